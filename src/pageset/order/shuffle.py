"""Epoch permutations for order v1: which record id sits at each epoch position.

An epoch permutation maps an epoch position ``p`` in ``[0, N)`` to a record id in ``[0, N)`` (ids in file
order; page ``k`` holds ids ``[a_k, a_{k+1})`` where ``a`` is the prefix sum of ``page_sizes``). Three orders:

- ``"sequential"``: the identity.
- ``"random"``: a Fisher-Yates permutation of all N ids; step ``i`` uses
  ``key(seed, epoch, TAG_PERMUTATION, i)``.
- ``"quasi_random"`` with ``M = window_pages``:
  1. permute the page numbers ``0..K-1`` by Fisher-Yates with ``key(seed, epoch, TAG_PAGES, i)``;
  2. window ``w`` is the pages ``page_order[w*M : (w+1)*M]`` (the last window may hold fewer pages);
  3. its ids are the ids of those pages, concatenated in ``page_order`` order, each page's ids ascending,
     then shuffled by Fisher-Yates where step ``i`` uses ``key_step(key(seed, epoch, TAG_WINDOW, w), i)``
     (splitmix64 chained over seed, epoch, tag, window index, step);
  4. the epoch is windows 0, 1, ... concatenated. Window ``w`` covers positions
     ``[window_starts[w], window_starts[w+1])``, prefix sums of the window sizes, so any position range is
     computable from the windows it touches: resume costs O(K + window), never a replay.
  ``M = 1`` is page-local (pages in random order, each page's records shuffled); ``M >= K`` is one window,
  a full shuffle (not the same permutation as ``"random"``: other keys).

Fisher-Yates is Durstenfeld's in-place form (R. Durstenfeld, "Algorithm 235: Random permutation", CACM 7(7),
1964; Knuth TAOCP vol. 2, Algorithm P): for ``i = n-1 .. 1`` swap ``values[i]`` with ``values[j]``,
``j = randbelow(key_i, i + 1)`` (Lemire 2019, exactly unbiased; see ``keys.py``). Keys are counter-based
(splitmix64), so nothing depends on process, thread, ``PYTHONHASHSEED`` or any global RNG.

Pages may be empty (``page_sizes[k] == 0``): the format lets a record larger than a page own several pages,
so pages after its first hold no record start. Empty pages take part in the page permutation and in windows
but contribute no positions. ``N == 0`` gives empty permutations.

Each kernel has a pure-Python twin (``*_py``) used by the tests to check results on small N.
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict

import numba
import numpy as np

from .keys import (
    MASK64,
    TAG_PAGES,
    TAG_PERMUTATION,
    TAG_WINDOW,
    key,
    key_base_py,
    key_py,
    key_step,
    key_step_py,
    randbelow,
    randbelow_py,
)

ORDERS = ("sequential", "random", "quasi_random")


# --- kernels ------------------------------------------------------------------------------------------


@numba.njit(nogil=True)
def _fisher_yates(values, base):
    """Shuffle ``values`` (int64[n]) in place for stream ``base`` (uint64).

    Step i = n-1 .. 1 swaps i and ``j = randbelow(key_step(base, i), i + 1)``.
    """
    for i in range(values.shape[0] - 1, 0, -1):
        j = np.int64(randbelow(key_step(base, i), i + 1))
        tmp = values[i]
        values[i] = values[j]
        values[j] = tmp


@numba.njit(nogil=True)
def _shuffled_arange(n, base):
    """``arange(n)`` shuffled by :func:`_fisher_yates` with stream ``base``: int64[n]."""
    out = np.arange(n, dtype=np.int64)
    _fisher_yates(out, base)
    return out


@numba.njit(nogil=True)
def _quasi_random_windows(
    page_starts, page_order, window_pages, window_starts, seed, epoch, first, last, out
):
    """Write the ids of windows ``[first, last)`` into ``out``.

    out: int64[window_starts[last] - window_starts[first]], written in place.

    page_starts: int64[K+1] first id of each page; page_order: int64[K] permuted pages; window_starts:
    int64[n_windows+1] first position of each window. seed, epoch: uint64.
    """
    n_pages = page_order.shape[0]
    origin = window_starts[first]
    for w in range(first, last):
        n = window_starts[w] - origin
        for q in range(w * window_pages, min((w + 1) * window_pages, n_pages)):
            p = page_order[q]
            for rid in range(page_starts[p], page_starts[p + 1]):
                out[n] = rid
                n += 1
        _fisher_yates(out[window_starts[w] - origin : n], key(seed, epoch, TAG_WINDOW, w))


# --- pure-Python twins (reference implementations for the tests; O(N) Python objects) -----------------


def fisher_yates_py(values: list[int], base: int) -> list[int]:
    """Pure-Python twin of the Fisher-Yates kernel: a shuffled copy of ``values`` for stream ``base``."""
    out = list(values)
    for i in range(len(out) - 1, 0, -1):
        j = randbelow_py(key_step_py(base, i), i + 1)
        out[i], out[j] = out[j], out[i]
    return out


def epoch_permutation_py(page_sizes, seed: int, epoch: int, order: str, window_pages: int = 1) -> list[int]:
    """Pure-Python twin of :func:`epoch_permutation`, written from the module docstring, not the kernels."""
    sizes = [int(s) for s in page_sizes]
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    n = starts[-1]
    if order == "sequential":
        return list(range(n))
    if order == "random":
        return fisher_yates_py(list(range(n)), key_base_py(seed, epoch, TAG_PERMUTATION))
    if order != "quasi_random":
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    pages = fisher_yates_py(list(range(len(sizes))), key_base_py(seed, epoch, TAG_PAGES))
    out: list[int] = []
    for w, q in enumerate(range(0, len(pages), window_pages)):
        ids = [rid for p in pages[q : q + window_pages] for rid in range(starts[p], starts[p + 1])]
        out.extend(fisher_yates_py(ids, key_py(seed, epoch, TAG_WINDOW, w)))
    return out


# --- argument checks ----------------------------------------------------------------------------------


def _as_page_sizes(page_sizes) -> np.ndarray:
    """``page_sizes`` as a contiguous int64[K] of records per page, each >= 0 (ValueError otherwise)."""
    arr = np.asarray(page_sizes)
    if arr.ndim != 1:
        raise ValueError(f"page_sizes must be 1-D (records per page), got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"page_sizes must hold integers, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if arr.size and arr.min() < 0:
        k = int(np.argmin(arr))
        raise ValueError(f"page_sizes must be >= 0, got page_sizes[{k}] = {arr[k]}")
    return arr


def _check_params(seed: int, epoch: int, order: str, window_pages: int) -> tuple[int, int, int]:
    """Validate the order parameters; returns (seed, epoch, window_pages) as Python ints."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    seed, epoch = _as_int("seed", seed), _as_int("epoch", epoch)
    window_pages = _as_int("window_pages", window_pages)
    if not 0 <= seed <= MASK64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    if not 0 <= epoch <= MASK64:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    if window_pages < 1:
        raise ValueError(f"window_pages must be >= 1 (1 = page-local order), got {window_pages}")
    return seed, epoch, window_pages


