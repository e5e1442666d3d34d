"""Cold and warm start: time to the first batch of a fresh process, images and tokens, empty and filled kernel cache.

    python -m benchmarks.cold_start [--runs 3] [--json out/bench_cold_start.json] [--no-warmup]

Every row is a fresh interpreter (``subprocess``) with its own temporary ``NUMBA_CACHE_DIR`` (numba's variable,
set in the child's environment only): "cold" is the first process on an empty cache (what a fresh install, a new
container or a CI job meets), "warm" a second process on the cache the cold one filled. Each process imports
torch, then pageset, builds a Loader (images: RandomResizedCrop(224) + flip + Normalize -> float32, batch 32, 2
threads, on an ImageNet-like file cut from the real photos on this machine; tokens: TokenWindows(1024), batch
32, on a 2M-token uint16 file) and takes one batch. Columns: seconds from process start (the parent's clock
before the spawn: interpreter start-up included), seconds after ``import torch`` returned, CPU seconds of the
process (user + system, all threads: read these on a loaded machine; whole process and after import torch),
and the pageset kernels numba
compiled. "numba alone" is the floor under every warm number: ``import numba`` plus the initialisation of its
CPU target (what the first cache load triggers), after ``import torch``. ``pageset warmup`` (one run, empty
cache) is the command a Dockerfile runs to skip the cold rows: wall and CPU seconds of it and its workers.
Medians (min-max) of ``--runs`` runs, images and tokens interleaved. Targets (issue 20): cold <= 5 s from
process start, warm <= 0.5 s after import torch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import report

ROOT = Path(__file__).resolve().parents[1]
COLD_GOAL_S, WARM_GOAL_S = 5.0, 0.5

CHILD = r"""
import json, resource, sys, time
kind, path, spawned = sys.argv[1], sys.argv[2], float(sys.argv[3])
import torch
t_torch = time.time()
ru0 = resource.getrusage(resource.RUSAGE_SELF)
from numba.core import event  # imports numba: inside the "after import torch" interval, as pageset would
compiled = []
class Listener(event.Listener):
    def on_start(self, ev):
        if ev.data["dispatcher"].py_func.__module__.startswith("pageset."):
            compiled.append(1)
    def on_end(self, ev):
        pass
event.register("numba:compile", Listener())
if kind == "numba":
    from numba.core.registry import cpu_target
    cpu_target.target_context.refresh()
else:
    from pageset import Loader, Normalize, RandomHorizontalFlip, RandomResizedCrop, ToTensor, TokenWindows
    if kind == "images":
        pipes = {"image": [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(), ToTensor()], "label": None}
    else:
        pipes = {"tokens": [TokenWindows(seq_len=1024)]}
    loader = Loader(path, batch_size=32, num_threads=2, pipelines=pipes)
    batch = next(iter(loader))
t_first = time.time()
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"since_start_s": t_first - spawned, "after_torch_s": t_first - t_torch,
                  "import_torch_s": t_torch - spawned, "cpu_s": ru.ru_utime + ru.ru_stime,
                  "cpu_after_torch_s": ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime,
                  "kernels_compiled": len(compiled)}))
