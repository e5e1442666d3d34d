"""One opened pageset file as the loader reads it: page access, one stage per loaded field, and its records.

A Loader reads one ``FileSource`` (a file, or a subset of it) or several (a ``Mixture``, a ``FileSet``), through
a ``RowReader``; the threads fill batch rows from whichever source a row's sample comes from.
"""

from __future__ import annotations

import time

import numpy as np

from ..format.fields import JSON, Bytes, Float, Int, NDArray, RGBImage, RGBImages, TokenIds, Tokens
from ..ops import tokens as token_ops
from ..ops.transforms import (
    CenterCrop,
    FloatDecoder,
    IntDecoder,
    PadTokens,
    RandomResizedCrop,
    SmartResize,
    TokenWindows,
)
from .pages import PageVerifier, PreadPages, ProcessPageCache, resume_reads
from .packed import PackedIdsStage, PackedTokenStage
from .patches import PatchImagesStage, is_patch_pipeline
from .stages import (
    ArrayStage,
    BytesStage,
    ImageStage,
    ImagesStage,
    JSONStage,
    PipelineError,
    ScalarStage,
    Stage,
    TokenIdsStage,
    TokenStage,
)
from .parts import Source, StageOp
from .stats import STATS_KEY, add_stage

# Rows of a mixture slice that come from one file but are not contiguous are filled in place, one call per run of
# rows, when a row's outputs are at least this large (images: the copy would cost more than the call), else in
# one call into scratch buffers and copied to their rows (token windows, scalars: the call costs more). A
# 224x224 float32 image is 602 KB a row, a 1024-token window 16 KB.
IN_PLACE_ROW_BYTES = 1 << 18



def build_stage(name, field, ops, ds, pages, array_type: str = "torch") -> Stage:
    """The stage for one field and its pipeline (``None``/missing ops: the field's default decoder); its arrays
    are handed out as ``array_type`` ("torch" tensors or "numpy" arrays)."""
    if ops is not None and not isinstance(ops, (list, tuple)):
        raise PipelineError(f"field {name!r}: a pipeline is a list of ops, e.g. [RandomResizedCrop(224)], "
                            f"got {ops!r}")
    ops = list(ops or [])
    for op in ops:
        if isinstance(op, type):
            raise PipelineError(f"field {name!r}: {op.__name__} is a class; pass an instance, e.g. {op.__name__}()")
    if ops and isinstance(ops[0], StageOp):  # a stage kind defined outside pageset (load/parts.py)
        return ops[0].build_stage(name, field, ops, ds, pages, array_type)
    if isinstance(field, Tokens):
        if any(isinstance(op, TokenWindows) and op.packing for op in ops):
            return PackedTokenStage(name, ops, ds, pages, array_type)
        return TokenStage(name, ops, ds, pages, array_type)
    if isinstance(field, RGBImage):
        return ImageStage(name, ops, ds, pages, array_type)
    if isinstance(field, RGBImages):
        if is_patch_pipeline(ops):
            return PatchImagesStage(name, ops, ds, pages, array_type)
        return ImagesStage(name, ops, ds, pages, array_type)
    if isinstance(field, Int):
        return ScalarStage(name, ops, ds, IntDecoder(), array_type)
    if isinstance(field, Float):
        return ScalarStage(name, ops, ds, FloatDecoder(), array_type)
    if isinstance(field, NDArray):
        return ArrayStage(name, ops, ds, field, pages, array_type)
    if isinstance(field, Bytes):
        return BytesStage(name, ops, ds, pages, array_type)
    if isinstance(field, JSON):
        return JSONStage(name, ops, ds, pages)
    if isinstance(field, TokenIds):
        if any(isinstance(op, PadTokens) and op.packing for op in ops):
            return PackedIdsStage(name, ops, ds, pages, array_type)
        return TokenIdsStage(name, ops, ds, pages, array_type)
    raise PipelineError(f"field {name!r}: the loader does not handle {type(field).__name__} fields")


def _is_image_pipeline(ops) -> bool:
    """Whether a pipeline loads images (its first op a crop or SmartResize)."""
    return isinstance(ops, (list, tuple)) and bool(ops) and isinstance(ops[0], (RandomResizedCrop, CenterCrop,
                                                                              SmartResize))


