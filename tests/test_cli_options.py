"""The numeric options of the `pageset` command line are checked by argparse: a value out of range is a usage
error (exit status 2) naming the option and its valid range, before any work; never a traceback.

The ranges are those the Python API documents (RGBImage: max_resolution >= 1, jpeg_quality 1-100; page sizes a
power of two in [4096, 2**30] (formats/v1.md); worker counts >= 0; token ids in [0, 2**32 - 1]), typed here by
hand, not read from the code under test.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pageset.cli import build_parser, main

CONVERT = ["convert", "out.pageset", "photos/"]
TEXT = ["convert-text", "out.pageset", "corpus.txt", "--tokenizer", "tokenizer.json"]

# (command line before the option, option, a bad value, the valid range the message must state)
BAD = [
    (CONVERT, "--max-resolution", "-5", "an int >= 1"),
    (CONVERT, "--max-resolution", "0", "an int >= 1"),
    (CONVERT, "--jpeg-quality", "500", "an int in [1, 100]"),
    (CONVERT, "--jpeg-quality", "0", "an int in [1, 100]"),
    (CONVERT, "--jpeg-quality", "high", "an int in [1, 100]"),
    (CONVERT, "--jpeg-restart", "65", "an int in [0, 64]"),
    (CONVERT, "--jpeg-restart", "-1", "an int in [0, 64]"),
    (CONVERT, "--num-workers", "-3", "an int in [0, 1024]"),
    (CONVERT, "--num-workers", "99999999999999999999", "an int in [0, 1024]"),
    (CONVERT, "--page-size", "1000", "a power of two in [4096, 1073741824]"),
    (CONVERT, "--page-size", "2048", "a power of two in [4096, 1073741824]"),
    (CONVERT, "--page-size", "2147483648", "a power of two in [4096, 1073741824]"),
    (CONVERT, "--page-size", "12288", "a power of two in [4096, 1073741824]"),
    (CONVERT, "--chunk-size", "0", "an int >= 1"),
    (TEXT, "--eos-id", "-1", "an int in [0, 4294967295]"),
    (TEXT, "--bos-id", "4294967296", "an int in [0, 4294967295]"),
    (TEXT, "--num-workers", "-1", "an int in [0, 1024]"),
    (TEXT, "--page-size", "100", "a power of two in [4096, 1073741824]"),
    (["warmup"], "--num-workers", "0", "an int in [1, 1024]"),
    (["warmup"], "--num-workers", "1025", "an int in [1, 1024]"),
]


@pytest.mark.parametrize("head, option, value, valid", BAD, ids=[f"{h[0]}{o}={v}" for h, o, v, _ in BAD])
def test_a_number_out_of_range_is_a_usage_error_naming_the_option_and_range(tmp_path, monkeypatch, capsys, head,
                                                                             option, value, valid):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main([*head, option, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: must be {valid}, got '{value}'" in err, err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []  # before any work: nothing written


GOOD = [
    (CONVERT, "--max-resolution", "1", 1), (CONVERT, "--jpeg-quality", "1", 1), (CONVERT, "--jpeg-quality", "100", 100),
    (CONVERT, "--jpeg-restart", "4", 4),
    (CONVERT, "--num-workers", "0", 0), (CONVERT, "--page-size", "4096", 4096),
    (CONVERT, "--page-size", "1073741824", 1 << 30), (CONVERT, "--chunk-size", "1", 1),
    (TEXT, "--eos-id", "0", 0), (TEXT, "--bos-id", "4294967295", 2**32 - 1), (TEXT, "--page-size", "65536", 65536),
    (["warmup"], "--num-workers", "1", 1),
]


@pytest.mark.parametrize("head, option, value, parsed", GOOD, ids=[f"{h[0]}{o}={v}" for h, o, v, _ in GOOD])
def test_the_ends_of_each_range_are_accepted(head, option, value, parsed):
    args = build_parser().parse_args([*head, option, value])
    assert getattr(args, option[2:].replace("-", "_")) == parsed


def _options():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, p in sub.choices.items():
        for action in p._actions:
            if action.option_strings:
                yield command, action


def test_every_numeric_option_has_a_range_checked_by_argparse():
    """A plain ``type=int`` lets -5 through to a traceback (or to a Python-API message naming a keyword the
    command line user never typed): every option taking a number must check its range itself."""
    numeric = [(c, a) for c, a in _options() if a.type in (int, float) or getattr(a.type, "valid", None) or (
               isinstance(a.default, (int, float)) and not isinstance(a.default, bool))]
    unchecked = [(c, a.option_strings[0]) for c, a in numeric if not getattr(a.type, "valid", None)]
    assert unchecked == [], f"numeric options without a range check: {unchecked}"
    checked = sorted((c, a.option_strings[0]) for c, a in _options() if getattr(a.type, "valid", None))
    assert checked == sorted({(h[0], o) for h, o, _, _ in BAD}), checked  # each one is in BAD above


def test_the_installed_command_exits_2_on_a_bad_quality(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pageset.cli", "convert", str(tmp_path / "o.pageset"), str(tmp_path),
                        "--jpeg-quality", "500"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "argument --jpeg-quality: must be an int in [1, 100], got '500'" in r.stderr
