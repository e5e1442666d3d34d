"""Where the loader's time goes: counters every Loader keeps (``Loader.stats()``, ``Loader.bottleneck()``).

Cheap enough to leave on: the hot path only reads ``time.perf_counter`` (~50 ns) and adds to attributes of
objects owned by one thread each (no lock). Per batch: two clock reads around each slice a thread fills (one more
pair per stage when a file loads several fields, and one pair per page read), two around ``next()``. Threads' CPU
seconds are read from their CPU clocks when ``stats()`` is called, never on the hot path.

- :class:`ThreadStats`: one thread's counters (a decode thread's, or the consumer's when it fills or helps); only
  that thread writes them, kept in its scratch context under :data:`STATS_KEY`.
- :class:`LoaderStats`: the consumer's counters (time in ``next()``, between batches, batches ready ahead) and the
  aggregation into ``Loader.stats()``'s dict; ``reset`` subtracts a snapshot of the threads' counters (they are
  never written by another thread) and zeroes the consumer's.
"""

from __future__ import annotations

import math
import os
import time

from ..format import arguments as check
from .parts import page_counters

STATS_KEY = "stats"  # a thread's scratch-context key of its ThreadStats
# the consumer is "loader-bound" when it spent more than this share of its loop's time in next()
LOADER_BOUND_SHARE = 0.05


class ThreadStats:
    """Counters of one thread: ``fill_s`` (wall seconds filling slices of batches), ``slices``, ``rows``,
    ``stage_s`` ({field: wall seconds} of each loaded field's stage; a slice of a one-field file counts whole),
    ``read_s`` (wall seconds in page reads: ``pread`` into the staging buffer, or copies out of the process page
    cache; part of the stages' time), ``read_bytes`` (bytes read with ``pread`` by ``page_cache="os"``)."""

    __slots__ = ("fill_s", "slices", "rows", "stage_s", "read_s", "read_bytes")

    def __init__(self):
        self.fill_s = self.read_s = 0.0
        self.slices = self.rows = self.read_bytes = 0
        self.stage_s: dict = {}

    def snapshot(self) -> dict:
        return {"fill_s": self.fill_s, "slices": self.slices, "rows": self.rows, "stage_s": dict(self.stage_s),
                "read_s": self.read_s, "read_bytes": self.read_bytes}


def add_stage(ctx: dict, name: str, seconds: float) -> None:
    """Add ``seconds`` to the stage ``name`` of the thread whose scratch is ``ctx`` (no-op without counters)."""
    st = ctx.get(STATS_KEY)
    if st is not None:
        st.stage_s[name] = st.stage_s.get(name, 0.0) + seconds


def _minus(now: dict, base: dict | None) -> dict:
    if base is None:
        return now
    out = {k: now[k] - base[k] for k in ("fill_s", "slices", "rows", "read_s", "read_bytes")}
    out["stage_s"] = {k: v - base["stage_s"].get(k, 0.0) for k, v in now["stage_s"].items()}
    return out


def _thread_cpu(thread) -> float | None:
    """CPU seconds of a running thread (its CPU clock), None where the platform has none. A decode thread of the
    loader's child process (``num_workers=1``) reports its own (``cpu_seconds()``, as last sent by the child)."""
    remote = getattr(thread, "cpu_seconds", None)
    if remote is not None:
        return remote()
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError, TypeError):  # no pthread CPU clocks, or the thread has ended
        return None


