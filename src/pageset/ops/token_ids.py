"""A batch of variable-length token-id records (a ``TokenIds`` field: captions) padded or truncated to one length.

:func:`pad_rows` is one nogil kernel call per slice: each record's stored little-endian ids are widened into a
row of ``input_ids`` (int64) and its ``attention_mask`` (1 on ids, 0 on padding), as a Hugging Face tokenizer
returns them with ``padding="max_length", truncation=True, max_length=L``. With ``keep_last`` a truncated
record keeps its own last id in the last column (the end-of-text token a CLIP tokenizer always ends with:
``open_clip``'s ``tokenize`` and ``CLIPTokenizer`` with truncation both do so).
"""

from __future__ import annotations

import functools
import sys

import numba
import numpy as np

from pageset.ops import kernel_cache


@numba.njit(nogil=True)
def pad_rows(buf, offs, counts, itemsize, out_ids, out_mask, pad_id, keep_last, truncate):
    """Fill ``out_ids[j]`` / ``out_mask[j]`` (int64[n, L]) from record ``j``: ``counts[j]`` ids of ``itemsize``
    bytes (2 or 4, little-endian) at ``buf[offs[j]:]`` (uint8; offs, counts int64[n]). A record longer than L
    keeps its first L ids, or its first L - 1 and its last with ``keep_last``; with ``truncate`` False nothing
    is cut and the first such ``j`` is returned (the caller raises, naming the sample). Returns -1 otherwise."""
    n, width = out_ids.shape
    for j in range(n):
        c = counts[j]
        if c > width and not truncate:
            return j
        take = min(c, width)
        base = offs[j]
        for t in range(take):
            src = t
            if keep_last and c > width and t == width - 1:
                src = c - 1
            p = base + src * itemsize
            v = np.int64(buf[p]) | (np.int64(buf[p + 1]) << 8)
            if itemsize == 4:
                v |= (np.int64(buf[p + 2]) << 16) | (np.int64(buf[p + 3]) << 24)
            out_ids[j, t] = v
            out_mask[j, t] = 1
        for t in range(take, width):
            out_ids[j, t] = pad_id
            out_mask[j, t] = 0
    return -1


@functools.cache
def prepare() -> None:
    """Enable the on-disk cache of this module's kernel (run time, never at import; idempotent)."""
    kernel_cache.enable(sys.modules[__name__])
