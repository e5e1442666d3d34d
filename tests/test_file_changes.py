"""A file changed in place under a reader (issue 9, items 1 and 2): truncated, rewritten with ``cp``, overwritten.

The process must never die from it (no SIGBUS, in any page_cache mode, at any moment): every read either
completes with the bytes of the file as opened or raises a FormatError subclass (TruncatedFileError naming the
file and the byte range, FileChangedError). The random trials run in a child process so that a signal shows up
as its exit status instead of killing pytest.
"""

from __future__ import annotations

import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from pageset import (
    Dataset,
    FileChangedError,
    Int,
    Loader,
    RandomResizedCrop,
    RGBImage,
    TokenWindows,
    TruncatedFileError,
    open_dataset,
    open_tokens,
    write_dataset,
    write_tokens,
)

PIPES = {"image": [RandomResizedCrop(32)]}
OLD_MTIME_NS = 1_000_000_000 * 1_600_000_000  # 2020: any later write to a trial file moves its mtime


@pytest.fixture(scope="module")
def files(tmp_path_factory, imagenet_like):
    """{kind: (file, another file of the same kind and a different size)}, kinds "image" and "tokens"."""
    d = tmp_path_factory.mktemp("changes")
    out = {}
    for name, res in (("image", 96), ("image_other", 64)):
        write_dataset(d / name, imagenet_like, {"image": RGBImage(max_resolution=res, jpeg_quality=85),
                                                "label": Int()}, num_workers=0, page_size=1 << 12, progress=False)
    rng = np.random.default_rng(0)
    for name, n in (("tokens", 40), ("tokens_other", 25)):
        docs = [rng.integers(0, 50000, size=int(rng.integers(50, 400))) for _ in range(n)]
        write_tokens(d / name, docs, eos_id=50256, num_workers=0, page_size=1 << 12, progress=False)
    for kind in ("image", "tokens"):
        out[kind] = (d / kind, d / f"{kind}_other")
    return out


# ---- deterministic cases --------------------------------------------------------------------------------------

def _loader(path, kind, cache, **kw):
    pipes = PIPES if kind == "image" else {"tokens": [TokenWindows(16)]}
    return Loader(path, batch_size=4, pipelines=pipes, num_threads=2, page_cache=cache, seed=0, **kw)


@pytest.mark.parametrize("cache", ["os", "process"])
@pytest.mark.parametrize("kind", ["image", "tokens"])
def test_truncated_under_a_loader_names_file_and_bytes(tmp_path, files, kind, cache):
    path = tmp_path / "live.pageset"
    shutil.copyfile(files[kind][0], path)
    with Dataset(path) as ds:  # either kind of file
        cut = ds.data_offset + 100  # keeps the header and a little of page 0
    with _loader(path, kind, cache, order="sequential") as loader:
        it = iter(loader)
        next(it)
        os.truncate(path, cut)
        with pytest.raises(TruncatedFileError) as ei:
            for _ in range(10_000):  # bounded: a few epochs of this small file
                next(it)
    exc = ei.value
    assert exc.path == str(path) and str(path) in str(exc)
    assert "truncated" in str(exc) and f"shrank to {cut} bytes" in str(exc)
    if "short read" in str(exc):  # the read that came up short names its byte range
        assert exc.offset is not None and f"[{exc.offset}, " in str(exc)


@pytest.mark.parametrize("cache", ["os", "process"])
def test_process_cache_short_read_is_truncated_file_error(tmp_path, files, cache):
    """The read itself comes up short (the file shrank between the check and the read): TruncatedFileError
    naming the file and the exact byte range, never a plain OSError."""
    path = tmp_path / "live.pageset"
    shutil.copyfile(files["image"][0], path)
    with _loader(path, "image", cache) as loader:
        ds, pages = loader._ds, loader._pages
        offs = ds.index["image.offset"].astype(np.int64)[-3:]
        lens = ds.index["image.length"].astype(np.int64)[-3:]
        os.truncate(path, int(offs[0]) + 10)
        with pytest.raises(TruncatedFileError) as ei:
            pages.gather(offs, lens, {})
    first, cut = int(offs[0]), int(offs[0]) + 10
    msg = str(ei.value)
    lo, hi = map(int, re.search(r"short read of bytes \[(\d+), (\d+)\)", msg).groups())
    # the range read: the records' run ("os") or their page ("process"), and the file ended inside it
    assert str(path) in msg and ei.value.offset == lo <= first < hi and cut < hi
    assert f"shrank to {cut} bytes" in msg
    assert not isinstance(ei.value, FileChangedError)


@pytest.mark.parametrize("cache", ["os", "process"])
def test_overwritten_in_place_same_size_raises_file_changed(tmp_path, files, cache):
    path = tmp_path / "live.pageset"
    shutil.copyfile(files["image"][0], path)
    os.utime(path, ns=(OLD_MTIME_NS, OLD_MTIME_NS))
    with _loader(path, "image", cache) as loader:
        it = iter(loader)
        next(it)
        with open(path, "r+b") as f:  # same size, other bytes: a damaged page written in place
            f.seek(open_dataset(files["image"][0]).data_offset + 10)
            f.write(b"\xff" * 64)
        with pytest.raises(FileChangedError, match="modified in place"):
            for _ in range(10_000):
                next(it)


