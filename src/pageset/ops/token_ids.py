"""A batch of variable-length token-id records (a ``TokenIds`` field: captions) padded or truncated to one length.

:func:`pad_rows` is one nogil kernel call per slice: each record's stored little-endian ids are widened into a
row of ``input_ids`` (int64) and its ``attention_mask`` (1 on ids, 0 on padding), as a Hugging Face tokenizer
returns them with ``padding="max_length", truncation=True, max_length=L``. With ``keep_last`` a truncated
record keeps its own last id in the last column (the end-of-text token a CLIP tokenizer always ends with:
``open_clip``'s ``tokenize`` and ``CLIPTokenizer`` with truncation both do so).

:func:`expand_rows` is the vision-language variant: each image placeholder id becomes the image's tokens (as
transformers' LLaVA processor expands ``<image>``), and ``labels`` follow a stored loss mask.
"""

from __future__ import annotations

import functools
import sys

import numba
import numpy as np

from pageset.ops import kernel_cache


@numba.njit(nogil=True)
def _id(buf, p, itemsize):
    """The little-endian id of ``itemsize`` bytes (2 or 4) at ``buf[p]``, as int64."""
    lo = np.int64(buf[p]) | (np.int64(buf[p + 1]) << 8)
    return lo if itemsize == 2 else lo | (np.int64(buf[p + 2]) << 16) | (np.int64(buf[p + 3]) << 24)


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
            out_ids[j, t] = _id(buf, base + src * itemsize, itemsize)
            out_mask[j, t] = 1
        for t in range(take, width):
            out_ids[j, t] = pad_id
            out_mask[j, t] = 0
    return -1


# What expand_rows reports for its first bad row (status[0]); status[1] holds the count it found.
TOO_LONG, IMAGE_COUNT, IMAGE_CUT = 1, 2, 3


@numba.njit(nogil=True)
def _tokens_of(image_tokens, k, per_image):
    """Tokens of the slice's image k: ``image_tokens[k]`` (dynamic resolution), or ``per_image`` when the array
    is empty (a fixed size) or k lies past it (a record with more placeholders than images: refused anyway)."""
    return image_tokens[k] if k < image_tokens.shape[0] else per_image


@numba.njit(nogil=True)
def _measure(buf, base, c, itemsize, image_id, per_image, image_tokens, k0):
    """``(images, expanded length, where the last image's tokens end or -1)`` of a record of ``c`` ids whose
    first image is the slice's image ``k0`` (see :func:`_tokens_of`)."""
    images = 0
    last = -1
    total = 0
    for t in range(c):
        if _id(buf, base + t * itemsize, itemsize) == image_id:
            total += _tokens_of(image_tokens, k0 + images, per_image)
            images += 1
            last = total
        else:
            total += 1
    return images, total, last


@numba.njit(nogil=True)
def _write(buf, base, c, itemsize, has_mask, image_id, per_image, image_tokens, k0, ids, mask, labels, col, end):
    """Write a record's expanded tokens into the row arrays ``ids``/``mask``/``labels`` (int64[L]) from column
    ``col`` up to (not including) ``end``; returns the column after the last one written."""
    mbase = base + c * itemsize
    pos = col
    k = k0
    for t in range(c):
        if pos >= end:
            break
        v = _id(buf, base + t * itemsize, itemsize)
        if v == image_id:
            n = _tokens_of(image_tokens, k, per_image)
            k += 1
            for _ in range(n):
                ids[pos] = v
                mask[pos] = 1
                labels[pos] = -100
                pos += 1
        else:
            ids[pos] = v
            mask[pos] = 1
            labels[pos] = v if (not has_mask or buf[mbase + t] != 0) else -100
            pos += 1
    return pos


@numba.njit(nogil=True)
def _check(buf, base, c, itemsize, image_id, per_image, image_tokens, k0, expected, room, truncate, status):
    """0 when the record fits ``room`` columns (cut after its last image when ``truncate``), else the status
    code (TOO_LONG / IMAGE_COUNT / IMAGE_CUT, with status[1] set); also returns the expanded length."""
    images, total, last = _measure(buf, base, c, itemsize, image_id, per_image, image_tokens, k0)
    if expected >= 0 and images != expected:
        status[0], status[1] = IMAGE_COUNT, images
        return IMAGE_COUNT, total
    if total > room and not truncate:
        status[0], status[1] = TOO_LONG, total
        return TOO_LONG, total
    if last > room:
        status[0], status[1] = IMAGE_CUT, total
        return IMAGE_CUT, total
    return 0, total


