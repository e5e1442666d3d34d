"""Find libjpeg-turbo's TurboJPEG 3 library and bind it for Numba nopython code.

The library comes from the ``turbojpeg==0.0.2`` wheel, which bundles
``turbojpeg.libs/libturbojpeg-*.so*`` (libjpeg-turbo 2.1.92, the 3.0 API). We locate it by path through
``importlib.metadata.files("turbojpeg")`` and never ``import turbojpeg`` (PyTurboJPEG installs a module of
the same name). Debian's ``libturbojpeg0`` (2.1.x) has only the TJ2 API (no ``tj3SetCroppingRegion``), so it
is not used: without the wheel, :func:`load_library` raises :class:`TurboJpegNotFoundError`.

How kernels call C: each symbol is registered with ``llvmlite.binding.add_symbol`` under the prefix
``pageset_`` and declared as a ``numba.types.ExternalFunction``. The compiled code then refers to the symbol
by name, so ``cache=True`` works across processes (a ctypes function object is a "dynamic global" that
forces a recompile in every process). Pointers travel as ``uintp``; the two small structs the API passes by
value are packed into 64-bit integers (System V x86-64 / AAPCS64 pass an 8-byte struct of ints in one
register: ``tjscalingfactor`` {num, denom} -> one int64, ``tjregion`` {x, y, w, h} -> two int64).
Windows x64 passes such structs differently; this module targets Linux.

Nothing happens at import: the library is found, loaded and its symbols registered by the first call of
:func:`load_library` (cached). Kernels call :func:`require_library` first: an intrinsic whose typing step
calls :func:`load_library`, so the symbols exist before LLVM resolves them (an unresolved
``ExternalFunction`` symbol segfaults the process instead of raising).

Under ``NUMBA_DISABLE_JIT=1`` the same names are lazily resolved ctypes functions, so kernel bodies still
run (slowly) as plain Python.

Reference: libjpeg-turbo TurboJPEG 3 API, https://libjpeg-turbo.org/Documentation/Documentation
(``turbojpeg.h``: tj3Init, tj3DecompressHeader, tj3Get, tj3SetScalingFactor, tj3SetCroppingRegion,
tj3Decompress8, tj3GetErrorCode, tj3GetErrorStr, tj3Destroy).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import threading
from pathlib import Path

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

DISTRIBUTION = "turbojpeg"
INSTALL_HINT = "pip install 'turbojpeg==0.0.2'  (bundles libjpeg-turbo with the TurboJPEG 3 API)"
SYMBOL_PREFIX = "pageset_"

# enum values from turbojpeg.h (TurboJPEG 3.0): part of the C ABI, never renumbered upstream.
TJINIT_DECOMPRESS = 1
TJPF_RGB = 0  # 3 bytes per pixel, R G B
TJPF_CMYK = 11  # 4 bytes per pixel, raw C M Y K samples as stored (Adobe files store them inverted)
TJPARAM_SUBSAMP = 4
TJPARAM_JPEGWIDTH = 5
TJPARAM_JPEGHEIGHT = 6
TJPARAM_PRECISION = 7
TJPARAM_COLORSPACE = 8
TJCS_RGB, TJCS_YCBCR, TJCS_GRAY, TJCS_CMYK, TJCS_YCCK = 0, 1, 2, 3, 4
TJSAMP_444, TJSAMP_422, TJSAMP_420, TJSAMP_GRAY, TJSAMP_440, TJSAMP_411 = 0, 1, 2, 3, 4, 5
TJSAMP_UNKNOWN = -1
TJERR_WARNING = 0  # tj3GetErrorCode: the image decoded, with a libjpeg warning (e.g. truncated scan)
TJERR_FATAL = 1
# iMCU width in pixels per TJSAMP value (tjMCUWidth in turbojpeg.h): 8 for 4:4:4/gray/4:4:0, 16 for
# 4:2:2/4:2:0, 32 for 4:1:1. A cropping region's x must be a multiple of the *scaled* iMCU width.
MCU_WIDTH = (8, 16, 16, 8, 8, 32)

_handle = types.intp
_ptr = types.uintp
# name -> (Numba signature for kernels, ctypes restype, ctypes argtypes). Only what kernels call.
_KERNEL_SYMBOLS = {
    "tj3DecompressHeader": (
        types.int32(_handle, _ptr, types.uintp),
        ctypes.c_int,
        (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t),
    ),
    "tj3Get": (types.int32(_handle, types.int32), ctypes.c_int, (ctypes.c_void_p, ctypes.c_int)),
    "tj3SetScalingFactor": (
        types.int32(_handle, types.int64),
        ctypes.c_int,
        (ctypes.c_void_p, ctypes.c_int64),
    ),
    "tj3SetCroppingRegion": (
        types.int32(_handle, types.int64, types.int64),
        ctypes.c_int,
        (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64),
    ),
    "tj3Decompress8": (
        types.int32(_handle, _ptr, types.uintp, _ptr, types.int32, types.int32),
        ctypes.c_int,
        (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_int),
    ),
    "tj3GetErrorCode": (types.int32(_handle), ctypes.c_int, (ctypes.c_void_p,)),
    "tj3GetErrorStr": (types.voidptr(_handle), ctypes.c_char_p, (ctypes.c_void_p,)),
}
# Called from Python only (handle lifetime and error text).
_PYTHON_SYMBOLS = {
    "tj3Init": (ctypes.c_void_p, (ctypes.c_int,)),
    "tj3Destroy": (None, (ctypes.c_void_p,)),
}


class TurboJpegNotFoundError(ImportError):
    """libjpeg-turbo's TurboJPEG 3 library was not found; the message says what to install."""


