"""JPEG decoding kernels over libjpeg-turbo (TurboJPEG 3 API), callable from other Numba kernels.

Kernels (``@njit(nogil=True)``, safe to call from other nopython functions, e.g. a fused
decode -> crop/resize loop over a batch slice):

- :func:`jpeg_info` reads the header: size, chroma subsampling, colorspace.
- :func:`jpeg_decode` decodes a region of the image scaled by num/denom (libjpeg-turbo DCT scaling) into
  an HWC RGB uint8 buffer, through ``tj3SetCroppingRegion``: rows below the region cost nothing, rows above
  are only entropy-decoded, columns outside skip the IDCT and colour conversion. Entropy decoding is about
  half the time of a q90 photo, so on 400x350 q90 crops (one core) a full decode takes ~520 us, the top
  half ~285 us, the left half ~520 us, the centre quarter ~370 us, and a 1/2-scale decode ~420 us.
- :func:`choose_scale`, :func:`scaled_size`, :func:`scale_region`, :func:`scratch_size` do the arithmetic.

:class:`JpegDecoder` owns one decompress handle (handles are not thread-safe: one per worker thread) and
offers ``info()`` / ``decode()`` for Python callers. Create one (or call ``prepare()``) before compiling
or calling a kernel that uses these functions: that loads the library and registers its symbols.

Output matches Pillow (``Image.open(f).convert("RGB")``, and ``Image.draft`` for 1/2, 1/4, 1/8) byte for
byte, including grayscale (channels replicated) and CMYK/YCCK files (Pillow's inverted-Adobe convention
and its CMYK -> RGB formula).

Status codes returned by kernels (int): ``OK`` 0, ``WARNING`` 1 (libjpeg warned, e.g. a truncated scan or
junk before a marker; the image is decoded, missing rows are grey), negative on error: ``ERR_LIBJPEG`` -1
(read the message with :func:`error_string`), ``ERR_EMPTY`` -2, ``ERR_SCALE`` -3, ``ERR_REGION`` -4,
``ERR_OUT`` -5, ``ERR_SCRATCH`` -6, ``ERR_DATA`` -7, ``ERR_NO_IMAGE`` -8 (see :data:`STATUS_MESSAGES`).

Reference: libjpeg-turbo TurboJPEG 3 API (https://libjpeg-turbo.org/Documentation/Documentation,
``turbojpeg.h``): tj3DecompressHeader, tj3Get, tj3SetScalingFactor, tj3SetCroppingRegion, tj3Decompress8.
"""

from __future__ import annotations

import functools
import threading

import numba
import numpy as np

from pageset.ops import turbo
from pageset.ops.turbo import (
    MCU_WIDTH,
    TJCS_CMYK,
    TJCS_YCCK,
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
}

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
    """
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


# Kernels whose compiled code is cached on disk once the library is loaded (see prepare()).
_KERNELS = (jpeg_info, jpeg_decode, choose_scale, scale_region, scratch_size)
_PREPARE_LOCK = threading.Lock()  # worker threads may create their decoders at the same moment


def prepare() -> turbo.TurboJpegLibrary:
    """Load libjpeg-turbo, register its symbols and enable the kernels' on-disk cache; once per process.

    Caching is chosen here, at run time, not at import: numba picks a writable cache directory
    (``__pycache__`` next to this file, else the user-wide cache dir); if none is writable the kernels
    simply compile in each process. Raises :class:`pageset.ops.turbo.TurboJpegNotFoundError`.
    """
    with _PREPARE_LOCK:
        return _prepare_once()


@functools.cache
def _prepare_once() -> turbo.TurboJpegLibrary:
    lib = turbo.load_library()
    if not numba.config.DISABLE_JIT:
        for kernel in _KERNELS:
            try:
                kernel.enable_caching()
            except RuntimeError:  # "cannot cache function ...: no locator available" (read-only install)
                pass
    return lib


def error_string(handle: int) -> str:
    """The libjpeg-turbo message of the last failed call on ``handle`` (``tj3GetErrorStr``)."""
    return prepare().error_str(handle)


class JpegDecodeError(ValueError):
    """A JPEG could not be decoded; the message carries the status and libjpeg-turbo's text."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _as_bytes_array(data) -> np.ndarray:
    # One array type for every input (read-only, C-contiguous uint8[:]) so the kernel compiles once.
    arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise TypeError(f"data must be bytes-like or uint8[:], got {arr.dtype}{list(arr.shape)}")
    arr = np.ascontiguousarray(arr).view()
    arr.flags.writeable = False
    return arr


