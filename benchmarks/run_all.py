"""Every benchmark in one command: one targets table, JSON, markdown and PNG charts, with the machine it ran on.

    python -m benchmarks.run_all --quick              # every benchmark at its smallest settings (minutes)
    python -m benchmarks.run_all                      # the full tables (quiet machine)
    python -m benchmarks.run_all [--quick] --publish  # = --out docs/bench, then rewrite README's marked tables
    python -m benchmarks.run_all --only loaders tokens --runs 5   # re-measure some sections, keep the others

    # optional peers, each in its own virtual environment (built once; their rows say "not run: ..." if absent):
    bash benchmarks/peers/setup_ffcv.sh         # FFCV 1.0.2        -> benchmarks/.envs/ffcv
    bash benchmarks/peers/setup_streaming.sh    # MDS 0.13 + litdata -> benchmarks/.envs/streaming

Sections (``--only`` picks some):

- ``loaders``: pageset next to FFCV, Mosaic Streaming (MDS), litdata and the PyTorch DataLoader + Pillow on the
  same ImageNet-like folders cut from the real photos on this machine (``wheel_photos() + debian_photos()``,
  JPEG q90, long side at most 256 and 512 px; 320 images at 512 px with --quick). Every loader produces the
  same batches: RandomResizedCrop(224) + RandomHorizontalFlip + Normalize -> float32 [64, 3, 224, 224]. Each
  row runs in a fresh process (``benchmarks/peers/measure.py``: time to first batch from process start, a
  warm-up epoch, whole epochs timed until at least 2 s have passed, CPU per image and peak PSS of the process
  tree), ``--runs`` times, rows
  interleaved run by run, after one untimed pageset row that fills the Numba kernel cache; the table gives
  the median (min-max).
- ``images``, ``tokens``, ``write``, ``mixture``, ``producer_consumer``, ``manyfile_scale``, ``remote``, ``cold_start``,
  ``trainer_cost``, ``packing``, ``multimodal``: ``python -m
  benchmarks.<name>`` in a subprocess with ``--json <out>/<name>.json`` (and its small settings with --quick,
  its ``--runs``/``--repeats`` set to ``--runs``). Its peak RSS is the process's (``wait4``); the markdown
  tables it prints and the ``"targets"`` list of its JSON are collected.

Writes ``<out>/results.json`` (machine, data, command, every section, all targets), ``<out>/results.md``, the
per-benchmark JSONs and ``<out>/*.png`` (benchmarks/charts.py; needs matplotlib, the ``bench`` extra). Test data
and logs go to ``--work``. README's tables are generated from ``docs/bench/results.json`` by
``python -m benchmarks.tables --write`` (``--publish`` runs it); tests/test_bench_tables.py fails when they differ.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

# Before pageset / torch: importing measure starts the time-to-first-batch clock of --row processes.
from benchmarks.peers import measure  # isort: skip
from benchmarks import report  # isort: skip
from benchmarks.sections import BENCHES, SECTIONS  # isort: skip

ROOT = Path(__file__).resolve().parents[1]
ENVS = ROOT / "benchmarks" / ".envs"
PEERS = ROOT / "benchmarks" / "peers"
DOCS = ROOT / "docs" / "bench"
BATCH = 64



def log(msg: str) -> None:
    print(msg, flush=True)


# ---- one loader row, in this (fresh) process ----------------------------------------------------------------
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
        dl = torch.utils.data.DataLoader(PillowFolder(measure.image_folder(spec["folder"])), batch_size=BATCH,
                                         shuffle=True, num_workers=spec["workers"], drop_last=True,
                                         persistent_workers=spec["workers"] > 0)

        def make_iter(epoch):
            return iter(dl)

    def check(batch):
        img = batch["image"] if isinstance(batch, dict) else batch[0]
        assert tuple(img.shape) == (BATCH, 3, 224, 224) and img.dtype == torch.float32, (img.shape, img.dtype)

    measure.emit(measure.measure(make_iter, check))


class PillowFolder:
    """torchvision's ImageFolder + RandomResizedCrop + flip + ToTensor + Normalize, done in Pillow
    (``measure.pillow_transform``, the transform the streaming peers run too)."""

    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from PIL import Image

        path, label = self.files[i]
        with Image.open(path) as img:
            return measure.pillow_transform(img), label


# ---- subprocesses ---------------------------------------------------------------------------------------------
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


def run_process(cmd, log_path: Path, timeout: float) -> dict:
    """Run ``cmd`` with stdout+stderr to ``log_path``; {"rc", "wall_s", "peak_rss_mb", "timed_out"}.

    The peak RSS is ``wait4``'s ``ru_maxrss``: the largest resident set of the process (or of a descendant it
    waited for), not a sum over processes."""
    t = time.perf_counter()
    with open(log_path, "w") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline, timed_out = time.monotonic() + timeout, False
        try:
            while True:
                pid, status, ru = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    os.killpg(p.pid, signal.SIGKILL)  # its own session: the benchmark and the servers it started
                    pid, status, ru = os.wait4(p.pid, 0)
                    break
                time.sleep(0.2)
        except BaseException:  # Ctrl-C or an error here: do not leave the benchmark running
            os.killpg(p.pid, signal.SIGKILL)
            os.wait4(p.pid, 0)
            raise
        p.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": p.returncode, "wall_s": time.perf_counter() - t, "peak_rss_mb": ru.ru_maxrss / 1024,
            "timed_out": timed_out}


def script_flags(name: str) -> set[str]:
    """The --flags ``benchmarks/<name>.py`` defines (read from its source: no import, no torch start-up)."""
    src = (ROOT / "benchmarks" / f"{name}.py").read_text()
    return set(re.findall(r"add_argument\(\s*[\"'](--[a-z0-9][a-z0-9-]*)", src))


def bench_command(name: str, quick: bool, runs: int, out: Path) -> tuple[list[str], list[str]]:
    """(command, notes): the settings of ``BENCHES[name]`` the script supports, plus --json / --runs."""
    flags, spec, notes = script_flags(name), BENCHES[name], []
    cmd = [sys.executable, "-m", f"benchmarks.{name}"]
    if quick and "--quick" in flags:
        cmd.append("--quick")
    else:
        for flag, *vals in spec["quick" if quick else "full"]:
            if flag in flags:
                cmd += [flag, *vals]
            else:
                notes.append(f"{flag} not supported by benchmarks/{name}.py: its default used")
    runs_flag = next((f for f in ("--runs", "--repeats") if f in flags), None)
    if runs_flag:  # --runs, or more where the settings ask for more (mixture's noisy pairs: 9)
        if runs_flag in cmd:
            k = cmd.index(runs_flag)
            runs = max(runs, int(cmd[k + 1]))
            del cmd[k:k + 2]
        cmd += [runs_flag, str(runs)]
    else:
        notes.append(f"benchmarks/{name}.py has no --runs/--repeats: its rates are single runs")
    if "--json" in flags:
        cmd += ["--json", str(out / f"{name}.json")]
    else:
        notes.append(f"benchmarks/{name}.py has no --json: only its printed tables are kept")
    if spec.get("chart") and spec["chart"] in flags:
        cmd += [spec["chart"], str(out / f"{name}.png")]
    return cmd, notes


def run_bench(name: str, quick: bool, runs: int, out: Path, work: Path) -> dict:
    cmd, notes = bench_command(name, quick, runs, out)
    json_path = out / f"{name}.json"
    json_path.unlink(missing_ok=True)
    log(f"\n== {name}: {shlex.join(_rel(cmd))}")
    for n in notes:
        log(f"   note: {n}")
    proc = run_process(cmd, work / f"{name}.log", BENCHES[name]["timeout"])
    text = (work / f"{name}.log").read_text(errors="replace")
    res = {"command": shlex.join(_rel(cmd)), "notes": notes, **proc, "tables": report.markdown_tables(text),
           "json": json_path.name if json_path.exists() else None, "targets": []}
    if proc["rc"] != 0:
        tail = " | ".join(text.strip().splitlines()[-3:])[-400:]
        why = f"timed out after {BENCHES[name]['timeout']} s" if proc["timed_out"] else f"rc={proc['rc']}: {tail}"
        res["error"] = why
        res["targets"] = [_whole(name, f"benchmark failed: {why}")]
        log(f"   FAILED ({why}); log: {work / f'{name}.log'}")
        return res
    if not json_path.exists():
        res["targets"] = [_whole(name, f"no JSON written ({name}.json)")] if "--json" in script_flags(name) else []
    else:
        data = json.loads(json_path.read_text())
        for key in ("settings", "data", "machine"):
            if isinstance(data, dict) and key in data:
                res[key] = data[key]
        targets = data.get("targets") if isinstance(data, dict) else None
        if targets is None:
            res["targets"] = [_whole(name, f"{name}.json has no top-level \"targets\" list")]
        else:
            res["targets"] = [dict(t, benchmark=name) if isinstance(t, dict) else t for t in targets]
    for t in res["targets"]:
        bad = report.check_target(t)
        if bad:
            log(f"   target entry does not follow the contract: {bad}")
    log(f"   done in {proc['wall_s']:.0f} s, peak RSS {proc['peak_rss_mb']:.0f} MB, {len(res['tables'])} tables, "
        f"{len(res['targets'])} targets")
    return res


def _whole(bench: str, why: str) -> dict:
    return {"benchmark": bench, "name": "(whole benchmark)", "measured": None, "target": None, "unit": "",
            "met": None, "detail": f"not run: {why}"}


def _rel(cmd):
    """The command as typed from the repository root: ``python`` for this interpreter, relative paths."""
    out = []
    for c in map(str, cmd):
        if c == sys.executable:
            out.append("python")
        elif c.startswith(str(ROOT) + os.sep):
            out.append(os.path.relpath(c, ROOT))
        else:
            out.append(c)
    return out


# ---- the loaders section ----------------------------------------------------------------------------------------
def peer_python(name: str):
    """(python, None) for a built peer env, or (None, reason)."""
    py = ENVS / name / "bin" / "python"
    if not py.exists():
        script = {"ffcv": "setup_ffcv.sh", "streaming": "setup_streaming.sh"}[name]
        return None, f"{py.relative_to(ROOT)} missing: run `bash benchmarks/peers/{script}`"
    return str(py), None


def photo_facts(photos) -> dict:
    sizes = [os.path.getsize(p) for p in photos]
    return {"source_photos": len(photos), "source_mb": round(sum(sizes) / 1e6, 1),
            "source": "real photos: the scikit-image / scikit-learn wheels' samples (pageset.sample_data."
                      "wheel_photos) + Debian wallpapers when installed (debian_photos)",
            "from_wheels": sum("site-packages" in p for p in photos)}


def build_data(work: Path, sizes, n: int) -> tuple[dict, list]:
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
        jpgs = list(folder.rglob("*.jpg"))
        files = {"folder": str(folder), "images": len(jpgs), "classes": sum(1 for d in folder.iterdir() if d.is_dir()),
                 "folder_mb": round(sum(p.stat().st_size for p in jpgs) / 1e6, 1), "convert": {}}
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


def plan_rows(quick: bool, cores: int) -> list[dict]:
    threads = sorted({1, min(2, cores), cores})
    rows = []
    for enc in ("jpeg", "raw"):
        for t in threads:
            combos = [("random", "os"), ("quasi_random", "os"), ("quasi_random", "process")]
            if enc == "raw" or quick:
                combos = [("random", "os")] + ([("quasi_random", "process")] if t == cores else [])
            for order, cache in combos:
                rows.append({"kind": "pageset", "enc": enc, "order": order, "cache": cache, "workers": t})
    for w in ([1, cores] if quick else sorted({0, 1, cores})):
        rows.append({"kind": "dataloader", "workers": w})
    for w in sorted({1, cores}):
        rows.append({"kind": "ffcv", "order": "random", "os_cache": 1, "workers": w})
    if not quick:
        rows.append({"kind": "ffcv", "order": "quasi_random", "os_cache": 0, "workers": cores})
    for peer in ("mds", "litdata"):
        for w in ([cores] if quick else sorted({1, cores})):
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


ROW_KEYS = ("images_per_s", "first_batch_s", "cpu_s_per_image", "peak_rss_mb")


def run_loaders(args, cores: int) -> dict:
    work = Path(args.work)
    n = args.images or (320 if args.quick else 2000)
    sizes = args.sizes or ([512] if args.quick else [256, 512])
    data, photos = build_data(work, sizes, n)
    peers = {}
    for env in ("ffcv", "streaming"):
        peers[env] = (None, "--skip-peers") if args.skip_peers else peer_python(env)
        if peers[env][1]:
            log(f"  not run: {env}: {peers[env][1]}")
    rows, skipped = [], {}
    for S in sizes:
        d = data[S]
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
            d["convert"][peer] = r
            d[peer] = str(target)
            if "error" in r:
                skipped[peer] = f"convert failed: {r['error']}"
                log(f"  not run: {peer} ({S}px): {skipped[peer]}")
        specs = []
        for spec in plan_rows(args.quick, cores):
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
            name, fmt = label(spec)
            specs.append(({"size": S, "loader": name, "format": fmt, "workers": spec["workers"], "kind": k}, cmd))
        # One untimed pageset row first: it fills the Numba kernel cache, so no timed row pays the one-time
        # compile (benchmarks/images.py measures the first batch with a cold and a warm cache).
        warm = next((cmd for row, cmd in specs if row["kind"] == "pageset"), None)
        if warm is not None:
            r = run_json(warm)
            log(f"  warm-up row (untimed): {r.get('error') or 'first batch %.1f s' % r['first_batch_s']}")
        runs = [[] for _ in specs]
        for rep in range(args.runs):  # interleaved: run 1 of every row, then run 2, ... (the load drifts)
            for i, (row, cmd) in enumerate(specs):
                r = run_json(cmd)
                runs[i].append(r)
                what = (f"ERROR {r['error']}" if "error" in r else f"{r['images_per_s']:.0f} img/s, first batch "
                        f"{r['first_batch_s']:.2f} s, {r['peak_rss_mb']:.0f} MB")
                log(f"  run {rep + 1}/{args.runs} | {S}px | {row['loader']} | {row['format']} | "
                    f"{row['workers']} | {what}")
        for (row, _), rr in zip(specs, runs):
            ok = [r for r in rr if "error" not in r]
            row.update({k: report.stats(r[k] for r in ok) for k in ROW_KEYS})
            row["runs"] = rr
            if not ok:
                row["error"] = rr[-1]["error"]
            rows.append(row)
    res = {"settings": {"images": n, "sizes": sizes, "batch_size": BATCH, "runs": args.runs, "jpeg_quality": 90,
                        "pipeline": "RandomResizedCrop(224) + RandomHorizontalFlip + Normalize -> float32 "
                                    "[B,3,224,224]"},
           "data": {**photo_facts(photos), "sets": {S: {k: data[S][k] for k in ("images", "classes", "folder_mb")}
                                                    for S in sizes}},
           "rows": rows, "conversions": {S: data[S]["convert"] for S in sizes}, "skipped": skipped}
    res["peer_tokens"] = peer_tokens(args, peers, work, skipped)
    res["targets"] = loader_targets(res, cores)
    return res


def peer_tokens(args, peers, work: Path, skipped: dict):
    """litdata's TokensLoader (ds[i] + np.stack) tokens/s, when its env is built; else None."""
    py, why = peers["streaming"]
    if why:
        skipped["litdata tokens"] = why
        return None
    lit_dir = work / "litdata-tokens"
    shutil.rmtree(lit_dir, ignore_errors=True)
    r = run_json([py, str(PEERS / "streaming_bench.py"), "tokens", "--out", str(lit_dir), "--tokens",
                  str(2_000_000 if args.quick else 20_000_000)])
    if "error" in r:
        skipped["litdata tokens"] = r["error"]
        return None
    return r


