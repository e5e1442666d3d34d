"""Chaos resume: seeded random trials (kill step, new world size, thread count, order, data kind) against an
uninterrupted control. Each trial interrupts a multi-rank run at a random global step (mid-epoch, at an epoch
end or in a later epoch), saves the state, and resumes on another world size dividing the global batch with
another thread count; ids and per-sample output digests must equal the control from the cut on."""

from __future__ import annotations

import random

import numpy as np
import pytest
from resume_contract import global_stream, run_epochs

from pageset import (
    Int,
    Loader,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RGBImage,
    TokenWindows,
    write_dataset,
    write_tokens,
)

TRIALS = 120
EPOCHS = 2


@pytest.fixture(scope="module")
def files(tmp_path_factory, imagenet_like):
    root = tmp_path_factory.mktemp("chaos")
    img = root / "img.pageset"
    write_dataset(img, imagenet_like, {"image": RGBImage(max_resolution=64), "label": Int()}, num_workers=0,
                  page_size=1 << 13, progress=False)
    rng = np.random.default_rng(8)
    tok = root / "tok.pageset"
    write_tokens(tok, [rng.integers(0, 500, size=int(rng.integers(1, 60))) for _ in range(200)], eos_id=500,
                 num_workers=0, page_size=4096, progress=False)
    return {"images": img, "tokens": tok}


def _maker(files, kind, order, drop_last):
    def make(rank, world, batch, threads):
        if kind == "images":
            pipes = {"image": [RandomResizedCrop(16), RandomHorizontalFlip()], "label": None}
        else:
            pipes = {"tokens": [TokenWindows(32, document_outputs=True)]}
        return Loader(files[kind], batch_size=batch, rank=rank, world_size=world, num_threads=threads,
                      order=order, seed=99, window_pages=2, drop_last=drop_last, batches_ahead=3, pipelines=pipes)

    return make


@pytest.mark.slow
def test_chaos_resume(files):
    rnd = random.Random(20261129)
    controls: dict = {}
    outcomes = {"mid_epoch": 0, "epoch_end": 0, "second_epoch": 0}
    for trial in range(TRIALS):
        kind = rnd.choice(["images", "tokens"])
        order = rnd.choice(["random", "quasi_random", "sequential"])
        drop_last = rnd.random() < 0.5
        G = rnd.choice([4, 6, 8, 12])
        divisors = [w for w in (1, 2, 3, 4, 6) if G % w == 0]
        w1, w2 = rnd.choice(divisors), rnd.choice(divisors)
        t1, t2 = rnd.choice([1, 2, 3]), rnd.choice([1, 2, 3])
        make = _maker(files, kind, order, drop_last)
        key = (kind, order, drop_last, G)
        if key not in controls:
            controls[key] = run_epochs(make, 1, G, 2, EPOCHS)
        control = controls[key]
        total = len(control) // G
        steps = total // EPOCHS
        cut = rnd.choice([rnd.randrange(0, total + 1), steps, rnd.randrange(steps, total + 1)])
        outcomes["epoch_end" if cut % steps == 0 else ("mid_epoch" if cut < steps else "second_epoch")] += 1
        loaders = [make(r, w1, G // w1, t1) for r in range(w1)]
        done, remaining = [], cut
        while remaining:
            k = min(remaining, loaders[0].steps_remaining)
            done += global_stream(loaders, k)
            remaining -= k
        state = loaders[0].state_dict()
        for ld in loaders:
            ld.close()  # the "kill": in-flight prefetch is dropped, only the state survives
        assert done == control[: cut * G], f"trial {trial}: run before the cut diverged"
        resumed = [make(r, w2, G // w2, t2) for r in range(w2)]
        for ld in resumed:
            ld.load_state_dict(state)
        rest, left = [], total - cut
        while left:
            k = min(left, resumed[0].steps_remaining)
            rest += global_stream(resumed, k)
            left -= k
        for ld in resumed:
            ld.close()
        assert rest == control[cut * G :], f"trial {trial}: {key}, W {w1}->{w2}, threads {t1}->{t2}, cut {cut}"
    print(f"chaos: {TRIALS} trials, {len(controls)} controls, cuts {outcomes}")
