"""JPEG decoding kernels over libjpeg-turbo (TurboJPEG 3 API), callable from other Numba kernels.

Kernels (``@njit(nogil=True)``, safe to call from other nopython functions, e.g. a fused
decode -> crop/resize loop over a batch slice):

- :func:`jpeg_info` reads the header: size, chroma subsampling, colorspace.
- :func:`jpeg_decode` decodes a region of the image scaled by num/denom (libjpeg-turbo DCT scaling) into
  an HWC RGB uint8 buffer, through ``tj3SetCroppingRegion``: rows below the region cost nothing, rows above
  are only entropy-decoded, columns outside skip the IDCT and colour conversion. Entropy decoding is about
  half the time of a q90 photo, so on 400x350 q90 crops (one core) a full decode takes ~520 us, the top
  half ~285 us, the left half ~520 us, the centre quarter ~370 us, and a 1/2-scale decode ~420 us.

The scale and region arithmetic is in :mod:`pageset.ops.jpeg_scale`; the Python binding (one handle per
thread, :class:`pageset.ops.jpeg.JpegDecoder`, which also loads the library before any kernel compiles) in
:mod:`pageset.ops.jpeg`.

Output matches Pillow (``Image.open(f).convert("RGB")``, and ``Image.draft`` for 1/2, 1/4, 1/8) byte for
byte, including grayscale (channels replicated) and CMYK/YCCK files (Pillow's inverted-Adobe convention
and its CMYK -> RGB formula).

Status codes returned by kernels (int): ``OK`` 0, ``WARNING`` 1 (libjpeg warned, e.g. a truncated scan or
junk before a marker; the image is decoded, missing rows are grey), negative on error: ``ERR_LIBJPEG`` -1
(read the message with ``jpeg.error_string``), ``ERR_EMPTY`` -2, ``ERR_SCALE`` -3, ``ERR_REGION`` -4,
``ERR_OUT`` -5, ``ERR_SCRATCH`` -6, ``ERR_DATA`` -7, ``ERR_NO_IMAGE`` -8 (see :data:`STATUS_MESSAGES`).

Reference: libjpeg-turbo TurboJPEG 3 API (https://libjpeg-turbo.org/Documentation/Documentation,
``turbojpeg.h``): tj3DecompressHeader, tj3Get, tj3SetScalingFactor, tj3SetCroppingRegion, tj3Decompress8.
"""

from __future__ import annotations

import numba
import numpy as np

from pageset.ops import jpeg_restart
from pageset.ops.jpeg_scale import (
    _direct,
    _pixel_size,
    decode_window,
    is_supported_scale,
    scaled_size,
)
from pageset.ops.turbo import (
    TJPARAM_COLORSPACE,
    TJPARAM_JPEGHEIGHT,
    TJPARAM_JPEGWIDTH,
    TJPARAM_SUBSAMP,
    TJPF_CMYK,
    TJPF_RGB,
    failed_with_warning_only,
    require_library,
    tj3Decompress8,
    tj3DecompressHeader,
    tj3Get,
    tj3SetCroppingRegion,
    tj3SetScalingFactor,
)

OK = 0
WARNING = 1
ERR_LIBJPEG = -1
ERR_EMPTY = -2
ERR_SCALE = -3
ERR_REGION = -4
ERR_OUT = -5
ERR_SCRATCH = -6
ERR_DATA = -7
ERR_NO_IMAGE = -8
ERR_RESTART = -9

STATUS_MESSAGES = {
    OK: "ok",
    WARNING: "decoded with a libjpeg warning (corrupt or truncated data; missing rows are grey)",
    ERR_LIBJPEG: "libjpeg-turbo error",
    ERR_EMPTY: "empty input: 0 bytes",
    ERR_SCALE: "unsupported scale: use n/8 for n in 1..8, as a reduced fraction (1/8, 1/4, 3/8, 1/2, ...)",
    ERR_REGION: "region outside the scaled image (or w/h <= 0)",
    ERR_OUT: "out must be uint8[>=h, >=w, 3]",
    ERR_SCRATCH: "scratch too small or not contiguous: size it with scratch_size()",
    ERR_DATA: "data must be a contiguous uint8[:] array",
    ERR_NO_IMAGE: "no image: the data ends (or is truncated) before the first scan (SOS marker)",
    ERR_RESTART: "damaged restart markers: the RSTn markers do not match the header's restart interval (DRI)",
}


@numba.njit(nogil=True)
def _pack2(lo, hi):
    # Two C ints passed by value in one 64-bit register (x86-64 SysV / AAPCS64): lo in bits 0-31.
    return np.int64(lo) | (np.int64(hi) << np.int64(32))


