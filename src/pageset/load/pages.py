"""Page access for the loader's threads: the OS page cache through ``pread``, or a bounded process page cache.

Both read with ``pread`` (in nogil kernels, see ``ops.spans``) into memory the process owns, never through a memory map:
a file truncated or rewritten in place under a running loader then makes a read come up short or the file's
size / modification time change, and the batch raises TruncatedFileError (naming the file and the byte range)
or FileChangedError. A mapped page past the new end of the file would kill the process with SIGBUS instead.
Each ``gather`` checks the file after its reads (one ``fstat``), so a batch is built only from bytes of the file
as opened.

``"os"``: each record's bytes (runs of records that follow each other in the file: one read) are read straight
into the calling thread's staging buffer; the kernel decides what stays resident. One copy per record (~10 us
for a 100 KB JPEG, against ~1 ms to decode it).

``"process"``: whole pages are read into an LRU cache of at most ``capacity`` pages; a record's bytes are then
copied into the thread's staging buffer. The cache holds at most ``capacity`` pages in an arena allocated once,
so its memory is ``capacity * page_size`` bytes at most, whatever the file size (the Loader's default capacity
is in ``Loader``'s docstring). Records larger than a page (they own whole pages) are read straight into the
staging buffer and are not cached.

Interface shared by every page source: ``gather(offs, lens, staging, ordered=True) -> (buf, offsets)`` and
``close()`` (``ordered=False``: the records may be packed in another order than the batch's; ``offsets`` says where).
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

from ..format.checksum import crc32
from ..ops import spans
from ..ops import tokens as token_ops
from .parts import PageSource
from .stats import STATS_KEY


def _staging(staging: dict, total: int) -> np.ndarray:
    """The thread's staging buffer with room for ``total`` bytes (grown, never shrunk)."""
    buf = staging.get("bytes")
    if buf is None or buf.shape[0] < total:
        buf = staging["bytes"] = np.empty(max(total, 1 << 16), dtype=np.uint8)
    return buf


def resume_reads(read, finish, n: int) -> tuple[int, bool]:
    """Read items ``[0, n)`` with a kernel that stops at the first item it reads short, finishing each such item
    with ``finish(j)`` (its absolute index; a Python read that completes it or raises TruncatedFileError) and
    resuming after it: the one short-read loop of every ``pread`` path (records, token windows, a Mixture's
    windows, a set's runs and windows).

    ``read(done)`` runs the kernel over items ``[done, n)`` and returns the index, relative to ``done``, of the
    item it read short, or a negative code when it stopped without one (-1: all read; a set's kernels return
    ``-2 - member`` for a member that changed). Returns ``(code, finished)``: the kernel's last negative code
    (-1 when every item was read) and whether any item was finished by ``finish``."""
    done, finished = 0, False
    while done < n:
        r = read(done)
        if r < 0:
            return r, finished
        j = done + r
        finish(j)
        done, finished = j + 1, True
    return -1, finished


def gather_runs(offs: np.ndarray, lens: np.ndarray, staging: dict, ordered: bool, read_runs, after=None):
    """The frame of a ``pread`` gather (PreadPages, a set's SetPages): records ``offs``/``lens`` (int64[n]) as
    runs (:func:`contiguous_runs`) into the thread's staging buffer, ``read_runs(run_offs, run_lens, buf,
    run_dst)`` reading them (not called for n = 0), then ``after()`` (a check that the file is unchanged, also
    for n = 0), the thread's read seconds and bytes counted (Loader.stats()). Returns ``(buf, offsets)``."""
    t0 = time.perf_counter()
    n = offs.shape[0]
    out_offs, total, run_offs, run_dst, run_lens = (contiguous_runs(offs, lens, ordered) if n else
                                                    (offs, 0, None, None, None))
    buf = _staging(staging, total)
    if n:
        read_runs(run_offs, run_lens, buf, run_dst)
    if after is not None:
        after()
    st = staging.get(STATS_KEY)  # Loader.stats(): this thread's read seconds and bytes
    if st is not None:
        st.read_s += time.perf_counter() - t0
        st.read_bytes += total
    return buf, out_offs


