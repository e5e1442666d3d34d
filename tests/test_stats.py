"""``Loader.stats()`` and ``Loader.bottleneck()``: counts exact against the file's own layout, times that add up.

Counts (batches, rows, bytes read, page-cache misses) are compared with values computed by hand from the file's
index (record lengths, page boundaries) or from the token file's arithmetic, never with another run of the
loader. Times are only compared with each other (sums, inequalities, shares of a loop the test times itself),
with tolerances that do not depend on the machine's speed or load: no timing is asserted.
"""

from __future__ import annotations

import math
import sys
import time

import numpy as np
import pytest

from pageset import Int, Loader, Normalize, RandomResizedCrop, RGBImage, TokenWindows, write_dataset, write_tokens
from pageset.read import Dataset

SEQ, B_TOK = 32, 4


@pytest.fixture(scope="module")
def images(tmp_path_factory, imagenet_like):
    path = tmp_path_factory.mktemp("stats") / "img.pageset"
    # small pages: the 48 JPEGs span several pages (page-cache misses are then a real count)
    write_dataset(path, imagenet_like, {"image": RGBImage(), "label": Int()}, num_workers=0, progress=False,
                  page_size=1 << 16)
    return path


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("stats") / "tok.pageset"
    rng = np.random.default_rng(5)
    write_tokens(path, [rng.integers(1, 60000, 5000).astype(np.uint16)], None, eos_id=0, num_workers=0,
                 progress=False, page_size=4096)
    return path


def image_loader(path, **kw):
    pipe = {"image": [RandomResizedCrop(96), Normalize()]}
    return Loader(path, batch_size=8, pipelines=pipe, order="quasi_random", seed=3, **kw)


def test_token_counts_are_exact(tokens):
    with Loader(tokens, batch_size=B_TOK, pipelines={"tokens": [TokenWindows(SEQ)]}, order="random") as ld:
        n_windows = (5001 - 1) // SEQ  # 5000 tokens + one EOS; a window needs SEQ + 1 tokens
        steps = n_windows // B_TOK
        assert len(ld) == steps
        got = sum(1 for _ in ld)
        s = ld.stats()
        assert got == steps == s["batches"] == s["slices"] and s["rows"] == steps * B_TOK
        # each window is one read of SEQ + 1 uint16 tokens
        assert s["bytes_read"] == steps * B_TOK * (SEQ + 1) * 2
        assert s["inline"] is True and s["num_threads"] == 0 and s["ready_ahead"] is None
        assert set(s["stages"]) == {"tokens"} and s["stages"]["tokens"] == s["fill_s"]
        assert [t["name"] for t in s["threads"]] == ["consumer"] and s["threads"][0]["rows"] == s["rows"]
        assert s["page_cache"] is None and s["remote"] is None
        assert s["steps"] == steps  # the interval after the last batch ends at the next() that ends the epoch
        # reset: everything counts from zero again; a partial epoch counts exactly what it handed out
        s0 = ld.stats(reset=True)
        assert s0["batches"] == steps
        z = ld.stats()
        assert z["batches"] == z["rows"] == z["bytes_read"] == z["steps"] == 0 and z["fill_s"] == 0.0
        it = iter(ld)
        for _ in range(3):
            next(it)
        s = ld.stats()
        assert s["batches"] == 3 and s["rows"] == 3 * B_TOK and s["bytes_read"] == 3 * B_TOK * (SEQ + 1) * 2
        assert s["steps"] == 2
        it.close()


def record_lengths(path, field="image"):
    with Dataset(path) as ds:
        return (ds.index[f"{field}.offset"].astype(np.int64), ds.index[f"{field}.length"].astype(np.int64),
                ds.data_offset, ds.page_size, ds.data_length)


@pytest.mark.parametrize("threads", [1, 2])
def test_image_bytes_read_are_the_records_read(images, threads):
    """page_cache="os": bytes read = the lengths of the images of every batch (labels are index columns: no read)."""
    _, lens, *_ = record_lengths(images)
    with image_loader(images, num_threads=threads) as ld:
        ids = np.concatenate([b["_index"].numpy() for b in ld])  # a whole epoch: nothing prepared beyond it
        s = ld.stats()
    assert s["batches"] == len(ids) // 8 == 6 and s["rows"] == len(ids)
    assert s["bytes_read"] == int(lens[ids].sum())
    assert s["inline"] is False and s["num_threads"] == threads
    assert [t["name"] for t in s["threads"]] == [f"thread {i}" for i in range(threads)] + ["consumer"]
    assert sum(t["rows"] for t in s["threads"]) == s["rows"]
    assert sum(t["slices"] for t in s["threads"]) == s["slices"]
    r = s["ready_ahead"]
    assert r["count"] == s["batches"] and 0 <= r["min"] <= r["mean"] <= ld.batches_ahead


