"""The bytes under a :class:`~pageset.read.reader.Dataset`: a local file (:class:`LocalFile`, ``pread``) or an
object at a URL (:class:`URLFile`, range requests pinned to the object's ETag), with the same methods, so the
Dataset and its open-time validation (:mod:`pageset.read.validate`) never ask which one they hold.

Both take the file's geometry once the header is read (``attach``) and then serve:

- ``pread(offset, length) -> bytes`` (the metadata at open; TruncatedFileError on a short read) and
  ``read_into(offset, out)`` (a writable contiguous buffer; for a URL from CRC-checked pages, the last few kept);
- ``read_checked(offset, length) -> bytes``: record bytes known to be the file as opened;
- ``check_unchanged()``: TruncatedFileError / FileChangedError when a local file changed in place (one
  ``fstat``); nothing for a URL (every request carries the pinned ETag: ObjectChangedError);
- ``page_crc(start, length, scratch)`` and ``stored_page_crcs(...)``: CRC-32 of pages as stored (``verify()``);
- ``begin_open()`` -> the size in bytes; ``load_range(lo, hi)`` / ``drop_cached()``: a URL's metadata fetched in
  one request and dropped after the open (no-ops locally); ``reread_on_checksum_error`` (a URL: a flipped bit on
  the wire is read once more before the file is called damaged);
- ``buffer()`` / ``fileno()`` (local only: ValueError for a URL, naming it), ``close()``.

Reads never go through a memory map (only ``buffer()``, on first use): a file truncated or rewritten in place
under an open Dataset raises TruncatedFileError (naming the byte range) or FileChangedError instead of killing
the process with SIGBUS.
"""

from __future__ import annotations

import collections
import mmap
import os
import threading

import numpy as np

from ..format.checksum import crc32
from ..format.errors import FileChangedError, TruncatedFileError

READ_CHUNK = 1 << 22  # bytes per pread when checksumming a page (page_size is up to 1 GiB)
REMOTE_HEAD = 1 << 16  # a URL's first request at open: the header and the zero padding up to data_offset
REMOTE_RUN = 8 << 20  # bytes per range request of verify() on a URL
RECENT_PAGES = 8  # pages a URL dataset keeps for reading records in order (one request per page)


class LocalFile:
    """A local pageset file, read with ``pread`` (``os.preadv``; thread-safe, the GIL released). ``path`` (str);
    ``storage_options`` must be empty (ValueError: they apply to URLs); FileNotFoundError / OSError from
    ``open``. See the module docstring for the methods."""

    remote = None
    reread_on_checksum_error = False
    page_reader = None

    def __init__(self, path, storage_options: dict | None = None):
        if storage_options:
            raise ValueError(f"{os.fspath(path)}: storage_options apply to URLs (s3://, http://, ...), "
                             "not to local paths")
        self.path = os.fspath(path)
        self._mm, self._mm_lock = None, threading.Lock()
        self.file_size, self._mtime_ns = 0, None
        self._file = open(self.path, "rb")

    def begin_open(self) -> int:
        st = os.fstat(self._file.fileno())
        self.file_size, self._mtime_ns = st.st_size, st.st_mtime_ns
        return st.st_size

    def load_range(self, lo: int, hi: int) -> None:
        pass

    def drop_cached(self) -> None:
        pass

    def attach(self, data_offset: int, data_length: int, page_size: int, page_crcs) -> None:
        pass

    def pread(self, offset: int, length: int) -> bytes:
        out = bytearray(length)
        self.read_into(offset, out)
        return bytes(out)

    def read_into(self, offset: int, out) -> None:
        view = memoryview(out).cast("B")
        length, done, fd = len(view), 0, self._file.fileno()
        while done < length:  # a single read returns at most ~2 GiB on Linux
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                now = os.fstat(fd).st_size
                raise TruncatedFileError(
                    self.path, "file", offset,
                    f"short read of bytes [{offset}, {offset + length}): {done} bytes read; the file shrank "
                    f"to {now} bytes ({self.file_size} when opened): it was truncated or rewritten in place while "
                    "being read. Replace files by renaming a new one over them, as write_dataset does")
            done += n

    def read_checked(self, offset: int, length: int) -> bytes:
        data = self.pread(offset, length)
        self.check_unchanged()
        return data

    def check_unchanged(self) -> None:
        st = os.fstat(self._file.fileno())
        if st.st_size == self.file_size and st.st_mtime_ns == self._mtime_ns:
            return
        if st.st_size < self.file_size:
            raise TruncatedFileError(
                self.path, "file", None,
                f"the file shrank to {st.st_size} bytes ({self.file_size} when opened): it was truncated or "
                "rewritten in place while being read. Replace files by renaming a new one over them, as "
                "write_dataset does")
        raise FileChangedError(
            self.path, "file", None,
            f"the file was modified in place after it was opened ({self.file_size} -> {st.st_size} bytes, "
            "modification time changed): bytes read from it may mix old and new content. Replace files by "
            "renaming a new one over them, as write_dataset does, and open the new file")

    def page_crc(self, start: int, length: int, scratch: np.ndarray | None = None) -> int:
        """CRC-32 of the stored bytes ``[start, start + length)``, read in chunks of at most READ_CHUNK bytes."""
        if scratch is None:
            scratch = np.empty(min(length, READ_CHUNK), dtype=np.uint8)
        crc = 0
        for pos in range(0, length, scratch.shape[0]):
            chunk = scratch[: min(scratch.shape[0], length - pos)]
            self.read_into(start + pos, chunk)
            crc = crc32(chunk, crc)
        return crc

    def stored_page_crcs(self, data_offset: int, data_length: int, page_size: int, page_count: int,
                         scratch: np.ndarray):
        """Yield ``(k, CRC-32 of page k as stored)`` for every page, read in chunks."""
        end = data_offset + data_length
        for k in range(page_count):
            start = data_offset + k * page_size
            yield k, self.page_crc(start, min(page_size, end - start), scratch)

    def buffer(self) -> np.ndarray:
        with self._mm_lock:
            if self._mm is None:
                if self._file.closed:
                    raise ValueError(f"{self.path}: the dataset is closed")
                self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if self.file_size else b""
            return np.frombuffer(self._mm, dtype=np.uint8)

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        if isinstance(self._mm, mmap.mmap):
            try:
                self._mm.close()
            except BufferError:  # a caller still holds a view; the mapping is freed with the last view
                pass
            self._mm = None
        self._file.close()


