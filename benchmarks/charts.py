"""PNG charts of a ``benchmarks/run_all.py`` result (matplotlib, Agg backend: no display needed).

    .venv/bin/python -m benchmarks.charts out/bench/results.json     # re-draw from a saved result

Charts: ``images_per_s.png`` (images/s by loader, one panel per max side, bars per worker count) and
``first_batch.png`` (seconds from process start to the first batch, all threads/workers).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _short(r) -> str:
    fmt = r["format"].replace("page_cache=", "").replace("os_cache=True", "os cache").replace("os_cache=False", "no os cache")
    return f"{r['loader']}\n{fmt}"


def write_charts(result: dict, out_dir) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    rows = [r for r in result["results"] if "error" not in r]
    sizes = sorted({r["size"] for r in rows})
    cpus = result["machine"]["cpus"]
    paths = []

    fig, axes = plt.subplots(1, len(sizes), figsize=(7 * len(sizes), 0.45 * max(8, len(rows) / len(sizes) * 1.1) + 1.5),
                             squeeze=False)
    for ax, S in zip(axes[0], sizes):
        sub = [r for r in rows if r["size"] == S]
        labels = list(dict.fromkeys(_short(r) for r in sub))
        workers = sorted({r["workers"] for r in sub})
        h = 0.8 / len(workers)
        for j, w in enumerate(workers):
            ys, xs = [], []
            for i, lab in enumerate(labels):
                hit = [r for r in sub if _short(r) == lab and r["workers"] == w]
                if hit:
                    ys.append(i + (j - (len(workers) - 1) / 2) * h)
                    xs.append(hit[0]["images_per_s"])
            ax.barh(ys, xs, height=h, label=f"{w} threads/workers")
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("images/s (higher is better)")
        ax.set_title(f"max side {S} px", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"RandomResizedCrop(224)+flip+normalize -> float32, batch 64; {cpus}-core CPU, "
                 f"{result['settings']['images']} real-photo JPEGs per size", fontsize=10)
    fig.tight_layout()
    p = out_dir / "images_per_s.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    sub = [r for r in rows if r["workers"] == cpus]
    fig, ax = plt.subplots(figsize=(10, 0.4 * max(6, len(sub)) + 1.2))
    labels = [f"{_short(r).replace(chr(10), ', ')} ({r['size']} px)" for r in sub]
    ax.barh(range(len(sub)), [r["first_batch_s"] for r in sub], color="tab:orange")
    ax.set_yticks(range(len(sub)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from process start to the first batch (lower is better)")
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
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "out/bench/results.json")
    for path in write_charts(json.loads(src.read_text()), src.parent):
        print(path)