def test_process_cache_counts_pages(images):
    """page_cache="process" with room for every page: each page the epoch touches is read once, whole."""
    offs, lens, data_offset, page_size, data_length = record_lengths(images)
    with image_loader(images, num_threads=1, page_cache="process", cache_pages=10_000) as ld:
        ids = np.concatenate([b["_index"].numpy() for b in ld])
        s = ld.stats()
    rel = offs[ids] - data_offset
    pages = np.unique(np.concatenate([np.arange(a // page_size, (a + n - 1) // page_size + 1)
                                      for a, n in zip(rel, lens[ids])]))
    inside = (rel // page_size) == ((rel + lens[ids] - 1) // page_size)
    # records inside one page come from the cache; a record across a page boundary is read straight
    cached_pages = np.unique(rel[inside] // page_size)
    page_bytes = sum(min(page_size, data_length - int(k) * page_size) for k in cached_pages)
    assert s["page_cache"]["misses"] == len(cached_pages) <= len(pages)
    assert s["bytes_read"] == page_bytes + int(lens[ids][~inside].sum())
    assert s["page_cache"]["hits"] + s["page_cache"]["misses"] >= len(cached_pages)


def cpu_step(x: np.ndarray, rounds: int) -> float:
    """A deterministic CPU step (the same work whatever the machine): repeated matrix products."""
    for _ in range(rounds):
        x = np.tanh(x @ x)
    return float(x[0, 0])


def test_times_add_up_on_a_slow_pipeline(images):
    """Loader-bound on purpose (96 px crops + normalise on 1 thread, a small step): the relations between the
    counters that hold whatever the machine's speed or load. Only orderings that follow from one monotonic clock
    read in a fixed order are asserted (no tolerance in seconds: a preempted thread can stretch any interval
    under load), and CPU seconds (a thread's own clock: load delays it, never inflates it) against wall seconds;
    the loader's accounting itself is checked exactly on a virtual clock below."""
    from pageset.load.stats import bottleneck

    x = np.random.default_rng(0).standard_normal((128, 128)) / 12
    with image_loader(images, num_threads=1) as ld:
        next(iter(ld))  # construction, kernel cache: not in the loop below
        ld.set_epoch(1)
        ld.stats(reset=True)
        stepped = 0.0
        t0 = time.perf_counter()
        for b in ld:
            ts = time.perf_counter()
            cpu_step(x, 40)
            stepped += time.perf_counter() - ts
        loop = time.perf_counter() - t0
        s = ld.stats()
    eps = 1e-6  # float rounding of sums of clock differences
    # the loader's intervals lie inside the test's loop and do not overlap; the test's steps inside the loader's
    assert s["next_s"] + s["step_s"] <= loop + eps, (s["next_s"], s["step_s"], loop)
    assert stepped <= s["step_s"] + eps and s["next_s"] <= loop - stepped + eps
    assert s["batches"] == s["steps"] == 6 and s["next_s"] > 0
    # the decode thread's CPU clock: positive, at most its wall time, and spent filling: its filling time plus
    # the pool's bookkeeping per slice (CPU microseconds; 2 ms each is a bound no load can reach, while the
    # consumer's matrix products, ~40x a slice's bookkeeping, would show if cpu_s were the process's CPU time)
    wall = s["wall_s"]
    (decode,) = [t for t in s["threads"] if t["name"] == "thread 0"]
    if decode["cpu_s"] is not None:
        assert 0 < decode["cpu_s"] <= wall + 1e-3
        assert decode["cpu_s"] <= decode["fill_s"] + 0.002 * (decode["slices"] + 1), decode
        r = bottleneck(s, 1, False)  # the report of this very dict: the share is exactly CPU over filling time
        assert r["thread_cpu_share"] == decode["cpu_s"] / decode["fill_s"] > 0
    # work: every thread busy at most the wall time; the consumer fills only inside next()
    for t in s["threads"]:
        assert 0 <= t["fill_s"] <= wall
        if t["name"] == "consumer":
            assert t["fill_s"] <= s["next_s"] + eps
    assert s["fill_s"] <= 2 * wall  # one decode thread + the consumer
    assert sum(s["stages"].values()) <= s["fill_s"] + eps
    assert set(s["stages"]) == {"image", "label"}
    assert 0 < s["read_s"] <= s["stages"]["image"]


class VirtualClock:
    """``pageset.load.stats``'s ``time`` module with a clock that moves only when the test moves it."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name):  # the threads' CPU clocks and everything else: the real module's
        return getattr(time, name)


@pytest.mark.parametrize("in_next,in_step", [(0.03125, 1.0), (1.0, 0.25)])
def test_next_and_step_times_are_exact_on_a_virtual_clock(tokens, monkeypatch, in_next, in_step):
    """The consumer's accounting, exactly: each next() takes ``in_next`` virtual seconds (the fill), each step
    ``in_step``: next_s, step_s, wall_s and the wait share are those sums to the last bit (binary fractions),
    whatever the machine's load; the verdict follows (step-bound at 3% waiting, loader-bound at 80%: the
    threshold is 5%)."""
    from pageset.load import stats as stats_mod

    clock = VirtualClock()
    monkeypatch.setattr(stats_mod, "time", clock)
    with Loader(tokens, batch_size=B_TOK, pipelines={"tokens": [TokenWindows(SEQ)]}, order="random") as ld:
        fill = ld._run_slice  # token batches: filled inline, one slice per next()

        def slow_fill(*args):
            clock.now += in_next
            return fill(*args)

        ld._run_slice = slow_fill
        n = 0
        for _ in ld:
            clock.now += in_step
            n += 1
        s = ld.stats()
        r = ld.bottleneck()
    assert n == len(ld) == s["batches"] == s["steps"] and s["inline"] is True
    assert s["next_s"] == n * in_next and s["step_s"] == n * in_step  # the step after the last batch included
    assert s["wall_s"] == n * (in_next + in_step)
    assert r["wait_share"] == in_next / (in_next + in_step) and r["step_s"] == in_step
    assert r["verdict"] == ("loader-bound" if r["wait_share"] > stats_mod.LOADER_BOUND_SHARE else "step-bound")
    assert r["verdict"] == ("loader-bound" if in_next > in_step else "step-bound")


def test_bottleneck_loader_bound_when_the_step_is_empty(images):
    with image_loader(images, num_threads=1) as ld:
        assert ld.bottleneck()["verdict"] == "unknown"
        for _ in ld:
            pass  # no step at all: the loop is next() and nothing else
        r = ld.bottleneck()
        s = ld.stats()
    assert r["verdict"] == "loader-bound" and r["wait_share"] > 0.5
    assert r["wait_share"] == pytest.approx(s["next_s"] / (s["next_s"] + s["step_s"]), rel=1e-3)
    work, step = s["fill_s"] / s["batches"], s["step_s"] / s["steps"]
    assert r["work_s_per_batch"] == pytest.approx(work, rel=1e-3)
    assert r["recommended_num_threads"] == max(1, math.ceil(r["work_s_per_batch"] / r["step_s"]))
    assert r["text"].startswith("loader-bound: the step waited ") and "% of its time in next()" in r["text"]
    assert step < work  # sanity of the setting: no step


def test_bottleneck_against_a_given_step_time(images):
    with image_loader(images, num_threads=2) as ld:
        for _ in ld:
            pass
        work = ld.stats()["fill_s"] / ld.stats()["batches"]
        tiny, huge = ld.bottleneck(step_seconds=1e-9), ld.bottleneck(step_seconds=1e6)
        fits = ld.bottleneck(step_seconds=work)  # 2 threads each doing `work` per batch keep up with `work`
    assert tiny["verdict"] == "loader-bound" and tiny["step_s"] == 1e-9
    assert tiny["recommended_num_threads"] == math.ceil(tiny["work_s_per_batch"] / 1e-9)
    assert "more than this machine's" in tiny["text"]
    assert huge["verdict"] == "step-bound" and huge["recommended_num_threads"] == 1 and "(given)" in huge["text"]
    assert fits["verdict"] == "step-bound" and fits["recommended_num_threads"] == 1


def test_bottleneck_step_bound_with_a_long_step(tokens):
    """Token batches filled inline (~0.1 ms) against a step of many matrix products: the step dominates."""
    x = np.random.default_rng(0).standard_normal((96, 96)) / 10
    with Loader(tokens, batch_size=B_TOK, pipelines={"tokens": [TokenWindows(SEQ)]}) as ld:
        it = iter(ld)
        next(it)
        ld.stats(reset=True)
        for _ in range(6):
            next(it)
            cpu_step(x, 800)  # ~50x a token batch's fill, whatever the machine's speed
        it.close()
        r = ld.bottleneck()
    assert r["verdict"] == "step-bound" and r["wait_share"] < 0.05 and r["inline"] is True
    assert r["recommended_num_threads"] == 1 and r["text"].startswith("step-bound: ")
