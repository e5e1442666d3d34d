"""A local many-file record set read as one flat file: one gather per batch across its members.

``load/set_source.py`` reads a set member by member: each member a batch touches gets its own FileSource call
(index lookups, a page gather, a stage fill each), and a member is re-opened (header, sections, index: ~1-2 ms)
whenever the bounded set of open members evicted it. A quasi-random window of 8 pages spans up to 8 members, a
random batch up to ``batch_size``: per batch that is several calls where one file makes one, and with small
members most of an epoch goes to opening files. Here (local members, ``page_cache="os"``, no page verification):

- the set's stages are built once (from the member that sizes the buffers) and hold **set-wide index columns**:
  record ``g``'s offset, length, image size... at row ``g``, filled in for a member the first time one of its
  records is read (its index parsed and checked against the manifest once per Loader; the columns are allocated
  for the whole set but only the members read are written);
- a record's offset is a *virtual* offset ``(k << MEMBER_SHIFT) | offset``, so a stage's one ``pages.gather``
  call reads every member's bytes in one nogil kernel call (``ops.spans.pread_spans_fds``, a descriptor per run);
- members are only descriptors here (:class:`MemberFiles`): at most ``max_open`` open, least recently used closed
  first, re-opened with ``os.open`` + ``fstat`` (~10 us), refused when the file is no longer the one first read
  (another inode, size or modification time: FileChangedError naming the member).

Batches equal the member-by-member reading byte for byte (tests/test_manyfile_loader.py compares both with the
records the test wrote); errors name the set folder and the global sample id, as ``_index`` does.
"""

from __future__ import annotations

import errno
import os

import numpy as np

from ..format.errors import FileChangedError, TruncatedFileError
from ..ops import spans
from ..ops import tokens as token_ops
from ..read.member_cache import MemberCache
from .pages import _staging, gather_runs, resume_reads
from .parts import PageSource
from .source import FileSource
from .stages import ArrayStage, BytesStage, DecodeError, ImageStage, JSONStage, ScalarStage
from .stats import STATS_KEY

MEMBER_SHIFT = 40  # virtual offset = (member << 40) | byte offset: members below 1 TiB (checked from the manifest)
_MASK = (1 << MEMBER_SHIFT) - 1
# the stages whose per-record state is only these index columns (anything else keeps the member-by-member path)
FLAT_STAGES = (ImageStage, ScalarStage, ArrayStage, BytesStage, JSONStage)
PER_RECORD = ("offs", "lens", "heights", "widths", "encodings", "column")


def can_flatten(info, stages, remote, page_cache: str, verify_pages: bool) -> bool:
    """True when a set is read flat: local members, ``page_cache="os"``, no verification, and either records
    (members below 1 TiB) whose stages are of the kinds in FLAT_STAGES (exact types: a subclass may hold more
    per-record state), or stride token windows without a loss mask (:class:`SetWindows`)."""
    if remote or page_cache != "os" or verify_pages:
        return False
    if info.kind == "tokens":
        return len(stages) == 1 and stages[0].strided and stages[0].mask_bits is None
    return all(type(s) in FLAT_STAGES for s in stages) and all(int(b) <= _MASK for b in info.bytes)


