#!/usr/bin/env bash
# Create .venv with the CPU torch wheel first (a bare torch range would pull a multi-GB CUDA build), then pageset
# with its test extra. Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
.venv/bin/python -c "import torch, numba, pageset; print('pageset set-up OK: torch', torch.__version__, '| numba', numba.__version__)"
