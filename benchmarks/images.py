"""Image loading throughput: pageset vs a PyTorch DataLoader + Pillow, same files, same transforms, same cores.

    .venv/bin/python -m benchmarks.images [--images 1000] [--batch-size 64] [--json out/bench_images.json]

Data: an ImageNet-like set derived from the real photos on this machine (max side 512, JPEG q90).
Pipeline: RandomResizedCrop(224) + RandomHorizontalFlip + Normalize -> float32 NCHW tensors, for both.
Rows: pageset at 1 and all threads (random and quasi_random order, os and process page cache); the baseline
DataLoader with 0 (in-process), 1 and all workers; decode-only rates of the same bytes (Pillow, and
libjpeg-turbo through pageset's kernel); time to first batch in a fresh process with a cold and a warm Numba
kernel cache. Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.peers.measure import pillow_transform
from pageset import (
    Int,
    Loader,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RGBImage,
    ToTensor,
    ToTorchImage,
    open_dataset,
    write_dataset,
)
from pageset.sample_data import debian_photos, make_imagenet_like, wheel_photos


class PillowFolder(torch.utils.data.Dataset):
    """torchvision's ImageFolder + RandomResizedCrop + RandomHorizontalFlip + ToTensor + Normalize, in Pillow
    (torchvision cannot be installed beside the CPU torch here): ``peers.measure.pillow_transform``, the same
    transform the streaming peers run, with torchvision's box algorithm."""

    def __init__(self, files, size=224):
        self.files, self.size = files, size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from PIL import Image

        path, label = self.files[i]
        with Image.open(path) as img:
            return pillow_transform(img, self.size), label


def _time_iter(make, n_images, warmup=1):
    it = make()
    t0 = time.perf_counter()
    first = None
    count = 0
    for b in it:
        if first is None:
            first = time.perf_counter() - t0
        count += len(b[1] if isinstance(b, (list, tuple)) else b["_index"])
    dt = time.perf_counter() - t0
    return {"images_per_s": count / dt, "first_batch_s": first, "images": count}


def bench_pageset(path, n, bs, threads, order, cache):
    pipe = {"image": [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(), ToTorchImage(), ToTensor()],
            "label": None}
    with Loader(path, batch_size=bs, pipelines=pipe, order=order, num_threads=threads, page_cache=cache,
                seed=0) as loader:
        next(iter(loader))  # compile / warm; measure a full later epoch
        loader.set_epoch(1)
        return _time_iter(lambda: loader, n)


def bench_baseline(files, bs, workers):
    ds = PillowFolder(files)
    dl = torch.utils.data.DataLoader(ds, batch_size=bs, shuffle=True, num_workers=workers, drop_last=True,
                                     persistent_workers=False)
    return _time_iter(lambda: dl, len(files))


def decode_only(path):
    from PIL import Image

    from pageset.ops.jpeg import JpegDecoder

    with open_dataset(path) as ds:
        blobs = [ds[i]["image"].data for i in range(len(ds))]
    t0 = time.perf_counter()
    for b in blobs:
        with Image.open(io.BytesIO(b)) as img:
            img.convert("RGB")
    pil = len(blobs) / (time.perf_counter() - t0)
    with JpegDecoder() as dec:
        dec.decode(blobs[0])
        t0 = time.perf_counter()
        for b in blobs:
            dec.decode(b)
        turbo = len(blobs) / (time.perf_counter() - t0)
    return pil, turbo


FIRST_BATCH = """
import time, sys
t0 = time.perf_counter()
from pageset import Loader, RandomResizedCrop, RandomHorizontalFlip, Normalize, ToTensor
loader = Loader(sys.argv[1], batch_size=64, num_threads=2, pipelines={"image": [RandomResizedCrop(224),
    RandomHorizontalFlip(), Normalize(), ToTensor()], "label": None})
next(iter(loader))
print(time.perf_counter() - t0)
"""


def first_batch_times(path):
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)  # this subprocess only: a fresh, empty kernel cache
        out = []
        for _ in range(2):
            r = subprocess.run([sys.executable, "-c", FIRST_BATCH, str(path)], env=env, capture_output=True,
                               text=True, check=True)
            out.append(float(r.stdout.strip().splitlines()[-1]))
    return out  # [cold, warm]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--json", default="out/bench_images.json")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_imagenet_like(Path(tmp) / "train", args.images, long_side=(400, 512),
                                    photos=wheel_photos() + debian_photos(), quality=(90, 90))
        files = sorted((str(p), 0) for p in folder.rglob("*.jpg"))
        path = Path(tmp) / "train.pageset"
        write_dataset(path, folder, {"image": RGBImage(max_resolution=512, jpeg_quality=90), "label": Int()},
                      progress=False)
        for threads in sorted({1, cores}):
            for order, cache in (("random", "os"), ("quasi_random", "os"), ("quasi_random", "process")):
                r = bench_pageset(path, args.images, args.batch_size, threads, order, cache)
                rows.append({"loader": f"pageset {order}, page_cache={cache}", "workers": threads, **r})
        for workers in sorted({0, 1, cores}):
            r = bench_baseline(files, args.batch_size, workers)
            rows.append({"loader": "DataLoader + Pillow (JPEG files)", "workers": workers, **r})
        pil, turbo = decode_only(path)
        cold, warm = first_batch_times(path)
    base = {r["workers"]: r["images_per_s"] for r in rows if r["loader"].startswith("DataLoader")}
    print(f"\nRandomResizedCrop(224) + flip + normalize, float32, batch {args.batch_size}, {args.images} "
          f"ImageNet-like JPEGs (max side 512, q90), {cores} cores\n")
    print("| loader | threads/workers | images/s | vs DataLoader (same workers) | first batch s |")
    print("|---|---|---|---|---|")
    for r in rows:
        ref = base.get(r["workers"]) or base.get(max(r["workers"], 1))
        print(f"| {r['loader']} | {r['workers']} | {r['images_per_s']:.0f} | {r['images_per_s'] / ref:.2f}x | "
              f"{r['first_batch_s']:.3f} |")
    print(f"\ndecode only, one core: Pillow {pil:.0f} images/s, libjpeg-turbo via pageset kernel {turbo:.0f} images/s")
    print(f"time to first batch in a new process: cold kernel cache {cold:.1f} s, warm {warm:.1f} s")
    result = {"benchmark": "images", "settings": vars(args), "machine": {"cpus": cores,
              "platform": platform.platform(), "torch": torch.__version__}, "results": rows,
              "decode_only_per_core": {"pillow": pil, "pageset_turbo": turbo},
              "first_batch_s": {"cold_cache": cold, "warm_cache": warm}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
