"""Byte spans for the loader's page sources: many records read or copied in one nogil call.

A batch's records (JPEGs, token windows, arrays) sit at scattered offsets of the file or of a page cache's
arena. One ``os.preadv`` or numpy slice copy per record costs ~1 us of Python and a GIL release/re-acquire
each; for a batch of 32 token windows of 4 KiB that is more than the reads themselves, and with a second
thread wanting the GIL every re-acquire can wait. :func:`pread_spans` and :func:`copy_spans` do the whole
batch in one call that releases the GIL once.

``pread_spans`` calls libc's ``pread`` (POSIX; ``off_t`` is 64-bit on the 64-bit Linux targets) through a
Numba ``ExternalFunction`` resolved by name in the running process, so the on-disk kernel cache works
across processes. Under ``NUMBA_DISABLE_JIT=1`` it is the same loop in Python over ``os.preadv``.
"""

from __future__ import annotations

import functools
import os
import sys

import numba
import numpy as np
from numba import types

from pageset.ops import kernel_cache

if numba.config.DISABLE_JIT:

    def pread_spans(fd, offs, lens, dst, dst_offs):
        """Plain-Python twin of the kernel below (``NUMBA_DISABLE_JIT=1``): one descriptor for every span."""
        return pread_spans_fds(np.full(lens.shape[0], fd, dtype=np.int64), offs, lens, dst, dst_offs)

    def pread_spans_fds(fds, offs, lens, dst, dst_offs):
        """Plain-Python twin of the kernel below (``NUMBA_DISABLE_JIT=1``)."""
        view = memoryview(dst)
        for j in range(lens.shape[0]):
            done, n = 0, int(lens[j])
            while done < n:
                lo = int(dst_offs[j]) + done
                r = os.preadv(int(fds[j]), [view[lo : lo + n - done]], int(offs[j]) + done)
                if r <= 0:
                    return j
                done += r
        return -1

    def fstat_into(fd, buf):
        """Plain-Python twin of the kernel below (``NUMBA_DISABLE_JIT=1``): the fields it reads, at their places."""
        st = os.fstat(int(fd))
        buf[1], buf[6] = st.st_ino, st.st_size
        buf[11], buf[12] = divmod(st.st_mtime_ns, 10**9)
        return 0

    def changed_files(fds, touched, sizes, mtimes, buf):
        """Plain-Python twin of the kernel below (``NUMBA_DISABLE_JIT=1``)."""
        bad = -1
        for i in np.flatnonzero(touched).tolist():
            touched[i] = 0
            st = os.fstat(int(fds[i]))
            if bad < 0 and (st.st_size != sizes[i] or st.st_mtime_ns != mtimes[i]):
                bad = i
        return bad

    def file_changed(fd, size, mtime, buf):
        """Plain-Python twin of the kernel below (``NUMBA_DISABLE_JIT=1``)."""
        try:
            st = os.fstat(int(fd))
        except OSError:
            return True
        return st.st_size != size or st.st_mtime_ns != mtime

    def pread_full(fd, dst, off):
        """Plain-Python twin of the kernel below (``NUMBA_DISABLE_JIT=1``)."""
        view = memoryview(dst).cast("B")
        done = 0
        while done < len(view):
            r = os.preadv(fd, [view[done:]], off + done)
            if r <= 0:
                return False
            done += r
        return True

