"""An on-disk page cache shared by the processes of one host (``Loader(url, cache_dir=...)``).

Layout: ``<cache_dir>/<dataset_id>/<page>.page`` holds page ``page`` of the dataset whose content hash is
``dataset_id`` (so two objects with the same content share pages, and a rewritten file never reads stale ones).
A page is written to a temporary name and renamed into place, so a reader sees a whole page or none; every page
read from disk is CRC-checked again (a damaged or torn cache file is deleted and fetched anew).

Processes that miss the same page at the same time do not both download it: a miss takes an exclusive
``flock`` on the page's lock file (``locks/<page mod 4096>.lock``, taken in ascending order, so two runs never
deadlock), looks again, and only then fetches; the others wait on the lock and then find the page on disk. A
lock not obtained within ``lock_timeout`` seconds is skipped (the page is fetched anyway: slower, never wrong).

Size bound, one for the whole ``cache_dir``: ``limit_bytes`` bounds the pages and temporary files of every
dataset folder under ``cache_dir`` together (as Mosaic Streaming's ``cache_limit`` bounds its local cache
folder), not each dataset's folder: two datasets, the members of a many-file set, or runs with other settings
sharing a folder hold at most one limit between them. It is enforced when a cache opens (a folder filled under a
larger limit is cut at once, before the first page is read: a run whose pages are all on disk writes nothing,
and would otherwise never evict) and whenever the pages written push the folder past it. Eviction deletes the
least recently used pages of any dataset (by mtime; a hit touches its page) down to 90 % of the bound, never the
newest page under ``cache_dir`` nor the page the evicting call has just read or written (a bound smaller than one
page is refused at construction); dead writers' temporary files are reclaimed first, a live writer's count but
stay. Only what a cache writes is counted or deleted: ``*.page`` and temporary files in folders with a
``locks`` folder (a cache's dataset folders); anything else a user keeps under ``cache_dir`` is left alone.
Each process sharing a folder (ranks, other jobs) applies its own ``limit_bytes``: pass the same one to all.

Several processes: each counts the folder's bytes as of its last scan plus its own writes since; it scans the
whole folder again (and evicts if past its bound) after every ``1/RESCAN_FRACTION`` of the bound it writes and
after each run that takes its count past the bound. So N processes writing at once hold at most
``limit x (1 + N / 32)`` plus one request's pages each; any eviction brings the folder back to 90 %. One scan:
a ``scandir`` of each dataset folder (``stat`` of each page), amortised to at most 32 stats per page written.
Evictions run one at a time on a host (a thread lock, then an exclusive ``flock`` on ``<cache_dir>/evict.lock``)
and each scans the folder afresh: two evictions working from two scans taken a moment apart (pages touched in
between reorder the LRU list) could otherwise each delete the page the other kept, and leave none. The caches of
one process share their count of a folder (a registry keyed by the folder's real path, while one is open): the
first to open scans it, the members of a many-file set opened later do not scan it again.

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
import weakref
from pathlib import Path

import numpy as np

from ..format.checksum import crc32

LOCK_STRIPES = 4096
TMP_SUFFIX = ".tmp"
PAGE_SUFFIX = ".page"
RESCAN_FRACTION = 32  # a process scans the whole cache_dir again after writing 1/32 of its bound
EVICT_TO = 0.9  # an eviction deletes down to this share of the bound


def _touch(path: Path) -> None:
    """Stamp ``path`` with the current time in ns (LRU by mtime). An explicit stamp, because the kernel's own
    file times are coarse (one tick, ~4 ms): pages written in one tick would tie and be evicted in name order."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except FileNotFoundError:
        pass


class _Folder:
    """What the caches of one process know of one ``cache_dir``: ``size``, its bytes (pages and temporary files of
    every dataset folder) as of the last scan plus this process's writes since, ``written`` (this process's writes
    since that scan); ``lock`` guards both, ``evict_lock`` makes this process's evictions one at a time."""

    def __init__(self, root: Path):
        self.root = root
        self.lock = threading.Lock()
        self.evict_lock = threading.Lock()
        self.size = self.written = 0
        self.scanned_once = False

    def dataset_dirs(self) -> list[str]:
        """The cache's dataset folders under the root: its subfolders with a ``locks`` folder."""
        out = []
        with os.scandir(self.root) as it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False) and os.path.isdir(os.path.join(e.path, "locks")):
                        out.append(e.path)
                except OSError:  # removed meanwhile
                    continue
        return out

    def entries(self, temps: bool) -> list[tuple[int, int, str]]:
        """(mtime_ns, size, path) of the pages (and the temporary files, if ``temps``) of every dataset folder."""
        out = []
        for d in self.dataset_dirs():
            try:
                it = os.scandir(d)
            except FileNotFoundError:
                continue
            with it:
                for e in it:
                    if e.name.endswith(PAGE_SUFFIX) or (temps and e.name.endswith(TMP_SUFFIX)):
                        try:
                            st = e.stat()
                        except FileNotFoundError:
                            continue
                        out.append((st.st_mtime_ns, st.st_size, e.path))
        return out

    def scanned(self, total: int) -> None:
        with self.lock:
            self.size, self.written, self.scanned_once = total, 0, True


