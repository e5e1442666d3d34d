"""The on-disk page cache (``Loader(url, cache_dir=...)``, ``pageset.load.disk_cache``) at its edges: a bound
smaller than one page, and the temporary file of a writer killed mid-write (a real child process, SIGKILLed
while it holds its temporary file): reclaimed when a cache opens, counted in the bound, and never taken from
a writer that is still alive (ranks share a cache folder)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
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


# ---- DiskPageCache on its own (issue 18: the mutants of load/disk_cache.py), expectations counted by hand ----------

def _page(k: int) -> np.ndarray:
    return np.full(PAGE, k % 251, dtype=np.uint8)


class _Fetch:
    """fetch(a, b) that records its calls and returns pages of known bytes."""

    def __init__(self):
        self.calls = []

    def __call__(self, a, b):
        self.calls.append((a, b))
        return [_page(k) for k in range(a, b)]


def test_a_run_fetches_only_the_missing_pages_in_contiguous_requests(tmp_path):
    cache = DiskPageCache(tmp_path, "ds", None, 100 * PAGE, PAGE)
    fetch = _Fetch()
    cache.get_run(2, 3, fetch)
    cache.get_run(5, 6, fetch)
    assert fetch.calls == [(2, 3), (5, 6)] and (cache.hits, cache.misses) == (0, 2)
    got = cache.get_run(0, 8, fetch)  # on disk: 2 and 5 -> requests [0, 2), [3, 5), [6, 8)
    assert fetch.calls[2:] == [(0, 2), (3, 5), (6, 8)]
    assert sorted(got) == list(range(8)) and all(got[k].tobytes() == _page(k).tobytes() for k in range(8))
    assert (cache.hits, cache.misses, cache.evicted) == (2, 8, 0)
    again = cache.get_run(0, 8, lambda a, b: pytest.fail(f"pages [{a}, {b}) are on disk"))
    assert all(again[k].tobytes() == _page(k).tobytes() for k in range(8)) and cache.hits == 10
    assert all(again[k].dtype == np.uint8 and again[k].shape == (PAGE,) for k in range(8))
    cache.get_run(0, 9, fetch)  # 8 hits and a miss: the counters add up across runs
    assert fetch.calls[-1] == (8, 9) and (cache.hits, cache.misses) == (18, 9)
    names = sorted(p.name for p in (tmp_path / "ds").iterdir())
    assert names == sorted([f"{k}.page" for k in range(9)] + ["locks"])
    mode = (tmp_path / "ds" / "0.page").stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o644 & ~umask
    assert sorted(p.name for p in (tmp_path / "ds" / "locks").iterdir()) == sorted(f"{k}.lock" for k in range(9))


def test_a_damaged_page_on_disk_is_fetched_again(tmp_path):
    crcs = np.array([zlib.crc32(_page(k).tobytes()) for k in range(3)], dtype=np.uint32)
    cache = DiskPageCache(tmp_path, "ds", crcs, 100 * PAGE, PAGE)
    (tmp_path / "ds" / "1.page").write_bytes(_page(7).tobytes())  # wrong bytes under page 1's name
    (tmp_path / "ds" / "2.page").write_bytes(_page(2).tobytes()[:100])  # torn
    (tmp_path / "ds" / "0.page").write_bytes(_page(0).tobytes())  # good
    fetch = _Fetch()
    got = cache.get_run(0, 3, fetch)
    assert fetch.calls == [(1, 3)] and (cache.hits, cache.misses) == (1, 2)
    for k in range(3):
        assert got[k].tobytes() == _page(k).tobytes() == (tmp_path / "ds" / f"{k}.page").read_bytes()


def test_the_bound_evicts_least_recently_used_pages_down_to_90_percent(tmp_path):
    """Bound 10 pages: nothing goes while the folder holds <= 10 pages; the 11th page evicts down to 9 pages
    (the 2 least recently used), a hit makes its page the most recently used."""
    cache = DiskPageCache(tmp_path, "ds", None, 10 * PAGE, PAGE)
    fetch = _Fetch()
    for k in range(10):
        cache.get_run(k, k + 1, fetch)
    assert cache.evicted == 0 and cache._size == 10 * PAGE
    cache.get_run(0, 1, fetch)  # a hit: page 0 is now the newest
    cache.get_run(10, 11, fetch)
    on_disk = sorted(int(p.stem) for p in (tmp_path / "ds").glob("*.page"))
    assert on_disk == [0] + list(range(3, 11)) and cache.evicted == 2 and cache._size == 9 * PAGE
    cache.get_run(11, 12, fetch)  # 10 pages: at the bound, not past it
    assert cache.evicted == 2
    cache.get_run(12, 14, fetch)  # 12 pages: down to 9 (3 go: 3, 4, 5)
    on_disk = sorted(int(p.stem) for p in (tmp_path / "ds").glob("*.page"))
    assert on_disk == [0] + list(range(6, 14)) and cache.evicted == 5 and cache._size == 9 * PAGE
    reopened = DiskPageCache(tmp_path, "ds", None, 10 * PAGE, PAGE)  # the size is scanned from the folder
    assert reopened._size == 9 * PAGE and reopened.reclaimed == 0
    one_run = DiskPageCache(tmp_path, "other", None, 10 * PAGE, PAGE)
    one_run.get_run(0, 12, fetch)  # one run of 12 pages past the bound: down to 9 pages, the newest stay
    assert sorted(int(p.stem) for p in (tmp_path / "other").glob("*.page")) == list(range(3, 12))
    # the bound is the whole cache_dir's: the 9 older pages of "ds" went first, then "other"'s 3 oldest
    assert not list((tmp_path / "ds").glob("*.page"))
    assert one_run.evicted == 12 and one_run._size == 9 * PAGE


def test_eviction_never_deletes_the_page_just_written_nor_the_newest(tmp_path):
    """Bound one page, and a live writer's temporary file (locked, one page) in the folder: the folder is past
    the bound with the page just written alone, which stays (the old eviction deleted it and left no page: CI saw
    a Loader with a one-page bound end with none). A hit spares the page it read, though older."""
    folder = tmp_path / "ds"
    folder.mkdir()
    tmp = folder / ".9.1.cc.tmp"
    tmp.write_bytes(bytes(PAGE))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_EX)  # a live writer's
        cache = DiskPageCache(tmp_path, "ds", None, PAGE, PAGE)
        assert cache.reclaimed == 0 and cache._size == PAGE
        fetch = _Fetch()
        cache.get_run(0, 1, fetch)
        assert sorted(p.name for p in folder.glob("*.page")) == ["0.page"] and cache.evicted == 0
        cache.get_run(1, 2, fetch)  # 0 goes, 1 (just written) stays, the temp file is left alone
        assert sorted(p.name for p in folder.glob("*.page")) == ["1.page"] and cache.evicted == 1
        assert tmp.exists()
    finally:
        os.close(fd)
    elsewhere = tmp_path / "elsewhere"  # a cache_dir of its own (the bound is one cache_dir's)
    other = elsewhere / "other"  # page 5 stamped by a host whose clock runs ahead: newer than anything written here
    other.mkdir(parents=True)
    (other / "0.page").write_bytes(_page(0).tobytes())
    os.utime(other / "0.page", ns=(1, 1))
    (other / "5.page").write_bytes(_page(5).tobytes())
    ahead = time.time_ns() + 10**12
    os.utime(other / "5.page", ns=(ahead, ahead))
    two = DiskPageCache(elsewhere, "other", None, 2 * PAGE, PAGE)
    two.get_run(1, 2, fetch)  # 3 pages > 2: down to 90 % of the bound: 0 goes; 1 is next by age, but just written
    assert sorted(p.name for p in other.glob("*.page")) == ["1.page", "5.page"] and two.evicted == 1


def test_evictions_run_one_at_a_time_on_a_host(tmp_path):
    """An eviction waits for the host-wide eviction lock (``<cache_dir>/evict.lock``, held here as another
    process would hold it) and scans the folder only once it has the lock."""
    import fcntl
    import threading
    cache = DiskPageCache(tmp_path, "ds", None, PAGE, PAGE)
    fetch = _Fetch()
    cache.get_run(0, 1, fetch)
    fd = os.open(tmp_path / "evict.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (cache.get_run(1, 2, fetch), done.set()), daemon=True)
    try:
        worker.start()
        assert not done.wait(0.5)  # blocked on the lock: nothing deleted yet
        assert sorted(p.name for p in (tmp_path / "ds").glob("*.page")) == ["0.page", "1.page"]
        (tmp_path / "ds" / "0.page").unlink()  # what the other process's eviction did meanwhile
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    assert done.wait(30)
    worker.join(30)
    # the scan after the lock sees one page: at the bound, nothing more goes
    assert sorted(p.name for p in (tmp_path / "ds").glob("*.page")) == ["1.page"] and cache.evicted == 0


def test_dead_temp_files_are_reclaimed_and_counted_until_then(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    for name in (".1.99.aa.tmp", ".2.99.bb.tmp"):  # left by writers that died (no lock held)
        (folder / name).write_bytes(bytes(PAGE))
    (folder / "4.page").write_bytes(bytes(100))
    (folder / "notes.txt").write_bytes(bytes(1000))  # neither a page nor a temp file: not counted
    cache = DiskPageCache(tmp_path, "ds", None, 10 * PAGE, PAGE)
    assert cache.reclaimed == 2 and cache._size == 100
    assert sorted(p.name for p in folder.iterdir()) == ["4.page", "locks", "notes.txt"]


def test_reclaiming_goes_past_live_and_vanished_temp_files(tmp_path, monkeypatch):
    """Nine temp files: the first one the folder lists belongs to a live writer (locked), the second vanishes
    before it is opened (renamed into place meanwhile); the seven others are dead writers': all reclaimed."""
    folder = tmp_path / "ds"
    folder.mkdir()
    for i in range(9):
        (folder / f".{i}.7.x{i}.tmp").write_bytes(bytes(10))
    with os.scandir(folder) as it:
        listed = [e.path for e in it]
    fd = os.open(listed[0], os.O_RDONLY)
    disk_cache.fcntl.flock(fd, disk_cache.fcntl.LOCK_EX)
    real_open = disk_cache.os.open

    def vanishing_open(path, *args):
        if os.fspath(path) == listed[1]:
            os.unlink(path)
            raise FileNotFoundError(path)
        return real_open(path, *args)

    monkeypatch.setattr(disk_cache.os, "open", vanishing_open)
    try:
        cache = DiskPageCache(tmp_path, "ds", None, 10 * PAGE, PAGE)
    finally:
        os.close(fd)
    assert cache.reclaimed == 7 and cache._size == 10
    assert sorted(p.name for p in folder.iterdir()) == sorted([Path(listed[0]).name, "locks"])


