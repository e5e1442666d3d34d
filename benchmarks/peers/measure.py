"""One measurement protocol for every loader (pageset, the DataLoader baseline and the peers in their own envs).

Stdlib + psutil + torch/Pillow only (no pageset): the peer scripts import this file by path inside their own
virtual environments, and ``benchmarks/run_all.py`` imports it from the main one.

Protocol, one fresh process per row (so RSS and CPU belong to that row alone):
- ``t0`` is taken when the script starts, before any loader import: **time to first batch** is
  ``t0 -> first batch of epoch 0`` (import, file open, JIT compile or kernel-cache load, worker start, decode);
- epoch 0 is finished (warm-up: page cache, worker pools, lazy allocations), then **epochs 1, 2, ...** are
  timed, whole epochs until at least 2 s have passed: images/s = images / wall seconds;
- **CPU s/image**: user+system CPU seconds of this process and all its live descendants (DataLoader worker
  processes, numba threads) over the timed epochs, divided by the images; 2 cores busy for 1 s = 2 CPU s;
- **peak RSS**: the largest sum over the process tree of PSS (proportional set size: pages shared by forked
  workers are split between them, not counted once per worker), sampled every 50 ms over every epoch;
  file pages a loader maps (pageset's and FFCV's mmap) count while they are mapped.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time

T0 = time.perf_counter()  # import this module first in a measuring script

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


class TreeSampler:
    """Background sampler of the process tree's PSS (peak) and CPU times (on demand)."""

    def __new__(cls, *args, **kwargs):
        try:
            import psutil  # noqa: F401
        except ImportError:  # a fresh env without the bench extra: this process only, via getrusage
            return RusageSampler()
        return super().__new__(cls)

    def __init__(self, interval=0.05):
        import psutil

        self._ps = psutil
        self.me = psutil.Process()
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _procs(self):
        try:
            return [self.me] + self.me.children(recursive=True)
        except self._ps.Error:
            return [self.me]

    def _mem(self):
        total = 0
        for p in self._procs():
            try:
                total += p.memory_full_info().pss
            except (self._ps.Error, AttributeError):
                try:
                    total += p.memory_info().rss
                except self._ps.Error:
                    pass
        return total

    def _run(self, interval):
        while not self._stop.wait(interval):
            self.peak_bytes = max(self.peak_bytes, self._mem())

    def cpu_seconds(self) -> float:
        total = 0.0
        for p in self._procs():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except self._ps.Error:
                pass
        return total

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._mem())


