"""The fused per-slice image kernel the loader's threads run: crop box -> partial JPEG decode at a reduced DCT
scale (or a raw view) -> Pillow-exact resize -> flip -> normalize, written into the batch buffer. One call per
slice of a batch, so Python runs once per slice and the GIL is released for the whole slice.
"""

from __future__ import annotations

import functools

import numba
import numpy as np

from pageset.format.constants import ENCODING_RAW
from pageset.ops import jpeg
from pageset.ops.image import center_crop_box, random_flip, random_resized_crop_box, resize_crop_flip_normalize

CROP_RANDOM_RESIZED = 0
CROP_CENTER = 1


@numba.njit(nogil=True)
def _crop_box(h, w, key, crop_mode, params, out_h, out_w):
    if crop_mode == CROP_RANDOM_RESIZED:
        return random_resized_crop_box(h, w, key, params[0], params[1], params[2], params[3])
    return center_crop_box(h, w, out_h, out_w, params[4])


@numba.njit(nogil=True)
def image_slice(handle, buf, offs, lens, heights, widths, encodings, keys, crop_mode, params, flip_p, table, out,
                channels_last, decoded, jpeg_scratch, resize_scratch, status):
    """Fill ``out[j]`` for every sample j of a slice; returns -1, or the first j whose JPEG failed to decode.

    handle: int, the thread's ``JpegDecoder.handle``. buf: uint8[:], bytes holding the records (the file's mmap
    or a staging copy); offs, lens: int64[n] byte offset and length of each image in ``buf``; heights, widths:
    int64[n] stored size in pixels; encodings: uint8[n] (0 raw HWC RGB, 1 JPEG); keys: uint64[n] sample keys.
    crop_mode: CROP_RANDOM_RESIZED or CROP_CENTER; params: float64[5] = (scale_lo, scale_hi, ratio_lo,
    ratio_hi, center_ratio). flip_p: float, probability of a horizontal flip. table: [3, 256] value table
    (``image.normalize_table`` / ``pixel_table``), dtype equal to out's. out: [n, 3, H, W] or, with
    ``channels_last``, [n, H, W, 3]. decoded: uint8[:] >= max(h*w*3) over the slice; jpeg_scratch: uint8[:] >=
    ``jpeg.scratch_bound(w, h)``; resize_scratch: int32[:] >= ``image.resize_scratch_size`` of the largest image.
    status: int64[n], written with the decoder status per sample (0 ok, 1 libjpeg warning, < 0 error).

    The crop box is torchvision's (RandomResizedCrop) or FFCV's (CenterCrop) in stored pixels. JPEGs are
    decoded only over the crop's region, at the smallest DCT scale keeping the crop >= the output size
    (``jpeg.choose_scale``); at scale 1/1 the result is Pillow's ``img.crop(box).resize(size, BILINEAR)`` bit
    for bit; at smaller scales the box is mapped into the scaled image (a sub-pixel position).
    """
    if channels_last:
        out_h = out.shape[1]
        out_w = out.shape[2]
    else:
        out_h = out.shape[2]
        out_w = out.shape[3]
    for j in range(offs.shape[0]):
        h = heights[j]
        w = widths[j]
        key = keys[j]
        x, y, cw, ch = _crop_box(h, w, key, crop_mode, params, out_h, out_w)
        flip = flip_p > 0.0 and random_flip(key, flip_p)
        data = buf[offs[j] : offs[j] + lens[j]]
        if encodings[j] == ENCODING_RAW:
            src = data.reshape((h, w, 3))[y : y + ch, x : x + cw]
            resize_crop_flip_normalize(src, 0.0, 0.0, float(cw), float(ch), flip, table, out[j], channels_last,
                                       resize_scratch)
            status[j] = 0
            continue
        num, den = jpeg.choose_scale(w, h, cw, ch, out_w, out_h)
        sx, sy, sw, sh = jpeg.scale_region(w, h, x, y, cw, ch, num, den)
        region = decoded[: sh * sw * 3].reshape((sh, sw, 3))
        st = jpeg.jpeg_decode(handle, data, num, den, sx, sy, sw, sh, region, jpeg_scratch)
        status[j] = st
        if st < 0:
            return j
        f = num / den
        bx0 = min(max(x * f - sx, 0.0), sw - 1e-3)
        by0 = min(max(y * f - sy, 0.0), sh - 1e-3)
        bx1 = min(max((x + cw) * f - sx, bx0 + 1e-3), float(sw))
        by1 = min(max((y + ch) * f - sy, by0 + 1e-3), float(sh))
        resize_crop_flip_normalize(region, bx0, by0, bx1, by1, flip, table, out[j], channels_last, resize_scratch)
    return -1


@functools.cache
def prepare() -> None:
    """Load libjpeg-turbo and enable the on-disk cache of the slice kernel (run time, never at import)."""
    jpeg.prepare()
    if not numba.config.DISABLE_JIT:
        try:
            image_slice.enable_caching()
        except RuntimeError:  # no writable cache location: compile in each process
            pass


def buffer_sizes(max_height: int, max_width: int, out_h: int, out_w: int) -> tuple[int, int, int]:
    """(decoded bytes, jpeg scratch bytes, resize scratch int32 elements) enough for images up to this size."""
    from pageset.ops.image import resize_scratch_size

    decoded = max_height * max_width * 3
    return decoded, int(jpeg.scratch_bound(max_width, max_height)), int(resize_scratch_size(max_height, max_width,
                                                                                            out_h, out_w))


def empty_status(n: int) -> np.ndarray:
    """int64[n] status buffer for :func:`image_slice`."""
    return np.zeros(n, dtype=np.int64)
