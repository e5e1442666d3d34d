"""The bounded cache of a many-file set's open members (``formats/manyfile.md``), one for every reader of a set.

:class:`MemberCache` keeps at most ``max_open`` members open, closes the least recently used member nobody holds
first, and never closes a member a read in flight holds (so the bound is passed while more are held at once).
The record reader (:class:`~pageset.read.set_dataset.ManyFileDataset`), the Loader's member sources
(:class:`~pageset.load.set_source.SetSource`) and the flat reader's descriptors
(:class:`~pageset.load.set_records.MemberFiles`) are this class over different members: parsed Datasets,
FileSources, file descriptors.

The defaults, defined here only: ``MAX_OPEN_MEMBERS`` members parsed and open at once (their descriptor and index
in memory: a quasi-random window of 8 pages reads up to 8 members and a few windows are in flight, so a set of at
most this many members is never re-opened), ``MAX_OPEN_FILES`` bare descriptors of a flat set (a member costs
only its descriptor there). The Loader lowers both to a quarter of the process's open-file limit
(:func:`max_open_files`).
"""

from __future__ import annotations

import threading

import numpy as np

MAX_OPEN_MEMBERS = 128
MAX_OPEN_FILES = 4096


def max_open_files(cap: int | None = None) -> int:
    """``cap`` (default ``MAX_OPEN_FILES``), or a quarter of this process's soft open-file limit (``ulimit -n``,
    at least 16) if that is lower."""
    cap = MAX_OPEN_FILES if cap is None else int(cap)
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY:
            return min(cap, max(16, soft // 4))
    except (ImportError, OSError, ValueError):  # no resource module (Windows): the constant
        pass
    return cap


class MemberCache:
    """Members ``0 .. n-1`` of a set, opened on demand by ``open_member(k) -> item``, closed by
    ``close_member(k, item)``; at most ``max_open`` (an int >= 1) stay open when nobody holds them.

    - ``acquire(ks)`` -> the items of members ``ks`` (a sequence or int64 array, repeats allowed), opened now if
      closed (in order of first appearance), held until ``release(ks)`` with the same ``ks``. A call holds each
      distinct member once. ``hold(ks)`` is ``acquire`` without building the list (the hot path of flat reads).
    - ``acquire_within(ks)``: ``acquire`` unless that opens members and the members held would then pass
      ``max_open`` (a read of more members than may be open at once): then None, nothing held.
    - ``get(k)``: member k's item, opened if needed, not held (closed again when it is the least recently used
      beyond ``max_open``).
    - ``put(k, item)``: an item opened elsewhere (the caller's first member) entered as open and just used.
    - ``peek(k)`` (the item or None; no use recorded), ``open_members()`` (least recently used first),
      ``items()`` (a snapshot {k: item}), ``opens`` (calls of ``open_member`` so far), ``fit`` (every member
      fits: nothing is ever closed before ``close()``).
    - ``close()`` closes every member; later acquires raise RuntimeError(``closed_message``), or, when that is
      None, open members again (a record reader may be read after ``close()``, as one file's Dataset).

    Recency: one tick per call, ties broken by the lower member index. Errors of ``open_member`` reach the
    caller; the members of that call are then not held. Thread-safe (one re-entrant lock: ``open_member`` and
    ``close_member`` run under it and may call back into the cache).
    """

    def __init__(self, n: int, open_member, close_member, max_open: int,
                 closed_message: str | None = "the loader was closed"):
        self.n, self.max_open = int(n), int(max_open)
        if self.max_open < 1:
            raise ValueError(f"max_open must be an int >= 1, got {max_open!r}")
        self.fit = self.max_open >= self.n
        self._open_member, self._close_member, self._closed_message = open_member, close_member, closed_message
        self._items: list = [None] * self.n
        self._is_open = np.zeros(self.n, dtype=bool)
        self._users = np.zeros(self.n, dtype=np.int64)  # reads in flight holding each member
        self._used = np.zeros(self.n, dtype=np.int64)  # tick of each member's last use (the LRU order)
        self._tick = 0
        self._n_open = 0
        self.opens = 0
        self.closed = False
        self.lock = threading.RLock()

    # ---- holding ------------------------------------------------------------------------------------------
    def _check(self) -> None:
        if self.closed:
            raise RuntimeError(self._closed_message)

    def _hold(self, ks: np.ndarray) -> None:  # (the caller holds the lock)
        self._check()
        shut = ks[~self._is_open[ks]]
        if shut.size:
            u, first = np.unique(shut, return_index=True)
            try:
                for k in u[np.argsort(first, kind="stable")].tolist():
                    item = self._open_member(k)
                    self._items[k] = item
                    self._is_open[k] = True
                    self._n_open += 1
                    self.opens += 1
            except BaseException:  # nothing of this call held; what it opened may be closed again
                if self._n_open > self.max_open:
                    self._evict()
                raise
        self._users[ks] += 1  # once per distinct member (a buffered fancy-index add), as release
        self._tick += 1
        self._used[ks] = self._tick
        if self._n_open > self.max_open:
            self._evict()

    def hold(self, ks) -> None:
        ks = np.asarray(ks, dtype=np.int64)
        with self.lock:
            self._hold(ks)

    def acquire(self, ks) -> list:
        ks = np.asarray(ks, dtype=np.int64)
        with self.lock:
            self._hold(ks)
            return [self._items[k] for k in ks.tolist()]

    def acquire_within(self, ks) -> list | None:
        ks = np.asarray(ks, dtype=np.int64)
        with self.lock:
            self._check()
            u = np.unique(ks)
            if u.shape[0] > 1 and not self._is_open[u].all():
                if int(np.count_nonzero(self._users)) + int(np.count_nonzero(self._users[u] == 0)) > self.max_open:
                    return None
            self._hold(ks)
            return [self._items[k] for k in ks.tolist()]

    def release(self, ks) -> None:
        ks = np.asarray(ks, dtype=np.int64)
        with self.lock:
            self._users[ks] -= 1
            if self._n_open > self.max_open:
                self._evict()

    def get(self, k: int):
        with self.lock:
            (item,) = self.acquire([k])
            self.release([k])
            return item

    def put(self, k: int, item) -> None:
        with self.lock:
            self._check()
            if not self._is_open[k]:
                self._items[k] = item
                self._is_open[k] = True
                self._n_open += 1
            self._tick += 1
            self._used[k] = self._tick
            if self._n_open > self.max_open:
                self._evict()

    # ---- looking ------------------------------------------------------------------------------------------
    def peek(self, k: int):
        return self._items[k]

    def items(self) -> dict:
        with self.lock:
            return {k: self._items[k] for k in self._open_order()}

    def open_members(self) -> list[int]:
        with self.lock:
            return self._open_order()

    def _open_order(self) -> list[int]:
        ks = np.flatnonzero(self._is_open)
        return ks[np.argsort(self._used[ks], kind="stable")].tolist()

    # ---- closing ------------------------------------------------------------------------------------------
    def _shut(self, k: int) -> None:
        item, self._items[k] = self._items[k], None
        self._is_open[k] = False
        self._n_open -= 1
        self._close_member(k, item)

    def _evict(self) -> None:
        """Close the least recently used members nobody holds until at most ``max_open`` are open."""
        idle = np.flatnonzero(self._is_open & (self._users == 0))
        extra = min(self._n_open - self.max_open, idle.shape[0])
        if extra <= 0:
            return
        for k in idle[np.argsort(self._used[idle], kind="stable")[:extra]].tolist():
            self._shut(k)

    def close(self) -> None:
        """Close every open member (the first error of ``close_member`` is raised after all were tried)."""
        with self.lock:
            self.closed = self._closed_message is not None
            err = None
            for k in self._open_order():
                try:
                    self._shut(k)
                except BaseException as exc:  # noqa: BLE001 - close the others, then raise it
                    err = err or exc
            if err is not None:
                raise err
