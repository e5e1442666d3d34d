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
mtime; a hit touches its page) are deleted down to 90 % of the bound, never the newest page in the folder nor
the page the evicting call has just read or written (a bound smaller than one page is refused at construction).
Temporary files count towards the bound. Evictions run one at a time on a host (a thread lock, then an exclusive
``flock`` on ``locks/evict.lock``) and each scans the folder afresh: two evictions working from two scans taken
a moment apart (pages touched in between reorder the LRU list) could otherwise each delete the page the other
kept, and leave none.

Temporary files of a writer that died mid-write (SIGKILL, OOM, power loss of a node with a shared folder) are
reclaimed when a cache opens: the writer holds an exclusive ``flock`` on its temporary file from creation to
rename, and the kernel drops that lock when the process dies, whatever killed it. So a temporary file whose
lock can be taken belongs to no live writer and is deleted; one whose lock is held is a live writer's (another
rank's) and is left alone. A lock, not a pid in the name: pids are per pid namespace (ranks in containers
sharing a host folder can have the same pid), a pid is reused after its process died, and a liveness check
cannot see another host's processes; a ``flock`` answers "is its writer alive" for all of them.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from ..format.checksum import crc32

LOCK_STRIPES = 4096
TMP_SUFFIX = ".tmp"


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

    def __init__(self, cache_dir, dataset_id: str, page_crcs: np.ndarray | None, limit_bytes: int, page_size: int,
                 lock_timeout: float = 120.0):
        """Raises ValueError when ``limit_bytes`` < ``page_size`` (no page would stay on disk), NotADirectoryError /
        PermissionError when the folder cannot be made."""
        if int(limit_bytes) < int(page_size):
            raise ValueError(f"cache_limit_bytes={int(limit_bytes):,} is smaller than one page of this dataset "
                             f"({int(page_size):,} bytes): every page would be written and deleted at once; pass "
                             f"cache_limit_bytes >= {int(page_size):,} (several pages: at least the pages of the "
                             "steps in flight) or no cache_dir")
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
        self.page_size = int(page_size)
        self.limit_bytes = int(limit_bytes)
        self.lock_timeout = float(lock_timeout)
        self.hits = self.misses = self.evicted = 0
        self._lock = threading.Lock()
        self._evict_lock = threading.Lock()
        self.reclaimed = self._reclaim_dead_temps()
        self._size = self._scan_size()

    def _path(self, k: int) -> Path:
        return self.dir / f"{k}.page"

    def _scan_size(self) -> int:
        """Bytes of the pages and temporary files in the folder (what the bound limits)."""
        return sum(size for _, size, _ in self._entries(temps=True))

    def _entries(self, temps: bool) -> list[tuple[int, int, str]]:
        """(mtime_ns, size, path) of the pages (and the temporary files, if ``temps``) in the folder."""
        out = []
        with os.scandir(self.dir) as it:
            for e in it:
                if e.name.endswith(".page") or (temps and e.name.endswith(TMP_SUFFIX)):
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    out.append((st.st_mtime_ns, st.st_size, e.path))
        return out

    def _reclaim_dead_temps(self) -> int:
        """Delete the temporary files whose writer is dead (their flock can be taken); return how many."""
        reclaimed = 0
        with os.scandir(self.dir) as it:
            names = [e.path for e in it if e.name.endswith(TMP_SUFFIX)]
        for path in names:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # renamed into place (or reclaimed by another process) meanwhile
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # a live writer holds it
                    continue
                try:  # unlink only the file we locked (never one created since under that name)
                    if os.stat(path).st_ino == os.fstat(fd).st_ino:
                        os.unlink(path)
                        reclaimed += 1
                except FileNotFoundError:
                    pass
            finally:
                os.close(fd)  # drops the lock
        return reclaimed

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
        """Write page ``k`` under a temporary name, locked (see the module notes), and rename it into place."""
        for _ in range(3):
            tmp = self.dir / f".{k}.{os.getpid()}.{uuid.uuid4().hex}{TMP_SUFFIX}"  # never reused
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # held until closed: the kernel drops it if this process dies
                try:  # a reclaimer may have taken the unlocked file between open and flock: start again
                    if os.stat(tmp).st_ino != os.fstat(fd).st_ino:
                        continue
                except FileNotFoundError:
                    continue
                with open(fd, "wb", closefd=False) as f:
                    f.write(memoryview(page))
                os.replace(tmp, self._path(k))
            finally:
                os.close(fd)
            _touch(self._path(k))
            return
        # three reclaims in a row (only if other processes open caches non-stop): the page is not cached

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
            self._evict(os.fspath(self._path(k1 - 1)))
        return out

    def _evict(self, keep: str) -> None:
        """Delete the least recently used pages down to 90 % of the bound, sparing ``keep`` (the path of the
        page this call read or wrote last) and the newest page; one eviction at a time on the host."""
        with self._evict_lock:
            fd = os.open(self.lock_dir / "evict.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # short (one scan, a few unlinks); dropped if this process dies
                every = self._entries(temps=True)  # live writers' temporary files count, but are never deleted
                entries = sorted(e for e in every if e[2].endswith(".page"))
                total = sum(size for _, size, _ in every)
                target = max(int(self.limit_bytes * 0.9), self.page_size)
                evicted = 0
                for _, size, path in entries[:-1]:  # never the newest
                    if total <= target:
                        break
                    if path == keep:
                        continue
                    try:
                        os.unlink(path)
                        evicted += 1
                    except FileNotFoundError:
                        pass
                    total -= size
            finally:
                os.close(fd)
        with self._lock:
            self._size = total
            self.evicted += evicted