def _paired(rows, a, b):
    """Per-run ratios a/b of two rows measured in the same interleaved runs: report.stats of them."""
    ra = [r.get("images_per_s") for r in a["runs"]]
    rb = [r.get("images_per_s") for r in b["runs"]]
    return report.stats(x / y for x, y in zip(ra, rb) if x and y)


def loader_targets(res: dict, cores: int) -> list[dict]:
    """Issue 13's loader-level targets at the largest max side: per thread against FFCV (JPEG >= 1.5x, raw
    >= 4x), and 2 threads >= 1.8x 1 thread, each a median of per-run ratios (runs interleaved)."""
    S = max(res["settings"]["sizes"])
    rows = [r for r in res["rows"] if r["size"] == S and "error" not in r]

    def find(kind, workers, fmt_start):
        return next((r for r in rows if r["kind"] == kind and r["workers"] == workers
                     and r["format"].startswith(fmt_start)), None)

    out = []
    jpeg1 = find("pageset", 1, "jpeg, random, page_cache=os")
    raw1 = find("pageset", 1, "raw, random, page_cache=os")
    ffcv1 = find("ffcv", 1, "jpg .beton, random")
    for name, row, goal in ((f"pageset JPEG vs FFCV, 1 thread each, {S} px", jpeg1, 1.5),
                            (f"pageset raw vs FFCV, 1 thread each, {S} px", raw1, 4.0)):
        if ffcv1 is None:
            why = res["skipped"].get("ffcv") or "no FFCV row"
            out.append(report.not_run(name, goal, "x", why))
        elif row is None:
            out.append(report.not_run(name, goal, "x", "no pageset row"))
        else:
            s = _paired(rows, row, ffcv1)
            out.append(report.target(name, s.get("median"), goal, "x", _detail(s, row, ffcv1, "img/s")))
    jpeg2 = find("pageset", 2, "jpeg, random, page_cache=os")
    name = f"pageset JPEG (Loader, fresh process), 2 threads vs 1, {S} px"
    if cores < 2:
        out.append(report.not_run(name, 1.8, "x", f"{cores} core"))
    elif jpeg1 is None or jpeg2 is None:
        out.append(report.not_run(name, 1.8, "x", "a pageset row failed"))
    else:
        s = _paired(rows, jpeg2, jpeg1)
        detail = _detail(s, jpeg2, jpeg1, "img/s")
        cpu1, cpu2 = (r.get("cpu_s_per_image", {}).get("median") for r in (jpeg1, jpeg2))
        if cpu1 and cpu2:  # equal CPU per image: the second thread costs nothing extra per image (no contention)
            detail += f"; CPU per image {cpu2 * 1e3:.3f} vs {cpu1 * 1e3:.3f} ms"
        if cores <= 2:  # the thread calling next() decodes too (Loader: the consumer runs queued slices)
            detail += f"; on {cores} cores 1 thread + the consumer already decode on 2 threads"
        out.append(report.target(name, s.get("median"), 1.8, "x", detail))
    for t in out:
        t["benchmark"] = "loaders"
    return out


