#!/usr/bin/env bash
# Build benchmarks/.envs/ffcv: FFCV 1.0.2 beside the CPU torch 2.13.0 wheel, for benchmarks/peers/ffcv_bench.py.
#
#   bash benchmarks/peers/setup_ffcv.sh            (root for apt-get, or the three packages already installed)
#
# FFCV 1.0.2 is an sdist with one C++ extension (libffcv.cpp) linked against OpenCV and libturbojpeg found by
# pkg-config, so Debian's libturbojpeg0-dev, libopencv-dev and pkg-config come first. Its setup.py imports
# numpy-free setuptools only, but builds against the env's packages: --no-build-isolation. --no-deps keeps pip
# from resolving `opencv-python` (we use the headless wheel) or a CUDA torch. Its runtime requirements
# (setup.py install_requires): terminaltables, pytorch_pfn_extras, fastargs, opencv-python, assertpy, tqdm,
# psutil, numba; pytorch_pfn_extras is only imported by Normalize on CUDA, installed with --no-deps too.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
ENV="$ROOT/benchmarks/.envs/ffcv"
PY="${PYTHON:-python3}"

need=()
for p in libturbojpeg0-dev libopencv-dev pkg-config; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "setup_ffcv: need Debian packages ${need[*]} (run as root or: sudo apt-get install ${need[*]})" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
pkg-config --exists opencv4 || pkg-config --exists opencv || { echo "setup_ffcv: pkg-config finds no opencv" >&2; exit 1; }
pkg-config --exists libturbojpeg || { echo "setup_ffcv: pkg-config finds no libturbojpeg" >&2; exit 1; }

[ -x "$ENV/bin/python" ] || "$PY" -m venv "$ENV"
PIP=("$ENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip setuptools wheel
# torch first and pinned: the CPU wheel this machine's pip finds (find-links), so nothing pulls a CUDA build.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" numpy numba opencv-python-headless psutil tqdm terminaltables fastargs assertpy pillow
"${PIP[@]}" --no-deps pytorch-pfn-extras
"${PIP[@]}" --no-build-isolation --no-deps ffcv==1.0.2
"$ENV/bin/python" - <<'PY'
import torch, ffcv, ffcv._libffcv, cv2
from ffcv.loader import Loader, OrderOption
from ffcv.writer import DatasetWriter
print("ffcv env ok: ffcv", getattr(ffcv, "__version__", "1.0.2"), "torch", torch.__version__, "cv2", cv2.__version__)
assert not torch.version.cuda, "a CUDA torch was installed"
PY