def find_library() -> Path:
    """Path of ``libturbojpeg-*.so*`` inside the installed ``turbojpeg`` wheel.

    Raises :class:`TurboJpegNotFoundError` (an ``ImportError``) naming the pip command when the
    distribution is missing or ships no such file.
    """
    try:
        files = importlib.metadata.files(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise TurboJpegNotFoundError(
            f"libjpeg-turbo (TurboJPEG 3 API) not found: the '{DISTRIBUTION}' distribution is not installed. "
            f"Fix: {INSTALL_HINT}"
        ) from None
    for f in files:
        if f.parent.name == "turbojpeg.libs" and f.name.startswith("libturbojpeg") and ".so" in f.name:
            path = Path(f.locate()).resolve()
            if path.is_file():
                return path
    raise TurboJpegNotFoundError(
        f"libjpeg-turbo not found: the installed '{DISTRIBUTION}' distribution has no "
        f"turbojpeg.libs/libturbojpeg-*.so* (a non-Linux or broken wheel?). Fix: {INSTALL_HINT}"
    )


class TurboJpegLibrary:
    """The loaded library: ctypes functions for Python-side calls, symbols registered for kernels.

    Create it through :func:`load_library` (one per process). Methods take and return handles as ints.
    """

    def __init__(self, path: Path):
        import llvmlite.binding as llvm

        self.path = path
        self.cdll = ctypes.CDLL(str(path))
        self.cfuncs: dict[str, ctypes._CFuncPtr] = {}
        for name, (_sig, restype, argtypes) in _KERNEL_SYMBOLS.items():
            self._bind(name, restype, argtypes)
            llvm.add_symbol(SYMBOL_PREFIX + name, ctypes.cast(self.cfuncs[name], ctypes.c_void_p).value)
        for name, (restype, argtypes) in _PYTHON_SYMBOLS.items():
            self._bind(name, restype, argtypes)

    def _bind(self, name: str, restype, argtypes) -> None:
        fn = getattr(self.cdll, name)
        fn.restype, fn.argtypes = restype, argtypes
        self.cfuncs[name] = fn

    def init_decompress(self) -> int:
        """A new decompress handle (``tj3Init(TJINIT_DECOMPRESS)``), as an int; MemoryError if NULL."""
        handle = self.cfuncs["tj3Init"](TJINIT_DECOMPRESS)
        if not handle:
            raise MemoryError(f"tj3Init(TJINIT_DECOMPRESS) failed: {self.error_str(0)}")
        return handle

    def destroy(self, handle: int) -> None:
        """Free a handle from :meth:`init_decompress` (``tj3Destroy``); never call twice on one handle."""
        self.cfuncs["tj3Destroy"](handle)

    def error_str(self, handle: int) -> str:
        """The last error or warning message of ``handle`` (``tj3GetErrorStr``; 0 = global error)."""
        msg = self.cfuncs["tj3GetErrorStr"](handle or None)
        return msg.decode("utf-8", "replace") if msg else ""


_LOAD_LOCK = threading.Lock()  # worker threads may ask for the library at the same moment


def load_library() -> TurboJpegLibrary:
    """Find, load and register the library once per process; later calls return the same object.

    Raises :class:`TurboJpegNotFoundError` when the wheel is missing (message gives the pip command).
    """
    with _LOAD_LOCK:
        return _load_once()


@functools.cache
def _load_once() -> TurboJpegLibrary:
    return TurboJpegLibrary(find_library())


class _LazyCFunction:
    """Stand-in for an ExternalFunction under NUMBA_DISABLE_JIT: calls the ctypes function."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args):
        return load_library().cfuncs[self.name](*(int(a) for a in args))


def _declare(name: str):
    if numba.config.DISABLE_JIT:
        return _LazyCFunction(name)
    return types.ExternalFunction(SYMBOL_PREFIX + name, _KERNEL_SYMBOLS[name][0])


# The C functions as kernels see them (ExternalFunction types: creating them loads nothing).
tj3DecompressHeader = _declare("tj3DecompressHeader")
tj3Get = _declare("tj3Get")
tj3SetScalingFactor = _declare("tj3SetScalingFactor")
tj3SetCroppingRegion = _declare("tj3SetCroppingRegion")
tj3Decompress8 = _declare("tj3Decompress8")
tj3GetErrorCode = _declare("tj3GetErrorCode")
tj3GetErrorStr = _declare("tj3GetErrorStr")


if numba.config.DISABLE_JIT:

    def require_library():
        """Load and register the library (plain Python mode)."""
        load_library()

else:

    @intrinsic
    def require_library(typingctx):
        """Kernel guard: registers the symbols when the calling kernel is compiled; emits no code."""
        load_library()

        def codegen(context, builder, signature, args):
            return context.get_dummy_value()

        return types.none(), codegen


# tj3GetErrorCode says TJERR_WARNING whenever a warning was emitted during the call, even when a fatal
# error followed it (the flag is never cleared; e.g. a 2-byte file warns "Premature end of JPEG file",
# then fails with "JPEG datastream contains no image" and leaves the previous image's header values).
# The last message tells them apart: it is the fatal error's text if there was one. These are all of
# libjpeg-turbo's JWRN_* messages (jerror.h, stable since IJG 6b; TurboJPEG's own errors are prefixed with
# the function name). An unknown message counts as an error: a loud failure beats a silent garbage image.
WARNING_MESSAGE_PREFIXES = (
    "Corrupt JPEG data:",  # extraneous bytes, premature end of segment, bad Huffman/arith code, RST, ICC
    "Premature end of JPEG file",  # truncated file (not "Premature end of input file", an error)
    "Inconsistent progression sequence",
    "Unknown Adobe color transform code",
    "Warning: unknown JFIF revision number",
    "Invalid SOS parameters for sequential JPEG",
    "Application transferred too many scanlines",
)
_WARNING_TABLE = np.frombuffer("\0".join(WARNING_MESSAGE_PREFIXES).encode() + b"\0", dtype=np.uint8)
JMSG_LENGTH_MAX = 200  # bytes of every TurboJPEG error-string buffer (thread-local and per handle)


@numba.njit(nogil=True)
def _is_warning_message(msg):
    # msg: uint8[JMSG_LENGTH_MAX], NUL-terminated. True when it starts with one of the prefixes.
    start = 0
    while start < _WARNING_TABLE.size:
        end = start
        while _WARNING_TABLE[end] != 0:
            end += 1
        match = True
        for i in range(end - start):
            if msg[i] != _WARNING_TABLE[start + i]:
                match = False
                break
        if match:
            return True
        start = end + 1
    return False


if numba.config.DISABLE_JIT:

    def _error_message(handle):
        raw = load_library().error_str(handle).encode()[: JMSG_LENGTH_MAX - 1]
        return np.frombuffer(raw.ljust(JMSG_LENGTH_MAX, b"\0"), dtype=np.uint8)

else:

    @numba.njit(nogil=True)
    def _error_message(handle):
        return numba.carray(tj3GetErrorStr(handle), (JMSG_LENGTH_MAX,), np.uint8)


@numba.njit(nogil=True)
def failed_with_warning_only(handle):
    """After a tj3* call on ``handle`` returned -1: True when only libjpeg warnings occurred.

    Then the call completed and its output is usable (rows past a truncation are grey). False for a
    fatal error. Must run on the thread that made the call (the message buffer is thread-local).
    """
    if tj3GetErrorCode(handle) != TJERR_WARNING:
        return False
    return _is_warning_message(_error_message(handle))
