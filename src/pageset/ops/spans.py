"""Byte-span copies for the loader's page sources: many records out of one buffer in one nogil call.

A batch's records (JPEGs, token windows, arrays) sit at scattered offsets of a page cache's arena; copying
them one numpy slice at a time costs ~1 us of Python per record, which for a batch of 32 token windows of
4 KiB is more than the copy itself (~0.3 us each). :func:`copy_spans` does the whole batch in one call and
releases the GIL while it runs.
"""

from __future__ import annotations

import functools

import numba


@numba.njit(nogil=True)
def copy_spans(src, src_starts, lens, dst, dst_starts):
    """``dst[dst_starts[j] : +lens[j]] = src[src_starts[j] : +lens[j]]`` for every ``j`` with ``src_starts[j] >= 0``.

    src, dst: uint8[:] (distinct buffers); src_starts, lens, dst_starts: int64[n] byte offsets and lengths
    (a negative ``src_starts[j]`` skips record ``j``: the caller reads it some other way). Bounds are the
    caller's contract (the page sources compute them from a validated index); nothing is allocated.
    """
    for j in range(lens.shape[0]):
        s = src_starts[j]
        if s < 0:
            continue
        d = dst_starts[j]
        for i in range(lens[j]):
            dst[d + i] = src[s + i]


@functools.cache
def prepare() -> None:
    """Enable the on-disk cache of this module's kernels (run time, never at import; idempotent)."""
    if not numba.config.DISABLE_JIT:
        try:
            copy_spans.enable_caching()
        except RuntimeError:  # no writable cache location: compile in each process
            pass
