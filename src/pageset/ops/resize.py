"""The fused resize -> flip -> normalize kernel: Pillow's BILINEAR resample of a box, bit for bit.

:func:`resize_crop_flip_normalize` is Pillow's ``Image.resize(size, Image.BILINEAR, box=...)``
(``ImagingResample`` in Pillow's ``src/libImaging/Resample.c``: a separable triangle filter whose support
grows with the reduction factor -- antialiased when shrinking, plain bilinear when enlarging -- in 22-bit
fixed point, the first pass rounded to uint8), then ``RandomHorizontalFlip``, then ``ToTensor`` +
``Normalize`` in float32. The uint8 result equals Pillow 13's exactly (the tests compare every pixel), so
float32 outputs equal torchvision's tensors exactly too.

The per-sample path allocates nothing: the output goes into ``out`` and every temporary (filter weights, a
few resampled rows) into a caller-provided int32 ``scratch`` sized once by :func:`resize_scratch_size`.
Values are mapped through a [3, 256] table built once per Loader (``image.normalize_table``,
``image.pixel_table``), which is how one kernel serves every output dtype.
"""

from __future__ import annotations

import numba
import numpy as np
from numpy.lib.stride_tricks import as_strided

from pageset.ops.resize_weights import _HALF, _clip8, _coeffs, _mac, resize_taps

# Stages of the kernel, as bits of _resize's ``stages`` (benchmarks/images.py times them by difference).
STAGE_HORIZONTAL = 1  # horizontal pass (with the flip: mirrored columns)
STAGE_VERTICAL = 2  # vertical pass
STAGE_STORE = 4  # round, map through the value table, write the output row
ALL_STAGES = STAGE_HORIZONTAL | STAGE_VERTICAL | STAGE_STORE


@numba.njit(nogil=True)
def _vertical_first(src_h, src_w, out_h, out_w):
    """Pillow >= 13's pass order (python-pillow/Pillow#9549): vertical pass first when the IMAGE (not the
    box) is shrunk in height, by more than twice as many pixels as in width (a width that grows counts as a
    negative shrink: an image narrower than the output but taller is resized vertically first); horizontal
    first otherwise (found by comparing both orders with Pillow 13 on some 10,000 random image, box and output
    sizes; tests/test_image_ops.py checks the kernel against Pillow in each regime).

    The order matters because each pass rounds to uint8 (Pillow < 13 always went horizontal first; the
    two orders differ by at most 1 in a few pixels)."""
    return src_h > out_h and (src_h - out_h) > (src_w - out_w) * 2


@numba.njit(nogil=True)
def _scratch_offsets(out_h, out_w, taps_x, taps_y, rows_len):
    """int32 offsets into scratch: x bounds, y bounds, x weights, y weights, output row, row buffer, end."""
    xb = 0
    yb = xb + 2 * out_w
    xk = yb + 2 * out_h
    yk = xk + out_w * taps_x
    acc = yk + out_h * taps_y
    rows = acc + 3 * out_w
    return xb, yb, xk, yk, acc, rows, rows + rows_len


@numba.njit(nogil=True)
def _rows_len(src_h, src_w, out_h, out_w, taps_y):
    """int32 elements of the row buffer: a ring of ``taps_y + 1`` horizontally resampled rows (horizontal
    pass first), or one source-wide vertically resampled row (vertical first)."""
    if _vertical_first(src_h, src_w, out_h, out_w):
        return 3 * src_w
    return (taps_y + 1) * 3 * out_w


