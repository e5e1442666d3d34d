"""The fused per-slice image kernel the loader's threads run: crop box -> partial JPEG decode at a reduced DCT
scale (or a raw view) -> Pillow-exact resize -> flip -> normalize, written into the batch buffer. One call per
slice of a batch, so Python runs once per slice and the GIL is released for the whole slice.
"""

from __future__ import annotations

import functools
import sys

import numba

from pageset.format.constants import ENCODING_RAW
from pageset.ops import crop, jpeg, jpeg_kernels, jpeg_scale, kernel_cache, resize, resize_weights
from pageset.ops.crop import center_crop_box, random_flip, random_resized_crop_box
from pageset.ops.resize import resize_crop_flip_normalize, resize_scratch_size
from pageset.ops.resize_fast import fast_scratch_size, resize_fast

CROP_RANDOM_RESIZED = 0
CROP_CENTER = 1


@numba.njit(nogil=True)
def _crop_box(h, w, key, crop_mode, params, out_h, out_w):
    if crop_mode == CROP_RANDOM_RESIZED:
        return random_resized_crop_box(h, w, key, params[0], params[1], params[2], params[3])
    return center_crop_box(h, w, out_h, out_w, params[4])


JPEG_WINDOW_MARGIN = 96  # widening of a cropping region to iMCU boundaries: <= 3 iMCUs of <= 32 pixels


@numba.njit(nogil=True)
def plan_slice(heights, widths, encodings, keys, crop_mode, params, flip_p, out_h, out_w, boxes, flips):
    """Crop boxes, DCT scales and flips of a slice, and the scratch sizes they need (before any decode).

    heights, widths: int64[n] stored pixels; encodings: uint8[n]; keys: uint64[n]; crop_mode, params, flip_p: as
    in :func:`image_slice`; out_h, out_w: output pixels. Writes ``boxes`` int64[n, 6] = (x, y, w, h, num, denom)
    (crop in stored pixels and the DCT scale; 1/1 for raw images) and ``flips`` bool[n]. Returns (decoded bytes,
    JPEG scratch bytes, resize scratch int32 elements) that :func:`image_slice` needs for this slice: the sizes
    follow the regions actually decoded, not the images' full sizes (a 12000x9000 JPEG cropped for a 224 output is
    decoded at 1/8 over the crop only).
    """
    need_dec = 0
    need_jpeg = 0
    need_rs = 0
    for j in range(heights.shape[0]):
        h = heights[j]
        w = widths[j]
        x, y, cw, ch = _crop_box(h, w, keys[j], crop_mode, params, out_h, out_w)
        flips[j] = flip_p > 0.0 and random_flip(keys[j], flip_p)
        if encodings[j] == ENCODING_RAW:
            num, den = 1, 1
            rh, rw = ch, cw
        else:
            num, den = jpeg_scale.choose_scale(w, h, cw, ch, out_w, out_h)
            sx, sy, rw, rh = jpeg_scale.scale_region(w, h, x, y, cw, ch, num, den)
            need_dec = max(need_dec, (rw + JPEG_WINDOW_MARGIN) * rh * 3)  # the decode window (jpeg_decode_window)
            need_jpeg = max(need_jpeg, (rw + JPEG_WINDOW_MARGIN) * rh * 4)
        boxes[j, 0] = x
        boxes[j, 1] = y
        boxes[j, 2] = cw
        boxes[j, 3] = ch
        boxes[j, 4] = num
        boxes[j, 5] = den
        # enough for either resize mode (a few KiB either way)
        need_rs = max(need_rs, resize_scratch_size(rh, rw, out_h, out_w), fast_scratch_size(rh, rw, out_h, out_w))
    return need_dec, need_jpeg, need_rs


@numba.njit(nogil=True)
def _resize(src, x0, y0, x1, y1, flip, table, out, channels_last, fast, scratch):
    """The exact kernel (Pillow's bits) or, with ``fast``, :func:`pageset.ops.resize_fast.resize_fast`."""
    if fast:
        resize_fast(src, x0, y0, x1, y1, flip, table, out, channels_last, scratch)
    else:
        resize_crop_flip_normalize(src, x0, y0, x1, y1, flip, table, out, channels_last, scratch)


