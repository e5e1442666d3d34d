"""Page access for the loader's threads: the OS page cache through mmap, or a bounded process page cache.

``"os"``: the file is memory-mapped once; kernels read record bytes in place (zero copies). The kernel
decides what stays resident, which is right for data that fits in RAM or for sequential reads.

``"process"``: whole pages are read with ``os.pread`` (which releases the GIL) into an LRU cache of at most
``capacity`` pages; a record's bytes are then copied into the calling thread's staging buffer. With the
quasi-random order a batch touches the pages of one or two windows, so ``capacity = 2 * window_pages +
prefetch`` bounds the memory whatever the file size. Records larger than a page (they own whole pages) are
read straight into the staging buffer and are not cached.
"""

from __future__ import annotations

import collections
import os
import threading

import numpy as np

from ..format.errors import TruncatedFileError


class MmapPages:
    """Zero-copy access: ``gather`` returns the whole-file buffer and the records' own offsets.

    A mapped file that shrinks under the reader (truncated or rewritten in place instead of replaced by a rename)
    would kill the process with SIGBUS on the next access; ``gather`` checks the size first (one ``fstat``, ~1 us)
    and raises TruncatedFileError instead. A file replaced by a rename, as ``write_dataset`` does, is safe: the
    mapping keeps the old inode.
    """

    def __init__(self, ds):
        self.buffer, self.path, self.fd, self.size = ds.buffer, ds.path, ds.fileno(), ds.file_size

    def gather(self, offs: np.ndarray, lens: np.ndarray, staging: dict) -> tuple[np.ndarray, np.ndarray]:
        """(buf uint8[:], offsets int64[n]) such that record j is ``buf[off[j] : off[j] + lens[j]]``."""
        size = os.fstat(self.fd).st_size
        if size < self.size:
            raise TruncatedFileError(
                self.path, "file", size, f"the file shrank from {self.size} to {size} bytes while it was being read "
                "(truncated or rewritten in place); replace files by renaming a new one over them, as "
                "write_dataset does, or use page_cache='process'")
        return self.buffer, offs

    def close(self) -> None:
        self.buffer = None


class ProcessPageCache:
    """A bounded LRU cache of whole pages read with ``os.pread``; thread-safe.

    Attributes: ``hits``, ``misses`` (page lookups), ``capacity`` (pages), ``page_size`` (bytes).
    """

    def __init__(self, path: str, data_offset: int, data_length: int, page_size: int, capacity: int):
        self.fd = os.open(path, os.O_RDONLY)
        self.data_offset, self.data_length, self.page_size = data_offset, data_length, page_size
        self.capacity = max(1, int(capacity))
        self._pages: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _read(self, offset: int, length: int, out: np.ndarray) -> None:
        view = memoryview(out)[:length]
        done = 0
        while done < length:
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"short read at byte {offset + done} of the pageset file (file truncated?)")
            done += n

    def page(self, k: int) -> np.ndarray:
        """uint8 bytes of page ``k`` (the last page may be short). The array stays valid after eviction."""
        with self._lock:
            arr = self._pages.get(k)
            if arr is not None:
                self._pages.move_to_end(k)
                self.hits += 1
                return arr
            self.misses += 1
        start = k * self.page_size
        length = min(self.page_size, self.data_length - start)
        arr = np.empty(length, dtype=np.uint8)
        self._read(self.data_offset + start, length, arr)
        with self._lock:
            self._pages[k] = arr
            while len(self._pages) > self.capacity:
                self._pages.popitem(last=False)
        return arr

    def gather(self, offs: np.ndarray, lens: np.ndarray, staging: dict) -> tuple[np.ndarray, np.ndarray]:
        """Copy the records into the thread's staging buffer (grown when needed); return (buf, offsets)."""
        total = int(lens.sum())
        buf = staging.get("bytes")
        if buf is None or buf.shape[0] < total:
            buf = staging["bytes"] = np.empty(max(total, 1 << 16), dtype=np.uint8)
        out_offs = np.empty_like(offs)
        pos = 0
        for j in range(offs.shape[0]):
            rel, n = int(offs[j]) - self.data_offset, int(lens[j])
            out_offs[j] = pos
            k = rel // self.page_size
            if n and (rel + n - 1) // self.page_size != k:  # a record larger than a page: not cached
                self._read(self.data_offset + rel, n, buf[pos:])
            elif n:
                page = self.page(k)
                start = rel - k * self.page_size
                buf[pos : pos + n] = page[start : start + n]
            pos += n
        return buf, out_offs

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._pages.clear()


class PageVerifier:
    """Checks each page's CRC-32 the first time a batch needs it (``Loader(verify_pages=True)``).

    A flipped byte then raises ChecksumMismatchError naming the page and the sample instead of producing a wrong
    image or label. Each page is checked once per Loader (a bitmap of verified pages; a race between two threads
    only checks a page twice). Cost: one CRC pass over the data, ~1 GB/s per core, spread over the first epoch.
    """

    def __init__(self, ds):
        if ds.page_checksums is None:
            raise ValueError(f"{ds.path}: verify_pages=True needs page checksums, and this file has none")
        self.ds = ds
        self.done = np.zeros(ds.page_count, dtype=bool)

    def check(self, starts: np.ndarray, lengths: np.ndarray, ids: np.ndarray) -> None:
        """Verify the pages under byte spans ``[starts, starts + lengths)`` (absolute offsets) of samples ``ids``."""
        if not self.done.size:
            return
        rel = starts - self.ds.data_offset
        first = rel // self.ds.page_size
        last = np.maximum(rel + lengths - 1, rel) // self.ds.page_size
        for j in np.flatnonzero(~self.done[first] | ~self.done[np.minimum(last, self.done.size - 1)]):
            for k in range(int(first[j]), min(int(last[j]), self.done.size - 1) + 1):
                if not self.done[k]:
                    self.ds.check_page(k, int(ids[j]))
                    self.done[k] = True