class _NoImages:
    """An open dataset seen as if field ``name`` were an RGBImages field holding no image in any record (a
    Mixture member without the image lists the other members load): what the image stages read of it."""

    def __init__(self, ds, name: str):
        self.path = ds.path
        zeros = np.zeros(len(ds), dtype=np.int64)
        self.index = {f"{name}.{column}": zeros for column in ("offset", "length", "count")}


def _link_image_tokens(path, stages) -> None:
    """Give each stage that takes image token counts from another field (``image_tokens_from``) that field's
    stage; PipelineError when the field is not loaded."""
    by_name = {s.name: s for s in stages}
    for stage in stages:
        images = stage.images_absent and stage.expand.images
        if images and images not in by_name:  # not a Mixture member loading the absent image lists as empty
            raise PipelineError(f"field {stage.name!r}: ExpandImageTokens(images={images!r}) names no RGBImages "
                                f"field of {path}; its fields are {[s.name for s in stages]}")
        if stage.image_tokens_from is None:
            continue
        other = by_name.get(stage.image_tokens_from)
        if other is None:
            raise PipelineError(f"{path}: field {stage.name!r} takes its image tokens from field "
                                f"{stage.image_tokens_from!r}, which is not loaded: load it with SmartResize(...)")
        stage.link_image_tokens(other)