@numba.njit(nogil=True)
def _status_after(rc, handle, warned):
    # tj3* return -1 for warnings too (image usable): see turbo.failed_with_warning_only.
    if rc == 0:
        return WARNING if warned else OK
    return WARNING if failed_with_warning_only(handle) else ERR_LIBJPEG


@numba.njit(nogil=True)
def _reaches_scan(data):
    # tj3DecompressHeader returns 0 *without reading new parameters* when libjpeg meets EOI before the
    # first SOS ("tables-only" stream, or a file truncated inside its header, e.g. b"\xff\xd8"): tj3Get then
    # reports the previous image on this handle. Walk the markers as libjpeg's reader does (skip junk and
    # fill bytes, hop over segments by their length) and say whether SOS comes before EOI. A few hops.
    n = data.size
    i = 2  # after SOI: libjpeg has already rejected data that does not start with it
    while i + 1 < n:
        if data[i] != 0xFF or data[i + 1] == 0xFF or data[i + 1] == 0x00:
            i += 1  # junk between segments (libjpeg warns and skips), fill byte, or stuffed 0xFF00
            continue
        marker = data[i + 1]
        if marker == 0xDA:
            return True
        if marker == 0xD9:
            return False
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # TEM, RSTn, SOI: no length field
            i += 2
            continue
        if i + 3 >= n:
            return False
        i += 2 + ((np.int64(data[i + 2]) << 8) | np.int64(data[i + 3]))
    return False


@numba.njit(nogil=True)
def jpeg_info(handle, data):
    """Read a JPEG header: ``(status, width, height, subsamp, colorspace)``.

    handle: int from :class:`JpegDecoder` ``.handle`` (one thread at a time). data: uint8[:] contiguous,
    the whole file. width/height: unscaled pixels. subsamp: TJSAMP_* (0 4:4:4, 1 4:2:2, 2 4:2:0, 3 gray,
    4 4:4:0, 5 4:1:1, -1 unknown). colorspace: TJCS_* (0 RGB, 1 YCbCr, 2 gray, 3 CMYK, 4 YCCK).
    status: OK, WARNING (header read with a libjpeg warning) or a negative ERR_* (sizes are then 0, -1);
    ERR_NO_IMAGE when the data has no scan (TurboJPEG would report the previous image's header).
    Calls tj3DecompressHeader and tj3Get (TurboJPEG 3 API).
    """
    require_library()
    if data.size == 0:
        return ERR_EMPTY, 0, 0, -1, -1
    if data.strides[0] != 1:
        return ERR_DATA, 0, 0, -1, -1
    rc = tj3DecompressHeader(handle, data.ctypes.data, data.size)
    status = _status_after(rc, handle, False)
    if status < 0:
        return status, 0, 0, -1, -1
    if rc == 0 and not _reaches_scan(data):
        return ERR_NO_IMAGE, 0, 0, -1, -1
    width = tj3Get(handle, TJPARAM_JPEGWIDTH)
    height = tj3Get(handle, TJPARAM_JPEGHEIGHT)
    return status, width, height, tj3Get(handle, TJPARAM_SUBSAMP), tj3Get(handle, TJPARAM_COLORSPACE)


@numba.njit(nogil=True)
def _muldiv255(a, b):
    # Pillow's MULDIV255 (libImaging/ImagingUtils.h): round(a * b / 255) for a, b in 0..255.
    t = a * b + 128
    return ((t >> 8) + t) >> 8


@numba.njit(nogil=True)
def _copy_rgb(scratch, pitch, col0, row0, out, h, w):
    for r in range(h):
        base = (row0 + r) * pitch + col0 * 3
        for c in range(w):
            s = base + 3 * c
            out[r, c, 0] = scratch[s]
            out[r, c, 1] = scratch[s + 1]
            out[r, c, 2] = scratch[s + 2]


@numba.njit(nogil=True)
def _copy_cmyk(scratch, pitch, col0, row0, out, h, w):
    # Pillow reads every 4-channel JPEG as inverted ("CMYK;I", Adobe's convention) and converts with
    # R = nk - C * nk / 255 where C = 255 - raw_c and nk = 255 - K = raw_k.
    for r in range(h):
        base = (row0 + r) * pitch + col0 * 4
        for c in range(w):
            s = base + 4 * c
            nk = np.int32(scratch[s + 3])
            for ch in range(3):
                v = nk - _muldiv255(255 - np.int32(scratch[s + ch]), nk)
                out[r, c, ch] = min(max(v, 0), 255)


@numba.njit(nogil=True)
def _set_region(handle, sw, sh, x0, y0, w0, h0):
    if x0 == 0 and y0 == 0 and w0 == sw and h0 == sh:
        return tj3SetCroppingRegion(handle, _pack2(0, 0), _pack2(0, 0))  # TJUNCROPPED
    return tj3SetCroppingRegion(handle, _pack2(x0, y0), _pack2(w0, h0))


