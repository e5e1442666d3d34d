"""The images of image-list records (an ``RGBImages`` field: a conversation's images) laid out for the image kernels.

A stored image list (formats/v1.md section 5) is a u32 image count, one 16-byte entry per image (height, width,
byte length: <u4; encoding: u1; 3 zero bytes), then the images' bytes. :func:`entries` turns a slice's gathered
records into one row per image (where its bytes are, its size and encoding, and which output row it fills), so
that every image of a batch goes through ``image_batch.image_slice`` in one call; :func:`image_keys` gives image k
of a sample its own augmentation key (image 0 keeps the sample's key, so a one-image record crops as an
``RGBImage`` record does).
"""

from __future__ import annotations

import functools
import sys

import numba
import numpy as np

from pageset.ops import kernel_cache
from pageset.order.keys import GOLDEN, splitmix64

ENTRY_BYTES = 16


@numba.njit(nogil=True)
def _u32(buf, p):
    return (np.int64(buf[p]) | (np.int64(buf[p + 1]) << 8) | (np.int64(buf[p + 2]) << 16)
            | (np.int64(buf[p + 3]) << 24))


@numba.njit(nogil=True)
def entries(buf, offs, lens, counts, first, img_offs, img_lens, heights, widths, encodings, rows):
    """One row per image of a slice: record j's value is ``buf[offs[j]:][:lens[j]]`` (uint8; offs, lens int64[n])
    holding ``counts[j]`` images (int64[n], from the index); image k of record j fills output row
    ``first[j] + k`` (int64[n]; a record a sample: ``j * width``). Writes img_offs, img_lens (int64: the image's bytes in ``buf``), heights, widths (int64
    pixels), encodings (uint8) and rows (int64), each of ``counts.sum()`` entries in record order. Returns -1, or
    the first j whose stored count or byte lengths disagree with its index entry (a damaged page)."""
    i = 0
    for j in range(offs.shape[0]):
        base, c = offs[j], counts[j]
        head = 4 + ENTRY_BYTES * c
        if lens[j] < head or _u32(buf, base) != c:
            return j
        at = base + head
        for k in range(c):
            e = base + 4 + ENTRY_BYTES * k
            length = _u32(buf, e + 8)
            heights[i] = _u32(buf, e)
            widths[i] = _u32(buf, e + 4)
            encodings[i] = buf[e + 12]
            img_offs[i] = at
            img_lens[i] = length
            rows[i] = first[j] + k
            at += length
            i += 1
        if at != base + lens[j]:
            return j
    return -1


@numba.njit(nogil=True)
def _image_keys(keys, counts, out):
    i = 0
    for j in range(keys.shape[0]):
        for k in range(counts[j]):
            out[i] = keys[j] if k == 0 else splitmix64(keys[j] ^ (numba.uint64(k) * numba.uint64(GOLDEN)))
            i += 1


def image_keys(keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """uint64[counts.sum()]: image k of sample j gets ``keys[j]`` for k = 0, else ``splitmix64(keys[j] ^ k *
    GOLDEN)`` (order/keys.py), in the order :func:`entries` lists the images."""
    out = np.empty(int(counts.sum()), dtype=np.uint64)
    _image_keys(keys, counts, out)
    return out


@numba.njit(nogil=True)
def sizes(buf, offs, counts, heights, widths):
    """The stored size of every image of a slice from the records' heads only: record j's image list starts at
    ``buf[offs[j]]`` (its count and entries, ``4 + 16 * counts[j]`` bytes, are enough). Writes heights, widths
    (int64, ``counts.sum()`` entries in record order). Returns -1, or the first j whose stored count disagrees
    with its index entry (a damaged page)."""
    i = 0
    for j in range(offs.shape[0]):
        base, c = offs[j], counts[j]
        if _u32(buf, base) != c:
            return j
        for k in range(c):
            e = base + 4 + ENTRY_BYTES * k
            heights[i] = _u32(buf, e)
            widths[i] = _u32(buf, e + 4)
            i += 1
    return -1


@functools.cache
def prepare() -> None:
    """Enable the on-disk cache of this module's kernels (run time, never at import; idempotent)."""
    kernel_cache.enable(sys.modules[__name__])
