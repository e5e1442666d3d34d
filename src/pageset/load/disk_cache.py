"""An on-disk page cache shared by the processes of one host (``Loader(url, cache_dir=...)``).

Layout: ``<cache_dir>/<dataset_id>/<page>.page`` holds page ``page`` of the dataset whose content hash is
``dataset_id`` (so two objects with the same content share pages, and a rewritten file never reads stale ones).
A page is written to a temporary name and renamed into place, so a reader sees a whole page or none; every page
read from disk is CRC-checked again (a damaged or torn cache file is deleted and fetched anew).

Processes that miss the same page at the same time do not both download it: a miss takes an exclusive
``flock`` on the page's lock file (``locks/<page mod 4096>.lock``, taken in ascending order, so two runs never
deadlock), looks again, and only then fetches; the others wait on the lock and then find the page on disk. A
lock not obtained within ``lock_timeout`` seconds is skipped (the page is fetched anyway: slower, never wrong).

Size bound: when the pages written push the directory past ``limit_bytes``, the least recently used pages (by
mtime; a hit touches its page) are deleted down to 90 % of the bound.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import numpy as np

from ..format.checksum import crc32

LOCK_STRIPES = 4096


def _touch(path: Path) -> None:
    """Stamp ``path`` with the current time in ns (LRU by mtime). An explicit stamp, because the kernel's own
    file times are coarse (one tick, ~4 ms): pages written in one tick would tie and be evicted in name order."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except FileNotFoundError:
        pass


class DiskPageCache:
    """Pages of one dataset under ``cache_dir``; thread- and process-safe.

    ``get_run(k0, k1, fetch)`` -> ``{page: uint8 array}`` for pages ``[k0, k1)``: from disk where present,
    else from ``fetch(a, b)`` (a list of CRC-checked page arrays for ``[a, b)``), written to disk before being
    returned. Counters: ``hits``, ``misses`` (pages), ``evicted`` (pages deleted by the size bound).
    """

    def __init__(self, cache_dir, dataset_id: str, page_crcs: np.ndarray | None, limit_bytes: int,
                 lock_timeout: float = 120.0):
        self.dir = Path(cache_dir) / dataset_id
        self.lock_dir = self.dir / "locks"
        try:
            self.lock_dir.mkdir(parents=True, exist_ok=True)
        except (NotADirectoryError, FileExistsError) as exc:
            raise NotADirectoryError(f"cache_dir {os.fspath(cache_dir)!r} is not a folder (it or a folder above it is "
                                     f"a file: {exc}); pass cache_dir= a folder path (created if missing)") from None
        except PermissionError as exc:
            raise PermissionError(f"cache_dir {os.fspath(cache_dir)!r}: cannot create the page cache there ({exc}); "
                                  "pass cache_dir= a folder this process may write") from None
        self.page_crcs = page_crcs
        self.limit_bytes = int(limit_bytes)
        self.lock_timeout = float(lock_timeout)
        self.hits = self.misses = self.evicted = 0
        self._lock = threading.Lock()
        self._size = self._scan_size()

    def _path(self, k: int) -> Path:
        return self.dir / f"{k}.page"

    def _scan_size(self) -> int:
        total = 0
        with os.scandir(self.dir) as it:
            for e in it:
                if e.name.endswith(".page"):
                    try:
                        total += e.stat().st_size
                    except FileNotFoundError:
                        pass
        return total

    def _load(self, k: int) -> np.ndarray | None:
        path = self._path(k)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if self.page_crcs is not None and crc32(data) != int(self.page_crcs[k]):
            try:  # torn or damaged cache file: drop it, fetch again
                path.unlink()
            except FileNotFoundError:
                pass
            return None
        _touch(path)
        return np.frombuffer(data, dtype=np.uint8)

    def _store(self, k: int, page: np.ndarray) -> None:
        tmp = self.dir / f".{k}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(memoryview(page))
        os.replace(tmp, self._path(k))
        _touch(self._path(k))

    def _acquire(self, pages: list[int]) -> list[int]:
        """Exclusive flocks on the stripes of ``pages`` (ascending); returns the open descriptors."""
        fds = []
        deadline = time.monotonic() + self.lock_timeout
        for stripe in sorted({k % LOCK_STRIPES for k in pages}):
            fd = os.open(self.lock_dir / f"{stripe}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fds.append(fd)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:  # give up on sharing, never on correctness
                        os.close(fd)
                        break
                    time.sleep(0.005)
        return fds

    @staticmethod
    def _release(fds: list[int]) -> None:
        for fd in reversed(fds):
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def get_run(self, k0: int, k1: int, fetch) -> dict[int, np.ndarray]:
        out = {}
        for k in range(k0, k1):
            page = self._load(k)
            if page is not None:
                out[k] = page
        if len(out) == k1 - k0:
            with self._lock:
                self.hits += len(out)
            return out
        fds = self._acquire([k for k in range(k0, k1) if k not in out])
        written = 0
        try:
            for k in range(k0, k1):  # another process may have fetched them while we waited
                if k not in out:
                    page = self._load(k)
                    if page is not None:
                        out[k] = page
            hits = len(out)
            missing = [k for k in range(k0, k1) if k not in out]
            while missing:  # contiguous sub-runs of the missing pages, one request each
                a = b = missing[0]
                while b + 1 in missing:
                    b += 1
                for k, page in zip(range(a, b + 1), fetch(a, b + 1)):
                    self._store(k, page)
                    out[k] = page
                    written += page.nbytes
                missing = [k for k in missing if k > b]
        finally:
            self._release(fds)
        with self._lock:
            self.hits += hits
            self.misses += k1 - k0 - hits
            self._size += written
            over = self._size > self.limit_bytes
        if over:
            self._evict()
        return out

    def _evict(self) -> None:
        entries = []
        with os.scandir(self.dir) as it:
            for e in it:
                if e.name.endswith(".page"):
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    entries.append((st.st_mtime_ns, st.st_size, e.path))
        total = sum(size for _, size, _ in entries)
        target = int(self.limit_bytes * 0.9)
        evicted = 0
        for _, size, path in sorted(entries):
            if total <= target:
                break
            try:
                os.unlink(path)
                evicted += 1
            except FileNotFoundError:
                pass
            total -= size
        with self._lock:
            self._size = total
            self.evicted += evicted