def _as_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got a bool ({value})")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} ({value!r})") from None


def _check_range(start: int, stop: int, limit: int | None) -> tuple[int, int]:
    start, stop = _as_int("start", start), _as_int("stop", stop)
    if not 0 <= start <= stop:
        raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")
    if limit is not None and stop > limit:
        raise ValueError(f"stop={stop} is past the end of the epoch permutation (N={limit})")
    return start, stop


# --- window size: pages per window, given or sized in records ----------------------------------------

DEFAULT_WINDOW_RECORDS = 16384  # R of formats/order.md section 4.1: records a quasi-random window holds, on average


def window_pages_for(page_sizes, window_pages: int | None = None,
                     window_records: int = DEFAULT_WINDOW_RECORDS) -> int:
    """M, the pages per quasi-random window of one page layout (formats/order.md section 4.1).

    ``window_pages`` (an int >= 1) is M as given. ``None`` sizes the window in records: the smallest M whose
    windows hold at least ``window_records`` (R >= 1) records on average, ``M = min(K, max(1, ceil(R*K / N)))``
    for K = ``len(page_sizes)`` pages (empty pages counted) holding N records; 1 when N = 0. So a window holds
    about R records whatever the record size (8 MiB pages of ~140 KB JPEGs: ~60 a page, M ~ R / 60; of 2 KiB
    token windows: ~4,096 a page, M ~ R / 4096), and a loader's memory (the pages of the windows in flight) is
    about R records' bytes. Raises ValueError / TypeError on bad arguments.
    """
    sizes = _as_page_sizes(page_sizes)
    return window_pages_of(int(sizes.sum()), sizes.shape[0], window_pages, window_records)


