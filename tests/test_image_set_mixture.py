"""Augmentation through a many-file image set in a Mixture: every sample's crop and flip against Pillow.

A Mixture's rows of a set are filled by the set (``load/set_source.py`` ``ManyFileSource.fill_rows``): flat
(``page_cache="os"``, no page checks: one call over all members) or member by member (``page_cache="process"``,
``verify_pages=True``: each member's own source gets its rows, their ids and their augmentation keys). Each
sample's output must be the one computed here without the Loader:

- which record: ``tests/reference/order.py``'s mixture model over the set's records per page (the reference
  manifest reader, ``tests/reference/manifest.py``) and the other file's (the reference reader);
- its augmentation key: ``key(seed, epoch, 4, position in the epoch)`` (formats/order.md section 5,
  formats/mixture.md section 2.4), from the reference model;
- its pixels: the stored JPEG decoded by Pillow, cropped to torchvision's RandomResizedCrop box for that key
  (``random_resized_crop_box_py``, the pure-Python twin tests/test_image_ops.py checks), resized by Pillow's
  bilinear filter and flipped when ``uniform(key, 40) < 0.5`` (``uniform_py``): bit-exact, since every crop of
  these <= 80 px images is decoded at DCT scale 1/1 for a 64 px output (checked per sample).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from reference import format as ref_format
from reference import manifest as ref_manifest
from reference import order as model

from pageset import Int, Loader, Mixture, RandomHorizontalFlip, RandomResizedCrop, RGBImage, write_dataset
from pageset.ops.crop import FLIP_COUNTER, random_resized_crop_box_py
from pageset.ops.jpeg import choose_scale
from pageset.order.keys import uniform_py

OUT = 64
FIELDS = {"image": RGBImage(max_resolution=80, jpeg_quality=90), "label": Int()}


@pytest.fixture(scope="module")
def sources(tmp_path_factory, imagenet_like):
    """The 48 photos as a set (7 members of 7, the last 6; 16 KiB pages) and as one file (8 KiB pages)."""
    d = tmp_path_factory.mktemp("imgsetmix")
    folder = d / "set"
    write_dataset(folder, imagenet_like, FIELDS, records_per_member=7, num_workers=0, page_size=1 << 14,
                  progress=False, lineage=False)
    single = d / "single.pageset"
    write_dataset(single, imagenet_like, FIELDS, num_workers=0, page_size=1 << 13, progress=False, lineage=False)
    ref_set = ref_manifest.read_set(folder)
    ref_one = ref_format.read_file(single)
    h = ref_one.header
    one_sizes = model.record_page_sizes([r["_offset"] for r in ref_one.records], h["data_offset"], h["page_size"],
                                        h["page_count"])
    assert len(ref_set.members) == 7
    return [folder, single], [ref_set.records, ref_one.records], [[s for p in ref_set.records_per_page for s in p],
                                                                  one_sizes]


def expected_image(rec: dict, key: int) -> np.ndarray:
    img = rec["image"]
    assert img["encoding"] == "jpeg"
    x, y, w, h = random_resized_crop_box_py(img["height"], img["width"], key, 0.08, 1.0, 3 / 4, 4 / 3)
    assert choose_scale(img["width"], img["height"], w, h, OUT, OUT) == (1, 1)
    pil = Image.open(io.BytesIO(img["data"])).convert("RGB")
    assert pil.size == (img["width"], img["height"])
    out = pil.crop((x, y, x + w, y + h)).resize((OUT, OUT), Image.BILINEAR)
    if uniform_py(key, FLIP_COUNTER) < 0.5:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(out)


READS = {"process_cache": ("process", False, False), "verify_pages": ("os", True, False), "flat": ("os", False, True)}


@pytest.mark.parametrize("read", list(READS))
def test_a_set_in_an_image_mixture_gives_each_sample_its_own_crop_and_flip(sources, read):
    """Two ranks, two epochs: each sample's source, record, label and pixels (crop + flip of its own key)."""
    paths, records, sizes = sources
    page_cache, verify, flat = READS[read]
    seed, W, B, order = 13, 2, 4, "quasi_random"
    mix = model.MixtureModel([0.7, 0.3], sizes, seed, order, 2, True, W * B, samples_per_epoch=40)
    pipe = {"image": [RandomResizedCrop(OUT), RandomHorizontalFlip()]}
    loaders = [Loader(Mixture(paths, [0.7, 0.3], samples_per_epoch=40), batch_size=B, rank=r, world_size=W,
                      order=order, seed=seed, window_pages=2, page_cache=page_cache, verify_pages=verify,
                      num_threads=2, pipelines=pipe, array_type="numpy") for r in range(W)]
    try:
        assert (loaders[0]._sources[0]._flat is not None) == flat
        flipped = 0
        for epoch in range(2):
            for step, batches in enumerate(zip(*loaders)):
                for rank, b in enumerate(batches):
                    src, ids = mix.batch(epoch, step, rank, W)
                    assert b["_source"].tolist() == src and b["_index"].tolist() == ids, (epoch, step, rank)
                    for j, (s, i) in enumerate(zip(src, ids)):
                        rec = records[s][i]
                        key = model.aug_key(seed, epoch, step * W * B + rank * B + j)
                        assert int(b["label"][j]) == rec["label"]
                        np.testing.assert_array_equal(b["image"][j], expected_image(rec, key),
                                                      err_msg=f"epoch {epoch} step {step} rank {rank} row {j}: "
                                                              f"source {s} record {i}")
                        flipped += uniform_py(key, FLIP_COUNTER) < 0.5
        assert 0 < flipped < 2 * 40  # both branches of the flip were checked
    finally:
        for ld in loaders:
            ld.close()