else:
    _pread = types.ExternalFunction("pread", types.int64(types.int32, types.int64, types.int64, types.int64))

    @numba.njit(nogil=True)
    def pread_spans(fd, offs, lens, dst, dst_offs):
        """Read file bytes ``[offs[j], offs[j] + lens[j])`` into ``dst[dst_offs[j]:]`` for every ``j``.

        fd: an open file descriptor; offs, lens, dst_offs: int64[n] (bytes); dst: uint8[:], contiguous, large
        enough (the caller's contract). Returns -1 when every span was read in full, else the first ``j``
        whose read came up short (end of file: the file shrank) or failed; the caller re-reads that span with
        ``Dataset.read_into``, which finishes it or raises TruncatedFileError naming the byte range.
        """
        base = np.int64(dst.ctypes.data)
        for j in range(lens.shape[0]):
            done = np.int64(0)
            n = lens[j]
            while done < n:
                r = _pread(fd, base + dst_offs[j] + done, n - done, offs[j] + done)
                if r <= 0:
                    return j
                done += r
        return -1

    @numba.njit(nogil=True)
    def pread_spans_fds(fds, offs, lens, dst, dst_offs):
        """:func:`pread_spans` with a descriptor per span: span ``j`` is read from ``fds[j]`` (int64[n]; the files
        of a many-file set, each span within one member). Returns -1 when every span was read in full, else the
        first short or failed ``j`` (the caller finishes it or raises TruncatedFileError naming that member)."""
        base = np.int64(dst.ctypes.data)
        for j in range(lens.shape[0]):
            done = np.int64(0)
            n = lens[j]
            while done < n:
                r = _pread(np.int32(fds[j]), base + dst_offs[j] + done, n - done, offs[j] + done)
                if r <= 0:
                    return j
                done += r
        return -1

    _fstat = types.ExternalFunction("fstat", types.int32(types.int32, types.int64))

    @numba.njit(nogil=True)
    def fstat_into(fd, buf):
        """libc ``fstat(fd)`` into ``buf`` (int64[18]: the 144-byte ``struct stat`` of 64-bit Linux, x86_64 and
        aarch64 alike: st_ino at word 1, st_size at word 6, st_mtim at words 11-12). Returns fstat's result (0).
        Only used once :func:`fstat_layout_ok` has compared it with ``os.fstat`` in this process."""
        return _fstat(np.int32(fd), np.int64(buf.ctypes.data))

    @numba.njit(nogil=True)
    def changed_files(fds, touched, sizes, mtimes, buf):
        """For every file ``i`` with ``touched[i]`` set (uint8[n], cleared here): ``fstat(fds[i])``, compared with
        ``sizes[i]`` / ``mtimes[i]`` (int64 bytes / ns). Returns the first changed (or failing) ``i``, else -1;
        ``buf`` int64[18] scratch. One nogil call for a batch's files instead of an ``os.fstat`` each (~2 us)."""
        bad = -1
        for i in range(touched.shape[0]):
            if touched[i] == 0:
                continue
            touched[i] = 0
            if bad >= 0:
                continue
            if _fstat(np.int32(fds[i]), np.int64(buf.ctypes.data)) != 0:
                bad = i
            elif buf[6] != sizes[i] or buf[11] * 1000000000 + buf[12] != mtimes[i]:
                bad = i
        return bad

    @numba.njit(nogil=True)
    def file_changed(fd, size, mtime, buf):
        """True when ``fstat(fd)`` fails or gives another size (bytes) or modification time (ns) than ``size`` /
        ``mtime``; ``buf`` int64[18] scratch. Called from other kernels (after :func:`fstat_layout_ok`)."""
        if _fstat(np.int32(fd), np.int64(buf.ctypes.data)) != 0:
            return True
        return buf[6] != size or buf[11] * 1000000000 + buf[12] != mtime

    @numba.njit(nogil=True)
    def pread_full(fd, dst, off):
        """Fill ``dst`` (a contiguous array, any dtype) with the file's bytes from byte ``off``; True when every
        byte was read, False when a read came up short (end of file) or failed (the caller then reads the span
        with ``Dataset.read_into``, which finishes it or raises TruncatedFileError). Called from other kernels."""
        n = np.int64(dst.size * dst.itemsize)
        base = np.int64(dst.ctypes.data)
        done = np.int64(0)
        while done < n:
            r = _pread(fd, base + done, n - done, off + done)
            if r <= 0:
                return False
            done += r
        return True


