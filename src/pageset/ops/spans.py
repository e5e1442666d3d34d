"""Byte spans for the loader's page sources: many records read or copied in one nogil call.

A batch's records (JPEGs, token windows, arrays) sit at scattered offsets of the file or of a page cache's
arena. One ``os.preadv`` or numpy slice copy per record costs ~1 us of Python and a GIL release/re-acquire
each; for a batch of 32 token windows of 4 KiB that is more than the reads themselves, and with a second
thread wanting the GIL every re-acquire can wait. :func:`pread_spans` and :func:`copy_spans` do the whole
batch in one call that releases the GIL once.

``pread_spans`` calls libc's ``pread`` (POSIX; ``off_t`` is 64-bit on the 64-bit Linux targets) through a
Numba ``ExternalFunction`` resolved by name in the running process, so the on-disk kernel cache works
across processes. Under ``NUMBA_DISABLE_JIT=1`` it is the same loop in Python over ``os.preadv``.
"""

from __future__ import annotations

import functools
import os
import sys

import numba
import numpy as np
from numba import types

from pageset.ops import kernel_cache

if numba.config.DISABLE_JIT:

    def pread_spans(fd, offs, lens, dst, dst_offs):
        """Plain-Python twin of the kernel below (``NUMBA_DISABLE_JIT=1``)."""
        view = memoryview(dst)
        for j in range(lens.shape[0]):
            done, n = 0, int(lens[j])
            while done < n:
                lo = int(dst_offs[j]) + done
                r = os.preadv(fd, [view[lo : lo + n - done]], int(offs[j]) + done)
                if r <= 0:
                    return j
                done += r
        return -1

    def pread_spans_fds(fds, offs, lens, dst, dst_offs):
        """Plain-Python twin of the kernel below (``NUMBA_DISABLE_JIT=1``)."""
        view = memoryview(dst)
        for j in range(lens.shape[0]):
            done, n = 0, int(lens[j])
            while done < n:
                lo = int(dst_offs[j]) + done
                r = os.preadv(int(fds[j]), [view[lo : lo + n - done]], int(offs[j]) + done)
                if r <= 0:
                    return j
                done += r
        return -1

    def pread_full(fd, dst, off):
        """Plain-Python twin of the kernel below (``NUMBA_DISABLE_JIT=1``)."""
        view = memoryview(dst).cast("B")
        done = 0
        while done < len(view):
            r = os.preadv(fd, [view[done:]], off + done)
            if r <= 0:
                return False
            done += r
        return True

else:
    _pread = types.ExternalFunction("pread", types.int64(types.int32, types.int64, types.int64, types.int64))

    @numba.njit(nogil=True)
    def pread_spans(fd, offs, lens, dst, dst_offs):
        """Read file bytes ``[offs[j], offs[j] + lens[j])`` into ``dst[dst_offs[j]:]`` for every ``j``.

        fd: an open file descriptor; offs, lens, dst_offs: int64[n] (bytes); dst: uint8[:], contiguous, large
        enough (the caller's contract). Returns -1 when every span was read in full, else the first ``j``
        whose read came up short (end of file: the file shrank) or failed; the caller re-reads that span with
        ``Dataset.read_into``, which finishes it or raises TruncatedFileError naming the byte range.
        """
        base = np.int64(dst.ctypes.data)
        for j in range(lens.shape[0]):
            done = np.int64(0)
            n = lens[j]
            while done < n:
                r = _pread(fd, base + dst_offs[j] + done, n - done, offs[j] + done)
                if r <= 0:
                    return j
                done += r
        return -1

    @numba.njit(nogil=True)
    def pread_spans_fds(fds, offs, lens, dst, dst_offs):
        """:func:`pread_spans` with a descriptor per span: span ``j`` is read from ``fds[j]`` (int64[n]; the files
        of a many-file set, each span within one member). Returns -1 when every span was read in full, else the
        first short or failed ``j`` (the caller finishes it or raises TruncatedFileError naming that member)."""
        base = np.int64(dst.ctypes.data)
        for j in range(lens.shape[0]):
            done = np.int64(0)
            n = lens[j]
            while done < n:
                r = _pread(np.int32(fds[j]), base + dst_offs[j] + done, n - done, offs[j] + done)
                if r <= 0:
                    return j
                done += r
        return -1

    @numba.njit(nogil=True)
    def pread_full(fd, dst, off):
        """Fill ``dst`` (a contiguous array, any dtype) with the file's bytes from byte ``off``; True when every
        byte was read, False when a read came up short (end of file) or failed (the caller then reads the span
        with ``Dataset.read_into``, which finishes it or raises TruncatedFileError). Called from other kernels."""
        n = np.int64(dst.size * dst.itemsize)
        base = np.int64(dst.ctypes.data)
        done = np.int64(0)
        while done < n:
            r = _pread(fd, base + done, n - done, off + done)
            if r <= 0:
                return False
            done += r
        return True


@numba.njit(nogil=True)
def copy_spans(src, src_starts, lens, dst, dst_starts):
    """``dst[dst_starts[j] : +lens[j]] = src[src_starts[j] : +lens[j]]`` for every ``j`` with ``src_starts[j] >= 0``.

    src, dst: uint8[:] (distinct buffers); src_starts, lens, dst_starts: int64[n] byte offsets and lengths
    (a negative ``src_starts[j]`` skips record ``j``: the caller reads it some other way). Bounds are the
    caller's contract (the page sources compute them from a validated index); nothing is allocated.
    """
    for j in range(lens.shape[0]):
        if src_starts[j] < 0:
            continue
        # unsigned indices: no negative-index wrap-around branch, so LLVM vectorises the copy (~10x faster)
        s, d = np.uint64(src_starts[j]), np.uint64(dst_starts[j])
        for i in range(np.uint64(lens[j])):
            dst[d + i] = src[s + i]


@functools.cache
def prepare() -> None:
    """Enable the on-disk cache of this module's kernels (run time, never at import; idempotent)."""
    kernel_cache.enable(sys.modules[__name__])
