"""Pillow's 8-bit resampling arithmetic: filter taps and 22-bit fixed-point weights per axis.

``_coeffs`` is Pillow's ``precompute_coeffs`` + ``normalize_coeffs_8bpc`` (``src/libImaging/Resample.c``) for
the BILINEAR (triangle) filter, whose support grows with the reduction factor (antialiased when shrinking,
plain bilinear when enlarging). ``_mac`` and ``_clip8`` are the int32 multiply-add and the rounding to
0..255 every pass uses. The passes themselves are in :mod:`pageset.ops.resize`.
"""

from __future__ import annotations

import math

import numba
import numpy as np

# Pillow's 8-bit resampling arithmetic (Resample.c): weights are rounded to 22 fractional bits, so that
# 255 * 2**22 (plus rounding slack) stays below 2**31 -- "8 bits for result, two extra bits for overflow".
PRECISION_BITS = 22
_HALF = 1 << (PRECISION_BITS - 1)  # added before the shift: round half up
_ONE = float(1 << PRECISION_BITS)
BILINEAR_SUPPORT = 1.0  # the triangle filter is non-zero on (-1, 1) in units of the (scaled) pixel pitch


@numba.njit(nogil=True)
def resize_taps(extent, out_size):
    """Maximum filter taps per output pixel (Pillow's ``ksize``) for a box ``extent`` source pixels wide.

    ``ksize = 2 * ceil(support) + 1`` with ``support = max(extent / out_size, 1)``: 3 taps when enlarging,
    ~2x the reduction factor + 1 when shrinking (400 -> 224: 5 taps; 9000 -> 224: 83 taps).
    extent: float > 0 (the whole source side gives a bound for every box). out_size: int >= 1.
    """
    scale = extent / out_size
    return int(math.ceil(BILINEAR_SUPPORT * max(scale, 1.0))) * 2 + 1


# The small helpers here and in resize.py are plain @njit functions, not inline="always": LLVM inlines them all
# the same (no call left in the fused kernel's machine code, the same vector instructions), while numba's own
# IR-level inlining cost ~1.3 of ~6 CPU seconds compiling the resize kernel.
@numba.njit(nogil=True)
def _triangle(x):
    """Pillow's ``bilinear_filter``: 1 - |x| on (-1, 1), else 0."""
    if x < 0.0:
        x = -x
    if x < 1.0:
        return 1.0 - x
    return 0.0


@numba.njit(nogil=True)
def _coeffs(in_size, in0, in1, out_size, taps, bounds, weights):
    """Pillow's ``precompute_coeffs`` + ``normalize_coeffs_8bpc`` for one axis, written into scratch.

    in0, in1: the box edges as float32 (Pillow parses the box as C floats and subtracts in float, then
    widens to double -- reproduced so that tap boundaries round identically). For output pixel ``xx``:
    ``center = in0 + (xx + 0.5) * scale``, taps ``[xmin, xmin + n)`` clipped to the image, weights
    ``triangle((x - center + 0.5) / filterscale)`` normalised to sum 1, then rounded to 22-bit fixed point
    (``int(0.5 + w * 2**22)``; triangle weights are >= 0). bounds: int32[2*out_size] (xmin, n) pairs.
    weights: int32[out_size*taps], row xx holds its n weights first.
    """
    scale = np.float64(in1 - in0) / out_size
    filterscale = scale if scale >= 1.0 else 1.0
    support = BILINEAR_SUPPORT * filterscale
    inv = 1.0 / filterscale
    for xx in range(out_size):
        center = np.float64(in0) + (xx + 0.5) * scale
        xmin = int(center - support + 0.5)  # int() truncates toward zero, as C's (int) does
        if xmin < 0:
            xmin = 0
        xmax = int(center + support + 0.5)
        if xmax > in_size:
            xmax = in_size
        n = xmax - xmin
        total = 0.0
        for x in range(n):  # same terms in the same order as Pillow, so the same double sum
            total += _triangle((x + xmin - center + 0.5) * inv)
        base = xx * taps
        for x in range(n):
            w = _triangle((x + xmin - center + 0.5) * inv)
            if total != 0.0:
                w /= total
            weights[base + x] = np.int32(0.5 + w * _ONE)
        bounds[2 * xx] = xmin
        bounds[2 * xx + 1] = n


@numba.njit(nogil=True)
def _clip8(acc):
    """Pillow's ``clip8``: a 22-bit fixed-point accumulator (with the half already added) -> 0..255."""
    v = acc >> PRECISION_BITS
    if v < 0:
        return 0
    if v > 255:
        return 255
    return v


@numba.njit(nogil=True)
def _mac(acc, pixel, weight):
    """acc + pixel * weight in int32: <= 255 * 2**22 * (1 + slack) + 2**21 < 2**31, so it never wraps.

    Keeping the arithmetic int32 (numba would widen to int64) lets LLVM use 16-lane vectors: the vertical
    pass runs ~6x faster than with int64 temporaries."""
    return np.int32(acc + np.int32(pixel) * weight)
