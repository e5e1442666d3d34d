#!/usr/bin/env bash
# The test command of README.md: set up (idempotent) and run the whole suite, slow cases included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec .venv/bin/python -m pytest "$@"