class LoaderStats:
    """The consumer's counters and the aggregation of every thread's (see the module docstring)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.next_s = self.step_s = 0.0
        self.batches = self.steps = 0  # batches handed out; intervals between two batches of one loop
        self.ready_sum = self.ready_n = 0
        self.ready_min: int | None = None
        self._base: dict = {}  # id(ThreadStats) -> snapshot at the last reset
        self._cpu_base: dict = {}  # thread ident -> CPU seconds at the last reset

    def timed(self, gen):
        """Yield ``gen``'s batches, counting the seconds spent in ``next()`` (``next_s``, the call that ends the
        loop included) and between a batch handed out and the next ``next()`` of the same loop (``step_s``)."""
        clock = time.perf_counter
        try:
            t0 = clock()
            for batch in gen:
                t1 = clock()
                self.next_s += t1 - t0
                self.batches += 1
                yield batch
                t0 = clock()
                self.step_s += t0 - t1
                self.steps += 1
            self.next_s += clock() - t0
        finally:
            gen.close()

    def note_ready(self, ready: int) -> None:
        """At a ``next()`` of the threaded path: ``ready`` batches were prepared already (the asked one included)."""
        self.ready_sum += ready
        self.ready_n += 1
        if self.ready_min is None or ready < self.ready_min:
            self.ready_min = ready

    def collect(self, thread_stats: list, consumer: ThreadStats, threads: list, reset: bool) -> dict:
        """``Loader.stats()``'s dict (without the loader's own entries) from the threads' counters."""
        now = time.perf_counter()
        per_thread = []
        total = ThreadStats().snapshot()
        for name, st, thread in [*((f"thread {i}", st, t) for i, (st, t) in enumerate(zip(thread_stats, threads))),
                                 ("consumer", consumer, None)]:
            snap = st.snapshot()
            d = _minus(snap, self._base.get(id(st)))
            if reset:
                self._base[id(st)] = snap
            entry = {"name": name, "fill_s": d["fill_s"], "slices": d["slices"], "rows": d["rows"]}
            if thread is not None:
                cpu = _thread_cpu(thread)
                base = self._cpu_base.get(thread.ident, 0.0)
                entry["cpu_s"] = None if cpu is None else cpu - base
                if reset and cpu is not None:
                    self._cpu_base[thread.ident] = cpu
            per_thread.append(entry)
            for k in ("fill_s", "slices", "rows", "read_s", "read_bytes"):
                total[k] += d[k]
            for k, v in d["stage_s"].items():
                total["stage_s"][k] = total["stage_s"].get(k, 0.0) + v
        out = {
            "wall_s": now - self.t0,
            "batches": self.batches,
            "next_s": self.next_s,
            "step_s": self.step_s,
            "steps": self.steps,
            "ready_ahead": (None if not self.ready_n else
                            {"mean": self.ready_sum / self.ready_n, "min": self.ready_min, "count": self.ready_n}),
            "fill_s": total["fill_s"],
            "slices": total["slices"],
            "rows": total["rows"],
            "stages": total["stage_s"],
            "read_s": total["read_s"],
            "read_bytes": total["read_bytes"],
            "threads": per_thread,
        }
        if reset:
            self.t0 = now
            self.next_s = self.step_s = 0.0
            self.batches = self.steps = self.ready_sum = self.ready_n = 0
            self.ready_min = None
        return out


