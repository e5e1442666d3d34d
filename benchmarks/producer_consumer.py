"""Does the training loop wait on data? A real CPU model fed by pageset, versus the same loop on preloaded batches.

    .venv/bin/python -m benchmarks.producer_consumer [--images 1000] [--steps 60] [--loader-threads 1]
        [--model-threads 1] [--target-step-ms 10 25 50 100] [--repeats 3] [--json out/bench/producer_consumer.json]

Data: an ImageNet-like folder from the real photos (max side 256, JPEG q90) converted to pageset; batches of 64
RandomResizedCrop(64) + flip + normalize float32 [B, 3, 64, 64] (NCHW tensors); labels are the source photos.
Consumer: a small ResNet (stem conv 3->32 /2, two residual blocks at 32 channels, conv 32->64 /2, one residual
block, global average pool, linear), one SGD step (forward + backward + update) per batch. The script sets
``torch.set_num_threads(--model-threads)`` for itself; pageset never changes torch's threads.

Measured:
- C: step time with the batches already in memory (``list(loader)`` first, then cycling over that list);
- the same loop fed by the Loader: wall time per step, and the time spent inside ``next()`` (waiting on data);
  wait fraction = waiting / total;
- P1: the loader alone on one thread: CPU seconds per batch ``t_cpu = B / (images/s at 1 thread)``;
- the recommendation: ``num_threads >= ceil(t_cpu / t_step)`` for each target step time (seed 002's
  workers >= t_cpu / t_gpu arithmetic), with the measured C as one of the targets. On this machine the model
  and the loader share the same cores, so the loader-fed loop also pays for the cores the loader takes; on a
  GPU box the step runs on the accelerator and the arithmetic is the whole story.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from pageset import (
    Int,
    Loader,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RGBImage,
    ToTensor,
    ToTorchImage,
    write_dataset,
)
from pageset.sample_data import debian_photos, make_imagenet_like, wheel_photos

B = 64


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(x + self.b2(self.c2(y)))


def small_resnet(n_classes):
    return nn.Sequential(nn.Conv2d(3, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         Block(32), Block(32),
                         nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         Block(64), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, n_classes))


def make_loader(path, threads):
    pipe = {"image": [RandomResizedCrop(64), RandomHorizontalFlip(), Normalize(), ToTorchImage(channels_last=False),
                      ToTensor()]}  # "label" left out: its default decoder, int64[B] tensor
    return Loader(path, batch_size=B, pipelines=pipe, order="quasi_random", seed=0, num_threads=threads)


def batches_forever(loader):
    while True:
        yield from loader


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--loader-threads", type=int, default=1)
    ap.add_argument("--model-threads", type=int, default=1)
    ap.add_argument("--target-step-ms", type=float, nargs="+", default=[10, 25, 50, 100])
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every measurement (median, min-max)")
    ap.add_argument("--json", default="out/bench/producer_consumer.json")
    args = ap.parse_args()
    torch.set_num_threads(args.model_threads)  # this script's choice for its model
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_imagenet_like(Path(tmp) / "train", args.images, long_side=(204, 256),
                                    photos=wheel_photos() + debian_photos(), quality=(90, 90))
        path = Path(tmp) / "train.pageset"
        write_dataset(path, folder, {"image": RGBImage(max_resolution=256, jpeg_quality=90), "label": Int()},
                      progress=False)
        n_classes = sum(1 for d in folder.iterdir() if d.is_dir())
        model = small_resnet(n_classes).to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loss_fn = nn.CrossEntropyLoss()

        def step(batch):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(batch["image"]), batch["label"])
            loss.backward()
            opt.step()

        # --repeats rounds, each: P1 (the loader alone, one thread -> CPU seconds per batch; and at
        # --loader-threads), C (preloaded batches), the loader-fed loop. Tables give the median (min-max).
        runs = []
        for _ in range(args.repeats):
            rates = {}
            for threads in sorted({1, args.loader_threads}):
                with make_loader(path, threads) as ld:
                    next(iter(ld))  # compile / warm
                    ld.set_epoch(1)
                    t, n = time.perf_counter(), 0
                    for b in ld:
                        n += len(b["_index"])
                    rates[threads] = n / (time.perf_counter() - t)

            # C: preloaded batches (list(loader) keeps each batch: safe, see the Loader docstring)
            with make_loader(path, args.loader_threads) as ld:
                pre = list(ld)
            for b in pre[:3]:
                step(b)  # warm-up (allocator, oneDNN primitives)
            t = time.perf_counter()
            for i in range(args.steps):
                step(pre[i % len(pre)])
            t_step = (time.perf_counter() - t) / args.steps
            del pre

            # the loader-fed loop
            with make_loader(path, args.loader_threads) as ld:
                it = batches_forever(ld)
                for _ in range(3):
                    step(next(it))
                wait = 0.0
                t = time.perf_counter()
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    b = next(it)
                    wait += time.perf_counter() - t0
                    step(b)
                t_fed = (time.perf_counter() - t) / args.steps
                it.close()
            runs.append({"loader_images_per_s": {str(k): v for k, v in rates.items()}, "step_s_preloaded": t_step,
                         "step_s_loader_fed": t_fed, "wait_s_per_step": wait / args.steps,
                         "wait_fraction": wait / (t_fed * args.steps)})

    def med(key, sub=None):
        vals = [r[key][sub] if sub else r[key] for r in runs]
        return float(np.median(vals)), min(vals), max(vals)

    def mm(v, scale=1.0, fmt="{:.1f}"):
        return f"{fmt.format(v[0] * scale)} ({fmt.format(v[1] * scale)}-{fmt.format(v[2] * scale)})"

    r1, t_step_m, t_fed_m = med("loader_images_per_s", "1"), med("step_s_preloaded"), med("step_s_loader_fed")
    t_cpu, t_step = B / r1[0], t_step_m[0]
    wait_m, frac_m = med("wait_s_per_step"), med("wait_fraction")
    targets = sorted(set(args.target_step_ms) | {round(1000 * t_step, 1)})
    rec = {f"{ms:g}": max(1, math.ceil(t_cpu / (ms / 1000))) for ms in targets}
    res = {"benchmark": "producer_consumer", "settings": vars(args), "cpus": os.cpu_count(), "runs": runs,
           "loader_images_per_s": {k: med("loader_images_per_s", k)[0] for k in runs[0]["loader_images_per_s"]},
           "t_cpu_per_batch_ms": 1000 * t_cpu, "step_ms_preloaded": 1000 * t_step,
           "step_ms_loader_fed": 1000 * t_fed_m[0], "wait_ms_per_step": 1000 * wait_m[0],
           "wait_fraction": frac_m[0], "slowdown_vs_preloaded": t_fed_m[0] / t_step, "recommended_num_threads": rec,
           "targets": []}
    print(f"\nsmall ResNet on 64x64 crops, batch {B}, model threads {args.model_threads}, loader threads "
          f"{args.loader_threads}, {os.cpu_count()} cores; median (min-max) of {args.repeats} rounds\n")
    print("| measurement | value |\n|---|---|")
    print(f"| loader alone, 1 thread | {mm(r1, fmt='{:.0f}')} images/s = {1000 * t_cpu:.1f} CPU ms per batch |")
    if args.loader_threads != 1:
        print(f"| loader alone, {args.loader_threads} threads | "
              f"{mm(med('loader_images_per_s', str(args.loader_threads)), fmt='{:.0f}')} images/s |")
    print(f"| step, batches preloaded (C) | {mm(t_step_m, 1000)} ms |")
    print(f"| step, fed by the Loader | {mm(t_fed_m, 1000)} ms ({t_fed_m[0] / t_step:.2f}x) |")
    print(f"| waiting in next() | {mm(wait_m, 1000, '{:.2f}')} ms per step = {mm(frac_m, 100)}% |")
    print("\n| target step ms | recommended num_threads = ceil(t_cpu / t_step) |\n|---|---|")
    for ms, n in rec.items():
        print(f"| {ms}{' (this model, measured)' if float(ms) == round(1000 * t_step, 1) else ''} | {n} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
