"""Training from object storage: the same file read locally, from a local S3 server and from an HTTP server,
with 0, 10 and 50 ms injected per request; Mosaic Streaming and litdata reading the same photos from the same S3
server; the MLPerf Storage framing (an emulated accelerator, AU >= 90%).

    .venv/bin/python -m benchmarks.remote [--images 1200] [--threads 2] [--latencies 0,10,50] [--repeats 3]
        [--peers mds,litdata] [--au-probes 5] [--json out/bench_remote.json] [--chart out/remote.png]

Servers (all on 127.0.0.1, started here in a separate process per latency, so their Python threads do not share
the loader's GIL): moto's S3 server (``moto[server]``) spoken to by s3fs/botocore, and aiohttp's static file
server (Range requests), each behind the tests' proxy (``tests/remote_servers.py``) that adds the latency.
Data: the real-photo ImageNet-like set (max side 256, JPEG q90) in pages of ``--page-size``.
Pipeline: RandomResizedCrop(160) + flip, uint8, batch 64.

Rows per (source, latency, order): images/s after the first batch and as a ratio to the local file's rate in the
same run; time to first batch (open included); range requests and bytes fetched per epoch; read amplification
(bytes fetched / bytes of the records the epoch used); the emulated accelerator's utilisation (AU: a consumer that
sleeps ``--compute-ms`` per batch; AU = compute time / wall time). First the server's own floor: serial
page-sized GETs per second and MB/s, so rates can be read against what the server can give at all. Every row runs
``--repeats`` times (interleaved); tables give the median (min-max).

Peers (``--peers``, in their own venv from ``benchmarks/peers/setup_streaming.sh``): the JPEG bytes pageset stored
are written as an ImageFolder, converted to MDS shards / litdata chunks of ``--peer-shard-mb`` and uploaded to
the same moto server behind the same proxy; each reads them with its own S3 client (MDS: boto3 with
``S3_ENDPOINT_URL``; litdata: ``storage_options={"endpoint_url": ...}``, obstore for chunks) through a DataLoader
with ``--threads`` workers, Pillow decode + RandomResizedCrop(160) + flip + normalize (their way), one epoch per
fresh dataset and empty local cache (``benchmarks/peers/streaming_bench.py remote``).

AU search (``--au-probes``): for the local file and ``s3://`` at each latency, a bisection over the compute time
per batch (one epoch per probe on an open Loader) for the shortest at which AU >= 90%.
"""

from __future__ import annotations

import argparse
import json
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from remote_servers import s3_options  # noqa: E402

from pageset import (  # noqa: E402
    Int,
    Loader,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RGBImage,
    TokenWindows,
    open_dataset,
    open_tokens,
    write_dataset,
    write_tokens,
)
from pageset.sample_data import debian_photos, make_imagenet_like, wheel_photos  # noqa: E402

BATCH = 64
SERVERS = Path(__file__).resolve().parents[1] / "tests" / "remote_servers.py"


