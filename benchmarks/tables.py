"""README's benchmark tables, generated from ``docs/bench/results.json`` (a ``benchmarks.run_all`` result).

    python -m benchmarks.tables --check    # exit 1 and name the stale tables if README differs from the JSON
    python -m benchmarks.tables --write    # rewrite README's marked tables from the JSON
    python -m benchmarks.tables --print NAME

README holds each table between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``; NAME is ``targets``,
``loaders`` or a benchmark run_all ran (``images``, ``tokens``, ``write``, ``mixture``, ``producer_consumer``,
``remote``). Each block starts with the machine, the data and the command that produced it, so README never
holds a hand-typed number; tests/test_bench_tables.py fails when a block differs from what this module makes
of the committed JSON. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from benchmarks import report
from benchmarks.sections import BENCHES

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "bench" / "results.json"
README = ROOT / "README.md"
MARKER = re.compile(r"<!-- bench:([a-z_]+) -->\n(.*?)<!-- /bench:\1 -->", re.S)


def _header(res: dict, extra: list[str] = (), section: dict | None = None) -> list[str]:
    run = (section or {}).get("run") or res  # the run that measured this section
    mode = "quick settings" if run.get("quick") else "full settings"
    lines = [f"Measured with `{run['command']}` ({mode}, every rate the median of {run.get('runs', '?')} runs "
             f"with min-max unless a table says otherwise) on {report.machine_line(run['machine'], run.get('loadavg_end'))}."]
    lines += list(extra)
    return [" ".join(lines), ""] if len(lines) == 1 else [lines[0], "", *lines[1:], ""]


def block_targets(res: dict) -> str:
    kept = res.get("kept_from_earlier_runs")
    lines = _header(res, [f"Kept from earlier runs (their tables below name their own command and machine): "
                          f"{', '.join(kept)}."] if kept else [])
    lines += report.targets_table(res.get("targets", []))
    return "\n".join(lines) + "\n"


def _row_cells(r: dict, rows: list[dict]) -> list:
    if "error" in r:
        return [r["size"], r["loader"], r["format"], r["workers"], f"error: {r['error'][:80]}", "", "", "", "", ""]
    same = [x for x in rows if "error" not in x and x["size"] == r["size"] and x["workers"] == max(r["workers"], 1)]
    dl = next((x for x in same if x["kind"] == "dataloader"), None)
    ff = next((x for x in same if x["kind"] == "ffcv" and x["format"].endswith("os_cache=True")), None)
    med = r["images_per_s"]["median"]
    return [r["size"], r["loader"], r["format"], r["workers"], report.fmt_stats(r["images_per_s"]),
            f"{med / dl['images_per_s']['median']:.2f}x" if dl else "-",
            f"{med / ff['images_per_s']['median']:.2f}x" if ff else "-",
            report.fmt_stats(r["first_batch_s"], "{:.2f}"), report.fmt_stats(r["cpu_s_per_image"], "{:.2f}", 1e3),
            report.fmt_stats(r["peak_rss_mb"])]


def block_loaders(res: dict) -> str:
    ld = res.get("loaders")
    if ld is None:
        return _absent(res, "loaders")
    s, d = ld["settings"], ld["data"]
    sets = "; ".join(f"max side {S}: {v['images']} JPEGs in {v['classes']} classes, {v['folder_mb']} MB"
                     for S, v in d["sets"].items())
    lines = _header(res, [
        f"Data: ImageNet-like folders cut from {d['source_photos']} {d['source']} ({d['source_mb']} MB of "
        f"sources), JPEG q{s['jpeg_quality']}; {sets}. Every loader: {s['pipeline']}, batch {s['batch_size']}. "
        "Each row is a fresh process: images/s of its second epoch, first batch from process start (warm Numba "
        "kernel cache), CPU time of the process tree per image, peak PSS of the process tree; "
        f"median (min-max) of {s['runs']} runs, rows interleaved."], ld)
    lines += report.md_table(["max side", "loader", "format / order", "threads / workers", "images/s",
                              "vs DataLoader", "vs FFCV", "first batch s", "CPU ms/image", "peak RSS MB"],
                             [_row_cells(r, ld["rows"]) for r in ld["rows"]])
    lines += ["", "Ratios compare the medians of rows with the same max side and worker count (0 workers with 1).",
              ""]
    conv = [[name, S, f"{c['convert_s']:.1f}", f"{c['file_mb']:.1f}"] for S, cs in ld["conversions"].items()
            for name, c in cs.items() if "error" not in c]
    lines += report.md_table(["conversion (one run)", "max side", "seconds", "file MB"], conv)
    pt = ld.get("peer_tokens")
    if pt:
        lines += ["", "litdata TokensLoader (ds[i] + np.stack), one run per seq_len: "
                  + ", ".join(f"seq_len {k}: {v / 1e6:.1f} M tokens/s" for k, v in pt.items()
                              if k.isdigit() and isinstance(v, (int, float)))]
    for peer, why in ld.get("skipped", {}).items():
        lines += ["", f"Not run: {peer}: {why}"]
    return "\n".join(lines) + "\n"


def block_bench(res: dict, name: str) -> str:
    b = res.get("benchmarks", {}).get(name)
    if b is None:
        return _absent(res, name)
    extra = [f"This table: `{b['command']}` (peak RSS of the process {b['peak_rss_mb']:.0f} MB, "
             f"{b['wall_s']:.0f} s)."]
    info = b.get("data") or b.get("settings")
    if isinstance(info, dict) and info:
        extra.append("Settings: " + ", ".join(f"{k}={_short(v)}" for k, v in info.items() if k != "json") + ".")
    for note in b.get("notes", []):
        extra.append(f"Note: {note}.")
    lines = _header(res, extra, b)
    if "error" in b:
        lines.append(f"Not run: {b['error']}")
    for t in b.get("tables", []):
        if t.get("caption"):
            lines += [t["caption"], ""]
        lines += t["lines"] + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _short(v) -> str:
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= 60 else s[:57] + "..."


def _absent(res: dict, name: str) -> str:
    return (f"Not in the committed run (`{res['command']}`). Run `python -m benchmarks.run_all --only {name}` "
            "(add `--quick` for small settings).\n")


def blocks(res: dict) -> dict[str, str]:
    """{marker name: markdown} for every table the result can give."""
    out = {"targets": block_targets(res), "loaders": block_loaders(res)}
    for name in BENCHES:
        out[name] = block_bench(res, name)
    return out


def results_md(res: dict) -> str:
    """docs/bench/results.md: every block, titled."""
    parts = ["# Benchmark results\n\nGenerated by `python -m benchmarks.tables` from results.json.\n"]
    for name, text in blocks(res).items():
        parts.append(f"## {name}\n\n{text}")
    return "\n".join(parts)


def render_readme(text: str, res: dict) -> str:
    """``text`` with every marked block replaced by its generated table; an unknown marker name raises."""
    gen = blocks(res)

    def sub(m):
        if m.group(1) not in gen:
            raise KeyError(f"README marker bench:{m.group(1)} names no table (known: {', '.join(gen)})")
        return f"<!-- bench:{m.group(1)} -->\n{gen[m.group(1)]}<!-- /bench:{m.group(1)} -->"

    return MARKER.sub(sub, text)


def stale_blocks(text: str, res: dict) -> list[str]:
    """Names of README blocks whose content differs from the generated table."""
    gen = blocks(res)
    return [m.group(1) for m in MARKER.finditer(text) if gen.get(m.group(1)) != m.group(2)]


def write_readme(path: Path, res: dict) -> bool:
    old = Path(path).read_text()
    new = render_readme(old, res)
    if new != old:
        Path(path).write_text(new)
    return new != old


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--readme", default=str(README))
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--check", action="store_true")
    g.add_argument("--write", action="store_true")
    g.add_argument("--print", metavar="NAME")
    args = ap.parse_args(argv)
    res = json.loads(Path(args.results).read_text())
    if args.print:
        sys.stdout.write(blocks(res)[args.print])
        return 0
    if args.write:
        changed = write_readme(Path(args.readme), res)
        Path(args.results).with_name("results.md").write_text(results_md(res))
        print(f"{args.readme}: {'rewritten' if changed else 'up to date'}")
        return 0
    stale = stale_blocks(Path(args.readme).read_text(), res)
    if stale:
        print(f"{args.readme}: stale tables {', '.join(stale)}: run python -m benchmarks.tables --write")
        return 1
    print(f"{args.readme}: tables match {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
