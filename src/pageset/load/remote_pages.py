"""Page access for a dataset opened from a URL: the same ``gather`` as the local page sources, fed ahead of time.

The loader tells :class:`RemotePages` which pages each upcoming step of this rank needs (the order is a pure
function of (seed, epoch), so it knows them before any thread asks). ``advance(step)`` keeps the pages of the
next steps in flight, in step order, until ``prefetch_bytes`` of newly requested pages are outstanding (in
flight, or arrived and not yet used), with at most ``max_requests`` requests running at once (a small pool of
fetch threads). Adjacent missing pages of one step are coalesced into one range request (up to
``max_run_bytes``). A thread whose page is not there yet waits on the request already in flight, or issues it.

Tiers: memory (an LRU of at most ``memory_bytes``; pages planned for steps not yet handed out are pinned and
never evicted) -> an optional :class:`~pageset.load.disk_cache.DiskPageCache` shared by the processes of the
host -> the store (:class:`~pageset.read.remote.PageReader`: CRC-32 checked on arrival, retried, pinned to the
ETag seen at open). An error in a fetch thread reaches the decode thread that needs the page, and from there
the training loop's ``next()``.

Bound: a store that stops answering ends every wait within ``RetryPolicy.bound`` seconds (``request_attempts x
request_timeout`` + the backoff between attempts) of its last answer, however many requests are pending: the
first request to give up fails every pending one (and later waits, until the next ``plan``), and a thread waiting
longer than the bound with no request started or answered in between gives up itself. While answers arrive,
nothing is cut (a slow store is not a stopped one).

Cost model: requests per step = runs of adjacent missing pages in the step's page set. ``quasi_random`` reads
each page of its windows once per epoch (while the window's pages stay in memory); ``random`` needs nearly one
page per sample, so a step of B samples costs ~B page reads unless the memory or disk cache holds the file.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
import time

import numpy as np

from ..format.errors import RemoteReadError
from .parts import PageSource

MAX_LOOKAHEAD_STEPS = 256


def span_pages(starts: np.ndarray, lengths: np.ndarray, data_offset: int, page_size: int,
               page_count: int) -> np.ndarray:
    """Sorted unique int64 pages covered by byte spans ``[starts, starts + lengths)`` (absolute offsets);
    zero-length spans cover nothing."""
    keep = lengths > 0
    if not keep.any() or page_count == 0:
        return np.empty(0, dtype=np.int64)
    rel = starts[keep].astype(np.int64) - data_offset
    first = rel // page_size
    last = np.minimum((rel + lengths[keep].astype(np.int64) - 1) // page_size, page_count - 1)
    if (last == first).all():
        return np.unique(first)
    return np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(first, last)]))


def _settle(fut: concurrent.futures.Future, result=None, exc: BaseException | None = None) -> bool:
    """Complete ``fut`` unless close() (or another fetch's failure) already failed it; True if this did."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        return False
    return True


class RemotePages(PageSource):
    """Prefetching page source over a remote dataset (``ds.page_reader``); thread-safe.

    Args:
        ds: a :class:`~pageset.read.reader.Dataset` opened from a URL.
        prefetch_bytes: bytes of pages requested ahead of the consumer (default 64 MiB, at least one page).
        max_requests: range requests running at once (>= 1).
        memory_bytes: bound of the in-memory LRU of arrived pages (default ``2 * prefetch_bytes``). Pages of the
            planned steps (at least the steps the decode threads work on, at most MAX_LOOKAHEAD_STEPS) are pinned
            and may exceed it: with ``random`` order one step pins up to ``batch_size`` pages.
        cache_dir: optional on-disk page cache shared by the processes of one host; ``cache_limit_bytes`` bounds
            the whole folder, every dataset in it (default 10 GiB; enforced at construction, see
            :mod:`pageset.load.disk_cache`).

    Counters (``stats()``): requests and bytes over the network, pages used, memory / disk hits.
    """

    prefetches = True  # the Loader hands it the epoch's plan (plan / advance)


    def __init__(self, ds, *, prefetch_bytes: int | None = None, max_requests: int = 8,
                 memory_bytes: int | None = None, cache_dir=None, cache_limit_bytes: int | None = None,
                 max_run_bytes: int = 16 << 20):
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.reader = ds.page_reader
        self.url = ds.path
        self.page_size, self.page_count = ds.page_size, ds.page_count
        self.data_offset, self.data_length = ds.data_offset, ds.data_length
        self.prefetch_bytes = max(int(prefetch_bytes if prefetch_bytes is not None else 64 << 20), self.page_size)
        if prefetch_bytes is not None and prefetch_bytes < 0:
            raise ValueError(f"prefetch_bytes must be >= 0, got {prefetch_bytes}")
        self.memory_bytes = int(memory_bytes if memory_bytes is not None else 2 * self.prefetch_bytes)
        self.max_run_pages = max(1, int(max_run_bytes) // self.page_size)
        self.max_requests = int(max_requests)
        retry = self.retry = ds.remote.retry
        self.stall_after = retry.bound  # no answer (nor a request started) for this long: the store stopped
        self.wait_timeout = 3600.0 + retry.bound  # a hard cap on one wait, even while answers keep arriving
        self._pid = os.getpid()
        self._failure: BaseException | None = None  # a failed fetch fails every wait until the next plan()
        self._last_event = float("-inf")  # monotonic time a fetch last started or arrived
        self.disk = None
        if cache_dir is not None:
            from .disk_cache import DiskPageCache

            limit = cache_limit_bytes if cache_limit_bytes is not None else 10 << 30
            try:
                self.disk = DiskPageCache(cache_dir, ds.dataset_id, ds.page_checksums, limit, self.page_size,
                                          lock_timeout=2 * retry.attempts * (retry.timeout + retry.backoff_max) + 30)
            except ValueError as exc:  # the bound is smaller than this file's page
                raise ValueError(f"{self.url}: {exc}") from None
        self._pool = concurrent.futures.ThreadPoolExecutor(self.max_requests, thread_name_prefix="pageset-fetch")
        self._lock = threading.Lock()
        self._ready: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._ready_bytes = 0
        self._inflight: dict[int, concurrent.futures.Future] = {}
        self._pins: collections.Counter = collections.Counter()
        self._planned: collections.deque = collections.deque()  # (step, pages, new_bytes)
        self._planned_bytes = 0
        self._pages_of_step = None
        self._frontier = self._steps = 0
        self._min_ahead = 1
        self._closed = False
        self.network_requests = self.network_bytes = self.pages_fetched = 0
        self.memory_hits = self.waits = self.pages_used = 0

    # ---- fetching ---------------------------------------------------------------------------------------
    def _page_nbytes(self, k: int) -> int:
        return min(self.page_size, self.data_length - k * self.page_size)

    def _network(self, k0: int, k1: int) -> list[np.ndarray]:
        with self._lock:  # a request starts (after a disk cache lock wait, perhaps): the stall clock restarts
            self._last_event = time.monotonic()
        pages = self.reader.read_run(k0, k1)
        with self._lock:
            self.network_requests += 1
            self.network_bytes += sum(p.nbytes for p in pages)
            self.pages_fetched += k1 - k0
        return pages

    def _job(self, k0: int, k1: int, fut: concurrent.futures.Future) -> None:
        try:
            if fut.done():  # failed by close() or by another fetch's failure
                return
            with self._lock:
                self._last_event = time.monotonic()
            if self.disk is not None:
                got = self.disk.get_run(k0, k1, self._network)
            else:
                got = dict(zip(range(k0, k1), self._network(k0, k1)))
        except BaseException as exc:  # handed to every thread waiting on these pages, and on any other
            with self._lock:
                for k in range(k0, k1):
                    if self._inflight.get(k) is fut:
                        del self._inflight[k]
                if not fut.done() and self._failure is None:
                    self._failure = exc  # in the same step: no thread sees these pages neither asked nor failed
            if _settle(fut, exc=exc):  # not a fetch already given up on (by close, a plan, another failure)
                self._fail(exc)
            return
        with self._lock:
            self._last_event = time.monotonic()
            for k, page in got.items():
                if self._inflight.get(k) is fut:
                    del self._inflight[k]
                if k not in self._ready:
                    self._ready[k] = page
                    self._ready_bytes += page.nbytes
            self._evict()
        _settle(fut, result=got)

    def _issue(self, missing: list[int]) -> int:
        """Request sorted ``missing`` pages as runs of adjacent pages (caller holds the lock); returns bytes.
        Raises the failure of a fetch since the last ``plan`` instead (asking again would only repeat it)."""
        if missing and self._failure is not None:
            raise self._failure
        total, i = 0, 0
        while i < len(missing):
            j = i
            while j + 1 < len(missing) and missing[j + 1] == missing[j] + 1 and j + 1 - i < self.max_run_pages:
                j += 1
            k0, k1 = missing[i], missing[j] + 1
            fut: concurrent.futures.Future = concurrent.futures.Future()
            for k in range(k0, k1):
                self._inflight[k] = fut
                total += self._page_nbytes(k)
            self._pool.submit(self._job, k0, k1, fut)
            i = j + 1
        return total

    def _fail(self, exc: BaseException) -> None:
        """A fetch failed (after its retries) or a wait gave up: fail every pending fetch with ``exc`` (the
        store is the same for all; waiting on them would only add their own timeouts) and every later wait
        until the next ``plan``."""
        with self._lock:
            if self._failure is None:
                self._failure = exc
            pending = list(set(self._inflight.values()))
            self._inflight.clear()
        for fut in pending:
            _settle(fut, exc=exc)

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.url}: the page source is closed")
        if os.getpid() != self._pid:
            self.reader.remote.check_process()  # names the fork (async stores)
            raise RuntimeError(f"{self.url}: this Loader was created in process {self._pid} and is used in process "
                               f"{os.getpid()}, a forked child: its fetch threads do not survive a fork; create "
                               "the Loader in the child, or start it with the 'spawn' or 'forkserver' method")
        if self._failure is not None:
            raise self._failure

    def _evict(self) -> None:
        if self._ready_bytes <= self.memory_bytes:
            return
        for k in list(self._ready):
            if self._ready_bytes <= self.memory_bytes:
                break
            if self._pins.get(k):
                continue
            self._ready_bytes -= self._ready.pop(k).nbytes

    def _missing(self, pages) -> list[int]:
        return [k for k in pages if k not in self._ready and k not in self._inflight]

    def pages(self, wanted: np.ndarray) -> dict[int, np.ndarray]:
        """``{page: uint8 array}`` for the sorted unique pages ``wanted``, waiting for (or issuing) fetches."""
        self._check()
        got, waits = {}, {}
        with self._lock:
            for k in wanted.tolist():
                page = self._ready.get(k)
                if page is not None:
                    self._ready.move_to_end(k)
                    got[k] = page
            self.memory_hits += len(got)
            self.pages_used += len(wanted)
            self._issue(self._missing([k for k in wanted.tolist() if k not in got]))
            for k in wanted.tolist():
                if k not in got:
                    waits[k] = self._inflight[k]
        if waits:
            with self._lock:
                self.waits += 1
            self._wait_for(waits)
            for k, fut in waits.items():
                got[k] = fut.result(timeout=0)[k]
        return got

    def _wait_for(self, waits: dict) -> None:
        """Wait until every future of ``waits`` (page -> future) is done; raise the first failure, or
        RemoteReadError once the store gave no sign of life (no fetch started or arrived) for ``stall_after``
        seconds since this wait began (or ``wait_timeout`` passed)."""
        began = time.monotonic()
        pending = set(waits.values())
        while pending:
            with self._lock:
                since = max(began, self._last_event)
            now = time.monotonic()
            left = min(since + self.stall_after, began + self.wait_timeout) - now
            if left <= 0:
                k = next(k for k, f in waits.items() if f in pending)
                quiet = now - since
                exc = RemoteReadError(
                    f"{self.url}: page {k} not fetched: no answer from the store for {quiet:.1f} s with "
                    f"{len(pending)} request(s) awaited ({self.retry.describe()}); the store or the network "
                    "stopped answering: check the endpoint (storage_options client_kwargs.endpoint_url) and the "
                    "network, or raise request_timeout / request_attempts")
                self._fail(exc)
                raise exc
            done, pending = concurrent.futures.wait(pending, timeout=left,
                                                    return_when=concurrent.futures.FIRST_EXCEPTION)
            for fut in done:
                if fut.exception() is not None:
                    raise fut.exception()

    # ---- the order's plan -------------------------------------------------------------------------------
    def plan(self, pages_of_step, first: int, steps: int, min_ahead: int = 1) -> None:
        """Start prefetching an epoch: ``pages_of_step(s)`` -> sorted unique int64 pages of this rank's step
        ``s``; steps ``[first, steps)`` will be handed out in order. The ``min_ahead`` steps from the current one
        (those the decode threads already work on) are always planned, whatever the byte budget, so their pages
        are requested (and pinned) before a thread asks for them."""
        with self._lock:
            self._failure = None  # a new iteration tries the store again
            for _, pages, _ in self._planned:
                self._pins.subtract(pages.tolist())
            self._pins = +self._pins
            self._planned.clear()
            self._planned_bytes = 0
            self._pages_of_step, self._frontier, self._steps = pages_of_step, first, steps
            self._min_ahead = max(1, int(min_ahead))
        self.advance(first)

    def advance(self, step: int) -> None:
        """The consumer is about to take ``step``: release the pins of earlier steps, then keep the next steps'
        pages requested up to ``prefetch_bytes`` (and at most MAX_LOOKAHEAD_STEPS steps ahead)."""
        if self._closed or self._pages_of_step is None:
            return
        self._check()
        with self._lock:
            while self._planned and self._planned[0][0] < step:
                _, pages, nbytes = self._planned.popleft()
                self._pins.subtract(pages.tolist())
                self._planned_bytes -= nbytes
            self._pins = +self._pins
            self._frontier = max(self._frontier, step)
        while (self._frontier < self._steps and self._frontier < step + MAX_LOOKAHEAD_STEPS
               and (self._planned_bytes < self.prefetch_bytes or self._frontier < step + self._min_ahead)):
            pages = self._pages_of_step(self._frontier)
            with self._lock:
                self._pins.update(pages.tolist())
                nbytes = self._issue(self._missing(pages.tolist()))
                self._planned.append((self._frontier, pages, nbytes))
                self._planned_bytes += nbytes
                self._frontier += 1

    # ---- the loader's interface ------------------------------------------------------------------------
    def gather(self, offs: np.ndarray, lens: np.ndarray, staging: dict,
               ordered: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Copy the records ``[offs[j], offs[j] + lens[j])`` (absolute offsets) into the thread's staging buffer
        (grown when needed); return ``(buf, offsets)`` such that record j is ``buf[off[j] : off[j] + lens[j]]``."""
        total = int(lens.sum())
        buf = staging.get("bytes")
        if buf is None or buf.shape[0] < total:
            buf = staging["bytes"] = np.empty(max(total, 1 << 16), dtype=np.uint8)
        out_offs = np.empty_like(offs)
        pages = self.pages(span_pages(offs, lens, self.data_offset, self.page_size, self.page_count))
        ps, pos = self.page_size, 0
        for j in range(offs.shape[0]):
            rel, n = int(offs[j]) - self.data_offset, int(lens[j])
            out_offs[j] = pos
            while n:  # a record may cross pages (records larger than a page own whole pages)
                k, start = divmod(rel, ps)
                take = min(n, ps - start)
                buf[pos : pos + take] = pages[k][start : start + take]
                pos, rel, n = pos + take, rel + take, n - take
        return buf, out_offs

    def stats(self) -> dict:
        """Counters: ``requests`` and ``bytes_fetched`` (range requests of pages that reached the cache, not
        counting retries; ``all_requests`` = the dataset's own requests incl. retries), ``pages_fetched``,
        ``pages_used`` (page lookups by decode threads), ``memory_hits``, ``waits`` (gathers that had to wait),
        ``disk_hits`` / ``disk_misses`` (cache_dir)."""
        with self._lock:
            out = {"requests": self.network_requests, "bytes_fetched": self.network_bytes,
                   "pages_fetched": self.pages_fetched, "pages_used": self.pages_used,
                   "memory_hits": self.memory_hits, "waits": self.waits,
                   "all_requests": self.reader.remote.requests}
        if self.disk is not None:
            out.update(disk_hits=self.disk.hits, disk_misses=self.disk.misses, disk_evicted=self.disk.evicted)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending = list(set(self._inflight.values()))
            self._inflight.clear()
            self._ready.clear()
            self._ready_bytes = 0
        for fut in pending:
            _settle(fut, exc=RuntimeError(f"{self.url}: the loader was closed"))
        self._pool.shutdown(wait=False, cancel_futures=True)