def open_file_limit() -> int | None:
    """This process's soft RLIMIT_NOFILE (descriptors it may hold), None when unlimited or unknown."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def too_many_open_files(path, k: int, folder, max_open: int) -> OSError:
    """The EMFILE of opening member ``k`` (``path``) of the set in ``folder``, with the limit and the fixes
    (errno EMFILE kept)."""
    soft = open_file_limit()
    limit = f"is {soft}" if soft is not None else "is reached"
    return OSError(errno.EMFILE, f"{os.fspath(path)}: cannot open member {k} of the many-file dataset "
                   f"{os.fspath(folder)}: too many open files: this process's open-file limit (RLIMIT_NOFILE) "
                   f"{limit} (`ulimit -n`) and the Loader keeps up to {max_open} members of the set open (a quarter "
                   "of the limit, plus a few per decode thread), more than the descriptors this process has left. "
                   "Raise the limit (`ulimit -n 4096` before starting, or resource.setrlimit(resource."
                   "RLIMIT_NOFILE, ...)), close other files the process holds, or read fewer members at once: "
                   "fewer num_threads, a smaller batch_size, order='quasi_random' (a window reads few members), or "
                   "fewer, larger members (records_per_member)")


class MemberFiles:
    """Descriptors of a set's member files, at most ``max_open`` open: a
    :class:`~pageset.read.member_cache.MemberCache` of descriptors (least recently used closed first; a member a
    batch in flight holds is never closed, so the bound can be passed while more are held at once).

    ``register(k, ds)`` takes member k's identity (device, inode, size, mtime) from its opened, checked Dataset
    and keeps a duplicate of its descriptor; ``acquire(member)`` / ``release(member)`` hold the members of a
    read (``member``: int64[n], repeats allowed; closed ones are re-opened: FileChangedError naming the member
    when the file is no longer the one registered, FileNotFoundError when it is gone, OSError EMFILE naming
    the open-file limit); ``acquire_within(member)`` holds them only if the members held stay within
    ``max_open`` (else False: the caller reads fewer members at a time); ``check(ks)`` raises
    TruncatedFileError / FileChangedError when a member changed in place (one ``fstat`` each, after reading).
    ``fds`` int64[members] (-1: closed) is what the read kernels index.
    """

    def __init__(self, paths: list, max_open: int, folder=None):
        n = len(paths)
        self.paths, self.max_open, self.folder = list(paths), int(max_open), folder
        self.fds = np.full(n, -1, dtype=np.int64)
        self._cache = MemberCache(n, self._reopen, self._close_fd, self.max_open)
        self.fit = self._cache.fit  # every member stays open once read: nothing to hold or close
        self._ident: dict[int, tuple] = {}
        # size and mtime of each registered member, checked after each read (one nogil fstat call for a batch's
        # members where fstat_layout_ok, else an os.fstat each)
        self._sizes, self._mtimes = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        self._kernel = None

    @property
    def reopens(self) -> int:
        """Descriptors opened again after they were closed (evicted)."""
        return self._cache.opens

    def register(self, k: int, ds) -> None:
        st = os.fstat(ds.fileno())
        with self._cache.lock:
            self._ident[k] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            self._sizes[k], self._mtimes[k] = st.st_size, st.st_mtime_ns
            fd = int(self.fds[k])
            if fd < 0:
                try:
                    fd = self.fds[k] = os.dup(ds.fileno())
                except OSError as exc:
                    if exc.errno == errno.EMFILE:
                        raise too_many_open_files(self.paths[k], k, self.folder, self.max_open) from None
                    raise
            self._cache.put(k, fd)

    def open_members(self) -> list[int]:
        """The members open now, least recently used first."""
        return self._cache.open_members()

    def acquire_within(self, member: np.ndarray) -> bool:
        """:meth:`acquire` ``member`` unless that opens members and the members held would then pass
        ``max_open`` (a read of more members than may be open at once): then False, nothing held."""
        if self.fit and not self._cache.closed:
            return True
        return self._cache.acquire_within(member) is not None

    def acquire(self, member: np.ndarray) -> None:
        if self.fit and not self._cache.closed:
            return
        self._cache.hold(member)

    def release(self, member: np.ndarray) -> None:
        if self.fit:
            return
        self._cache.release(member)

    def _reopen(self, k: int) -> int:
        path = self.paths[k]
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))  # FileNotFoundError names the path
        except OSError as exc:
            if exc.errno == errno.EMFILE:
                raise too_many_open_files(path, k, self.folder, self.max_open) from None
            raise
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != self._ident[k]:
                raise FileChangedError(path, "file", None, f"member {k} was replaced or modified after the loader "
                                       "first read it (another inode, size or modification time): the set on "
                                       "disk is no longer the one opened; restart the loader on the new set")
        except BaseException:
            os.close(fd)
            raise
        self.fds[k] = fd
        return fd

    def _close_fd(self, k: int, fd: int) -> None:
        self.fds[k] = -1
        os.close(int(fd))

    def use_kernel(self, k: int) -> bool:
        """True when the members can be checked by the nogil ``fstat`` kernels (decided at the first read, on
        member ``k``'s descriptor: the first kernel call of a process loads Numba, ~1 s)."""
        if self._kernel is None:
            self._kernel = spans.fstat_layout_ok(int(self.fds[k]))
        return self._kernel

    def check_touched(self, touched: np.ndarray, buf: np.ndarray) -> None:
        """:meth:`check` of the members flagged in ``touched`` (uint8[members], cleared); ``buf`` int64[18]."""
        if self._kernel is None:  # at the first read (the first kernel call of a process loads Numba: ~1 s)
            first = int(np.flatnonzero(touched)[0]) if touched.any() else -1
            if first < 0:
                return
            self._kernel = spans.fstat_layout_ok(int(self.fds[first]))
        if self._kernel:
            bad = spans.changed_files(self.fds, touched, self._sizes, self._mtimes, buf)
            if bad >= 0:
                self.check([bad])  # the message (and a failing fstat's OSError)
            return
        ks = np.flatnonzero(touched).tolist()
        touched[ks] = 0
        self.check(ks)

    def check(self, ks) -> None:
        fds, sizes, mtimes = self.fds, self._sizes, self._mtimes
        for k in ks:
            st = os.fstat(int(fds[k]))
            if st.st_size == sizes[k] and st.st_mtime_ns == mtimes[k]:
                continue
            size, path = int(sizes[k]), self.paths[k]
            if st.st_size < size:
                raise TruncatedFileError(path, "file", None, f"member {k} shrank to {st.st_size} bytes ({size} when "
                                         "opened): it was truncated or rewritten in place while being read. Replace "
                                         "files by renaming a new one over them, as write_dataset does")
            raise FileChangedError(path, "file", None, f"member {k} was modified in place after it was opened "
                                   f"({size} -> {st.st_size} bytes, modification time changed): bytes read from it "
                                   "may mix old and new content. Replace files by renaming a new one over them")

    def read_into(self, k: int, offset: int, out: np.ndarray) -> None:
        """Finish a short read of member ``k``'s bytes ``[offset, offset + len(out))`` or raise
        TruncatedFileError naming the member and the range."""
        view, done, fd = memoryview(out).cast("B"), 0, int(self.fds[k])
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise TruncatedFileError(self.paths[k], "file", offset, f"member {k}: short read of bytes "
                                         f"[{offset}, {offset + len(view)}): {done} bytes read; the file shrank "
                                         f"to {os.fstat(fd).st_size} bytes: it was truncated or rewritten in place")
            done += n

    def close(self) -> None:
        self._cache.close()


class SetPages(PageSource):
    """The set stages' ``pages``: ``gather(virtual offsets, lengths, staging)`` as PreadPages.gather, each run
    of contiguous bytes read from its member's descriptor, all runs in one kernel call, then every member read
    checked unchanged. The caller holds the members (MemberFiles.acquire)."""

    def __init__(self, files: MemberFiles):
        self.files = files
        spans.prepare()

    @staticmethod
    def reserve(staging: dict, nbytes: int) -> None:
        _staging(staging, nbytes)

    def gather(self, offs: np.ndarray, lens: np.ndarray, staging: dict,
               ordered: bool = True) -> tuple[np.ndarray, np.ndarray]:
        return gather_runs(offs, lens, staging, ordered, lambda *runs: self._read_runs(staging, *runs))

    def _read_runs(self, staging, run_v, run_lens, buf, run_dst) -> None:
        # runs of bytes that follow each other (in one member: a run never crosses 1 TiB of virtual space), read
        # and their members checked in one kernel call
        files = self.files
        scratch = staging.get(self)
        if scratch is None:  # the thread's flags of the members read, fstat buffer
            scratch = staging[self] = (np.zeros(files.fds.shape[0], np.uint8), np.zeros(18, np.int64))
        touched, stat_buf = scratch
        check = files.use_kernel(int(run_v[0] >> MEMBER_SHIFT))

        def finish(j):  # a short read (past the end, or > 2 GiB): read_into finishes it or raises
            lo, v = int(run_dst[j]), int(run_v[j])
            files.read_into(v >> MEMBER_SHIFT, v & _MASK, buf[lo : lo + int(run_lens[j])])

        try:
            r, partial = resume_reads(
                lambda d: spans.pread_set_spans(files.fds, run_v[d:], run_lens[d:], buf, run_dst[d:], touched,
                                                files._sizes, files._mtimes, stat_buf, check, MEMBER_SHIFT),
                finish, run_v.shape[0])
            if r <= -2:  # a member changed: named (check raises; one changed back meanwhile reads on)
                files.check([-2 - r])
            if partial or not check:  # members flagged before a short read (or all, without the kernel)
                files.check_touched(touched, stat_buf)
        except BaseException:
            touched.fill(0)
            raise

    def close(self) -> None:
        pass


class SetRecords(FileSource):
    """The set as one FileSource for ``fill`` / ``fill_rows``: stages over set-wide index columns (see the module
    docstring), ``verifier`` None. Built from the member ``first`` (a FileSource whose stages size the batch
    buffers), ``starts`` int64[members + 1] (each member's first global id), the set's ``path``, ``dataset_id``,
    member ``paths`` and ``max_open``. ``load(k, src)`` copies member k's index columns in (once);
    ``loaded(k)``; ``files`` (MemberFiles)."""

    def __init__(self, first: FileSource, k0: int, starts: np.ndarray, path, dataset_id, paths, max_open: int):
        self.path, self.dataset_id, self.ds = path, dataset_id, first.ds
        self.starts = starts
        self.files = MemberFiles(paths, max_open, path)
        self.pages = SetPages(self.files)
        self.verifier = None
        n = int(starts[-1])
        # the stages of the member that sizes the buffers, re-pointed at the set: pages, path, set-wide columns
        self.stages = first.stages
        self.row_bytes = first.row_bytes
        for st in self.stages:
            if st.pages is not None:
                st.pages = self.pages
            if st.path is not None:
                st.path = path
        self._columns = []  # (stage, attribute, set-wide array) of every per-record column
        for st in self.stages:
            for attr in PER_RECORD:
                col = getattr(st, attr, None)
                if isinstance(col, np.ndarray):
                    glob = np.zeros(n, dtype=col.dtype)
                    self._columns.append((st, attr, glob))
        self.is_loaded = np.zeros(len(paths), dtype=bool)  # members whose index columns are in
        self.all_loaded = False
        self.load(k0, first)  # (its stages still hold its own columns)
        for st, attr, glob in self._columns:
            setattr(st, attr, glob)

    def loaded(self, k: int) -> bool:
        return bool(self.is_loaded[k])

    def load(self, k: int, src: FileSource) -> None:
        """Copy member ``k``'s index columns (from ``src``, its FileSource, stages in the set's order) into the
        set-wide ones (offsets made virtual) and keep a descriptor of its file."""
        lo, hi = int(self.starts[k]), int(self.starts[k + 1])
        by_name = {st.name: st for st in src.stages}
        for st, attr, glob in self._columns:
            col = getattr(by_name[st.name], attr)
            glob[lo:hi] = col + (k << MEMBER_SHIFT) if attr == "offs" else col
        self.files.register(k, src.ds)
        self.is_loaded[k] = True
        self.all_loaded = bool(self.is_loaded.all())

    def fill(self, arrays: list, lo: int, hi: int, ids: np.ndarray, keys, ctx: dict, stages=None) -> None:
        """FileSource.fill over the set; a DecodeError names the member file and the sample's id in it too."""
        try:
            super().fill(arrays, lo, hi, ids, keys, ctx, stages)
        except DecodeError as exc:
            raise self._in_member(exc) from exc

    def _in_member(self, exc: DecodeError) -> DecodeError:
        g = exc.sample
        prefix = f"{self.path}: sample {g},"
        if g is None or not str(exc).startswith(prefix):
            return exc
        k = int(np.searchsorted(self.starts, g, side="right")) - 1
        where = f"{self.path}: sample {g} (sample {g - int(self.starts[k])} of member {k}, {self.files.paths[k]}),"
        return DecodeError(where + str(exc)[len(prefix):], g)

    def close(self) -> None:
        self.files.close()


class SetWindows:
    """A local token set's stride windows read flat: window ``g`` of the set is window ``g - starts[k]`` of member
    ``k = window_member[g]``; a batch's windows, whatever their members, are read, widened and their members
    checked unchanged in one kernel call (``ops.tokens.pread_set_windows``), each window from its member's
    descriptor at that member's token-0 offset. ``stage`` is the first member's TokenStage (its outputs, seq_len,
    dtype, document outputs), ``load(k, src)`` records member k's token-0 offset and descriptor (once), ``files``.
    """

    def __init__(self, first: FileSource, k0: int, starts: np.ndarray, window_member: np.ndarray, path, paths,
                 max_open: int):
        self.stage = st = first.stages[0]
        st.path = path
        self.starts, self.path = starts, path
        self.window_member = window_member  # int16|int32[windows]: each global window's member
        self.files = MemberFiles(paths, max_open, path)
        n = len(paths)
        self._bases = np.zeros(n, dtype=np.int64)
        self._stride = int(st.stride)  # every member's (the layout check refuses others)
        self.is_loaded = np.zeros(n, dtype=bool)  # members whose token-0 offset and descriptor are known
        self.all_loaded = False
        self._row_bytes = (st.seq_len + 1) * st.itemsize
        self.load(k0, first)

    def loaded(self, k: int) -> bool:
        return bool(self.is_loaded[k])

    def load(self, k: int, src: FileSource) -> None:
        self._bases[k] = src.stages[0].data_offset
        self.files.register(k, src.ds)
        self.is_loaded[k] = True
        self.all_loaded = bool(self.is_loaded.all())

    def fill(self, arrays: list, lo: int, hi: int, ids: np.ndarray, ctx: dict) -> None:
        """Rows ``[lo, hi)``: global windows ``ids`` (int64; their members loaded and held by the caller).

        Raises TruncatedFileError (a member shrank) / FileChangedError (a member modified in place), naming it."""
        st, files = self.stage, self.files
        scratch = ctx.get(self)
        if scratch is None:  # the thread's window row and flags of the members read
            scratch = ctx[self] = (np.empty(st.seq_len + 1, dtype=st.dtype),
                                   np.zeros(self._bases.shape[0], dtype=np.uint8), np.zeros(18, np.int64))
        row, touched, stat_buf = scratch
        inp, tgt = arrays[0]["input"][lo:hi], arrays[0]["target"][lo:hi]
        check = files.use_kernel(int(self.window_member[ids[0]])) if ids.shape[0] else False
        def finish(j):  # a short read: read_into finishes it or raises TruncatedFileError naming the member
            k = int(self.window_member[ids[j]])
            files.read_into(k, int(self._bases[k] + (ids[j] - self.starts[k]) * self._stride), row)
            token_ops.split_windows(row[None], inp[j : j + 1], tgt[j : j + 1])

        try:
            r, partial = resume_reads(
                lambda d: token_ops.pread_set_windows(files.fds, self._bases, self.starts, self._stride,
                                                      self.window_member, ids[d:], row, inp[d:], tgt[d:], touched,
                                                      files._sizes, files._mtimes, stat_buf, check),
                finish, ids.shape[0])
            if r <= -2:  # a member changed: named (check raises; one changed back meanwhile reads on)
                files.check([-2 - r])
            if partial or not check:  # members flagged before a short read (or every member, without the kernel)
                files.check_touched(touched, stat_buf)
        except BaseException:
            touched.fill(0)
            raise
        stats = ctx.get(STATS_KEY)
        if stats is not None:
            stats.read_bytes += (hi - lo) * self._row_bytes
        if st.docs:
            st.fill_documents(arrays[0], lo, hi)

    def close(self) -> None:
        self.files.close()
