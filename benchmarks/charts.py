"""PNG charts of a ``benchmarks/run_all.py`` result (matplotlib, Agg backend: no display needed).

    python -m benchmarks.charts docs/bench/results.json     # re-draw next to a saved result

Charts: ``targets.png`` (every target's measured / goal, met or not, "not run" labelled), and from the loaders
section ``images_per_s.png`` (images/s by loader, one panel per max side, bars per worker count, min-max
whiskers) and ``first_batch.png`` (seconds from process start to the first batch, all threads/workers).
matplotlib comes with the ``bench`` extra (``pip install '.[bench]'``); without it ``write_charts`` raises
ImportError and run_all prints that no charts were drawn.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path


def _short(r) -> str:
    fmt = r["format"].replace("page_cache=", "").replace("os_cache=True", "os cache").replace("os_cache=False", "no os cache")
    return f"{r['loader']}\n{fmt}"


def write_charts(result: dict, out_dir) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    paths = [_targets_chart(plt, result, out_dir / "targets.png")]
    if result.get("loaders"):
        paths += _loader_charts(plt, result, out_dir)
    return [p for p in paths if p is not None]


def _targets_chart(plt, result, path):
    ts = [t for t in result.get("targets", []) if isinstance(t, dict) and t.get("target")]
    if not ts:
        return None
    fig, ax = plt.subplots(figsize=(11, 0.4 * len(ts) + 1.6))
    cap = 3.0  # bars past 3x the goal are cut there; the label keeps the value
    for i, t in enumerate(ts):
        name = f"{t.get('benchmark', '')}: {t['name']}"
        if t.get("measured") is None:
            ax.text(0.02, i, "not run", va="center", fontsize=7, color="gray")
            continue
        # lower-is-better targets are drawn as goal / measured, so > 1 always means better than the goal
        v = t["measured"] / t["target"] if t.get("higher_is_better", True) else t["target"] / max(t["measured"], 1e-12)
        ax.barh(i, min(v, cap), color="tab:green" if t["met"] else "tab:red")
        ax.text(min(v, cap), i, f" {v:.2f}", va="center", fontsize=7)
        name += "" if t.get("higher_is_better", True) else " (goal / measured)"
        ts[i] = dict(t, _label=name)
    ax.set_yticks(range(len(ts)), [textwrap.fill(t.get("_label", f"{t.get('benchmark', '')}: {t['name']}"), 60)
                                   for t in ts], fontsize=6)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlim(0, cap + 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("measured / goal (>= 1: target met; green met, red not met)")
    ax.set_title(f"targets: {result.get('command', '')}\n{result['machine'].get('cpu_model', '')}, "
                 f"{result['machine'].get('cpus')} cores, {result['machine'].get('time_utc', '')}", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.subplots_adjust(left=0.36, right=0.97, top=1 - 0.9 / fig.get_figheight(), bottom=0.7 / fig.get_figheight())
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _loader_charts(plt, result, out_dir):
    ld = result["loaders"]
    rows = [r for r in ld["rows"] if "error" not in r]
    if not rows:
        return []
    sizes = sorted({r["size"] for r in rows})
    cpus = result["machine"]["cpus"]
    runs = ld["settings"]["runs"]
    paths = []

    fig, axes = plt.subplots(1, len(sizes), figsize=(7 * len(sizes), 0.45 * max(8, len(rows) / len(sizes) * 1.1) + 1.5),
                             squeeze=False)
    for ax, S in zip(axes[0], sizes):
        sub = [r for r in rows if r["size"] == S]
        labels = list(dict.fromkeys(_short(r) for r in sub))
        workers = sorted({r["workers"] for r in sub})
        h = 0.8 / len(workers)
        for j, w in enumerate(workers):
            ys, xs, lo, hi = [], [], [], []
            for i, lab in enumerate(labels):
                hit = [r for r in sub if _short(r) == lab and r["workers"] == w]
                if hit:
                    s = hit[0]["images_per_s"]
                    ys.append(i + (j - (len(workers) - 1) / 2) * h)
                    xs.append(s["median"])
                    lo.append(s["median"] - s["min"])
                    hi.append(s["max"] - s["median"])
            ax.barh(ys, xs, height=h, xerr=[lo, hi], capsize=2, label=f"{w} threads/workers")
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(f"images/s, median of {runs} runs, min-max whiskers (higher is better)")
        ax.set_title(f"max side {S} px", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"RandomResizedCrop(224)+flip+normalize -> float32, batch 64\n{cpus}-core "
                 f"{result['machine'].get('cpu_model', 'CPU')}, {ld['settings']['images']} real-photo JPEGs per size",
                 fontsize=9)
    fig.tight_layout()
    p = out_dir / "images_per_s.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    sub = [r for r in rows if r["workers"] == cpus]
    fig, ax = plt.subplots(figsize=(10, 0.4 * max(6, len(sub)) + 1.2))
    labels = [f"{_short(r).replace(chr(10), ', ')} ({r['size']} px)" for r in sub]
    ax.barh(range(len(sub)), [r["first_batch_s"]["median"] for r in sub], color="tab:orange",
            xerr=[[r["first_batch_s"]["median"] - r["first_batch_s"]["min"] for r in sub],
                  [r["first_batch_s"]["max"] - r["first_batch_s"]["median"] for r in sub]], capsize=2)
    ax.set_yticks(range(len(sub)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds from process start to the first batch, median of {runs} (lower is better)")
    ax.set_title(f"time to first batch, {cpus} threads/workers\n(imports + open + JIT or kernel cache + worker start + first decode)",
                 fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    p = out_dir / "first_batch.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


if __name__ == "__main__":
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/bench/results.json")
    for path in write_charts(json.loads(src.read_text()), src.parent):
        print(path)