class FileSource(Source):
    """Page access, stages and record layout of one open dataset ``ds`` (the caller owns ``ds``).

    Attributes: ``ds``, ``path``, ``dataset_id``; ``pages`` (PreadPages, ProcessPageCache, or RemotePages for a URL); ``stages`` (one
    per loaded field, file order); ``n_records`` (records, or seq_len windows for a token file);
    ``page_sizes`` int64[K] records per page; ``spans(ids) -> (starts, lengths)`` absolute byte spans;
    ``verifier`` (PageVerifier or None). Raises PipelineError for pipelines naming fields the file lacks or
    invalid for its fields (``in_mixture``: fields mapped to None may be missing); ``array_type`` ("torch" or
    "numpy") is what the stages hand out; ``cache_pages`` (``page_cache="process"``) is an int or a function
    ``(n_records, page_count) -> int``; ``close()`` releases the page access (not ``ds``).
    """

    direct_windows = True  # RowReader may read a file's token windows itself (pread on ds.fileno())

    def __init__(self, ds, pipelines: dict, page_cache: str, cache_pages, verify_pages: bool,
                 in_mixture: bool = False, remote_options: dict | None = None, array_type: str = "torch"):
        self.ds, self.path, self.dataset_id = ds, ds.path, ds.dataset_id
        if ds.remote is not None:  # a URL: whole pages by range request, each CRC-checked on arrival
            if not isinstance(page_cache, str):
                raise ValueError(f"{self.path}: page_cache={page_cache.__name__} reads local files; a URL is read "
                                 "through its own page source (give page_cache='os' or 'process')")
            from .remote_pages import RemotePages

            self.pages = RemotePages(ds, **(remote_options or {}))
            verify_pages = False
        elif not isinstance(page_cache, str):  # a storage kind of the caller's (a PageSource subclass)
            self.pages = page_cache(ds)
        else:  # "process": a ProcessPageCache replaces it below, sized once the record count is known
            self.pages = PreadPages(ds)
        try:
            # In a mixture, a field switched off with None may be missing from some of the files, and so may an
            # image list loaded by the others (its records then hold no image: text-only conversations).
            absent = [n for n in pipelines if n not in ds.fields and pipelines[n] is not None]
            no_images = [n for n in absent if in_mixture and _is_image_pipeline(pipelines[n])]
            unknown = {n for n in pipelines if n not in ds.fields and not (in_mixture and pipelines[n] is None)}
            if unknown - set(no_images):
                raise PipelineError(f"{self.path}: pipelines name unknown fields {sorted(unknown - set(no_images))}; "
                                    f"the file has {list(ds.fields)}")
            self.stages = [build_stage(n, f, pipelines.get(n), ds, self.pages, array_type)
                           for n, f in ds.fields.items() if not (n in pipelines and pipelines[n] is None)]
            self.stages += [build_stage(n, RGBImages(), pipelines[n], _NoImages(ds, n), self.pages, array_type)
                            for n in no_images]
            self.without = frozenset(no_images)  # the fields it lacks and loads as empty image lists
            _link_image_tokens(self.path, self.stages)
            # Records are the file's records, or, for a token file, its seq_len windows.
            windows = [s for s in self.stages if s.windows]
            if windows and windows[0].record_rows is not None:  # records packed into rows: every field reads rows
                for stage in self.stages:
                    if stage is windows[0]:
                        continue
                    if not stage.reads_rows:
                        raise PipelineError(f"{self.path}: field {stage.name!r} cannot be loaded with packed rows "
                                            f"(field {windows[0].name!r} packs several records a row): map it to "
                                            "None in pipelines, or load the file without packing")
                    stage.read_rows(windows[0].record_rows)
            if windows:
                self.n_records = windows[0].n_records
                self.page_sizes = windows[0].records_per_page(ds.page_count)
                self.spans = windows[0].spans
                self.tokens = windows[0].token_count()
            else:
                self.tokens = None  # records, not token rows
                self.n_records = len(ds)
                self.page_sizes = ds.records_per_page()
                rec_off = ds.index["_offset"].astype(np.int64)
                rec_len = ds.index["_length"].astype(np.int64)
                self.spans = lambda ids: (rec_off[ids], rec_len[ids])
            if page_cache == "process" and ds.remote is None:
                capacity = cache_pages(self.n_records, ds.page_count) if callable(cache_pages) else cache_pages
                self.pages = ProcessPageCache(ds, capacity)
                for stage in self.stages:
                    if stage.pages is not None:
                        stage.pages = self.pages
            elif ds.remote is not None and callable(cache_pages):
                # a URL's in-memory pages hold the quasi-random windows in flight too, as the process cache
                # does, plus what is prefetched ahead of them (the next window's first pages): a window's pages
                # are then fetched once, not once per batch that reads them
                in_flight = cache_pages(self.n_records, ds.page_count) * ds.page_size
                self.pages.memory_bytes = max(self.pages.memory_bytes, in_flight + 2 * self.pages.prefetch_bytes)
            self.verifier = PageVerifier(ds) if verify_pages else None
            self.row_bytes = sum(int(np.prod(shape)) * np.dtype(dt).itemsize
                                 for st in self.stages for shape, dt, _ in st.outputs.values())
        except BaseException:
            self.pages.close()
            raise

    def fill(self, arrays: list, lo: int, hi: int, ids: np.ndarray, keys: np.ndarray, ctx: dict,
             stages=None) -> None:
        """Fill rows ``[lo, hi)`` of a slot's ``arrays`` (one dict per stage) with records ``ids`` of this file.

        ``stages``: indices of the stages to run (default all; else the caller has checked the pages)."""
        if stages is None:
            if self.verifier is not None:
                self.verifier.check(*self.spans(ids), ids)
            stages = range(len(self.stages))
        if len(self.stages) == 1:  # one field: Loader.stats() counts the whole slice as its stage
            for k in stages:
                self.stages[k].fill(arrays[k], lo, hi, ids, keys, ctx)
            return
        for k in stages:  # several fields: each stage's wall seconds (Loader.stats()["stages"])
            t0 = time.perf_counter()
            self.stages[k].fill(arrays[k], lo, hi, ids, keys, ctx)
            add_stage(ctx, self.stages[k].name, time.perf_counter() - t0)

    def fill_rows(self, arrays: list, rows: np.ndarray, ids: np.ndarray, keys: np.ndarray, ctx: dict) -> None:
        """Fill the (sorted, possibly scattered) rows ``rows`` of a slot's ``arrays`` with records ``ids``.

        Contiguous rows are filled in place. Scattered rows: stages that write rows themselves (images) do, in
        one call; the others are filled in place one call per run of rows when their outputs are large (see
        IN_PLACE_ROW_BYTES), else into the thread's scratch buffers in one call per stage and copied to their rows.
        """
        m = rows.shape[0]
        if int(rows[-1]) - int(rows[0]) == m - 1:
            self.fill(arrays, int(rows[0]), int(rows[0]) + m, ids, keys, ctx)
            return
        if self.verifier is not None:
            self.verifier.check(*self.spans(ids), ids)
        rest = []
        for k, stage in enumerate(self.stages):
            if stage.fills_rows:
                t0 = time.perf_counter()
                stage.fill_rows(arrays[k], rows, ids, keys, ctx)
                if len(self.stages) > 1:
                    add_stage(ctx, stage.name, time.perf_counter() - t0)
            else:
                rest.append(k)
        if not rest:
            return
        row_bytes = sum(int(np.prod(shape)) * np.dtype(dt).itemsize
                        for k in rest for shape, dt, _ in self.stages[k].outputs.values())
        if row_bytes >= IN_PLACE_ROW_BYTES:
            cuts = [0, *(np.flatnonzero(np.diff(rows) != 1) + 1).tolist(), m]
            for a, b in zip(cuts[:-1], cuts[1:]):
                self.fill(arrays, int(rows[a]), int(rows[a]) + b - a, ids[a:b], None if keys is None else keys[a:b],
                          ctx, rest)
            return
        scratch = ctx.get(("rows", id(self)))
        if scratch is None or scratch[0] < m:
            scratch = ctx[("rows", id(self))] = (m, [None if st.fills_rows else st.alloc(m, np.empty)
                                                     for st in self.stages])
        self.fill(scratch[1], 0, m, ids, keys, ctx, rest)
        for k in rest:
            stage, src, dst = self.stages[k], scratch[1][k], arrays[k]
            for key, value in src.items():
                out = dst[key]
                if isinstance(value, list):  # JSON: Python objects
                    for j, r in enumerate(rows.tolist()):
                        out[r] = value[j]
                elif key in stage.outputs:
                    if out.shape[1:] == value.shape[1:]:
                        out[rows] = value[:m]
                    else:  # Bytes, TokenIds: this file's values are narrower than the widest file's buffer
                        out[rows] = 0
                        out[rows, : value.shape[1]] = value[:m]

    def close(self) -> None:
        self.pages.close()