def window_pages_of(n_records: int, n_pages: int, window_pages: int | None = None,
                    window_records: int = DEFAULT_WINDOW_RECORDS) -> int:
    """:func:`window_pages_for` of a layout of ``n_records`` records on ``n_pages`` pages (ints >= 0)."""
    if window_pages is not None:
        window_pages = _as_int("window_pages", window_pages)
        if window_pages < 1:
            raise ValueError(f"window_pages must be >= 1 (1 = page-local order) or None (sized by window_records), "
                             f"got {window_pages}")
        return window_pages
    r = _as_int("window_records", window_records)
    if r < 1:
        raise ValueError(f"window_records must be >= 1, got {r}")
    k, n = max(_as_int("n_pages", n_pages), 1), _as_int("n_records", n_records)
    if n <= 0:
        return 1
    return min(k, max(1, -(-(r * k) // n)))


# --- layout: page order and window bounds -------------------------------------------------------------


def page_permutation(n_pages: int, seed: int, epoch: int) -> np.ndarray:
    """The quasi_random page order: int64[n_pages], a permutation of ``0..n_pages-1``."""
    seed, epoch, _ = _check_params(seed, epoch, "quasi_random", 1)
    n_pages = _as_int("n_pages", n_pages)
    if n_pages < 0:
        raise ValueError(f"n_pages must be >= 0, got {n_pages}")
    base = np.uint64(key_base_py(seed, epoch, TAG_PAGES))
    return _shuffled_arange(np.int64(n_pages), base)


def window_layout(page_sizes, seed: int, epoch: int, order: str, window_pages: int = 1):
    """Pages and position bounds of the windows of one epoch.

    Returns ``(page_order, window_starts)``: page_order int64[K], the pages in epoch order (window ``w`` is
    ``page_order[w*M : (w+1)*M]``); window_starts int64[n_windows + 1], window ``w`` covers epoch positions
    ``[window_starts[w], window_starts[w+1])``, ``window_starts[-1] == N``. For ``"quasi_random"`` the page
    order is :func:`page_permutation`; for ``"sequential"`` it is ``0..K-1`` (windows of M pages in file
    order, handy for prefetching); ``"random"`` has one window holding every page (no locality to exploit).
    K == 0 gives zero windows.
    """
    sizes = _as_page_sizes(page_sizes)
    seed, epoch, m = _check_params(seed, epoch, order, window_pages)
    k = sizes.shape[0]
    m = min(m, max(k, 1))  # M >= K is one window of every page, whatever M (formats/order.md section 4)
    if order == "quasi_random":
        page_order = page_permutation(k, seed, epoch)
    else:
        page_order = np.arange(k, dtype=np.int64)
    if order == "random":
        m = max(k, 1)
    n_windows = -(-k // m)
    padded = np.zeros(n_windows * m, dtype=np.int64)
    padded[:k] = sizes[page_order]
    window_starts = np.zeros(n_windows + 1, dtype=np.int64)
    np.cumsum(padded.reshape(n_windows, m).sum(axis=1), out=window_starts[1:])
    return page_order, window_starts


# --- public functions ---------------------------------------------------------------------------------


def random_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The ``"random"`` order: int64[n], Fisher-Yates of ``0..n-1``, step i keyed
    ``key(seed, epoch, TAG_PERMUTATION, i)``.

    O(n) time and memory: 1e7 ids take 80 MB and a fraction of a second (random swaps miss the cache);
    1e8 ids take 800 MB.
    """
    seed, epoch, _ = _check_params(seed, epoch, "random", 1)
    n = _as_int("n", n)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return _shuffled_arange(np.int64(n), np.uint64(key_base_py(seed, epoch, TAG_PERMUTATION)))


def epoch_permutation(page_sizes, seed: int, epoch: int, order: str, window_pages: int = 1) -> np.ndarray:
    """The whole epoch: int64[N], ``out[position] = record id``, a bijection of ``0..N-1``.

    page_sizes: int64[K], records per page (>= 0), N = sum. seed: int in [0, 2**64). epoch: int >= 0.
    order: ``"sequential" | "random" | "quasi_random"``. window_pages: M >= 1 pages per window (used by
    ``"quasi_random"`` only, validated always). Raises ValueError / TypeError on bad arguments.
    """
    sizes = _as_page_sizes(page_sizes)
    seed, epoch, m = _check_params(seed, epoch, order, window_pages)
    n = int(sizes.sum())
    if order == "sequential":
        return np.arange(n, dtype=np.int64)
    if order == "random":
        return random_permutation(n, seed, epoch)
    return quasi_random_range(sizes, seed, epoch, m, 0, n)


def sequential_range(n_records: int, start: int, stop: int) -> np.ndarray:
    """Ids at positions ``[start, stop)`` of the ``"sequential"`` order (the identity): int64[stop - start].

    Requires ``0 <= start <= stop <= n_records`` (ValueError otherwise).
    """
    start, stop = _check_range(start, stop, _as_int("n_records", n_records))
    return np.arange(start, stop, dtype=np.int64)


def quasi_random_range(
    page_sizes, seed: int, epoch: int, window_pages: int, start: int, stop: int
) -> np.ndarray:
    """Ids at positions ``[start, stop)`` of the ``"quasi_random"`` order: int64[stop - start].

    Equal to ``epoch_permutation(page_sizes, seed, epoch, "quasi_random", window_pages)[start:stop]`` but
    builds only the windows the range touches: O(K) for the page order plus O(ids in those windows).
    Requires ``0 <= start <= stop <= N`` (ValueError otherwise).
    """
    sizes = _as_page_sizes(page_sizes)
    seed, epoch, m = _check_params(seed, epoch, "quasi_random", window_pages)
    m = min(m, max(sizes.shape[0], 1))  # M >= K: one window (and M fits the kernel's int64)
    page_order, window_starts = window_layout(sizes, seed, epoch, "quasi_random", m)
    start, stop = _check_range(start, stop, int(window_starts[-1]))
    if start == stop:
        return np.empty(0, dtype=np.int64)
    first = int(np.searchsorted(window_starts, start, side="right")) - 1
    last = int(np.searchsorted(window_starts, stop, side="left"))
    origin = int(window_starts[first])
    out = np.empty(int(window_starts[last]) - origin, dtype=np.int64)
    page_starts = _page_starts(sizes)
    _quasi_random_windows(
        page_starts,
        page_order,
        np.int64(m),
        window_starts,
        np.uint64(seed),
        np.uint64(epoch),
        np.int64(first),
        np.int64(last),
        out,
    )
    if start == origin and stop - origin == out.shape[0]:
        return out  # the range is whole windows (e.g. the full epoch): no second copy
    return out[start - origin : stop - origin].copy()


def _page_starts(sizes: np.ndarray) -> np.ndarray:
    """int64[K+1]: first record id of each page, then N."""
    starts = np.zeros(sizes.shape[0] + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    return starts


# --- the loader's view: one epoch, any position range, bounded memory ---------------------------------


class EpochOrder:
    """Record ids for position ranges of one epoch, for the loader.

    ``EpochOrder(page_sizes, seed, epoch, order, window_pages)`` computes the page order and window bounds
    once (O(K)). Ids are built per window and cached: at most two windows (the current one and the next being
    prefetched), so memory is O(2 * window) for ``"quasi_random"`` and ``"sequential"``; ``"random"`` builds
    its full int64[N] permutation once, on first use. Thread-safe (one lock around the cache).

    Positions past N (the padding of ``drop_last=False``, see ``sharding.py``) wrap to ``position % N``.
    """

    _CACHED_WINDOWS = 2  # current + next (prefetch); enough for a rank slice straddling two windows

    def __init__(self, page_sizes, seed: int, epoch: int, order: str, window_pages: int = 1):
        sizes = _as_page_sizes(page_sizes)
        self.seed, self.epoch, self.window_pages = _check_params(seed, epoch, order, window_pages)
        self.order = order
        self._page_starts = _page_starts(sizes)
        self._page_order, self._window_starts = window_layout(sizes, seed, epoch, order, window_pages)
        # Pages per window in self._page_order; "random" has one window of all pages.
        self._m = min(self.window_pages, max(sizes.shape[0], 1)) if order != "random" else max(sizes.shape[0], 1)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self._last = None  # (start, stop, ids) of the cached window the last ids() call read: the loader's fast path
        for arr in (self._page_starts, self._page_order, self._window_starts):
            arr.flags.writeable = False

    @property
    def n_records(self) -> int:
        """N, the number of records (positions) in one epoch before padding."""
        return int(self._page_starts[-1])

    @property
    def n_pages(self) -> int:
        return int(self._page_order.shape[0])

    @property
    def n_windows(self) -> int:
        return int(self._window_starts.shape[0] - 1)

    @property
    def window_starts(self) -> np.ndarray:
        """Read-only int64[n_windows + 1]: window w covers ``[window_starts[w], window_starts[w+1])``."""
        return self._window_starts

    def window_of(self, position: int) -> int:
        """The window holding epoch position ``position`` (wrapped mod N).

        ValueError if N == 0 or position < 0.
        """
        p = self._wrap(_as_int("position", position))
        return int(np.searchsorted(self._window_starts, p, side="right")) - 1

    def window_page_ids(self, window: int) -> np.ndarray:
        """Pages of window ``window`` in epoch order: int64[<= M] (prefetch them before it starts)."""
        w = self._check_window(window)
        return self._page_order[w * self._m : (w + 1) * self._m].copy()

    def window_ids(self, window: int) -> np.ndarray:
        """Read-only int64[window size]: the ids at positions ``window_starts[w] .. window_starts[w+1]-1``."""
        w = self._check_window(window)
        with self._lock:
            ids = self._cache.get(w)
            if ids is None:
                ids = self._build_window(w)
                ids.flags.writeable = False
                if self.order != "random":  # random is one window: keep it for the epoch
                    while len(self._cache) >= self._CACHED_WINDOWS:
                        _, gone = self._cache.popitem(last=False)
                        if self._last is not None and self._last[2] is gone:
                            self._last = None
                self._cache[w] = ids
            else:
                self._cache.move_to_end(w)
            return ids

    def ids(self, start: int, stop: int) -> np.ndarray:
        """Record ids at epoch positions ``[start, stop)``: int64[stop - start], a new array.

        Positions >= N wrap to ``position % N`` (padding); ``0 <= start <= stop`` (ValueError otherwise);
        N == 0 with a non-empty range is a ValueError.
        """
        last = self._last
        if last is not None and type(start) is int and type(stop) is int and last[0] <= start <= stop <= last[1]:
            # inside the window the previous call read (a batch's positions, step after step): one slice copy
            return last[2][start - last[0] : stop - last[0]].copy()
        start, stop = _check_range(start, stop, None)
        out = np.empty(stop - start, dtype=np.int64)
        n = self.n_records
        if stop > start and n == 0:
            raise ValueError("the dataset has no records: no position range is valid")
        done = 0
        while done < out.shape[0]:
            p = (start + done) % n
            w = int(np.searchsorted(self._window_starts, p, side="right")) - 1
            w_start, w_stop = int(self._window_starts[w]), int(self._window_starts[w + 1])
            take = min(out.shape[0] - done, w_stop - p)
            window = self.window_ids(w)
            out[done : done + take] = window[p - w_start : p - w_start + take]
            done += take
            with self._lock:
                if any(ids is window for ids in self._cache.values()):
                    self._last = (w_start, w_stop, window)
        return out

    def pages(self, start: int, stop: int) -> np.ndarray:
        """Pages holding the records at positions ``[start, stop)`` (wrapped): sorted unique int64[...]."""
        ids = self.ids(start, stop)
        return np.unique(np.searchsorted(self._page_starts, ids, side="right") - 1)

    def _wrap(self, p: int) -> int:
        if p < 0:
            raise ValueError(f"position must be >= 0, got {p}")
        if self.n_records == 0:
            raise ValueError("the dataset has no records: no position is valid")
        return p % self.n_records

    def _check_window(self, window: int) -> int:
        w = _as_int("window", window)
        if not 0 <= w < self.n_windows:
            raise ValueError(f"window must be in [0, {self.n_windows}), got {w}")
        return w

    def _build_window(self, w: int) -> np.ndarray:
        if self.order == "random":
            return random_permutation(self.n_records, self.seed, self.epoch)
        lo, hi = int(self._window_starts[w]), int(self._window_starts[w + 1])
        if self.order == "sequential":
            return np.arange(lo, hi, dtype=np.int64)
        out = np.empty(hi - lo, dtype=np.int64)
        _quasi_random_windows(
            self._page_starts,
            self._page_order,
            np.int64(self._m),
            self._window_starts,
            np.uint64(self.seed),
            np.uint64(self.epoch),
            np.int64(w),
            np.int64(w + 1),
            out,
        )
        return out

    def __repr__(self) -> str:
        return (
            f"EpochOrder(order={self.order!r}, epoch={self.epoch}, n_records={self.n_records}, "
            f"n_pages={self.n_pages}, n_windows={self.n_windows}, window_pages={self.window_pages})"
        )