def test_reader_paths_raise_instead_of_dying(tmp_path, files):
    path = tmp_path / "live.pageset"
    shutil.copyfile(files["image"][0], path)
    with open_dataset(path) as ds:
        ds[0]
        os.truncate(path, ds.data_offset + 10)
        with pytest.raises(TruncatedFileError, match=r"short read of bytes \["):
            ds[len(ds) - 1]
        with pytest.raises(TruncatedFileError):
            ds.verify()
        with pytest.raises(TruncatedFileError):
            ds.check_page(ds.page_count - 1)
    tpath = tmp_path / "tokens.pageset"
    shutil.copyfile(files["tokens"][0], tpath)
    with open_tokens(tpath) as td:
        first = td.document(0)
        os.truncate(tpath, td.dataset.data_offset + 8)
        assert first.shape[0] > 0
        with pytest.raises(TruncatedFileError):
            td.document(td.documents - 1)
        with pytest.raises(TruncatedFileError):
            td.dataset.verify()


# ---- random trials in a child process --------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys, time
    from pageset import FormatError, Loader, RandomResizedCrop, TokenWindows, open_dataset, open_tokens
    budget = float(sys.argv[1])
    for line in sys.stdin:  # one trial per line: "<mode> <kind> <path>"
        mode, kind, path = line.split()
        deadline = time.monotonic() + budget
        try:
            if mode == "reader":
                with (open_tokens(path) if kind == "tokens" else open_dataset(path)) as ds:
                    print("open", flush=True)
                    while time.monotonic() < deadline:
                        if kind == "tokens":
                            for i in range(ds.documents):
                                ds.document(i)
                            ds.dataset.verify()
                        else:
                            for i in range(len(ds)):
                                ds[i]
                            ds.verify()
            else:
                pipes = ({"image": [RandomResizedCrop(32)]} if kind == "image" else
                         {"tokens": [TokenWindows(16)]})
                with Loader(path, batch_size=4, pipelines=pipes, num_threads=2, page_cache=mode,
                            order="quasi_random", seed=0, verify_pages=kind == "tokens") as loader:
                    print("open", flush=True)
                    while time.monotonic() < deadline:
                        for batch in loader:
                            pass
            print("done ok", flush=True)
        except FormatError as exc:
            print("done", type(exc).__name__, flush=True)
""")


def _mutate(path, other, rng: random.Random) -> str:
    size = os.path.getsize(path)
    how = rng.choice(["truncate", "cp", "rewrite", "overwrite"])
    if how == "truncate":
        os.truncate(path, rng.randrange(0, size))
    elif how == "cp":  # cp other live: O_TRUNC, then the other file's bytes
        shutil.copyfile(other, path)
    elif how == "rewrite":  # written in place from the start, then cut or extended to the other's size
        with open(path, "r+b") as f:
            f.write(other.read_bytes())
            f.truncate()
    else:  # same size, a span of other bytes
        with open(path, "r+b") as f:
            f.seek(rng.randrange(0, size))
            f.write(os.urandom(rng.randrange(1, 4096)))
    return how


def _run_trials(tmp_path, files, modes, trials, seed, budget=0.4):
    rng = random.Random(seed)
    # budget: seconds of reading per trial; each mutation lands at a random moment inside it
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(budget)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x.strip()) for x in proc.stdout] + [lines.put(None)],
                     daemon=True).start()

    def expect(prefix):
        try:
            got = lines.get(timeout=120)
        except queue.Empty:
            proc.kill()
            pytest.fail(f"the child gave no {prefix!r} line within 120 s")
        if got is None or not got.startswith(prefix):
            proc.kill()
            _, err = proc.communicate(timeout=60)
            status = proc.wait(timeout=60)
            sig = f" (signal {signal.Signals(-status).name})" if status < 0 else ""
            pytest.fail(f"child exited with status {status}{sig} instead of {prefix!r}:\n{err[-3000:]}")
        return got

    outcomes = {}
    try:
        for k in range(trials * len(modes)):
            mode, kind = modes[k % len(modes)], rng.choice(["image", "tokens"])
            src, other = files[kind]
            path = tmp_path / f"live{k}.pageset"
            shutil.copyfile(src, path)
            os.utime(path, ns=(OLD_MTIME_NS, OLD_MTIME_NS))
            proc.stdin.write(f"{mode} {kind} {path}\n")
            proc.stdin.flush()
            expect("open")
            done = []
            for _ in range(rng.randint(1, 3)):
                time.sleep(rng.uniform(0.0, budget / 2))
                done.append(_mutate(path, other, rng))
            result = expect("done").split()[1]
            assert result in ("ok", "TruncatedFileError", "FileChangedError"), (mode, kind, done, result)
            outcomes.setdefault(mode, []).append(result)
            path.unlink()
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    for mode in modes:  # most trials must have been hit by a change, not only have outlived it
        assert sum(r != "ok" for r in outcomes[mode]) >= len(outcomes[mode]) // 2, outcomes


def test_random_changes_never_kill_the_process(tmp_path, files):
    _run_trials(tmp_path, files, ["os", "process", "reader"], trials=3, seed=1, budget=0.25)


@pytest.mark.slow
def test_random_changes_never_kill_the_process_50_trials(tmp_path, files):
    _run_trials(tmp_path, files, ["os", "process", "reader"], trials=50, seed=2)
