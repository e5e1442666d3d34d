"""tools/gpu_check.py in its CPU dry run: every check but CUDA itself runs and passes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--dry-run", "--images", "48",
                        "--batch-size", "8", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["overwritten_in_flight"] == 0 and res["batches_checked"] == 6
    assert res["images_per_s"] > 0 and res["first_batch_s"] > 0
    assert "| pinned batch buffers |" in r.stdout
