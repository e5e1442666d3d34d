#!/usr/bin/env bash
# The test command of README.md: set up (idempotent), run the whole suite (slow cases included), then run the
# pure kernel tests once more with NUMBA_DISABLE_JIT=1 so the kernel bodies are covered as plain Python.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
.venv/bin/python -m pytest "$@"
echo "--- kernels as plain Python (NUMBA_DISABLE_JIT=1) ---"
NUMBA_DISABLE_JIT=1 .venv/bin/python -m pytest -q -W ignore::RuntimeWarning \
  tests/test_keys.py tests/test_order.py tests/test_image_ops.py tests/test_jpeg.py tests/test_jpeg_restart.py tests/test_spans.py \
  tests/test_mixtures.py::test_golden_vectors tests/test_mixtures.py::test_counts_in_closed_form_equal_a_replay \
  tests/test_mixtures.py::test_lookup_kernel_equals_per_position_orders \
  tests/test_schedules.py::test_stream_schedule_equals_the_model_on_random_schedules \
  tests/test_schedules.py::test_golden_vectors_of_formats_mixture_md tests/test_schedules.py::test_ramp_tracks_the_integral_of_its_shares \
  tests/test_vlm.py::test_kernels_on_hand_checked_values tests/test_vlm_dynamic.py::test_smart_resize_and_patch_layout_equal_transformers
