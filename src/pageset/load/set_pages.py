"""The page sources of a many-file set read as one file (:class:`~pageset.load.set_source.ManyFileSource`'s
``pages``): local members read their own pages; a URL set splits the Loader's prefetch plan over its members."""

from __future__ import annotations

import collections
import threading

import numpy as np

from .parts import PageSource


class LocalSetPages(PageSource):
    """A local set's ``pages``: members read their own pages (nothing is prefetched)."""

    def opened(self, k: int, src) -> None:
        pass

    def close(self) -> None:
        pass


class RemoteSetPages(PageSource):
    """A URL set's ``pages``: the Loader's prefetch plan (``plan`` / ``advance``, pages of the virtual file)
    split over the members: the members of the next ``min_ahead`` steps are opened (and held) by the thread
    calling ``next()``, and each open member's RemotePages prefetches its share of the coming steps."""

    prefetches = True  # the Loader hands it the epoch's plan (plan / advance)

    def __init__(self, owner):
        self.owner = owner
        self._lock = threading.Lock()
        self._pages_of_step = None
        self._cache: dict = {}
        self._held: collections.deque = collections.deque()  # (step, members held for it)
        self._steps = self._first = self._next_hold = 0
        self._min_ahead = 1

    def _virtual(self, step: int) -> np.ndarray:
        with self._lock:
            got = self._cache.get(step)
        if got is None:
            got = self._pages_of_step(step)
            with self._lock:
                self._cache[step] = got
        return got

    def _member_pages(self, k: int):
        lo, hi = int(self.owner._page_base[k]), int(self.owner._page_base[k + 1])

        def pages_of_step(step: int) -> np.ndarray:
            v = self._virtual(step)
            return v[(v >= lo) & (v < hi)] - lo

        return pages_of_step

    def opened(self, k: int, src) -> None:
        if self._pages_of_step is not None and src.pages.prefetches:
            src.pages.plan(self._member_pages(k), self._first, self._steps, min_ahead=self._min_ahead)

    def plan(self, pages_of_step, first: int, steps: int, min_ahead: int = 1) -> None:
        self._release_held(None)
        with self._lock:
            self._cache.clear()
        self._pages_of_step, self._first, self._steps = pages_of_step, first, steps
        self._min_ahead, self._next_hold = max(1, int(min_ahead)), first
        for k in self.owner.open_members():
            src = self.owner.open_source(k)
            if src is not None and src.pages.prefetches:
                src.pages.plan(self._member_pages(k), first, steps, min_ahead=self._min_ahead)
        self.advance(first)

    def _release_held(self, step) -> None:
        while self._held and (step is None or self._held[0][0] < step):
            _, ks = self._held.popleft()
            self.owner.release(ks)

    def advance(self, step: int) -> None:
        if self._pages_of_step is None:
            return
        self._release_held(step)
        with self._lock:
            for s in [s for s in self._cache if s < step]:
                del self._cache[s]
        self._first = step
        owner = self.owner
        stop = min(step + self._min_ahead + 1, self._steps)
        while self._next_hold < stop:  # open (and hold) the members of the steps the threads work on next
            s = max(self._next_hold, step)
            v = self._virtual(s)
            ks = np.unique(np.searchsorted(owner._page_base, v, side="right") - 1).tolist() if v.size else []
            owner.acquire(ks)
            self._held.append((s, ks))
            self._next_hold = s + 1
        for k in owner.open_members():
            src = owner.open_source(k)
            if src is not None and src.pages.prefetches:
                src.pages.advance(step)

    def stats(self) -> dict:
        owner = self.owner
        total = dict(owner._closed_stats)
        for k in owner.open_members():
            src = owner.open_source(k)
            stats = src.pages.stats() if src is not None else None
            if stats is not None:
                for key, value in stats.items():
                    total[key] = total.get(key, 0) + value
        total["members_opened"] = owner.opened_count
        return total

    def close(self) -> None:
        self._release_held(None)
