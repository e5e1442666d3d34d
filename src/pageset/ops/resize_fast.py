"""The fast resize kernel (``resize_mode="fast"``): Pillow's BILINEAR filter, not bit-exact, ~2x cheaper.

:func:`resize_fast` takes the arguments of :func:`pageset.ops.resize.resize_crop_flip_normalize` and writes the
same kind of output: the same antialiased triangle filter with the same tap windows (Pillow's
``precompute_coeffs``), but

- weights in 12-bit fixed point (sum exactly ``2**12``) instead of Pillow's 22 bits;
- always the vertical pass first (one vectorized int32 loop over the box's source columns per output row),
  rounded to uint8 like Pillow's temporary image, whatever order Pillow would choose;
- the horizontal pass on all three channels at once (SWAR): a pixel packed into one int64 as three 21-bit
  lanes, ``R | G << 21 | B << 42``, so one multiply-add per tap replaces three. 21 bits hold
  ``255 * 2**12 + 2**11`` (the largest lane before rounding) with room to spare, and the weights are >= 0,
  so no lane ever carries into the next.

Measured error against the exact kernel (= Pillow 13) on real photos (tests/test_resize_fast.py, the four
test photos x the crops of RandomResizedCrop(224) and CenterCrop(224)): max abs. difference
:data:`FAST_MAX_ABS_DIFF` = 2 (uint8 levels), PSNR >= :data:`FAST_MIN_PSNR_DB` = 50 dB, and the same bound
against Pillow's own ``Image.resize``. Differences come from the rounding of the weights and from the pass
order (Pillow rounds its first pass to uint8 too); an image's mean changes by < 0.01 level.

Scratch: int32[n], n >= :func:`fast_scratch_size`; the per-sample path allocates nothing.
"""

from __future__ import annotations

import numba
import numpy as np
from numpy.lib.stride_tricks import as_strided

from pageset.ops.resize import ALL_STAGES, STAGE_HORIZONTAL, STAGE_STORE, STAGE_VERTICAL, _check_resize_args, _is_identity, _pad_taps
from pageset.ops.resize_weights import _coeffs, resize_taps

FAST_BITS = 12  # fractional bits of the fast weights: 255 * 2**12 fits a 21-bit lane
FAST_MAX_ABS_DIFF = 2  # stated bound (uint8 levels) vs the exact kernel and vs Pillow, on real photos
FAST_MIN_PSNR_DB = 52.0  # stated bound (dB, peak 255) vs the exact kernel and vs Pillow, on real photos
_ONE = 1 << FAST_BITS
_HALF = 1 << (FAST_BITS - 1)
_LANE = 21  # bits per channel in a packed pixel
_LANE_MASK8 = 0xFF | (0xFF << _LANE) | (0xFF << (2 * _LANE))  # the 8 result bits of each lane
_HALF3 = _HALF | (_HALF << _LANE) | (_HALF << (2 * _LANE))  # round half up, in every lane


@numba.njit(nogil=True)
def _fast_offsets(out_h, out_w, taps_x, taps_y, src_w):
    """int32 offsets into scratch: x bounds, y bounds, x weights, y weights, tap-major x weights, tap
    windows, output values, vertical row, int64 area (packed row ``src_w`` + accumulators ``out_w``), end.
    The int64 area may start one element later, at the first 8-byte aligned address."""
    xb = 0
    yb = xb + 2 * out_w
    xk = yb + 2 * out_h
    yk = xk + out_w * taps_x
    wt = yk + out_h * taps_y
    idx = wt + out_w * taps_x
    vals = idx + out_w
    row = vals + 3 * out_w
    wide = row + 3 * src_w
    return xb, yb, xk, yk, wt, idx, vals, row, wide, wide + 2 * (src_w + out_w) + 1


@numba.njit(nogil=True)
def fast_scratch_size(src_h, src_w, out_h, out_w):
    """int32 elements of ``scratch`` that :func:`resize_fast` needs for ANY box inside a ``src_h x src_w``
    source: bounds ``2*(out_w + out_h)``, weights ``2*out_w*Tx + out_h*Ty`` (``Tx = resize_taps(src_w,
    out_w)``, ``Ty = resize_taps(src_h, out_h)``), ``4*out_w`` for tap windows and output values, one
    vertically resampled row ``3*src_w``, and ``2*(src_w + out_w) + 1`` for int64 packed pixels and
    accumulators. 224x224 from 500x375: 8.5 K elements (34 KiB)."""
    taps_x = resize_taps(float(src_w), out_w)
    taps_y = resize_taps(float(src_h), out_h)
    return _fast_offsets(out_h, out_w, taps_x, taps_y, src_w)[9]


