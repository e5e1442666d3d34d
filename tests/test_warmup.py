"""`pageset warmup` fills numba's kernel cache so that a fresh process's Loader compiles nothing.

Each check runs fresh interpreters with their own empty ``NUMBA_CACHE_DIR`` (numba's own variable, set only in
the child's environment), so the shared cache of the test run cannot make a test pass. The compile detector is
checked too: the same Loader script in an empty cache must report compiles (and print the compile notice).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numba
import pytest

from pageset.cli import main

SRC = str(Path(__file__).resolve().parents[1] / "src")
NOTICE = "pageset: compiling the Numba kernels"

# A Loader per family a training job meets (float32 and uint8 images, tokens), one batch each; prints the pageset
# kernels numba compiled (its numba:compile event fires only after a cache miss) as JSON on the last line.
LOADERS = r"""
import json, sys
from numba.core import event
compiled = []
class Listener(event.Listener):
    def on_start(self, ev):
        f = ev.data["dispatcher"].py_func
        if f.__module__.startswith("pageset."):
            compiled.append(f.__module__ + "." + f.__qualname__)
    def on_end(self, ev):
        pass
event.register("numba:compile", Listener())
from pageset import CenterCrop, Loader, Normalize, RandomHorizontalFlip, RandomResizedCrop, ToTensor, TokenWindows
images, tokens = sys.argv[1], sys.argv[2]
runs = [] if images == "-" else [
    (images, {"image": [RandomResizedCrop(64), RandomHorizontalFlip(), Normalize(), ToTensor()], "label": None}),
    (images, {"image": [CenterCrop(48), ToTensor()], "label": None})]
runs.append((tokens, {"tokens": [TokenWindows(seq_len=256)]}))
runs += [(p, pipes) for p, pipes in zip(sys.argv[3:5], [{"tokens": [TokenWindows(seq_len=64)]}, {}])]  # sets
if len(sys.argv) > 5:  # packed rows of a token file; a chat file (loss mask): windows with labels, packed rows
    chat = sys.argv[5]
    runs += [(tokens, {"tokens": [TokenWindows(seq_len=64, packing="best_fit")]}),
             (chat, {"tokens": [TokenWindows(seq_len=16)]}),
             (chat, {"tokens": [TokenWindows(seq_len=16, document_outputs=True)]}),
             (chat, {"tokens": [TokenWindows(seq_len=16, packing="best_fit")]})]
for path, pipes in runs:
    with Loader(path, batch_size=4, num_threads=2, pipelines=pipes) as loader:
        next(iter(loader))
