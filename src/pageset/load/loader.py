"""``Loader``: a pageset file -> batches, in order v1, from a persistent pool of threads running Numba kernels.

    loader = Loader("train.pageset", batch_size=256, order="quasi_random", seed=0,
                    pipelines={"image": [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(),
                                         ToTorchImage(), ToTensor(), ToDevice("cuda")],
                               "label": [IntDecoder(), ToTensor(), ToDevice("cuda")]})
    for epoch in range(90):
        for batch in loader:              # one epoch (or the rest of it after load_state_dict)
            batch["image"], batch["label"], batch["_index"], batch["_is_padding"]

Order, rank slices and resume are order v1 (``pageset.order``): the batches of a step are a pure function of
(seed, epoch, step, rank, world_size), and ``state_dict()`` counts batches handed out by ``next()``.
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass

import numpy as np

from ..order import (
    ORDERS,
    EpochOrder,
    OrderState,
    check_compatible,
    enable_kernel_cache,
    epoch_length,
    normalize_cursor,
    rank_positions,
    resolve_rank,
    sample_keys,
)
from ..read import open_dataset
from .pages import PageVerifier, PreadPages, ProcessPageCache
from .stages import PipelineError, build_stage
from .workers import Slot, ThreadPool

INDEX_KEY = "_index"  # int64[B]: record ids of the batch (field names never start with "_")
PADDING_KEY = "_is_padding"  # bool[B]: True for wrap-around samples of drop_last=False


@dataclass(frozen=True)
class Distributed:
    """Which slice of the data this process loads: ``rank`` in ``[0, world_size)``."""

    rank: int
    world_size: int


def _torch_distributed():
    """(rank, world_size) from an initialised torch.distributed, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