@numba.njit(nogil=True)
def _fast_weights(bounds, weights, taps, out_size):
    """Pillow's 22-bit weights (``_coeffs``) -> 12-bit ones, in place, each pixel's sum exactly ``2**12``.

    ``w12 = round(w22 / 2**10)``; the rounding error of the sum (a few units) goes to the pixel's largest
    weight, which is >= 2**12 / n, so every weight stays >= 0 and no packed lane can overflow."""
    for xx in range(out_size):
        base = xx * taps
        n = bounds[2 * xx + 1]
        total = 0
        best = base
        for t in range(n):
            w = (weights[base + t] + (1 << 9)) >> 10
            weights[base + t] = w
            total += w
            if w > weights[best]:
                best = base + t
        weights[best] += _ONE - total


@numba.njit(nogil=True)
def _vertical_packed(pixels, ymin, n, weights, x_lo, x_hi, row, packed):
    """Vertical pass of source rows ymin..ymin+n-1, columns [x_lo, x_hi), rounded to uint8 and packed:
    ``packed[x - x_lo] = R | G << 21 | B << 42``. ``row``: int32[>= 3*(x_hi-x_lo)] accumulators (a flat loop
    LLVM vectorizes)."""
    m3 = 3 * (x_hi - x_lo)
    for i in range(m3):
        row[i] = np.int32(_HALF)
    for t in range(n):
        k = weights[t]
        line = pixels[ymin + t, 3 * x_lo:3 * x_hi]
        for i in range(m3):
            row[i] = np.int32(row[i] + np.int32(line[i]) * k)
    for x in range(x_hi - x_lo):
        packed[x] = (np.int64(row[3 * x] >> FAST_BITS) | (np.int64(row[3 * x + 1] >> FAST_BITS) << _LANE)
                     | (np.int64(row[3 * x + 2] >> FAST_BITS) << (2 * _LANE)))


@numba.njit(nogil=True)
def _tap_major(bounds, weights, taps, nfix, out_w, x_lo, idx, wt):
    """Tap-major copies of the padded x weights for :func:`_horizontal_taps`: ``wt[t*out_w + xx]`` (int32)
    and each pixel's first column ``idx[xx] = xmin - x_lo`` (uint32: unsigned indices need no wraparound
    check, which is what keeps the tap loop short: 2.5x faster than signed ones, measured)."""
    for xx in range(out_w):
        idx[xx] = np.uint32(bounds[2 * xx] - x_lo)
        for t in range(nfix):
            wt[t * out_w + xx] = weights[xx * taps + t]


@numba.njit(nogil=True)
def _horizontal_taps(packed, out_w, nfix, idx, wt, acc, flip, dst):
    """Horizontal pass of one packed row, ``nfix`` taps per pixel, tap-major -> ``dst`` int32[3*out_w], RGB
    interleaved, rounded to 0..255, mirrored when ``flip``. acc: int64[out_w] accumulators."""
    for xx in range(out_w):
        acc[xx] = np.int64(_HALF3)
    for t in range(nfix):
        w = wt[t * out_w:(t + 1) * out_w]
        src = packed[t:]
        for xx in range(out_w):
            acc[xx] += w[xx] * src[idx[xx]]
    _unpack(acc, out_w, flip, dst)


@numba.njit(nogil=True)
def _unpack(acc, out_w, flip, dst):
    """Packed accumulators -> 0..255 values, RGB interleaved (mirrored when ``flip``)."""
    mask = np.int64(_LANE_MASK8)
    for xx in range(out_w):
        v = (acc[xx] >> FAST_BITS) & mask
        o = 3 * (out_w - 1 - xx) if flip else 3 * xx
        dst[o] = np.int32(v & 0xFF)
        dst[o + 1] = np.int32((v >> _LANE) & 0xFF)
        dst[o + 2] = np.int32(v >> (2 * _LANE))


@numba.njit(nogil=True)
def _horizontal_packed(packed, x_lo, out_w, taps, bounds, weights, acc, flip, dst):
    """:func:`_horizontal_taps` for rows too narrow for a common tap count (``_pad_taps`` gave 0): each pixel
    its own n taps."""
    for xx in range(out_w):
        j = bounds[2 * xx] - x_lo
        base = xx * taps
        a = np.int64(_HALF3)
        for t in range(bounds[2 * xx + 1]):
            a += weights[base + t] * packed[j + t]
        acc[xx] = a
    _unpack(acc, out_w, flip, dst)


@numba.njit(nogil=True)
def _store_values(vals, y, out_w, table, identity, out, flat, channels_last):
    """Write output row ``y`` from ``vals`` int32[3*out_w] (0..255, RGB interleaved) through ``table``
    (``resize._store_row`` without the rounding: the values are already pixels)."""
    if channels_last and out.strides[1] != 3 * out.strides[2]:
        for xx in range(out_w):
            for c in range(3):
                out[y, xx, c] = table[c, vals[3 * xx + c]]
    elif channels_last:
        line = flat[y]
        if identity:
            for i in range(3 * out_w):
                line[i] = vals[i]
        else:
            for xx in range(out_w):
                for c in range(3):
                    line[3 * xx + c] = table[c, vals[3 * xx + c]]
    else:
        for c in range(3):
            plane = out[c, y]
            lut = table[c]
            for xx in range(out_w):
                plane[xx] = lut[vals[3 * xx + c]]


