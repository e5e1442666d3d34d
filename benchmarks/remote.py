"""Training from object storage: the same file read locally, from a local S3 server and from an HTTP server,
with 0, 10 and 50 ms injected per request.

    .venv/bin/python -m benchmarks.remote [--images 600] [--threads 2] [--latencies 0,10,50] [--json out/bench_remote.json]

Servers (all on 127.0.0.1, started here in a separate process per latency, so their Python threads do not share
the loader's GIL): moto's S3 server (``moto[server]``) spoken to by s3fs/botocore, and aiohttp's static file
server (Range requests), each behind the tests' proxy (``tests/remote_servers.py``) that adds the latency.
Data: the real-photo ImageNet-like set (max side 256, JPEG q90) in pages of ``--page-size``.
Pipeline: RandomResizedCrop(160) + flip, uint8, batch 64.

Rows per (source, latency, order): images/s after the first batch and as a ratio to the local file's rate in the
same run; time to first batch (open included); range requests and bytes fetched per epoch; read amplification
(bytes fetched / bytes of the records the epoch used); the emulated accelerator's utilisation (AU: a consumer that
sleeps ``--compute-ms`` per batch; AU = compute time / wall time). First the server's own floor: serial
page-sized GETs per second and MB/s, so rates can be read against what the server can give at all.
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
    """PNG: images/s and read amplification by latency, one line per (source, order), from a saved result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for order, style in (("quasi_random", "-"), ("random", "--")):
        local = next((r for r in rows if r["source"] == "local" and r["order"] == order), None)
        for source, color in (("s3", "tab:blue"), ("http", "tab:orange")):
            sub = sorted((r for r in rows if r["source"] == source and r["order"] == order),
                         key=lambda r: r["latency_ms"])
            if not sub:
                continue
            lat = [r["latency_ms"] for r in sub]
            ax.plot(lat, [r["images_per_s"] for r in sub], style, color=color, marker="o", label=f"{source} {order}")
            ax2.plot(lat, [r["read_amplification"] for r in sub], style, color=color, marker="o",
                     label=f"{source} {order}")
        if local is not None:
            ax.axhline(local["images_per_s"], linestyle=style, color="gray", label=f"local file {order}")
    ax.set(xlabel="injected latency per request (ms)", ylabel="images/s (2 threads)",
           title=f"images/s, pages of {result['page_size'] >> 10} KiB")
    ax2.set(xlabel="injected latency per request (ms)", ylabel="bytes fetched / bytes used",
            title="read amplification (first epoch)")
    ax.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=1200)
    ap.add_argument("--tokens", type=int, default=8_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=1 << 20)
    ap.add_argument("--latencies", default="0,10,50", help="ms per request, comma-separated")
    ap.add_argument("--orders", default="quasi_random,random")
    ap.add_argument("--compute-ms", type=float, default=None,
                    help="emulated accelerator step (default: 1.2 x the local file's batch time)")
    ap.add_argument("--prefetch-mb", type=int, default=4,
                    help="prefetch_bytes in MiB (the memory cache is twice that: below the file's size, so random "
                         "order pays for its page reads)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--chart", default=None, help="PNG path (matplotlib); or re-draw with --from-json")
    ap.add_argument("--from-json", default=None, help="only draw --chart from a saved --json result")
    args = ap.parse_args()
    if args.from_json:
        write_chart(json.loads(Path(args.from_json).read_text()), args.chart or "remote.png")
        return

    tmp = Path(tempfile.mkdtemp(prefix="pageset-bench-remote-"))
    servers = {}
    try:
        folder = make_imagenet_like(tmp / "src", args.images, long_side=(400, 500),
                                    photos=wheel_photos() + debian_photos(), seed=0)
        path = tmp / "train.pageset"
        res = write_dataset(path, folder, {"image": RGBImage(max_resolution=256, jpeg_quality=90), "label": Int()},
                            page_size=args.page_size, progress=False)
        shutil.rmtree(tmp / "src")
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

        def sources(lat, name="train.pageset"):
            info = servers[lat].info
            return {"s3": (info["s3_prefix"] + name, s3_options(info["s3_endpoint"])),
                    "http": (info["http_prefix"] + name, None)}
        print(f"{res.records} images, {size / 1e6:.1f} MB, pages of {args.page_size >> 10} KiB, "
              f"{args.threads} threads, batch {BATCH}, prefetch_bytes {args.prefetch_mb} MiB")
        floors = {name: server_floor(url, opts, args.page_size, size)
                  for name, (url, opts) in sources(latencies[0]).items()}
        for name, f in floors.items():
            print(f"server floor {name} (+{latencies[0]:.0f} ms): {f['requests_per_s']:.1f} serial page GETs/s, "
                  f"{f['MB_per_s']:.0f} MB/s")
        rows = []
        orders = args.orders.split(",")
        local = {o: run_epoch(path, o, args.threads, 0.0) for o in orders}  # warm-up + local batch time
        compute = (args.compute_ms / 1e3 if args.compute_ms is not None
                   else 1.2 * BATCH / local[orders[0]]["images_per_s"])
        for order in orders:
            local[order] = run_epoch(path, order, args.threads, compute)
            rows.append({"source": "local", "latency_ms": 0, "order": order, **local[order]})
            for lat in latencies:
                for name, (url, opts) in sources(lat).items():
                    row = run_epoch(url, order, args.threads, compute, storage_options=opts,
                                    prefetch_bytes=args.prefetch_mb << 20)
                    row.update(source=name, latency_ms=lat, order=order,
                               vs_local=row["images_per_s"] / local[order]["images_per_s"],
                               read_amplification=row["bytes_epoch1"] / used)
                    rows.append(row)
        print(f"\nemulated accelerator: {compute * 1e3:.1f} ms per batch of {BATCH}\n")
        print("| source | latency | order | images/s | vs local | first batch | requests/epoch | "
              "read ampl. | AU |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            req = r.get("requests_epoch1", "-")
            amp = f"{r['read_amplification']:.2f}" if "read_amplification" in r else "-"
            vs = f"{r['vs_local']:.2f}" if "vs_local" in r else "1.00"
            print(f"| {r['source']} | {r['latency_ms']:.0f} ms | {r['order']} | {r['images_per_s']:.0f} | {vs} | "
                  f"{r['first_batch_s']:.2f} s | {req} | {amp} | {r['AU'] * 100:.0f}% |")
        print(f"\ntokens: TokenWindows(seq_len={SEQ}), batch {TOK_BATCH}, {args.threads} threads\n")
        print("| source | latency | order | tokens/s | vs local | first batch | requests/epoch | read ampl. |")
        print("|---|---|---|---|---|---|---|---|")
        tok_rows = []
        for order in orders:
            base = run_tokens(tok_path, order, args.threads)
            base = run_tokens(tok_path, order, args.threads)
            tok_rows.append({"source": "local", "latency_ms": 0, "order": order, **base})
            for lat in latencies:
                for name, (url, opts) in sources(lat, "tokens.pageset").items():
                    row = run_tokens(url, order, args.threads, storage_options=opts,
                                     prefetch_bytes=args.prefetch_mb << 20)
                    row.update(source=name, latency_ms=lat, order=order,
                               vs_local=row["tokens_per_s"] / base["tokens_per_s"],
                               read_amplification=row["bytes_epoch1"] / tok_bytes)
                    tok_rows.append(row)
        for r in tok_rows:
            req = r.get("requests_epoch1", "-")
            amp = f"{r['read_amplification']:.2f}" if "read_amplification" in r else "-"
            vs = f"{r['vs_local']:.2f}" if "vs_local" in r else "1.00"
            print(f"| {r['source']} | {r['latency_ms']:.0f} ms | {r['order']} | {r['tokens_per_s'] / 1e6:.1f} M | {vs} | "
                  f"{r['first_batch_s']:.2f} s | {req} | {amp} |")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"floors": floors, "rows": rows, "token_rows": tok_rows, "compute_s": compute,
                                                   "images": res.records, "file_bytes": size,
                                                   "page_size": args.page_size}, indent=2))
        if args.chart:
            write_chart({"rows": rows, "page_size": args.page_size}, args.chart)
    finally:
        for srv in servers.values():
            srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