@numba.njit(nogil=True)
def expand_rows(buf, offs, counts, itemsize, has_mask, image_id, per_image, image_tokens, starts, expected, out_ids,
                out_mask, out_labels, pad_id, truncate, status):
    """Fill row j of ``out_ids`` / ``out_mask`` / ``out_labels`` (int64[n, L]) from record j (``counts[j]`` ids at
    ``buf[offs[j]:]``, then with ``has_mask`` one loss-mask byte per id), each ``image_id`` repeated
    ``per_image`` times, or, with a non-empty ``image_tokens`` (int64: tokens of each image of the slice, record
    after record; ``starts`` int64[n]: record j's first image in it), ``image_tokens[starts[j] + k]`` times for
    its k-th placeholder (dynamic resolution). labels: the id where the mask is 1, -100 on image tokens, padding and mask 0.
    ``expected`` int64[n]: the record's image count (-1: unchecked). A row longer than L keeps its first L
    tokens when ``truncate`` and no image token is cut. Returns -1, or the first bad j with status[0] =
    TOO_LONG / IMAGE_COUNT / IMAGE_CUT and status[1] = the expanded length or the placeholders found."""
    n, width = out_ids.shape
    for j in range(n):
        c, base = counts[j], offs[j]
        code, _ = _check(buf, base, c, itemsize, image_id, per_image, image_tokens, starts[j], expected[j], width,
                         truncate, status)
        if code:
            return j
        pos = _write(buf, base, c, itemsize, has_mask, image_id, per_image, image_tokens, starts[j], out_ids[j],
                     out_mask[j], out_labels[j], 0, width)
        for t in range(pos, width):
            out_ids[j, t] = pad_id
            out_mask[j, t] = 0
            out_labels[j, t] = -100
    return -1


@numba.njit(nogil=True)
def pack_rows(buf, offs, counts, itemsize, has_mask, image_id, per_image, image_tokens, starts, expected, row_counts,
              out_ids, out_mask, out_labels, out_pos, pad_id, truncate, status):
    """Packed rows (formats/packing.md section 8): output row r holds the next ``row_counts[r]`` records (int64[n]
    records in all, row after row; each as in :func:`expand_rows`) back to back from column 0. A record's first
    column has label -100 (no record predicts another's first token) and ``out_pos`` (int64[n, L]) counts 0, 1,
    ... within each record (``image_tokens``/``starts`` as in :func:`expand_rows`); padding columns after the last record: ``pad_id``, mask 0, label -100, position
    ids counting from 0. Returns -1, or the first bad record (index into ``offs``) with ``status`` set as by
    :func:`expand_rows` (a record longer than the row's remaining columns: TOO_LONG unless ``truncate``)."""
    width = out_ids.shape[1]
    j = 0
    for r in range(row_counts.shape[0]):
        col = 0
        for _ in range(row_counts[r]):
            c, base = counts[j], offs[j]
            code, total = _check(buf, base, c, itemsize, image_id, per_image, image_tokens, starts[j], expected[j],
                                 width - col, truncate, status)
            if code:
                return j
            start = col
            col = _write(buf, base, c, itemsize, has_mask, image_id, per_image, image_tokens, starts[j], out_ids[r],
                         out_mask[r], out_labels[r], col, min(col + total, width))
            out_labels[r, start] = -100
            for t in range(start, col):
                out_pos[r, t] = t - start
            j += 1
        for t in range(col, width):
            out_ids[r, t] = pad_id
            out_mask[r, t] = 0
            out_labels[r, t] = -100
            out_pos[r, t] = t - col
    return -1


@functools.cache
def prepare() -> None:
    """Enable the on-disk cache of this module's kernel (run time, never at import; idempotent)."""
    kernel_cache.enable(sys.modules[__name__])