@numba.njit(nogil=True)
def resize_scratch_size(src_h, src_w, out_h, out_w):
    """int32 elements of ``scratch`` that suffice for ANY box inside a ``src_h`` x ``src_w`` source.

    Layout (int32): x bounds ``2*out_w`` | y bounds ``2*out_h`` | x weights ``out_w*Tx`` | y weights
    ``out_h*Ty`` | output row ``3*out_w`` | row buffer ``max((Ty+1)*3*out_w, 3*src_w)`` (a ring of
    horizontally resampled rows, or one vertically resampled source row when Pillow's order is vertical
    first), with ``Tx = resize_taps(src_w, out_w)``, ``Ty = resize_taps(src_h, out_h)``. Magnitudes for a
    224x224 output: 500x375 source 8.3 K elements (32 KiB), 12000x9000 source 101 K (395 KiB), a 1x70000
    sliver 353 K. Size it once per worker from the largest image the dataset holds (height and width);
    every box of a source no larger than that, e.g. a crop view, then fits.
    """
    taps_x = resize_taps(float(src_w), out_w)
    taps_y = resize_taps(float(src_h), out_h)
    rows_len = max((taps_y + 1) * 3 * out_w, 3 * src_w)
    return _scratch_offsets(out_h, out_w, taps_x, taps_y, rows_len)[6]


# ---------------------------------------------------------------------------------------------------------
# The passes (Pillow's ImagingResampleHorizontal_8bpc / ImagingResampleVertical_8bpc, one row at a time)
# ---------------------------------------------------------------------------------------------------------


@numba.njit(nogil=True)
def _pad_taps(bounds, weights, taps, out_size, in_size):
    """Give every output pixel the same tap count (the largest n), for a branch-free, unrollable tap loop.

    A pixel with fewer taps gets zero weights, its window moved left where it would pass the image's right
    edge (``start = min(xmin, in_size - nmax)``), so every read stays inside the row; adding ``0 * pixel``
    leaves each sum, hence the result, bit-identical. Rewrites ``bounds``/``weights`` in place (layout of
    ``_coeffs``) and returns the common count, or 0 (nothing changed) when the image is narrower than it.
    """
    nmax = 0
    for xx in range(out_size):
        nmax = max(nmax, bounds[2 * xx + 1])
    if nmax > in_size:
        return 0
    for xx in range(out_size):
        xmin = bounds[2 * xx]
        n = bounds[2 * xx + 1]
        shift = xmin - min(xmin, in_size - nmax)
        if shift == 0 and n == nmax:
            continue
        base = xx * taps
        for t in range(nmax - 1, -1, -1):  # move right by shift, from the end: no weight is overwritten early
            s = t - shift
            weights[base + t] = weights[base + s] if 0 <= s < n else 0
        bounds[2 * xx] = xmin - shift
        bounds[2 * xx + 1] = nmax
    return nmax


@numba.njit(nogil=True)
def _tap2(a, b, j, k, a0, a1, a2, b0, b1, b2):
    """One tap of weight k at byte j on two rows: six multiply-adds (RGB of row a and row b)."""
    return (_mac(a0, a[j], k), _mac(a1, a[j + 1], k), _mac(a2, a[j + 2], k),
            _mac(b0, b[j], k), _mac(b1, b[j + 1], k), _mac(b2, b[j + 2], k))