def bottleneck(stats: dict, num_threads: int, inline: bool, step_seconds: float | None = None,
               cores: int | None = None) -> dict:
    """The bottleneck report of a ``Loader.stats()`` dict; see ``Loader.bottleneck``."""
    batches, steps = stats["batches"], stats["steps"]
    work = stats["fill_s"] / batches if batches else None  # wall seconds of filling per batch, all threads
    step = step_seconds if step_seconds is not None else (stats["step_s"] / steps if steps else None)
    loop = stats["next_s"] + stats["step_s"]  # the consumer's loops: time in next() + time between batches
    share = stats["next_s"] / loop if steps and loop > 0 else None
    out = {"wait_share": share, "work_s_per_batch": work, "step_s": step, "num_threads": num_threads,
           "inline": inline, "recommended_num_threads": None, "thread_cpu_share": None, "verdict": None,
           "text": None}
    if work is None or step is None:
        out["verdict"] = "unknown"
        out["text"] = ("unknown: no step measured yet (iterate over at least two batches in one loop, or pass "
                       "step_seconds=)")
        return out
    # threads needed so that the batches keep up with the step: each does `work` seconds per batch
    need = max(1, math.ceil(work / step)) if step > 0 else None
    out["recommended_num_threads"] = need
    short = need is not None and cores is not None and need > cores  # more threads than cores cannot keep up
    # the decode threads' CPU seconds per second of filling: well under 1 when they wait for a core (the
    # machine's cores are busy) or for the GIL (a Python-bound step holding it)
    timed = [t for t in stats["threads"] if t.get("cpu_s") is not None and t["fill_s"] > 0]
    cpu_share = (sum(t["cpu_s"] for t in timed) / sum(t["fill_s"] for t in timed)) if timed else None
    out["thread_cpu_share"] = cpu_share
    if step_seconds is not None:  # from the given step time alone: can num_threads keep up?
        bound = work / num_threads > step if not inline else work > step
    else:
        bound = share > LOADER_BOUND_SHARE
    out["verdict"] = "loader-bound" if bound else "step-bound"
    how = "filled by the thread calling next()" if inline else f"on {num_threads} thread(s)"
    waited = (f"the step waited {100 * share:.1f}% of its time in next()" if share is not None else
              "no step measured")
    out["text"] = (f"{out['verdict']}: {waited}; the loader's work is {1e3 * work:.3g} ms per batch ({how}), "
                   f"the step {1e3 * step:.3g} ms"
                   + (" (given)" if step_seconds is not None else "")
                   + (f"; recommended num_threads >= {need}" if need is not None else "")
                   + (f" (more than this machine's {cores} cores: the loader cannot keep up with this step here; "
                      "use smaller images, a cheaper pipeline or a longer step)" if short else "")
                   + (f"; the decode threads ran {100 * cpu_share:.0f}% of their filling time (waiting for a core "
                      "or the GIL): free cores (fewer processes or step threads) rather than add threads"
                      if bound and cpu_share is not None and cpu_share < 0.7 and need is not None
                      and need <= num_threads else ""))
    return out


