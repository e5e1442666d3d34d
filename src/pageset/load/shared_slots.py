"""The batch slots of the process mode in anonymous shared memory, mapped by the trainer and its child process.

One anonymous file per slot (``os.memfd_create``, else an unlinked ``tempfile.TemporaryFile``): no name in
``/dev/shm``, nothing to clean after a crash or a SIGKILL (the kernel frees it with its last descriptor and
mapping). A slot's file holds a header (what the child needs to fill it: read ids, files, keys) and then every
stage's buffers as the stage lays them out; the layout is computed once and sent to the child.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

_ALIGN = 64  # bytes: every buffer of a slot starts on a cache line


def anonymous_file(size: int) -> int:
    """A new anonymous file of ``size`` bytes (zeros), as a file descriptor: ``memfd_create`` where the OS has it,
    else an unlinked temporary file. It has no name anywhere: it is freed with its last descriptor and mapping."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("pageset-slot", os.MFD_CLOEXEC)
    else:  # pragma: no cover - systems without memfd (macOS)
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    try:
        os.ftruncate(fd, max(int(size), 1))
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_file(fd: int, size: int):
    """A shared read-write mapping of ``size`` bytes of ``fd`` (the caller may close ``fd`` afterwards)."""
    import mmap

    return mmap.mmap(fd, max(int(size), 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class SharedBuffers:
    """The slots' batch buffers in anonymous shared memory: one file per slot, laid out once for all slots.

    A slot's file holds a header (``read_ids`` int64[B], ``sources`` int16[B], ``keys`` uint64[B]: what the
    child needs to fill it) and then every stage's buffers as ``stage.alloc(B, empty)`` lays them out, each
    aligned to 64 bytes. ``layout`` (sent to the child once) is, per stage, ``[(key, offset, shape, dtype)]``, or
    ``(key, None, B, None)`` for a Python list (a JSON field: its values travel with the "done" message).
    """

    def __init__(self, stages: list, batch_size: int):
        B = self.batch_size = int(batch_size)
        self.header = [("read_ids", 0, (B,), np.dtype(np.int64)),
                       ("sources", _aligned(8 * B), (B,), np.dtype(np.int16)),
                       ("keys", _aligned(8 * B) + _aligned(2 * B), (B,), np.dtype(np.uint64))]
        offset = [_aligned(8 * B) + _aligned(2 * B) + _aligned(8 * B)]
        self.layout = []

        def sizing(shape, dt):  # records where each buffer goes; allocates nothing (a zero-stride view)
            dt = np.dtype(dt)
            arr = np.broadcast_to(np.zeros((), dt), tuple(int(s) for s in shape))
            placed[id(arr)] = (offset[0], tuple(arr.shape), dt)
            offset[0] += _aligned(int(np.prod(arr.shape, dtype=np.int64)) * dt.itemsize)
            keep.append(arr)
            return arr

        for st in stages:
            placed, keep = {}, []
            arrays = st.alloc(B, sizing)
            entries = []
            for key, value in arrays.items():
                if isinstance(value, np.ndarray) and id(value) in placed:
                    off, shape, dt = placed[id(value)]
                    entries.append((key, off, shape, dt.str))
                elif isinstance(value, list):
                    entries.append((key, None, len(value), None))
                else:
                    raise TypeError(f"field {st.name!r}: buffer {key!r} cannot live in shared memory "
                                    f"({type(value).__name__}); use num_workers=0")
            self.layout.append(entries)
        self.size = max(offset[0], 1)
        self._fresh: dict[int, int] = {}  # slot index -> descriptor of its new file, not yet sent to the child
        self._headers: dict[int, dict] = {}  # slot index -> header views of its current file

    def arrays(self, index: int) -> list:
        """New buffers for slot ``index`` in a new anonymous file (its descriptor is sent with the slot's next
        fill, :meth:`take_fd`); the old file stays mapped while anything points into it."""
        fd = anonymous_file(self.size)
        try:
            mm = map_file(fd, self.size)
        except BaseException:
            os.close(fd)
            raise
        old = self._fresh.pop(index, None)
        if old is not None:  # replaced before the child ever saw it
            os.close(old)
        self._fresh[index] = fd
        self._headers[index] = views(mm, [(k, off, shape, dt) for k, off, shape, dt in self.header])
        return [views(mm, entries) for entries in self.layout]

    def header_of(self, index: int) -> dict:
        return self._headers[index]

    def take_fd(self, index: int) -> int | None:
        """The descriptor of slot ``index``'s new file, once (None when the child has it already)."""
        return self._fresh.pop(index, None)

    def close(self) -> None:
        for fd in self._fresh.values():
            os.close(fd)
        self._fresh.clear()
        self._headers.clear()


def views(mm, entries) -> dict:
    """``{key: ndarray over mm}`` (or a list of ``n`` Nones) for layout entries ``(key, offset, shape, dtype)``."""
    out = {}
    for key, off, shape, dt in entries:
        if off is None:
            out[key] = [None] * int(shape)
        else:
            out[key] = np.ndarray(tuple(shape), dtype=np.dtype(dt), buffer=mm, offset=int(off))
    return out