@numba.njit(nogil=True)
def _horizontal_src_rows(pixels, row, pair, out_w, taps, nfix, bounds, weights, flip, dst_a, dst_b):
    """Horizontal pass of source ``row`` (and ``row + 1`` when ``pair``) -> int32[3*out_w] rows, RGB
    interleaved, rounded to 0..255 like Pillow's temporary image, mirrored when ``flip`` (output pixel xx is
    written at ``out_w - 1 - xx``: the flip commutes with the vertical pass, and here it costs nothing).
    pixels: uint8[h, 3*w] source rows. nfix: the common tap count from :func:`_pad_taps` (0: per pixel).

    Two rows per sweep share the weight loads and loop control (~25% faster on 400 -> 224); with a common
    count of 2 to 5 taps the tap loop is unrolled (~20% faster again). The taps gather interleaved RGB, so
    the pass stays scalar (vectorizing across output pixels needs gathers: measured 1.6x slower)."""
    a = pixels[row]
    b = pixels[row + 1] if pair else pixels[row]
    for xx in range(out_w):
        j = 3 * bounds[2 * xx]
        base = xx * taps
        a0 = a1 = a2 = b0 = b1 = b2 = np.int32(_HALF)
        if nfix == 3:
            a0, a1, a2, b0, b1, b2 = _tap2(a, b, j, weights[base], a0, a1, a2, b0, b1, b2)
            a0, a1, a2, b0, b1, b2 = _tap2(a, b, j + 3, weights[base + 1], a0, a1, a2, b0, b1, b2)
            a0, a1, a2, b0, b1, b2 = _tap2(a, b, j + 6, weights[base + 2], a0, a1, a2, b0, b1, b2)
        elif nfix == 2:
            a0, a1, a2, b0, b1, b2 = _tap2(a, b, j, weights[base], a0, a1, a2, b0, b1, b2)
            a0, a1, a2, b0, b1, b2 = _tap2(a, b, j + 3, weights[base + 1], a0, a1, a2, b0, b1, b2)
        elif nfix == 4:
            a0, a1, a2, b0, b1, b2 = _tap2(a, b, j, weights[base], a0, a1, a2, b0, b1, b2)
            a0, a1, a2, b0, b1, b2 = _tap2(a, b, j + 3, weights[base + 1], a0, a1, a2, b0, b1, b2)
            a0, a1, a2, b0, b1, b2 = _tap2(a, b, j + 6, weights[base + 2], a0, a1, a2, b0, b1, b2)
            a0, a1, a2, b0, b1, b2 = _tap2(a, b, j + 9, weights[base + 3], a0, a1, a2, b0, b1, b2)
        elif nfix == 5:
            a0, a1, a2, b0, b1, b2 = _tap2(a, b, j, weights[base], a0, a1, a2, b0, b1, b2)
            a0, a1, a2, b0, b1, b2 = _tap2(a, b, j + 3, weights[base + 1], a0, a1, a2, b0, b1, b2)
            a0, a1, a2, b0, b1, b2 = _tap2(a, b, j + 6, weights[base + 2], a0, a1, a2, b0, b1, b2)
            a0, a1, a2, b0, b1, b2 = _tap2(a, b, j + 9, weights[base + 3], a0, a1, a2, b0, b1, b2)
            a0, a1, a2, b0, b1, b2 = _tap2(a, b, j + 12, weights[base + 4], a0, a1, a2, b0, b1, b2)
        else:
            for x in range(bounds[2 * xx + 1]):
                a0, a1, a2, b0, b1, b2 = _tap2(a, b, j, weights[base + x], a0, a1, a2, b0, b1, b2)
                j += 3
        o = 3 * (out_w - 1 - xx) if flip else 3 * xx
        dst_a[o] = _clip8(a0)
        dst_a[o + 1] = _clip8(a1)
        dst_a[o + 2] = _clip8(a2)
        if pair:
            dst_b[o] = _clip8(b0)
            dst_b[o + 1] = _clip8(b1)
            dst_b[o + 2] = _clip8(b2)


@numba.njit(nogil=True)
def _vertical_ring(ring, ring_rows, row_len, ymin, n, weights, acc):
    """Vertical pass over ring rows ymin..ymin+n-1 -> ``acc`` int32[row_len], fixed point (not rounded)."""
    for i in range(row_len):
        acc[i] = np.int32(_HALF)
    for t in range(n):
        start = ((ymin + t) % ring_rows) * row_len
        line = ring[start:start + row_len]
        k = weights[t]
        for i in range(row_len):
            acc[i] = _mac(acc[i], line[i], k)


@numba.njit(nogil=True)
def _vertical_src_rows(pixels, ymin, n, weights, x_lo, x_hi, dst):
    """Vertical pass of source rows ymin..ymin+n-1, columns [x_lo, x_hi) -> ``dst`` int32[3*(x_hi-x_lo)],
    rounded to 0..255 (Pillow's temporary image in the vertical-first order). pixels: uint8[h, 3*w]."""
    m3 = 3 * (x_hi - x_lo)
    for i in range(m3):
        dst[i] = np.int32(_HALF)
    for t in range(n):
        k = weights[t]
        line = pixels[ymin + t, 3 * x_lo:3 * x_hi]  # 1D: LLVM vectorizes this (6x the [x, c] form)
        for i in range(m3):
            dst[i] = _mac(dst[i], line[i], k)
    for i in range(m3):
        dst[i] = _clip8(dst[i])


