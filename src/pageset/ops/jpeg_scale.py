"""DCT-scale and region arithmetic of the JPEG stage: which scale to decode at, which region, which scratch.

- :func:`choose_scale`: the smallest libjpeg-turbo DCT scale (:data:`SCALES`) keeping a crop >= the output.
- :func:`scaled_size`, :func:`scale_region`: sizes and regions in pixels of the scaled image.
- :func:`decode_window`, :func:`scratch_size`, :func:`window_bytes`, :func:`scratch_bound`: the region
  libjpeg-turbo actually decodes (iMCU-aligned, with context) and the scratch bytes it needs.

All ``@numba.njit(nogil=True)`` integer arithmetic; no library call. The decode kernels are in
:mod:`pageset.ops.jpeg_kernels`.
"""

from __future__ import annotations

import numba

from pageset.ops.turbo import MCU_WIDTH, TJCS_CMYK, TJCS_YCCK

# DCT scales libjpeg-turbo implements below 1, ascending, as reduced fractions (tj3SetScalingFactor
# matches num and denom exactly: 4/8 is rejected, 1/2 accepted). IDCT and colour work shrink with the
# area; entropy decoding (about half of a q90 decode) does not.
SCALES = ((1, 8), (1, 4), (3, 8), (1, 2), (5, 8), (3, 4), (7, 8), (1, 1))


@numba.njit(nogil=True)
def scaled_size(dim, num, denom):
    """A dimension in pixels after DCT scaling by num/denom, as libjpeg-turbo computes it.

    ``TJSCALED(dim, sf) = ceil(dim * num / denom)`` (turbojpeg.h). Ints in, int out.
    """
    return (dim * num + denom - 1) // denom


@numba.njit(nogil=True)
def is_supported_scale(num, denom):
    """True when num/denom is one of :data:`SCALES` (exact reduced fraction)."""
    for s in SCALES:
        if s[0] == num and s[1] == denom:
            return True
    return False


@numba.njit(nogil=True)
def choose_scale(width, height, crop_w, crop_h, out_w, out_h):
    """Smallest DCT scale that keeps the scaled crop at least ``out_w x out_h``.

    Args are ints in original image pixels (``width x height`` image, ``crop_w x crop_h`` crop, clamped
    to the image) and output pixels. The scaled crop is measured conservatively as
    ``floor(crop * num / denom)``. Returns ``(num, denom)`` from :data:`SCALES`; (1, 1) when even the
    full-size crop is smaller than the output (upsampling).
    """
    cw = min(crop_w, width)
    ch = min(crop_h, height)
    for s in SCALES:
        if cw * s[0] // s[1] >= out_w and ch * s[0] // s[1] >= out_h:
            return s[0], s[1]
    return 1, 1


