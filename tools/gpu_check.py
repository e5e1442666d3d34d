"""GPU path check for a session that has a CUDA machine (and a CPU dry run that exercises everything else).

    .venv/bin/python tools/gpu_check.py [--dry-run] [--images 1000] [--json out/gpu_check.json]

Checks, on real photos (ImageNet-like crops, max side 512, JPEG q90):
1. pinned slots: every batch buffer of a ``ToDevice("cuda")`` Loader is page-locked host memory;
2. no buffer overwritten in flight: the consumer holds each GPU batch for several steps while a synthetic GPU
   step runs, and every delivered batch is compared with the hash of the same batch loaded on the CPU;
3. copy/compute overlap: time of N synthetic steps on preloaded GPU batches vs the same steps fed by the
   Loader (overlap efficiency = preloaded / fed; 1.0 means the loader hid completely);
4. throughput: images/s into GPU memory with all cores, and time to first batch in a fresh process.
Prints a table and writes JSON; finishes in well under 5 minutes on a 16-core machine.
``--dry-run`` uses ``ToDevice("cpu")`` and a CPU step: everything but CUDA itself.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pageset import (
    Int,
    Loader,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RGBImage,
    ToDevice,
    ToTensor,
    write_dataset,
)
from pageset.sample_data import debian_photos, make_imagenet_like, wheel_photos

PIPE = [RandomResizedCrop(224), RandomHorizontalFlip()]  # uint8 NHWC: normalize on the device


def _hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()


def synthetic_step(x: torch.Tensor, weight: torch.Tensor, iters: int) -> torch.Tensor:
    """A fixed-cost stand-in for a training step: normalise the uint8 batch, then matmuls on the device."""
    h = x.float().mean(dim=(1, 2))  # [B, 3]
    h = h @ weight[:3]  # [B, D]
    for _ in range(iters):
        h = torch.tanh(h @ weight)
    return h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="no CUDA: ToDevice('cpu') and a CPU step")
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--hold", type=int, default=4, help="batches the consumer keeps alive")
    ap.add_argument("--json", default="out/gpu_check.json")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("CUDA is not available: run with --dry-run, or on the GPU machine")
    device = "cpu" if args.dry_run else "cuda"
    threads = os.cpu_count() or 1
    results: dict = {"device": device, "threads": threads, "torch": torch.__version__}
    if device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        folder = make_imagenet_like(Path(tmp) / "train", args.images, long_side=(400, 512),
                                    photos=wheel_photos() + debian_photos(), quality=(90, 90))
        path = Path(tmp) / "train.pageset"
        write_dataset(path, folder, {"image": RGBImage(max_resolution=512), "label": Int()}, progress=False)
        results["prepare_s"] = time.perf_counter() - t0
        kw = dict(batch_size=args.batch_size, seed=5, order="quasi_random", num_threads=threads)

        # control hashes on the CPU
        with Loader(path, pipelines={"image": PIPE + [ToTensor()], "label": None}, **kw) as cpu:
            control = [_hash(b["image"]) for b in cpu]

        dev_pipe = {"image": PIPE + [ToDevice(device)], "label": [ToDevice(device)]}
        with Loader(path, pipelines=dev_pipe, **kw) as loader:
            pinned = [torch.from_numpy(a).is_pinned() for slot in loader._slots for arrays in slot.arrays
                      for a in arrays.values()]
            results["pinned_slots"] = f"{sum(pinned)}/{len(pinned)}"
            weight = torch.randn(512, 512, device=device) / 16
            held: collections.deque = collections.deque()
            mismatches = 0
            for k, b in enumerate(loader):
                synthetic_step(b["image"], weight, 20)
                held.append((k, b["image"]))
                if len(held) > args.hold:  # compare after the batch was held while later copies were issued
                    j, old = held.popleft()
                    mismatches += _hash(old) != control[j]
            for j, old in held:
                mismatches += _hash(old) != control[j]
            results["batches_checked"] = len(control)
            results["overwritten_in_flight"] = mismatches

            # overlap: the same steps on preloaded device batches vs fed by the loader
            loader.set_epoch(1)
            pre = [b["image"].clone() for b in loader]
            iters = 200 if device == "cuda" else 5
            _sync(device)
            t0 = time.perf_counter()
            for x in pre:
                synthetic_step(x, weight, iters)
            _sync(device)
            t_pre = time.perf_counter() - t0
            loader.set_epoch(2)
            t0 = time.perf_counter()
            for b in loader:
                synthetic_step(b["image"], weight, iters)
            _sync(device)
            t_fed = time.perf_counter() - t0
            results["step_ms"] = 1000 * t_pre / len(pre)
            results["overlap_efficiency"] = t_pre / t_fed

            loader.set_epoch(3)
            t0 = time.perf_counter()
            n = 0
            for b in loader:
                n += b["image"].shape[0]
            _sync(device)
            results["images_per_s"] = n / (time.perf_counter() - t0)
        results["first_batch_s"] = _first_batch(path, device, threads, args.batch_size)
    print(f"\npageset GPU check ({'dry run, ' if args.dry_run else ''}{results.get('gpu', 'CPU')}, {threads} threads)\n")
    print("| check | result |")
    print("|---|---|")
    print(f"| pinned batch buffers | {results['pinned_slots']} |")
    print(f"| batches overwritten in flight (of {results['batches_checked']}, {args.hold} held) | "
          f"{results['overwritten_in_flight']} |")
    print(f"| synthetic step | {results['step_ms']:.1f} ms |")
    print(f"| copy/compute overlap efficiency | {results['overlap_efficiency']:.2f} |")
    print(f"| images/s into {device} memory (RRC 224, uint8) | {results['images_per_s']:.0f} |")
    print(f"| time to first batch, new process | {results['first_batch_s']:.2f} s |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"JSON: {args.json}")
    if results["overwritten_in_flight"]:
        sys.exit(1)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


FIRST = """
import sys, time
t0 = time.perf_counter()
from pageset import Loader, RandomResizedCrop, ToDevice
with Loader(sys.argv[1], batch_size=int(sys.argv[4]), num_threads=int(sys.argv[3]),
            pipelines={"image": [RandomResizedCrop(224), ToDevice(sys.argv[2])], "label": None}) as loader:
    next(iter(loader))
print(time.perf_counter() - t0)
"""


def _first_batch(path, device, threads, batch_size) -> float:
    r = subprocess.run([sys.executable, "-c", FIRST, str(path), device, str(threads), str(batch_size)], capture_output=True,
                       text=True, check=True)
    return float(r.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