@numba.njit(nogil=True)
def _horizontal_buf_row(buf, x_lo, out_w, taps, bounds, weights, flip, acc):
    """Horizontal pass of one buffered row (columns from x_lo) -> ``acc`` int32[3*out_w], fixed point,
    mirrored when ``flip``."""
    for xx in range(out_w):
        j = 3 * (bounds[2 * xx] - x_lo)
        n = bounds[2 * xx + 1]
        base = xx * taps
        s0 = s1 = s2 = np.int32(_HALF)
        for x in range(n):
            k = weights[base + x]
            s0 = _mac(s0, buf[j], k)
            s1 = _mac(s1, buf[j + 1], k)
            s2 = _mac(s2, buf[j + 2], k)
            j += 3
        o = 3 * (out_w - 1 - xx) if flip else 3 * xx
        acc[o] = s0
        acc[o + 1] = s1
        acc[o + 2] = s2


@numba.njit(nogil=True)
def _store_row(acc, y, out_w, table, identity, out, flat, channels_last):
    """Round ``acc`` (already mirrored) to uint8, map through ``table`` (normalize + dtype), write output row
    ``y``. ``flat``: ``out`` as [H, 3*W] rows when channels_last; ``identity``: the table is
    :func:`pixel_table`'s, so the rounded values are stored as they are (a loop LLVM vectorizes)."""
    if channels_last and out.strides[1] != 3 * out.strides[2]:  # pixels of a row not contiguous
        for xx in range(out_w):
            for c in range(3):
                out[y, xx, c] = table[c, _clip8(acc[3 * xx + c])]
    elif channels_last:
        line = flat[y]
        if identity:
            for i in range(3 * out_w):
                line[i] = _clip8(acc[i])
        else:
            for xx in range(out_w):
                for c in range(3):
                    line[3 * xx + c] = table[c, _clip8(acc[3 * xx + c])]
    else:
        for c in range(3):
            plane = out[c, y]
            lut = table[c]
            for xx in range(out_w):
                plane[xx] = lut[_clip8(acc[3 * xx + c])]


@numba.njit(nogil=True)
def _is_identity(table):
    """True when ``table[c, v] == v`` everywhere (:func:`pixel_table`): 768 compares per call."""
    for c in range(3):
        for v in range(256):
            if table[c, v] != v:
                return False
    return True


# ---------------------------------------------------------------------------------------------------------
# The fused kernel
# ---------------------------------------------------------------------------------------------------------


@numba.njit(nogil=True)
def _check_resize_args(src, x0, y0, x1, y1, table, out, channels_last):
    """Validate shapes and the box (float32 values, as Pillow checks them); returns (out_h, out_w)."""
    if channels_last:
        out_h, out_w, out_c = out.shape
    else:
        out_c, out_h, out_w = out.shape
    if out_c != 3 or out_h < 1 or out_w < 1:
        raise ValueError("resize_crop_flip_normalize: out must be [3, H, W] (or [H, W, 3] with channels_last)"
                         ", H, W >= 1; got shape", out.shape[0], out.shape[1], out.shape[2])
    if src.shape[2] != 3 or src.shape[0] < 1 or src.shape[1] < 1:
        raise ValueError("resize_crop_flip_normalize: src must be uint8[h, w, 3] RGB, h, w >= 1; got shape",
                         src.shape[0], src.shape[1], src.shape[2])
    if src.strides[1] != 3 * src.strides[2]:
        raise ValueError("resize_crop_flip_normalize: the pixels of a src row must be contiguous (strides[1] "
                         "== 3 * strides[2]; e.g. not img[:, ::-1] or img[:, ::2]); got strides",
                         src.strides[0], src.strides[1], src.strides[2])
    if table.shape[0] != 3 or table.shape[1] != 256:
        raise ValueError("resize_crop_flip_normalize: table must be [3, 256] (normalize_table), got shape",
                         table.shape[0], table.shape[1])
    if not (table.dtype == out.dtype):
        raise ValueError("resize_crop_flip_normalize: table and out dtypes differ; build the table with "
                         "normalize_table(dtype) / pixel_table() for the dtype of out")
    if not (0.0 <= x0 < x1 <= src.shape[1] and 0.0 <= y0 < y1 <= src.shape[0]):
        raise ValueError("resize_crop_flip_normalize: need 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h; got box",
                         x0, y0, x1, y1, "for h, w =", src.shape[0], src.shape[1])
    return out_h, out_w


