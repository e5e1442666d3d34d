"""Many-file datasets at scale: the order of a 1-billion-record, 10,000-member set by simulation, a 1,000-member set
read through the Loader against one file of the same records, and conversion into members with 1 and 2 workers.

    .venv/bin/python -m benchmarks.manyfile_scale [--records 1000000000] [--members 10000] [--json out/m.json]
    .venv/bin/python -m benchmarks.manyfile_scale --quick     (smaller read sets and epochs; ~5 min on 2 cores)

1. Simulation (no data): synthetic page tables (every member ``records / members`` records, ``--per-page`` records
   per page) go through the real plan objects a Loader on the set builds: ``FileSet(...).plan(members, params)``
   (``ManyFilePlan``: order v1 over the concatenated page list, rows mapped to (member, local id); the Loader on a
   folder runs the same ``FilePlan`` over the same list, its source doing the mapping), each phase in a fresh
   process (its peak RSS from ``getrusage``): the plan, epoch 0's order (``quasi_random``), the first batch of
   rank 0 and of the last rank, and a resume: ``plan.resume(state)`` of a state saved mid-epoch on another world
   size + that rank's first batch. ``random`` is not run at this size: its epoch order is a Fisher-Yates of all
   N ids (int64[N]: 8 GB for 10^9 records); it is measured at ``--random-records`` to show the O(N) growth.
2. Reading: sets of ``--set-members`` members (``--total-records`` records each; records of an int label + a
   float32[64] array: the Loader's
   per-batch cost, not decoding, dominates) against one file of the same records (``merge_datasets``), both
   ``quasi_random``, in ``--repeats`` fresh processes, each building both loaders and alternating them (a
   warm-up epoch each, then 7 rounds of one epoch of each; the median epoch rate of each); the rate ratio (goal
   >= 0.95, the median over the processes) and the
   construction time of ``Loader(folder)`` (lazy: one member opened) against ``Loader(FileSet(paths, id))``
   (every member opened); then a set of ``--token-members`` token files against their merge (seq_len 1024).
3. Conversion: ``write_dataset(records_per_member=...)`` of the same in-memory source with ``num_workers`` 1 and 2
   (members written by the worker processes themselves).

Prints markdown tables; ``--json`` writes rows and targets.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIM = r"""
import json, resource, sys, time
import numpy as np
from pageset.order.fileset import FileSet
from pageset.order.plan import Member, OrderParams
records, members, per_page, order, phase, world = [int(x) if x.isdigit() else x for x in sys.argv[1:7]]
from pageset.order import enable_kernel_cache
enable_kernel_cache()  # as a Loader does: the order kernels come from numba's disk cache
t = {}
_w = FileSet(["a", "b"], "cd" * 32).plan([Member("a", "0" * 64, np.array([3, 2])), Member("b", "1" * 64,
    np.array([4]))], OrderParams(seed=1, order=sys.argv[4], window_pages=2, global_batch_size=2, drop_last=True))
