"""Crop-only JPEG decoding through restart intervals: which entropy-coded bytes a region needs, as a sub-JPEG.

A baseline JPEG with a restart interval (a DRI segment, ``Ri`` MCUs) codes its scan as independent intervals
separated by RSTn markers: the DC predictors restart at each one (ITU-T T.81, B.2.4.4 and F.2.1.3.1). When ``Ri``
divides the MCUs of a row (or is a whole number of rows), the intervals form a grid of MCU rectangles, and the
intervals that cover a region, with their markers renumbered, are themselves a valid JPEG of that rectangle once
the frame header (SOF) carries its size. libjpeg-turbo then entropy-decodes only those bytes, instead of every
row above the region and the full width of every row in it.

- :func:`read_header` reads the markers up to the scan (the MCU grid, the restart interval); :func:`find_intervals`
  finds where every interval's coded data starts.
- :func:`sub_image` picks the interval rectangle that covers a region of the (scaled) image plus a few pixels of
  context on every side (libjpeg's fancy chroma upsampling reads the neighbouring chroma samples; with the
  margin, every wanted pixel is the full decode's bit for bit) and assembles it.

Only single-scan baseline or extended Huffman files (SOF0/SOF1, 8-bit) qualify; progressive, arithmetic-coded,
lossless, multi-scan and DNL files, and files without a restart interval, are decoded as before. A restart
interval whose markers are not where the header says (a marker missing, extra or out of sequence) is
``ERR_RESTART``: decoding the rectangle would put intervals in the wrong place.

All ``@numba.njit(nogil=True)``; no library call. Used by :func:`pageset.ops.jpeg_kernels.jpeg_decode` and
``jpeg_decode_window``.
"""

from __future__ import annotations

import numba
import numpy as np

# layout: int64[LAYOUT_SIZE], filled by read_header and find_intervals
L_WIDTH, L_HEIGHT, L_MCU_W, L_MCU_H, L_MCUS_PER_ROW, L_MCU_ROWS = 0, 1, 2, 3, 4, 5
L_INTERVAL, L_SOF, L_SCAN, L_END, L_COUNT = 6, 7, 8, 9, 10
LAYOUT_SIZE = 11

NO_RESTART = 0  # no restart interval, or a kind of file this module does not cut: decode as before
USABLE = 1
DAMAGED = -1  # a restart interval whose markers do not match it


@numba.njit(nogil=True)
def _u16(data, i):
    return (np.int64(data[i]) << 8) | np.int64(data[i + 1])


@numba.njit(nogil=True)
def read_header(data, layout):
    """Parse the markers of ``data`` (uint8[:], a whole JPEG file) up to the scan, for crop-only decoding.

    layout: int64[LAYOUT_SIZE], written with the image size, MCU size in pixels, MCUs per row, MCU rows, restart
    interval (MCUs), the offset of the SOF segment, the first byte of entropy-coded data and the number of
    intervals (``L_COUNT``). Returns USABLE or NO_RESTART (decode the file as before).
    """
    n = data.size
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return NO_RESTART
    i = 2
    sof = -1
    interval = 0
    hmax = 1
    vmax = 1
    ncomp = 0
    width = 0
    height = 0
    scan = -1
    while i + 3 < n:
        if data[i] != 0xFF:
            return NO_RESTART  # junk between segments: libjpeg copes; we do not cut such files
        marker = data[i + 1]
        if marker == 0xFF:
            i += 1  # fill byte
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:
            return NO_RESTART  # a parameterless marker in the header: unusual, leave it to libjpeg
        if marker == 0xD9:
            return NO_RESTART
        seg = _u16(data, i + 2)
        if seg < 2 or i + 2 + seg > n:
            return NO_RESTART
        if marker == 0xC0 or marker == 0xC1:
            if sof >= 0 or seg < 8 or data[i + 4] != 8:
                return NO_RESTART
            sof = i
            height = _u16(data, i + 5)
            width = _u16(data, i + 7)
            ncomp = np.int64(data[i + 9])
            if ncomp < 1 or seg != 8 + 3 * ncomp or height == 0 or width == 0:
                return NO_RESTART  # height 0: a DNL marker defines it later
            for c in range(ncomp):
                hv = data[i + 11 + 3 * c]
                hmax = max(hmax, np.int64(hv >> 4))
                vmax = max(vmax, np.int64(hv & 15))
        elif 0xC2 <= marker <= 0xCF and marker != 0xC4 and marker != 0xC8 and marker != 0xCC:
            return NO_RESTART  # progressive, lossless, hierarchical or arithmetic-coded
        elif marker == 0xCC:
            return NO_RESTART  # arithmetic conditioning
        elif marker == 0xDD:
            if seg != 4:
                return NO_RESTART
            interval = _u16(data, i + 4)
        elif marker == 0xDA:
            if sof < 0 or np.int64(data[i + 4]) != ncomp:
                return NO_RESTART  # not one interleaved scan of every component
            scan = i + 2 + seg
            break
        i += 2 + seg
    if scan < 0 or interval == 0:
        return NO_RESTART
    if ncomp == 1:
        mcu_w = 8
        mcu_h = 8
    else:
        mcu_w = 8 * hmax
        mcu_h = 8 * vmax
    per_row = (width + mcu_w - 1) // mcu_w
    rows = (height + mcu_h - 1) // mcu_h
    if per_row % interval != 0 and interval % per_row != 0:
        return NO_RESTART  # intervals that do not tile the MCU grid into rectangles
    layout[L_WIDTH] = width
    layout[L_HEIGHT] = height
    layout[L_MCU_W] = mcu_w
    layout[L_MCU_H] = mcu_h
    layout[L_MCUS_PER_ROW] = per_row
    layout[L_MCU_ROWS] = rows
    layout[L_INTERVAL] = interval
    layout[L_SOF] = sof
    layout[L_SCAN] = scan
    layout[L_COUNT] = (per_row * rows + interval - 1) // interval
    return USABLE