@numba.njit(nogil=True)
def resize_crop_flip_normalize(src, x0, y0, x1, y1, flip, table, out, channels_last, scratch):
    """Resize the box of ``src`` to ``out``'s size (Pillow BILINEAR), flip, normalize, write ``out``.

    Equals exactly (Pillow >= 13; float16 / bfloat16 are the float32 values rounded to nearest even)::

        img = Image.fromarray(rgb).resize((W, H), Image.BILINEAR, box=(x0, y0, x1, y1))
        if flip: img = ImageOps.mirror(img)
        out = Normalize(mean, std)(ToTensor()(img))   # then .to(dtype); channels_last: .permute(1, 2, 0)

    src: uint8[h, w, 3], HWC RGB: a decoded image or a view of it, e.g. a crop ``rgb[y0:y1, x0:x1]``. Rows
        may have any stride; the pixels of a row must be contiguous (``strides[1] == 3 * strides[2]``).
    x0, y0, x1, y1: float box in source pixel coordinates (pixel i spans [i, i+1)), exactly Pillow's ``box``:
        0 <= x0 < x1 <= w, 0 <= y0 < y1 <= h; rounded to float32 as Pillow does. Filter taps near the box edge
        read source pixels OUTSIDE the box (clamped at the image border). torchvision's ``resized_crop`` crops
        first, so to reproduce it pass the crop view ``rgb[y0:y0+h, x0:x0+w]`` with the box ``(0, 0, w, h)``;
        pass the whole image and a box to reproduce ``resize(box=...)``.
    flip: bool, mirror left-right after resizing (``random_flip``).
    table: [3, 256] value table from :func:`normalize_table` / :func:`pixel_table`; dtype must equal out's.
    out: written in place; ``channels_last=False``: [3, H, W] (one NCHW sample), True: [H, W, 3] (NHWC).
        dtype float32 (normalized), uint16 (float16 or bfloat16 bits, normalized) or uint8 (pixels).
    scratch: int32[n], n >= ``resize_scratch_size(h, w, H, W)``; overwritten, not needed afterwards.

    Algorithm (Pillow ``ImagingResampleInner``): per-axis weights (``_coeffs``), then, one output row at a
    time, the two separable passes in Pillow's order (``_vertical_first``), the first rounded to uint8 as in
    Pillow's temporary image, so the uint8 result is bit-exact. Streaming rows replaces Pillow's temporary
    image: horizontal-first keeps a ring of the ``Ty + 1`` latest resampled rows (each source row resampled
    once), vertical-first one row. The uint8 result indexes ``table``. Work: ~2 * box_w * box_h * 3 +
    H * W * 3 * Ty multiply-adds (horizontal first). Raises ValueError on bad shapes or strides, a dtype
    mismatch, a box outside the image or a small scratch. Allocates nothing.
    """
    return _resize(src, x0, y0, x1, y1, flip, table, out, channels_last, scratch, ALL_STAGES)


