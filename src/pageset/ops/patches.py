"""Dynamic resolution on a patch grid (Qwen2-VL's image input): each image resized to its own size, a multiple of
``patch_size * merge_size`` within ``[min_pixels, max_pixels]`` ("smart resize"), normalized and cut into
flattened patches, as transformers' ``Qwen2VLImageProcessor`` lays them out.

Source: Qwen2-VL (Wang et al., 2024, "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at Any
Resolution", arXiv:2409.12191) and transformers' ``models/qwen2_vl/image_processing_qwen2_vl.py``
(``smart_resize``; the patch order below). The images of a slice go through one nogil kernel call
(:func:`patch_slice`): full-image JPEG decode at the smallest DCT scale keeping the target size, the resize
kernels of the fixed-size path (Pillow's BILINEAR bits, or the fast mode), the normalize table, then the patch
copy.

Patch layout of an image resized to ``H x W`` (``gh = H / p``, ``gw = W / p``; p = patch_size, m = merge_size,
T = temporal_patch_size): ``gh * gw`` rows of ``3 * T * p * p`` values. Row ``((bh * (gw / m) + bw) * m + mh) * m
+ mw`` is the patch at grid row ``bh * m + mh``, column ``bw * m + mw`` (the m x m patches one merged token reads
are consecutive); within it, value ``((c * T + t) * p + y) * p + x`` is channel c at pixel ``(y, x)`` of the patch,
the same for every t (a still image is its own T frames). The image's grid is ``(1, gh, gw)`` and it takes ``gh *
gw / m**2`` image tokens.
"""

from __future__ import annotations

import functools
import math
import sys

import numba
import numpy as np

from pageset.format.constants import ENCODING_RAW
from pageset.ops import image_batch, jpeg_scale, kernel_cache
from pageset.ops.image_batch import JPEG_WINDOW_MARGIN, decode_crop_resize
from pageset.ops.resize import resize_scratch_size
from pageset.ops.resize_fast import fast_scratch_size

MAX_ASPECT = 200  # Qwen2-VL refuses images whose long side is more than 200 times the short one