@numba.njit(nogil=True)
def _sub_image(data, scale_num, scale_denom, x, y, w, h):
    # the restart intervals that cover the region, as a JPEG of their own (see pageset.ops.jpeg_restart)
    if data.size == 0 or data.strides[0] != 1 or not is_supported_scale(scale_num, scale_denom):
        return jpeg_restart.NO_RESTART, data[:0], 0, 0
    return jpeg_restart.sub_image(data, scale_num, scale_denom, x, y, w, h)


@numba.njit(nogil=True)
def jpeg_decode(handle, data, scale_num, scale_denom, x, y, w, h, out, scratch):
    """Decode region ``[x, x+w) x [y, y+h)`` of the image scaled by ``scale_num/scale_denom`` into ``out``.

    handle: int, :class:`JpegDecoder` ``.handle`` (not thread-safe: one per thread).
    data: uint8[:] contiguous, the whole JPEG file.
    scale_num, scale_denom: a reduced fraction from :data:`SCALES` (1/8 ... 1/1).
    x, y, w, h: ints, the region in pixels of the *scaled* image (``scaled_size(width, num, denom)`` wide);
    the whole image is ``(0, 0, scaled_w, scaled_h)``.
    out: uint8[>=h, >=w, 3], HWC RGB, any strides; ``out[:h, :w]`` is written, the rest untouched.
    scratch: uint8[:] contiguous, at least :func:`scratch_size` bytes (0 for full-width regions of RGB,
    YCbCr and gray files, which decode straight into ``out`` when its pixels are packed, strides (.., 3, 1)).
    Returns a status: OK 0, WARNING 1 (image written despite corrupt/truncated data), or ERR_* < 0 with
    ``out`` unspecified. Allocates no arrays (libjpeg-turbo mallocs its small working state per call);
    releases the GIL.
    Grayscale files decode to replicated RGB; CMYK/YCCK files decode as TJPF_CMYK and convert to RGB like
    Pillow. Calls tj3DecompressHeader, tj3SetScalingFactor, tj3SetCroppingRegion, tj3Decompress8.

    A baseline file with restart intervals that tile its MCU rows (written with ``RGBImage(jpeg_restart=...)``,
    or any such file) is cut first: only the intervals covering the region, plus one MCU of context, are
    entropy-decoded (:mod:`pageset.ops.jpeg_restart`; the sub-JPEG is a new array of about the file's size), with
    the same pixels. Its markers are checked on every call: ``ERR_RESTART`` when they do not match the header.
    """
    st, sub, dx, dy = _sub_image(data, scale_num, scale_denom, x, y, w, h)
    if st == jpeg_restart.DAMAGED:
        return ERR_RESTART
    if st == jpeg_restart.USABLE:
        return _decode(handle, sub, scale_num, scale_denom, x - dx, y - dy, w, h, out, scratch)
    return _decode(handle, data, scale_num, scale_denom, x, y, w, h, out, scratch)


@numba.njit(nogil=True)
def _decode(handle, data, scale_num, scale_denom, x, y, w, h, out, scratch):
    # jpeg_decode on the file as libjpeg-turbo reads it
    status, width, height, subsamp, colorspace = jpeg_info(handle, data)
    if status < 0:
        return status
    if not is_supported_scale(scale_num, scale_denom):
        return ERR_SCALE
    sw = scaled_size(width, scale_num, scale_denom)
    sh = scaled_size(height, scale_num, scale_denom)
    if x < 0 or y < 0 or w <= 0 or h <= 0 or x + w > sw or y + h > sh:
        return ERR_REGION
    if out.shape[0] < h or out.shape[1] < w or out.shape[2] != 3:
        return ERR_OUT
    if tj3SetScalingFactor(handle, _pack2(scale_num, scale_denom)) != 0:
        return ERR_LIBJPEG
    warned = status == WARNING
    if _direct(width, height, subsamp, colorspace, scale_num, scale_denom, x, y, w, h) and (
        out.strides[1] == 3 and out.strides[2] == 1
    ):
        if _set_region(handle, sw, sh, 0, y, sw, h) != 0:
            return ERR_LIBJPEG
        rc = tj3Decompress8(handle, data.ctypes.data, data.size, out.ctypes.data, out.strides[0], TJPF_RGB)
        return _status_after(rc, handle, warned)
    x0, y0, w0, h0 = decode_window(width, height, subsamp, scale_num, scale_denom, x, y, w, h)
    ps = _pixel_size(colorspace)
    if scratch.size < w0 * h0 * ps or scratch.strides[0] != 1:
        return ERR_SCRATCH
    if _set_region(handle, sw, sh, x0, y0, w0, h0) != 0:
        return ERR_LIBJPEG
    pf = TJPF_CMYK if ps == 4 else TJPF_RGB
    rc = tj3Decompress8(handle, data.ctypes.data, data.size, scratch.ctypes.data, w0 * ps, pf)
    status = _status_after(rc, handle, warned)
    if status < 0:
        return status
    if ps == 4:
        _copy_cmyk(scratch, w0 * 4, x - x0, y - y0, out, h, w)
    else:
        _copy_rgb(scratch, w0 * 3, x - x0, y - y0, out, h, w)
    return status


