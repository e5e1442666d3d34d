"""The on-disk page cache (``Loader(url, cache_dir=...)``, ``pageset.load.disk_cache``) at its edges: a bound
smaller than one page, and the temporary file of a writer killed mid-write (a real child process, SIGKILLed
while it holds its temporary file): reclaimed when a cache opens, counted in the bound, and never taken from
a writer that is still alive (ranks share a cache folder)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import fsspec
import numpy as np
import pytest

from pageset import Loader, TokenWindows, open_tokens, write_tokens
from pageset.load import disk_cache
from pageset.load.disk_cache import DiskPageCache

PAGE = 4096


@pytest.fixture()
def memory_url(tmp_path):
    """A small token file (4096-byte pages) served by fsspec's in-memory filesystem: ``(url, local path)``."""
    tokens = np.random.default_rng(0).integers(0, 1000, 20479).astype(np.uint16)  # + EOS: 10 full pages
    path = tmp_path / "t.pageset"
    write_tokens(path, [tokens], None, eos_id=1001, num_workers=0, page_size=PAGE, progress=False)
    name = f"/disk-cache-{os.getpid()}-{tmp_path.name}.pageset"
    fs = fsspec.filesystem("memory")
    fs.pipe(name, path.read_bytes())
    yield f"memory://{name}", path
    fs.rm(name)


def _loader(url, cache, limit):
    return Loader(url, batch_size=4, pipelines={"tokens": [TokenWindows(64)]}, order="sequential", num_threads=1,
                  cache_dir=cache, cache_limit_bytes=limit)


def test_a_bound_smaller_than_one_page_is_refused(memory_url, tmp_path):
    url, _ = memory_url
    with pytest.raises(ValueError, match=rf"{url}: cache_limit_bytes=4,095 is smaller than one page of this "
                                         r"dataset \(4,096 bytes\).*pass cache_limit_bytes >= 4,096"):
        _loader(url, tmp_path / "cache", PAGE - 1)


def test_a_one_page_bound_keeps_the_newest_page(memory_url, tmp_path):
    """With the bound at one page, the page just written stays on disk (evicting down to 90 % of the bound
    deleted every page as soon as it was written), and it holds the file's bytes."""
    url, local = memory_url
    cache = tmp_path / "cache"
    with _loader(url, cache, PAGE) as loader:
        steps = sum(1 for _ in loader)
        stats, dataset_id = loader.remote_stats(), loader.dataset_id
    assert steps == loader.steps_per_epoch > 0
    pages = sorted((cache / dataset_id).glob("*.page"))
    assert len(pages) == 1 and stats["disk_misses"] == 10 and stats["disk_evicted"] == 9
    k = int(pages[0].stem)
    with open_tokens(local) as td, open(local, "rb") as f:  # page k: bytes [k * page, +page) of the data section
        f.seek(td.dataset.data_offset + k * PAGE)
        want = f.read(min(PAGE, td.dataset.data_length - k * PAGE))
    assert pages[0].read_bytes() == want


WRITER = textwrap.dedent("""
    import os, sys
    import numpy as np
    from pageset.load import disk_cache

    def stop_before_rename(src, dst):  # the temp file is written and locked: say so, then wait to be killed
        print("WRITTEN", src, flush=True)
        if sys.stdin.readline().strip() == "go":   # or, when told, finish the write
            real_replace(src, dst)

    real_replace = os.replace
    disk_cache.os.replace = stop_before_rename
    cache = disk_cache.DiskPageCache(sys.argv[1], "ds", None, 1 << 20, 4096)
    page = np.arange(4096, dtype=np.uint8)
    cache.get_run(3, 4, lambda a, b: [page])
    print("DONE", flush=True)
""")


def _start_writer(cache_dir: Path) -> tuple[subprocess.Popen, Path]:
    """A child process that writes page 3 into ``cache_dir`` and stops between the write and the rename."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(cache_dir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 300)  # bounded wait for the child's line
    assert ready, "the writer never reached its write"
    line = proc.stdout.readline().split()
    assert line[0] == "WRITTEN", line
    return proc, Path(line[1])


def test_a_killed_writers_temp_file_is_reclaimed_and_counted(tmp_path):
    cache_dir = tmp_path / "cache"
    proc, tmp = _start_writer(cache_dir)
    try:
        assert tmp.is_file() and tmp.stat().st_size == PAGE
        # a cache opened while the writer lives (another rank): its temp file is counted, and left alone
        live = DiskPageCache(cache_dir, "ds", None, 1 << 20, PAGE)
        assert live.reclaimed == 0 and tmp.is_file()
        assert live._size == PAGE
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL and tmp.is_file()  # killed mid-write: the temp file stays behind
    reopened = DiskPageCache(cache_dir, "ds", None, 1 << 20, PAGE)
    assert reopened.reclaimed == 1 and not tmp.exists()
    assert reopened._size == 0 and sorted(p.name for p in (cache_dir / "ds").iterdir()) == ["locks"]


def test_a_live_writer_finishes_after_a_cache_opened(tmp_path):
    """The writer that another cache saw (and did not reclaim) renames its page into place: the page on disk is
    the writer's bytes (CRC-32 checked by a cache that knows the page's checksum)."""
    cache_dir = tmp_path / "cache"
    proc, tmp = _start_writer(cache_dir)
    try:
        DiskPageCache(cache_dir, "ds", None, 1 << 20, PAGE)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        assert ready and proc.stdout.readline().strip() == "DONE"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    want = bytes(range(256)) * 16
    crcs = np.zeros(4, dtype=np.uint32)
    crcs[3] = zlib.crc32(want)
    cache = DiskPageCache(cache_dir, "ds", crcs, 1 << 20, PAGE)
    got = cache.get_run(3, 4, lambda a, b: pytest.fail("page 3 is on disk"))
    assert got[3].tobytes() == want and cache.hits == 1 and not tmp.exists()


def test_a_reclaim_between_create_and_lock_does_not_lose_the_page(tmp_path, monkeypatch):
    """The one moment a writer's temp file is unlocked (created, not yet flocked): a cache opening then takes
    it for a dead writer's. The writer sees its file gone and writes the page again under a new name."""
    real_flock = disk_cache.fcntl.flock
    cache = DiskPageCache(tmp_path, "ds", None, 1 << 20, PAGE)
    raced = []

    def flock(fd, op):
        if op == disk_cache.fcntl.LOCK_EX and not raced:  # the writer's blocking lock, first time
            raced.append(DiskPageCache(tmp_path, "ds", None, 1 << 20, PAGE).reclaimed)
        return real_flock(fd, op)

    monkeypatch.setattr(disk_cache.fcntl, "flock", flock)
    page = np.arange(PAGE, dtype=np.uint8)
    cache.get_run(0, 1, lambda a, b: [page])
    monkeypatch.setattr(disk_cache.fcntl, "flock", real_flock)
    assert raced == [1]  # the reclaimer did delete the unlocked temp file
    assert (tmp_path / "ds" / "0.page").read_bytes() == page.tobytes()
    assert not list((tmp_path / "ds").glob("*.tmp"))
