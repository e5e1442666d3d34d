"""The read side's declared parts: what the Loader asks of a stage, a page source, a source and a pool.

Each part is a small base class whose defaults say what a part that lacks a capability does, so that the Loader
and the rest of ``load/`` ask a part what it declares and never which kind it is (no ``hasattr`` probes):

- :class:`Stage`: one loaded field; its batch buffers and how a thread fills rows of them (load/stages.py,
  load/packed.py). Token stages declare ``seq_len`` (> 0), ``windows`` (records are token windows or packed
  rows), ``packing``; every stage declares ``min_slice_rows``, ``inline``, ``pages`` (its page source, or None
  when it reads no page: a scalar field's values are index columns) and ``reserve()``.
- :class:`PageSource`: how a stage's bytes are read (load/pages.py: pread, the process page cache;
  load/remote_pages.py: a URL; load/set_records.py and load/set_source.py: a many-file set). Local sources keep
  the no-op defaults of the prefetch calls ``plan``/``advance`` and of ``stats``/``counters``.
- :class:`Source`: the rows of one input (a file: load/source.py ``FileSource``; a many-file set:
  load/set_source.py ``ManyFileSource``): its stages, layout, ``fill``/``fill_rows``/``spans``/``close``.
- :class:`Pool`: what runs the slices of a batch (load/workers.py ``ThreadPool``; load/process_pool.py
  ``ProcessPool``, the threads of a child process).

Two of them are open to kinds defined outside pageset, with no edit to it (tests/test_extension_kinds.py):

- a stage kind: a pipeline whose first op is a :class:`StageOp` is built by that op's ``build_stage``;
- a storage kind: ``Loader(page_cache=SomePageSource)``, a :class:`PageSource` subclass, reads every local
  file through ``SomePageSource(ds)``.
"""

from __future__ import annotations

import abc

import numpy as np
import torch


