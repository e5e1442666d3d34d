"""LLaVA-format data as a write source (issue 32): ``LlavaSource(data, chat, image_folder)`` writes each entry's
conversation (roles human/gpt, ``<image>`` placeholders) and its images, as LLaVA's training script reads the
file.

Independent expectations: the stored ids and loss masks equal transformers' ``apply_chat_template(...,
return_assistant_tokens_mask=True)`` on the entry converted by hand (human -> user, gpt -> assistant); each stored
image is its source photo resized with Pillow to the stored size (PSNR); the reference reader reads the file.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from reference.format import RefDataset
from test_vlm import N_IMAGES, TEMPLATE, _conversation, chat, hf, tokenizer_file  # noqa: F401 (fixtures)

from pageset import ChatTokenizer, LlavaSource, RGBImages, SampleError, TokenIds, write_dataset
from pageset.sample_data import make_imagenet_like

from benchmarks.multimodal import package_summaries

FIELDS = {"conversation": TokenIds(loss_mask=True), "images": RGBImages(max_resolution=384)}


@pytest.fixture(scope="module")
def llava(tmp_path_factory, photos):
    """12 LLaVA entries (10 with 2-3 images as lists, one with one image as a path, one text-only) over 24 real
    photo crops in an image folder; returns (tmp, entries, the same conversations with user/assistant roles)."""
    tmp = tmp_path_factory.mktemp("llava")
    root = make_imagenet_like(tmp / "imgs", 24, long_side=(200, 640), photos=photos, seed=7)
    rel = sorted(str(p.relative_to(root)) for p in root.rglob("*.jpg"))
    lines = package_summaries()
    entries, convs, at = [], [], 0
    for k, n in enumerate(N_IMAGES):
        conv = _conversation(k, n, lines)
        convs.append(conv)
        turns = [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in conv]
        entry = {"id": f"llava-{k:03d}", "conversations": turns}
        images = [rel[(at + i) % len(rel)] for i in range(n)]
        at += n
        if n == 1:
            entry["image"] = images[0]
        elif n:
            entry["image"] = images
        entries.append(entry)
    (tmp / "data.json").write_text(json.dumps(entries))
    (tmp / "data.jsonl").write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    return tmp, entries, convs


def _psnr(a, b):
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_entries_are_written_as_the_chat_template_and_the_photos(llava, chat, hf, tmp_path):  # noqa: F811
    folder, entries, convs = llava
    out = tmp_path / "llava.pageset"
    write_dataset(out, LlavaSource(folder / "data.json", chat, folder / "imgs"), FIELDS, num_workers=2,
                  page_size=1 << 16, progress=False)
    ref = RefDataset(out.read_bytes(), str(out))
    assert len(ref.records) == len(entries)
    for i, (entry, conv) in enumerate(zip(entries, convs)):
        want = hf.apply_chat_template(conv, chat_template=TEMPLATE, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        got = ref.records[i]["conversation"]
        assert got["input_ids"] == list(want["input_ids"]) and got["loss_mask"] == list(want["assistant_masks"])
        image = entry.get("image", [])
        paths = [image] if isinstance(image, str) else image
        stored = ref.records[i]["images"]
        assert len(stored) == len(paths) == N_IMAGES[i]
        for s, p in zip(stored, paths):
            img = np.asarray(Image.open(io.BytesIO(s["data"])).convert("RGB"))
            assert img.shape[:2] == (s["height"], s["width"]) and max(img.shape[:2]) <= 384
            src = Image.open(folder / "imgs" / p).convert("RGB").resize((s["width"], s["height"]), Image.BILINEAR)
            assert _psnr(img, np.asarray(src)) > 28.0, p
    # the same entries as JSON lines, written in this process: the same records
    lines = tmp_path / "lines.pageset"
    write_dataset(lines, LlavaSource(folder / "data.jsonl", chat, folder / "imgs"), FIELDS, num_workers=0,
                  page_size=1 << 16, progress=False)
    assert RefDataset(lines.read_bytes(), str(lines)).records == ref.records


def test_placeholders_become_the_tokenizers_image_token(llava, tokenizer_file, tmp_path):  # noqa: F811
    """A tokenizer whose placeholder is Qwen2-VL's ``<|image_pad|>``: the file's ``<image>`` texts are written as
    that token, one per image."""
    from tokenizers import Tokenizer

    folder, entries, _ = llava
    tok = Tokenizer.from_file(str(tokenizer_file))
    tok.add_special_tokens(["<|image_pad|>"])
    tok.save(str(tmp_path / "tok.json"))
    qwen = ChatTokenizer(tmp_path / "tok.json", chat_template=TEMPLATE, image_token="<|image_pad|>")
    src = LlavaSource(folder / "data.json", qwen, folder / "imgs")
    for i, n in enumerate(N_IMAGES):
        ids = src[i]["conversation"]["input_ids"]
        assert int((ids == qwen.image_token_id).sum()) == n
        assert tok.decode(ids.tolist(), skip_special_tokens=False).count("<|image_pad|>") == n
        assert "<image>" not in tok.decode(ids.tolist(), skip_special_tokens=False)


def test_bad_entries_name_the_file_entry_and_fix(llava, chat, tokenizer_file, tmp_path):  # noqa: F811
    folder, entries, _ = llava

    def write(rows, name="bad.json"):
        (tmp_path / name).write_text(json.dumps(rows) if name.endswith(".json") else rows)
        out = tmp_path / "bad.pageset"
        write_dataset(out, LlavaSource(tmp_path / name, chat, folder / "imgs"), FIELDS, num_workers=0,
                      progress=False)

    good = entries[0]
    cases = [
        ({**good, "conversations": [{"from": "robot", "value": "hi"}]}, r"entry 1 \(id 'llava-000'\): turn 0 is from "
                                                                       r"'robot'; LLaVA roles are"),
        ({"id": "x"}, r"entry 1 \(id 'x'\): 'conversations' must be a non-empty list"),
        ({**good, "image": 5}, r"entry 1 \(id 'llava-000'\): 'image' must be an image \(a path, bytes, a PIL image\)"),
        ({**good, "image": good["image"][:1]}, r"entry 1 \(id 'llava-000'\): 2 image placeholders '<image>' in the "
                                               r"conversation but 1 images"),
        ({**good, "conversations": [{"from": "human"}]}, r"turn 0 must be \{'from': role, 'value': text\}"),
    ]
    for bad, match in cases:
        with pytest.raises(SampleError, match=r"sample 1.*" + match):
            write([entries[1], bad])
    missing = {**good, "image": ["nope/missing.jpg", good["image"][1]]}
    with pytest.raises(SampleError, match=r"sample 0, field 'images'.*missing\.jpg"):
        write([missing])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not JSON"):
        write(json.dumps(good) + "\n{oops\n", "bad.jsonl")
    with pytest.raises(ValueError, match=r"a LLaVA data file is a JSON list"):
        write({"conversations": []})
    with pytest.raises(FileNotFoundError, match="no such folder"):
        LlavaSource(folder / "data.json", chat, folder / "nowhere")
    assert not (tmp_path / "bad.pageset").exists()  # nothing written half
    with pytest.raises(ValueError, match="LlavaSource.chat has no image_token"):
        LlavaSource(folder / "data.json", ChatTokenizer(tokenizer_file, chat_template=TEMPLATE), folder / "imgs")


def test_entries_from_a_hf_dataset_parquet_and_webdataset(llava, chat, hf, tmp_path):  # noqa: F811
    """The same entries as a Hugging Face Dataset with an Image column (PIL images, a list for multi-image
    entries), as Parquet files that Dataset wrote (image structs {bytes, path}) and as a WebDataset shard (the
    entry as the json member, its one image as jpg): each written conversation equals apply_chat_template's, each
    image its source photo (PSNR)."""
    import tarfile

    datasets = pytest.importorskip("datasets")
    from pageset import ParquetSource, WebDatasetSource

    folder, entries, convs = llava
    imgs = folder / "imgs"
    rows = [{"id": e["id"], "conversations": e["conversations"],
             "image": [str(imgs / p) for p in ([e["image"]] if isinstance(e.get("image"), str) else e.get("image", []))]}
            for e in entries]
    ds = datasets.Dataset.from_list(rows).cast_column("image", datasets.Sequence(datasets.Image()))
    ds.to_parquet(str(tmp_path / "llava.parquet"))
    shard = tmp_path / "shard-000.tar"
    one = [k for k, e in enumerate(entries) if isinstance(e.get("image"), str) or len(e.get("image", [])) == 1]
    with tarfile.open(shard, "w") as tar:
        for k in one:
            e = dict(entries[k])
            path = imgs / (e.pop("image") if isinstance(e.get("image"), str) else e.pop("image")[0])
            for name, data in ((f"{e['id']}.json", json.dumps(e).encode()), (f"{e['id']}.jpg", path.read_bytes())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    sources = {"hf": (LlavaSource(ds, chat), range(len(entries))),
               "parquet": (LlavaSource(ParquetSource(tmp_path / "llava.parquet"), chat), range(len(entries))),
               "webdataset": (LlavaSource(WebDatasetSource(shard, {"entry": "json", "image": "jpg"}), chat,
                                          entry="entry"), one)}
    for name, (src, which) in sources.items():
        out = tmp_path / f"{name}.pageset"
        write_dataset(out, src, FIELDS, num_workers=0, progress=False)
        ref = RefDataset(out.read_bytes(), str(out))
        assert len(ref.records) == len(which), name
        for rec, k in zip(ref.records, which):
            want = hf.apply_chat_template(convs[k], chat_template=TEMPLATE, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            assert rec["conversation"]["input_ids"] == list(want["input_ids"]), (name, k)
            assert rec["conversation"]["loss_mask"] == list(want["assistant_masks"]), (name, k)
            assert len(rec["images"]) == N_IMAGES[k], (name, k)
            for s, p in zip(rec["images"], rows[k]["image"]):
                img = np.asarray(Image.open(io.BytesIO(s["data"])).convert("RGB"))
                src_img = Image.open(p).convert("RGB").resize((s["width"], s["height"]), Image.BILINEAR)
                assert _psnr(img, np.asarray(src_img)) > 28.0, (name, k, p)