class Servers:
    """S3 + HTTP for one file in a child process, ``latency_ms`` added per request; ``info`` has the URLs."""

    def __init__(self, paths, latency_ms):
        self.proc = subprocess.Popen([sys.executable, str(SERVERS), *map(str, paths), "--latency-ms", str(latency_ms)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        if not ready:
            self.stop()
            raise TimeoutError("the server process did not start within 120 s")
        self.info = json.loads(self.proc.stdout.readline())

    def stop(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def server_floor(url, opts, page_size, file_size, n=30):
    """Serial page-sized range GETs through the pinned reader: requests/s and MB/s."""
    from pageset.read.remote import RemoteFile

    rf = RemoteFile(url, opts)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, max(1, file_size - page_size), n)
    t0 = time.perf_counter()
    for s in starts:
        rf.read(int(s), int(min(file_size, s + page_size)))
    dt = time.perf_counter() - t0
    rf.close()
    return {"requests_per_s": n / dt, "MB_per_s": n * page_size / dt / 1e6}


def run_epoch(path, order, threads, compute_s, **kw):
    t0 = time.perf_counter()
    with Loader(path, batch_size=BATCH, order=order, seed=0, num_threads=threads, window_pages=4,
                pipelines={"image": [RandomResizedCrop(160), RandomHorizontalFlip()]}, **kw) as loader:
        it = iter(loader)
        next(it)
        t_first = time.perf_counter() - t0
        t1 = time.perf_counter()
        n = 1
        for _ in it:
            n += 1
        dt = time.perf_counter() - t1
        stats = loader.remote_stats()
        # AU: the next epoch, with a consumer that "computes" for compute_s per batch
        t2 = time.perf_counter()
        steps = 0
        for _ in loader:
            time.sleep(compute_s)
            steps += 1
        au = steps * compute_s / (time.perf_counter() - t2)
        stats2 = loader.remote_stats()
    row = {"images_per_s": (n - 1) * BATCH / dt if n > 1 else float("nan"), "first_batch_s": t_first,
           "AU": au, "steps": n}
    if stats is not None:
        row.update(requests_epoch1=stats["requests"], bytes_epoch1=stats["bytes_fetched"],
                   requests_epoch2=stats2["requests"] - stats["requests"],
                   waits=stats["waits"])
    return row


SEQ, TOK_BATCH = 1024, 16


def run_tokens(path, order, threads, **kw):
    t0 = time.perf_counter()
    with Loader(path, batch_size=TOK_BATCH, order=order, seed=0, num_threads=threads, window_pages=4,
                pipelines={"tokens": [TokenWindows(seq_len=SEQ)]}, **kw) as loader:
        it = iter(loader)
        next(it)
        t_first = time.perf_counter() - t0
        t1 = time.perf_counter()
        n = sum(1 for _ in it)
        dt = time.perf_counter() - t1
        stats = loader.remote_stats()
    row = {"tokens_per_s": n * TOK_BATCH * SEQ / dt, "first_batch_s": t_first}
    if stats is not None:
        row.update(requests_epoch1=stats["requests"], bytes_epoch1=stats["bytes_fetched"])
    return row


def write_chart(result: dict, path) -> None:
    """PNG from a saved result: images/s by latency (pageset s3/http per order, the peers from s3), read
    amplification, and the emulated accelerator's utilisation at the run's fixed compute time; medians of the
    runs, bars from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, peer_rows = result["rows"], result.get("peer_rows", [])
    fig, axes = plt.subplots(1, 3 if peer_rows or "AU" in rows[0] else 2, figsize=(16, 4.8))
    ax, ax2 = axes[0], axes[1]

    def line(a, sub, key, style, color, label, scale=1.0):
        lat = [r["latency_ms"] for r in sub]
        med = [r[key] * scale for r in sub]
        err = None
        if all(key + "_min" in r for r in sub):
            err = [[(r[key] - r[key + "_min"]) * scale for r in sub], [(r[key + "_max"] - r[key]) * scale for r in sub]]
        a.errorbar(lat, med, yerr=err, fmt=style, color=color, marker="o", capsize=3, label=label)

    for order, style in (("quasi_random", "-"), ("random", "--")):
        local = next((r for r in rows if r["source"] == "local" and r["order"] == order), None)
        for source, color in (("s3", "tab:blue"), ("http", "tab:orange")):
            sub = sorted((r for r in rows if r["source"] == source and r["order"] == order),
                         key=lambda r: r["latency_ms"])
            if not sub:
                continue
            line(ax, sub, "images_per_s", style, color, f"pageset {source} {order}")
            line(ax2, sub, "read_amplification", style, color, f"pageset {source} {order}")
            if len(axes) > 2 and order == "quasi_random" and "AU" in sub[0]:
                line(axes[2], sub, "AU", style, color, f"pageset {source} {order}", 100)
        if local is not None:
            ax.axhline(local["images_per_s"], linestyle=style, color="gray", label=f"pageset local file {order}")
            if len(axes) > 2 and order == "quasi_random":
                axes[2].axhline(local["AU"] * 100, linestyle=style, color="gray", label="pageset local file")
    for peer, color in (("mds", "tab:green"), ("litdata", "tab:purple")):
        sub = sorted((r for r in peer_rows if r["peer"] == peer and r["source"].endswith("s3")),
                     key=lambda r: r["latency_ms"])
        local = next((r for r in peer_rows if r["peer"] == peer and r["source"].endswith("local")), None)
        name = {"mds": "Mosaic Streaming", "litdata": "litdata"}[peer]
        if sub:
            line(ax, sub, "images_per_s", ":", color, f"{name} s3")
            line(ax2, sub, "read_amplification", ":", color, f"{name} s3")
            line(axes[2], sub, "AU", ":", color, f"{name} s3", 100)
        if local is not None:
            ax.axhline(local["images_per_s"], linestyle=":", color=color, alpha=0.5, label=f"{name} local")
    n = result.get("repeats", 1)
    ax.set(xlabel="injected latency per request (ms)", ylabel="images/s (2 threads / 2 workers)",
           title=f"images/s, pages of {result['page_size'] >> 10} KiB" + (f", median of {n}" if n > 1 else ""))
    ax2.set(xlabel="injected latency per request (ms)", ylabel="bytes fetched / bytes used",
            title="read amplification (first epoch)")
    for a in axes:
        a.set_ylim(bottom=0)
        a.legend(fontsize=7)
    if len(axes) > 2:
        axes[2].set(xlabel="injected latency per request (ms)", ylabel="AU (%)",
                    title=f"accelerator utilisation, {result['compute_s'] * 1e3:.0f} ms compute per batch")
        axes[2].axhline(90, color="red", linewidth=0.8)
        axes[2].set_ylim(0, 105)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


ROOT = Path(__file__).resolve().parents[1]
PEER_PY = ROOT / "benchmarks" / ".envs" / "streaming" / "bin" / "python"
PEER_SCRIPT = ROOT / "benchmarks" / "peers" / "streaming_bench.py"


def peer_call(args, env=None, timeout=600) -> dict:
    """Run benchmarks/peers/streaming_bench.py in the peers' venv; its last JSON line."""
    import os

    proc = subprocess.run([str(PEER_PY), str(PEER_SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"peer run {args[:3]} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


def upload_dir(endpoint, bucket, folder, prefix):
    """Upload every file of ``folder`` to ``s3://bucket/prefix/`` (relative paths kept)."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    for f in sorted(Path(folder).rglob("*")):
        if f.is_file():
            client.upload_file(str(f), bucket, f"{prefix}/{f.relative_to(folder).as_posix()}")


def au_epoch(loader, compute_s):
    """One epoch of ``loader`` with a consumer sleeping ``compute_s`` per batch: compute time / wall time."""
    t = time.perf_counter()
    steps = 0
    for _ in loader:
        time.sleep(compute_s)
        steps += 1
    return steps * compute_s / (time.perf_counter() - t)


def au_search(path, order, threads, lo, hi, probes, target=0.9, **kw):
    """Shortest compute time per batch (s) at which one epoch's AU >= target: bisection on [lo, hi] (hi doubled up
    to twice if it misses), ``probes`` halvings, one epoch per probe on one open Loader (after a warm-up epoch).
    Returns (threshold_s, [(compute_s, AU), ...])."""
    tried = []
    with Loader(path, batch_size=BATCH, order=order, seed=0, num_threads=threads, window_pages=4,
                pipelines={"image": [RandomResizedCrop(160), RandomHorizontalFlip()]}, **kw) as loader:
        for _ in loader:
            pass
        for _ in range(3):
            tried.append((hi, au_epoch(loader, hi)))
            if tried[-1][1] >= target:
                break
            lo, hi = hi, 2 * hi
        else:
            return float("nan"), tried
        for _ in range(probes):
            mid = (lo + hi) / 2
            tried.append((mid, au_epoch(loader, mid)))
            lo, hi = (lo, mid) if tried[-1][1] >= target else (mid, hi)
    return hi, tried


def summarize(runs: list[dict], keys) -> dict:
    """Median of each key over the runs, with _min and _max; the raw runs under 'runs'."""
    out = {k: v for k, v in runs[0].items() if k in ("source", "latency_ms", "order", "peer")}
    for k in keys:
        vals = [r[k] for r in runs if r.get(k) is not None and r[k] == r[k]]
        if vals:
            out[k], out[k + "_min"], out[k + "_max"] = float(np.median(vals)), min(vals), max(vals)
    out["runs"] = runs
    return out


def remote_targets(rows, latencies) -> list[dict]:
    """Issue 11's targets at the largest latency, quasi_random: >= 80% of the local rate, read amplification
    <= 1.1, first batch < 3 s; per source (s3, http), from the medians of the runs."""
    lat = max(latencies)
    out = []
    for source in ("s3", "http"):
        r = next((x for x in rows if x["source"] == source and x["latency_ms"] == lat
                  and x["order"] == "quasi_random"), None)
        for key, name, goal, unit, higher in (("vs_local", "images/s vs the local file", 0.8, "x", True),
                                              ("read_amplification", "read amplification", 1.1, "x", False),
                                              ("first_batch_s", "first batch", 3.0, "s", False)):
            full = f"{source}:// at {lat:g} ms, quasi_random: {name}"
            if r is None or key not in r:
                out.append({"name": full, "measured": None, "target": goal, "unit": unit, "met": None,
                            "detail": "not run: no quasi_random row at this latency (--orders / --latencies)"})
                continue
            m = r[key]
            out.append({"name": full, "measured": m, "target": goal, "unit": unit,
                        "met": bool(m >= goal if higher else m <= goal), "higher_is_better": higher,
                        "detail": f"median of {len(r['runs'])} runs ({r[key + '_min']:.2f}-{r[key + '_max']:.2f})"})
    return out


def _mm(r, k, fmt, scale=1.0, unit=""):
    if k not in r:
        return "-"
    med = fmt.format(r[k] * scale)
    if len(r.get("runs", ())) < 2:
        return med + unit
    return f"{med}{unit} ({fmt.format(r[k + '_min'] * scale)}-{fmt.format(r[k + '_max'] * scale)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=1200)
    ap.add_argument("--tokens", type=int, default=8_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=1 << 20)
    ap.add_argument("--latencies", default="0,10,50", help="ms per request, comma-separated")
    ap.add_argument("--orders", default="quasi_random,random")
    ap.add_argument("--repeats", type=int, default=3, help="runs of every row (interleaved); tables give the "
                    "median (min-max)")
    ap.add_argument("--compute-ms", type=float, default=None,
                    help="emulated accelerator step (default: 1.2 x the local file's batch time)")
    ap.add_argument("--prefetch-mb", type=int, default=4,
                    help="prefetch_bytes in MiB (the memory cache is twice that: below the file's size, so random "
                         "order pays for its page reads)")
    ap.add_argument("--peers", default="mds,litdata" if PEER_PY.exists() else "",
                    help="Mosaic Streaming / litdata rows (venv from benchmarks/peers/setup_streaming.sh); '' = none")
    ap.add_argument("--peer-shard-mb", type=int, default=4, help="MDS shard / litdata chunk size, MB")
    ap.add_argument("--au-probes", type=int, default=5, help="bisection steps of the AU >= 90%% search; 0 = none")
    ap.add_argument("--no-tokens", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--chart", default=None, help="PNG path (matplotlib); or re-draw with --from-json")
    ap.add_argument("--from-json", default=None, help="only draw --chart from a saved --json result")
    args = ap.parse_args()
    if args.from_json:
        write_chart(json.loads(Path(args.from_json).read_text()), args.chart or "remote.png")
        return

    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="pageset-bench-remote-"))
    servers = {}
    peers = [p for p in args.peers.split(",") if p]
    try:
        folder = make_imagenet_like(tmp / "src", args.images, long_side=(400, 500),
                                    photos=wheel_photos() + debian_photos(), seed=0)
        path = tmp / "train.pageset"
        res = write_dataset(path, folder, {"image": RGBImage(max_resolution=256, jpeg_quality=90), "label": Int()},
                            page_size=args.page_size, progress=False)
        # the peers store the same photos as pageset stored them (max side 256, q90): re-encoded JPEGs from
        # the file, so all three read the same bytes per image
        peer_src = tmp / "peer_src"
        with open_dataset(path) as ds:
            for i in range(len(ds) if peers else 0):
                rec = ds[i]
                if rec["image"].encoding != "jpeg":
                    raise ValueError(f"{path}: record {i} image is stored {rec['image'].encoding}, not JPEG")
                d = peer_src / f"c{rec['label']:04d}"
                d.mkdir(parents=True, exist_ok=True)
                (d / f"{i:06d}.jpg").write_bytes(rec["image"].data)
        shutil.rmtree(tmp / "src")
        peer_dirs = {}
        for peer in peers:
            peer_dirs[peer] = tmp / f"peer_{peer}"
            peer_call(["convert", "--peer", peer, "--folder", peer_src, "--out", peer_dirs[peer],
                       "--shard-size", f"{args.peer_shard_mb}mb"])
        size = path.stat().st_size
        tok_path = tmp / "tokens.pageset"
        rng = np.random.default_rng(0)  # ids only: the loader's cost does not depend on which ids
        docs = (rng.integers(0, 50000, int(n)) for n in rng.integers(50, 4000, args.tokens // 2000))
        write_tokens(tok_path, docs, eos_id=50256, page_size=args.page_size, num_workers=0, progress=False)
        with open_tokens(tok_path) as td:
            tok_bytes = td.dataset.data_length  # an epoch of windows reads every token once
        with open_dataset(path) as ds:
            used = int(ds.index["_length"].astype(np.int64).sum())  # bytes of the records one epoch reads
        latencies = [float(x) for x in args.latencies.split(",")]
        for lat in latencies:
            servers[lat] = Servers([path, tok_path], lat)
            for peer, d in peer_dirs.items():
                upload_dir(servers[lat].info["s3_endpoint"], "pageset-bench", d, peer)

        def sources(lat, name="train.pageset"):
            info = servers[lat].info
            return {"s3": (info["s3_prefix"] + name, s3_options(info["s3_endpoint"])),
                    "http": (info["http_prefix"] + name, None)}
        print(f"{res.records} images, {size / 1e6:.1f} MB, pages of {args.page_size >> 10} KiB, "
              f"{args.threads} threads, batch {BATCH}, prefetch_bytes {args.prefetch_mb} MiB, "
              f"{args.repeats} runs per row", flush=True)
        floors = {name: server_floor(url, opts, args.page_size, size)
                  for name, (url, opts) in sources(latencies[0]).items()}
        for name, f in floors.items():
            print(f"server floor {name} (+{latencies[0]:.0f} ms): {f['requests_per_s']:.1f} serial page GETs/s, "
                  f"{f['MB_per_s']:.0f} MB/s", flush=True)
        orders = args.orders.split(",")
        local0 = {o: run_epoch(path, o, args.threads, 0.0) for o in orders}  # warm-up + local batch time
        compute = (args.compute_ms / 1e3 if args.compute_ms is not None
                   else 1.2 * BATCH / local0[orders[0]]["images_per_s"])
        runs: dict = {}
        peer_runs: dict = {}
        peer_failures: list = []
        au_runs: dict = {}
        for rep in range(args.repeats):
            for order in orders:
                local = run_epoch(path, order, args.threads, compute)
                runs.setdefault(("local", 0.0, order), []).append(
                    {"source": "local", "latency_ms": 0, "order": order, "vs_local": 1.0, **local})
                for lat in latencies:
                    for name, (url, opts) in sources(lat).items():
                        row = run_epoch(url, order, args.threads, compute, storage_options=opts,
                                        prefetch_bytes=args.prefetch_mb << 20)
                        row.update(source=name, latency_ms=lat, order=order,
                                   vs_local=row["images_per_s"] / local["images_per_s"],
                                   read_amplification=row["bytes_epoch1"] / used)
                        runs.setdefault((name, lat, order), []).append(row)
            for peer in peers:
                base = None
                for lat in [None, *latencies]:
                    where = str(peer_dirs[peer]) if lat is None else f"s3://pageset-bench/{peer}"
                    env = None if lat is None else {
                        "S3_ENDPOINT_URL": servers[lat].info["s3_endpoint"], "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
                    row = None
                    for attempt in range(2):  # a peer's own failure is recorded (peer_failures), not fatal
                        try:
                            row = peer_call(["remote", "--peer", peer, "--path", where, "--workers", args.threads,
                                             "--compute-ms", compute * 1e3], env=env)
                            break
                        except (RuntimeError, subprocess.TimeoutExpired) as e:
                            msg = str(e).strip().splitlines()[-1][:300]
                            peer_failures.append({"peer": peer, "latency_ms": lat, "run": rep, "error": msg})
                            print(f"{peer} at {lat} ms failed (attempt {attempt + 1}): {msg}", flush=True)
                    if row is None:
                        continue
                    base = base or (row["images_per_s"] if lat is None else None)
                    row.update(source=f"{peer} {'local' if lat is None else 's3'}", peer=peer,
                               latency_ms=lat or 0, vs_local=row["images_per_s"] / base if base else None,
                               read_amplification=(row["bytes_downloaded"] / used if lat is not None else None))
                    peer_runs.setdefault((peer, lat), []).append(row)
            if args.au_probes:
                b = BATCH / local0[orders[0]]["images_per_s"]
                for lat in [None, *latencies]:
                    kw = {} if lat is None else {"storage_options": sources(lat)["s3"][1],
                                                 "prefetch_bytes": args.prefetch_mb << 20}
                    where = path if lat is None else sources(lat)["s3"][0]
                    thr, tried = au_search(where, orders[0], args.threads, 0.3 * b, 1.5 * b, args.au_probes, **kw)
                    au_runs.setdefault(lat, []).append({"source": "local" if lat is None else "s3",
                                                        "latency_ms": lat or 0, "order": orders[0],
                                                        "compute_ms_90": thr * 1e3, "probes": tried})
            print(f"run {rep + 1}/{args.repeats} done at {time.perf_counter() - t_start:.0f} s", flush=True)
        keys = ("images_per_s", "vs_local", "first_batch_s", "AU", "read_amplification", "requests_epoch1",
                "bytes_epoch1", "compute_ms_90", "bytes_downloaded")
        rows = [summarize(v, keys) for v in runs.values()]
        rows.sort(key=lambda r: (orders.index(r["order"]), r["latency_ms"], r["source"] != "local"))
        peer_rows = [summarize(v, keys) for v in peer_runs.values()]
        au_rows = [summarize(v, keys) for v in au_runs.values()]
        print(f"\nemulated accelerator: {compute * 1e3:.1f} ms per batch of {BATCH}; median (min-max) of "
              f"{args.repeats} runs\n")
        print("| source | latency | order | images/s | vs local | first batch | requests/epoch | "
              "read ampl. | AU |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            req = f"{r['requests_epoch1']:.0f}" if "requests_epoch1" in r else "-"
            amp = f"{r['read_amplification']:.2f}" if "read_amplification" in r else "-"
            print(f"| {r['source']} | {r['latency_ms']:.0f} ms | {r['order']} | {_mm(r, 'images_per_s', '{:.0f}')} "
                  f"| {_mm(r, 'vs_local', '{:.2f}')} | {_mm(r, 'first_batch_s', '{:.2f}', unit=' s')} | {req} "
                  f"| {amp} | {_mm(r, 'AU', '{:.0f}', 100, '%')} |")
        if peer_rows:
            print(f"\npeers: {args.threads} DataLoader workers, Pillow decode + RandomResizedCrop(160) + flip + "
                  f"normalize (float32), shards of {args.peer_shard_mb} MB, a fresh local cache per epoch\n")
            print("| loader | source | latency | images/s | vs its local | first batch | bytes fetched / used "
                  "| AU |")
            print("|---|---|---|---|---|---|---|---|")
            for r in peer_rows:
                amp = f"{r['read_amplification']:.2f}" if "read_amplification" in r else "-"
                print(f"| {r['peer']} | {r['source'].split()[1]} | {r['latency_ms']:.0f} ms | "
                      f"{_mm(r, 'images_per_s', '{:.0f}')} | {_mm(r, 'vs_local', '{:.2f}')} | "
                      f"{_mm(r, 'first_batch_s', '{:.2f}', unit=' s')} | {amp} | {_mm(r, 'AU', '{:.0f}', 100, '%')} |")
        if au_rows:
            print(f"\nshortest compute time per batch of {BATCH} with AU >= 90% ({orders[0]}, bisection, "
                  f"{args.au_probes} probes)\n")
            print("| source | latency | compute ms/batch at AU >= 90% | = images/s the accelerator consumes |")
            print("|---|---|---|---|")
            for r in au_rows:
                if "compute_ms_90" not in r:
                    print(f"| {r['source']} | {r['latency_ms']:.0f} ms | not reached | - |")
                    continue
                print(f"| {r['source']} | {r['latency_ms']:.0f} ms | {_mm(r, 'compute_ms_90', '{:.0f}')} | "
                      f"{BATCH / (r['compute_ms_90'] / 1e3):.0f} |")
        tok_rows = []
        if not args.no_tokens:
            print(f"\ntokens: TokenWindows(seq_len={SEQ}), batch {TOK_BATCH}, {args.threads} threads\n")
            print("| source | latency | order | tokens/s | vs local | first batch | requests/epoch | read ampl. |")
            print("|---|---|---|---|---|---|---|---|")
            truns: dict = {}
            for rep in range(args.repeats):
                for order in orders:
                    if rep == 0:
                        run_tokens(tok_path, order, args.threads)
                    base = run_tokens(tok_path, order, args.threads)
                    truns.setdefault(("local", 0.0, order), []).append(
                        {"source": "local", "latency_ms": 0, "order": order, "vs_local": 1.0, **base})
                    for lat in latencies:
                        for name, (url, opts) in sources(lat, "tokens.pageset").items():
                            row = run_tokens(url, order, args.threads, storage_options=opts,
                                             prefetch_bytes=args.prefetch_mb << 20)
                            row.update(source=name, latency_ms=lat, order=order,
                                       vs_local=row["tokens_per_s"] / base["tokens_per_s"],
                                       read_amplification=row["bytes_epoch1"] / tok_bytes)
                            truns.setdefault((name, lat, order), []).append(row)
            tok_rows = [summarize(v, ("tokens_per_s", "vs_local", "first_batch_s", "read_amplification",
                                      "requests_epoch1")) for v in truns.values()]
            tok_rows.sort(key=lambda r: (orders.index(r["order"]), r["latency_ms"], r["source"] != "local"))
            for r in tok_rows:
                req = f"{r['requests_epoch1']:.0f}" if "requests_epoch1" in r else "-"
                amp = f"{r['read_amplification']:.2f}" if "read_amplification" in r else "-"
                print(f"| {r['source']} | {r['latency_ms']:.0f} ms | {r['order']} | "
                      f"{_mm(r, 'tokens_per_s', '{:.1f}', 1e-6, ' M')} | {_mm(r, 'vs_local', '{:.2f}')} | "
                      f"{_mm(r, 'first_batch_s', '{:.2f}', unit=' s')} | {req} | {amp} |")
        wall = time.perf_counter() - t_start
        print(f"\nbenchmark wall time: {wall / 60:.1f} min")
        for f in peer_failures:
            print(f"peer failure: {f}")
        result = {"targets": remote_targets(rows, latencies), "floors": floors, "rows": rows, "peer_rows": peer_rows, "peer_failures": peer_failures,
                  "au_rows": au_rows,
                  "token_rows": tok_rows, "compute_s": compute, "images": res.records, "file_bytes": size,
                  "page_size": args.page_size, "repeats": args.repeats, "wall_s": wall}
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=2))
        if args.chart:
            write_chart(result, args.chart)
    finally:
        for srv in servers.values():
            srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