@numba.njit(nogil=True)
def _resize(src, x0, y0, x1, y1, flip, table, out, channels_last, scratch, stages):
    """:func:`resize_crop_flip_normalize`, running only the passes whose ``STAGE_*`` bit is set in ``stages``
    (the weights always): benchmarks/images.py times each stage by difference. ALL_STAGES is the kernel."""
    fx0 = np.float32(x0)
    fy0 = np.float32(y0)
    fx1 = np.float32(x1)
    fy1 = np.float32(y1)
    out_h, out_w = _check_resize_args(src, fx0, fy0, fx1, fy1, table, out, channels_last)
    src_h = src.shape[0]
    src_w = src.shape[1]
    # The same pixels as uint8[h, 3*w]: flat rows let LLVM vectorize the vertical pass (6x faster than
    # indexing [x, c]); as_strided because numba cannot reshape a non-contiguous view (e.g. a crop).
    pixels = as_strided(src, shape=(src_h, 3 * src_w), strides=(src.strides[0], src.strides[2]))
    # out as [H, 3*W] rows (read only when channels_last and a row's pixels are contiguous): a vectorizable store.
    flat = as_strided(out, shape=(out_h, 3 * out_w), strides=(out.strides[0], out.strides[2]))
    identity = _is_identity(table)
    taps_x = resize_taps(np.float64(fx1 - fx0), out_w)
    taps_y = resize_taps(np.float64(fy1 - fy0), out_h)
    rows_len = _rows_len(src_h, src_w, out_h, out_w, taps_y)
    xb, yb, xk, yk, acc_at, rows_at, end = _scratch_offsets(out_h, out_w, taps_x, taps_y, rows_len)
    if scratch.shape[0] < end:
        raise ValueError("resize_crop_flip_normalize: scratch holds", scratch.shape[0],
                         "int32 elements, this call needs", end, "; size it with resize_scratch_size()")
    x_bounds = scratch[xb:yb]
    y_bounds = scratch[yb:xk]
    x_weights = scratch[xk:yk]
    y_weights = scratch[yk:acc_at]
    acc = scratch[acc_at:rows_at]
    rows = scratch[rows_at:end]
    _coeffs(src_w, fx0, fx1, out_w, taps_x, x_bounds, x_weights)
    nfix = _pad_taps(x_bounds, x_weights, taps_x, out_w, src_w)
    _coeffs(src_h, fy0, fy1, out_h, taps_y, y_bounds, y_weights)
    if _vertical_first(src_h, src_w, out_h, out_w):
        x_lo = x_bounds[0]  # columns any output pixel reads: [x_lo, x_hi)
        x_hi = x_bounds[2 * out_w - 2] + x_bounds[2 * out_w - 1]
        for y in range(out_h):
            ymin = y_bounds[2 * y]
            n = y_bounds[2 * y + 1]
            if stages & STAGE_VERTICAL:
                _vertical_src_rows(pixels, ymin, n, y_weights[y * taps_y:], x_lo, x_hi, rows)
            if stages & STAGE_HORIZONTAL:
                _horizontal_buf_row(rows, x_lo, out_w, taps_x, x_bounds, x_weights, flip, acc)
            if stages & STAGE_STORE:
                _store_row(acc, y, out_w, table, identity, out, flat, channels_last)
    else:
        row_len = 3 * out_w
        ring_rows = taps_y + 1  # a window spans <= taps_y rows, plus one row computed ahead by a pair
        y_last = y_bounds[2 * out_h - 2] + y_bounds[2 * out_h - 1]  # one past the last source row used
        next_row = 0  # first source row not yet resampled horizontally; tap windows only move down
        for y in range(out_h):
            ymin = y_bounds[2 * y]
            n = y_bounds[2 * y + 1]
            row = max(next_row, ymin)
            while row < ymin + n:
                pair = row + 1 < y_last
                a = (row % ring_rows) * row_len
                b = ((row + 1) % ring_rows) * row_len
                if stages & STAGE_HORIZONTAL:
                    _horizontal_src_rows(pixels, row, pair, out_w, taps_x, nfix, x_bounds, x_weights, flip,
                                         rows[a:a + row_len], rows[b:b + row_len])
                row += 2 if pair else 1
            next_row = max(next_row, row)
            if stages & STAGE_VERTICAL:
                _vertical_ring(rows, ring_rows, row_len, ymin, n, y_weights[y * taps_y:], acc)
            if stages & STAGE_STORE:
                _store_row(acc, y, out_w, table, identity, out, flat, channels_last)