def contiguous_runs(offs: np.ndarray, lens: np.ndarray, ordered: bool = True):
    """Records ``offs``/``lens`` (int64[n], n >= 1) packed back to back: ``(out_offs, total, run_offs, run_dst,
    run_lens)``: each record's offset in the packed buffer, the buffer's bytes, and per run of records that follow
    each other in the source (one read each) its source offset, its offset in the buffer and its bytes.

    ``ordered``: packed in batch order (record j right after record j - 1: callers that read the buffer as rows);
    else in ascending offset order (a stable argsort: equal offsets keep their batch order), which turns records
    of one page that a shuffled batch holds out of order into one read: a quasi-random batch of small records then
    reads about half as many runs. Records already in order cost no extra run either way."""
    n = offs.shape[0]
    order = None
    if not ordered and n > 1 and (offs[1:] < offs[:-1]).any():
        order = np.argsort(offs, kind="stable")
        offs, lens = offs[order], lens[order]
    ends = np.cumsum(lens)
    starts = ends - lens
    first = np.flatnonzero(np.concatenate([[True], offs[1:] != offs[:-1] + lens[:-1]]))
    last = np.append(first[1:], n) - 1
    run_dst = starts[first]
    if order is None:
        out_offs = starts
    else:
        out_offs = np.empty_like(starts)
        out_offs[order] = starts
    return out_offs, int(ends[-1]), offs[first], run_dst, ends[last] - run_dst