def _detail(s, a, b, unit):
    if not s:
        return ""
    return (f"median of {s['runs']} paired runs ({s['min']:.2f}-{s['max']:.2f}); "
            f"{a['images_per_s']['median']:.0f} vs {b['images_per_s']['median']:.0f} {unit}")


def keep_earlier_sections(result: dict, path: Path) -> None:
    """``--only``: the sections this run skipped are taken from the results already in ``--out`` (each keeps its
    own "run": command, machine, load), so one section can be re-measured without re-running the others."""
    if not path.exists():
        return
    old = json.loads(path.read_text())
    kept = []
    if "loaders" not in result and old.get("loaders", {}).get("run"):
        result["loaders"] = old["loaders"]
        kept.append("loaders")
    for name, sec in old.get("benchmarks", {}).items():
        if name not in result["benchmarks"] and name in BENCHES and sec.get("run"):
            result["benchmarks"][name] = sec
            kept.append(name)
    result["benchmarks"] = {n: result["benchmarks"][n] for n in BENCHES if n in result["benchmarks"]}
    result["kept_from_earlier_runs"] = kept
    if kept:
        log(f"kept from the published results: {', '.join(kept)}")


# ---- the driver ----------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="every benchmark at its smallest settings")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=None, help="run only these sections; the others are kept from <out>/results.json if there")
    ap.add_argument("--runs", type=int, default=3, help="runs of every rate (median, min-max); at least 3")
    ap.add_argument("--images", type=int, default=None, help="loaders: images per folder (2000; 320 --quick)")
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help="loaders: max sides (256 512; 512 --quick)")
    ap.add_argument("--out", default="out/bench", help="JSON, markdown and charts")
    ap.add_argument("--work", default="out/bench-work", help="test data and each benchmark's log")
    ap.add_argument("--publish", action="store_true", help="--out docs/bench, then rewrite README's tables")
    ap.add_argument("--skip-peers", action="store_true", help="loaders: no FFCV / MDS / litdata rows")
    ap.add_argument("--row", help=argparse.SUPPRESS)  # internal: one measured loader row in a fresh process
    args = ap.parse_args(argv)
    if args.row:
        return row_main(json.loads(args.row))
    if args.runs < 3:
        ap.error("--runs must be at least 3 (tables give the median and min-max of the runs)")
    command = shlex.join(["python", "-m", "benchmarks.run_all", *(sys.argv[1:] if argv is None else argv)])
    out = DOCS if args.publish else Path(args.out)
    work = Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    sections = args.only or SECTIONS
    t_all = time.perf_counter()
    machine = report.machine_facts()
    log(f"{command}\nmachine: {report.machine_line(machine)}")

    result = {"benchmark": "run_all", "command": command, "quick": args.quick, "runs": args.runs,
              "sections": sections, "machine": machine, "benchmarks": {}}
    if "loaders" in sections:
        log("\n== loaders (one fresh process per row)")
        t = time.perf_counter()
        loaders = run_loaders(args, cores)
        loaders["wall_s"] = time.perf_counter() - t
        result["loaders"] = loaders
    for name in BENCHES:
        if name in sections:
            result["benchmarks"][name] = run_bench(name, args.quick, args.runs, out, work)
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["total_s"] = time.perf_counter() - t_all
    run = {k: result[k] for k in ("command", "quick", "runs", "machine", "loadavg_end")}
    for sec in [result.get("loaders"), *result["benchmarks"].values()]:
        if sec is not None:
            sec["run"] = run  # each section's own header (an --only run keeps the other sections' results)
    if args.only:
        keep_earlier_sections(result, out / "results.json")
    result["targets"] = (result.get("loaders", {}).get("targets", [])
                         + [t for b in result["benchmarks"].values() for t in b["targets"]])

    from benchmarks import tables

    text = json.dumps(result, indent=2, default=str) + "\n"
    (out / "results.json").write_text(text)
    result = json.loads(text)  # what README's tables and their test read back (string keys, lists)
    (out / "results.md").write_text(tables.results_md(result))
    log("\n" + "\n".join(report.targets_table(result["targets"])))
    try:
        from benchmarks.charts import write_charts

        for p in write_charts(result, out):
            log(f"chart: {p}")
    except ImportError as exc:
        log(f"no charts: {exc} (pip install '.[bench]' for matplotlib)")
    if args.publish:
        changed = tables.write_readme(ROOT / "README.md", result)
        log(f"README.md tables {'rewritten' if changed else 'already up to date'}")
    log(f"\nJSON: {out / 'results.json'}  markdown: {out / 'results.md'}  total {result['total_s']:.0f} s")


if __name__ == "__main__":
    main()