_w.epoch(0).batch(0, 2)  # warm-up, untimed: kernels loaded (or compiled once) before the clock starts
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t["rss_start_mb"] = rss()
per_member = records // members
pages = -(-per_member // per_page)
sizes = np.full(pages, per_page, np.int64)
sizes[-1] = per_member - per_page * (pages - 1)
t0 = time.perf_counter()
ms = [Member(f"m{k:06d}.pageset", f"{k:064x}", sizes) for k in range(members)]  # the manifest's page tables
G, M = 4096, 8
params = OrderParams(seed=7, order=order, window_pages=M, global_batch_size=G, drop_last=True)
plan = FileSet([m.path for m in ms], "ab" * 32).plan(ms, params)
t["plan_s"] = time.perf_counter() - t0
B = G // world
if phase == "order":
    t0 = time.perf_counter()
    ep = plan.epoch(0)
    b = ep.batch(0, B)
    t["epoch_and_first_batch_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    last = ep.batch((world - 1) * B, world * B)  # the last rank's slice of step 0
    mid = plan.epoch_length // G // 2 * G
    ep.batch(mid, mid + B)
    t["later_batches_s"] = time.perf_counter() - t0
    t["first_members"] = sorted(set(b.sources.tolist()))[:8]
else:  # resume: a state saved at mid-epoch on world size 64, resumed on `world` ranks
    state = plan.state(0, plan.epoch_length // G // 2 * G)
    state = json.loads(json.dumps(state))
    t0 = time.perf_counter()
    e, cursor, shift = plan.resume(state, world)  # shift: 0 here (no change of the global batch)
    ep = plan.epoch(e, shift)
    b = ep.batch(cursor + (world - 1) * B, cursor + world * B)
    t["resume_and_first_batch_s"] = time.perf_counter() - t0
t["n_records"], t["pages"] = plan.n_records, int(plan.page_sizes.shape[0])
t["rss_peak_mb"] = rss()
print(json.dumps(t))
"""

READ = r"""
import json, sys, time
from pageset import Loader
from pageset.order.fileset import FileSet
from pageset.read.set_manifest import many_file_members
path, kind, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
t0 = time.perf_counter()
if kind == "fileset":
    info = many_file_members(path)
    src = FileSet(info.paths, info.dataset_id)
else:
    src = path
ld = Loader(src, batch_size=256, order="quasi_random", seed=1, num_threads=threads, array_type="numpy")
build = time.perf_counter() - t0
src = ld._sources[0]
opens = None
if kind != "fileset":
    n = 0
    for b in ld:  # warm-up epoch: kernels, page cache, every member opened once
        n += len(b["_index"])
    before = getattr(src, "opened_count", 0)
    rates = []
    for _ in range(5):  # the median of 5 timed epochs (one epoch of a small set is ~0.1 s)
        t0 = time.perf_counter()
        n = 0
        for b in ld:
            n += len(b["_index"])
        rates.append(n / (time.perf_counter() - t0))
    rate = sorted(rates)[2]
    opens = (getattr(src, "opened_count", 0) - before) // 5  # member files opened per timed epoch
else:
    rate = None
print(json.dumps({"build_s": build, "rate": rate, "opens": opens}))
"""


# One process, both loaders: a warm-up epoch each, then EPOCHS rounds alternating one epoch of the file and one of
# the set (the same process, kernels and page cache for both: what differs is the reading); the median of each.
READ_PAIR = r"""
import json, sys, time
from pageset import Loader, TokenWindows
one, folder, kind = sys.argv[1], sys.argv[2], sys.argv[3]
def make(p):
    t0 = time.perf_counter()
    if kind == "tokens":
        ld = Loader(p, batch_size=32, order="quasi_random", seed=1, array_type="numpy",
                    pipelines={"tokens": [TokenWindows(1024)]})
    else:
        ld = Loader(p, batch_size=256, order="quasi_random", seed=1, num_threads=1, array_type="numpy")
    return ld, time.perf_counter() - t0
(a, _), (b, build) = make(one), make(folder)
key = "input" if kind == "tokens" else "_index"
def epoch(ld):
    t0 = time.perf_counter()
    n = sum(x[key].size for x in ld)
    return n / (time.perf_counter() - t0)
epoch(a), epoch(b)  # warm-up: kernels, page cache, every member opened once
before = b._sources[0].opened_count
EPOCHS = 7
ra, rb = [], []
for _ in range(EPOCHS):
    ra.append(epoch(a))
    rb.append(epoch(b))
opens = (b._sources[0].opened_count - before) // EPOCHS
print(json.dumps({"one": {"rate": sorted(ra)[EPOCHS // 2]},
                  "set": {"rate": sorted(rb)[EPOCHS // 2], "build_s": build, "opens": opens}}))
"""


def _child(code: str, *args) -> dict:
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                         timeout=3600)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def simulate(args) -> tuple[list, list]:
    rows, targets = [], []
    print("\n| set | order | phase | time (s) | peak RSS (MB) | pages |")
    print("|---|---|---|---|---|---|")
    label = f"{args.records / 1e9:g} B records, {args.members:,} members"
    for phase, world in (("order", 1024), ("resume", 512)):
        r = _child(SIM, args.records, args.members, args.per_page, "quasi_random", phase, world)
        secs = r.get("epoch_and_first_batch_s", r.get("resume_and_first_batch_s"))
        what = ("plan + epoch order + rank 0's first batch (W=1024)" if phase == "order"
                else "load_state_dict (saved on W=1024, mid-epoch) + first batch of rank 511 of W=512")
        if phase == "order":
            print(f"| {label} | quasi_random | FileSet(...).plan: the concatenated page tables | {r['plan_s']:.2f} | "
                  f"- | {r['pages']:,} |")
        print(f"| {label} | quasi_random | {what} | {secs:.3f} | {r['rss_peak_mb']:.0f} | {r['pages']:,} |")
        rows.append({"phase": phase, "order": "quasi_random", **r})
        if phase == "resume":
            targets.append({"name": f"resume of a {label} set: load_state_dict + first batch plan",
                            "measured": secs, "target": 1.0, "unit": "s", "met": secs < 1.0,
                            "higher_is_better": False,
                            "detail": f"order v1 quasi_random, {r['pages']:,} pages; "
                                      f"peak RSS {r['rss_peak_mb']:.0f} MB "
                                      "(the page tables and one epoch's page order: O(pages), not O(records))"})
    for n in args.random_records:
        r = _child(SIM, n, max(1, args.members * n // args.records), args.per_page, "random", "order", 1024)
        print(f"| {n / 1e6:g} M records | random | epoch order (Fisher-Yates of all ids) + first batch | "
              f"{r['epoch_and_first_batch_s']:.2f} | {r['rss_peak_mb']:.0f} | {r['pages']:,} |")
        rows.append({"phase": "order", "order": "random", "records": n, **r})
    return rows, targets


def _write_set(folder: Path, members: int, per_member: int, workers: int = 0):
    from pageset import Int, NDArray, write_dataset

    n = members * per_member
    rng = np.random.default_rng(0)
    data = rng.standard_normal((n, 64)).astype(np.float32)
    source = [{"label": i, "x": data[i]} for i in range(n)]
    t0 = time.perf_counter()
    write_dataset(folder, source, {"label": Int(), "x": NDArray("float32", (64,))}, records_per_member=per_member,
                  num_workers=workers, page_size=1 << 14, progress=False, lineage=False)
    return n, time.perf_counter() - t0


def reading(args, tmp: Path) -> tuple[list, list]:
    rows, targets = [], []
    print(f"\n| data | members | one file (samples/s) | set (samples/s) | rate ratio, median (min-max) of "
          f"{args.repeats} | Loader construction: set (lazy) / FileSet (all members opened) | member opens per epoch |")
    print("|---|---|---|---|---|---|---|")
    for members in args.set_members:
        r, t = _reading(args, tmp / f"r{members}", members)
        rows.append(r)
        targets.append(t)
    r, t = token_reading(args, tmp)
    rows.append(r)
    targets.append(t)
    return rows, targets


def _reading(args, tmp: Path, members: int):
    from pageset import merge_datasets
    from pageset.read.set_manifest import many_file_members

    tmp.mkdir(parents=True, exist_ok=True)
    folder = tmp / "set"
    n, _ = _write_set(folder, members, args.total_records // members)
    one = tmp / "one.pageset"
    merge_datasets(one, list(many_file_members(folder).paths), progress=False, lineage=False)
    pairs = []
    for _ in range(args.repeats):  # a fresh process each, both loaders alternating in it
        r = _child(READ_PAIR, one, folder, "records")
        pairs.append((r["one"], r["set"]))
    ratios = [b["rate"] / a["rate"] for a, b in pairs]
    eager = _child(READ, folder, "fileset", 1)
    med = float(np.median(ratios))
    opens = int(np.median([b["opens"] for _, b in pairs]))
    print(f"| {n:,} records (int + float32[64]), 1 thread, quasi_random, batch 256 | {members:,} | "
          f"{np.median([a['rate'] for a, _ in pairs]):,.0f} | {np.median([b['rate'] for _, b in pairs]):,.0f} | "
          f"{med:.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
          f"{np.median([b['build_s'] for _, b in pairs]):.2f} s / {eager['build_s']:.2f} s | {opens:,} |")
    row = {"records": n, "members": members, "pairs": pairs, "ratios": ratios, "fileset": eager}
    target = {"name": f"{members:,}-member set vs one file of the same records, through the Loader",
              "measured": med, "target": 0.95, "unit": "x", "met": med >= 0.95,
              "detail": f"median of {len(ratios)} processes, each the median of 7 alternated epochs "
                        f"({min(ratios):.2f}-{max(ratios):.2f}); "
                        f"{opens:,} member file opens per epoch; Loader construction "
                        f"{np.median([b['build_s'] for _, b in pairs]):.2f} s lazy, {eager['build_s']:.2f} s "
                        "opening every member"}
    return row, target


def _write_token_set(folder: Path, members: int, tokens: int) -> None:
    """``members`` token files of ``tokens`` uint16 tokens each (one document) and their manifest."""
    from pageset import write_tokens
    from pageset.format.manifest import Member, build_manifest, schema_digest
    from pageset.read import Dataset
    from pageset.write.members import commit_manifest

    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    entries, schema = [], None
    for k in range(members):
        name = f"m0001-{k:06d}.pageset"
        doc = rng.integers(0, 50000, tokens - 1, dtype=np.uint16)
        write_tokens(folder / name, [doc], eos_id=50256, num_workers=0, page_size=1 << 20, progress=False,
                     lineage=False)
        with Dataset(folder / name) as ds:
            schema = ds.schema
            entries.append(Member(name, ds.dataset_id, ds.file_size, ds.page_count, schema_digest(ds.schema),
                                  tokens=int(ds.tokens_info["count"]), documents=int(ds.tokens_info["documents"])))
    commit_manifest(str(folder), build_manifest("tokens", 1, schema, 1 << 20, entries), None)


def token_reading(args, tmp: Path) -> tuple[dict, dict]:
    from pageset import merge_datasets
    from pageset.read.set_manifest import many_file_members

    members, tokens = args.token_members, args.member_tokens
    folder = tmp / "tokset"
    _write_token_set(folder, members, tokens)
    one = tmp / "tokens.pageset"
    merge_datasets(one, list(many_file_members(folder).paths), progress=False, lineage=False)
    pairs = [(r["one"], r["set"]) for r in (_child(READ_PAIR, one, folder, "tokens") for _ in range(args.repeats))]
    ratios = [b["rate"] / a["rate"] for a, b in pairs]
    med = float(np.median(ratios))
    opens = int(np.median([b["opens"] for _, b in pairs]))
    print(f"| {members * tokens / 1e6:g} M tokens (uint16), seq_len 1024, batch 32, quasi_random | {members:,} | "
          f"{np.median([a['rate'] for a, _ in pairs]) / 1e6:.1f} M tokens/s | "
          f"{np.median([b['rate'] for _, b in pairs]) / 1e6:.1f} M tokens/s | {med:.2f} ({min(ratios):.2f}-"
          f"{max(ratios):.2f}) | {np.median([b['build_s'] for _, b in pairs]):.2f} s | {opens:,} |")
    target = {"name": f"{members:,}-member token set vs one file of the same tokens, through the Loader",
              "measured": med, "target": 0.95, "unit": "x", "met": med >= 0.95,
              "detail": f"median of {len(ratios)} processes, each the median of 7 alternated epochs "
                        f"({min(ratios):.2f}-{max(ratios):.2f}); "
                        f"{opens:,} member opens per epoch"}
    return {"members": members, "tokens_per_member": tokens, "pairs": pairs, "ratios": ratios}, target


def conversion(args, tmp: Path) -> list:
    print("\n| conversion | num_workers | members | records/s | seconds |")
    print("|---|---|---|---|---|")
    rows = []
    members = max(args.set_members)
    for w in (1, 2):
        n, secs = _write_set(tmp / f"conv{w}", members, args.total_records // members, workers=w)
        print(f"| int + float32[64] records -> members | {w} | {members:,} | {n / secs:,.0f} | {secs:.1f} |")
        rows.append({"num_workers": w, "records": n, "seconds": secs})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000_000)
    ap.add_argument("--members", type=int, default=10_000)
    ap.add_argument("--per-page", type=int, default=100, help="records per page of the synthetic tables")
    ap.add_argument("--random-records", type=int, nargs="*", default=[10_000_000, 50_000_000])
    ap.add_argument("--set-members", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--total-records", type=int, default=100_000, help="records of the read sets")
    ap.add_argument("--token-members", type=int, default=1000)
    ap.add_argument("--member-tokens", type=int, default=500_000, help="tokens per member of the token set")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.random_records, args.repeats = [10_000_000], 3  # the 1 B-record simulation stays (~1 min)
        args.total_records, args.token_members, args.member_tokens = 60_000, 1000, 200_000
    load = os.getloadavg()
    sim_rows, targets = simulate(args)
    with tempfile.TemporaryDirectory() as d:
        read_rows, t = reading(args, Path(d))
        targets += t
        conv_rows = conversion(args, Path(d))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "manyfile_scale", "settings": vars(args), "simulation": sim_rows,
                       "reading": read_rows, "conversion": conv_rows, "targets": targets,
                       "machine": {"cpus": os.cpu_count(), "loadavg": load, "loadavg_end": os.getloadavg(),
                                   "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}},
                      f, indent=2)
        print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