@numba.njit(nogil=True)
def scale_region(width, height, x, y, w, h, num, denom):
    """Map a region of the original image to the smallest covering region of the scaled image.

    ``[x, x+w) x [y, y+h)`` in original pixels -> ``(sx, sy, sw, sh)`` in pixels of the image decoded at
    num/denom: ``floor`` at the start, ``ceil`` at the end, clamped to ``scaled_size`` of the image.
    """
    sw_img = scaled_size(width, num, denom)
    sh_img = scaled_size(height, num, denom)
    sx = min(x * num // denom, sw_img - 1)
    sy = min(y * num // denom, sh_img - 1)
    sx1 = min(scaled_size(x + w, num, denom), sw_img)
    sy1 = min(scaled_size(y + h, num, denom), sh_img)
    return sx, sy, max(sx1 - sx, 1), max(sy1 - sy, 1)


@numba.njit(nogil=True)
def box_in_region(x, y, w, h, num, denom, sx, sy, sw, sh):
    """The crop ``[x, x+w) x [y, y+h)`` (original pixels) in the coordinates of the decoded region ``(sx, sy, sw,
    sh)`` of :func:`scale_region`: ``(x0, y0, x1, y1)`` floats, scaled by num/denom, shifted to the region and
    kept inside it with at least 1e-3 px of width and height (what the resize kernel samples)."""
    f = num / denom
    x0 = min(max(x * f - sx, 0.0), sw - 1e-3)
    y0 = min(max(y * f - sy, 0.0), sh - 1e-3)
    x1 = min(max((x + w) * f - sx, x0 + 1e-3), float(sw))
    y1 = min(max((y + h) * f - sy, y0 + 1e-3), float(sh))
    return x0, y0, x1, y1


@numba.njit(nogil=True)
def _known_subsamp(subsamp):
    return 0 <= subsamp < len(MCU_WIDTH)


@numba.njit(nogil=True)
def decode_window(width, height, subsamp, num, denom, x, y, w, h):
    """The region libjpeg-turbo actually decodes for a wanted region: ``(x0, y0, w0, h0)``, scaled pixels.

    x is widened down to a scaled-iMCU boundary (tj3SetCroppingRegion requires it) and then by one more
    iMCU on each side: libjpeg's fancy chroma upsampling treats the cropped edge as an image edge, which
    changes the edge columns; one spare iMCU of context keeps the wanted columns bit-identical to a full
    decode. Rows need no margin (libjpeg-turbo skips rows with context). Unknown subsampling cannot be
    cropped: the whole scaled image is decoded. ``width``/``height`` are the unscaled image size.
    """
    sw = scaled_size(width, num, denom)
    if not _known_subsamp(subsamp):
        return 0, 0, sw, scaled_size(height, num, denom)
    m = scaled_size(MCU_WIDTH[subsamp], num, denom)
    x0 = max(0, (x // m - 1) * m)
    x1 = min(sw, ((x + w + m - 1) // m + 1) * m)
    return x0, y, x1 - x0, h


@numba.njit(nogil=True)
def _pixel_size(colorspace):
    return 4 if colorspace == TJCS_CMYK or colorspace == TJCS_YCCK else 3


@numba.njit(nogil=True)
def _direct(width, height, subsamp, colorspace, num, denom, x, y, w, h):
    # Decode straight into out (no scratch): full scaled width, RGB output, and rows croppable.
    sw = scaled_size(width, num, denom)
    if x != 0 or w != sw or _pixel_size(colorspace) != 3:
        return False
    return _known_subsamp(subsamp) or (y == 0 and h == scaled_size(height, num, denom))


@numba.njit(nogil=True)
def scratch_size(width, height, subsamp, colorspace, num, denom, x, y, w, h):
    """Bytes of ``scratch`` that :func:`jpeg_decode` needs for this image, scale and region.

    Args: the header values from :func:`jpeg_info` (unscaled ``width``, ``height``, ``subsamp``,
    ``colorspace``), the scale, and the region in scaled pixels. Returns 0 when the decoder writes straight
    into ``out`` (the region spans the full scaled width of an RGB/YCbCr/gray image), else
    ``w0 * h0 * bytes_per_pixel`` of the :func:`decode_window` (3 bytes RGB, 4 for CMYK/YCCK files).
    The 0 assumes ``out`` has packed pixels (strides ``(.., 3, 1)``); otherwise size for the window.
    For a cropped region of an image with known subsampling that is at most ``(w + 4 * iMCU) * h * 4``
    (scaled iMCU <= 32 pixels; 16 for 4:2:0 at 1/1); with unknown subsampling (rare sampling factors,
    not croppable) the whole scaled image: :func:`scratch_bound` bounds every case for images up to a size.
    """
    if _direct(width, height, subsamp, colorspace, num, denom, x, y, w, h):
        return 0
    return window_bytes(width, height, subsamp, colorspace, num, denom, x, y, w, h)


@numba.njit(nogil=True)
def window_bytes(width, height, subsamp, colorspace, num, denom, x, y, w, h):
    """Bytes of the :func:`decode_window` in the decoder's pixel format: scratch needed for any ``out``."""
    _, _, w0, h0 = decode_window(width, height, subsamp, num, denom, x, y, w, h)
    return w0 * h0 * _pixel_size(colorspace)


@numba.njit(nogil=True)
def scratch_bound(max_width, max_height):
    """Scratch bytes enough for any scale and region of any image up to ``max_width x max_height``."""
    return max_width * max_height * 4
