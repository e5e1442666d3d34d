"""Two source trees of pageset side by side: the Loader end to end, images and tokens, per CPU second.

    python -m benchmarks.before_after --before /path/to/old/src --after src [--rounds 3] [--json out.json]

For a refactoring that must not cost speed (issue 29: the read side as declared parts): each measurement is a
fresh process whose ``PYTHONPATH`` is one tree's ``src`` (both read the same files, written once here by the
``--after`` tree), rounds interleaved (before/after, then after/before, ...), one warm-up process per tree first
so that Numba's disk cache is filled. A measurement: a Loader's first batch (not timed), then whole epochs, their
samples over the process's CPU seconds (``time.process_time``: every thread) and over wall seconds. Images:
ImageNet-like JPEGs (the real photos in the scikit-image / scikit-learn wheels), RandomResizedCrop(224) + flip +
normalize, quasi_random, 2 threads. Tokens: GPT-2-sized random documents (uint16), ``TokenWindows(1024)``,
random order. Prints a markdown table of medians (min-max) and the after / before ratio of the medians; writes
JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KINDS = ("images", "tokens")


def child(kind: str, path: str, epochs: int) -> dict:
    """One measurement in this process (the tree on ``PYTHONPATH``): samples per CPU second and per wall second."""
    from pageset import Loader, Normalize, RandomHorizontalFlip, RandomResizedCrop, TokenWindows, ToTorchImage

    if kind == "images":
        kw = dict(batch_size=64, order="quasi_random", num_threads=2, seed=0,
                  pipelines={"image": [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(), ToTorchImage()],
                             "label": None})
    else:
        kw = dict(batch_size=32, order="random", num_threads=2, seed=0, pipelines={"tokens": [TokenWindows(1024)]})
    with Loader(path, **kw) as loader:
        next(iter(loader))  # kernels loaded, threads started, buffers touched
        loader.set_epoch(1)
        samples, c0, t0 = 0, time.process_time(), time.perf_counter()
        for e in range(epochs):
            loader.set_epoch(1 + e)
            for batch in loader:
                samples += len(batch["_index"])
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    return {"samples": samples, "cpu_s": cpu, "wall_s": wall, "per_cpu_s": samples / cpu, "per_s": samples / wall}


def build(tmp: Path, n_images: int, n_tokens: int) -> dict:
    import numpy as np

    from pageset import Int, RGBImage, write_dataset, write_tokens
    from pageset.sample_data import debian_photos, make_imagenet_like, wheel_photos

    folder = make_imagenet_like(tmp / "train", n_images, long_side=(400, 512), photos=wheel_photos() + debian_photos(),
                                quality=(90, 90))
    images = tmp / "images.pageset"
    write_dataset(images, folder, {"image": RGBImage(max_resolution=512, jpeg_quality=90), "label": Int()},
                  progress=False)
    rng = np.random.default_rng(0)
    docs, total = [], 0
    while total < n_tokens:
        n = int(rng.integers(50, 3000))
        docs.append(rng.integers(0, 50257, n))
        total += n
    tokens = tmp / "tokens.pageset"
    write_tokens(tokens, docs, eos_id=50256, num_workers=0, progress=False)
    return {"images": str(images), "tokens": str(tokens)}


def run_child(src: str, kind: str, path: str, epochs: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    out = subprocess.run([sys.executable, "-m", "benchmarks.before_after", "--child", kind, path, str(epochs)],
                         env=env, capture_output=True, text=True, check=False, timeout=1800,
                         cwd=Path(__file__).resolve().parents[1])
    if out.returncode:
        raise RuntimeError(f"{kind} with {src}: rc {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=3, metavar=("KIND", "PATH", "EPOCHS"), help=argparse.SUPPRESS)
    ap.add_argument("--before", help="the old tree's src folder")
    ap.add_argument("--after", default="src", help="the new tree's src folder (default: src)")
    ap.add_argument("--rounds", type=int, default=3, choices=range(1, 100), metavar="N")
    ap.add_argument("--images", type=int, default=320, help="ImageNet-like images to write (default 320)")
    ap.add_argument("--tokens", type=int, default=4_000_000, help="tokens to write (default 4M)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.child:
        kind, path, epochs = args.child
        print(json.dumps(child(kind, path, int(epochs))))
        return
    if not args.before:
        ap.error("--before SRC is required")
    trees = {"before": args.before, "after": args.after}
    epochs = {"images": 2, "tokens": 3}
    with tempfile.TemporaryDirectory() as tmp:
        env_src = os.path.abspath(args.after)
        sys.path.insert(0, env_src)
        paths = build(Path(tmp), args.images, args.tokens)
        for name, src in trees.items():  # warm-up: each tree's kernels compiled into its own disk cache
            for kind in KINDS:
                run_child(src, kind, paths[kind], 1)
        rows = {(name, kind): [] for name in trees for kind in KINDS}
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for kind in KINDS:
                for name in order:
                    rows[(name, kind)].append(run_child(trees[name], kind, paths[kind], epochs[kind]))
    print(f"| loader | tree | samples per CPU second | samples per second | after / before (CPU) |")
    print("|---|---|---|---|---|")
    result = {"trees": trees, "rounds": args.rounds, "rows": {}}
    for kind in KINDS:
        med = {}
        for name in trees:
            runs = rows[(name, kind)]
            cpu, wall = [x["per_cpu_s"] for x in runs], [x["per_s"] for x in runs]
            med[name] = statistics.median(cpu)
            result["rows"][f"{kind}/{name}"] = runs
            ratio = f"{med['after'] / med['before']:.3f}" if name == "after" else ""
            print(f"| {kind} | {name} | {_fmt(cpu)} | {_fmt(wall)} | {ratio} |")
        result[f"{kind}_ratio"] = med["after"] / med["before"]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