# Margin kept around a region, in pixels of the scaled image. libjpeg's fancy upsampling (h2v1, h2v2: a triangle
# filter over the nearest chroma samples, jdsample.c) makes a pixel depend on the chroma samples next to its own,
# so the first and last 2 pixels next to a cut differ from the full decode (the cut is taken as the image edge);
# 4 is that with room to spare. Replicating upsamplers (4:1:1) and IDCT-scaled chroma need none.
CONTEXT = 4

_ONES = np.uint64(0x0101010101010101)
_HIGHS = np.uint64(0x8080808080808080)


@numba.njit(nogil=True)
def _next_ff(data, words, base, j):
    # the first index >= j holding 0xFF (data.size if none). ``words`` is ``data[base:]`` viewed as aligned uint64
    # (base = the first 8-byte-aligned index): a word w holds a 0xFF byte when ~w has a zero byte, i.e.
    # (v - 0x01..01) & ~v & 0x80..80 != 0 (Hacker's Delight, 6-1). About 1% of coded bytes are 0xFF (stuffed
    # 0xFF00 and the markers), so most words are skipped whole.
    n = data.size
    while j < n and (j < base or (j - base) & 7 != 0):
        if data[j] == 0xFF:
            return j
        j += 1
    w = (j - base) >> 3
    while w < words.size:
        v = ~words[w]
        if ((v - _ONES) & ~v & _HIGHS) != 0:
            break
        w += 1
    j = max(j, base + 8 * w)
    while j < n and data[j] != 0xFF:
        j += 1
    return j


