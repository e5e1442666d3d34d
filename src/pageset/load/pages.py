"""Page access for the loader's threads: the OS page cache through ``pread``, or a bounded process page cache.

Both read with ``os.preadv`` (which releases the GIL) into memory the process owns, never through a memory map:
a file truncated or rewritten in place under a running loader then makes a read come up short or the file's
size / modification time change, and the batch raises TruncatedFileError (naming the file and the byte range)
or FileChangedError. A mapped page past the new end of the file would kill the process with SIGBUS instead.
Each ``gather`` checks the file after its reads (one ``fstat``), so a batch is built only from bytes of the file
as opened.

``"os"``: each record's bytes (runs of records that follow each other in the file: one read) are read straight
into the calling thread's staging buffer; the kernel decides what stays resident. One copy per record (~10 us
for a 100 KB JPEG, against ~1 ms to decode it).

``"process"``: whole pages are read into an LRU cache of at most ``capacity`` pages; a record's bytes are then
copied into the thread's staging buffer. With the quasi-random order a batch touches the pages of one or two
windows, so ``capacity = 2 * window_pages + prefetch`` bounds the memory whatever the file size. Records larger
than a page (they own whole pages) are read straight into the staging buffer and are not cached.

Interface shared by every page source: ``gather(offs, lens, staging) -> (buf, offsets)`` and ``close()``.
"""

from __future__ import annotations

import collections
import os
import threading

import numpy as np


def _staging(staging: dict, total: int) -> np.ndarray:
    """The thread's staging buffer with room for ``total`` bytes (grown, never shrunk)."""
    buf = staging.get("bytes")
    if buf is None or buf.shape[0] < total:
        buf = staging["bytes"] = np.empty(max(total, 1 << 16), dtype=np.uint8)
    return buf


class PreadPages:
    """``page_cache="os"``: records read with ``pread`` into the thread's staging buffer; thread-safe."""

    def __init__(self, ds):
        self.ds = ds

    def gather(self, offs: np.ndarray, lens: np.ndarray, staging: dict) -> tuple[np.ndarray, np.ndarray]:
        """(buf uint8[:], offsets int64[n]) such that record j is ``buf[off[j] : off[j] + lens[j]]``.

        ``offs``/``lens``: int64[n] absolute byte offsets and lengths. Raises TruncatedFileError /
        FileChangedError when the file was truncated or modified in place since it was opened.
        """
        n = offs.shape[0]
        ends = np.cumsum(lens)
        out_offs = ends - lens
        buf = _staging(staging, int(ends[-1]) if n else 0)
        if n:
            # runs of records that follow each other in the file (sequential order, small records): one read each
            first = np.flatnonzero(np.concatenate([[True], offs[1:] != offs[:-1] + lens[:-1]]))
            last = np.append(first[1:], n) - 1
            view, fd = memoryview(buf), self.ds.fileno()
            for off, lo, hi in zip(offs[first].tolist(), out_offs[first].tolist(), ends[last].tolist()):
                # one pread per run (~1-2 us); a short one (past the end, or > 2 GiB) goes through read_into,
                # which finishes it or raises TruncatedFileError naming the byte range
                if hi > lo and os.preadv(fd, [view[lo:hi]], off) != hi - lo:
                    self.ds.read_into(off, buf[lo:hi])
        self.ds.check_unchanged()
        return buf, out_offs

    def close(self) -> None:
        self.ds = None


class ProcessPageCache:
    """``page_cache="process"``: a bounded LRU cache of whole pages read with ``pread``; thread-safe.

    Attributes: ``hits``, ``misses`` (page lookups), ``capacity`` (pages), ``page_size`` (bytes).
    """

    def __init__(self, ds, capacity: int):
        self.ds = ds
        self.data_offset, self.data_length, self.page_size = ds.data_offset, ds.data_length, ds.page_size
        self.capacity = max(1, int(capacity))
        self._pages: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

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
        arr = np.empty(min(self.page_size, self.data_length - start), dtype=np.uint8)
        self.ds.read_into(self.data_offset + start, arr)
        with self._lock:
            self._pages[k] = arr
            while len(self._pages) > self.capacity:
                self._pages.popitem(last=False)
        return arr

    def gather(self, offs: np.ndarray, lens: np.ndarray, staging: dict) -> tuple[np.ndarray, np.ndarray]:
        """Copy the records into the thread's staging buffer (grown when needed); return (buf, offsets).

        Raises TruncatedFileError / FileChangedError as :meth:`PreadPages.gather` does.
        """
        buf = _staging(staging, int(lens.sum()))
        out_offs = np.empty_like(offs)
        pos = 0
        for j in range(offs.shape[0]):
            rel, n = int(offs[j]) - self.data_offset, int(lens[j])
            out_offs[j] = pos
            k = rel // self.page_size
            if n and (rel + n - 1) // self.page_size != k:  # a record larger than a page: not cached
                self.ds.read_into(self.data_offset + rel, buf[pos : pos + n])
            elif n:
                page = self.page(k)
                start = rel - k * self.page_size
                buf[pos : pos + n] = page[start : start + n]
            pos += n
        self.ds.check_unchanged()  # also for cache hits: one rule, whatever is cached
        return buf, out_offs

    def close(self) -> None:
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