@numba.njit(nogil=True)
def resize_fast(src, x0, y0, x1, y1, flip, table, out, channels_last, scratch):
    """:func:`pageset.ops.resize.resize_crop_flip_normalize` in the fast mode: same arguments, same output
    shapes, dtypes and errors; uint8 values within :data:`FAST_MAX_ABS_DIFF` of Pillow's (module docstring),
    deterministic (one result per input, any thread). ``scratch``: int32[n], n >= :func:`fast_scratch_size`
    (h, w, H, W) (smaller than the exact kernel's). Work: ``H * box_w * 3 * Ty`` vectorized int32 and
    ``H * W * Tx`` int64 multiply-adds. Allocates nothing."""
    return _resize_fast(src, x0, y0, x1, y1, flip, table, out, channels_last, scratch, ALL_STAGES)


@numba.njit(nogil=True)
def _resize_fast(src, x0, y0, x1, y1, flip, table, out, channels_last, scratch, stages):
    """:func:`resize_fast` running only the passes whose ``resize.STAGE_*`` bit is set (the weights always;
    as in the exact kernel): benchmarks/images.py times the stages by difference."""
    fx0 = np.float32(x0)
    fy0 = np.float32(y0)
    fx1 = np.float32(x1)
    fy1 = np.float32(y1)
    out_h, out_w = _check_resize_args(src, fx0, fy0, fx1, fy1, table, out, channels_last)
    src_h = src.shape[0]
    src_w = src.shape[1]
    pixels = as_strided(src, shape=(src_h, 3 * src_w), strides=(src.strides[0], src.strides[2]))
    flat = as_strided(out, shape=(out_h, 3 * out_w), strides=(out.strides[0], out.strides[2]))
    identity = _is_identity(table)
    taps_x = resize_taps(np.float64(fx1 - fx0), out_w)
    taps_y = resize_taps(np.float64(fy1 - fy0), out_h)
    xb, yb, xk, yk, wt_at, idx_at, vals_at, row_at, wide_at, end = _fast_offsets(out_h, out_w, taps_x, taps_y,
                                                                                 src_w)
    if scratch.shape[0] < end:
        raise ValueError("resize_fast: scratch holds", scratch.shape[0], "int32 elements, this call needs", end,
                         "; size it with fast_scratch_size()")
    x_bounds = scratch[xb:yb]
    y_bounds = scratch[yb:xk]
    x_weights = scratch[xk:yk]
    y_weights = scratch[yk:wt_at]
    wt = scratch[wt_at:idx_at]
    idx = scratch[idx_at:vals_at].view(np.uint32)
    vals = scratch[vals_at:row_at]
    row = scratch[row_at:wide_at]
    # the int64 area at its first 8-byte aligned address (the view needs no alignment on x86, but keep it)
    w0 = wide_at + (1 if (scratch.ctypes.data + 4 * wide_at) & 7 else 0)
    packed = scratch[w0:w0 + 2 * src_w].view(np.int64)
    acc = scratch[w0 + 2 * src_w:w0 + 2 * (src_w + out_w)].view(np.int64)
    _coeffs(src_w, fx0, fx1, out_w, taps_x, x_bounds, x_weights)
    nfix = _pad_taps(x_bounds, x_weights, taps_x, out_w, src_w)
    _fast_weights(x_bounds, x_weights, taps_x, out_w)
    _coeffs(src_h, fy0, fy1, out_h, taps_y, y_bounds, y_weights)
    _fast_weights(y_bounds, y_weights, taps_y, out_h)
    x_lo = x_bounds[0]  # columns any output pixel reads: [x_lo, x_hi)
    x_hi = x_bounds[2 * out_w - 2] + x_bounds[2 * out_w - 1]
    _tap_major(x_bounds, x_weights, taps_x, nfix, out_w, x_lo, idx, wt)
    for y in range(out_h):
        if stages & STAGE_VERTICAL:
            _vertical_packed(pixels, y_bounds[2 * y], y_bounds[2 * y + 1], y_weights[y * taps_y:], x_lo, x_hi,
                             row, packed)
        if stages & STAGE_HORIZONTAL:
            if nfix:
                _horizontal_taps(packed, out_w, nfix, idx, wt, acc, flip, vals)
            else:
                _horizontal_packed(packed, x_lo, out_w, taps_x, x_bounds, x_weights, acc, flip, vals)
        if stages & STAGE_STORE:
            _store_values(vals, y, out_w, table, identity, out, flat, channels_last)