class PreadPages(PageSource):
    """``page_cache="os"``: records read with ``pread`` into the thread's staging buffer; thread-safe."""

    direct = True  # windows may be read with pread on ds.fileno() by another reader (RowReader)

    def __init__(self, ds):
        self.ds = ds
        spans.prepare()

    @staticmethod
    def reserve(staging: dict, nbytes: int) -> None:
        """Grow the thread's staging buffer to ``nbytes`` now (at Loader construction), not at its first read."""
        _staging(staging, nbytes)

    def gather(self, offs: np.ndarray, lens: np.ndarray, staging: dict,
               ordered: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(buf uint8[:], offsets int64[n]) such that record j is ``buf[off[j] : off[j] + lens[j]]``.

        ``offs``/``lens``: int64[n] absolute byte offsets and lengths; ``ordered``: the records back to back in
        batch order from byte 0 (else in file order: fewer reads; see :func:`contiguous_runs`). Raises TruncatedFileError /
        FileChangedError when the file was truncated or modified in place since it was opened.
        """
        return gather_runs(offs, lens, staging, ordered, self._read_runs, self.ds.check_unchanged)

    def _read_runs(self, run_offs, run_lens, buf, run_dst) -> None:
        # runs of records that follow each other in the file (sequential order, small records): one read each,
        # all in one nogil kernel call (~1 us per read, the GIL released once per batch); a short read (past the
        # end, or > 2 GiB): read_into finishes it or raises
        ds = self.ds
        fd = ds.fileno()

        def finish(j):
            lo, hi = int(run_dst[j]), int(run_dst[j] + run_lens[j])
            ds.read_into(int(run_offs[j]), buf[lo:hi])

        resume_reads(lambda d: spans.pread_spans(fd, run_offs[d:], run_lens[d:], buf, run_dst[d:]), finish,
                     run_offs.shape[0])

    def read_windows(self, base: int, stride: int, ids: np.ndarray, dtype, out_input: np.ndarray,
                     out_target: np.ndarray, ctx: dict) -> bool:
        """Token windows ``ids`` read and widened into ``out_input`` / ``out_target`` (``[n, L]``) in one nogil
        kernel call; always True (done). Window ``w`` is the ``L + 1`` tokens of ``dtype`` (the file's, uint16 or
        uint32) from byte ``base + w * stride``; ``ctx`` is the calling thread's scratch.

        Raises TruncatedFileError / FileChangedError as :meth:`gather` does.
        """
        row = _row(ctx, out_input.shape[1] + 1, dtype)
        fd, ds = self.ds.fileno(), self.ds

        def finish(j):  # a short read: read_into finishes it or raises TruncatedFileError
            ds.read_into(base + int(ids[j]) * stride, row)
            token_ops.split_windows(row[None], out_input[j : j + 1], out_target[j : j + 1])

        resume_reads(lambda d: token_ops.pread_windows(fd, base, stride, ids[d:], row, out_input[d:], out_target[d:]),
                     finish, ids.shape[0])
        self.ds.check_unchanged()
        st = ctx.get(STATS_KEY)  # Loader.stats(): bytes read (the time is the token stage's, one kernel)
        if st is not None:
            st.read_bytes += ids.shape[0] * row.nbytes
        return True

    def close(self) -> None:
        self.ds = None


def _row(ctx: dict, span: int, dtype) -> np.ndarray:
    """The thread's scratch row of ``span`` tokens of ``dtype`` (one window), kept in ``ctx``."""
    row = ctx.get("window row")
    if row is None or row.shape[0] != span or row.dtype != dtype:
        row = ctx["window row"] = np.empty(span, dtype=dtype)
    return row


class _Fill:
    """A page being read into a slot: ``done`` is set when the read ended, ``ok`` says whether it succeeded."""

    def __init__(self):
        self.done = threading.Event()
        self.ok = False


class ProcessPageCache(PageSource):
    """``page_cache="process"``: a bounded LRU cache of whole pages read with ``pread``; thread-safe.

    The cache owns one arena of ``capacity * page_size`` bytes, allocated once (untouched parts cost no
    resident memory), and every cached page lives in one of its ``capacity`` slots: the bytes it holds can
    never exceed ``capacity * page_size``, whatever the file size, the order or the number of threads.
    A slot is pinned while a thread copies records out of it and is never evicted then; a page that two
    threads miss at the same time is read once (the second waits for the first). When every slot is pinned
    (more threads than slots), the records are read straight into the thread's staging buffer instead.

    Attributes: ``hits``, ``misses`` (page lookups), ``capacity`` (slots), ``page_size`` (bytes),
    ``peak_resident`` (the most slots ever filled: <= capacity).
    """

    _WAIT_S = 60.0  # a thread waiting for another thread's read of the same page (a pread of one page)

    # Each page's CRC-32 is checked the first time it enters the cache (once per Loader: a bitmap of checked
    # pages), on the bytes just read: no extra read. Records not served from the cache (larger than a page, or
    # no slot free) are not checked here (Loader(verify_pages=True) checks every page a batch needs).
    check_pages = True

    def __init__(self, ds, capacity: int):
        self.ds = ds
        self._crcs = ds.page_checksums if self.check_pages else None
        self._checked = np.zeros(max(int(ds.page_count), 1), dtype=bool)
        self.data_offset, self.data_length, self.page_size = ds.data_offset, ds.data_length, ds.page_size
        # never more slots than pages: a small file costs no more than its data
        self.capacity = max(1, min(int(capacity), max(int(ds.page_count), 1)))
        try:
            self._arena = np.empty(self.capacity * self.page_size, dtype=np.uint8)
        except MemoryError:
            raise MemoryError(f"{ds.path}: page_cache='process' needs {self.capacity} x {self.page_size} bytes "
                              "of address space; pass a smaller cache_pages or use page_cache='os'") from None
        self._slot_page = np.full(self.capacity, -1, dtype=np.int64)  # page held by each slot (-1: none)
        # slot of each page whose read has completed, -1 otherwise (the token kernels' lookup; lock held)
        self._page_slot = np.full(max(int(ds.page_count), 1), -1, dtype=np.int64)
        self._typed = (None, None)  # (dtype, the arena viewed as that dtype) for read_windows
        self._pins = np.zeros(self.capacity, dtype=np.int64)
        self._lru: collections.OrderedDict[int, int] = collections.OrderedDict()  # page -> slot, oldest first
        self._loading: dict[int, threading.Event] = {}  # page -> set when its slot is filled (or failed)
        self._free = list(range(self.capacity - 1, -1, -1))
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.bytes_read = 0  # bytes read from the file: pages into the cache, records read around it
        self.peak_resident = 0
        spans.prepare()

    def counters(self) -> dict:
        """``{"hits", "misses", "bytes_read"}``: page lookups found / not found, bytes read from the file."""
        return {"hits": self.hits, "misses": self.misses, "bytes_read": self.bytes_read}

    @property
    def resident_pages(self) -> int:
        """Slots holding a page (or being filled): <= ``capacity``."""
        return self.capacity - len(self._free)

    def _victim(self) -> int:
        """A slot to fill: a free one, else the least recently used unpinned one (-1 if all are pinned)."""
        if self._free:
            return self._free.pop()
        for page, slot in self._lru.items():
            if self._pins[slot] == 0 and page not in self._loading:
                del self._lru[page]
                self._page_slot[page] = -1
                return slot
        return -1

    def _acquire(self, pages: np.ndarray) -> np.ndarray:
        """Pin a slot for each page of ``pages`` (distinct, int64[m]), reading missing pages; int64[m] slots,
        -1 where no slot could be pinned (the caller reads those records directly). Release with _release."""
        slots = np.full(pages.shape[0], -1, dtype=np.int64)
        for i, k in enumerate(pages.tolist()):
            mine = False
            with self._lock:
                slot = self._lru.get(k)
                if slot is not None:
                    self._lru.move_to_end(k)
                    self._pins[slot] += 1
                    self.hits += 1
                    fill = self._loading.get(k)
                else:
                    self.misses += 1
                    slot = self._victim()
                    if slot < 0:
                        continue
                    self._slot_page[slot] = k
                    self._pins[slot] += 1
                    self._lru[k] = slot
                    self.peak_resident = max(self.peak_resident, self.resident_pages)
                    fill = self._loading[k] = _Fill()
                    mine = True
            if mine:
                self._fill(k, slot, fill)
            elif fill is not None and not (fill.done.wait(self._WAIT_S) and fill.ok):
                # the other thread's read failed (it raises there) or timed out: read these records directly
                self._release(np.array([slot]))
                continue
            slots[i] = slot
        return slots

    def _fill(self, k: int, slot: int, fill: _Fill) -> None:
        start = k * self.page_size
        n = min(self.page_size, self.data_length - start)
        base = slot * self.page_size
        try:
            self.ds.read_into(self.data_offset + start, self._arena[base : base + n])
            if self._crcs is not None and not self._checked[k]:
                if crc32(self._arena[base : base + n]) != int(self._crcs[k]):
                    self.ds.check_page(k)  # raises ChecksumMismatchError naming the page and its offset
                    self.ds.read_into(self.data_offset + start, self._arena[base : base + n])  # good on disk now
                self._checked[k] = True
            fill.ok = True
        finally:
            with self._lock:
                del self._loading[k]
                if fill.ok:
                    self._page_slot[k] = slot
                    self.bytes_read += n
                else:  # forget the page; the slot is free again once its waiters unpin it
                    del self._lru[k]
                    self._slot_page[slot] = -1
                    self._unpin(slot)
            fill.done.set()

    def _unpin(self, slot: int) -> None:
        """Drop one pin (lock held); a slot whose page was forgotten goes back to the free list when unpinned."""
        self._pins[slot] -= 1
        if self._pins[slot] == 0 and self._slot_page[slot] < 0:
            self._free.append(slot)

    def _release(self, slots: np.ndarray) -> None:
        with self._lock:
            for slot in slots.tolist():
                if slot >= 0:
                    self._unpin(slot)

    def page(self, k: int) -> np.ndarray:
        """A copy of page ``k``'s bytes (uint8; the last page may be short), through the cache."""
        slots = self._acquire(np.array([k], dtype=np.int64))
        try:
            n = min(self.page_size, self.data_length - k * self.page_size)
            if slots[0] < 0:
                out = np.empty(n, dtype=np.uint8)
                self.ds.read_into(self.data_offset + k * self.page_size, out)
                with self._lock:
                    self.bytes_read += n
                return out
            base = int(slots[0]) * self.page_size
            return self._arena[base : base + n].copy()
        finally:
            self._release(slots)

    reserve = staticmethod(PreadPages.reserve)

    def gather(self, offs: np.ndarray, lens: np.ndarray, staging: dict,
               ordered: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Copy the records into the thread's staging buffer (grown when needed); return (buf, offsets).

        One nogil kernel call copies every cached record (no Python work per record); records larger than a
        page, or on a page no slot could be pinned for, are read with ``pread``. Raises TruncatedFileError /
        FileChangedError as :meth:`PreadPages.gather` does.
        """
        t0 = time.perf_counter()
        ends = np.cumsum(lens)
        out_offs = ends - lens
        buf = _staging(staging, int(ends[-1]) if lens.shape[0] else 0)
        rel = offs - self.data_offset
        first = rel // self.page_size
        cached = (np.maximum(rel + lens - 1, rel) // self.page_size) == first  # inside one page
        pages, inverse = np.unique(first[cached], return_inverse=True)
        slots = self._acquire(pages)
        try:
            src = np.full(offs.shape[0], -1, dtype=np.int64)
            rec_slot = slots[inverse]
            src[cached] = np.where(rec_slot >= 0, rec_slot * self.page_size + rel[cached] % self.page_size, -1)
            spans.copy_spans(self._arena, src, lens, buf, out_offs)
        finally:
            self._release(slots)
        direct = 0
        for j in np.flatnonzero(src < 0).tolist():  # larger than a page, or no slot: not cached
            if lens[j]:
                self.ds.read_into(int(offs[j]), buf[out_offs[j] : out_offs[j] + lens[j]])
                direct += int(lens[j])
        if direct:
            with self._lock:
                self.bytes_read += direct
        self.ds.check_unchanged()  # also for cache hits: one rule, whatever is cached
        st = staging.get(STATS_KEY)  # Loader.stats(): this thread's read seconds (bytes: self.bytes_read)
        if st is not None:
            st.read_s += time.perf_counter() - t0
        return buf, out_offs

    def read_windows(self, base: int, stride: int, ids: np.ndarray, dtype, out_input: np.ndarray,
                     out_target: np.ndarray, ctx: dict) -> bool:
        """Token windows ``ids`` widened into ``out_input`` / ``out_target`` (``[n, L]``) straight from the
        cache when every window lies in one cached page (one lookup under the lock, one nogil copy kernel; the
        pages stay pinned meanwhile); False (nothing written) otherwise: the caller then uses :meth:`gather`.

        Window ``w`` is the ``L + 1`` tokens of ``dtype`` (the file's) from byte ``base + w * stride`` (``base``
        is the data offset). Counts a hit per distinct page and refreshes their LRU order, as ``gather`` does.
        Raises FileChangedError / TruncatedFileError as :meth:`gather` does.
        """
        dtype = np.dtype(dtype)
        size = dtype.itemsize
        if base != self.data_offset or self.page_size % size or stride % size:
            return False
        arena_dtype, arena = self._typed
        if arena_dtype != dtype or arena.shape[0] * size != self._arena.shape[0]:
            arena = self._arena.view(dtype)
            self._typed = (dtype, arena)
        n = ids.shape[0]
        scratch = ctx.get("window pages")
        if scratch is None or scratch.shape[1] < n:
            scratch = ctx["window pages"] = np.empty((2, max(n, 64)), dtype=np.int64)
        offsets, pages = scratch[0], scratch[1]
        page_len, span = self.page_size // size, out_input.shape[1] + 1
        with self._lock:
            m = token_ops.pin_windows(self._page_slot, self._pins, page_len, stride // size, span, ids, offsets,
                                      pages)
            if m < 0:
                return False
            self.hits += m
            lru = self._lru
            for k in pages[:m].tolist():
                lru.move_to_end(k)
        try:
            token_ops.copy_windows(arena, offsets, out_input, out_target)
        finally:
            with self._lock:
                token_ops.unpin_pages(self._page_slot, self._pins, pages[:m])
        self.ds.check_unchanged()
        return True

    def close(self) -> None:
        with self._lock:
            self._lru.clear()
            self._free = []
            self._page_slot[:] = -1
            self._arena = np.empty(0, dtype=np.uint8)
            self._typed = (None, None)


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
