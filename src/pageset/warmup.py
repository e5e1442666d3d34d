"""``pageset warmup``: compile every Numba kernel the Loader uses into the on-disk cache, ahead of training.

A fresh install compiles its kernels during the first batches (measured in benchmarks/cold_start.py: ~15 CPU
seconds for one image pipeline, ~2 s for tokens). Running ``pageset warmup`` once where the package is
installed -- a Dockerfile ``RUN`` step after ``pip install``, a cluster's setup job -- moves that cost out of
every training process: later processes load the compiled code from the cache (~0.1 s) and the compile
notice stays silent.

The warm-up builds tiny real files in a temporary folder (a few JPEGs, two token files) and pulls one batch
through each pipeline family the Loader compiles a separate specialization for: images written as float32,
float16 / bfloat16 and uint8, with both page caches; tokens of uint16 and uint32 files, plain and with
document outputs, in every order, a mixture, and many-file sets of tokens and of records; packed rows
(``packing="best_fit"``: ops/packing.py) of token files and chat files (a loss mask: labels), with both
page caches and both input dtypes. Families run in
``num_workers`` processes: the first wave compiles the shared helpers (JPEG, crop, resize, spans) once, the later
waves load them from the cache.

Where the cache lives is numba's choice (``NUMBA_CACHE_DIR`` if set, else ``__pycache__`` next to pageset's
modules when writable, else a user cache folder): without ``NUMBA_CACHE_DIR`` that is two folders, one for the
ops kernels and one for the order kernels; :func:`cache_dirs` names them, :func:`warmup` returns them and the CLI
prints them.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import tempfile
import time
from dataclasses import dataclass

# The families, in waves: a family of a later wave reuses the helpers a family of an earlier wave cached.
WAVES = (("images-float32", "tokens"), ("images-uint8", "images-float16"))
FAMILIES = tuple(name for wave in WAVES for name in wave)


@dataclass(frozen=True)
class WarmupResult:
    """What :func:`warmup` did: ``families`` run, ``seconds`` of wall time, ``cache_dirs`` (every folder the
    kernels are cached in: see :func:`cache_dirs`; empty when numba found no writable cache location: then
    nothing was kept and each process compiles again) and ``cache_dir`` (the first of them, or None)."""

    families: tuple
    seconds: float
    cache_dir: str | None
    cache_dirs: tuple = ()


def _make_data(folder: str) -> dict:
    """Tiny real files for the warm-up: 8 JPEGs (two classes), uint16 and uint32 token files, sets and chat files
    (a loss mask)."""
    import numpy as np
    from PIL import Image

    from .format.fields import Bytes, Int, RGBImage
    from .write import write_dataset
    from .write.tokens import write_tokens

    rng = np.random.default_rng(0)
    root = os.path.join(folder, "photos")
    for i in range(8):
        os.makedirs(os.path.join(root, f"c{i % 2}"), exist_ok=True)
        y, x = np.mgrid[0:48 + 8 * i, 0:64]
        rgb = np.stack([x * 4, y * 4, rng.integers(0, 256, x.shape)], axis=-1).astype(np.uint8)
        Image.fromarray(rgb).save(os.path.join(root, f"c{i % 2}", f"{i}.jpg"), quality=90)
    paths = {"images": os.path.join(folder, "images.pageset")}
    write_dataset(paths["images"], root, {"image": RGBImage(), "label": Int()}, num_workers=0, progress=False)
    for dtype, vocab in (("uint16", 50_257), ("uint32", 100_277)):
        paths[dtype] = os.path.join(folder, f"{dtype}.pageset")
        write_tokens(paths[dtype], [rng.integers(0, vocab, 40_000).astype(np.int64)], None, eos_id=vocab - 1,
                     dtype=dtype, num_workers=0, progress=False)
    # many-file sets (read flat: load/set_records.py), of token files and of records with a Bytes field
    for dtype in ("uint16", "uint32"):  # (the set kernels are compiled per token dtype, as the file ones)
        path = paths[f"token_set_{dtype}"] = os.path.join(folder, f"token_set_{dtype}")
        write_tokens(path, [rng.integers(0, 50_257, 3_000).astype(np.int64) for _ in range(4)], None,
                     eos_id=50_256, dtype=dtype, docs_per_member=2, num_workers=0, progress=False)
    for dtype in ("uint16", "uint32"):  # chat files: tokens with a loss mask (packed: another kernel argument)
        paths[f"chat_{dtype}"] = os.path.join(folder, f"chat_{dtype}.pageset")
        _chat_file(paths[f"chat_{dtype}"], dtype, rng)
    paths["record_set"] = os.path.join(folder, "record_set")
    write_dataset(paths["record_set"], [{"label": i, "blob": bytes(i + 1)} for i in range(8)],
                  {"label": Int(), "blob": Bytes()}, records_per_member=4, num_workers=0, progress=False)
    return paths


def _chat_file(path: str, dtype: str, rng) -> None:
    """A token file with a loss mask, as ``write_tokens(messages_key=...)`` writes (no tokenizer needed here):
    40 documents ending in EOS (id 1), the second half of each trained on."""
    import numpy as np

    from .write.tokens import TokenFileWriter

    lengths = rng.integers(4, 60, 40)
    ends = np.cumsum(lengths)
    ids = rng.integers(2, 50_000 if dtype == "uint16" else 100_000, int(ends[-1]))
    ids[ends - 1] = 1
    mask = np.concatenate([np.repeat([0, 1], [n // 2, n - n // 2]) for n in lengths.tolist()]).astype(np.uint8)
    writer = TokenFileWriter(path, dtype)
    writer.write(ids)
    info = {"eos_id": 1, "bos_id": None, "tokenizer": None, "source": "chat", "max_id": int(ids.max()),
            "loss_mask": {"train_on": ["assistant"], "rule": "message", "template_sha256": "0" * 64}}
    writer.finish(np.concatenate([[0], ends]).astype(np.uint64), info, None, 0.0, False, mask)


def _batches(loader) -> None:
    with loader:
        next(iter(loader))


def run_family(name: str, paths: dict) -> None:
    """Pull one batch through each Loader configuration of family ``name`` (one of :data:`FAMILIES`)."""
    from .ops.transforms import (
        CenterCrop,
        Normalize,
        RandomHorizontalFlip,
        RandomResizedCrop,
        TokenWindows,
        ToTensor,
        ToTorchImage,
    )
    from .order.mixture import Mixture
    from .load.loader import Loader

    if name.startswith("images-"):
        dtype = name.split("-")[1]
        tail = [] if dtype == "uint8" else [Normalize(dtype=dtype)]
        pipes = [[RandomResizedCrop(32), RandomHorizontalFlip(), *tail, ToTensor()],
                 [CenterCrop(32), *tail, ToTorchImage(channels_last=False), ToTensor()]]
        for pipe in pipes:
            for page_cache in ("os", "process"):
                _batches(Loader(paths["images"], batch_size=4, num_threads=1, page_cache=page_cache,
                                pipelines={"image": pipe}))
    elif name == "tokens":
        for dtype in ("uint16", "uint32"):
            for page_cache in ("os", "process"):
                for order in ("sequential", "random", "quasi_random"):
                    _batches(Loader(paths[dtype], batch_size=2, num_threads=1, page_cache=page_cache, order=order,
                                    pipelines={"tokens": [TokenWindows(seq_len=64)]}))
            _batches(Loader(paths[dtype], batch_size=2, num_threads=1, pipelines={
                "tokens": [TokenWindows(seq_len=64, document_outputs=True, input_dtype="int32")]}))
        for dtype in ("uint16", "uint32"):
            _batches(Loader(Mixture([paths[dtype], paths[dtype]], [0.5, 0.5]), batch_size=2, num_threads=1,
                            pipelines={"tokens": [TokenWindows(seq_len=64)]}))
        for dtype in ("uint16", "uint32"):
            for input_dtype in ("int64", "int32"):
                _batches(Loader(paths[f"token_set_{dtype}"], batch_size=8, num_threads=1,
                                pipelines={"tokens": [TokenWindows(64, input_dtype=input_dtype)]}))
        _batches(Loader(paths["record_set"], batch_size=8, num_threads=1))
        # packed rows: the packing kernels, and the row kernel per token dtype x input dtype x mask (a chat file's
        # loss mask is a read-only array, another type than the empty mask of a plain file)
        for dtype in ("uint16", "uint32"):
            for path in (paths[dtype], paths[f"chat_{dtype}"]):
                for page_cache in ("os", "process"):
                    for input_dtype in ("int64", "int32"):
                        _batches(Loader(path, batch_size=2, num_threads=1, page_cache=page_cache, pipelines={
                            "tokens": [TokenWindows(seq_len=64, packing="best_fit", input_dtype=input_dtype)]}))
            for document_outputs in (False, True):  # chat windows: labels from the loss mask
                _batches(Loader(paths[f"chat_{dtype}"], batch_size=2, num_threads=1, pipelines={
                    "tokens": [TokenWindows(seq_len=16, document_outputs=document_outputs)]}))
    else:
        raise ValueError(f"unknown warm-up family {name!r}; one of {', '.join(FAMILIES)}")


def cache_dirs() -> tuple[str, ...]:
    """Every folder numba caches pageset's kernels in, in this process: ``(NUMBA_CACHE_DIR,)`` when that is set
    (numba files each module's kernels in a sub-folder of it); else one per package holding kernels,
    ``.../pageset/ops/__pycache__`` and ``.../pageset/order/__pycache__`` (their counterparts in the user cache
    folder where the install is read-only). Empty: no writable location, nothing is kept."""
    import numba

    from .ops import image_batch, kernel_cache, packing, spans, tokens
    from .order import enable_kernel_cache, keys, mixture, shuffle

    image_batch.prepare()
    tokens.prepare()
    spans.prepare()
    packing.prepare()
    enable_kernel_cache()
    found = [kernel_cache.cache_dir(m) for m in (image_batch, tokens, spans, packing, keys, mixture, shuffle)]
    if None in found:
        return ()
    return (numba.config.CACHE_DIR,) if numba.config.CACHE_DIR else tuple(dict.fromkeys(found))


def cache_dir() -> str | None:
    """The first of :func:`cache_dirs` (the only one when ``NUMBA_CACHE_DIR`` is set), or None."""
    dirs = cache_dirs()
    return dirs[0] if dirs else None


def warmup(num_workers: int | None = None, log=None) -> WarmupResult:
    """Compile every kernel the Loader uses into numba's on-disk cache; later processes load them from there.

    num_workers: processes compiling at once (default: ``min(2, os.cpu_count())``, the widest wave; 1 runs
    everything in this process). log: a callable taking one line of progress (e.g. ``print``), or None.
    Returns a :class:`WarmupResult`. Raises ValueError on a bad ``num_workers``, and whatever a family raises
    (e.g. :class:`pageset.ops.turbo.TurboJpegNotFoundError` without libjpeg-turbo).
    """
    from .format import arguments as check
    from .write.pool import MAX_WORKERS

    num_workers = check.integer("num_workers", num_workers, minimum=1, maximum=MAX_WORKERS, optional=True)
    if num_workers is None:
        num_workers = min(max(len(w) for w in WAVES), os.cpu_count() or 1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pageset-warmup-") as folder:
        paths = _make_data(folder)
        if num_workers == 1:
            for name in FAMILIES:
                run_family(name, paths)
                if log:
                    log(f"  {name}: {time.perf_counter() - t0:.1f} s")
        else:
            # spawn: a fresh interpreter per worker (no forked copy of this process's threads or numba state)
            ctx = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(num_workers, mp_context=ctx) as pool:
                for wave in WAVES:
                    futures = {pool.submit(run_family, name, paths): name for name in wave}
                    for fut in concurrent.futures.as_completed(futures):
                        fut.result()
                        if log:
                            log(f"  {futures[fut]}: {time.perf_counter() - t0:.1f} s")
    dirs = cache_dirs()
    return WarmupResult(FAMILIES, time.perf_counter() - t0, dirs[0] if dirs else None, dirs)