class Stage:
    """Base: ``outputs`` maps output key -> (per-sample shape, numpy storage dtype, torch dtype or None)."""

    name: str
    to_tensor: bool
    to_device = None
    outputs: dict
    needs_keys = False  # whether fill() uses the per-sample augmentation keys (else it gets None)
    fills_rows = False  # whether fill_rows(arrays, rows, ...) writes scattered rows itself (no scratch copy)
    # whether a batch of one slice costs less than a thread hand-off (then the thread calling next() fills it)
    inline = False
    op = None  # the op that fixes the output shape (a crop, TokenWindows), named in buffer errors
    pages = None  # the PageSource the stage reads from; None: it reads no page (its values are index columns)
    path = None  # the file named in the stage's errors; None: its errors name none
    seq_len = 0  # token windows' seq_len (tokens a row); 0: the records are the file's records
    packing = ""  # token rows: "" (stride windows) or the packing ("best_fit")
    windows = False  # whether the records are token windows/rows: then n_records, records_per_page, token_count
    strided = False  # whether the rows are stride windows another reader may fill (RowReader, SetWindows)
    min_slice_rows = 1  # fewest rows a slice handed to a thread should hold
    # whether the output width is the file's longest value (Bytes; TokenIds without PadTokens): then the files of
    # a mixture or a set may differ in it, ``max_len`` says this file's, and the widest file's buffers are used
    variable_width = False
    max_len = 0
    # a stage that packs the file's records into rows (PadTokens(packing=...)): its ops.packing.RecordRows, which
    # the file's other stages then read (read_rows); None: records are not packed
    record_rows = None
    reads_rows = False  # whether read_rows() can load the packed rows of another stage (else: PipelineError)
    # dynamic resolution: whether image_tokens(records, ctx) gives each image's token count (an RGBImages field
    # loaded with SmartResize: load/patches.py), and the field a stage takes those counts from (None: none)
    sizes_images = False
    image_tokens_from = None
    images_absent = False  # a TokenIds stage whose ExpandImageTokens(images=...) field the file lacks (a Mixture)

    def image_tokens(self, records: np.ndarray, ctx: dict) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens int64[m], starts int64[n])``: the token count of every image of ``records`` (record after
        record) and where each record's images start in it; only a stage declaring ``sizes_images`` is asked."""
        raise TypeError(f"{type(self).__name__} does not declare sizes_images")

    def link_image_tokens(self, stage: "Stage") -> None:
        """Take each image's token count from ``stage`` (the field ``image_tokens_from`` names)."""
        raise TypeError(f"{type(self).__name__} does not declare image_tokens_from")

    def read_rows(self, rows) -> None:
        """Load packed rows of records instead of records (``rows``: ops.packing.RecordRows), when another field
        of the file packs them (``PadTokens(packing="best_fit")``); only a stage declaring ``reads_rows`` is
        asked (an RGBImages field: load/stages.py ``ImagesStage``)."""
        raise TypeError(f"{type(self).__name__} does not declare reads_rows")

    def reserve(self, ctx: dict, rows: int) -> None:
        """Size a thread's scratch (``ctx``) for slices of up to ``rows`` rows (at Loader construction); no-op."""

    def buffer_shapes(self, batch_size: int) -> dict:
        """``{key: (shape, numpy dtype)}`` of the buffers :meth:`alloc` makes for one slot."""
        return {k: ((batch_size, *shape), np.dtype(dt)) for k, (shape, dt, _) in self.outputs.items()}

    def alloc(self, batch_size: int, empty) -> dict:
        """Buffers for one slot; ``empty(shape, np_dtype)`` allocates (pinned when copying to a GPU)."""
        return {k: empty((batch_size, *shape), dt) for k, (shape, dt, _) in self.outputs.items()}

    def handout(self, arrays: dict, view) -> dict:
        """``{batch key: value}`` for the user: ``view(arr)`` makes the handed-out view; torch if asked.

        One output is handed out under the field's name; several (Bytes: data and lengths) as a tuple there.
        """
        vals = {k: view(a) for k, a in arrays.items()}
        if self.to_tensor:
            vals = {k: _to_torch(v, self.outputs[k][2]) for k, v in vals.items()}
        return {self.name: vals[self.name] if len(vals) == 1 else tuple(vals[k] for k in self.outputs)}


class StageOp(abc.ABC):
    """Base of a pipeline op that brings its own stage kind.

    When the first op of a field's pipeline is a StageOp, the Loader loads that field with the stage
    ``op.build_stage(name, field, ops, ds, pages, array_type)`` returns instead of the field type's own stage:
    ``name`` (str) the field, ``field`` its ``pageset`` field type, ``ops`` the whole pipeline (list), ``ds`` the
    open Dataset, ``pages`` the file's :class:`PageSource` (``gather`` reads byte spans), ``array_type``
    ("torch" or "numpy"). The stage declares what it needs through the :class:`Stage` attributes; its errors
    should name ``ds.path``, the sample and the field. In process mode (``num_workers=1``) the op must be
    importable by the child (a module-level class)."""

    @abc.abstractmethod
    def build_stage(self, name: str, field, ops: list, ds, pages, array_type: str) -> Stage:
        """The stage that loads field ``name``; PipelineError (load/stages.py) for a pipeline it cannot run."""