@numba.njit(nogil=True)
def jpeg_decode_window(handle, data, scale_num, scale_denom, x, y, w, h, buf, scratch):
    """:func:`jpeg_decode` without the final copy: the region is decoded where libjpeg-turbo writes it.

    Same arguments and statuses as :func:`jpeg_decode`, except ``buf``: uint8[:] contiguous, receiving the
    :func:`pageset.ops.jpeg_scale.decode_window` (iMCU-aligned, a few columns wider than the region) as packed
    RGB rows. Returns ``(status, h0, w0, row, col)``: the region is
    ``buf[:h0 * w0 * 3].reshape((h0, w0, 3))[row:row + h, col:col + w]`` (see :func:`window_view`), bit for bit
    what :func:`jpeg_decode` writes. Needs ``buf.size >= window_bytes(...) // 4 * 3`` (at most
    ``(w + 96) * h * 3`` for a croppable image; the whole scaled image otherwise), else ``ERR_SCRATCH``;
    ``scratch`` is used only by CMYK/YCCK files (converted into ``buf`` as an ``h x w`` image, row = col = 0).
    Saves the copy of every decoded pixel (about 0.1 ms for a 300 x 300 region). Restart intervals are used and
    checked as in :func:`jpeg_decode` (``ERR_RESTART``).
    """
    st, sub, dx, dy = _sub_image(data, scale_num, scale_denom, x, y, w, h)
    if st == jpeg_restart.DAMAGED:
        return ERR_RESTART, 0, 0, 0, 0
    if st == jpeg_restart.USABLE:
        return _decode_window(handle, sub, scale_num, scale_denom, x - dx, y - dy, w, h, buf, scratch)
    return _decode_window(handle, data, scale_num, scale_denom, x, y, w, h, buf, scratch)


@numba.njit(nogil=True)
def _decode_window(handle, data, scale_num, scale_denom, x, y, w, h, buf, scratch):
    # jpeg_decode_window on the file as libjpeg-turbo reads it
    status, width, height, subsamp, colorspace = jpeg_info(handle, data)
    if status < 0:
        return status, 0, 0, 0, 0
    if not is_supported_scale(scale_num, scale_denom):
        return ERR_SCALE, 0, 0, 0, 0
    sw = scaled_size(width, scale_num, scale_denom)
    sh = scaled_size(height, scale_num, scale_denom)
    if x < 0 or y < 0 or w <= 0 or h <= 0 or x + w > sw or y + h > sh:
        return ERR_REGION, 0, 0, 0, 0
    if buf.strides[0] != 1:
        return ERR_DATA, 0, 0, 0, 0
    if tj3SetScalingFactor(handle, _pack2(scale_num, scale_denom)) != 0:
        return ERR_LIBJPEG, 0, 0, 0, 0
    warned = status == WARNING
    x0, y0, w0, h0 = decode_window(width, height, subsamp, scale_num, scale_denom, x, y, w, h)
    ps = _pixel_size(colorspace)
    if ps == 4:
        if buf.size < h * w * 3:
            return ERR_SCRATCH, 0, 0, 0, 0
        out = buf[:h * w * 3].reshape((h, w, 3))
        return _decode(handle, data, scale_num, scale_denom, x, y, w, h, out, scratch), h, w, 0, 0
    if buf.size < w0 * h0 * 3:
        return ERR_SCRATCH, 0, 0, 0, 0
    if _set_region(handle, sw, sh, x0, y0, w0, h0) != 0:
        return ERR_LIBJPEG, 0, 0, 0, 0
    rc = tj3Decompress8(handle, data.ctypes.data, data.size, buf.ctypes.data, w0 * 3, TJPF_RGB)
    return _status_after(rc, handle, warned), h0, w0, y - y0, x - x0


@numba.njit(nogil=True)
def window_view(buf, h0, w0, row, col, h, w):
    """The ``h x w`` region inside a window written by :func:`jpeg_decode_window`: uint8[h, w, 3], a view."""
    return buf[:h0 * w0 * 3].reshape((h0, w0, 3))[row:row + h, col:col + w]
