"""``ToDevice``: pinned host slots -> ``non_blocking`` copies on a side CUDA stream (the only torch.cuda code).

The loader's threads write each batch straight into page-locked ("pinned") host buffers, so the copy to the
GPU is a DMA that overlaps the training step instead of a synchronous staging copy. Per batch:

1. the copies are issued on a side stream with ``non_blocking=True``, for batch s+1 as soon as batch s is handed
   out (when it is ready), so they overlap the training step the consumer runs on batch s;
2. an event recorded on the side stream after the copies is stored with the slot; the loader waits on it
   (``event.synchronize()``) before it lets a thread overwrite that slot, so a buffer still in flight is
   never reused;
3. when the batch is handed out, the consumer's current stream waits for that event (``wait_event``: on the GPU,
   the host does not block), so kernels launched on it see the copied data, and each output tensor is marked
   with ``record_stream`` so the caching allocator does not hand its memory to another tensor while the consumer
   stream may still use it.

Without CUDA, ``ToDevice("cpu")`` is accepted (tensors stay in host memory) and ``ToDevice("cuda")`` raises a
clear error at Loader construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..format import arguments as check


@dataclass(frozen=True)
class ToDevice:
    """Move a field's batches to ``device`` (e.g. ``"cuda"``, ``"cuda:1"``, ``"cpu"``); ``non_blocking`` copies
    from pinned memory on a side stream. Put it last in a pipeline (it implies ToTensor)."""

    device: object = "cuda"
    non_blocking: bool = True
    is_to_device = True

    def __post_init__(self):
        if isinstance(self.device, bool) or not isinstance(self.device, (str, int, torch.device)):
            raise TypeError(f"ToDevice.device must be a device string such as 'cuda', 'cuda:1' or 'cpu' (or a "
                            f"torch.device), got {self.device!r} ({type(self.device).__name__})")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"ToDevice.device must be 'cuda', 'cuda:N' or 'cpu' (or a torch.device), got "
                             f"{self.device!r}") from exc
        if dev.type not in ("cuda", "cpu"):
            raise ValueError(f"ToDevice: unsupported device {self.device!r} (use 'cuda[:n]' or 'cpu')")
        object.__setattr__(self, "non_blocking", check.boolean("ToDevice.non_blocking", self.non_blocking))

    def make_queue(self):
        """The copy queue the Loader uses for this device (``None`` semantics are handled by the caller)."""
        dev = torch.device(self.device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"ToDevice({self.device!r}): CUDA is not available in this torch build "
                    f"({torch.__version__}); use ToDevice('cpu') or install a CUDA build of torch"
                )
            return CudaCopyQueue(dev, self.non_blocking)
        if dev.type == "cpu":
            return HostQueue()
        raise ValueError(f"ToDevice: unsupported device {self.device!r} (use 'cuda[:n]' or 'cpu')")


def _torch_dtype(np_dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype


class HostQueue:
    """ToDevice("cpu"): plain host buffers; batches are handed out as tensors over them (no early copy)."""

    prefetch = False

    def empty(self, shape, np_dtype) -> np.ndarray:
        return np.empty(shape, np_dtype)

    def issue(self, stages, slot, view) -> dict:
        return _host_batch(stages, slot, view)

    def deliver(self, pending: dict) -> dict:
        return pending


def _host_batch(stages, slot, view) -> dict:
    batch = {}
    for stage, arrays in zip(stages, slot.arrays):
        batch.update(stage.handout(arrays, view))
    batch["_index"] = slot.ids.copy()
    batch["_is_padding"] = slot.padding.copy()
    return batch


class CudaCopyQueue:
    """Pinned slots and a side stream for one CUDA device."""

    def __init__(self, device: torch.device, non_blocking: bool = True):
        self.device, self.non_blocking = device, non_blocking
        self.stream = torch.cuda.Stream(device=device)

    def empty(self, shape, np_dtype) -> np.ndarray:
        """A numpy view of a pinned host tensor (the view keeps the tensor, and so the pinned memory, alive)."""
        return torch.empty(tuple(shape), dtype=_torch_dtype(np_dtype), pin_memory=True).numpy()

    prefetch = True  # the loader issues batch s+1's copy when it hands out batch s (copy/compute overlap)

    def issue(self, stages, slot, view) -> dict:
        """Queue the copies of a filled slot on the side stream; return the pending batch (not yet safe to use).

        Only the side stream is involved, so the copies overlap whatever the consumer's stream is running (the
        previous training step). An event recorded after the copies is stored in ``slot.event``: the loader
        waits on it before letting a thread refill the slot's pinned buffers.
        """
        out = {}
        with torch.cuda.stream(self.stream):
            for stage, arrays in zip(stages, slot.arrays):
                for key, value in stage.handout(arrays, lambda a: a).items():  # views of the pinned slot
                    if stage.to_device is None:
                        out[key] = _clone_host(value)  # not moved: an owned copy (the slot is reused)
                    else:
                        out[key] = _to(value, self.device, self.non_blocking)
            event = torch.cuda.Event()
            event.record(self.stream)
        slot.event = event
        out["_index"], out["_is_padding"] = slot.ids.copy(), slot.padding.copy()
        return {"batch": out, "event": event}

    def deliver(self, pending: dict) -> dict:
        """Hand a pending batch to the consumer: its current stream waits for the copies (GPU-side, the host does
        not block), and each tensor is marked as used by that stream so the caching allocator cannot recycle its
        memory while queued kernels may still read it."""
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(pending["event"])
        for value in pending["batch"].values():
            for t in value if isinstance(value, tuple) else (value,):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(consumer)
        return pending["batch"]


def _to(value, device, non_blocking):
    if isinstance(value, tuple):
        return tuple(_to(v, device, non_blocking) for v in value)
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking, copy=True)  # never an alias of the reused slot
    return value  # Python values (max_seqlen)


def _clone_host(value):
    if isinstance(value, tuple):
        return tuple(_clone_host(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    return value