class RusageSampler:
    """Fallback without psutil: CPU and peak RSS (not PSS) of this process only (threads, not worker processes)."""

    def __init__(self):
        import resource

        self._r = resource
        self.peak_bytes = 0

    def cpu_seconds(self) -> float:
        u = self._r.getrusage(self._r.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime

    def stop(self):
        self.peak_bytes = self._r.getrusage(self._r.RUSAGE_SELF).ru_maxrss * 1024


def cpu_with_children(timeout: float = 10.0) -> float:
    """User + system CPU seconds of this process and of its finished child processes, after reaping the children
    a writer started and left to exit by themselves (FFCV's workers; waits up to ``timeout`` s for them)."""
    import multiprocessing
    import os

    deadline = time.monotonic() + timeout
    while multiprocessing.active_children() and time.monotonic() < deadline:  # active_children() reaps the done
        time.sleep(0.01)
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class PeakRSS:
    """Peak resident memory of this process over a ``with`` block, for one row of a benchmark that runs several
    rows in one process (threads share the process's memory, so this is the whole loader's).

        with PeakRSS() as mem:
            ...run the row...
        row["peak_rss_mb"] = mem.peak_mb          # also mem.start_mb (RSS when the block began), mem.method

    On Linux the kernel's high-water mark (``VmHWM``) is reset at the start of the block (writing 5 to
    ``/proc/self/clear_refs``) and read at its end: exact, no sampling. Where that reset is refused, a thread
    samples ``VmRSS`` every ``interval`` seconds (``method == "sampled"``); without ``/proc`` it falls back to
    ``getrusage`` (``method == "ru_maxrss"``: the process's peak since it started, an upper bound). Memory of
    child processes is not counted (run_all measures each benchmark process with ``wait4``)."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.peak_mb, self.start_mb, self.method = interval, 0.0, 0.0, ""
        self._stop, self._thread = threading.Event(), None

    @staticmethod
    def _status_mb(key: str) -> float:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024  # kB
        raise KeyError(key)

    def __enter__(self):
        try:
            self.start_mb = self._status_mb("VmRSS")
        except OSError:
            self.method = "ru_maxrss"
            return self
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM"
        except OSError:
            self.method = "sampled"
            self.peak_mb = self.start_mb
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.peak_mb = max(self.peak_mb, self._status_mb("VmRSS"))

    def __exit__(self, *exc):
        if self.method == "VmHWM":
            self.peak_mb = self._status_mb("VmHWM")
        elif self.method == "sampled":
            self._stop.set()
            self._thread.join(timeout=5)
            self.peak_mb = max(self.peak_mb, self._status_mb("VmRSS"))
        else:
            import resource

            self.peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return False


def batch_len(batch) -> int:
    if isinstance(batch, dict):
        return len(batch["_index"])
    return len(batch[1] if isinstance(batch, (list, tuple)) else batch)


def measure(make_iter, check=None, min_seconds: float = 2.0, max_epochs: int = 50) -> dict:
    """Run epoch 0 (first batch timed from T0), then time epochs 1, 2, ... of ``make_iter(epoch)``: whole epochs
    until at least ``min_seconds`` of wall time have passed (at most ``max_epochs``).

    A small epoch (320 images: 5 batches of 64, 0.15-0.9 s) timed once is dominated by its start and end (the
    ring of batches ahead fills and drains) and by the machine's load changing from one second to the next:
    timing several epochs makes a row's rate an average over seconds, not a sample of a fraction of one.
    ``check(batch)`` is called on the first batch (shape / dtype assertions). Returns the row's numbers
    (``images``, ``epoch_s``: the images and wall seconds of the ``epochs`` timed epochs).
    """
    sampler = TreeSampler()
    first, n0 = None, 0
    for batch in make_iter(0):
        if first is None:
            first = time.perf_counter() - T0
            if check is not None:
                check(batch)
        n0 += batch_len(batch)
    c0, t1 = sampler.cpu_seconds(), time.perf_counter()
    n1 = epochs = 0
    while epochs < max(1, max_epochs) and (epochs == 0 or time.perf_counter() - t1 < min_seconds):
        epochs += 1
        for batch in make_iter(epochs):
            n1 += batch_len(batch)
    dt = time.perf_counter() - t1
    cpu = sampler.cpu_seconds() - c0
    sampler.stop()
    return {"images_per_s": n1 / dt, "first_batch_s": first, "images": n1, "epoch_s": dt, "epochs": epochs,
            "cpu_s_per_image": cpu / max(n1, 1), "peak_rss_mb": sampler.peak_bytes / 2**20}


def emit(row: dict) -> None:
    """The one JSON line the parent process parses (the last line starting with '{')."""
    print(json.dumps(row), flush=True)


# ---- the baseline transform, for loaders whose samples are PIL images or JPEG bytes ----------------------
# torchvision's RandomResizedCrop.get_params box, BILINEAR resize of the box, flip p=0.5, /255, normalize, float32
# CHW. It lives here, not in benchmarks/images.py (whose PillowFolder calls it), because the peer envs have no
# pageset to import images.py with.
def rrc_box(w, h, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    area = w * h
    log_r = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * random.uniform(*scale)
        ar = math.exp(random.uniform(*log_r))
        cw, ch = int(round(math.sqrt(target * ar))), int(round(math.sqrt(target / ar)))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = random.randint(0, w - cw), random.randint(0, h - ch)
            return x, y, cw, ch
    return 0, 0, w, h


_NORM = None


def pillow_transform(img, size=224):
    """PIL image (or JPEG bytes) -> float32[3, size, size] normalized tensor."""
    global _NORM
    import io

    import numpy as np
    import torch
    from PIL import Image

    if _NORM is None:
        _NORM = (torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1))
    if isinstance(img, (bytes, bytearray, memoryview)):
        img = Image.open(io.BytesIO(bytes(img)))
    img = img.convert("RGB")
    x, y, cw, ch = rrc_box(*img.size)
    img = img.resize((size, size), Image.BILINEAR, box=(x, y, x + cw, y + ch))
    if random.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    t = torch.from_numpy(np.asarray(img)).permute(2, 0, 1).float().div_(255)
    return (t - _NORM[0]) / _NORM[1]


def image_folder(root):
    """[(path, label)] of an ImageFolder, sorted like pageset's ImageFolder source (class = sorted dir index)."""
    from pathlib import Path

    classes = sorted(d.name for d in Path(root).iterdir() if d.is_dir())
    return [(str(p), i) for i, c in enumerate(classes) for p in sorted((Path(root) / c).glob("*.jpg"))]
