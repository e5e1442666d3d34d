"""The JPEG stage for Python callers: load libjpeg-turbo once, one decompress handle per thread.

:class:`JpegDecoder` owns one TurboJPEG decompress handle (handles are not thread-safe: one per worker thread)
and offers ``info()`` / ``decode()`` for Python callers. Create one (or call :func:`prepare`) before compiling
or calling a kernel that uses the decode kernels: that loads the library and registers its symbols.

The kernels (:func:`jpeg_info`, :func:`jpeg_decode`, status codes) live in :mod:`pageset.ops.jpeg_kernels`
and the DCT-scale arithmetic (:func:`choose_scale`, :func:`scale_region`, ...) in :mod:`pageset.ops.jpeg_scale`;
both are re-exported here, so ``from pageset.ops.jpeg import jpeg_decode, choose_scale`` keeps working.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from pageset.ops import jpeg_kernels, jpeg_restart, jpeg_scale, kernel_cache, turbo
from pageset.ops.jpeg_kernels import (  # noqa: F401  (re-exported)
    ERR_DATA,
    ERR_EMPTY,
    ERR_LIBJPEG,
    ERR_NO_IMAGE,
    ERR_OUT,
    ERR_REGION,
    ERR_RESTART,
    ERR_SCALE,
    ERR_SCRATCH,
    OK,
    STATUS_MESSAGES,
    WARNING,
    jpeg_decode,
    jpeg_decode_window,
    jpeg_info,
    window_view,
)
from pageset.ops.jpeg_scale import (  # noqa: F401  (re-exported)
    SCALES,
    choose_scale,
    decode_window,
    is_supported_scale,
    scale_region,
    scaled_size,
    scratch_bound,
    scratch_size,
    window_bytes,
)

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
    kernel_cache.enable(jpeg_kernels, jpeg_scale, jpeg_restart, turbo)
    return lib


def error_string(handle: int) -> str:
    """The libjpeg-turbo message of the last failed call on ``handle`` (``tj3GetErrorStr``)."""
    return prepare().error_str(handle)


class JpegDecodeError(ValueError):
    """A JPEG could not be decoded; the message carries the status and libjpeg-turbo's text."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status

    def __reduce__(self):  # pickled as its constructor's arguments
        return (type(self), (str(self), self.status))


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
