"""Mixture overhead: a 3-source Mixture vs one file holding the same records, same pipeline, same threads.

    .venv/bin/python -m benchmarks.mixture [--images 300] [--tokens 2000000] [--threads 2] [--repeats 3]

Images: three files of ``--images`` ImageNet-like JPEGs each (real photos, long side 400-500) and one file
of all of them; RandomResizedCrop(224) + flip + Normalize, weights 0.5/0.3/0.2. Tokens: three token files and
one of their concatenation, TokenWindows(1024), weights 0.5/0.3/0.2. Rates are samples/s over whole epochs
(the best of ``--repeats`` epochs of each, alternated, after a warm-up epoch). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from pageset import (
    Int,
    Loader,
    Mixture,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RGBImage,
    TokenWindows,
    write_dataset,
    write_tokens,
)
from pageset.sample_data import make_imagenet_like


def _rates(make_a, make_b, repeats):
    """Best samples/s of each loader over ``repeats`` epochs, alternating a and b (the machine's load drifts)."""
    best = [0.0, 0.0]
    with make_a() as a, make_b() as b:
        for ld in (a, b):
            for _ in ld:  # warm-up epoch: kernels compiled, pages in the OS cache
                pass
        for _ in range(repeats):
            for k, ld in enumerate((a, b)):
                n, t0 = 0, time.perf_counter()
                for batch in ld:
                    n += len(batch["_index"])
                best[k] = max(best[k], n / (time.perf_counter() - t0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    weights = [0.5, 0.3, 0.2]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folders = [make_imagenet_like(tmp / f"img{k}", args.images, long_side=(400, 500), seed=k) for k in range(3)]
        fields = {"image": RGBImage(max_resolution=512), "label": Int()}
        parts = []
        for k, folder in enumerate(folders):
            parts.append(tmp / f"part{k}.pageset")
            write_dataset(parts[-1], folder, fields, num_workers=0, progress=False)
        records = [r for k in range(3) for r in _records(folders[k])]
        whole = tmp / "whole.pageset"
        write_dataset(whole, records, {"image": RGBImage(max_resolution=512), "label": Int()}, num_workers=0,
                      progress=False)
        pipe = {"image": [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize()]}
        kw = dict(batch_size=64, pipelines=pipe, num_threads=args.threads, order="random", seed=0)
        single, mixed = _rates(lambda: Loader(whole, **kw), lambda: Loader(Mixture(parts, weights), **kw),
                               args.repeats)
        rows.append(("images, RRC 224", single, mixed))

        rng = np.random.default_rng(0)
        tok_parts, all_docs = [], []
        for k in range(3):
            docs = [rng.integers(0, 50000, size=int(rng.integers(50, 2000))) for _ in range(args.tokens // 3 // 1000)]
            all_docs += docs
            tok_parts.append(tmp / f"tok{k}.pageset")
            write_tokens(tok_parts[-1], docs, eos_id=50000, num_workers=0, progress=False)
        tok_whole = tmp / "tok.pageset"
        write_tokens(tok_whole, all_docs, eos_id=50000, num_workers=0, progress=False)
        kw = dict(batch_size=32, pipelines={"tokens": [TokenWindows(1024)]}, num_threads=args.threads,
                  order="quasi_random", seed=0)
        single, mixed = _rates(lambda: Loader(tok_whole, **kw), lambda: Loader(Mixture(tok_parts, weights), **kw),
                               args.repeats)
        rows.append(("tokens, seq_len 1024", single, mixed))
    print("| data | one file (samples/s) | 3-source Mixture 0.5/0.3/0.2 (samples/s) | ratio |")
    print("|---|---|---|---|")
    for name, a, b in rows:
        print(f"| {name} | {a:,.0f} | {b:,.0f} | {b / a:.2f} |")


def _records(folder: Path):
    """(JPEG path, label) records of an ImageFolder, classes and files in sorted order."""
    classes = sorted(p for p in folder.iterdir() if p.is_dir())
    for label, cls in enumerate(classes):
        for f in sorted(cls.iterdir()):
            yield (str(f), label)


if __name__ == "__main__":
    main()