class URLFile:
    """An object at a URL read as a pageset file: ``remote`` the pinned
    :class:`~pageset.read.remote.RemoteFile` (``storage_options`` to its fsspec filesystem, ``retry`` a
    :class:`~pageset.format.retry.RetryPolicy` bounding every request), ``page_reader`` its
    :class:`~pageset.read.remote.PageReader` once attached (every page CRC-checked on arrival). Raises what
    RemoteFile raises (FileNotFoundError naming the URL, ImportError naming the package, RemoteReadError). See the
    module docstring for the methods."""

    reread_on_checksum_error = True

    def __init__(self, path: str, storage_options: dict | None, retry):
        from .remote import RemoteFile

        self.path = path
        self.remote = RemoteFile(path, storage_options, retry)
        self.page_reader = None
        self.file_size = 0
        self._recent: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._recent_lock = threading.Lock()

    def begin_open(self) -> int:
        size = self.file_size = self.remote.size
        self.remote.load_range(0, min(size, REMOTE_HEAD))  # header + padding: one request
        return size

    def load_range(self, lo: int, hi: int) -> None:
        self.remote.load_range(lo, hi)

    def drop_cached(self) -> None:
        self.remote.drop_cached()

    def attach(self, data_offset: int, data_length: int, page_size: int, page_crcs) -> None:
        from .remote import PageReader

        self.data_offset, self.page_size = data_offset, page_size
        self.page_reader = PageReader(self.remote, data_offset, data_length, page_size, page_crcs)
        with self._recent_lock:
            self._recent.clear()

    def pread(self, offset: int, length: int) -> bytes:
        data = self.remote.pread(offset, length)
        if len(data) != length:
            raise TruncatedFileError(self.path, "file", offset, f"short read: {len(data)} of {length} bytes")
        return data

    def _span(self, off: int, length: int) -> np.ndarray:
        """uint8[length], bytes ``[off, off + length)`` of the data area from CRC-checked pages (the last
        RECENT_PAGES pages are kept, so reading records in order costs one request per page)."""
        if length == 0:
            return np.empty(0, np.uint8)
        ps, rel = self.page_size, off - self.data_offset
        k0, k1 = rel // ps, (rel + length - 1) // ps + 1
        with self._recent_lock:
            have = {k: self._recent[k] for k in range(k0, k1) if k in self._recent}
        missing = [k for k in range(k0, k1) if k not in have]
        if missing:
            have.update(zip(range(missing[0], missing[-1] + 1), self.page_reader.read_run(missing[0], missing[-1] + 1)))
        pages = [have[k] for k in range(k0, k1)]
        with self._recent_lock:
            for k in range(k0, k1):
                self._recent[k] = pages[k - k0]
                self._recent.move_to_end(k)
            while len(self._recent) > RECENT_PAGES:
                self._recent.popitem(last=False)
        data = pages[0] if len(pages) == 1 else np.concatenate(pages)
        lo = rel - k0 * ps
        return data[lo : lo + length]

    def read_into(self, offset: int, out) -> None:
        view = memoryview(out).cast("B")
        view[:] = self._span(offset, len(view)).tobytes()

    def read_checked(self, offset: int, length: int) -> bytes:
        return self._span(offset, length).tobytes()

    def check_unchanged(self) -> None:
        pass  # every request carries the pinned ETag (ObjectChangedError)

    def page_crc(self, start: int, length: int, scratch: np.ndarray | None = None) -> int:
        # the stored bytes as they are (not through the CRC-checking page reader)
        return crc32(np.frombuffer(self.remote.read(start, start + length), dtype=np.uint8))

    def stored_page_crcs(self, data_offset: int, data_length: int, page_size: int, page_count: int,
                         scratch: np.ndarray):
        """Yield ``(k, CRC-32 of page k as stored)`` for every page, from range requests of up to REMOTE_RUN
        bytes (many pages each)."""
        ps, end = page_size, data_offset + data_length
        step = max(1, REMOTE_RUN // ps)
        for a in range(0, page_count, step):
            b = min(page_count, a + step)
            lo = data_offset + a * ps
            run = np.frombuffer(self.remote.read(lo, min(end, data_offset + b * ps)), dtype=np.uint8)
            for k in range(a, b):
                rel = k * ps - a * ps
                yield k, crc32(run[rel : rel + ps])

    def buffer(self) -> np.ndarray:
        raise ValueError(f"{self.path}: a remote dataset has no whole-file buffer; read records with ds[i] / "
                         "ds.read(i, field) or load it with Loader")

    def fileno(self) -> int:
        raise ValueError(f"{self.path}: a remote dataset has no file descriptor")

    def close(self) -> None:
        self.remote.close()
