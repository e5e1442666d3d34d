"""A many-file dataset (``formats/manyfile.md``) as the Loader reads it: ``Loader("folder/")``.

The Loader reads a set as ONE file (:class:`ManyFileSource`, in place of a :class:`~pageset.load.source.FileSource`)
whose records are the set's global record ids (token sets: global window ids, windows cut per member,
``formats/manyfile.md`` section 2) and whose page list is the members' records per page concatenated in manifest
order, computed from the manifest alone (``formats/order.md`` section 6). The plan over it is the one of a file
(``FilePlan``, ``SubsetPlan`` with ``indices=``, or a ``Mixture``'s source): order v1 over that page list, the
state of one file with the set's dataset id, ``_index`` global ids. It equals ``Loader(FileSet(member paths,
set id))`` batch for batch, without opening every member at construction.

Members are opened when they are first needed, and checked against the manifest before any record of theirs is
read (``read/set_manifest.py``: schema, dataset id, size, page and record counts; here also the records per page):

- local members: by the thread filling the batch that first reads one of their records;
- URL members: by the thread calling ``next()``, for the steps the decode threads are about to fill (then their
  pages are prefetched like a single URL's, through the member's own page source and the shared ``cache_dir``).

At most ``max_open`` members stay open (the set's :class:`~pageset.read.member_cache.MemberCache`: least recently
used closed first; a member a batch in flight reads is never closed): by default ``MAX_OPEN_MEMBERS``, or a
quarter of the process's open-file limit (``ulimit -n``) if that is lower. A slice whose rows lie in more members
than may be held at once (random batches over many small members) is read a few members at a time (flat reading:
runs of rows of at most ``max_open // 4`` members; else one member at a time), so a set of any size stays within
the limit: about ``max_open`` plus a few members per decode thread. A member that still cannot be opened (the
process holds other files) raises OSError EMFILE naming the member, the limit and the fixes. A missing member
raises FileNotFoundError naming it, a replaced one MemberMismatchError, from the ``next()`` of the first batch that
needs it, before any batch with its records.
"""

from __future__ import annotations

import errno
import threading
from dataclasses import dataclass

import numpy as np

from ..read import member_cache
from ..read.member_cache import MemberCache, max_open_files
from ..read.reader import Dataset
from ..read.remote import local_path, url_scheme
from ..read.set_manifest import CheckedMembers, ManyFileSet
from .parts import Source
from .set_pages import LocalSetPages, RemoteSetPages
from .set_records import SetRecords, SetWindows, can_flatten, too_many_open_files
from .source import FileSource, RowReader
from .stages import BytesStage, ImagesStage

PREFETCH_SHARE = 8  # a URL member prefetches prefetch_bytes / PREFETCH_SHARE (the members of a default window)


def _member_chunks(member: np.ndarray, cap: int) -> list[tuple[int, int]]:
    """Consecutive ranges ``[a, b)`` covering ``member`` (int64[n]), each of at most ``cap`` distinct members."""
    out, a, seen = [], 0, set()
    for i, k in enumerate(member.tolist()):
        if k not in seen and len(seen) == cap:
            out.append((a, i))
            a, seen = i, set()
        seen.add(k)
    out.append((a, member.shape[0]))
    return out


class _TokenMember:
    """A token member as ``read/set_manifest.py``'s checks see it (``len``: tokens, ``documents``) over its Dataset."""

    def __init__(self, ds: Dataset):
        self.dataset = ds
        self.documents = int(ds.tokens_info["documents"]) if ds.tokens_info is not None else -1

    def __len__(self) -> int:
        return int(self.dataset.tokens_info["count"]) if self.dataset.tokens_info is not None else -1

    def close(self) -> None:
        self.dataset.close()