print(json.dumps(sorted(set(compiled))))
"""

needs_jit = pytest.mark.skipif(numba.config.DISABLE_JIT, reason="no kernels to cache under NUMBA_DISABLE_JIT")


def _env(cache: Path) -> dict:
    return {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": SRC + os.pathsep + os.environ.get(
        "PYTHONPATH", "")}


def _loaders(cache: Path, images: str, tokens: str, *sets: str) -> tuple[list, str]:
    r = subprocess.run([sys.executable, "-c", LOADERS, images, tokens, *sets], env=_env(cache), capture_output=True,
                       text=True, timeout=1800, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.fixture(scope="module")
def files(tmp_path_factory, imagenet_like):
    import numpy as np

    from pageset import Bytes, Int, RGBImage, write_dataset, write_tokens

    d = tmp_path_factory.mktemp("warm")
    write_dataset(d / "img.pageset", imagenet_like, {"image": RGBImage(max_resolution=128), "label": Int()},
                  num_workers=0, progress=False)
    tokens = np.random.default_rng(3).integers(0, 50_000, 20_000).astype(np.int64)
    write_tokens(str(d / "tok.pageset"), [tokens], None, eos_id=50_256, num_workers=0, progress=False)
    # many-file sets (read flat, with their own kernels): of token files, of records with a Bytes field
    write_tokens(str(d / "tok_set"), [tokens[:5000], tokens[5000:]], None, eos_id=50_256, docs_per_member=1,
                 num_workers=0, progress=False)
    write_dataset(d / "rec_set", [{"label": i, "blob": bytes(i + 3)} for i in range(12)],
                  {"label": Int(), "blob": Bytes()}, records_per_member=5, num_workers=0, progress=False)
    _chat_file(d / "chat.pageset")
    return (str(d / "img.pageset"), str(d / "tok.pageset"), str(d / "tok_set"), str(d / "rec_set"),
            str(d / "chat.pageset"))


def _chat_file(path) -> None:
    """A token file with a loss mask (what write_tokens(messages_key=...) writes), made with the package's token
    writer so that no tokenizer or template is needed: 12 documents, the second half of each trained on."""
    import numpy as np

    from pageset.write.tokens import TokenFileWriter

    rng = np.random.default_rng(4)
    lengths = rng.integers(5, 40, 12)
    ids = rng.integers(2, 120_000, int(lengths.sum()))  # a 128K vocabulary: uint32 ids, as a DeepSeek chat file
    ends = np.cumsum(lengths)
    ids[ends - 1] = 1  # each document ends with EOS
    mask = np.concatenate([np.repeat([0, 1], [n // 2, n - n // 2]) for n in lengths]).astype(np.uint8)
    writer = TokenFileWriter(str(path), "uint32")
    writer.write(ids)
    info = {"eos_id": 1, "bos_id": None, "tokenizer": None, "source": "chat", "max_id": int(ids.max()),
            "loss_mask": {"train_on": ["assistant"], "rule": "message", "template_sha256": "0" * 64}}
    writer.finish(np.concatenate([[0], ends]).astype(np.uint64), info, None, 0.0, False, mask)


@needs_jit
def test_the_detector_sees_compiles_in_an_empty_cache(tmp_path, files):
    compiled, stderr = _loaders(tmp_path / "empty", "-", files[1])
    assert "pageset.ops.tokens.pread_windows" in compiled
    assert "pageset.order.shuffle._shuffled_arange" in compiled  # the default order="random"
    assert stderr.count(NOTICE) == 1


@needs_jit
@pytest.mark.slow
def test_after_warmup_a_fresh_loader_compiles_nothing(tmp_path, files):
    cache = tmp_path / "numba-cache"
    r = subprocess.run([sys.executable, "-m", "pageset.cli", "warmup", "--quiet"], env=_env(cache),
                       capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stderr
    assert f"kernels cached in {cache}" in r.stdout
    assert any(p.suffix == ".nbc" for p in cache.rglob("*")), "no compiled kernel in the cache folder"
    compiled, stderr = _loaders(cache, *files)
    assert compiled == []
    assert NOTICE not in stderr


@needs_jit
def test_print_cache_dir_names_numbas_folder(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pageset.cli", "warmup", "--print-cache-dir"],
                       env=_env(tmp_path / "c"), capture_output=True, text=True, timeout=600, check=True)
    assert r.stdout.strip() == str(tmp_path / "c")


@needs_jit
def test_print_cache_dir_names_every_folder_numba_fills(tmp_path, files):
    """Without NUMBA_CACHE_DIR numba caches each module's kernels in ``__pycache__`` next to it (when writable):
    pageset's kernels live in two packages, ops and order, so there are two folders, and --print-cache-dir names
    both. Checked on a copy of the package (its own folders, empty): the folders printed are exactly those in
    which a token Loader's compiled kernels (token, span and order kernels) land."""
    import shutil

    copy = tmp_path / "src"
    shutil.copytree(Path(SRC) / "pageset", copy / "pageset", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["PYTHONPATH"] = str(copy)
    r = subprocess.run([sys.executable, "-m", "pageset.cli", "warmup", "--print-cache-dir"], env=env,
                       capture_output=True, text=True, timeout=600, check=True)
    want = {str(copy / "pageset" / "ops" / "__pycache__"), str(copy / "pageset" / "order" / "__pycache__")}
    assert set(r.stdout.split()) == want and len(r.stdout.splitlines()) == 2, r.stdout
    r = subprocess.run([sys.executable, "-c", LOADERS, "-", files[1]], env=env, capture_output=True, text=True,
                       timeout=1800, check=True)
    assert json.loads(r.stdout.strip().splitlines()[-1]), "nothing compiled: the copy was not what ran"
    assert {str(p.parent) for p in (copy / "pageset").rglob("*.nbi")} == want


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_warmup_refuses_a_bad_worker_count(capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["warmup", "--num-workers", value])
    assert exc.value.code == 2
    assert f"--num-workers: must be an int in [1, 1024], got '{value}'" in capsys.readouterr().err


def test_warmup_function_refuses_a_bad_worker_count():
    from pageset.warmup import warmup

    with pytest.raises(ValueError, match="num_workers must be an int in \\[1, 1024\\]"):
        warmup(0)
    with pytest.raises(TypeError, match="num_workers must be an int"):
        warmup("2")


HELPERS = r"""
import sys
from pageset.ops import image_batch, jpeg_scale
image_batch.prepare()
print(jpeg_scale.scale_region(640, 480, 10, 20, 300, 200, 1, 2))
"""


@needs_jit
def test_the_helpers_a_kernel_calls_are_cached_too(tmp_path):
    """A kernel's callees (here scaled_size, called by scale_region) get their own cache entries: another
    process compiling another caller of them loads them instead of compiling them again."""
    cache = tmp_path / "c"
    r = subprocess.run([sys.executable, "-c", HELPERS], env=_env(cache), capture_output=True, text=True,
                       timeout=600, check=True)
    # 640 x 480 at 1/2 is 320 x 240; the region [10, 310) x [20, 220) -> [5, 155) x [10, 110)
    assert r.stdout.strip() == "(5, 10, 150, 100)"
    names = {p.name.split("-")[0] for p in cache.rglob("*.nbi")}
    assert {"jpeg_scale.scale_region", "jpeg_scale.scaled_size"} <= names, names
