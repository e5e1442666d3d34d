"""Crop sampling: where each sample's crop box lies and whether it is flipped (no pixels touched here).

- :func:`random_resized_crop_box` is ``torchvision.transforms.RandomResizedCrop.get_params`` (10 attempts,
  log-uniform aspect ratio, central-crop fallback), its uniforms drawn from the counter-based
  :func:`pageset.order.keys.uniform` instead of torch's global generator; :func:`random_resized_crop_box_py`
  is its pure-Python twin.
- :func:`center_crop_box` is FFCV's evaluation crop; :func:`random_flip` is ``RandomHorizontalFlip``'s draw.

Randomness: every decision reads ``uniform(key, counter)`` for the sample's key (``sample_keys``); counters
``[CROP_COUNTER, CROP_COUNTER + 40)`` belong to the crop and ``FLIP_COUNTER`` to the flip. Nothing reads
``np.random`` or thread state, so one key gives one crop in any thread, rank or process.

All kernels are ``numba.njit(nogil=True)`` functions, callable from Python and from other njit code (the
loader's per-slice planner, ``image_batch.plan_slice``). The pixels are resampled by :mod:`pageset.ops.resize`.
"""

from __future__ import annotations

import math

import numba

from pageset.order.keys import uniform, uniform_py

# Counter layout of one sample key (part of the augmentation stream; never reorder or reuse).
# RandomResizedCrop attempt t (0..9) reads CROP_COUNTER + 4t + {0: scale, 1: log-ratio, 2: top, 3: left}.
CROP_COUNTER = 0
CROP_ATTEMPTS = 10  # torchvision's fixed number of tries before the central-crop fallback
FLIP_COUNTER = 40  # one draw: flip when uniform(key, 40) < p (torchvision: torch.rand(1) < p)


@numba.njit(nogil=True)
def _randint(key, counter, n):
    """torch.randint(0, n): an int in [0, n) from one uniform; n >= 1 and < 2**53."""
    v = int(uniform(key, counter) * n)  # u < 1 and n < 2**53, so u * n < n after rounding; the min is a guard
    return min(v, n - 1)


@numba.njit(nogil=True)
def random_resized_crop_box(height, width, key, scale_lo, scale_hi, ratio_lo, ratio_hi):
    """Sample a RandomResizedCrop box for an image of ``height`` x ``width`` pixels.

    The algorithm of ``torchvision.transforms.RandomResizedCrop.get_params`` (torchvision docs: "A crop of
    random size (default: of 0.08 to 1.0) of the original size and a random aspect ratio (default: of 3/4 to
    4/3) of the original aspect ratio is made"): up to 10 attempts of
    ``target_area = area * U(scale_lo, scale_hi)``, ``aspect = exp(U(log ratio_lo, log ratio_hi))``,
    ``w = round(sqrt(target_area * aspect))``, ``h = round(sqrt(target_area / aspect))`` (Python rounding:
    half to even), accepted when ``0 < w <= width and 0 < h <= height``; then ``top = randint(0, height - h)``
    and ``left = randint(0, width - w)`` (inclusive). If no attempt fits, a central crop of the whole image
    with its aspect ratio clamped to ``[ratio_lo, ratio_hi]``.

    Randomness: attempt t reads ``uniform(key, CROP_COUNTER + 4t + j)``, j = 0 scale, 1 log-ratio, 2 top,
    3 left (float64; torchvision draws float32 from torch's global generator, so only the distribution is
    shared, not the numbers). Deviation: in the fallback, w and h are clamped to >= 1 (torchvision can return
    0 there, but only for ratio ranges that exclude 1 by a factor > 2, e.g. a 1x1 image with ratio (3, 4)).

    height, width: image size in pixels, >= 1. key: uint64 sample key. scale_lo <= scale_hi: area fractions
    (torchvision default (0.08, 1.0)). 0 < ratio_lo <= ratio_hi: width / height (default (3/4, 4/3)).
    Returns ``(x0, y0, w, h)`` ints in source pixels: the box covers columns [x0, x0 + w) and rows
    [y0, y0 + h), always inside the image with w, h >= 1. Raises ValueError on invalid arguments.
    """
    if height < 1 or width < 1:
        raise ValueError("random_resized_crop_box: image size must be >= 1x1, got", height, width)
    if not (0.0 <= scale_lo <= scale_hi):
        raise ValueError("random_resized_crop_box: need 0 <= scale_lo <= scale_hi, got", scale_lo, scale_hi)
    if not (0.0 < ratio_lo <= ratio_hi):
        raise ValueError("random_resized_crop_box: need 0 < ratio_lo <= ratio_hi, got", ratio_lo, ratio_hi)
    area = float(height) * float(width)
    log_lo = math.log(ratio_lo)
    log_hi = math.log(ratio_hi)
    for attempt in range(CROP_ATTEMPTS):
        c = CROP_COUNTER + 4 * attempt
        target_area = area * (scale_lo + (scale_hi - scale_lo) * uniform(key, c))
        aspect = math.exp(log_lo + (log_hi - log_lo) * uniform(key, c + 1))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            y0 = _randint(key, c + 2, height - h + 1)
            x0 = _randint(key, c + 3, width - w + 1)
            return x0, y0, w, h
    return _central_fallback(height, width, ratio_lo, ratio_hi)