class ManyFileInput:
    """A many-file set opened by the Loader: its manifest (``info``, a ManyFileSet), nothing else open.

    ``path`` (the folder), ``dataset_id`` (the set's), ``remote`` (True when the members are URLs, else None),
    ``open_member(k)`` -> member k's Dataset, checked against the manifest (FileNotFoundError,
    MemberMismatchError, SchemaError naming the member), ``close()`` (releases the manifest's lease, which kept
    a rewrite from removing these members; the members themselves belong to the :class:`ManyFileSource`)."""

    def __init__(self, info: ManyFileSet, storage_options, remote: dict):
        self.info, self.path, self.dataset_id = info, info.folder, info.dataset_id
        self.remote = True if url_scheme(local_path(info.folder)) is not None else None
        tokens = self._tokens = info.kind == "tokens"

        def opener(p):
            ds = Dataset(p, storage_options if url_scheme(p) else None, **remote)
            return _TokenMember(ds) if tokens else ds

        self._checked = CheckedMembers(info, opener, storage_options)

    def open_member(self, k: int) -> Dataset:
        ds = self._checked.open(k)  # opened and compared with the manifest's entry (read/set_manifest.py)
        return ds.dataset if self._tokens else ds  # (a token member is checked through its _TokenMember)

    def close(self) -> None:
        self.info.lease.close()


@dataclass(frozen=True)
class SetView:
    """What the Loader asks of a source's ``ds``: a virtual file whose page k is the set's k-th member page
    (``data_offset`` 0, ``page_size``, ``page_count`` all members' pages), its ``fields``, ``remote``."""

    path: str
    dataset_id: str
    fields: dict
    page_size: int
    page_count: int
    data_offset: int
    remote: object

    def close(self) -> None:
        pass