class LoaderReport:
    """The stats part of ``Loader`` (mixed in): ``stats()``, ``bottleneck()`` and ``remote_stats()`` over the
    Loader's ``_stats`` (LoaderStats), its pool's threads' counters and its sources' page sources."""

    def stats(self, reset: bool = False) -> dict:
        """Where the time went since construction or the last ``stats(reset=True)``; always on (see below).

        Consumer side (the thread iterating the loader): ``wall_s`` (seconds since construction / the last reset),
        ``batches`` (handed out), ``next_s`` (seconds spent inside ``next()``: waiting for a batch, filling it
        when batches are filled inline, helping the threads; the call that ends an epoch included), ``step_s``
        (seconds between a batch handed out and the next ``next()`` of the same loop: the training step) over
        ``steps`` such intervals; within one loop ``next_s + step_s`` is its wall time. ``ready_ahead``: at each
        ``next()`` of the threaded path, the batches already prepared (the one asked for included; 0: the consumer
        had to wait): ``{"mean", "min", "count"}``, None when every batch was filled inline.

        Work: ``fill_s`` (wall seconds filling batch slices, all threads and the consumer together), ``slices``,
        ``rows``; ``stages`` ({field: wall seconds of its stage}; an image field's stage is one fused kernel:
        read, decode, crop, resize, flip, normalize; a token field's reads and widens in one kernel; a file
        loading one field counts whole slices); ``read_s`` (part of the stages' time: reads of records' bytes
        into a thread's staging buffer, ``pread`` or copies out of the process page cache; token windows read by
        their kernel are not split out); ``bytes_read`` (bytes read from local files with ``pread``: with
        ``page_cache="os"`` the sum of the records' lengths read (a token window: ``(seq_len + 1) * itemsize``
        bytes); with ``"process"`` the pages read into the cache and records read around it); ``threads``
        (per decode thread and the consumer: ``name``, ``fill_s``, ``slices``, ``rows``, and for decode threads
        ``cpu_s`` from the thread's CPU clock, None where the platform has none); ``num_threads`` (threads
        started), ``inline`` (batches filled by the thread calling next()), ``page_cache`` (``{"hits",
        "misses"}`` page lookups of ``page_cache="process"``, else None), ``remote`` (:meth:`remote_stats`).

        A Mixture adds ``mixture``: ``{"position", "stage", "weights", "counts", "stage_counts", "edits"}`` where
        the stream stands after the batches handed out: the global sample position, the schedule's stage there (0
        for constant weights), the sources' shares there, every source's samples so far, those of the current
        stage, and the positions where weights were edited on resume (formats/mixture.md section 3).

        Cost: a few ``time.perf_counter`` reads per batch and slice (~50 ns each), no lock; under 1% of the
        fastest batch (a token batch filled inline, ~0.05-0.2 ms). Threads count their own numbers: while batches
        are being prepared, ``stats()`` may see a slice half counted (its time, not yet its row count).
        """
        reset = check.boolean("reset", reset)
        self._pool.refresh()  # process mode: the child's threads' counters, fetched now (threads: no-op)
        out = self._stats.collect([c[STATS_KEY] for c in self._pool.contexts[:len(self._pool.threads)]],
                                  self._ctx[STATS_KEY], self._pool.threads, reset)
        if len(self._stages) == 1:  # one field: its stage is the whole slice
            out["stages"] = {self._stages[0].name: out["fill_s"]}
        counted = self._pool.page_counters()  # process mode: the child's files are the ones read
        if counted is None:
            cache = page_counters(self._sources)
            caches = cache.pop("cached")
        else:
            caches, cache = counted
        prev = self._cache_base or {k: 0 for k in cache}
        if reset:
            self._cache_base = cache
        cache = {k: v - prev[k] for k, v in cache.items()}
        out["bytes_read"] = out.pop("read_bytes") + cache.pop("bytes_read")
        out.update(num_threads=len(self._pool.threads), inline=self._inline, page_cache=cache if caches else None,
                   remote=self.remote_stats())
        mixture = self._plan.describe(self._epoch, self._cursor, self._shift)
        if mixture is not None:
            out["mixture"] = mixture
        return out

    def bottleneck(self, step_seconds: float | None = None) -> dict:
        """Is the training loop waiting on the loader? From :meth:`stats` (since construction or its last reset).

        Returns ``{"verdict", "text", "wait_share", "work_s_per_batch", "step_s", "num_threads", "inline",
        "recommended_num_threads", "thread_cpu_share"}``: ``wait_share`` = ``next_s / (next_s + step_s)``, the share of the consumer's
        loop spent in ``next()``; ``verdict`` ``"loader-bound"`` when it exceeds 5%, else ``"step-bound"``
        (``"unknown"`` before two batches of one loop); ``work_s_per_batch`` = ``fill_s / batches`` (wall
        seconds of filling per batch, all threads together); ``recommended_num_threads`` = ``ceil(work / step)``
        (at least 1): the threads that keep up with a step of ``step_s`` seconds, cores permitting;
        ``thread_cpu_share``: the decode threads' CPU seconds (their CPU clocks) per second of filling, None
        without threads: well under 1 when they wait for a core or the GIL, then the text says so (loader-bound
        although ``num_threads`` would suffice: free cores rather than add threads).
        ``step_seconds`` (float > 0, seconds): judge against this step time instead of the measured one (e.g.
        the GPU step a CPU test run stands in for): loader-bound when ``work / num_threads`` exceeds it.
        ``text``: one line, e.g. ``"loader-bound: the step waited 37.0% of its time in next(); ..."``.
        """
        if step_seconds is not None:
            step_seconds = check.real("step_seconds", step_seconds, low=0, low_open=True)
        return bottleneck(self.stats(), len(self._pool.threads) or self.num_threads, self._inline, step_seconds,
                          os.cpu_count())

    def remote_stats(self) -> dict | None:
        """For a URL: what was fetched (requests, bytes_fetched, pages_fetched, pages_used, memory_hits, waits,
        disk_hits / disk_misses with cache_dir); None for a local file. For several files (a Mixture, a FileSet):
        those counters summed over its files read from URLs, plus ``"per_source"``: each file's own dict (None
        for a local file); None when every file is local."""
        per_source = [src.pages.stats() for src in self._sources]
        remote = [d for d in per_source if d is not None]
        if len(per_source) == 1 or not remote:  # one file: its own counters (None when local)
            return per_source[0]
        total: dict = {}
        for d in remote:
            for key, value in d.items():
                total[key] = total.get(key, 0) + value
        return {**total, "per_source": per_source}
