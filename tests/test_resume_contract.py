"""The shared resume contract (tests/resume_contract.py) on every order, for images and for tokens."""

from __future__ import annotations

import numpy as np
import pytest
from resume_contract import check_resume, file_expectation

from pageset import (
    Int,
    Loader,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RGBImage,
    TokenWindows,
    ToTensor,
    write_dataset,
    write_tokens,
)


@pytest.fixture(scope="module")
def images(tmp_path_factory, imagenet_like):
    path = tmp_path_factory.mktemp("contract") / "img.pageset"
    write_dataset(path, imagenet_like, {"image": RGBImage(max_resolution=80), "label": Int()}, num_workers=0,
                  page_size=1 << 14, progress=False)
    return path


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 1000, size=int(rng.integers(1, 90))) for _ in range(400)]
    path = tmp_path_factory.mktemp("contract") / "tok.pageset"
    write_tokens(path, docs, eos_id=1000, num_workers=0, page_size=4096, progress=False)
    return path


@pytest.mark.parametrize("order", ["random", "quasi_random", "sequential"])
def test_image_resume_contract(images, order):
    def make(rank, world, batch, threads):
        return Loader(images, batch_size=batch, rank=rank, world_size=world, num_threads=threads, order=order,
                      seed=17, window_pages=2, drop_last=False,
                      pipelines={"image": [RandomResizedCrop(24), RandomHorizontalFlip(), Normalize(), ToTensor()]})

    check_resume(make, global_batch=8, world_sizes=[1, 2, 4], cuts=[0, 3, 6, 7, 13],
                 expected=file_expectation(images, order, 17, 2, False, 8))


@pytest.mark.parametrize("order", ["random", "quasi_random", "sequential"])
def test_token_resume_contract(tokens, order):
    def make(rank, world, batch, threads):
        return Loader(tokens, batch_size=batch, rank=rank, world_size=world, num_threads=threads, order=order,
                      seed=3, window_pages=3, drop_last=True,
                      pipelines={"tokens": [TokenWindows(64, document_outputs=True), ToTensor()]})

    check_resume(make, global_batch=12, world_sizes=[1, 3, 2, 4], cuts=[0, 5, 23, 46, 50],
                 expected=file_expectation(tokens, order, 3, 3, True, 12, seq_len=64))