@numba.njit(nogil=True)
def _central_fallback(height, width, ratio_lo, ratio_hi):
    """RandomResizedCrop's fallback: the whole image, aspect clamped to [ratio_lo, ratio_hi], centred."""
    in_ratio = float(width) / float(height)
    if in_ratio < ratio_lo:
        w = width
        h = int(round(w / ratio_lo))
    elif in_ratio > ratio_hi:
        h = height
        w = int(round(h * ratio_hi))
    else:
        w = width
        h = height
    w = max(w, 1)
    h = max(h, 1)
    return (width - w) // 2, (height - h) // 2, w, h


def random_resized_crop_box_py(
    height: int, width: int, key: int, scale_lo: float, scale_hi: float, ratio_lo: float, ratio_hi: float
) -> tuple[int, int, int, int]:
    """Pure-Python reference twin of :func:`random_resized_crop_box` (same counters, same result).

    Written straight from torchvision's ``get_params`` with Python floats, ``round`` and ``uniform_py``;
    the tests check that both agree. Returns ``(x0, y0, w, h)``.
    """
    area = height * width
    log_ratio = (math.log(ratio_lo), math.log(ratio_hi))
    for attempt in range(CROP_ATTEMPTS):
        c = CROP_COUNTER + 4 * attempt
        target_area = area * (scale_lo + (scale_hi - scale_lo) * uniform_py(key, c))
        aspect_ratio = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * uniform_py(key, c + 1))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = min(int(uniform_py(key, c + 2) * (height - h + 1)), height - h)
            j = min(int(uniform_py(key, c + 3) * (width - w + 1)), width - w)
            return j, i, w, h
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio_lo, ratio_hi):
        w = width
        h = int(round(w / min(ratio_lo, ratio_hi)))
    elif in_ratio > max(ratio_lo, ratio_hi):
        h = height
        w = int(round(h * max(ratio_lo, ratio_hi)))
    else:
        w = width
        h = height
    w, h = max(w, 1), max(h, 1)
    return (width - w) // 2, (height - h) // 2, w, h


@numba.njit(nogil=True)
def center_crop_box(height, width, out_h, out_w, ratio=224 / 256):
    """The evaluation crop: FFCV's ``CenterCropRGBImageDecoder`` box, generalised to non-square outputs.

    FFCV (``get_center_crop``) takes a centred square of side ``int(ratio * min(height, width))`` and resizes
    it to the (square) output in one step. That is torchvision's ``Resize(256)`` + ``CenterCrop(224)`` with
    ratio = 224/256, done as one resample instead of two (so it is close to, not equal to, torchvision's
    two-step result). For a non-square output the crop keeps the output's aspect ratio and its longer side
    is ``ratio * min(height, width)``, which is again ``Resize(S) + CenterCrop((out_h, out_w))`` with
    ``S = max(out_h, out_w) / ratio``. For out_h == out_w the box equals FFCV's exactly.

    height, width, out_h, out_w: pixels, >= 1. ratio: in (0, 1]. Returns ``(x0, y0, w, h)`` ints in source
    pixels, centred (``(height - h) // 2`` like FFCV), inside the image, w, h >= 1. Raises ValueError.
    """
    if height < 1 or width < 1 or out_h < 1 or out_w < 1:
        raise ValueError("center_crop_box: sizes must be >= 1, got", height, width, out_h, out_w)
    if not (0.0 < ratio <= 1.0):
        raise ValueError("center_crop_box: ratio must be in (0, 1], got", ratio)
    side = ratio * min(height, width)
    longest = max(out_h, out_w)
    # out_h / longest is exactly 1.0 on the longer side, so a square output gives FFCV's int(ratio * s).
    h = max(int(side * (out_h / longest)), 1)
    w = max(int(side * (out_w / longest)), 1)
    return (width - w) // 2, (height - h) // 2, w, h


@numba.njit(nogil=True)
def random_flip(key, p):
    """``RandomHorizontalFlip(p)``: True when ``uniform(key, FLIP_COUNTER) < p``. key: uint64; p in [0, 1]."""
    return uniform(key, FLIP_COUNTER) < p