class JpegDecoder:
    """One TurboJPEG decompress handle plus a reusable scratch buffer: use one per worker thread.

    ``.handle`` (int) is what the kernels take. Free it with :meth:`close` (also on ``__del__`` and
    ``with``). Raises :class:`pageset.ops.turbo.TurboJpegNotFoundError` when libjpeg-turbo is missing.
    """

    def __init__(self):
        self._lib = prepare()
        self.handle: int = self._lib.init_decompress()
        self._scratch = np.empty(0, dtype=np.uint8)
        self.last_warning: str | None = None  # libjpeg's text when the last decode returned WARNING

    def close(self) -> None:
        """Free the handle (``tj3Destroy``); idempotent."""
        handle, self.handle = getattr(self, "handle", 0), 0
        if handle:
            self._lib.destroy(handle)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: ctypes or the library may already be gone
            pass

    def __enter__(self) -> JpegDecoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self, status: int) -> None:
        if status == WARNING:
            self.last_warning = self._lib.error_str(self.handle)
        if status >= 0:
            return
        detail = self._lib.error_str(self.handle) if status == ERR_LIBJPEG else STATUS_MESSAGES[status]
        raise JpegDecodeError(f"cannot decode JPEG (status {status}): {detail.strip()}", status)

    def _live_handle(self) -> int:
        if not self.handle:
            raise ValueError("JpegDecoder is closed")
        return self.handle

    def header(self, data) -> tuple[int, int, int, int]:
        """``(width, height, subsamp, colorspace)`` of a JPEG (see :func:`jpeg_info`)."""
        status, width, height, subsamp, colorspace = jpeg_info(self._live_handle(), _as_bytes_array(data))
        self._check(status)
        return width, height, subsamp, colorspace

    def info(self, data) -> tuple[int, int]:
        """``(width, height)`` in pixels from the header; JpegDecodeError when unreadable."""
        return self.header(data)[:2]

    def decode(self, data, scale: tuple[int, int] = (1, 1), region=None) -> np.ndarray:
        """Decode to a new ``uint8[H, W, 3]`` RGB array.

        scale: ``(num, denom)`` from :data:`SCALES`. region: ``(x, y, w, h)`` in pixels of the scaled image,
        default the whole image (then ``H, W`` are the scaled size). Raises :class:`JpegDecodeError` with
        libjpeg-turbo's message on errors; warnings (truncated data) return the image and set
        ``last_warning``.
        """
        arr = _as_bytes_array(data)
        num, denom = (int(v) for v in scale)
        if not is_supported_scale(num, denom):
            raise JpegDecodeError(f"{STATUS_MESSAGES[ERR_SCALE]}; got {num}/{denom}", ERR_SCALE)
        width, height, subsamp, colorspace = self.header(arr)
        sw, sh = scaled_size(width, num, denom), scaled_size(height, num, denom)
        x, y, w, h = (0, 0, sw, sh) if region is None else (int(v) for v in region)
        if x < 0 or y < 0 or w <= 0 or h <= 0 or x + w > sw or y + h > sh:
            raise JpegDecodeError(
                f"region (x, y, w, h) = {(x, y, w, h)} is outside the {sw}x{sh} image "
                f"(a {width}x{height} JPEG decoded at scale {num}/{denom}) or empty",
                ERR_REGION,
            )
        out = np.empty((max(h, 0), max(w, 0), 3), dtype=np.uint8)
        need = scratch_size(width, height, subsamp, colorspace, num, denom, x, y, w, h)
        if self._scratch.size < need:
            self._scratch = np.empty(need, dtype=np.uint8)
        self.last_warning = None
        self._check(jpeg_decode(self._live_handle(), arr, num, denom, x, y, w, h, out, self._scratch))
        return out
