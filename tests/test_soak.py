"""Soak (issue 6, part 3): many epochs, early breaks and loader lifetimes leave no growth in RSS, open file
descriptors or threads.

Samples come from /proc (psutil is not a dependency): RSS from ``/proc/self/statm``, descriptors from
``/proc/self/fd``, threads from ``/proc/self/status`` (native threads, numba's and torch's included) and
``threading.active_count()``. Tolerances: descriptors and threads must return EXACTLY to their warmed-up
values; RSS may move by at most ``RSS_SLACK`` (allocator noise) between the warmed-up sample and the last one,
and the last quarter of the run may not grow by more than a quarter of that (no steady creep).
The figures are printed (``pytest -s``) for the issue note.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest

from pageset import Int, Loader, Normalize, RandomHorizontalFlip, RandomResizedCrop, RGBImage, write_dataset

RSS_SLACK = 12 << 20  # 12 MiB: glibc arenas per thread and numba's lazily compiled kernels settle in warm-up
PIPES = {"image": [RandomResizedCrop(48), RandomHorizontalFlip(), Normalize()]}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def native_threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def settled_native_threads(timeout: float = 2.0) -> int:
    """Native threads once joined Python threads have left the kernel: ``Thread.join()`` returns when the
    Python side is done, the OS thread exits a moment later, so a sample taken at once may count it."""
    deadline = time.monotonic() + timeout
    n = native_threads()
    while time.monotonic() < deadline:
        time.sleep(0.01)
        m = native_threads()
        if m == n:
            break
        n = m
    return min(n, native_threads())


def sample() -> dict:
    return {"rss": rss(), "fds": fds(), "threads": settled_native_threads(), "py_threads": threading.active_count()}


def _check(samples: list[dict], warm: int, what: str) -> None:
    base, last = samples[warm], samples[-1]
    q = samples[len(samples) * 3 // 4]
    print(f"\n{what}: {len(samples)} samples; RSS {samples[0]['rss'] / 2**20:.1f} -> warm "
          f"{base['rss'] / 2**20:.1f} -> last {last['rss'] / 2**20:.1f} MiB (max "
          f"{max(s['rss'] for s in samples) / 2**20:.1f}); fds {base['fds']} -> {last['fds']}; native threads "
          f"{base['threads']} -> {last['threads']}; python threads {base['py_threads']} -> {last['py_threads']}")
    assert [s["fds"] for s in samples[warm:]] == [base["fds"]] * (len(samples) - warm), what
    assert [s["py_threads"] for s in samples[warm:]] == [base["py_threads"]] * (len(samples) - warm), what
    assert [s["threads"] for s in samples[warm:]] == [base["threads"]] * (len(samples) - warm), what
    assert last["rss"] - base["rss"] < RSS_SLACK, what
    assert last["rss"] - q["rss"] < RSS_SLACK // 4, what


@pytest.fixture(scope="module")
def small_file(tmp_path_factory, imagenet_like):
    path = tmp_path_factory.mktemp("soak") / "small.pageset"
    write_dataset(path, imagenet_like, {"image": RGBImage(max_resolution=128, jpeg_quality=85), "label": Int()},
                  num_workers=0, page_size=1 << 15, progress=False)
    return path


@pytest.mark.slow
def test_fifty_epochs_no_growth(small_file):
    with Loader(small_file, batch_size=8, pipelines=PIPES, num_threads=2, order="quasi_random") as loader:
        samples = [sample()]
        for _ in range(50):
            n = sum(1 for _ in loader)
            assert n == 6
            samples.append(sample())
        assert loader.epoch == 50
    _check(samples, 3, "50 epochs")


@pytest.mark.slow
def test_thousand_early_broken_epochs_no_growth(small_file):
    with Loader(small_file, batch_size=8, pipelines=PIPES, num_threads=2) as loader:
        samples = [sample()]
        for k in range(1000):
            loader.set_epoch(k)  # a fresh epoch each time, broken after its first batch
            for _batch in loader:
                break
            if k % 50 == 49:
                samples.append(sample())
        assert loader.epoch == 999 and loader.steps_remaining == loader.steps_per_epoch - 1
        assert sum(1 for _ in loader) == loader.steps_per_epoch - 1  # the broken epoch's rest is still there
    _check(samples, 2, "1000 early-broken epochs")


def _one_batch(loader) -> None:
    for _batch in loader:
        break


@pytest.mark.slow
def test_hundred_loaders_closed_no_growth(small_file):
    samples = [sample()]
    for k in range(100):
        loader = Loader(small_file, batch_size=8, pipelines=PIPES, num_threads=2)
        _one_batch(loader)
        loader.close()
        if k % 10 == 9:
            samples.append(sample())
    del loader
    _check(samples, 2, "100 loaders closed")


@pytest.mark.slow
def test_hundred_loaders_dropped_no_growth(small_file):
    """``del loader`` (no close, no gc.collect) must release its threads, mmap and descriptors."""
    samples = [sample()]
    for k in range(100):
        loader = Loader(small_file, batch_size=8, pipelines=PIPES, num_threads=2)
        _one_batch(loader)
        del loader
        if k % 10 == 9:
            samples.append(sample())
    _check(samples, 2, "100 loaders dropped with del")


def test_dropped_loader_releases_threads_and_fds_at_once(small_file):
    """Without gc.collect(): a dropped Loader joins its threads and closes its file when the last reference
    goes (CPython reference counting)."""
    gc.collect()
    before = sample()
    for _ in range(3):
        loader = Loader(small_file, batch_size=8, pipelines=PIPES, num_threads=3)
        _one_batch(loader)
        del loader
    after = sample()
    assert after["fds"] == before["fds"] and after["py_threads"] == before["py_threads"]
