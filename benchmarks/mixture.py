"""Mixture overhead: a 3-source Mixture vs one file holding the same records, same pipeline, same threads; and a
weight Schedule's cost vs constant weights.

    .venv/bin/python -m benchmarks.mixture [--images 300] [--tokens 8000000] [--threads 1 2] [--repeats 7]
                                           [--min-seconds 0.5] [--only images|tokens|schedule]
                                           [--json out/mixture.json]

Images: three files of ``--images`` ImageNet-like JPEGs each (real photos, long side 400-500) and one file
of all of them; RandomResizedCrop(224) + flip + Normalize, batch 64, order random, weights 0.5/0.3/0.2. Tokens:
three token files and one of their concatenation, TokenWindows(1024), batch 32, quasi_random, weights
0.5/0.3/0.2. A run is whole epochs for at least ``--min-seconds``; ``--repeats`` runs of each loader,
alternated (the machine's load drifts), after a warm-up epoch. The table gives the median samples/s, the
median (min-max) of the per-pair ratios and the median CPU time per sample (all threads: what the loader
costs, less sensitive to other load on a shared machine than the rate). Prints a markdown table; ``--json``
also writes the rows and the targets (issue 14: a 3-source mixture loads at >= 90% of the single-file rate, the
median of the per-pair ratios).

Schedule (issue 31): the same three token files, 1 thread, constant weights 0.5/0.3/0.2 vs a Schedule of 1,000
linear stages of random weights, one every 10,000 samples (the run crosses stages and ramp blocks), CPU
microseconds per sample, alternated runs (goal: within noise, here the median of per-pair CPU ratios <= 1.05);
the same with one stage every 100 samples (every batch crosses one: the cost of a piece, no goal); and the
resume time of a 1,000-stage schedule (step and linear, random float weights: quotas over 10**6) over 10**9
samples: a Loader at epoch ~10**9 / L writes its state (the stream's counts there: "plan"), a fresh Loader loads
it (checking every source's cursor against the schedule) and hands out its first batch (goal < 1 s).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from pageset import (
    Schedule,
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


def _rates(make_a, make_b, repeats, min_seconds):
    """Per run of each loader, alternating a and b (the machine's load drifts): whole epochs until
    ``min_seconds`` have passed, giving (samples/s, CPU microseconds per sample over all threads). Two lists of
    ``repeats`` pairs."""
    runs = ([], [])
    with make_a() as a, make_b() as b:
        for ld in (a, b):
            for _ in ld:  # warm-up epoch: kernels compiled, pages in the OS cache
                pass
        for _ in range(repeats):
            for k, ld in enumerate((a, b)):
                n, t0, c0 = 0, time.perf_counter(), time.process_time()
                while time.perf_counter() - t0 < min_seconds:
                    for batch in ld:
                        n += len(batch["_index"])
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                runs[k].append((n / wall, cpu / n * 1e6))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=8_000_000)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", choices=["images", "tokens", "schedule"], default=None)
    ap.add_argument("--min-seconds", type=float, default=0.5, help="length of one run (whole epochs)")
    ap.add_argument("--json", default=None, help="write the rows and targets here")
    args = ap.parse_args()
    load_start = os.getloadavg()
    weights = [0.5, 0.3, 0.2]
    rows, sched_rows = [], None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.only in (None, "images"):
            whole, parts = _image_files(tmp, args.images)
            pipe = {"image": [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize()]}
            for threads in args.threads:
                kw = dict(batch_size=64, pipelines=pipe, num_threads=threads, order="random", seed=0)
                rates = _rates(lambda kw=kw: Loader(whole, **kw), lambda kw=kw: Loader(Mixture(parts, weights), **kw),
                               args.repeats, args.min_seconds)
                rows.append(("images, RRC 224, B=64", threads, *rates))
        if args.only in (None, "tokens", "schedule"):
            whole, parts = _token_files(tmp, args.tokens)
        if args.only in (None, "schedule"):
            sched_rows = _schedule_rows(parts, weights, args.repeats, args.min_seconds)
        if args.only in (None, "tokens"):
            for threads in args.threads:
                kw = dict(batch_size=32, pipelines={"tokens": [TokenWindows(1024)]}, num_threads=threads,
                          order="quasi_random", seed=0)
                rates = _rates(lambda kw=kw: Loader(whole, **kw), lambda kw=kw: Loader(Mixture(parts, weights), **kw),
                               args.repeats, args.min_seconds)
                rows.append(("tokens, seq_len 1024, B=32", threads, *rates))
    print(f"| data | threads | one file (samples/s) | 3-source Mixture 0.5/0.3/0.2 (samples/s) | rate ratio, "
          f"median (min-max) of {args.repeats} pairs | CPU us/sample, one file / Mixture |")
    print("|---|---|---|---|---|---|")
    out_rows, targets = [], []
    for name, threads, a, b in rows:
        ratios = [y[0] / x[0] for x, y in zip(a, b)]
        print(f"| {name} | {threads} | {np.median([x[0] for x in a]):,.0f} ({min(x[0] for x in a):,.0f}-"
              f"{max(x[0] for x in a):,.0f}) | {np.median([y[0] for y in b]):,.0f} ({min(y[0] for y in b):,.0f}-"
              f"{max(y[0] for y in b):,.0f}) | {np.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
              f"{np.median([x[1] for x in a]):.1f} / {np.median([y[1] for y in b]):.1f} |")
        out_rows.append({"data": name, "threads": threads, "one_file_samples_per_s": [x[0] for x in a],
                         "mixture_samples_per_s": [y[0] for y in b], "ratio": ratios,
                         "one_file_cpu_us_per_sample": [x[1] for x in a],
                         "mixture_cpu_us_per_sample": [y[1] for y in b]})
        med = float(np.median(ratios))
        cpu_a, cpu_b = float(np.median([x[1] for x in a])), float(np.median([y[1] for y in b]))
        targets.append({"name": f"3-source Mixture vs one file, {name}, {threads} thread{'s' * (threads > 1)}",
                        "measured": med, "target": 0.9, "unit": "x", "met": med >= 0.9,
                        "detail": f"median of {len(ratios)} alternated pairs ({min(ratios):.2f}-{max(ratios):.2f}); "
                                  f"CPU us/sample one file / Mixture {cpu_a:.2f} / {cpu_b:.2f} "
                                  f"({cpu_a / cpu_b:.2f}x)"})
    if sched_rows is not None:
        targets += _schedule_table(*sched_rows)
        sched_rows = {"cost": {str(k): v for k, v in sched_rows[0].items()}, "resume": sched_rows[1]}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "mixture", "settings": vars(args), "weights": weights, "rows": out_rows,
                       "schedule": sched_rows,
                       "targets": targets, "machine": {"cpus": os.cpu_count(), "loadavg": load_start,
                                                       "loadavg_end": os.getloadavg()}}, f, indent=2)
        print(f"JSON: {args.json}")


def _image_files(tmp: Path, n: int):
    """(one file of all images, three files of n images each)."""
    folders = [make_imagenet_like(tmp / f"img{k}", n, long_side=(400, 500), seed=k) for k in range(3)]
    fields = {"image": RGBImage(max_resolution=512), "label": Int()}
    parts = []
    for k, folder in enumerate(folders):
        parts.append(tmp / f"part{k}.pageset")
        write_dataset(parts[-1], folder, fields, num_workers=0, progress=False)
    records = [r for k in range(3) for r in _records(folders[k])]
    whole = tmp / "whole.pageset"
    write_dataset(whole, records, fields, num_workers=0, progress=False)
    return whole, parts


def _token_files(tmp: Path, n_tokens: int):
    """(one token file, three token files holding its documents in three parts); documents of 50-2000 tokens."""
    rng = np.random.default_rng(0)
    parts, all_docs = [], []
    for k in range(3):
        docs = [rng.integers(0, 50000, size=int(rng.integers(50, 2000))) for _ in range(n_tokens // 3 // 1000)]
        all_docs += docs
        parts.append(tmp / f"tok{k}.pageset")
        write_tokens(parts[-1], docs, eos_id=50000, num_workers=0, progress=False)
    whole = tmp / "tok.pageset"
    write_tokens(whole, all_docs, eos_id=50000, num_workers=0, progress=False)
    return whole, parts


def _records(folder: Path):
    """(JPEG path, label) records of an ImageFolder, classes and files in sorted order."""
    classes = sorted(p for p in folder.iterdir() if p.is_dir())
    for label, cls in enumerate(classes):
        for f in sorted(cls.iterdir()):
            yield (str(f), label)



def _random_schedule(stages: int, every: int, interpolate: str, seed: int) -> Schedule:
    """``stages`` stages of random float weights (quotas over 10**6), one every ``every`` samples."""
    rng = np.random.default_rng(seed)
    return Schedule([(j * every, (rng.random(3) + 0.05).tolist()) for j in range(stages)], interpolate)


def _schedule_rows(parts, weights, repeats: int, min_seconds: float):
    """(cost rows, plan/resume rows): CPU per sample of a constant Mixture and of 1,000-stage linear Schedules
    over the run (one stage per 10,000 samples; one per 100: every batch of 32 crosses a stage), alternated
    with the constant runs, then the plan and resume seconds of 1,000-stage schedules over 10**9 samples."""
    kw = dict(batch_size=32, pipelines={"tokens": [TokenWindows(1024)]}, num_threads=1, order="quasi_random", seed=0)
    cost = {}
    for every in (10_000, 100):
        sched = _random_schedule(1000, every, "linear", 1)
        const, scheduled = _rates(lambda: Loader(Mixture(parts, weights), **kw),
                                  lambda sched=sched: Loader(Mixture(parts, sched), **kw), repeats, min_seconds)
        cost[every] = {"constant_cpu_us_per_sample": [x[1] for x in const],
                       "schedule_cpu_us_per_sample": [y[1] for y in scheduled],
                       "constant_samples_per_s": [x[0] for x in const],
                       "schedule_samples_per_s": [y[0] for y in scheduled]}
    resume = []
    for interpolate in ("step", "linear"):
        big = Mixture(parts, _random_schedule(1000, 10**6, interpolate, 2))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            with Loader(big, **kw) as ld:
                ld.set_epoch(10**9 // ld.epoch_length)
                state = ld.state_dict()
                length = ld.epoch_length
            t1 = time.perf_counter()
            with Loader(big, **kw) as ld:
                ld.load_state_dict(state)
                next(iter(ld))
                t2 = time.perf_counter()
            times.append((t1 - t0, t2 - t1))
        resume.append({"interpolate": interpolate, "position": state["epoch"] * length, "plan_s": [a for a, _ in times],
                       "resume_s": [b for _, b in times]})
    return cost, resume


def _schedule_table(cost: dict, resume: list) -> list[dict]:
    print()
    print("| tokens, seq_len 1024, B=32, 1 thread | CPU us/sample, median (min-max) | samples/s | per-pair CPU "
          "ratio, Schedule / constant |")
    print("|---|---|---|---|")
    targets = []
    for every, c in cost.items():
        a, b = c["constant_cpu_us_per_sample"], c["schedule_cpu_us_per_sample"]
        ratios = [y / x for x, y in zip(a, b)]
        print(f"| constant weights 0.5/0.3/0.2 | {np.median(a):.3f} ({min(a):.3f}-{max(a):.3f}) | "
              f"{np.median(c['constant_samples_per_s']):,.0f} | |")
        print(f"| Schedule: 1,000 linear stages, one per {every:,} samples | {np.median(b):.3f} ({min(b):.3f}-"
              f"{max(b):.3f}) | {np.median(c['schedule_samples_per_s']):,.0f} | {np.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}) |")
        if every == 10_000:
            med = float(np.median(ratios))
            targets.append({"name": "Schedule (1,000 linear stages, one per 10,000 samples) vs constant weights, CPU "
                                    "per sample, tokens B=32", "measured": med, "target": 1.05, "unit": "x",
                            "met": med <= 1.05, "higher_is_better": False,
                            "detail": f"median of {len(ratios)} alternated pairs ({min(ratios):.3f}-{max(ratios):.3f}); "
                                      f"{np.median(a):.3f} vs {np.median(b):.3f} us/sample"})
    print()
    print("| 1,000-stage schedule, random float weights | position | plan s (Loader, set_epoch, state_dict) | "
          "resume s (fresh Loader, load_state_dict, first batch) |")
    print("|---|---|---|---|")
    for r in resume:
        p, q = r["plan_s"], r["resume_s"]
        print(f"| {r['interpolate']}, one stage per 10**6 samples | {r['position']:,} | {np.median(p):.3f} "
              f"({min(p):.3f}-{max(p):.3f}) | {np.median(q):.3f} ({min(q):.3f}-{max(q):.3f}) |")
        med = float(np.median(q))
        targets.append({"name": f"resume at 10^9 samples, 1,000 {r['interpolate']} stages", "measured": med,
                        "target": 1.0, "unit": "s", "met": med < 1.0, "higher_is_better": False,
                        "detail": f"fresh Loader + load_state_dict + first batch at position {r['position']:,} "
                                  f"(median of {len(q)}); the first loader's set_epoch + state_dict there: "
                                  f"{np.median(p):.3f} s"})
    return targets


if __name__ == "__main__":
    main()