def test_a_cache_folder_this_process_may_not_write_is_named(tmp_path, monkeypatch):
    def mkdir(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(disk_cache.Path, "mkdir", mkdir)
    with pytest.raises(PermissionError) as info:
        DiskPageCache(tmp_path / "ro", "ds", None, PAGE, PAGE)
    assert str(info.value) == (f"cache_dir {str(tmp_path / 'ro')!r}: cannot create the page cache there ([Errno 13] "
                               f"Permission denied: {str(tmp_path / 'ro' / 'ds' / 'locks')!r}); pass cache_dir= a "
                               "folder this process may write")


def test_the_cache_folder_errors_name_the_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    with pytest.raises(NotADirectoryError) as info:
        DiskPageCache(blocker, "ds", None, PAGE, PAGE)
    assert str(info.value).startswith(f"cache_dir {str(blocker)!r} is not a folder (it or a folder above it is a file")
    assert str(info.value).endswith("pass cache_dir= a folder path (created if missing)")
    with pytest.raises(ValueError) as info:
        DiskPageCache(tmp_path, "ds", None, 3 * PAGE - 1, 3 * PAGE)
    assert str(info.value) == ("cache_limit_bytes=12,287 is smaller than one page of this dataset (12,288 bytes): "
                               "every page would be written and deleted at once; pass cache_limit_bytes >= 12,288 "
                               "(several pages: at least the pages of the steps in flight) or no cache_dir")


def _hold(cache_dir: Path, stripe: int) -> int:
    """An exclusive flock on the lock file of ``stripe`` through a descriptor of our own (another process' lock,
    to the cache: flocks of two open file descriptions conflict even within one process)."""
    (cache_dir / "ds" / "locks").mkdir(parents=True, exist_ok=True)
    fd = os.open(cache_dir / "ds" / "locks" / f"{stripe}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    disk_cache.fcntl.flock(fd, disk_cache.fcntl.LOCK_EX)
    return fd


def _no_waiting(monkeypatch):
    def sleep(s):
        raise AssertionError("the cache waited for a lock")
    monkeypatch.setattr(disk_cache.time, "sleep", sleep)


def test_a_run_locks_only_its_missing_pages_and_hits_take_no_lock(tmp_path, monkeypatch):
    cache = DiskPageCache(tmp_path, "ds", None, 100 * PAGE, PAGE)
    fds = [_hold(tmp_path, 0)]  # another process fetching page 0 (not in the runs below)
    _no_waiting(monkeypatch)
    try:
        fetch = _Fetch()
        cache.get_run(3, 5, fetch)  # locks stripes 3 and 4 only
        assert fetch.calls == [(3, 4 + 1)]
        fds += [_hold(tmp_path, 3), _hold(tmp_path, 4)]  # now 3 and 4 are being fetched elsewhere, too
        got = cache.get_run(3, 5, lambda a, b: pytest.fail("pages 3, 4 are on disk"))  # all hits: no lock
        assert [got[k].tobytes() for k in (3, 4)] == [_page(3).tobytes(), _page(4).tobytes()]
        assert (cache.hits, cache.misses) == (2, 2)
    finally:
        for fd in fds:
            os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "ds" / "locks" / "3.lock").stat().st_mode & 0o777 == 0o644 & ~umask


def test_a_miss_waits_for_the_process_fetching_the_page_and_uses_its_page(tmp_path, monkeypatch):
    """Another process holds page 5's lock (it is fetching it): the run waits, then finds page 5 on disk and
    fetches only page 6; while it fetches, it holds page 6's lock."""
    import threading

    cache = DiskPageCache(tmp_path, "ds", None, 100 * PAGE, PAGE, lock_timeout=600)
    fd = _hold(tmp_path, 5)
    waiting = threading.Event()
    real_sleep = disk_cache.time.sleep

    def sleep(s):
        waiting.set()
        real_sleep(s)

    monkeypatch.setattr(disk_cache.time, "sleep", sleep)
    calls, held = [], []

    def fetch(a, b):
        calls.append((a, b))
        probe = os.open(tmp_path / "ds" / "locks" / "6.lock", os.O_RDWR)
        try:
            disk_cache.fcntl.flock(probe, disk_cache.fcntl.LOCK_EX | disk_cache.fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(probe)
        return [_page(k) for k in range(a, b)]

    out = {}
    t = threading.Thread(target=lambda: out.update(cache.get_run(5, 7, fetch)))
    t.start()
    try:
        for _ in range(600):  # bounded: the run reaches the lock wait at once
            if waiting.wait(1) or not t.is_alive():
                break
        assert waiting.is_set() and not calls, "the run did not wait for the held lock"
        (tmp_path / "ds" / "5.page").write_bytes(_page(5).tobytes())  # the other process's page
    finally:
        os.close(fd)
        t.join(600)
    assert not t.is_alive() and calls == [(6, 7)] and held == [True]
    assert [out[k].tobytes() for k in (5, 6)] == [_page(5).tobytes(), _page(6).tobytes()]
    assert (cache.hits, cache.misses) == (1, 1)


def test_a_lock_not_obtained_in_time_is_skipped_and_the_page_fetched(tmp_path):
    """Page 1's lock is held elsewhere past lock_timeout: the run fetches it anyway, and still holds the lock of
    page 2 (the next stripe) while it fetches."""
    cache = DiskPageCache(tmp_path, "ds", None, 100 * PAGE, PAGE, lock_timeout=0.05)
    fd = _hold(tmp_path, 1)
    held = []

    class Fetch(_Fetch):
        def __call__(self, a, b):
            probe = os.open(tmp_path / "ds" / "locks" / "2.lock", os.O_RDWR)
            try:
                disk_cache.fcntl.flock(probe, disk_cache.fcntl.LOCK_EX | disk_cache.fcntl.LOCK_NB)
                held.append(False)
            except BlockingIOError:
                held.append(True)
            finally:
                os.close(probe)
            return super().__call__(a, b)

    try:
        fetch = Fetch()
        got = cache.get_run(1, 3, fetch)
        assert held == [True]
        assert fetch.calls == [(1, 3)] and [got[k].tobytes() for k in (1, 2)] == [_page(1).tobytes(),
                                                                                _page(2).tobytes()]
        assert (tmp_path / "ds" / "1.page").read_bytes() == _page(1).tobytes()
    finally:
        os.close(fd)


def test_a_live_writers_temp_file_counts_towards_the_bound(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    tmp = folder / ".0.1.live.tmp"
    tmp.write_bytes(bytes(PAGE))
    fd = os.open(tmp, os.O_RDONLY)
    disk_cache.fcntl.flock(fd, disk_cache.fcntl.LOCK_EX)  # its writer is alive
    try:
        cache = DiskPageCache(tmp_path, "ds", None, 10 * PAGE, PAGE)
        assert cache.reclaimed == 0 and cache._size == PAGE
        for k in range(10):  # the 10th page takes the folder to 11 pages' bytes: down to 9 (2 pages go)
            cache.get_run(k, k + 1, _Fetch())
        assert sorted(int(p.stem) for p in folder.glob("*.page")) == list(range(2, 10)) and tmp.exists()
        assert cache.evicted == 2 and cache._size == 9 * PAGE
    finally:
        os.close(fd)


def test_a_temp_file_replaced_between_create_and_lock_is_written_again(tmp_path, monkeypatch):
    """The temp name holds another file once the writer has its lock (the first one was reclaimed and the name
    taken): the writer starts again under a new name, and the page lands whole."""
    real_flock = disk_cache.fcntl.flock
    cache = DiskPageCache(tmp_path, "ds", None, 1 << 20, PAGE)
    swapped = []

    def flock(fd, op):
        if op == disk_cache.fcntl.LOCK_EX and not swapped:
            (name,) = [p for p in (tmp_path / "ds").iterdir() if p.name.endswith(".tmp")]
            name.unlink()
            name.write_bytes(b"someone else's")
            swapped.append(name)
        return real_flock(fd, op)

    monkeypatch.setattr(disk_cache.fcntl, "flock", flock)
    cache.get_run(0, 1, lambda a, b: [_page(0)])
    monkeypatch.setattr(disk_cache.fcntl, "flock", real_flock)
    assert len(swapped) == 1 and (tmp_path / "ds" / "0.page").read_bytes() == _page(0).tobytes()


# ---- issue 28: one bound for the whole cache_dir (every dataset in it), enforced when a cache opens -----------------

BIG_PAGE = 256 << 10


def _token_file(path: Path, mib: int, seed: int) -> Path:
    """A token file of about ``mib`` MiB of data in 256 KiB pages (uint16 tokens, documents of 1-4096)."""
    rng = np.random.default_rng(seed)
    docs, n = [], 0
    while n < (mib << 20) // 2:
        docs.append(rng.integers(0, 60000, int(rng.integers(1, 4096)), dtype=np.uint16))
        n += docs[-1].shape[0] + 1
    write_tokens(path, docs, eos_id=60001, num_workers=0, page_size=BIG_PAGE, progress=False)
    return path


@pytest.fixture(scope="module")
def http_tokens(tmp_path_factory):
    """Two token files (A: ~20 MiB, B: ~8 MiB of data) served by aiohttp's static files on 127.0.0.1 behind the
    fault proxy (no fault set): ``{"A": (url, path), "B": (url, path)}``."""
    from remote_servers import FaultProxy, StaticHTTP

    root = tmp_path_factory.mktemp("http-tokens")
    files = {"A": _token_file(root / "a.pageset", 20, 1), "B": _token_file(root / "b.pageset", 8, 2)}
    with StaticHTTP(root) as http, FaultProxy(http.url) as proxy:
        yield {k: (f"{proxy.url}/{p.name}", p) for k, p in files.items()}


def _cached(cache: Path) -> list[tuple[int, int, Path]]:
    """(mtime_ns, size, path) of every page file under ``cache`` (every dataset folder), oldest first."""
    return sorted((p.stat().st_mtime_ns, p.stat().st_size, p) for p in cache.glob("*/*.page"))


def _epoch(url, cache, limit) -> list[bytes]:
    """One sequential epoch of 1024-token windows (inputs' bytes per batch) with ``cache_dir=cache``."""
    with Loader(url, batch_size=16, pipelines={"tokens": [TokenWindows(1024)]}, order="sequential", num_threads=2,
                cache_dir=cache, cache_limit_bytes=limit, array_type="numpy") as loader:
        return [np.asarray(b["input"]).tobytes() for b in loader]


def _pages_match_the_file(cache: Path, files: dict) -> int:
    """Each page file under ``cache`` holds the bytes of its page in the file of its dataset id (read with open());
    returns how many were checked."""
    n = 0
    for url, path in files.values():
        with open_tokens(path) as td:
            off, length, ds_id = td.dataset.data_offset, td.dataset.data_length, td.dataset.dataset_id
        raw = path.read_bytes()
        for p in (cache / ds_id).glob("*.page"):
            k = int(p.stem)
            assert p.read_bytes() == raw[off + k * BIG_PAGE : off + min((k + 1) * BIG_PAGE, length)], p
            n += 1
    return n


def test_a_cache_filled_by_a_run_is_cut_to_a_lower_limit_at_open(http_tokens, tmp_path):
    """Run 1 (limit 64 MiB) leaves ~20 MiB on disk; run 2 with a 5 MiB limit finds every page it needs there (all
    hits: nothing is written, so the old bound, applied only after a write, left 20 MiB for the whole run). At
    open the cache is cut to 90 % of the new limit, least recently used pages first: what stays is the newest
    pages of the listing taken before (expectation from the file times alone), and after the run it is <= 5 MiB."""
    (url, path), cache = http_tokens["A"], tmp_path / "cache"
    with open_tokens(path) as td:
        data, pages = td.dataset.data_length, td.dataset.page_count
    first = _epoch(url, cache, 64 << 20)
    before = _cached(cache)
    assert sum(s for _, s, _ in before) == data and len(before) == pages  # the whole file (~20 MiB) is on disk
    limit = 5 << 20
    target, keep, total = int(limit * 0.9), [], 0
    for _, size, p in reversed(before):  # newest first, while they fit in 90 % of the limit
        if total + size > target:
            break
        keep.append(p)
        total += size
    with Loader(url, batch_size=16, pipelines={"tokens": [TokenWindows(1024)]}, order="sequential", num_threads=1,
                cache_dir=cache, cache_limit_bytes=limit, array_type="numpy"):
        at_open = _cached(cache)  # the Loader is made, no batch asked for yet
    assert sorted(p for _, _, p in at_open) == sorted(keep) and sum(s for _, s, _ in at_open) <= target
    second = _epoch(url, cache, limit)
    assert second == first
    after = sum(s for _, s, _ in _cached(cache))
    assert 0 < after <= limit and _pages_match_the_file(cache, {"A": http_tokens["A"]}) > 0
    print(f"\ncache_dir after run 1 (limit 64 MiB): {data / 2**20:.2f} MiB; at open with limit 5 MiB: "
          f"{sum(s for _, s, _ in at_open) / 2**20:.2f} MiB; after run 2: {after / 2**20:.2f} MiB")


def test_two_datasets_in_one_cache_dir_share_one_limit(http_tokens, tmp_path):
    """A (~20 MiB) then B (~8 MiB) read through one cache_dir, each run with a 5 MiB limit: the limit bounds the
    whole cache_dir, not each dataset's folder (which held 5 + 5 MiB); B's run evicts A's pages first (older),
    so after it only B's newest pages are left, each holding its page's bytes."""
    cache, limit = tmp_path / "cache", 5 << 20
    _epoch(http_tokens["A"][0], cache, limit)
    assert 0 < sum(s for _, s, _ in _cached(cache)) <= limit
    _epoch(http_tokens["B"][0], cache, limit)
    left = _cached(cache)
    with open_tokens(http_tokens["A"][1]) as a, open_tokens(http_tokens["B"][1]) as b:
        a_id, b_id, b_pages = a.dataset.dataset_id, b.dataset.dataset_id, b.dataset.page_count
    total = sum(s for _, s, _ in left)
    assert 0 < total <= limit
    assert {p.parent.name for _, _, p in left} == {b_id} and (cache / a_id).is_dir()
    assert {int(p.stem) for _, _, p in left} <= set(range(b_pages)) and str(b_pages - 1) in {p.stem for *_, p in left}
    assert _pages_match_the_file(cache, http_tokens) == len(left)
    print(f"\ncache_dir after A then B, each under a 5 MiB limit: {total / 2**20:.2f} MiB")


SHARER = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from pageset.load.disk_cache import DiskPageCache

    cache_dir, ds, pages, limit, page, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \\
        int(sys.argv[5]), sys.argv[6]
    cache = DiskPageCache(cache_dir, ds, None, limit, page)
    fill = int(ds[-1])
    def fetch(a, b):
        return [np.full(page, (fill * 31 + k) % 251, np.uint8) for k in range(a, b)]
    biggest = 0
    sys.stdin.readline()  # both processes start writing together
    for k in range(0, pages, 2):  # runs of two pages
        cache.get_run(k, min(k + 2, pages), fetch)
        total = 0
        for d in os.scandir(cache_dir):
            for e in os.scandir(d.path) if d.is_dir() else ():
                try:  # a temporary file renamed (or a page evicted) meanwhile is not there any more
                    total += e.stat().st_size if e.name.endswith((".page", ".tmp")) else 0
                except FileNotFoundError:
                    pass
        biggest = max(biggest, total)
    json.dump({"biggest": biggest, "evicted": cache.evicted}, open(out, "w"))
""")


def test_processes_writing_two_datasets_into_one_cache_dir_stay_within_the_bound(tmp_path):
    """Two processes write 200 pages each of two datasets into one cache_dir with a 64-page limit, at the same
    time. Each process sees only its own writes between scans; it scans the whole folder after every 1/32 of the
    limit it writes and after each run that takes its count past the limit, so the folder never holds more than
    the limit plus 1/32 of it per process plus one run (two pages) per process (the README's bound), measured
    after every run by both; with a per-dataset bound it reached 128 pages."""
    cache, limit = tmp_path / "cache", 64 * PAGE
    procs = [subprocess.Popen([sys.executable, "-c", SHARER, str(cache), f"ds{i}", "200", str(limit), str(PAGE),
                               str(tmp_path / f"out{i}.json")], stdin=subprocess.PIPE, text=True) for i in (1, 2)]
    try:
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            assert p.wait(timeout=300) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(60)
    res = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in (1, 2)]
    bound = limit + 2 * (limit // 32) + 2 * 2 * PAGE
    final = sum(s for _, s, _ in _cached(cache))
    assert final <= bound and all(r["biggest"] <= bound for r in res), (final, res, bound)
    assert sum(r["evicted"] for r in res) >= 400 - bound // PAGE  # every page over the bound was evicted by one
    for _, _, p in _cached(cache):  # what is left is the pages' own bytes
        fill = int(p.parent.name[-1])
        assert p.read_bytes() == bytes([(fill * 31 + int(p.stem)) % 251]) * PAGE


def test_files_the_cache_did_not_write_are_neither_counted_nor_deleted(tmp_path):
    """The bound counts pages and temporary files in the cache's dataset folders (those with a ``locks``
    folder), nothing else under cache_dir: a user's file there is never deleted to make room."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "0.page").write_bytes(bytes(5 * PAGE))  # a page-named file outside a cache folder
    (tmp_path / "notes.page").write_bytes(bytes(5 * PAGE))
    other = DiskPageCache(tmp_path, "other", None, 100 * PAGE, PAGE)
    other.get_run(0, 4, _Fetch())
    cache = DiskPageCache(tmp_path, "ds", None, 3 * PAGE, PAGE)  # opened past its bound: other's pages go
    assert cache._size <= 3 * PAGE and sorted(int(p.stem) for p in (tmp_path / "other").glob("*.page")) == [2, 3]
    cache.get_run(0, 3, _Fetch())
    assert (tmp_path / "mine" / "0.page").stat().st_size == 5 * PAGE and (tmp_path / "notes.page").exists()
    assert sum(s for _, s, _ in _cached(tmp_path) if s == PAGE) <= 3 * PAGE


def test_a_cache_rescans_what_another_process_wrote_after_it_opened(tmp_path):
    """This process opens its cache on an empty cache_dir (it counts 0 bytes); another process then fills the
    folder to its 64-page limit and exits; this one writes its own pages: it scans again after 1/32 of the limit
    written, sees the other's pages and evicts, so the folder never passes the limit plus 1/32 of it plus one
    run (measured after every run). Counting only its own writes, it wrote ~64 pages before evicting (~128)."""
    cache_dir, limit = tmp_path / "cache", 64 * PAGE
    mine = DiskPageCache(cache_dir, "ds1", None, limit, PAGE)
    assert mine._size == 0
    other = subprocess.Popen([sys.executable, "-c", SHARER, str(cache_dir), "ds2", "200", str(limit), str(PAGE),
                              str(tmp_path / "out2.json")], stdin=subprocess.PIPE, text=True)
    try:
        other.stdin.write("go\n")
        other.stdin.flush()
        assert other.wait(timeout=300) == 0
    finally:
        if other.poll() is None:
            other.kill()
            other.wait(60)
    assert 0.9 * limit <= sum(s for _, s, _ in _cached(cache_dir)) <= limit
    biggest = 0
    for k in range(0, 100, 2):
        mine.get_run(k, k + 2, lambda a, b: [np.full(PAGE, (31 + j) % 251, np.uint8) for j in range(a, b)])
        biggest = max(biggest, sum(s for _, s, _ in _cached(cache_dir)))
    assert biggest <= limit + limit // 32 + 2 * PAGE, biggest / PAGE
    assert not list((cache_dir / "ds2").glob("*.page"))  # the other's pages were older: they went first
