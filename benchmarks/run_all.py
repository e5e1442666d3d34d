"""Every loader comparison this machine can run, in one command: JSON, a markdown table and PNG charts.

    .venv/bin/python -m benchmarks.run_all [--quick] [--out out/bench]

    # optional peers, each in its own virtual environment (built once; skipped with a reason when absent):
    bash benchmarks/peers/setup_ffcv.sh         # FFCV 1.0.2        -> benchmarks/.envs/ffcv
    bash benchmarks/peers/setup_streaming.sh    # MDS 0.13 + litdata -> benchmarks/.envs/streaming

Data: ImageNet-like ImageFolders cut from the real photos on this machine (``wheel_photos() + debian_photos()``),
long side at most 256 and 512 px, JPEG q90, ``--images`` each (2,000; 500 with --quick, 512 px only). Every
loader reads the same folder (converted to its own format) and produces the same batches: RandomResizedCrop(224)
+ RandomHorizontalFlip + Normalize -> float32 [B, 3, 224, 224], batch 64, drop_last.

Each row runs in a fresh process (``benchmarks/peers/measure.py``): time to first batch from process start,
then a full warm-up epoch, then a timed epoch (images/s, CPU seconds per image over the process tree, peak
PSS). Rows: pageset (1 and all threads; random / quasi_random; os / process page cache; JPEG and raw files),
the PyTorch DataLoader + Pillow baseline (0, 1, all workers), FFCV, Mosaic Streaming (MDS), litdata; then the
token loaders (benchmarks/tokens.py). Writes ``<out>/results.json``, ``<out>/results.md``, ``<out>/*.png``.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Before pageset / torch: importing measure starts the time-to-first-batch clock of --row processes.
from benchmarks.peers import measure

ROOT = Path(__file__).resolve().parents[1]
ENVS = ROOT / "benchmarks" / ".envs"
PEERS = ROOT / "benchmarks" / "peers"
BATCH = 64


# ---- one row, in this (fresh) process ---------------------------------------------------------------------
def row_main(spec: dict) -> None:
    import torch

    if spec["kind"] == "pageset":
        from pageset import Loader, Normalize, RandomHorizontalFlip, RandomResizedCrop, ToTensor, ToTorchImage

        pipe = {"image": [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(), ToTorchImage(), ToTensor()],
                "label": None}
        loader = Loader(spec["path"], batch_size=BATCH, pipelines=pipe, order=spec["order"],
                        num_threads=spec["workers"], page_cache=spec["cache"], seed=0)

        def make_iter(epoch):
            loader.set_epoch(epoch)
            return iter(loader)
    else:
        from benchmarks.images import PillowFolder

        files = measure.image_folder(spec["folder"])
        w = spec["workers"]
        dl = torch.utils.data.DataLoader(PillowFolder(files), batch_size=BATCH, shuffle=True, num_workers=w,
                                         drop_last=True, persistent_workers=w > 0)

        def make_iter(epoch):
            return iter(dl)

    def check(batch):
        img = batch["image"] if isinstance(batch, dict) else batch[0]
        assert tuple(img.shape) == (BATCH, 3, 224, 224) and img.dtype == torch.float32, (img.shape, img.dtype)

    row = measure.measure(make_iter, check)
    measure.emit(row)


# ---- the driver -----------------------------------------------------------------------------------------
def run_json(cmd, timeout=900, env=None) -> dict:
    """Run ``cmd``; the last stdout line starting with '{' is the result; else {"error": tail of the output}."""
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return {"error": f"rc={r.returncode}: " + " | ".join(tail)}
    out = json.loads(lines[-1])
    out["wall_s"] = time.perf_counter() - t
    return out


def peer_python(name: str):
    """(python, None) for a built peer env, or (None, reason)."""
    py = ENVS / name / "bin" / "python"
    if not py.exists():
        script = {"ffcv": "setup_ffcv.sh", "streaming": "setup_streaming.sh"}[name]
        return None, f"{py.relative_to(ROOT)} missing: run `bash benchmarks/peers/{script}` to build it"
    return str(py), None


def build_data(work: Path, sizes, n: int, log) -> dict:
    from pageset import Int, RGBImage, write_dataset
    from pageset.sample_data import debian_photos, make_imagenet_like, wheel_photos

    photos = wheel_photos() + debian_photos()
    data = {}
    for S in sizes:
        folder = work / f"folder{S}"
        stamp = folder / f".done-{n}-{len(photos)}"
        if not stamp.exists():
            shutil.rmtree(folder, ignore_errors=True)
            t = time.perf_counter()
            make_imagenet_like(folder, n, long_side=(int(S * 0.8), S), photos=photos, quality=(90, 90))
            stamp.touch()
            log(f"  built {folder} ({n} JPEGs, long side {int(S * 0.8)}-{S}) in {time.perf_counter() - t:.0f} s")
        mb = sum(p.stat().st_size for p in folder.rglob("*.jpg")) / 1e6
        files = {"folder": str(folder), "folder_mb": mb, "convert": {}}
        for enc in ("jpeg", "raw"):
            path = work / f"s{S}-{enc}.pageset"
            t = time.perf_counter()
            res = write_dataset(path, folder, {"image": RGBImage(max_resolution=S, encoding=enc, jpeg_quality=90),
                                               "label": Int()}, num_workers=os.cpu_count(), progress=False)
            files[enc] = str(path)
            files["convert"][f"pageset {enc}"] = {"convert_s": time.perf_counter() - t, "images": res.records,
                                                  "file_mb": res.bytes / 1e6}
        data[S] = files
    return data, photos


def plan_rows(S, quick, cores):
    all_t = sorted({1, cores})
    rows = []
    for enc in ("jpeg", "raw"):
        for t in all_t:
            combos = [("random", "os"), ("quasi_random", "os"), ("quasi_random", "process")]
            if enc == "raw" or quick:
                combos = [("random", "os")] + ([("quasi_random", "process")] if t == cores else [])
            for order, cache in combos:
                rows.append({"kind": "pageset", "enc": enc, "order": order, "cache": cache, "workers": t})
    for w in ([1, cores] if quick else sorted({0, 1, cores})):
        rows.append({"kind": "dataloader", "workers": w})
    for w in ([cores] if quick else all_t):
        rows.append({"kind": "ffcv", "order": "random", "os_cache": 1, "workers": w})
    if not quick:
        rows.append({"kind": "ffcv", "order": "quasi_random", "os_cache": 0, "workers": cores})
    for peer in ("mds", "litdata"):
        for w in ([cores] if quick else all_t):
            rows.append({"kind": peer, "workers": w})
    return rows


def label(spec) -> tuple[str, str]:
    k = spec["kind"]
    if k == "pageset":
        return "pageset", f"{spec['enc']}, {spec['order']}, page_cache={spec['cache']}"
    if k == "dataloader":
        return "DataLoader + Pillow", "JPEG files"
    if k == "ffcv":
        return "FFCV 1.0.2", f"jpg .beton, {spec['order']}, os_cache={bool(spec['os_cache'])}"
    return {"mds": "Mosaic Streaming 0.13 (MDS)", "litdata": "litdata 0.2.76"}[k], "JPEG bytes, shuffle"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="500 images, 512 px only, fewer rows (~3 min)")
    ap.add_argument("--images", type=int, default=None)
    ap.add_argument("--sizes", type=int, nargs="+", default=None)
    ap.add_argument("--out", default="out/bench")
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--row", help=argparse.SUPPRESS)  # internal: one measured row in a fresh process
    args = ap.parse_args()
    if args.row:
        return row_main(json.loads(args.row))

    out = Path(args.out)
    work = out / "data"
    work.mkdir(parents=True, exist_ok=True)
    n = args.images or (500 if args.quick else 2000)
    sizes = args.sizes or ([512] if args.quick else [256, 512])
    cores = os.cpu_count() or 1
    t_all = time.perf_counter()

    def log(msg):
        print(msg, flush=True)

    import torch

    machine = {"cpus": cores, "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "python": platform.python_version(), "torch": torch.__version__,
               "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
    settings = {"images": n, "sizes": sizes, "batch_size": BATCH, "quick": args.quick, "jpeg_quality": 90,
                "pipeline": "RandomResizedCrop(224) + RandomHorizontalFlip + Normalize -> float32 [B,3,224,224]"}
    log(f"settings: {settings}\nmachine: {machine}")
    data, photos = build_data(work, sizes, n, log)
    settings["source_photos"] = len(photos)

    peers = {}
    for env in ("ffcv", "streaming"):
        py, why = (None, "--skip-peers") if args.skip_peers else peer_python(env)
        peers[env] = (py, why)
        if why:
            log(f"SKIP {env}: {why}")

    results, skipped = [], {}
    for S in sizes:
        d = data[S]
        converts = dict(d["convert"])
        for peer, env in (("ffcv", "ffcv"), ("mds", "streaming"), ("litdata", "streaming")):
            py, why = peers[env]
            if why:
                skipped[peer] = why
                continue
            target = work / (f"s{S}.beton" if peer == "ffcv" else f"s{S}-{peer}")
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
            script = str(PEERS / ("ffcv_bench.py" if peer == "ffcv" else "streaming_bench.py"))
            cmd = [py, script, "convert", "--folder", d["folder"], "--out", str(target)]
            cmd += ["--max-res", str(S)] if peer == "ffcv" else ["--peer", peer]
            r = run_json(cmd)
            converts[peer] = r
            d[peer] = str(target)
            if "error" in r:
                skipped[peer] = f"convert failed: {r['error']}"
                log(f"SKIP {peer} ({S}px): {skipped[peer]}")
        d["convert"] = converts
        for spec in plan_rows(S, args.quick, cores):
            k = spec["kind"]
            if k in skipped:
                continue
            if k == "pageset":
                spec = dict(spec, path=d[spec["enc"]])
                cmd = [sys.executable, "-m", "benchmarks.run_all", "--row", json.dumps(spec)]
            elif k == "dataloader":
                spec = dict(spec, folder=d["folder"])
                cmd = [sys.executable, "-m", "benchmarks.run_all", "--row", json.dumps(spec)]
            elif k == "ffcv":
                cmd = [peers["ffcv"][0], str(PEERS / "ffcv_bench.py"), "load", "--path", d["ffcv"], "--workers",
                       str(spec["workers"]), "--order", spec["order"], "--os-cache", str(spec["os_cache"])]
            else:
                cmd = [peers["streaming"][0], str(PEERS / "streaming_bench.py"), "load", "--peer", k, "--path",
                       d[k], "--workers", str(spec["workers"])]
            r = run_json(cmd)
            name, fmt = label(spec)
            row = {"size": S, "loader": name, "format": fmt, "workers": spec["workers"], "kind": k, **r}
            results.append(row)
            if "error" in r:
                log(f"  {S}px | {name} | {fmt} | {spec['workers']} | ERROR {r['error']}")
            else:
                log(f"  {S}px | {name} | {fmt} | {spec['workers']} | {r['images_per_s']:.0f} img/s | first batch "
                    f"{r['first_batch_s']:.2f} s | {1000 * r['cpu_s_per_image']:.2f} CPU ms/img | "
                    f"{r['peak_rss_mb']:.0f} MB")

    # Extra pageset facts: decode-only rates and the cold/warm kernel-cache first batch (benchmarks/images.py).
    from benchmarks.images import decode_only, first_batch_times

    big = data[max(sizes)]
    pil, turbo = decode_only(big["jpeg"])
    cold, warm = first_batch_times(big["jpeg"])
    extras = {"decode_only_per_core_img_s": {"pillow": pil, "pageset_libjpeg_turbo": turbo},
              "pageset_first_batch_s": {"cold_numba_cache": cold, "warm_numba_cache": warm}}
    log(f"decode only ({max(sizes)} px, one core): Pillow {pil:.0f} img/s, pageset libjpeg-turbo {turbo:.0f} img/s; "
        f"pageset first batch cold kernel cache {cold:.1f} s, warm {warm:.1f} s")

    tok_json = out / "tokens.json"
    tok_cmd = [sys.executable, "-m", "benchmarks.tokens", "--json", str(tok_json),
               "--tokens", str(5_000_000 if args.quick else 20_000_000)]
    if args.quick:
        tok_cmd += ["--memory-mb", "16", "--seconds", "0.3"]
    r = subprocess.run(tok_cmd, cwd=ROOT, capture_output=True, text=True)
    tokens = json.loads(tok_json.read_text()) if r.returncode == 0 else {"error": r.stderr[-500:]}
    py, why = peers["streaming"]
    if why:
        skipped["litdata tokens"] = why
    elif "load" in tokens:
        lit_dir = work / "litdata-tokens"
        shutil.rmtree(lit_dir, ignore_errors=True)
        lt = run_json([py, str(PEERS / "streaming_bench.py"), "tokens", "--out", str(lit_dir), "--tokens",
                       str(5_000_000 if args.quick else 20_000_000)])
        if "error" in lt:
            skipped["litdata tokens"] = lt["error"]
        else:
            for key in tokens["load"]:  # "<dtype> <seq_len>": litdata's run is one measurement per seq_len
                tokens["load"][key]["litdata TokensLoader (ds[i] + np.stack)"] = [lt[key.split()[-1]]]

    result = {"benchmark": "run_all", "settings": settings, "machine": machine, "results": results,
              "conversions": {S: data[S]["convert"] for S in sizes}, "skipped": skipped, "extras": extras,
              "tokens": tokens, "total_s": time.perf_counter() - t_all}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (out / "results.md").write_text(md)
    print("\n" + md)
    try:
        from benchmarks.charts import write_charts

        for p in write_charts(result, out):
            log(f"chart: {p}")
    except ImportError as exc:
        log(f"no charts ({exc}): pip install -e '.[bench]'")
    log(f"JSON: {out / 'results.json'}  table: {out / 'results.md'}  total {time.perf_counter() - t_all:.0f} s")


def markdown(res: dict) -> str:
    s, m = res["settings"], res["machine"]
    lines = [f"Images: {s['pipeline']}, batch {s['batch_size']}, {s['images']} ImageNet-like JPEGs (q90) per size "
             f"from {s.get('source_photos')} real photos; {m['cpus']} cores ({m['processor']}), {m['mem_gb']} GB, "
             f"torch {m['torch']}. Timed: the second epoch of a fresh process; first batch: from process start.",
             "",
             "| max side | loader | format / order | workers | images/s | vs DataLoader | vs FFCV | first batch s "
             "| CPU ms/image | peak RSS MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ok = [r for r in res["results"] if "error" not in r]
    for r in res["results"]:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['loader']} | {r['format']} | {r['workers']} | error: "
                         f"{r['error'][:80]} | | | | | |")
            continue
        same = [x for x in ok if x["size"] == r["size"] and x["workers"] == max(r["workers"], 1)]
        dl = next((x for x in same if x["kind"] == "dataloader"), None)
        ff = [x for x in same if x["kind"] == "ffcv" and x["format"].endswith("os_cache=True")]
        vs_dl = f"{r['images_per_s'] / dl['images_per_s']:.2f}x" if dl else "-"
        vs_ff = f"{r['images_per_s'] / ff[0]['images_per_s']:.2f}x" if ff else "-"
        lines.append(f"| {r['size']} | {r['loader']} | {r['format']} | {r['workers']} | {r['images_per_s']:.0f} | "
                     f"{vs_dl} | {vs_ff} | {r['first_batch_s']:.2f} | {1000 * r['cpu_s_per_image']:.2f} | "
                     f"{r['peak_rss_mb']:.0f} |")
    lines += ["", "Ratios compare rows of the same max side and worker count (workers 0 compares with 1).", ""]
    lines += ["| conversion | max side | seconds | MB |", "|---|---|---|---|"]
    for S, conv in res["conversions"].items():
        for name, c in conv.items():
            if "error" not in c:
                lines.append(f"| {name} | {S} | {c['convert_s']:.1f} | {c['file_mb']:.1f} |")
    for peer, why in res["skipped"].items():
        lines.append(f"\nskipped {peer}: {why}")
    e = res["extras"]
    lines.append(f"\nDecode only, one core: Pillow {e['decode_only_per_core_img_s']['pillow']:.0f} img/s, pageset's "
                 f"libjpeg-turbo kernel {e['decode_only_per_core_img_s']['pageset_libjpeg_turbo']:.0f} img/s. pageset "
                 f"first batch in a new process: {e['pageset_first_batch_s']['cold_numba_cache']:.1f} s with an empty "
                 f"Numba cache, {e['pageset_first_batch_s']['warm_numba_cache']:.1f} s warm.")
    tok = res["tokens"]
    if "load" in tok:
        import numpy as np

        lines += ["", "| token loader (B=32) | file, seq_len | tokens/s, median (min-max) | vs nanoGPT | "
                  "vs gather_windows alone |", "|---|---|---|---|---|"]
        for key, rows in tok["load"].items():
            base = float(np.median(rows["nanoGPT get_batch"]))
            kernel = float(np.median(rows["gather_windows alone (kernel, mmap)"]))
            for k, v in rows.items():
                m = float(np.median(v))
                lines.append(f"| {k} | {key} | {m / 1e6:.1f} M ({min(v) / 1e6:.0f}-{max(v) / 1e6:.0f}) | "
                             f"{m / base:.1f}x | {m / kernel:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