class Loader:
    """Batches from a pageset file.

    Args:
        path: the pageset file.
        batch_size: samples per batch on this rank (B); the global batch is ``G = B * world_size``.
        pipelines: ``{field: [ops]}``; a field mapped to ``None`` is not loaded; fields left out get their
            default decoder (images have none: give them a crop). See ``pageset.ops.transforms``.
        order: ``"random"`` (full shuffle), ``"quasi_random"`` (shuffle pages, then ids inside windows of
            ``window_pages`` pages: bounded memory, page-local reads) or ``"sequential"``.
        seed: u64; with the epoch it fixes the order and every augmentation.
        drop_last: drop the last incomplete global batch (True) or complete it by wrapping to the start of the
            epoch's order, flagging those samples in ``batch["_is_padding"]`` (False).
        num_threads: decode threads (default: ``os.cpu_count()``).
        batches_ahead: batches prepared ahead of the consumer (default 2 per thread, at least 2).
        rank, world_size: explicit values win; else an initialised torch.distributed; else torchrun's RANK /
            WORLD_SIZE environment; else a single process.
        page_cache: ``"os"`` (records read with ``pread``; the OS page cache keeps what is hot) or
            ``"process"`` (a bounded LRU of whole pages read with ``pread``: ``cache_pages`` pages; default
            ``2 * window_pages + batches_ahead + 2``). Neither maps the file: a file truncated or modified in
            place under the loader raises TruncatedFileError / FileChangedError at the next batch, never SIGBUS.
        window_pages: pages per quasi-random window (M).
        verify_pages: check each page's CRC-32 the first time a batch needs it (off by default: one extra pass
            over the data); a damaged page raises ChecksumMismatchError naming the page and the sample.

    Each batch is a dict: one entry per loaded field (a Bytes field gives ``(data, lengths)``), plus
    ``"_index"`` (int64[B] record ids) and ``"_is_padding"`` (bool[B]). Batches are numpy arrays, or torch
    tensors for fields whose pipeline has ``ToTensor``/``ToDevice``. Buffers are reused only once nothing
    the user holds points at them: keeping batches (``list(loader)``) is safe, and costs a fresh allocation
    for each kept batch instead of a copy for every batch.

    Raises ValueError for bad arguments (naming the argument and the fix), PipelineError for bad pipelines,
    FormatError for a damaged file; an exception raised while preparing a batch is re-raised by ``next()``
    with the thread's traceback.
    """

    def __init__(self, path, *, batch_size: int, pipelines: dict | None = None, order: str = "random",
                 seed: int = 0, drop_last: bool = True, num_threads: int | None = None,
                 batches_ahead: int | None = None, rank: int | None = None, world_size: int | None = None,
                 page_cache: str = "os", window_pages: int = 8, cache_pages: int | None = None,
                 verify_pages: bool = False):
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if page_cache not in ("os", "process"):
            raise ValueError(f"page_cache must be 'os' or 'process', got {page_cache!r}")
        num_threads = (os.cpu_count() or 1) if num_threads is None else num_threads
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        batches_ahead = max(2, 2 * num_threads) if batches_ahead is None else batches_ahead
        if batches_ahead < 1:
            raise ValueError(f"batches_ahead must be >= 1, got {batches_ahead}")
        self._closed = True  # until construction succeeds
        enable_kernel_cache()
        r, w = resolve_rank(rank, world_size, probe=_torch_distributed)
        self.dist = Distributed(r, w)
        self.batch_size, self.global_batch_size = batch_size, batch_size * w
        self.order, self.seed, self.drop_last = order, int(seed), bool(drop_last)
        self.window_pages, self.num_threads, self.batches_ahead = int(window_pages), num_threads, batches_ahead
        self._ds = open_dataset(path)
        try:
            self._setup(page_cache, cache_pages, pipelines, verify_pages)
        except BaseException:
            if getattr(self, "_pages", None) is not None:
                self._pages.close()
            self._ds.close()
            raise
        self._epoch, self._cursor = 0, 0
        self._active = None  # the running epoch generator, if any
        self._pool = ThreadPool(num_threads, self._run_slice)
        self._closed = False  # only now: close() and __del__ have everything to release

    def _setup(self, page_cache, cache_pages, pipelines, verify_pages) -> None:
        """Page access, stages, record layout and the buffer ring (everything but the threads)."""
        batch_size, batches_ahead = self.batch_size, self.batches_ahead
        self.path, self.dataset_id = self._ds.path, self._ds.dataset_id
        if page_cache == "os":
            self._pages = PreadPages(self._ds)
        else:
            capacity = cache_pages if cache_pages is not None else 2 * self.window_pages + batches_ahead + 2
            self._pages = ProcessPageCache(self._ds, capacity)
        pipelines = dict(pipelines or {})
        unknown = set(pipelines) - set(self._ds.fields)
        if unknown:
            raise PipelineError(f"{self.path}: pipelines name unknown fields {sorted(unknown)}; "
                                f"the file has {list(self._ds.fields)}")
        self._stages = [build_stage(n, f, pipelines.get(n), self._ds, self._pages)
                        for n, f in self._ds.fields.items() if not (n in pipelines and pipelines[n] is None)]
        # Records are the file's records, or, for a token file, its seq_len windows.
        windows = [s for s in self._stages if hasattr(s, "records_per_page")]
        if windows:
            self.n_records = windows[0].n_records
            self._page_sizes = windows[0].records_per_page(self._ds.page_count)
            self._spans = windows[0].spans
        else:
            self.n_records = len(self._ds)
            self._page_sizes = self._ds.records_per_page()
            rec_off = self._ds.index["_offset"].astype(np.int64)
            rec_len = self._ds.index["_length"].astype(np.int64)
            self._spans = lambda ids: (rec_off[ids], rec_len[ids])
        self._verifier = PageVerifier(self._ds) if verify_pages else None
        self.epoch_length = epoch_length(self.n_records, self.global_batch_size, self.drop_last)
        self._queue = self._device_queue()
        empty = self._queue.empty if self._queue is not None else (lambda shape, dt: np.empty(shape, dt))
        self._slots = [Slot(i, [s.alloc(batch_size, empty) for s in self._stages])
                       for i in range(batches_ahead + 2)]
        self._empty = empty

    # ---- configuration helpers -------------------------------------------------------------------------
    def _device_queue(self):
        targets = {s.to_device for s in self._stages if s.to_device is not None}
        devices = {str(op.device) for op in targets}
        if len(devices) > 1:
            raise PipelineError(f"all ToDevice ops must name one device, got {sorted(devices)}")
        if not targets:
            return None
        return next(iter(targets)).make_queue()

    # ---- state -----------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def steps_per_epoch(self) -> int:
        return self.epoch_length // self.global_batch_size

    def __len__(self) -> int:
        """Batches the next ``iter()`` yields on this rank (the same number on every rank): the rest of the
        current epoch, or a whole epoch once the current one has been handed out completely."""
        left = self.steps_per_epoch - self._cursor // self.global_batch_size
        return left if left > 0 else self.steps_per_epoch

    def state_dict(self) -> dict:
        """The resume state (order v1): JSON-serialisable, the same on every rank; counts delivered batches."""
        return self._state(self._epoch, self._cursor).to_dict()

    def _state(self, epoch, cursor) -> OrderState:
        return OrderState(dataset_id=self.dataset_id, seed=self.seed, epoch=epoch, cursor=cursor,
                          global_batch_size=self.global_batch_size, order=self.order,
                          window_pages=self.window_pages, drop_last=self.drop_last)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (possibly saved with another world size or thread count).

        Raises StateError / StateMismatchError naming the field (another dataset, seed, order, global batch,
        ...). The next batch is step ``cursor / G``; skipped samples are never read.
        """
        saved = OrderState.from_dict(state)
        check_compatible(saved, self._state(0, 0), self.dist.world_size, self.n_records)
        self._stop_active()
        self._epoch, self._cursor = normalize_cursor(saved.epoch, saved.cursor, self.epoch_length)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning at the next ``iter()``."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._stop_active()
        self._epoch, self._cursor = int(epoch), 0

    # ---- iteration -------------------------------------------------------------------------------------
    def __iter__(self):
        """The rest of the current epoch; a new ``iter()`` stops the previous one and continues from the
        state (batches already handed out are not repeated). The epoch counter advances at its end."""
        if self._closed:
            raise RuntimeError("this Loader is closed")
        self._stop_active()
        gen = self._epoch_batches()
        self._active = weakref.ref(gen)
        return gen

    def _stop_active(self) -> None:
        gen = self._active() if self._active is not None else None
        self._active = None
        if gen is not None:
            gen.close()

    def _epoch_batches(self):
        if self._cursor >= self.epoch_length:  # the last batch was handed out but the epoch not closed yet
            self._epoch, self._cursor = self._epoch + 1, 0
        G, epoch = self.global_batch_size, self._epoch
        steps = self.steps_per_epoch
        first = self._cursor // G
        order = EpochOrder(self._page_sizes, self.seed, epoch, self.order, self.window_pages)
        scheduled: list[Slot] = []
        nxt = first
        try:
            for step in range(first, steps):
                while nxt < steps and nxt - step < self.batches_ahead:
                    scheduled.append(self._schedule(order, epoch, nxt))
                    nxt += 1
                slot = scheduled.pop(0)
                self._wait(slot)
                batch = self._handout(slot)
                self._cursor = (step + 1) * G
                self._prefetch_to_device(scheduled[0] if scheduled else None)
                yield batch
            self._epoch, self._cursor = epoch + 1, 0
        finally:
            self._pool.cancel()
            for slot in scheduled:  # let in-flight slices finish before their buffers are reused
                self._wait(slot, raise_errors=False)

    def _prefetch_to_device(self, slot: Slot | None) -> None:
        """Issue the next batch's host-to-device copy now, if it is ready, so it overlaps the step the consumer
        is about to run on the batch just handed out (CUDA queue only)."""
        if (slot is not None and self._queue is not None and self._queue.prefetch and slot.prefetched is None
                and slot.done.is_set() and slot.error is None):
            slot.prefetched = self._queue.issue(self._stages, slot, None)

    def _schedule(self, order: EpochOrder, epoch: int, step: int) -> Slot:
        slot = self._slots[step % len(self._slots)]
        self._reclaim(slot)
        positions, padding = rank_positions(step, self.dist.rank, self.dist.world_size, self.global_batch_size,
                                            self.n_records, self.drop_last)
        slot.step, slot.generation, slot.error, slot.prefetched = step, self._pool.generation, None, None
        slot.positions, slot.padding = positions, padding
        slot.ids = order.ids(int(positions[0]), int(positions[-1]) + 1)
        slot.keys = sample_keys(self.seed, epoch, positions)
        n_slices = min(self.num_threads, self.batch_size)
        bounds = np.linspace(0, self.batch_size, n_slices + 1).astype(int)
        slot.done.clear()
        slot.pending = n_slices
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            self._pool.submit(slot, int(lo), int(hi))
        return slot

    def _reclaim(self, slot: Slot) -> None:
        """Make the slot's buffers safe to overwrite: wait for a GPU copy out of it, and give it new buffers
        where the user still holds a batch made from the old ones."""
        if slot.event is not None:
            slot.event.synchronize()
            slot.event = None
        if any(ref() is not None for ref in slot.handed):
            slot.arrays = [s.alloc(self.batch_size, self._empty) for s in self._stages]
        slot.handed = []

    def _run_slice(self, slot: Slot, lo: int, hi: int, ctx: dict) -> None:
        ids, keys = slot.ids[lo:hi], slot.keys[lo:hi]
        if self._verifier is not None:
            self._verifier.check(*self._spans(ids), ids)
        for stage, arrays in zip(self._stages, slot.arrays):
            stage.fill(arrays, lo, hi, ids, keys, ctx)

    def _wait(self, slot: Slot, raise_errors: bool = True) -> None:
        t0 = time.monotonic()
        while not slot.done.wait(0.1):
            if self._pool.alive() < self.num_threads:
                raise RuntimeError(f"{self.path}: a loader thread exited unexpectedly")
            if time.monotonic() - t0 > 3600:
                raise TimeoutError(f"{self.path}: batch step {slot.step} not ready after an hour")
        if slot.error is not None and raise_errors:
            exc, slot.error = slot.error, None
            raise exc

    def _handout(self, slot: Slot) -> dict:
        def view(arr):
            v = arr[...]  # a new view object: its lifetime tells whether the user still holds the batch
            slot.handed.append(weakref.ref(v))
            return v

        if self._queue is not None:
            pending, slot.prefetched = slot.prefetched, None
            return self._queue.deliver(pending if pending is not None else self._queue.issue(self._stages, slot, view))
        batch = {}
        for stage, arrays in zip(self._stages, slot.arrays):
            batch.update(stage.handout(arrays, view))
        batch[INDEX_KEY] = slot.ids.copy()
        batch[PADDING_KEY] = slot.padding.copy()
        return batch

    # ---- lifetime --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the epoch in progress, join the threads and release the file. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._stop_active()
        self._pool.close()
        self._pages.close()
        self._ds.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"Loader({self.path!r}, batch_size={self.batch_size}, order={self.order!r}, "
                f"rank={self.dist.rank}/{self.dist.world_size}, epoch={self._epoch}, batches_left={len(self)})")


