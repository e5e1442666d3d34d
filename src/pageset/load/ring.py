"""The Loader's ring of batch slots and their copies (mixed into ``Loader``, load/loader.py).

``batches_ahead + 2`` slots, each one set of batch buffers per stage (pinned when a CUDA ``ToDevice`` asks for
it; in shared memory in process mode), allocated once at construction and taken in turn across epochs. A slot
is refilled only once nothing the user holds points at its buffers (else it gets new ones) and once the GPU copy
out of it is done. ``_handout`` makes the batch dict a slot's buffers back (views, torch tensors), or hands the
slot to the device queue (load/../device/cuda.py), which copies it on a side stream with ``non_blocking=True``.
"""

from __future__ import annotations

import os
import weakref

import numpy as np
import torch

from .shared_slots import SharedBuffers
from .stages import PipelineError
from .workers import Slot

INDEX_KEY = "_index"  # int64[B]: record ids of the batch (field names never start with "_")
PADDING_KEY = "_is_padding"  # bool[B]: True for wrap-around samples of drop_last=False
SOURCE_KEY = "_source"  # int16[B]: which file of a Mixture each sample comes from (mixtures only)


class SlotRing:
    """The slot ring's part of ``Loader``: it uses the Loader's ``batch_size``, ``batches_ahead``,
    ``num_workers``, ``path``, ``array_type``, ``_stages``, ``_plan`` and ``_inline``; it sets ``_queue``,
    ``_slots``, ``_pinned``, ``_shared``, ``_empty`` and ``_turn``."""

    def _setup_buffers(self) -> None:
        """The device queue and the ring of batch buffers: ``batches_ahead + 2`` slots, all allocated here.

        Inline filling uses two of them (the batch handed out and the one being filled); the others are there
        for the switch to threads (see _inline_batches), which then allocates nothing in the middle of an epoch.
        Raises MemoryError naming the field, its op, the buffer shape and the bytes when the slots need more than
        the machine's memory or cannot be allocated.
        """
        self._queue = self._device_queue()
        empty = self._queue.empty if self._queue is not None else (lambda shape, dt: np.empty(shape, dt))
        n_slots = self.batches_ahead + 2
        self._check_buffer_memory(n_slots)
        self._shared = self._pinned = None
        try:
            if self.num_workers:  # process mode: the child fills them, in anonymous shared memory (process_pool)
                self._shared = SharedBuffers(self._stages, self.batch_size)
                self._slots = [Slot(i, self._shared.arrays(i)) for i in range(n_slots)]
                if self._queue is not None and self._queue.prefetch:  # CUDA: copied into pinned buffers, then sent
                    self._pinned = [Slot(i, [s.alloc(self.batch_size, empty) for s in self._stages])
                                    for i in range(n_slots)]
            else:
                self._slots = [Slot(i, [s.alloc(self.batch_size, empty) for s in self._stages])
                               for i in range(n_slots)]
        except MemoryError:
            raise MemoryError(self._buffer_message(n_slots, "could not be allocated")) from None
        self._empty = empty
        # Batches take the slots in turn, across epochs: the slot filled next is the one used longest ago, never
        # the one of the batch a `for batch in loader` loop still holds when it asks for the next (step % slots
        # would restart at slot 0 each epoch: a new batch buffer, 38 MB for 64 float32 224 px images, whenever
        # the epoch's step count is 1 more than a multiple of the slots).
        self._turn = 0

    def _buffers(self, n_slots: int) -> list:
        """(stage, key, shape, dtype, bytes) of one slot's buffers, largest first."""
        out = []
        for st in self._stages:
            for key, (shape, dt) in st.buffer_shapes(self.batch_size).items():
                out.append((st, key, shape, dt, int(np.prod(shape, dtype=object)) * dt.itemsize))
        return sorted(out, key=lambda b: -b[4])

    def _buffer_message(self, n_slots: int, what: str) -> str:
        bufs = self._buffers(n_slots)
        total = n_slots * sum(b[4] for b in bufs)
        st, key, shape, dt, nbytes = bufs[0]
        op = f"{st.op!r}" if st.op is not None else "its decoder"
        return (f"{self.path}: the batch buffers {what}: {n_slots} slots (batches_ahead + 2) x "
                f"{sum(b[4] for b in bufs) / 2**30:.3g} GiB = {total / 2**30:.3g} GiB; the largest: field "
                f"{st.name!r} ({op}), {key!r} of shape {tuple(shape)} {dt.name}, {nbytes / 2**30:.3g} GiB per batch. "
                "Use a smaller output size, batch_size or batches_ahead")

    def _check_buffer_memory(self, n_slots: int) -> None:
        """MemoryError when the slots' buffers need more than the machine's physical memory (they would be
        allocated lazily and fail, or be killed, at the first batches)."""
        total = n_slots * sum(b[4] for b in self._buffers(n_slots))
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # no sysconf: the allocation decides
            return
        if total > ram:
            raise MemoryError(self._buffer_message(n_slots, f"need more than this machine's memory "
                                                            f"({ram / 2**30:.3g} GiB)"))

    # ---- configuration helpers -------------------------------------------------------------------------
    def _device_queue(self):
        targets = {s.to_device for s in self._stages if s.to_device is not None}
        devices = {str(op.device) for op in targets}
        if len(devices) > 1:
            raise PipelineError(f"all ToDevice ops must name one device, got {sorted(devices)}")
        if not targets:
            return None
        return next(iter(targets)).make_queue()

    def _prefetch_to_device(self, slot: Slot | None) -> None:
        """Issue the next batch's host-to-device copy now, if it is ready, so it overlaps the step the consumer
        is about to run on the batch just handed out (CUDA queue only)."""
        if (slot is not None and self._queue is not None and self._queue.prefetch and slot.prefetched is None
                and slot.done.is_set() and slot.error is None):
            slot.prefetched = self._issue(slot, None)

    def _issue(self, slot: Slot, view):
        """The device queue's copy of a filled slot. Process mode with a CUDA queue: the slot's shared buffers
        are first copied into the slot's pinned ones (one host copy, in this process), which the DMA reads."""
        if self._pinned is None:
            return self._queue.issue(self._stages, slot, view)
        staged = self._pinned[slot.index]
        for dst, src in zip(staged.arrays, slot.arrays):
            for key, value in src.items():
                if isinstance(value, np.ndarray):
                    np.copyto(dst[key], value)
                else:
                    dst[key] = list(value)
        staged.ids, staged.padding, staged.event = slot.ids, slot.padding, None
        pending = self._queue.issue(self._stages, staged, view)
        slot.event = staged.event  # _reclaim waits on it before the pinned buffers are written again
        return pending

    def _next_slot(self) -> Slot:
        slot = self._slots[self._turn % (2 if self._inline else len(self._slots))]
        self._turn += 1
        return slot

    def _reclaim(self, slot: Slot) -> None:
        """Make the slot's buffers safe to overwrite: wait for a GPU copy out of it, and give it new buffers
        where the user still holds a batch made from the old ones."""
        if slot.event is not None:
            slot.event.synchronize()
            slot.event = None
        if any(ref() is not None for ref in slot.handed):
            slot.arrays = (self._shared.arrays(slot.index) if self._shared is not None else
                           [s.alloc(self.batch_size, self._empty) for s in self._stages])
        slot.handed = []

    def _handout(self, slot: Slot, owned: bool = False) -> dict:
        """The batch of a filled slot; ``owned``: the slot's ids/padding/sources arrays are new for this batch
        (inline filling) and are handed out without a copy."""
        def view(arr):
            v = arr[...]  # a new view object: its lifetime tells whether the user still holds the batch
            slot.handed.append(weakref.ref(v))
            return v

        if self._queue is not None:
            pending, slot.prefetched = slot.prefetched, None
            batch = self._queue.deliver(pending if pending is not None else self._issue(slot, view))
        else:
            batch = {}
            for stage, arrays in zip(self._stages, slot.arrays):
                batch.update(stage.handout(arrays, view))
            batch[INDEX_KEY] = slot.ids if owned else slot.ids.copy()
            batch[PADDING_KEY] = slot.padding if owned else slot.padding.copy()
        if self._plan.hands_sources:
            batch[SOURCE_KEY] = slot.sources if owned else slot.sources.copy()
        if self.array_type == "torch":  # owned copies: from_numpy shares them, costs no copy
            for key in (INDEX_KEY, PADDING_KEY, SOURCE_KEY):
                if isinstance(batch.get(key), np.ndarray):
                    batch[key] = torch.from_numpy(batch[key])
        return batch
