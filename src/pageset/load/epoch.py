"""The Loader's epochs (mixed into ``Loader``, load/loader.py): steps scheduled on the pool, filled inline or
ahead by threads, waited for and handed out in order; the cursor that ``state_dict()`` counts.

Step ``s`` of an epoch covers the epoch positions ``base + s * G + rank * B + [0, B)`` (order v1,
formats/order.md; ``base`` is 0 unless a state of another global batch was loaded). A batch of one cheap slice is
filled by the thread calling ``next()`` (``_inline_batches``) until such fills turn out slow; otherwise
``batches_ahead`` steps are scheduled on the pool ahead of the consumer, which helps run queued slices while it
waits (local files). Remote page sources are handed each step's pages ahead (``plan``/``advance``).
"""

from __future__ import annotations

import functools
import os
import time
import weakref

import numpy as np

from ..order import sample_keys
from .stats import STATS_KEY
from .workers import Slot


class EpochRunner:
    """The iteration part of ``Loader``: it uses the Loader's plan, sources, pool, slots and counters
    (``_epoch``, ``_cursor``, ``_shift``, ``_base``); ``iter(loader)`` yields the rest of the current epoch."""

    # Inline filling (see _inline_batches) gives way to the threads when the median of this many fills exceeds
    # this many seconds: several times a batch of the largest inline size read from the page cache (256K tokens,
    # ~0.3-0.5 ms on a busy 2-core VM), less than its reads waiting on a disk or a network file system.
    _INLINE_CHECK, _INLINE_SLOW_S = 16, 2e-3

    # ---- iteration -------------------------------------------------------------------------------------
    def __iter__(self):
        """The rest of the current epoch; a new ``iter()`` stops the previous one and continues from the
        state (batches already handed out are not repeated). The epoch counter advances at its end."""
        if self._closed:
            raise RuntimeError("this Loader is closed")
        self._check_process()
        self._stop_active()
        gen = self._stats.timed(self._epoch_batches())
        self._active = weakref.ref(gen)
        return gen

    def _check_process(self) -> None:
        """Raise RuntimeError at once when this Loader is used in a forked child of the process that created it
        and holds something a fork does not carry over: a URL's fetch threads and connections (fsspec's event
        loop), or decode threads already started (their tasks and locks stay behind in the parent). A Loader
        with neither (a local file whose batches are filled by the calling thread) is the child's from then on.
        """
        pid = os.getpid()
        if pid == self._pid:
            return
        remote = any(ds.remote is not None for ds in self._datasets)
        if not remote and not self._pool.threads:
            self._pid = pid
            return
        lost = ("the store's connections (fsspec's event loop) and its fetch threads" if remote else
                f"its {len(self._pool.threads)} decode threads")
        raise RuntimeError(
            f"{self.path}: this Loader was created in process {self._pid} and is used in process {pid}, a forked "
            f"child: {lost} do not survive a fork. Create the Loader in the child (after the fork, e.g. in the "
            "worker's own code or a DataLoader worker_init_fn), or start the workers with the 'spawn' or "
            "'forkserver' method (multiprocessing.get_context('spawn'), DataLoader(multiprocessing_context="
            "'spawn'))")

    def _stop_active(self) -> None:
        gen = self._active() if self._active is not None else None
        self._active = None
        if gen is not None:
            gen.close()

    def _next_epoch(self, end: int) -> None:
        """The epoch ended at position ``end`` (L, or another end when the global batch changed in it)."""
        self._epoch, self._cursor, self._shift = self._epoch + 1, 0, self._shift + end - self.epoch_length

    def _epoch_batches(self):
        end = self._plan.epoch_end(self._cursor)
        if self._cursor >= end:  # the last batch was handed out but the epoch not closed yet
            self._next_epoch(end)
            end = self.epoch_length
        G, epoch = self.global_batch_size, self._epoch
        # step s covers positions base + s*G + [0, G): base = 0, unless the epoch was resumed from a state of
        # another global batch (then the steps continue from the saved cursor)
        self._base = base = self._cursor % G
        steps = (end - base) // G
        first = self._cursor // G
        order = self._plan.epoch(epoch, self._shift)
        if self._inline:
            first = yield from self._inline_batches(order, epoch, first, steps)
            if first is None:  # the epoch is done
                return
        scheduled: list[Slot] = []
        nxt = first
        # remote pages: fetch the next steps' pages ahead (unless only index columns are loaded: no page reads),
        # each remote file the pages of its own samples in each step
        planned = [(src.pages, functools.partial(self._step_pages, order, k, base))
                   for k, src in enumerate(self._sources)
                   if src.pages.prefetches and any(s.pages is not None for s in src.stages)]
        for pages, pages_of_step in planned:
            pages.plan(pages_of_step, first, steps, min_ahead=self.batches_ahead)
        try:
            for step in range(first, steps):
                self._check_process()  # a generator carried over a fork: say so before touching its threads
                if self._closed:
                    raise RuntimeError(f"{self.path}: the Loader was closed (by another thread) during this epoch")
                for pages, _ in planned:
                    pages.advance(step)
                while nxt < steps and nxt - step < self.batches_ahead:
                    scheduled.append(self._schedule(order, epoch, nxt))
                    nxt += 1
                slot = scheduled.pop(0)
                self._stats.note_ready(slot.done.is_set() + sum(s.done.is_set() for s in scheduled))
                self._wait(slot)
                batch = self._handout(slot)
                self._cursor = base + (step + 1) * G
                self._prefetch_to_device(scheduled[0] if scheduled else None)
                yield batch
            self._next_epoch(end)
        finally:
            self._pool.cancel()
            for slot in scheduled if os.getpid() == self._pid and not self._closed else ():  # (forked child: no
                self._wait(slot, raise_errors=False)  # thread runs them) let in-flight slices finish first
            if self._closed:  # closed by another thread while this epoch ran: release now
                self._release()

    def _inline_batches(self, order, epoch: int, first: int, steps: int):
        """Steps ``[first, steps)`` of ``epoch``, each filled here, by the thread calling next() (``_inline``).

        Returns None at the end of the epoch, or the next step when the fills turned out slow (the median of
        ``_INLINE_CHECK`` fills above ``_INLINE_SLOW_S``: reads waiting on a disk or a network file system): the
        threads are then started and the caller prepares the rest of the epoch ahead with them.
        """
        G, B, base = self.global_batch_size, self.batch_size, self._base
        times = self._fill_times
        for step in range(first, steps):
            self._check_process()
            slot = self._next_slot()
            self._reclaim(slot)
            self._prepare(slot, order, epoch, step)
            times.append(self._run_slice(slot, 0, B, self._ctx))
            batch = self._handout(slot, owned=True)
            self._cursor = base + (step + 1) * G
            if len(times) >= self._INLINE_CHECK:
                slow = sorted(times)[len(times) // 2] > self._INLINE_SLOW_S
                times.clear()
                if slow:
                    self._leave_inline()
                    yield batch
                    return step + 1
            yield batch
        self._next_epoch(base + steps * G)
        return None

    def _leave_inline(self) -> None:
        """From now on, prepare batches ahead on ``num_threads`` threads, over the whole ring of slots (allocated
        at construction); the next batch takes slot 2, never one of the two the inline batches used."""
        self._inline = False
        self._turn = 2
        self._pool.start(self.num_threads)

    def _step_pages(self, order, k: int, base: int, step: int) -> np.ndarray:
        """Sorted unique pages of file ``k`` that this rank reads at ``step`` (its remote page source prefetches
        them): positions ``base + step*G + rank*B + [0, B)``, those :meth:`_prepare` reads."""
        from .remote_pages import span_pages

        start = base + step * self.global_batch_size + self.dist.rank * self.batch_size
        src = self._sources[k]
        starts, lens = src.spans(order.file_ids(k, start, start + self.batch_size))
        ds = src.ds
        return span_pages(np.asarray(starts, np.int64), np.asarray(lens, np.int64), ds.data_offset, ds.page_size,
                          ds.page_count)

    def _schedule(self, order, epoch: int, step: int) -> Slot:
        slot = self._next_slot()
        self._reclaim(slot)
        self._prepare(slot, order, epoch, step)
        B, n = self.batch_size, self._n_slices
        slot.done.clear()
        slot.pending = n
        for i in range(n):
            self._pool.submit(slot, i * B // n, (i + 1) * B // n)
        return slot

    def _prepare(self, slot: Slot, order, epoch: int, step: int) -> None:
        """Set the slot up for ``step``: each row's file and record id, padding, ``_index``, augmentation keys."""
        # rank_positions(step, rank, world_size, G, N, drop_last) without re-validating what __init__ checked
        # (step is in [0, steps of the epoch) here): positions base + step*G + rank*B + j; the plan flags padding
        B = self.batch_size
        start = self._base + step * self.global_batch_size + self.dist.rank * B
        slot.step, slot.generation, slot.error, slot.prefetched = step, self._pool.generation, None, None
        slot.sources, slot.read_ids, slot.padding, slot.ids = order.batch(start, start + B)
        slot.keys = (sample_keys(self.seed, epoch, np.arange(start, start + B, dtype=np.int64))
                     if self._needs_keys else None)

    def _run_slice(self, slot: Slot, lo: int, hi: int, ctx: dict) -> float:
        """Fill rows ``[lo, hi)`` of ``slot`` (in the thread whose scratch is ``ctx``); the wall seconds it took."""
        t0 = time.perf_counter()
        # slot.keys: None when no stage uses augmentation keys
        self._reader.fill(slot.arrays, lo, hi, slot.sources, slot.read_ids, slot.keys, ctx)
        dt = time.perf_counter() - t0
        st = ctx[STATS_KEY]
        st.fill_s += dt
        st.slices += 1
        st.rows += hi - lo
        return dt

    def _wait(self, slot: Slot, raise_errors: bool = True) -> None:
        # run queued slices (this batch's, else the next ones') here rather than sleeping until a thread is done
        while raise_errors and self._help and not slot.done.is_set() and self._pool.help(self._ctx):
            pass
        t0 = time.monotonic()
        while not slot.done.wait(0.1):
            if self._closed and raise_errors:
                raise RuntimeError(f"{self.path}: the Loader was closed (by another thread) while next() waited for "
                                   f"batch step {slot.step}")
            if self._pool.alive() < self.num_threads:
                raise RuntimeError(f"{self.path}: a loader thread exited unexpectedly")
            if time.monotonic() - t0 > 3600:
                raise TimeoutError(f"{self.path}: batch step {slot.step} not ready after an hour")
        if slot.error is not None and raise_errors:
            exc, slot.error = slot.error, None
            raise exc