_FOLDERS: "weakref.WeakValueDictionary[str, _Folder]" = weakref.WeakValueDictionary()
_FOLDERS_LOCK = threading.Lock()


def _folder(root: Path) -> _Folder:
    """This process's :class:`_Folder` of ``root``, shared by its open caches (made when none is open)."""
    key = os.path.realpath(root)
    with _FOLDERS_LOCK:
        folder = _FOLDERS.get(key)
        if folder is None:
            folder = _FOLDERS[key] = _Folder(Path(key))
        return folder


class DiskPageCache:
    """Pages of one dataset under ``cache_dir``; thread- and process-safe.

    ``get_run(k0, k1, fetch)`` -> ``{page: uint8 array}`` for pages ``[k0, k1)``: from disk where present,
    else from ``fetch(a, b)`` (a list of CRC-checked page arrays for ``[a, b)``), written to disk before being
    returned. ``limit_bytes`` bounds the whole ``cache_dir`` (every dataset in it; see the module notes), and is
    enforced at construction. Counters: ``hits``, ``misses`` (pages), ``evicted`` (pages, of any dataset under
    ``cache_dir``, deleted by this cache's evictions), ``reclaimed`` (dead writers' temporary files deleted at
    open).
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
        self.root = Path(cache_dir)
        self.dir = self.root / dataset_id
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
        folder = self._folder = _folder(self.root)
        with folder.evict_lock:  # a cache opening meanwhile in another thread reads the count once it is scanned
            # the first cache of this process on the folder: every dataset folder's dead temporary files, then a
            # scan; later ones (the members of a set): their own folder's, and a scan only if that deleted any
            first = not folder.scanned_once
            self.reclaimed = self._reclaim_dead_temps(folder.dataset_dirs() if first else [os.fspath(self.dir)])
            if first or self.reclaimed:
                folder.scanned(sum(size for _, size, _ in folder.entries(temps=True)))
        if self._size > self.limit_bytes:  # filled by a run with a larger bound (or by other datasets): cut now
            self._enforce(None)

    def _path(self, k: int) -> Path:
        return self.dir / f"{k}.page"

    @property
    def _size(self) -> int:
        """Bytes of the pages and temporary files under ``cache_dir`` as this process counts them (what the
        bound limits)."""
        return self._folder.size

    @staticmethod
    def _reclaim_dead_temps(folders: list[str]) -> int:
        """Delete the temporary files in ``folders`` whose writer is dead (their flock can be taken); return how
        many."""
        reclaimed = 0
        names = []
        for d in folders:
            try:
                with os.scandir(d) as it:
                    names += [e.path for e in it if e.name.endswith(TMP_SUFFIX)]
            except FileNotFoundError:
                continue
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
        if written:
            folder = self._folder
            with folder.lock:
                folder.size += written
                folder.written += written
                check = folder.size > self.limit_bytes or folder.written >= self.limit_bytes // RESCAN_FRACTION
            if check:
                self._enforce(os.fspath(self._path(k1 - 1)))
        return out

    def _enforce(self, keep: str | None) -> None:
        """Scan the whole ``cache_dir``; past the bound, reclaim dead writers' temporary files, then delete the
        least recently used pages (of any dataset) down to 90 % of the bound, sparing ``keep`` (the path of the page
        this call read or wrote last) and the newest page. One eviction at a time on the host."""
        folder = self._folder
        evicted = 0
        with folder.evict_lock:
            fd = os.open(folder.root / "evict.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # short (one scan, a few unlinks); dropped if this process dies
                every = folder.entries(temps=True)  # live writers' temporary files count, but are never deleted
                total = sum(size for _, size, _ in every)
                if total > self.limit_bytes:
                    if self._reclaim_dead_temps(folder.dataset_dirs()):
                        every = folder.entries(temps=True)
                        total = sum(size for _, size, _ in every)
                    entries = sorted(e for e in every if e[2].endswith(PAGE_SUFFIX))
                    target = max(int(self.limit_bytes * EVICT_TO), self.page_size)
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
                folder.scanned(total)
            finally:
                os.close(fd)
        with self._lock:
            self.evicted += evicted