class PageSource:
    """Base of the page sources: ``gather(offs, lens, staging, ordered=True) -> (buf, offsets)`` is each one's own.

    A subclass constructed as ``cls(ds)`` (``ds`` an open local Dataset) may be given to the Loader as
    ``page_cache``: a storage kind of its own. ``gather`` returns ``buf`` (uint8, the records' bytes back to
    back, from ``staging``'s buffer or its own) and ``offsets`` (int64[n], where record i starts in ``buf``); with
    ``ordered=False`` the spans may be in any order and overlap.

    Defaults (a local file): ``reserve`` sizes nothing, ``read_windows`` reads nothing (returns False: the caller
    gathers), the prefetch calls ``plan``/``advance`` do nothing, ``stats()`` is None (a URL's fetch counters
    otherwise), ``counters()`` is None (the process page cache's ``{"hits", "misses", "bytes_read"}``
    otherwise), ``direct`` is False (True: windows may be read with ``pread`` on ``ds.fileno()`` by another
    reader, as PreadPages does), ``prefetches`` is False (True: the Loader hands it each epoch's plan through
    ``plan``/``advance``, as a URL's pages take it), ``close()`` releases nothing."""

    direct = False
    prefetches = False

    @staticmethod
    def reserve(staging: dict, nbytes: int) -> None:
        """Size the staging buffer of a thread for ``nbytes`` bytes; no-op."""

    def read_windows(self, base: int, stride: int, ids: np.ndarray, dtype, out_input: np.ndarray,
                     out_target: np.ndarray, staging: dict) -> bool:
        """Read and widen windows ``ids`` into ``out_input``/``out_target``; False when not done here."""
        return False

    def plan(self, pages_of_step, first: int, steps: int, min_ahead: int = 1) -> None:
        """Prefetch the pages ``pages_of_step(step)`` of steps ``[first, steps)``; no-op."""

    def advance(self, step: int) -> None:
        """Batches before ``step`` are handed out (their pages may go); no-op."""

    def stats(self) -> dict | None:
        """A URL's fetch counters (Loader.remote_stats); None for a local source."""
        return None

    def counters(self) -> dict | None:
        """``{"hits", "misses", "bytes_read"}`` of a page cache; None without one."""
        return None

    def close(self) -> None:
        """Release what the source holds; no-op."""


def page_counters(sources) -> dict:
    """The page-cache counters of ``sources`` (their ``pages``): ``{"cached", "hits", "misses", "bytes_read"}``,
    ``cached`` True when any source has a page cache, the rest summed over those (0 without)."""
    counted = [c for c in (src.pages.counters() for src in sources) if c is not None]
    out = {k: sum(c[k] for c in counted) for k in ("hits", "misses", "bytes_read")}
    return {"cached": bool(counted), **out}


class Source:
    """Base of the rows of one input: ``ds``, ``path``, ``dataset_id``, ``pages`` (a PageSource), ``stages``,
    ``n_records``, ``page_sizes`` (int64[K] records per page), ``tokens`` (predictions of all token windows, or
    None for records), ``verifier`` (or None), ``row_bytes``; ``fill``, ``fill_rows``, ``spans``, ``close``.
    ``direct_windows``: whether another reader (load/source.py RowReader) may read this input's token windows
    itself from its ``ds`` and stage (a file: True; a many-file set fills its own rows)."""

    tokens = None
    verifier = None
    direct_windows = False
    without: frozenset = frozenset()  # fields it lacks and loads as empty image lists (a Mixture member)

    def close(self) -> None:
        """Release the page access (not ``ds``)."""


class Pool:
    """Base of what runs a batch's slices: ``threads`` and ``contexts`` (one scratch dict per thread),
    ``start(n)``, ``submit(slot, lo, hi)``, ``help(ctx)`` (run a queued slice on the caller's thread; False when
    none was run), ``cancel()``, ``alive()`` (threads alive), ``close()``. Defaults: ``refresh()`` fetches no
    counters (a child process's, otherwise), ``page_counters()`` is None (the Loader counts its own sources'
    pages; a child process reports its own)."""

    threads: list
    contexts: list

    def refresh(self, timeout: float = 10.0) -> None:
        """Fetch the threads' counters from where they run; no-op for threads of this process."""

    def page_counters(self) -> tuple[bool, dict] | None:
        """(whether pages are cached, ``{"hits", "misses", "bytes_read"}``) counted elsewhere; None here."""
        return None


def _to_torch(arr: np.ndarray, torch_dtype):
    t = torch.from_numpy(arr)
    return t.view(torch_dtype) if torch_dtype is not None and t.dtype != torch_dtype else t