@numba.njit(nogil=True)
def image_slice(handle, buf, offs, lens, heights, widths, encodings, boxes, flips, table, out, rows,
                channels_last, decoded, jpeg_scratch, resize_scratch, status, fast=False):
    """Fill ``out[rows[j]]`` for every sample j of a slice; returns -1, or the first j whose JPEG failed to decode.

    handle: int, the thread's ``JpegDecoder.handle``. buf: uint8[:], bytes holding the records (the thread's
    staging copy, read with pread); offs, lens: int64[n] byte offset and length of each image in ``buf``; heights,
    widths: int64[n] stored size in pixels; encodings: uint8[n] (0 raw HWC RGB, 1 JPEG); boxes, flips: from
    :func:`plan_slice`. fast: the resize mode, False "exact" (Pillow's bits), True "fast"
    (``resize_fast``). table: [3, 256] value table (``image.normalize_table`` / ``pixel_table``), dtype equal to
    out's. out: [B, 3, H, W] or, with ``channels_last``, [B, H, W, 3]; rows: int64[n], the row of ``out`` each
    sample is written to (``arange`` for a slice; a mixture's scattered rows of one file: no copy). decoded, jpeg_scratch (uint8) and
    resize_scratch (int32): at least the sizes :func:`plan_slice` returned. status: int64[n], written with the
    decoder status per sample (0 ok, 1 libjpeg warning, < 0 error; ``jpeg_kernels.ERR_SCRATCH`` asks for larger
    decoded and jpeg_scratch buffers: a JPEG whose subsampling cannot be cropped is decoded whole, so
    ``height * width * 4`` bytes each suffice).

    The crop box is torchvision's (RandomResizedCrop) or FFCV's (CenterCrop) in stored pixels. JPEGs are
    decoded only over the crop's region, at the smallest DCT scale keeping the crop >= the output size
    (``jpeg_scale.choose_scale``); at scale 1/1 the result is Pillow's ``img.crop(box).resize(size, BILINEAR)`` bit
    for bit; at smaller scales the box is mapped into the scaled image (a sub-pixel position).
    """
    for j in range(offs.shape[0]):
        h = heights[j]
        w = widths[j]
        x, y, cw, ch, num, den = boxes[j, 0], boxes[j, 1], boxes[j, 2], boxes[j, 3], boxes[j, 4], boxes[j, 5]
        status[j] = decode_crop_resize(handle, buf[offs[j] : offs[j] + lens[j]], h, w, encodings[j], x, y, cw, ch,
                                       num, den, flips[j], table, out[rows[j]], channels_last, fast, decoded,
                                       jpeg_scratch, resize_scratch)
        if status[j] < 0:
            return j
    return -1


@numba.njit(nogil=True)
def decode_crop_resize(handle, data, h, w, encoding, x, y, cw, ch, num, den, flip, table, out, channels_last, fast,
                       decoded, jpeg_scratch, resize_scratch):
    """One image of a slice: the box ``[x, x+cw) x [y, y+ch)`` of the stored ``h x w`` image ``data`` (raw HWC, or
    a JPEG decoded over the box only at DCT scale num/den) resized, flipped and normalized into ``out``; returns
    the decoder status (0 for a raw image; < 0: the JPEG failed). Arguments as :func:`image_slice`'s."""
    if encoding == ENCODING_RAW:
        src = data.reshape((h, w, 3))[y : y + ch, x : x + cw]
        _resize(src, 0.0, 0.0, float(cw), float(ch), flip, table, out, channels_last, fast, resize_scratch)
        return 0
    sx, sy, sw, sh = jpeg_scale.scale_region(w, h, x, y, cw, ch, num, den)
    # decoded where libjpeg-turbo writes it (an iMCU-aligned window a few columns wider): no copy
    st, h0, w0, row, col = jpeg_kernels.jpeg_decode_window(handle, data, num, den, sx, sy, sw, sh, decoded,
                                                            jpeg_scratch)
    if st < 0:
        return st
    region = jpeg_kernels.window_view(decoded, h0, w0, row, col, sh, sw)
    bx0, by0, bx1, by1 = jpeg_scale.box_in_region(x, y, cw, ch, num, den, sx, sy, sw, sh)
    _resize(region, bx0, by0, bx1, by1, flip, table, out, channels_last, fast, resize_scratch)
    return st


@functools.cache
def prepare() -> None:
    """Load libjpeg-turbo and enable the on-disk cache of the slice kernels and every kernel they call (run
    time, never at import)."""
    jpeg.prepare()
    kernel_cache.enable(sys.modules[__name__], crop, resize, resize_weights, sys.modules[resize_fast.__module__])