@numba.njit(nogil=True)
def find_intervals(data, layout, starts):
    """After :func:`read_header`: write where each interval's coded data begins into ``starts`` (int64[>= count])
    and the offset of the marker that ends the scan into ``layout[L_END]``. Returns USABLE, or DAMAGED when the
    RSTn markers are missing, extra or out of order (0xFF then 0xD0 + k % 8 after interval k)."""
    n = data.size
    scan = layout[L_SCAN]
    count = layout[L_COUNT]
    # find the RSTn markers: 0xFF then 0xD0 + (k % 8); 0xFF00 is a stuffed byte, 0xFFFF a fill byte
    k = 0
    starts[0] = scan
    j = scan
    end = n
    base = min(-data.ctypes.data & 7, n)
    words = data[base:base + (n - base) // 8 * 8].view(np.uint64)
    while j + 1 < n:
        j = _next_ff(data, words, base, j)
        if j + 1 >= n:
            break
        m = data[j + 1]
        if m == 0x00 or m == 0xFF:
            j += 1
            continue
        if 0xD0 <= m <= 0xD7:
            if m != 0xD0 + (k & 7) or k + 1 >= count:
                return DAMAGED
            k += 1
            starts[k] = j + 2
            j += 2
            continue
        end = j  # EOI or another marker: the scan ends
        break
    if k + 1 != count:
        return DAMAGED
    layout[L_END] = end
    return USABLE


@numba.njit(nogil=True)
def _coded_end(data, starts, layout, k):
    # last byte (exclusive) of interval k's coded data: before the RSTn marker that follows it, or the scan's end
    if k + 1 < layout[L_COUNT]:
        return starts[k + 1] - 2
    return layout[L_END]


@numba.njit(nogil=True)
def sub_rectangle(layout, num, denom, x, y, w, h):
    """The interval rectangle covering region ``[x, x+w) x [y, y+h)`` of the image scaled by num/denom, widened by
    :data:`CONTEXT` pixels on each side: ``(col0, col1, row0, row1)`` in MCUs (columns as multiples of the interval when
    it is shorter than a row; rows as multiples of the rows an interval spans when it is longer)."""
    mcu_w = layout[L_MCU_W]
    mcu_h = layout[L_MCU_H]
    per_row = layout[L_MCUS_PER_ROW]
    rows = layout[L_MCU_ROWS]
    interval = layout[L_INTERVAL]
    sw = (layout[L_WIDTH] * num + denom - 1) // denom
    sh = (layout[L_HEIGHT] * num + denom - 1) // denom
    # CONTEXT scaled pixels of margin, in original pixels (floor at the start, ceil at the end)
    ux0 = max(x - CONTEXT, 0) * denom // num
    uy0 = max(y - CONTEXT, 0) * denom // num
    ux1 = (min(x + w + CONTEXT, sw) * denom + num - 1) // num
    uy1 = (min(y + h + CONTEXT, sh) * denom + num - 1) // num
    c0 = ux0 // mcu_w
    c1 = min((ux1 + mcu_w - 1) // mcu_w, per_row)
    r0 = uy0 // mcu_h
    r1 = min((uy1 + mcu_h - 1) // mcu_h, rows)
    if interval <= per_row:
        c0 = c0 // interval * interval
        c1 = min((c1 + interval - 1) // interval * interval, per_row)
    else:
        c0 = 0
        c1 = per_row
        group = interval // per_row
        r0 = r0 // group * group
        r1 = min((r1 + group - 1) // group * group, rows)
    return c0, c1, r0, r1


@numba.njit(nogil=True)
def _append_interval(data, layout, starts, k, seq, out, p):
    # interval k's coded bytes at out[p:], after RST((seq - 1) % 8) unless it is the first; returns the new end
    if seq > 0:
        out[p] = 0xFF
        out[p + 1] = 0xD0 + ((seq - 1) & 7)
        p += 2
    a = starts[k]
    b = _coded_end(data, starts, layout, k)
    out[p:p + b - a] = data[a:b]
    return p + b - a


@numba.njit(nogil=True)
def assemble(data, layout, starts, c0, c1, r0, r1, out):
    """Write the JPEG of MCU columns ``[c0, c1)`` and rows ``[r0, r1)`` (from :func:`sub_rectangle`) into ``out``
    (uint8[:], at least ``data.size + 16`` bytes); returns its length in bytes. The header is the file's own with
    the SOF size replaced; the intervals are copied in order with their RSTn markers renumbered from 0."""
    mcu_w = layout[L_MCU_W]
    mcu_h = layout[L_MCU_H]
    per_row = layout[L_MCUS_PER_ROW]
    interval = layout[L_INTERVAL]
    scan = layout[L_SCAN]
    sub_w = min(c1 * mcu_w, layout[L_WIDTH]) - c0 * mcu_w
    sub_h = min(r1 * mcu_h, layout[L_HEIGHT]) - r0 * mcu_h
    out[:scan] = data[:scan]
    sof = layout[L_SOF]
    out[sof + 5] = (sub_h >> 8) & 0xFF
    out[sof + 6] = sub_h & 0xFF
    out[sof + 7] = (sub_w >> 8) & 0xFF
    out[sof + 8] = sub_w & 0xFF
    p = scan
    seq = 0
    if interval <= per_row:
        per = per_row // interval
        for r in range(r0, r1):
            for c in range(c0 // interval, c1 // interval):
                p = _append_interval(data, layout, starts, r * per + c, seq, out, p)
                seq += 1
    else:
        group = interval // per_row
        for k in range(r0 // group, (r1 + group - 1) // group):
            p = _append_interval(data, layout, starts, k, seq, out, p)
            seq += 1
    out[p] = 0xFF
    out[p + 1] = 0xD9
    return p + 2


@numba.njit(nogil=True)
def sub_image(data, num, denom, x, y, w, h):
    """The sub-JPEG that decodes region ``[x, x+w) x [y, y+h)`` of the image scaled by num/denom.

    Returns ``(status, sub, dx, dy)``: status USABLE with ``sub`` (uint8[:], a new array holding the JPEG of the
    covering interval rectangle) and ``(dx, dy)``, where that rectangle starts in scaled pixels (decode region
    ``(x - dx, y - dy, w, h)`` of ``sub``); NO_RESTART (no usable restart interval, a region outside the image, or
    a rectangle that is the whole image: decode ``data`` as before; ``sub`` is empty); DAMAGED (restart markers do
    not match the header). num/denom must be a supported scale (``jpeg_scale.SCALES``).
    """
    layout = np.zeros(LAYOUT_SIZE, np.int64)
    empty = np.empty(0, np.uint8)
    if read_header(data, layout) != USABLE:
        return NO_RESTART, empty, 0, 0
    sw = (layout[L_WIDTH] * num + denom - 1) // denom
    sh = (layout[L_HEIGHT] * num + denom - 1) // denom
    if x < 0 or y < 0 or w <= 0 or h <= 0 or x + w > sw or y + h > sh:
        return NO_RESTART, empty, 0, 0  # the decoder reports the bad region
    starts = np.empty(layout[L_COUNT], np.int64)
    if find_intervals(data, layout, starts) != USABLE:
        return DAMAGED, empty, 0, 0  # checked for every crop, the whole image too: never misplaced pixels
    c0, c1, r0, r1 = sub_rectangle(layout, num, denom, x, y, w, h)
    if c0 == 0 and r0 == 0 and c1 == layout[L_MCUS_PER_ROW] and r1 == layout[L_MCU_ROWS]:
        return NO_RESTART, empty, 0, 0
    out = np.empty(data.size + 16, np.uint8)
    size = assemble(data, layout, starts, c0, c1, r0, r1, out)
    return USABLE, out[:size], c0 * layout[L_MCU_W] * num // denom, r0 * layout[L_MCU_H] * num // denom