@numba.njit(nogil=True)
def pread_set_spans(fds, run_v, run_lens, dst, dst_offs, touched, sizes, mtimes, buf, check, shift):
    """Read the runs of a many-file set's batch, then check the members read unchanged, in one nogil call.

    Run ``j`` is ``run_lens[j]`` bytes at virtual offset ``run_v[j]`` = ``(member << shift) | byte offset`` (int64
    [n]), read from ``fds[member]`` into ``dst[dst_offs[j]:]`` (uint8[:]); ``touched[member]`` (uint8[members]) is
    set for each member read and, with ``check``, cleared again for the members of these runs, each ``fstat``-ed
    once (:func:`file_changed` against ``sizes`` / ``mtimes``, int64 bytes / ns; ``buf`` int64[18] scratch). Returns
    -1 when every run was read (and no member read changed); ``j >= 0``, the first run not read in full (nothing
    checked: the caller finishes it, reads the rest and checks the members still flagged); ``-2 - member`` for the
    first member that changed or whose ``fstat`` failed.
    """
    mask = (np.int64(1) << shift) - 1
    for j in range(run_lens.shape[0]):
        i = run_v[j] >> shift
        touched[i] = 1
        lo = dst_offs[j]
        if not pread_full(fds[i], dst[lo : lo + run_lens[j]], run_v[j] & mask):
            return j
    if not check:
        return -1
    bad = -1
    for j in range(run_lens.shape[0]):
        i = run_v[j] >> shift
        if touched[i] == 0:
            continue
        touched[i] = 0
        if bad < 0 and file_changed(fds[i], sizes[i], mtimes[i], buf):
            bad = i
    return -1 if bad < 0 else -2 - bad


_LAYOUT: dict = {}


def fstat_layout_ok(fd: int) -> bool:
    """True when :func:`fstat_into` reads ``fd``'s inode, size and modification time as ``os.fstat`` does (64-bit
    Linux with libc's ``fstat``): checked once per process, on the caller's open file; False elsewhere (the
    caller then checks its files with ``os.fstat``)."""
    if "ok" not in _LAYOUT:
        ok = False
        if sys.platform.startswith("linux") and sys.maxsize > 2**32:
            try:
                import ctypes

                if hasattr(ctypes.CDLL(None), "fstat"):  # glibc >= 2.33, musl: the symbol the kernel calls
                    buf = np.zeros(18, dtype=np.int64)
                    st = os.fstat(fd)
                    ok = (fstat_into(fd, buf) == 0 and int(buf[1]) == st.st_ino and int(buf[6]) == st.st_size
                          and int(buf[11]) * 10**9 + int(buf[12]) == st.st_mtime_ns)
            except Exception:  # no libc symbol to resolve, a build without ctypes: os.fstat it is
                ok = False
        _LAYOUT["ok"] = ok
    return _LAYOUT["ok"]


@numba.njit(nogil=True)
def copy_spans(src, src_starts, lens, dst, dst_starts):
    """``dst[dst_starts[j] : +lens[j]] = src[src_starts[j] : +lens[j]]`` for every ``j`` with ``src_starts[j] >= 0``.

    src, dst: uint8[:] (distinct buffers); src_starts, lens, dst_starts: int64[n] byte offsets and lengths
    (a negative ``src_starts[j]`` skips record ``j``: the caller reads it some other way). Bounds are the
    caller's contract (the page sources compute them from a validated index); nothing is allocated.
    """
    for j in range(lens.shape[0]):
        if src_starts[j] < 0:
            continue
        # unsigned indices: no negative-index wrap-around branch, so LLVM vectorises the copy (~10x faster)
        s, d = np.uint64(src_starts[j]), np.uint64(dst_starts[j])
        for i in range(np.uint64(lens[j])):
            dst[d + i] = src[s + i]


@functools.cache
def prepare() -> None:
    """Enable the on-disk cache of this module's kernels (run time, never at import; idempotent)."""
    kernel_cache.enable(sys.modules[__name__])
