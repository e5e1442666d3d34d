#!/usr/bin/env bash
# Build benchmarks/.envs/streaming: Mosaic Streaming (MDS) 0.13.0 and litdata 0.2.76 beside the CPU torch 2.13.0
# wheel, for benchmarks/peers/streaming_bench.py.
#
#   bash benchmarks/peers/setup_streaming.sh
#
# Both packages require torchvision, and a plain `pip install mosaicml-streaming` resolves torchvision's
# exact torch pin to a CUDA build of several GB. PyPI's torchvision wheels are CUDA builds whose C ops do not
# load beside the CPU torch ("operator torchvision::nms does not exist" at import), so torchvision is left out:
# litdata imports it lazily (only for its image serializers, unused here), and `import streaming` only touches
# torchvision.datasets.VisionDataset / transforms.functional.to_tensor, which streaming_bench.py stubs
# (peers/tv_stub.py). So: torch==2.13.0 first, then the two packages with --no-deps, then by hand the dependencies their import paths need (MDS: xxhash, zstd, brotli,
# python-snappy, catalogue, transformers (streaming.text imports it), numpy<2.2; litdata: lightning-utilities,
# filelock, requests, boto3, obstore, tifffile). Cloud-storage SDKs (google-cloud-storage, azure-*, oci,
# paramiko) are imported lazily by both and left out: the benchmark reads local directories.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
ENV="$ROOT/benchmarks/.envs/streaming"
PY="${PYTHON:-python3}"

[ -x "$ENV/bin/python" ] || "$PY" -m venv "$ENV"
PIP=("$ENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip setuptools wheel
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" "numpy<2.2" pillow psutil tqdm xxhash zstd brotli python-snappy catalogue "transformers<5" \
    lightning-utilities filelock requests urllib3 boto3 obstore tifffile
"$ENV/bin/python" -m pip uninstall -q -y torchvision 2>/dev/null || true
"${PIP[@]}" --no-deps mosaicml-streaming==0.13.0 litdata==0.2.76
"$ENV/bin/python" - "$ROOT/benchmarks/peers" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import tv_stub
import torch
assert not torch.version.cuda, "a CUDA torch was installed"
streaming = tv_stub.import_streaming()
import litdata
from streaming import MDSWriter, StreamingDataset
from litdata import StreamingDataset as LitDataset, optimize
print("streaming env ok: mosaicml-streaming", streaming.__version__, "litdata", litdata.__version__,
      "torch", torch.__version__)
PY
