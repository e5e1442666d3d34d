"""Train a tiny GPT on CPU from a pageset token file of a real corpus, then kill it mid-epoch and resume it.

    .venv/bin/python -m benchmarks.train_gpt [--steps 300] [--out out/gpt] [--json out/gpt/result.json]

Corpus: the ``fortunes`` collection (``apt-get install fortunes``: ~15,000 documents split by ``%`` lines) when
installed, else the METADATA files of the installed Python packages (real English documents, several MB).
Tokenizer: a byte-level BPE with a 1,024-token vocabulary trained on the corpus with HF ``tokenizers`` (seconds;
a small vocabulary keeps the output layer cheap on a CPU), saved as tokenizer.json and used by ``write_tokens``.
Loader: ``TokenWindows(seq_len=64, document_outputs=True)``: the model attends only inside each document
(block-diagonal causal mask from ``doc_ids``), uses ``position_ids`` that restart at every document, and is
trained on ``labels`` (-100 after an EOS: no cross-document prediction).

Then the same kill-and-resume check as train_cnn (benchmarks/killresume.py): SIGKILL mid-epoch after a
checkpoint, restart, and compare with the uninterrupted run: same windows in the same order, identical losses.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path

from benchmarks.killresume import add_worker_args, kill_and_resume, record_step, restore

SEQ_LEN = 64
VOCAB = 1024


def documents() -> tuple[list[str], str]:
    """(documents, corpus name): fortunes when installed, else installed packages' METADATA files."""
    files = sorted(p for p in glob.glob("/usr/share/games/fortunes/*") if "." not in os.path.basename(p))
    docs: list[str] = []
    for p in files:
        with open(p, encoding="utf-8", errors="replace") as f:
            docs += [d.strip() for d in f.read().split("\n%\n") if d.strip()]
    if len(docs) > 1000:
        return docs, f"fortunes ({len(files)} files)"
    meta = sorted(glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "*.dist-info", "METADATA")))
    return [Path(p).read_text(encoding="utf-8", errors="replace") for p in meta], "installed packages' METADATA"


def build_file(out: Path, max_docs: int | None) -> Path:
    from tokenizers import ByteLevelBPETokenizer

    from pageset import write_tokens

    docs, name = documents()
    docs = docs[:max_docs] if max_docs else docs
    out.mkdir(parents=True, exist_ok=True)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(docs, vocab_size=VOCAB, min_frequency=2, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    tok.save(str(out / "tokenizer.json"))
    path = out / "corpus.pageset"
    res = write_tokens(path, docs, str(out / "tokenizer.json"), num_workers=0, progress=False)
    print(f"corpus: {name}, {res.documents} documents, {res.tokens} tokens ({res.dtype}), vocab {VOCAB}")
    return path


def make_model():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            self.heads = heads

        def forward(self, x, mask):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.ln2(x))

    class TinyGPT(nn.Module):
        def __init__(self, vocab=VOCAB, d=128, layers=2, heads=4, ctx=SEQ_LEN):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, idx, position_ids, doc_ids):
            t = idx.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # block-diagonal: no attention across documents
            mask = (causal & same_doc)[:, None]
            x = self.tok(idx) + self.pos(position_ids)
            for blk in self.blocks:
                x = blk(x, mask)
            return self.head(self.ln(x))

    return TinyGPT()


def worker(args) -> None:
    import torch
    import torch.nn.functional as F

    from pageset import Loader, TokenWindows, ToTensor

    torch.set_num_threads(1)  # this script's choice, for bit-exact losses; pageset never sets it
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = Loader(args.data, batch_size=args.batch_size, order="quasi_random", seed=0, window_pages=4,
                    num_threads=args.threads,
                    pipelines={"tokens": [TokenWindows(SEQ_LEN, document_outputs=True), ToTensor()]})
    done = restore(args, model, opt, loader)
    log_path = Path(args.log)
    log = open(log_path, "a")
    while done < args.steps:
        epoch = loader.epoch
        for batch in loader:
            logits = model(batch["input"], batch["position_ids"], batch["doc_ids"])
            loss = F.cross_entropy(logits.view(-1, VOCAB), batch["labels"].view(-1), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += 1
            record_step(args, log, done, epoch, float(loss), batch, model, opt, loader)
            if done == args.steps:
                break
    log.close()
    losses = [json.loads(ln)["loss"] for ln in log_path.read_text().splitlines()]
    k = max(1, len(losses) // 10)
    print(json.dumps({"first_loss": sum(losses[:k]) / k, "last_loss": sum(losses[-k:]) / k, "steps": done}))


def run(args) -> dict:
    from pageset import Loader, TokenWindows

    out = Path(args.out)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # this script's own setting, before any fork
    data = build_file(out, args.max_docs)
    with Loader(data, batch_size=args.batch_size, pipelines={"tokens": [TokenWindows(SEQ_LEN)]}) as ld:
        steps_per_epoch = ld.steps_per_epoch
    stall = args.stall_at or min(args.steps - 1, args.steps * 2 // 3 + 3)  # 3 steps past a checkpoint are lost
    worker_args = ["--data", str(data), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                   "--threads", str(args.threads)]
    res = kill_and_resume("benchmarks.train_gpt", worker_args, out, args.steps, steps_per_epoch, args.ckpt_every,
                          stall)
    c = res["control"]
    print(f"tiny GPT: {args.steps} steps of {args.batch_size} x {SEQ_LEN} tokens in {res['train_s']:.1f} s; mean "
          f"loss of the first tenth {c['first_loss']:.3f} -> last tenth {c['last_loss']:.3f}")
    return {"steps": args.steps, "steps_per_epoch": steps_per_epoch, "batch_size": args.batch_size,
            "seq_len": SEQ_LEN, **res}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="loader threads")
    ap.add_argument("--max-docs", type=int, default=None, help="use only the first N documents (CI)")
    ap.add_argument("--ckpt-every", type=int, default=25)
    ap.add_argument("--stall-at", type=int, default=0)
    ap.add_argument("--out", default="out/gpt")
    ap.add_argument("--json", default=None)
    add_worker_args(ap, "--data")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    res = run(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
    if not (res["same_sample_stream"] and res["same_losses"]):
        raise SystemExit("FAIL: the resumed run differs from the uninterrupted one")
    if not res["control"]["last_loss"] < res["control"]["first_loss"] - 0.5:
        raise SystemExit("FAIL: the loss did not fall")


if __name__ == "__main__":
    main()