@numba.njit(nogil=True)
def smart_resize(height, width, factor, min_pixels, max_pixels):
    """``(resized height, resized width)``: both multiples of ``factor`` (``patch_size * merge_size``), their
    product within ``[min_pixels, max_pixels]``, the aspect kept as closely as that allows; transformers'
    ``smart_resize`` step for step (Python's round half to even is ``np.rint``). ``(-1, -1)`` when the long side
    is more than :data:`MAX_ASPECT` times the short one (Qwen2-VL refuses such an image)."""
    if max(height, width) > MAX_ASPECT * min(height, width):
        return -1, -1
    h_bar = int(np.rint(height / factor)) * factor
    w_bar = int(np.rint(width / factor)) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, int(math.floor(height / beta / factor)) * factor)
        w_bar = max(factor, int(math.floor(width / beta / factor)) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = int(math.ceil(height * beta / factor)) * factor
        w_bar = int(math.ceil(width * beta / factor)) * factor
    return h_bar, w_bar


@numba.njit(nogil=True)
def image_grids(heights, widths, patch, merge, min_pixels, max_pixels, grid_h, grid_w, tokens):
    """Per image i (stored ``heights[i] x widths[i]`` pixels, int64[n]): ``grid_h[i]``, ``grid_w[i]`` (patches)
    and ``tokens[i]`` (``grid_h * grid_w / merge**2``) after :func:`smart_resize`. Returns -1, or the first i
    whose aspect ratio Qwen2-VL refuses."""
    for i in range(heights.shape[0]):
        rh, rw = smart_resize(heights[i], widths[i], patch * merge, min_pixels, max_pixels)
        if rh < 0:
            return i
        grid_h[i] = rh // patch
        grid_w[i] = rw // patch
        tokens[i] = grid_h[i] * grid_w[i] // (merge * merge)
    return -1


@numba.njit(nogil=True)
def plan_patches(heights, widths, encodings, grid_h, grid_w, patch, scales):
    """DCT scales (``scales`` int64[n, 2] = num, denom) and the scratch :func:`patch_slice` needs for a slice:
    (decoded bytes, JPEG scratch bytes, resize scratch int32 elements, resized image elements)."""
    need_dec = 0
    need_jpeg = 0
    need_rs = 0
    need_img = 0
    for i in range(heights.shape[0]):
        h, w = heights[i], widths[i]
        out_h, out_w = grid_h[i] * patch, grid_w[i] * patch
        if encodings[i] == ENCODING_RAW:
            num, den = 1, 1
            rh, rw = h, w
        else:
            num, den = jpeg_scale.choose_scale(w, h, w, h, out_w, out_h)
            sx, sy, rw, rh = jpeg_scale.scale_region(w, h, 0, 0, w, h, num, den)
            need_dec = max(need_dec, (rw + JPEG_WINDOW_MARGIN) * rh * 3)
            need_jpeg = max(need_jpeg, (rw + JPEG_WINDOW_MARGIN) * rh * 4)
        scales[i, 0] = num
        scales[i, 1] = den
        need_rs = max(need_rs, resize_scratch_size(rh, rw, out_h, out_w), fast_scratch_size(rh, rw, out_h, out_w))
        need_img = max(need_img, 3 * out_h * out_w)
    return need_dec, need_jpeg, need_rs, need_img


@numba.njit(nogil=True)
def patchify(img, out, patch, merge, temporal):
    """Copy ``img`` ([3, H, W], H and W multiples of ``patch * merge``) into ``out`` ([gh * gw, 3 * temporal *
    patch**2], the first gh * gw rows of it) in the module's patch layout."""
    gh = img.shape[1] // patch
    gw = img.shape[2] // patch
    q = 0
    for bh in range(gh // merge):
        for bw in range(gw // merge):
            for mh in range(merge):
                for mw in range(merge):
                    y0 = (bh * merge + mh) * patch
                    x0 = (bw * merge + mw) * patch
                    v = 0
                    for c in range(3):
                        for t in range(temporal):
                            for y in range(patch):
                                for x in range(patch):
                                    out[q, v] = img[c, y0 + y, x0 + x]
                                    v += 1
                    q += 1


@numba.njit(nogil=True)
def patch_slice(handle, buf, offs, lens, heights, widths, encodings, grid_h, grid_w, scales, rows, firsts, table,
                out, patch, merge, temporal, decoded, jpeg_scratch, resize_scratch, image, status, fast):
    """Write image i's patches into ``out[rows[i], firsts[i]:firsts[i] + grid_h[i] * grid_w[i]]``; returns -1,
    or the first i whose JPEG failed to decode (``status[i]`` < 0, as in ``image_batch.image_slice``).

    buf: uint8[:] the gathered records; offs, lens: int64[n] each image's bytes in ``buf``; heights, widths:
    int64[n] stored pixels; encodings: uint8[n]; grid_h, grid_w: int64[n] from :func:`image_grids`; scales:
    from :func:`plan_patches`; table: [3, 256] normalize table of out's dtype; out: [B, P, 3 * temporal *
    patch**2]; decoded, jpeg_scratch (uint8), resize_scratch (int32), image (out's dtype): at least the sizes
    :func:`plan_patches` returned; fast: the resize mode (False: Pillow's BILINEAR bits)."""
    for i in range(offs.shape[0]):
        h, w = heights[i], widths[i]
        out_h, out_w = grid_h[i] * patch, grid_w[i] * patch
        img = image[: 3 * out_h * out_w].reshape((3, out_h, out_w))
        status[i] = decode_crop_resize(handle, buf[offs[i] : offs[i] + lens[i]], h, w, encodings[i], 0, 0, w, h,
                                       scales[i, 0], scales[i, 1], False, table, img, False, fast, decoded,
                                       jpeg_scratch, resize_scratch)
        if status[i] < 0:
            return i
        n = grid_h[i] * grid_w[i]
        patchify(img, out[rows[i], firsts[i] : firsts[i] + n], patch, merge, temporal)
    return -1


@functools.cache
def prepare() -> None:
    """Load libjpeg-turbo and enable the on-disk cache of this module's kernels and those they call (run time,
    never at import; idempotent)."""
    image_batch.prepare()
    kernel_cache.enable(sys.modules[__name__])