sys.stdout.flush()
"""


def child(kind: str, path: str, cache: str) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": str(ROOT / "src") + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    spawned = time.time()
    r = subprocess.run([sys.executable, "-c", CHILD, kind, path, repr(spawned)], env=env, capture_output=True,
                       text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{kind} child failed (rc {r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def warmup_run(cache: str) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": str(ROOT / "src") + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pageset.cli", "warmup", "--quiet"], env=env, check=True,
                   capture_output=True, timeout=3600)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu}


def build_data(tmp: Path) -> dict:
    import numpy as np

    from pageset import Int, RGBImage, write_dataset, write_tokens
    from pageset.sample_data import debian_photos, make_imagenet_like, wheel_photos

    photos = wheel_photos() + debian_photos()
    folder = make_imagenet_like(tmp / "train", 128, long_side=(400, 512), photos=photos, quality=(90, 90))
    images = tmp / "images.pageset"
    write_dataset(images, folder, {"image": RGBImage(max_resolution=512, jpeg_quality=90), "label": Int()},
                  progress=False)
    tokens = tmp / "tokens.pageset"
    ids = np.random.default_rng(0).integers(0, 50_000, 2_000_000).astype(np.int64)
    write_tokens(str(tokens), [ids], None, eos_id=50_256, num_workers=0, progress=False)
    return {"images": str(images), "tokens": str(tokens), "photos": len(photos)}


COLS = ("since_start_s", "after_torch_s", "cpu_s", "cpu_after_torch_s", "kernels_compiled")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each row (median, min-max); >= 1")
    ap.add_argument("--json", default="out/bench_cold_start.json")
    ap.add_argument("--no-warmup", action="store_true", help="skip the `pageset warmup` row (~40 CPU s)")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")
    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="cold-start-") as tmp:
        data = build_data(Path(tmp))
        for _ in range(args.runs):
            for kind in ("images", "tokens"):
                cache = tempfile.mkdtemp(prefix="numba-", dir=tmp)
                rows.setdefault(f"{kind} cold", []).append(child(kind, data[kind], cache))
                rows.setdefault(f"{kind} warm", []).append(child(kind, data[kind], cache))
                shutil.rmtree(cache)
            rows.setdefault("numba alone", []).append(child("numba", "-", tempfile.mkdtemp(dir=tmp)))
        warm_cmd = None if args.no_warmup else warmup_run(tempfile.mkdtemp(prefix="numba-", dir=tmp))
    table = {name: {c: report.stats([r[c] for r in runs]) for c in COLS} for name, runs in rows.items()}
    load = os.getloadavg()
    print(f"\nFirst batch of a fresh process, {os.cpu_count()} cores, load average {load[0]:.2f} at the end; "
          f"median (min-max) of {args.runs} runs\n")
    lines = report.md_table(
        ["pipeline", "kernel cache", "first batch s from process start", "s after import torch",
         "CPU s (process)", "CPU s after import torch", "kernels compiled"],
        [[n.split()[0] if n != "numba alone" else "numba alone (import + CPU target init)",
          n.split()[1] if n != "numba alone" else "-",
          report.fmt_stats(s["since_start_s"], "{:.2f}") if n != "numba alone" else "-",
          report.fmt_stats(s["after_torch_s"], "{:.2f}"), report.fmt_stats(s["cpu_s"], "{:.1f}"),
          report.fmt_stats(s["cpu_after_torch_s"], "{:.2f}"),
          report.fmt_stats(s["kernels_compiled"])] for n, s in table.items()])
    print("\n".join(lines))
    if warm_cmd:
        print("\n" + "\n".join(report.md_table(
            ["command (empty cache, 1 run)", "wall s", "CPU s (it and its worker processes)"],
            [["`pageset warmup`", f"{warm_cmd['wall_s']:.1f}", f"{warm_cmd['cpu_s']:.1f}"]])))
    med = {n: {c: s[c]["median"] for c in COLS} for n, s in table.items()}
    cpu_note = (f"CPU {med['images cold']['cpu_s']:.1f} s (images) / {med['tokens cold']['cpu_s']:.1f} s (tokens), "
                f"load average {load[0]:.2f} on {os.cpu_count()} cores")
    floor = med["numba alone"]["after_torch_s"]
    targets = [
        report.target("cold start: images, first batch from process start", med["images cold"]["since_start_s"],
                      COLD_GOAL_S, " s", f"empty NUMBA_CACHE_DIR; {cpu_note}; the kernels compile in the first "
                      "batch (`pageset warmup` moves this to install time)", higher_is_better=False),
        report.target("cold start: tokens, first batch from process start", med["tokens cold"]["since_start_s"],
                      COLD_GOAL_S, " s", f"empty NUMBA_CACHE_DIR; {cpu_note}", higher_is_better=False),
        report.target("warm start: images, first batch after import torch", med["images warm"]["after_torch_s"],
                      WARM_GOAL_S, " s", f"numba alone (import + CPU target init) takes {floor:.2f} s of it",
                      higher_is_better=False),
        report.target("warm start: tokens, first batch after import torch", med["tokens warm"]["after_torch_s"],
                      WARM_GOAL_S, " s", f"numba alone (import + CPU target init) takes {floor:.2f} s of it",
                      higher_is_better=False),
    ]
    result = {"benchmark": "cold_start", "settings": vars(args),
              "data": {"images": f"128 JPEGs, side 400-512, q90, from {data['photos']} photos",
                       "tokens": "2,000,000 uint16 tokens"},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_end": load},
              "rows": rows, "table": table, "warmup_command": warm_cmd, "targets": targets}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