def split_cache_pages(cache_pages: int, n_files: int) -> list[int]:
    """``cache_pages`` (the loader's page budget for ``page_cache="process"``) shared evenly by ``n_files``
    files: ``cache_pages // n_files`` each, one more for the first ``cache_pages % n_files``; sums to
    ``cache_pages``. ValueError when a file would get no page (``cache_pages < n_files``)."""
    if cache_pages < n_files:
        raise ValueError(f"cache_pages={cache_pages} for a Mixture of {n_files} files: each file needs at least one "
                         f"cached page; pass cache_pages >= {n_files} (the whole loader's budget, shared by the "
                         f"files), or None for the default per file")
    share, extra = divmod(int(cache_pages), n_files)
    return [share + (1 if i < extra else 0) for i in range(n_files)]


class RowReader:
    """Fills a slot's rows from the loader's files, each row from the file its sample comes from.

    ``RowReader(sources, stages)``: the open FileSources and the stages :func:`check_same_fields` chose.
    ``fill(arrays, lo, hi, sources, ids, keys, ctx)`` fills rows ``[lo, hi)`` where ``sources`` int16[B] (or
    None: every row from file 0, one call of :meth:`FileSource.fill`) and ``ids`` int64[B] give each row's file and
    record id (the loader's slot). Results equal filling each row from its own file.

    Token files (one field, the same token dtype) are read window by window, in row order, into one staging
    buffer and converted once, as a single file's slice is: with ``page_cache="os"`` and no page verification
    each window is one ``pread`` on its own file (the same reads as one file); otherwise each file gathers its
    windows through its page source (cache, URL, CRC checks) and they are copied to their rows. Other fields go
    file by file through :meth:`FileSource.fill_rows`.
    """

    _STAGING = "mixture windows"  # ctx key of the thread's staging buffer for token windows

    def __init__(self, sources: list[FileSource], stages: list):
        self.sources = sources
        self._windows = None  # the token stage whose conversion serves every file, or None
        firsts = [s.stages[0] if len(s.stages) == 1 else None for s in sources]
        if (all(st is not None and st.strided for st in firsts) and len({st.dtype for st in firsts}) == 1
                and all(s.direct_windows for s in sources)):  # windows (a many-file set fills its own rows)
            self._windows = stages[0]
            self._row_bytes = (self._windows.seq_len + 1) * self._windows.itemsize
            self._base = np.array([st.data_offset for st in firsts], dtype=np.int64)
            self._stride = np.array([st.seq_len * st.itemsize for st in firsts], dtype=np.int64)
            self._direct = all(s.pages.direct and s.verifier is None for s in sources)
            if self._direct:  # the descriptors stay valid until the loader closes the files
                self._fds = np.array([s.ds.fileno() for s in sources], dtype=np.int64)
                self._checks = [s.ds.check_unchanged for s in sources]

    def fill(self, arrays: list, lo: int, hi: int, sources: np.ndarray, ids: np.ndarray, keys: np.ndarray,
             ctx: dict) -> None:
        """Fill rows ``[lo, hi)`` of a slot's ``arrays``; raises what the files' stages and page sources raise."""
        if sources is None:  # one file (or a subset of it): the whole slice in one call
            self.sources[0].fill(arrays, lo, hi, ids[lo:hi], None if keys is None else keys[lo:hi], ctx)
            return
        if self._windows is not None:
            if lo or hi != sources.shape[0]:
                sources, ids = sources[lo:hi], ids[lo:hi]
            (self._read_windows if self._direct else self._fill_windows)(arrays, lo, hi, sources, ids, ctx)
            if any(s.stages[0].mask_bits is not None for s in self.sources):  # chat files: per-file loss masks
                for i, rows in self._groups(sources):
                    for a, b in _runs(rows):
                        self.sources[i].stages[0].fill_mask(arrays[0], lo + a, lo + b, ids[a:b])
            return
        for i, rows in self._groups(sources[lo:hi]):
            rows = rows + lo
            self.sources[i].fill_rows(arrays, rows, ids[rows], None if keys is None else keys[rows], ctx)

    @staticmethod
    def _groups(src: np.ndarray):
        """``(source, rows)`` for each source present in ``src``: its rows (relative, ascending)."""
        order = np.argsort(src, kind="stable")
        ordered = src[order]
        cuts = [0, *(np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist(), src.shape[0]]
        for a, b in zip(cuts[:-1], cuts[1:]):
            yield int(ordered[a]), order[a:b]

    def _read_windows(self, arrays: list, lo: int, hi: int, src: np.ndarray, ids: np.ndarray, ctx: dict) -> None:
        """Rows ``[lo, hi)`` (windows ``ids`` of files ``src``) with one pread per window on its own file, in row
        order, read and widened in one nogil kernel call (as a single file's batch is); then the files read from
        are checked unchanged (``page_cache="os"``, no page verification)."""
        stage = self._windows
        scratch = ctx.get(self)
        if scratch is None:  # the thread's window row and flags of the files read
            scratch = ctx[self] = (np.empty(stage.seq_len + 1, dtype=stage.dtype),
                                   np.zeros(len(self.sources), dtype=np.uint8))
        row, touched = scratch
        inp, tgt = arrays[0]["input"], arrays[0]["target"]
        if lo or hi != inp.shape[0]:
            inp, tgt = inp[lo:hi], tgt[lo:hi]
        def finish(j):  # a short read: read_into finishes it or raises TruncatedFileError
            i = int(src[j])
            self.sources[i].ds.read_into(int(self._base[i] + ids[j] * self._stride[i]), row)
            token_ops.split_windows(row[None], inp[j : j + 1], tgt[j : j + 1])

        try:
            resume_reads(lambda d: token_ops.pread_mixed_windows(self._fds, self._base, self._stride, src[d:], ids[d:],
                                                                 row, inp[d:], tgt[d:], touched), finish, hi - lo)
            for i in touched.nonzero()[0].tolist():
                self._checks[i]()
            st = ctx.get(STATS_KEY)
            if st is not None:
                st.read_bytes += (hi - lo) * self._row_bytes
        finally:
            touched.fill(0)
        if stage.docs:
            stage.fill_documents(arrays[0], lo, hi)

    def _fill_windows(self, arrays: list, lo: int, hi: int, src: np.ndarray, ids: np.ndarray, ctx: dict) -> None:
        """Rows ``[lo, hi)``: each file gathers its windows through its page source (cache, URL, CRC checks) into
        the thread's staging buffer, converted in one call."""
        m, w = hi - lo, self._row_bytes
        buf = ctx.get(self._STAGING)
        if buf is None or buf.shape[0] < m * w:
            buf = ctx[self._STAGING] = np.empty(max(m * w, 1 << 16), dtype=np.uint8)
        stage = self._windows
        rows2d = buf[: m * w].reshape(m, w)
        for i, rows in self._groups(src):
            source = self.sources[i]
            starts, lens = source.spans(ids[rows])
            if source.verifier is not None:
                source.verifier.check(starts, lens, ids[rows])
            got, _ = source.pages.gather(starts, lens, ctx)
            rows2d[rows] = got[: rows.shape[0] * w].reshape(rows.shape[0], w)
        stage.fill_windows(arrays[0], lo, hi, buf[: m * w].view(stage.dtype).reshape(m, stage.seq_len + 1))


def _runs(rows: np.ndarray):
    """``(a, b)`` for each run of consecutive values in ascending ``rows``: rows ``[a, b)``."""
    cuts = [0, *(np.flatnonzero(np.diff(rows) != 1) + 1).tolist(), rows.shape[0]]
    for x, y in zip(cuts[:-1], cuts[1:]):
        yield int(rows[x]), int(rows[y - 1]) + 1


def check_same_fields(sources: list[FileSource]) -> list:
    """The stages to allocate and hand out batches with, one per loaded field, for sources that must agree.

    Every source must load the same fields (names and order), of the same kinds, with the same output shapes
    and dtypes; a Bytes field may differ in its longest value (the widest source's buffer is used); token
    files with document outputs must share the EOS id. ValueError naming the file and the field otherwise.
    """
    ref = sources[0]
    ref_fields = [s.name for s in ref.stages]
    chosen = list(ref.stages)
    for name in sorted(set().union(*(src.without for src in sources))):
        kinds = {type(src.ds.fields[name]).__name__ for src in sources if name in src.ds.fields}
        if kinds != {"RGBImages"}:
            raise PipelineError(f"{sources[0].path}: pipelines name field {name!r}, which "
                                + ("no file of the mixture has" if not kinds else f"is {sorted(kinds)} in others")
                                + "; only an RGBImages field may be missing from some files (their records then "
                                "hold no image)")
    for src in sources[1:]:
        fields = [s.name for s in src.stages]
        if fields != ref_fields and sorted(fields) == sorted(ref_fields):  # an absent image list comes last
            by_name = {s.name: s for s in src.stages}
            src.stages = [by_name[n] for n in ref_fields]
            fields = ref_fields
        if fields != ref_fields:
            raise ValueError(f"{src.path}: loads fields {fields}, but {ref.path} loads {ref_fields}; the files "
                             f"of a mixture must load the same fields (map extra ones to None in pipelines)")
        for j, (a, b) in enumerate(zip(ref.stages, src.stages)):
            fa, fb = ref.ds.fields.get(a.name, RGBImages()), src.ds.fields.get(b.name, RGBImages())
            if type(fa) is not type(fb):
                raise ValueError(f"{src.path}: field {b.name!r} is {fb!r}, but {ref.path} has {fa!r}; the files "
                                 f"of a mixture must have matching fields")
            for key, (shape, dtype, _) in a.outputs.items():
                other = b.outputs.get(key)
                same = other is not None and np.dtype(other[1]) == np.dtype(dtype) and (
                    a.variable_width or tuple(other[0]) == tuple(shape))
                if not same:
                    got = None if other is None else (tuple(other[0]), str(np.dtype(other[1])))
                    raise ValueError(f"{src.path}: field {b.name!r} loads {key!r} as {got}, but {ref.path} "
                                     f"loads it as {(tuple(shape), str(np.dtype(dtype)))}; the files of a mixture "
                                     f"must have matching fields")
            if isinstance(a, TokenStage) and a.docs and a.eos_id != b.eos_id:
                raise ValueError(f"{src.path}: field {b.name!r} has eos_id {b.eos_id}, but {ref.path} has "
                                 f"{a.eos_id}; document outputs need one EOS id across the mixture")
            if b.variable_width and b.max_len > chosen[j].max_len:
                chosen[j] = b
    return chosen
