"""Error messages that say where: the file, line and byte of bad text; the folder that does not exist; one clear
message per bad sample (with the way to skip it) instead of chained tracebacks; the file list's own name."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from pageset import (
    ChecksumMismatchError,
    ImageList,
    Int,
    SampleError,
    import_nanogpt,
    open_dataset,
    write_dataset,
    write_tokens,
)
from pageset.cli import main as cli_main
from pageset.write.sources import WorkerTraceback


def _bytes_tokenizer(text):
    return list(text.encode("utf-8"))


def _tokens(path, source, **kw):
    return write_tokens(path, source, _bytes_tokenizer, eos_id=0, num_workers=0, progress=False, **kw)


# ---- text sources ------------------------------------------------------------------------------------------

def test_non_utf8_byte_in_jsonl_names_file_line_and_byte(tmp_path):
    lines = [b'{"text": "first"}\n', b'{"text": "caf\xe9 au lait"}\n']
    bad = tmp_path / "c.jsonl"
    bad.write_bytes(b"".join(lines))
    offset = len(lines[0]) + lines[1].index(b"\xe9")
    with pytest.raises(ValueError, match=rf"c\.jsonl:2: not UTF-8 text: byte 0xe9 at byte {offset} of the file"):
        _tokens(tmp_path / "o.pageset", bad)
    # sibling: the same bytes gzip-compressed (offsets in the decompressed stream), and a plain .txt file
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(b"".join(lines)))
    with pytest.raises(ValueError, match=rf"c\.jsonl\.gz:2: not UTF-8 text: byte 0xe9 at byte {offset}"):
        _tokens(tmp_path / "o.pageset", gz)
    txt = tmp_path / "c.txt"
    txt.write_bytes(b"plain caf\xe9")
    with pytest.raises(ValueError, match=r"c\.txt: not UTF-8 text \(byte 9"):
        _tokens(tmp_path / "o.pageset", txt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "c.jsonl.gz", "c.txt"]


def test_malformed_json_line_says_invalid_json_at_file_and_line(tmp_path):
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": "missing comma" "x": 1}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"c\.jsonl:3: invalid JSON at column 26: Expecting ','"):
        _tokens(tmp_path / "o.pageset", bad)
    # a line that ends inside its object: the column is on that line (not "line 2, column 1" after the newline)
    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"text": "ok"}\n{"text": "b",\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"cut\.jsonl:2: invalid JSON at column 14 \(the line ends there: one "
                                         r"whole JSON object per line.*\): Expecting property name"):
        _tokens(tmp_path / "o.pageset", cut)
    # siblings: valid JSON without the key, a JSON value that is not an object, a non-string value
    for line, match in ((b'{"body": "x"}', r"c2\.jsonl:1: no 'text' key in the JSON line \(it has \['body'\]\)"),
                        (b'[1, 2]', r"c2\.jsonl:1: no 'text' key in the JSON line \(it has list\)"),
                        (b'{"text": 42}', r"c2\.jsonl:1: 'text' holds int 42, not a string")):
        (tmp_path / "c2.jsonl").write_bytes(line + b"\n")
        with pytest.raises(ValueError, match=match):
            _tokens(tmp_path / "o.pageset", tmp_path / "c2.jsonl")


def test_parquet_wrong_text_key_and_damaged_parquet_name_the_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    good = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": ["first document", "second"], "id": [1, 2]}), good)
    with pytest.raises(ValueError, match=r"docs\.parquet: no column 'text' in the Parquet file \(it has \['body', "
                                         r"'id'\]\); set text_key= \(--text-key\)"):
        _tokens(tmp_path / "o.pageset", good)
    assert _tokens(tmp_path / "o.pageset", good, text_key="body").documents == 2
    bad = tmp_path / "cut.parquet"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])  # a copy cut short
    with pytest.raises(ValueError, match=r"cut\.parquet: cannot read it as Parquet \(ArrowInvalid: .*\); the file "
                                         r"is damaged or not Parquet"):
        _tokens(tmp_path / "o2.pageset", bad)
    assert not (tmp_path / "o2.pageset").exists()


def test_a_flat_list_of_ids_names_the_document_and_what_a_document_is(tmp_path):
    with pytest.raises(TypeError, match=r"^document 0: expected text \(str\) or a 1-D integer array / list of token "
                                        r"ids, got int 1; .*\[\[1, 2, 3\], \[4, 5\]\].*not \[1, 2, 3\]"):
        write_tokens(tmp_path / "k.pageset", [1, 2, 3], eos_id=0, progress=False, num_workers=0)
    assert not (tmp_path / "k.pageset").exists()


def test_non_json_metadata_names_the_argument_and_the_key(tmp_path):
    with pytest.raises(TypeError, match=r"^metadata\['x'\] is not JSON-serialisable .*metadata values must be"):
        write_dataset(tmp_path / "m.pageset", [(1,)], {"y": Int()}, metadata={"ok": 1, "x": object()},
                      progress=False, num_workers=0)
    with pytest.raises(TypeError, match=r"^metadata\['when'\] is not JSON-serialisable"):
        _tokens(tmp_path / "t.pageset", ["a"], metadata={"when": {1, 2}})
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_importer_messages_name_the_importer_called(tmp_path):
    from pageset import import_megatron

    with pytest.raises(FileNotFoundError, match=r"the output comes first: import_megatron\(path, prefix\)"):
        import_megatron(tmp_path / "o.pageset", tmp_path / "missing", eos_id=0)
    (tmp_path / "notes.txt").write_text("keep me")
    bin_path = tmp_path / "tok.bin"
    np.arange(10, dtype=np.uint16).tofile(bin_path)
    with pytest.raises(ValueError, match=r"notes\.txt exists and is not a pageset file.*import_nanogpt\(path, "
                                         r"bin_path\)"):
        import_nanogpt(tmp_path / "notes.txt", bin_path, eos_id=0)


def test_damaged_token_page_names_the_token_range_and_documents(tmp_path):
    from pageset.format import constants as C

    path = tmp_path / "t.pageset"
    docs = [np.arange(1, 3000, dtype=np.int64) % 60000 + k for k in range(6)]  # ~18k uint16 ids: 9 pages of 4 KiB
    write_tokens(path, docs, None, eos_id=0, page_size=4096, progress=False, num_workers=0)
    with open(path, "r+b") as f:
        f.seek(C.DATA_OFFSET + 2 * 4096 + 100)  # inside page 2: tokens [4096, 6144)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    from pageset import Dataset

    with Dataset(path) as ds:
        with pytest.raises(ChecksumMismatchError, match=r"page 2.*this page holds tokens \[4096, 6144\) "
                                                        r"\(documents 1\.\.2\)"):
            ds.verify()


# ---- output folder -----------------------------------------------------------------------------------------

def test_output_in_a_missing_folder_names_the_folder_for_every_writer(tmp_path, photos, capsys):
    out = tmp_path / "no" / "such" / "out.pageset"
    folder = rf"the output folder {tmp_path}/no/such does not exist; create it first"
    calls = {
        "write_dataset": lambda: write_dataset(out, [photos[0]], num_workers=0, progress=False),
        "write_tokens": lambda: _tokens(out, ["some text"]),
        "import_nanogpt": lambda: import_nanogpt(out, nano),
    }
    nano = tmp_path / "train.bin"
    np.array([1, 2, 50256], np.uint16).tofile(nano)
    for name, call in calls.items():
        with pytest.raises(FileNotFoundError, match=folder) as ei:
            call()
        assert ".tmp-" not in str(ei.value), name
    assert cli_main(["convert", str(photos[0]).rsplit("/", 1)[0], str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "does not exist; create it first" in err and ".tmp-" not in err
    # sibling: the "folder" is a file
    (tmp_path / "afile").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"the output folder .*afile is not a folder"):
        write_dataset(tmp_path / "afile" / "out.pageset", [photos[0]], num_workers=0, progress=False)


# ---- bad samples -------------------------------------------------------------------------------------------

@pytest.fixture()
def folder_with_bad_images(tmp_path, photos):
    """Two good JPEGs, a zero-byte .jpg, a truncated JPEG and a text file named .jpg, listed in files.txt."""
    root = tmp_path / "imgs"
    root.mkdir()
    for k in range(2):
        Image.open(photos[k]).convert("RGB").resize((40, 30)).save(root / f"{k}.jpg")
    (root / "empty.jpg").write_bytes(b"")
    (root / "cut.jpg").write_bytes((root / "0.jpg").read_bytes()[:200])
    (root / "notes.jpg").write_text("not an image at all")
    names = ["0.jpg", "empty.jpg", "1.jpg", "cut.jpg", "notes.jpg"]
    (root / "files.txt").write_text("".join(f"{n}\t{k}\n" for k, n in enumerate(names)))
    return root


def test_zero_byte_jpeg_one_message_with_the_skip_hint_no_tracebacks(tmp_path, folder_with_bad_images):
    lst = folder_with_bad_images / "files.txt"
    proc = subprocess.run([sys.executable, "-m", "pageset", "convert", str(lst), str(tmp_path / "o.pageset"),
                           "--num-workers", "2", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    err = proc.stderr
    assert "Traceback" not in err and err.count("is empty (0 bytes)") == 1, err
    assert "--on-error skip" in err and "sample 1, field 'image'" in err
    assert f"file list '{lst}'" in err and "source list" not in err  # the list's own name
    assert not (tmp_path / "o.pageset").exists()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_python_api_bad_sample_message_once_with_hint_and_one_traceback(tmp_path, folder_with_bad_images,
                                                                         num_workers):
    with pytest.raises(SampleError) as ei:
        write_dataset(tmp_path / "o.pageset", folder_with_bad_images / "files.txt", num_workers=num_workers,
                      progress=False)
    err = ei.value
    assert err.index == 1 and err.field == "image" and str(err).count("is empty (0 bytes)") == 1
    assert "on_error='skip'" in str(err) and "Traceback" not in str(err)
    assert str(err).startswith(f"file list '{folder_with_bad_images / 'files.txt'}': sample 1")
    if num_workers:  # the worker's traceback, once, as the cause (like concurrent.futures)
        assert isinstance(err.__cause__, WorkerTraceback)
        assert str(err.__cause__).count("Traceback (most recent call last)") == 1
        assert "open_image" in str(err.__cause__)  # the worker function that raised
    else:
        assert isinstance(err.__cause__, ValueError) and "is empty" in str(err.__cause__)


def test_skip_records_each_error_with_the_path_once(tmp_path, folder_with_bad_images):
    res = write_dataset(tmp_path / "o.pageset", folder_with_bad_images / "files.txt", num_workers=2,
                        progress=False, on_error="skip")
    assert res.skipped == (1, 3, 4) and res.records == 2
    with open_dataset(res.path) as ds:
        errors = ds.metadata["lineage"]["skipped_errors"]
        assert ds.metadata["lineage"]["source"] == f"file list '{folder_with_bad_images / 'files.txt'}'"
    assert [e["index"] for e in errors] == [1, 3, 4]
    for e, name in zip(errors, ["empty.jpg", "cut.jpg", "notes.jpg"]):
        assert e["error"].count(str(folder_with_bad_images / name)) == 1, e  # each names its path once
    # sibling: a value that is not a path gets no path appended
    res = write_dataset(tmp_path / "b.pageset", [(b"not a jpeg",), ((folder_with_bad_images / "0.jpg").read_bytes(),)],
                        {"image": __import__("pageset").RGBImage()}, num_workers=0, progress=False, on_error="skip")
    with open_dataset(res.path) as ds:
        (e,) = ds.metadata["lineage"]["skipped_errors"]
    assert e["error"].startswith("ValueError: encoded image bytes could not be decoded") and "(/" not in e["error"]


def test_errors_in_a_file_list_name_the_list_file(tmp_path, photos):
    lst = tmp_path / "list.txt"
    lst.write_text(f"{photos[0]}\t0\n{photos[1]}\tcat\n")
    with pytest.raises(ValueError, match=rf"{lst}:2: label 'cat' is not an integer"):
        ImageList(lst)
    lst.write_text(f"{photos[0]}\t0\n{photos[1]}\n")
    with pytest.raises(ValueError, match=rf"file list {lst}: either every line has a label or none does"):
        write_dataset(tmp_path / "o.pageset", lst, num_workers=0, progress=False)
    shutil.copy(photos[0], tmp_path / "x.jpg")
    with pytest.raises(ValueError, match=r"x\.jpg is one image: give a list of image paths"):
        write_dataset(tmp_path / "o.pageset", tmp_path / "x.jpg", num_workers=0, progress=False)


def test_token_pipeline_hint_and_counts_of_one_read_right(tmp_path):
    """The hint for a token file's pipeline is valid Python (no stray brace); counts of one are singular."""
    from pageset import IntDecoder, Loader, PipelineError, TokenWindows, open_tokens

    path = tmp_path / "t.pageset"
    _tokens(path, ["ab"])  # 2 bytes + EOS: 3 tokens in 1 document
    with pytest.raises(PipelineError) as info:
        Loader(path, batch_size=1, pipelines={"tokens": [IntDecoder()]})
    hint = str(info.value).split("give ", 1)[1]
    assert hint == "pipelines={'tokens': [TokenWindows(seq_len), ToTensor?, ToDevice?]}", hint
    with open_tokens(path) as td:
        with pytest.raises(IndexError, match=r"document 1 is out of range for 1 document$"):
            td.document(1)
    one = tmp_path / "one.pageset"
    _tokens(one, [""])  # only the EOS: 1 token
    with pytest.raises(ValueError, match=r": 1 token, fewer than seq_len \+ 1 = 3"):
        Loader(one, batch_size=1, pipelines={"tokens": [TokenWindows(2)]})