class ManyFileSource(Source):
    """A many-file set read as one file (see the module docstring); built by the Loader like a FileSource.

    ``ManyFileSource(inp, pipelines, page_cache, cache_pages, verify_pages, in_mixture, remote_options,
    array_type, max_open=None)``: ``inp`` a :class:`ManyFileInput`; the rest as for FileSource, applied to
    every member (``cache_pages`` an int: the set's share, split over ``max_open`` members; ``max_open`` default
    ``read.member_cache.MAX_OPEN_MEMBERS``, or a quarter of the open-file limit if lower).

    Attributes as FileSource: ``path`` (the folder), ``dataset_id`` (the set's), ``stages`` (of the first member
    opened: they size and hand out the batch buffers), ``n_records`` (global ids), ``page_sizes`` (the members'
    concatenated), ``spans(ids)`` (virtual byte spans, for the remote prefetch), ``pages``, ``verifier`` (None:
    each member checks its own pages), ``ds`` (a :class:`SetView`); ``starts`` int64[members + 1] the global id
    of each member's first record; ``open_members()`` the indices open now.

    Raises PipelineError / ValueError as FileSource for the first member, and, when a later member is opened, the
    errors of ``open_member`` and ValueError naming the member when it does not fit the batch buffers (a Bytes
    field longer than the first member's longest value) or its records per page differ from the manifest's.
    """

    def __init__(self, inp: ManyFileInput, pipelines: dict, page_cache: str, cache_pages, verify_pages: bool,
                 in_mixture: bool = False, remote_options: dict | None = None, array_type: str = "torch",
                 max_open: int | None = None):
        info = self.info = inp.info
        self.input, self.path, self.dataset_id = inp, info.folder, info.dataset_id
        self.max_open = int(max_open_files(member_cache.MAX_OPEN_MEMBERS) if max_open is None else max_open)
        if isinstance(cache_pages, int):
            cache_pages = max(1, cache_pages // min(self.max_open, len(info.paths)))
        opts = dict(remote_options or {})
        if inp.remote:
            prefetch = opts.get("prefetch_bytes")
            opts["prefetch_bytes"] = (64 << 20 if prefetch is None else prefetch) // PREFETCH_SHARE
        self._args = (pipelines, page_cache, cache_pages, verify_pages, in_mixture, opts, array_type)
        self._lock = threading.RLock()
        # the open members' FileSources (not used when the set is read flat: set_records.MemberFiles)
        self._members = MemberCache(len(info.paths), self._open_member, self._close_member, self.max_open,
                                    f"{self.path}: the loader was closed")
        self._closed_stats: dict = {}  # the counters of closed members' page sources (remote_stats())
        self._closed = False
        self._opened = 1  # members opened so far (the first one below)
        # the first member opened: the largest (a token set's shortest members may hold no window at all)
        k0 = int(np.argmax(info.tokens)) if info.kind == "tokens" else self._widest(pipelines)
        first = self._build(k0)
        try:
            self.stages, self.row_bytes, self.verifier = first.stages, first.row_bytes, None
            self._token = info.kind == "tokens"
            if not self._token and any(st.packing for st in first.stages):
                raise ValueError(
                    f"{self.path}: packed rows of records (PadTokens(packing='best_fit')) of a many-file set are not "
                    "supported: rows are packed within one file. Merge the set into one file and pack that "
                    "(pageset merge OUT.pageset FOLDER), or load the set without packing")
            if self._token and first.stages[0].packing:
                raise ValueError(
                    f"{self.path}: packed rows (TokenWindows(packing='best_fit')) of a many-file token set are not "
                    "supported: rows are packed within one file's pages. Merge the set into one file and pack that "
                    "(pageset merge OUT.pageset FOLDER), or read the set as stride windows (packing=None)")
            pages = np.asarray(info.pages, np.int64)
            if self._token:
                st = first.stages[0]
                self._stride, self._window_bytes = st.seq_len * st.itemsize, (st.seq_len + 1) * st.itemsize
                per = [_windows_per_page(t, p, info.page_size, st.seq_len, st.itemsize)
                       for t, p in zip(info.tokens, info.pages)]
            else:
                per = [np.asarray(r, np.int64) for r in info.records_per_page]
            counts = np.array([int(p.sum()) for p in per], dtype=np.int64)
            self.starts = np.zeros(len(per) + 1, np.int64)
            np.cumsum(counts, out=self.starts[1:])
            self._rpp_base = np.zeros(len(per) + 1, np.int64)  # where member k's entries start in page_sizes
            np.cumsum([p.shape[0] for p in per], out=self._rpp_base[1:])
            self._page_base = np.zeros(len(per) + 1, np.int64)  # member k's first page in the virtual file
            np.cumsum(pages, out=self._page_base[1:])
            self.page_sizes = np.concatenate(per)
            self._page_ends = np.cumsum(self.page_sizes)
            self.n_records = int(self.starts[-1])
            # a token set's member of each window (windows are few: tokens / seq_len), int16/int32
            self._window_member = None
            if self._token:
                dt = np.int16 if len(per) <= np.iinfo(np.int16).max else np.int32
                self._window_member = np.repeat(np.arange(len(per), dtype=dt), counts)
            # stride windows: every column a prediction; packed rows of a set are not supported here (None)
            self.tokens = self.n_records * int(first.stages[0].seq_len) if self._token else None
            self._members_pages = pages
            self._check_layout(k0, first)
            # a local record set (page_cache="os", no verification) is read flat: set-wide index columns, one
            # gather per batch across members, members kept as descriptors (load/set_records.py)
            self._flat = None
            if can_flatten(info, first.stages, inp.remote, page_cache, verify_pages):
                fds = self.max_open if max_open is not None else max_open_files(member_cache.MAX_OPEN_FILES)
                if self._token:
                    self._flat = SetWindows(first, k0, self.starts, self._window_member, self.path, info.paths, fds)
                else:
                    self._flat = SetRecords(first, k0, self.starts, self.path, self.dataset_id, info.paths, fds)
                first.close()
                first.ds.close()  # its descriptor lives on (a duplicate) in the flat reader
            else:
                self._members.put(k0, first)
            self.ds = SetView(self.path, self.dataset_id, first.ds.fields, info.page_size, int(self._page_base[-1]), 0,
                              inp.remote)
            self.pages = RemoteSetPages(self) if inp.remote else LocalSetPages()
        except BaseException:
            first.close()
            first.ds.close()
            raise

    # ---- members ------------------------------------------------------------------------------------------
    def _build(self, k: int) -> FileSource:
        try:
            ds = self.input.open_member(k)
        except OSError as exc:
            if exc.errno == errno.EMFILE:
                raise too_many_open_files(self.info.paths[k], k, self.path, self.max_open) from None
            raise
        try:
            return FileSource(ds, *self._args)
        except BaseException:
            ds.close()
            raise

    def _widest(self, pipelines: dict) -> int:
        """The member whose Bytes / TokenIds values are the longest and whose RGBImages records hold the most
        images (it sizes the batch buffers), found by opening each member once, one at a time; member 0 when no
        such field is loaded (nothing else depends on the data). When no member is widest in every such field,
        the widest in the first one (a narrower one's check then names the field)."""
        columns = [f"{f['name']}.count" if f.get("kind") == "rgb_images" else f"{f['name']}.length"
                   for f in self.info.manifest.schema.get("fields", [])
                   if f.get("kind") in ("bytes", "token_ids", "rgb_images")
                   and not (f["name"] in pipelines and pipelines[f["name"]] is None)]
        if not columns:
            return 0
        widths = []
        for k in range(len(self.info.paths)):
            ds = self.input.open_member(k)
            try:
                widths.append([int(ds.index[c].max(initial=0)) for c in columns])
            finally:
                ds.close()
        widths = np.asarray(widths)
        best = np.flatnonzero((widths == widths.max(axis=0)).all(axis=1))
        return int(best[0]) if best.size else int(np.argmax(widths[:, 0]))

    def _check_layout(self, k: int, src: FileSource) -> None:
        want = self.page_sizes[self._rpp_base[k] : self._rpp_base[k + 1]]
        if not np.array_equal(np.asarray(src.page_sizes, np.int64), want):
            raise ValueError(f"{src.path}: member {k} of the many-file dataset {self.path}: its records per page "
                             "differ from the manifest's; the file was replaced or rewritten after the manifest was "
                             "written: restore the member or rewrite the set")

    def _fits(self, k: int, src: FileSource) -> None:
        for a, b in zip(self.stages, src.stages):
            if a.variable_width and b.max_len > a.max_len:
                unit = "images" if isinstance(a, ImagesStage) else "bytes" if isinstance(a, BytesStage) else "ids"
                raise ValueError(f"{src.path}: member {k} of the many-file dataset {self.path}: field {b.name!r} has "
                                 f"a value of {b.max_len} {unit}, more than the {a.max_len} {unit} the batch buffers "
                                 "were sized for (the first member's longest); load the set with Loader(FileSet("
                                 "member paths, dataset_id)), which opens every member first, or pad the values")

    def _open_member(self, k: int) -> FileSource:
        """Member k's FileSource, opened and checked (the member cache's ``open_member``)."""
        src = self._build(k)
        try:
            self._check_layout(k, src)
            self._fits(k, src)
        except BaseException:
            src.close()
            src.ds.close()
            raise
        self.pages.opened(k, src)
        return src

    def _close_member(self, k: int, src: FileSource) -> None:
        stats = src.pages.stats()
        if stats is not None:  # a closed member's counters stay in remote_stats()
            for key, value in stats.items():
                self._closed_stats[key] = self._closed_stats.get(key, 0) + value
        src.close()
        src.ds.close()

    def acquire(self, ks) -> list[FileSource]:
        """The open sources of members ``ks`` (opened now if needed), held until :meth:`release`."""
        return self._members.acquire(ks)

    def acquire_within(self, ks) -> list[FileSource] | None:
        """:meth:`acquire` ``ks`` (distinct members) unless that opens members and the members held would then
        pass ``max_open``: then None, nothing held (the caller reads them one at a time)."""
        return self._members.acquire_within(ks)

    def release(self, ks) -> None:
        self._members.release(ks)

    def open_source(self, k: int):
        """Member k's FileSource when it is open now, else None (nothing opened, no use recorded)."""
        return self._members.peek(k)

    @property
    def opened_count(self) -> int:
        """Member files opened so far: parsed members, and (flat reading) descriptors re-opened after eviction."""
        return self._opened + self._members.opens + (self._flat.files.reopens if self._flat is not None else 0)

    def open_members(self) -> list[int]:
        if self._flat is not None:
            return self._flat.files.open_members()
        return self._members.open_members()

    def members_of(self, ids: np.ndarray) -> np.ndarray:
        """int64 member index of each global id (a token set's: a lookup in its per-window column)."""
        if self._window_member is not None:
            return self._window_member[ids]
        return np.searchsorted(self.starts, ids, side="right") - 1

    # ---- reading ------------------------------------------------------------------------------------------
    def _flat_members(self, member: np.ndarray, hold: bool = True) -> None:
        """Hold the members ``member`` (int64[n], flat reading), their index loaded first (once per member);
        ``hold=False``: only load their index."""
        flat = self._flat
        missing = member[~flat.is_loaded[member]] if not flat.all_loaded else ()
        for k in np.unique(missing).tolist() if len(missing) else ():
            if not flat.loaded(k):
                with self._lock:
                    if self._closed:
                        raise RuntimeError(f"{self.path}: the loader was closed")
                    if not flat.loaded(k):
                        src = self._build(k)  # opened and checked against the manifest (read/set_manifest.py)
                        try:
                            self._check_layout(k, src)
                            self._fits(k, src)
                            flat.load(k, src)
                            self._opened += 1
                        finally:
                            src.close()
                            src.ds.close()
        if hold:
            flat.files.acquire(member)

    def _flat_chunks(self, member: np.ndarray) -> list[tuple[int, int]]:
        """Load the index of the members ``member`` (flat reading), and hold them all, ``[(0, n)]``; or, when
        more than may be held at once, hold none: runs ``[a, b)`` of at most ``max_open // 4`` members each,
        to be held one run at a time."""
        self._flat_members(member, hold=False)
        files = self._flat.files
        if files.acquire_within(member):
            return [(0, member.shape[0])]
        return _member_chunks(member, max(1, files.max_open // 4))

    def _flat_fill(self, arrays, lo: int, hi: int, ids, keys, ctx, member) -> None:
        flat = self._flat
        chunks = self._flat_chunks(member)
        for a, b in chunks:
            sub = member[a:b]
            if len(chunks) > 1:
                flat.files.acquire(sub)
            try:
                if self._token:
                    flat.fill(arrays, lo + a, lo + b, ids[a:b], ctx)
                else:
                    flat.fill(arrays, lo + a, lo + b, ids[a:b], None if keys is None else keys[a:b], ctx)
            finally:
                flat.files.release(member if len(chunks) == 1 else sub)

    def fill(self, arrays: list, lo: int, hi: int, ids: np.ndarray, keys, ctx: dict, stages=None) -> None:
        """Fill rows ``[lo, hi)`` with global records ``ids``: one member's call when they all lie in one member,
        else each row from its member, token windows in one read call (the Loader's RowReader over the members);
        a flat set (load/set_records.py): one call over all members."""
        flat = self._flat
        if flat is not None:
            if flat.all_loaded and flat.files.fit:  # every member read once and kept open: nothing to hold
                if self._token:  # (the kernel looks each window's member up)
                    flat.fill(arrays, lo, hi, ids, ctx)
                else:  # (the offsets name the members)
                    flat.fill(arrays, lo, hi, ids, keys, ctx)
                return
            self._flat_fill(arrays, lo, hi, ids, keys, ctx, self.members_of(ids))
            return
        member = self.members_of(ids)
        k = int(member[0])
        if k == int(member[-1]) and (member == k).all():
            (src,) = self.acquire([k])
            try:
                src.fill(arrays, lo, hi, ids - self.starts[k], keys, ctx)
            finally:
                self.release([k])
            return
        ks = np.unique(member)
        srcs = self.acquire_within(ks.tolist())
        if srcs is None:  # more members than may be open at once: one member at a time
            self.fill_rows(arrays, np.arange(lo, hi), ids, keys, ctx)
            return
        reader = None
        try:
            reader = RowReader(srcs, self.stages)
            rows = np.zeros(hi, np.int16)  # RowReader reads rows [lo, hi) of batch-long arrays
            rows[lo:] = np.searchsorted(ks, member)
            local = np.zeros(hi, np.int64)
            local[lo:] = ids - self.starts[member]
            full_keys = None
            if keys is not None:
                full_keys = np.zeros(hi, keys.dtype)
                full_keys[lo:] = keys
            reader.fill(arrays, lo, hi, rows, local, full_keys, ctx)
        finally:
            ctx.pop(reader, None)  # the reader's scratch (it is made for this call)
            for s in srcs:
                ctx.pop(("rows", id(s)), None)  # the member's scratch dies with it
            self.release(ks.tolist())

    def fill_rows(self, arrays: list, rows: np.ndarray, ids: np.ndarray, keys, ctx: dict) -> None:
        """Fill the sorted rows ``rows`` with global records ``ids`` (a Mixture's rows of this set)."""
        if self._flat is not None:
            member = self.members_of(ids)
            chunks = self._flat_chunks(member)
            for c0, c1 in chunks:  # (runs of rows of a few members each when they are too many to hold at once)
                sub = member[c0:c1]
                if len(chunks) > 1:
                    self._flat.files.acquire(sub)
                try:
                    r, g = rows[c0:c1], ids[c0:c1]
                    if self._token:  # one call per run of consecutive rows
                        cuts = [0, *(np.flatnonzero(np.diff(r) != 1) + 1).tolist(), r.shape[0]]
                        for a, b in zip(cuts[:-1], cuts[1:]):
                            self._flat.fill(arrays, int(r[a]), int(r[a]) + b - a, g[a:b], ctx)
                    else:
                        self._flat.fill_rows(arrays, r, g, None if keys is None else keys[c0:c1], ctx)
                finally:
                    self._flat.files.release(member if len(chunks) == 1 else sub)
            return
        member = self.members_of(ids)
        for k in np.unique(member).tolist():
            sel = np.flatnonzero(member == k)
            (src,) = self.acquire([k])
            try:
                src.fill_rows(arrays, rows[sel], ids[sel] - self.starts[k], None if keys is None else keys[sel], ctx)
            finally:
                ctx.pop(("rows", id(src)), None)
                self.release([k])

    def spans(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Byte spans of global records ``ids`` in the virtual file of all member pages (``ds``): exact for token
        windows and for records of open members, else the page of the record's first byte (a record running on
        into the next page fetches it when read)."""
        member = self.members_of(ids)
        ps = self.info.page_size
        base = self._page_base[member] * ps
        if self._token:
            return base + (ids - self.starts[member]) * self._stride, np.full(ids.shape[0], self._window_bytes,
                                                                              np.int64)
        page = np.searchsorted(self._page_ends, ids, side="right") - self._rpp_base[member]  # member page
        page = np.minimum(page, np.maximum(self._members_pages[member] - 1, 0))
        starts = base + page * ps
        lens = (self._members_pages[member] > 0).astype(np.int64)
        open_now = self._members.items()
        for k in np.unique(member).tolist():
            src = open_now.get(k)
            if src is not None:
                sel = np.flatnonzero(member == k)
                s, n = src.spans(ids[sel] - self.starts[k])
                starts[sel] = base[sel] + (np.asarray(s, np.int64) - src.ds.data_offset)
                lens[sel] = n
        return starts, lens

    def close(self) -> None:
        self.pages.close()
        with self._lock:
            self._closed = True
            if self._flat is not None:
                self._flat.close()
        self._members.close()


def _windows_per_page(tokens: int, pages: int, page_size: int, seq_len: int, itemsize: int) -> np.ndarray:
    """int64[max(pages, 1)]: windows of a token member starting in each page (TokenStage.records_per_page, from
    the manifest's token and page counts)."""
    n = max(int(tokens) - 1, 0) // seq_len
    bounds = np.arange(max(int(pages), 1) + 1, dtype=np.int64) * page_size
    return np.diff(np.minimum(-(-bounds // (seq_len * itemsize)), n))
