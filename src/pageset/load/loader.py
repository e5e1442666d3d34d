"""``Loader``: a pageset file -> batches, in order v1, from a persistent pool of threads running Numba kernels.

    loader = Loader("train.pageset", batch_size=256, order="quasi_random", seed=0,
                    pipelines={"image": [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(),
                                         ToTorchImage(), ToDevice("cuda")],
                               "label": [IntDecoder(), ToDevice("cuda")]})
    for epoch in range(90):
        for batch in loader:              # one epoch (or the rest of it after load_state_dict)
            batch["image"], batch["label"], batch["_index"], batch["_is_padding"]

Order, rank slices and resume are order v1 (``pageset.order``): the batches of a step are a pure function of
(seed, epoch, step, rank, world_size), and ``state_dict()`` counts batches handed out by ``next()``.
"""

from __future__ import annotations

import functools
import os
import pickle
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ..format import arguments as check
from ..order import DEFAULT_WINDOW_RECORDS, ORDERS, enable_kernel_cache, resolve_rank, sample_keys, window_pages_of
from ..order.keys import MASK64
from ..order.plan import Member, OrderParams, PlanSpec
from ..order.subset import OneFile
from ..read.remote import url_scheme
from .manyfile import ManyFileInput, ManyFileSource, open_input
from .parts import PageSource, page_counters
from .source import FileSource, RowReader, check_same_fields, split_cache_pages
from .stages import PipelineError
from .stats import STATS_KEY, LoaderStats, ThreadStats, bottleneck
from .compile_notice import announce_compiles
from .process_pool import ProcessPool
from .shared_slots import SharedBuffers
from .workers import Slot, ThreadPool, close_context

INDEX_KEY = "_index"  # int64[B]: record ids of the batch (field names never start with "_")
PADDING_KEY = "_is_padding"  # bool[B]: True for wrap-around samples of drop_last=False
ARRAY_TYPES = ("torch", "numpy")  # what a batch's arrays are: torch tensors (default) or numpy arrays
SOURCE_KEY = "_source"  # int16[B]: which file of a Mixture each sample comes from (mixtures only)


@dataclass(frozen=True)
class Distributed:
    """Which slice of the data this process loads: ``rank`` in ``[0, world_size)``."""

    rank: int
    world_size: int


def _torch_distributed():
    """(rank, world_size) from an initialised torch.distributed, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


class Loader:
    """Batches from a pageset file.

    Args:
        path: the pageset file, or a :class:`~pageset.Mixture` of files read as one stream in fixed
            proportions (see ``formats/mixture.md``): each batch then also carries ``"_source"`` (int16[B],
            the file of each sample) and ``"_index"`` holds record ids within that file; or a
            ``pageset.order.manyfile.FileSet`` of member files read as one dataset (ids run through the members in
            order, ``"_index"`` holds those ids; ``formats/order.md`` section 6). Any ``pageset.order.plan.PlanSpec``.
        batch_size: samples per batch on this rank (B); the global batch is ``G = B * world_size``.
        pipelines: ``{field: [ops]}``; a field mapped to ``None`` is not loaded; fields left out get their
            default decoder (images have none: give them a crop). See ``pageset.ops.transforms``.
        order: ``"random"`` (full shuffle), ``"quasi_random"`` (shuffle pages, then ids inside windows of
            about ``window_records`` records: bounded memory, page-local reads) or ``"sequential"``.
        seed: u64; with the epoch it fixes the order and every augmentation.
        drop_last: ``True`` (default): drop the last incomplete global batch (up to ``G - 1`` samples of each
            epoch are not seen that epoch; which ones changes with the epoch's order). ``False``: complete it by
            wrapping to the start of the epoch's order, flagging those samples in ``batch["_is_padding"]``.
        num_threads: decode threads (default: ``os.cpu_count()``). The thread calling ``next()`` also runs
            queued work while the batch it asks for is not ready, instead of sleeping (local files only). A
            local token file's batch of under ~256K tokens (``batch_size * seq_len``) is filled by the thread
            calling ``next()``, in one kernel call (~0.05-0.2 ms), and no thread is started: a hand-off to a
            thread would cost as much as the batch. If those fills take over ~2 ms (median of 16: reads waiting
            on a disk or a network file system), the threads start and prepare batches ahead from then on.
        batches_ahead: batches prepared ahead of the consumer (default 2 per thread, at least 2; none when
            batches are filled by the thread calling ``next()``). The ``batches_ahead + 2`` batch buffers are
            allocated at construction either way (MemoryError naming the field, op, shape and bytes when they
            exceed the machine's memory).
        rank, world_size: explicit values win; else an initialised torch.distributed; else torchrun's RANK /
            WORLD_SIZE environment; else a single process.
        page_cache: ``"os"`` (records read with ``pread``; the OS page cache keeps what is hot) or
            ``"process"`` (a bounded LRU of whole pages read with ``pread``, at most ``cache_pages`` pages
            resident: ``cache_pages * page_size`` bytes whatever the file size; default, for each file (of a
            Mixture too): the pages of the quasi-random windows the batches in flight read, ``M *
            ceil((batches_ahead + 1) * global_batch / records_per_window) + 2`` (M: pages per window, below),
            never more than the file's pages;
            a given ``cache_pages`` bounds the whole loader: a Mixture's files share it evenly, at least one page
            each, ValueError if it is smaller than the number of files). Neither maps the file: a file truncated or modified in
            place under the loader raises TruncatedFileError / FileChangedError at the next batch, never SIGBUS.
            Or a ``pageset.load.parts.PageSource`` subclass: every local file is read through ``cls(ds)``, a
            storage kind of the caller's (``cache_pages`` does not apply; ValueError for a URL).
        window_pages, window_records: the size of a ``quasi_random`` window (``formats/order.md`` section 4.1).
            ``window_pages=None`` (default) sizes it in records: each page layout (a file, a subset, each file
            of a Mixture, a many-file set) gets the fewest pages M whose windows hold at least
            ``window_records`` records on average (default 16,384; ``M = min(K, ceil(window_records * K / N))``
            for N records on K pages), whatever the record size. A batch is a uniform draw without
            replacement from its window (two windows at a boundary), so on data sorted by class (an
            ImageFolder) it mixes about ``window_records / records_per_class`` classes. Memory: the windows
            in flight, about ``window_records`` records' bytes each (``page_cache="process"``; a URL's
            in-memory pages; the OS page cache's working set otherwise): lower ``window_records`` for large
            records. ``window_pages=M`` (an int >= 1) gives M pages per window instead, as before
            (``window_pages=8`` reproduces orders and states saved by pageset versions whose default it was);
            giving both is a ValueError.
        storage_options: for a URL ``path`` (``s3://``, ``http(s)://``, any fsspec protocol): options of the fsspec
            filesystem (endpoint, credentials); see ``pageset.read.remote``. In a Mixture they go to its URL
            members only (ValueError when no member is a URL). A URL is read in whole pages by range
            requests, each page's CRC-32 checked on arrival (``page_cache`` and ``verify_pages`` do not apply).
        cache_dir, cache_limit_bytes: URL only: an on-disk page cache shared by the processes of one host,
            pages in ``<cache_dir>/<dataset id>/``. ``cache_limit_bytes`` (bytes, default 10 GiB; ValueError when
            smaller than the file's page size) bounds the whole ``cache_dir``, every dataset in it together (a
            Mixture's files, a many-file set's members, other runs' datasets), LRU by page; it is enforced when the
            Loader opens (a folder filled under a larger limit is cut to 90 % of this one at once) and after
            writes. Each process applies its own: give every rank sharing a folder the same. Temporary files of
            writers that died mid-write are deleted when a cache opens and count towards the bound.
            ValueError for ``cache_dir=""`` and for ``cache_limit_bytes`` without ``cache_dir``.
        prefetch_bytes, max_requests: URL only: bytes of the next steps' pages requested ahead (default 64
            MiB) and range requests running at once (default 8). Arrived pages stay in memory up to
            ``2 * prefetch_bytes`` or, when more, the default ``cache_pages`` above (the windows in flight) plus
            ``2 * prefetch_bytes``: each page of a quasi-random window is then fetched once per epoch.
        request_timeout, request_attempts: URL only: seconds per request and attempts per request (retries
            with exponential backoff and jitter, of what can succeed on a retry: timeouts, resets, refused
            connections, 5xx, 429); then RemoteReadError names the URL, byte range and attempts. A stopped store
            ends the waiting ``next()`` within ``request_attempts x request_timeout`` + backoff s (151.5 s by
            default); a refusal (4xx) is raised at once. Used in a forked child (a URL, or decode threads
            started): RuntimeError at once.
        verify_pages: check each page's CRC-32 the first time a batch needs it (off by default: one extra pass
            over the data); a damaged page raises ChecksumMismatchError naming the page and the sample. With
            ``page_cache="process"`` each page is checked anyway when it first enters the cache (once per
            Loader, on the bytes just read; ChecksumMismatchError names the page and its offset).
        indices: load only these record ids (token files: window ids), e.g. a train/validation split: a sequence
            or 1-D integer array of n ids in ``[0, len(file))``, any order, repeats allowed. The loader then
            behaves like a file of n records (order, epoch length, rank slices, resume); ``"sequential"``
            follows the given order, ``"quasi_random"`` groups the ids by page (reads stay page-local).
            ``batch["_index"]`` holds the file's record ids. The state records a digest of the ids and
            refuses another subset. ValueError/TypeError naming the first bad position (out of range,
            not an integer).
        array_type: ``"torch"`` (default): every array of a batch is a torch tensor (``ToTensor`` is implied;
            CPU tensors over the batch buffers, no copy), as a ``torch.utils.data.DataLoader`` hands out;
            ``"numpy"``: every array is a numpy array (``ToTensor``, ``ToTorchImage``, ``ToDevice`` and
            bfloat16 are then refused). One batch never mixes the two.
        num_workers: ``0`` (default): the decode threads run in this process. ``1``: the ``num_threads`` decode
            threads run in one child process (``pageset.load.process_pool``), started at construction in the
            background, which fills the batch buffers in place in anonymous shared memory (one ``memfd`` per batch
            slot, ``pageset.load.shared_slots``: nothing in ``/dev/shm``, nothing left after a crash); this
            process plans the batches, keeps the state and hands them out, so batches, state, resume, ``len`` and
            padding equal ``num_workers=0``'s and the trainer's process does no decoding (no inline filling, no helping in ``next()``). Errors are
            raised by ``next()`` as with threads, the child's traceback as their ``__cause__``; a child that dies
            raises RuntimeError naming its exit code or signal. Pipelines are pickled for the child (TypeError
            naming the op that cannot be); local files only (ValueError for a URL). ValueError for more than 1.

    Each batch is a dict: one entry per loaded field (a Bytes field gives ``(data, lengths)``; a JSON field a
    list of Python values), plus ``"_index"`` (int64[B] record ids) and ``"_is_padding"`` (bool[B]); a Mixture
    adds ``"_source"`` (int16[B]). All are of ``array_type``; with ``ToDevice`` the field's tensors are on that
    device, ``_index``, ``_is_padding`` and ``_source`` stay on the CPU. Buffers are reused only once nothing the user holds points at them: keeping batches
    (``list(loader)``) is safe, and costs a fresh allocation for each kept batch instead of a copy for every
    batch.

    ``len(loader)`` is the number of batches per epoch on this rank (:attr:`steps_per_epoch`); the batches left
    in the current epoch are :attr:`steps_remaining`.

    Raises TypeError / ValueError for bad arguments (naming the argument and what it accepts), PipelineError
    for bad pipelines, FormatError for a damaged file; an exception raised while preparing a batch is re-raised
    by ``next()`` with the thread's traceback.
    """

    # Inline filling (see _inline_batches) gives way to the threads when the median of this many fills exceeds
    # this many seconds: several times a batch of the largest inline size read from the page cache (256K tokens,
    # ~0.3-0.5 ms on a busy 2-core VM), less than its reads waiting on a disk or a network file system.
    _INLINE_CHECK, _INLINE_SLOW_S = 16, 2e-3

    def __init__(self, path, *, batch_size: int, pipelines: dict | None = None, order: str = "random",
                 seed: int = 0, drop_last: bool = True, num_threads: int | None = None,
                 batches_ahead: int | None = None, rank: int | None = None, world_size: int | None = None,
                 page_cache: str = "os", window_pages: int | None = None,
                 window_records: int | None = None, cache_pages: int | None = None,
                 verify_pages: bool = False, indices=None, storage_options: dict | None = None, cache_dir=None,
                 cache_limit_bytes: int | None = None, prefetch_bytes: int | None = None, max_requests: int = 8,
                 request_timeout: float = 30.0, request_attempts: int = 5, array_type: str = "torch",
                 num_workers: int = 0):
        if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike, PlanSpec)):
            raise TypeError(f"path must be the pageset file's path or URL (str or os.PathLike) or a Mixture, got "
                            f"{path!r}")
        batch_size = check.integer("batch_size", batch_size, minimum=1)
        pipelines = check.mapping("pipelines", pipelines, optional=True,
                                  example="{'image': [RandomResizedCrop(224)], 'label': [IntDecoder()]}")
        order = check.choice("order", order, ORDERS)
        seed = check.integer("seed", seed, minimum=0, maximum=MASK64)
        drop_last = check.boolean("drop_last", drop_last)
        num_threads = check.integer("num_threads", num_threads, minimum=1, optional=True)
        batches_ahead = check.integer("batches_ahead", batches_ahead, minimum=1, optional=True)
        rank = check.integer("rank", rank, minimum=0, optional=True)
        world_size = check.integer("world_size", world_size, minimum=1, optional=True)
        if not (isinstance(page_cache, type) and issubclass(page_cache, PageSource)):  # else a storage kind
            page_cache = check.choice("page_cache", page_cache, ("os", "process"))
        window_pages = check.integer("window_pages", window_pages, minimum=1, optional=True)
        window_records = check.integer("window_records", window_records, minimum=1, optional=True)
        if window_pages is not None and window_records is not None:
            raise ValueError(f"window_pages={window_pages} and window_records={window_records} both size the "
                             "quasi-random window: give one (window_pages: M pages a window; window_records: M sized "
                             "so a window holds that many records)")
        window_records = DEFAULT_WINDOW_RECORDS if window_records is None else window_records
        cache_pages = check.integer("cache_pages", cache_pages, minimum=1, optional=True)
        verify_pages = check.boolean("verify_pages", verify_pages)
        storage_options = check.mapping("storage_options", storage_options, optional=True)
        if cache_dir is not None and (isinstance(cache_dir, bytes) or not isinstance(cache_dir, (str, os.PathLike))):
            raise TypeError(f"cache_dir must be a folder path (str or os.PathLike) or None, got {cache_dir!r}")
        if cache_dir is not None and not os.fspath(cache_dir):
            raise ValueError("cache_dir='' names no folder (it would cache into the current folder): pass a folder "
                             "path, or None for no on-disk cache")
        if cache_dir is not None and os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
            raise NotADirectoryError(f"cache_dir {os.fspath(cache_dir)!r} is a file, not a folder; pass cache_dir= a "
                                     "folder path (created if missing) for the on-disk page cache")
        cache_limit_bytes = check.integer("cache_limit_bytes", cache_limit_bytes, minimum=1, optional=True)
        if cache_limit_bytes is not None and cache_dir is None:
            raise ValueError(f"cache_limit_bytes={cache_limit_bytes:,} bounds the on-disk page cache of cache_dir=, "
                             "and no cache_dir is given: pass cache_dir=<folder> too, or leave cache_limit_bytes out")
        prefetch_bytes = check.integer("prefetch_bytes", prefetch_bytes, minimum=0, optional=True)
        max_requests = check.integer("max_requests", max_requests, minimum=1)
        request_timeout = check.real("request_timeout", request_timeout, low=0, low_open=True)
        request_attempts = check.integer("request_attempts", request_attempts, minimum=1)
        self.array_type = check.choice("array_type", array_type, ARRAY_TYPES)
        num_workers = check.integer("num_workers", num_workers, minimum=0)
        if num_workers > 1:
            raise ValueError(f"num_workers must be 0 (decode threads in this process) or 1 (num_threads decode "
                             f"threads in one child process), got {num_workers}: one child process running "
                             "num_threads threads is the supported layout; raise num_threads instead")
        self.num_workers = num_workers
        num_threads = (os.cpu_count() or 1) if num_threads is None else num_threads
        batches_ahead = max(2, 2 * num_threads) if batches_ahead is None else batches_ahead
        self._closed = True  # until construction succeeds
        enable_kernel_cache()
        announce_compiles()  # one line on stderr if this process compiles the kernels (a disk-cache miss)
        r, w = resolve_rank(rank, world_size, probe=_torch_distributed)
        self.dist = Distributed(r, w)
        self.batch_size, self.global_batch_size = batch_size, batch_size * w
        self.order, self.seed, self.drop_last = order, int(seed), bool(drop_last)
        self.window_pages, self.window_records = window_pages, int(window_records)
        self.num_threads, self.batches_ahead = num_threads, batches_ahead
        # what is read, in what order: a file, a subset, a Mixture, a FileSet (order/plan.py); the Loader holds
        # one plan built from it (in _setup) and never asks which kind it is
        spec = (path if isinstance(path, PlanSpec) else OneFile(path)).with_indices(indices)
        if num_workers and any(url_scheme(p) is not None for p in spec.paths):
            raise ValueError("num_workers=1 reads local files only (a URL's pages are fetched and prefetched by "
                             "the process that plans the batches); use num_workers=0 for a URL")
        # process mode: the child process builds this Loader again from these arguments (pickled; checked below)
        child_args = dict(path=path, batch_size=batch_size, pipelines=pipelines, order=order, seed=seed,
                          drop_last=drop_last, num_threads=num_threads, batches_ahead=batches_ahead,
                          page_cache=page_cache, window_pages=window_pages,
                          window_records=window_records if window_pages is None else None, cache_pages=cache_pages,
                          verify_pages=verify_pages, indices=indices, array_type=array_type) if num_workers else None
        self._sources: list[FileSource] = []
        self._datasets = []
        self._remote_options = dict(prefetch_bytes=prefetch_bytes, max_requests=max_requests, cache_dir=cache_dir,
                                    cache_limit_bytes=cache_limit_bytes)
        try:
            # storage_options go to the URL members of a Mixture; with no URL at all, Dataset refuses them
            any_url = any(url_scheme(p) is not None for p in spec.paths)
            for p in spec.paths:
                opts = storage_options if url_scheme(p) is not None or not any_url else None
                # records or a token file, or a many-file set's manifest (load/manyfile.py)
                self._datasets.append(open_input(p, opts, request_timeout, request_attempts))
            self._ds = self._datasets[0]
            self._setup(spec, page_cache, cache_pages, pipelines, verify_pages)
            self._setup_buffers()
            self._pool = None
            if num_workers:  # started now: the child imports and opens the files while the trainer sets up
                self._pool = ProcessPool(self._child_init(child_args), self._shared, num_threads, str(self.path))
        except BaseException:
            if getattr(self, "_pool", None) is not None:
                self._pool.close()
            for src in self._sources:
                src.close()
            for ds in self._datasets:
                ds.close()
            raise
        self._epoch, self._cursor = 0, 0
        # positions where this run's epochs start in a plan's stream across epochs (a Mixture), less epoch * L:
        # 0 unless the global batch changed (load_state_dict from a state of another global batch)
        self._shift = 0
        self._base = 0  # the epoch position of step 0 of the epoch being iterated (cursor % G: 0 unless G changed)
        self._active = None  # the running epoch generator, if any
        # the threads' scratch, sized here for the stages that know it (token windows: a slice's bytes), so that
        # threads started mid-epoch (inline fills handing over) allocate nothing either
        rows = -(-self.batch_size // self._n_slices)
        contexts = [{"thread": i, STATS_KEY: ThreadStats()} for i in range(num_threads)]
        for ctx in contexts:
            for st in self._stages:
                st.reserve(ctx, rows)
        if self._pool is None:
            self._pool = ThreadPool(0 if self._inline else num_threads, self._run_slice, contexts=contexts)
        self._ctx: dict = {"thread": "consumer", STATS_KEY: ThreadStats()}  # scratch of the thread calling next()
        self._stats = LoaderStats()  # loader.stats(): always on (a few clock reads per batch)
        self._cache_base: dict | None = None  # page cache counters at the last stats(reset=True)
        self._pid = os.getpid()  # the process whose threads (and a URL's connections) this Loader uses
        self._closed = False  # only now: close() and __del__ have everything to release

    def _setup(self, spec: PlanSpec, page_cache, cache_pages, pipelines, verify_pages) -> None:
        """Page access, stages and record layout of every file (a Mixture has several), then the plan."""
        pipelines = dict(pipelines or {})
        n = len(self._datasets)
        if cache_pages is None:  # the default, per file (a function of the file's records and pages)
            per_file = [self._default_cache_pages] * n
            subset = getattr(spec, "indices", None)
            if subset is not None and hasattr(subset, "__len__"):  # a subset's windows: its ids on the file's pages
                # (ids that are no sequence are refused by the plan, naming them)
                per_file = [functools.partial(self._default_cache_pages, subset_records=len(subset))]
        elif page_cache == "process":  # the whole loader's budget: a Mixture's files share it
            per_file = split_cache_pages(cache_pages, n)
        else:  # not used
            per_file = [cache_pages] * n
        for ds, cache_pages in zip(self._datasets, per_file):
            # a many-file set is read as one file whose members are opened when first read (load/manyfile.py)
            make = ManyFileSource if isinstance(ds, ManyFileInput) else FileSource
            self._sources.append(make(ds, pipelines, page_cache, cache_pages, verify_pages,
                                      in_mixture=spec.optional_fields,
                                      remote_options=self._remote_options, array_type=self.array_type))
        src = self._sources[0]
        self._pages, self._verifier, self._page_sizes = src.pages, src.verifier, src.page_sizes
        self._stages = check_same_fields(self._sources)  # the files of a Mixture or FileSet must agree
        # each row of a batch is read from its own file (all from file 0 when the plan names no sources)
        self._reader = RowReader(self._sources, self._stages)
        params = OrderParams(self.seed, self.order, self.window_pages, self.global_batch_size, self.drop_last,
                             self._seq_len(), next((s.packing for s in self._stages if s.packing), ""),
                             self.window_records)
        self._plan = spec.plan([Member(s.path, s.dataset_id, s.page_sizes, s.tokens)
                                 for s in self._sources], params)
        plan = self._plan
        self.path, self.dataset_id, self.n_records, self.epoch_length = (
            plan.path, plan.dataset_id, plan.n_records, plan.epoch_length)
        # Slices per batch: one per thread, unless a slice would be too small to pay for a thread hand-off
        # (~20-50 us): then threads work on different batches instead (token windows: one slice per batch).
        min_rows = max((s.min_slice_rows for s in self._stages), default=1)
        self._n_slices = max(1, min(self.num_threads, self.batch_size // min_rows))
        self._needs_keys = any(s.needs_keys for s in self._stages)
        # The consumer runs queued slices while it waits, except for URLs: there a slice waits on the network
        # (the remote page source has its own prefetching), and num_threads bounds the concurrent fetches.
        # Process mode (num_workers=1): never; the slices run in the child.
        self._help = all(src.ds.remote is None for src in self._sources) and not self.num_workers
        # A batch of one slice whose stages are cheap kernels (token windows: one call reads and widens the batch,
        # ~0.05-0.2 ms) is filled by the thread calling next(), and no thread is started: waking a thread and
        # handing the GIL back costs as much as the work, so more threads could only make it slower.
        # Should such fills take long after all (reads waiting on a disk or a network file system), the loader
        # starts its threads and prepares batches ahead instead (see _inline_batches).
        self._inline = (self._n_slices == 1 and self._help
                        and all(s.inline for s in self._stages))
        self._fill_times: list[float] = []  # seconds of the inline fills since the last check

    def _default_cache_pages(self, n_records: int, page_count: int, subset_records: int | None = None) -> int:
        """Default ``cache_pages`` of a file: ``M * ceil(in_flight / records_per_window) + 2``.

        M is the quasi-random window's pages (formats/order.md section 4.1: ``window_pages``, or sized by
        ``window_records`` over the file's ``n_records`` on ``page_count`` pages; for a subset of
        ``subset_records`` ids, over those ids on the file's pages: at least the subset's own M). The other
        orders have no windows: M is ``window_pages`` or 8, as the default was before windows were sized in
        records.

        The batches being filled at once (``batches_ahead + 1`` global batches) read from the window(s) their
        positions fall in; the quasi-random order visits a window's pages in every batch, so the cache must
        hold the windows in flight to read each page once per epoch. Two more pages cover the window a batch
        straddles at a window boundary (the LRU evicts the finished window's pages as the next one comes in:
        measured, a 256 MB token file with 8 MiB pages then reads each page exactly once per epoch). The cache
        itself never takes more slots than the file has pages.
        """
        if self.order != "quasi_random":
            m = self.window_pages or 8
        else:
            n = n_records if subset_records is None else subset_records
            m = window_pages_of(n, max(page_count, 1), self.window_pages, self.window_records)
        per_window = max(1, (n_records if subset_records is None else subset_records) * m // max(page_count, 1))
        in_flight = (self.batches_ahead + 1) * self.global_batch_size
        return m * -(-in_flight // per_window) + 2

    def _setup_buffers(self) -> None:
        """The device queue and the ring of batch buffers: ``batches_ahead + 2`` slots, all allocated here.

        Inline filling uses two of them (the batch handed out and the one being filled); the others are there
        for the switch to threads (see _inline_batches), which then allocates nothing in the middle of an epoch.
        Raises MemoryError naming the field, its op, the buffer shape and the bytes when the slots need more than
        the machine's memory or cannot be allocated.
        """
        self._queue = self._device_queue()
        empty = self._queue.empty if self._queue is not None else (lambda shape, dt: np.empty(shape, dt))
        n_slots = self.batches_ahead + 2
        self._check_buffer_memory(n_slots)
        self._shared = self._pinned = None
        try:
            if self.num_workers:  # process mode: the child fills them, in anonymous shared memory (process_pool)
                self._shared = SharedBuffers(self._stages, self.batch_size)
                self._slots = [Slot(i, self._shared.arrays(i)) for i in range(n_slots)]
                if self._queue is not None and self._queue.prefetch:  # CUDA: copied into pinned buffers, then sent
                    self._pinned = [Slot(i, [s.alloc(self.batch_size, empty) for s in self._stages])
                                    for i in range(n_slots)]
            else:
                self._slots = [Slot(i, [s.alloc(self.batch_size, empty) for s in self._stages])
                               for i in range(n_slots)]
        except MemoryError:
            raise MemoryError(self._buffer_message(n_slots, "could not be allocated")) from None
        self._empty = empty
        # Batches take the slots in turn, across epochs: the slot filled next is the one used longest ago, never
        # the one of the batch a `for batch in loader` loop still holds when it asks for the next (step % slots
        # would restart at slot 0 each epoch: a new batch buffer, 38 MB for 64 float32 224 px images, whenever
        # the epoch's step count is 1 more than a multiple of the slots).
        self._turn = 0

    def _buffers(self, n_slots: int) -> list:
        """(stage, key, shape, dtype, bytes) of one slot's buffers, largest first."""
        out = []
        for st in self._stages:
            for key, (shape, dt) in st.buffer_shapes(self.batch_size).items():
                out.append((st, key, shape, dt, int(np.prod(shape, dtype=object)) * dt.itemsize))
        return sorted(out, key=lambda b: -b[4])

    def _buffer_message(self, n_slots: int, what: str) -> str:
        bufs = self._buffers(n_slots)
        total = n_slots * sum(b[4] for b in bufs)
        st, key, shape, dt, nbytes = bufs[0]
        op = f"{st.op!r}" if st.op is not None else "its decoder"
        return (f"{self.path}: the batch buffers {what}: {n_slots} slots (batches_ahead + 2) x "
                f"{sum(b[4] for b in bufs) / 2**30:.3g} GiB = {total / 2**30:.3g} GiB; the largest: field "
                f"{st.name!r} ({op}), {key!r} of shape {tuple(shape)} {dt.name}, {nbytes / 2**30:.3g} GiB per batch. "
                "Use a smaller output size, batch_size or batches_ahead")

    def _check_buffer_memory(self, n_slots: int) -> None:
        """MemoryError when the slots' buffers need more than the machine's physical memory (they would be
        allocated lazily and fail, or be killed, at the first batches)."""
        total = n_slots * sum(b[4] for b in self._buffers(n_slots))
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # no sysconf: the allocation decides
            return
        if total > ram:
            raise MemoryError(self._buffer_message(n_slots, f"need more than this machine's memory "
                                                            f"({ram / 2**30:.3g} GiB)"))

    def _child_init(self, args: dict) -> dict:
        """The arguments the child process builds this Loader from (process mode): the given ones, rank and
        world size as resolved here, pipelines without ToDevice (the parent copies to the device). TypeError
        naming the field and op that cannot be pickled (the child is another interpreter)."""
        pipes = args["pipelines"]
        if pipes is not None:
            pipes = {name: ops if not isinstance(ops, (list, tuple)) else
                     [op for op in ops if not getattr(op, "is_to_device", False)] for name, ops in pipes.items()}
        init = {**args, "pipelines": pipes, "rank": self.dist.rank, "world_size": self.dist.world_size}
        try:
            pickle.dumps(init, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            for name, ops in (pipes or {}).items():
                for op in ops if isinstance(ops, (list, tuple)) else [ops]:
                    try:
                        pickle.dumps(op, protocol=pickle.HIGHEST_PROTOCOL)
                    except Exception as op_exc:
                        raise TypeError(f"pipelines[{name!r}]: {op!r} cannot be pickled ({op_exc}); num_workers=1 "
                                        "sends the pipelines to a child process: use ops defined at module level "
                                        "of an importable module, or num_workers=0") from op_exc
            raise TypeError(f"num_workers=1: the Loader's arguments cannot be pickled for the child process ({exc}); "
                            "use num_workers=0") from exc
        return init

    # ---- configuration helpers -------------------------------------------------------------------------
    def _device_queue(self):
        targets = {s.to_device for s in self._stages if s.to_device is not None}
        devices = {str(op.device) for op in targets}
        if len(devices) > 1:
            raise PipelineError(f"all ToDevice ops must name one device, got {sorted(devices)}")
        if not targets:
            return None
        return next(iter(targets)).make_queue()

    # ---- state -----------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def steps_per_epoch(self) -> int:
        return self.epoch_length // self.global_batch_size

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same number on every rank), like ``torch.utils.data.DataLoader``:
        ``N // G`` with ``drop_last``, ``ceil(N / G)`` without. The rest of a started epoch is
        :attr:`steps_remaining`."""
        return self.steps_per_epoch

    @property
    def steps_remaining(self) -> int:
        """Batches the next ``iter()`` yields on this rank: the rest of the current epoch (after a partial epoch
        or ``load_state_dict``, also from a state of another global batch), or a whole epoch once the current one
        has been handed out completely."""
        left = (self._plan.epoch_end(self._cursor) - self._cursor) // self.global_batch_size
        return left if left > 0 else self.steps_per_epoch

    def state_dict(self) -> dict:
        """The resume state (order v1): JSON-serialisable, the same on every rank; counts delivered batches.

        A mixture's state also holds ``"mixture"``: the weights' quotas, samples_per_epoch and every source's
        ``dataset_id``, ``epoch`` and ``cursor`` (its own stream's position)."""
        return self._plan.state(self._epoch, self._cursor, self._shift)

    def _seq_len(self) -> int:
        """The TokenWindows length of a token file (of a mixture's token files), 0 for record files."""
        return next((int(st.seq_len) for st in self._stages if st.seq_len), 0)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (possibly saved with another world size, thread count or global batch).

        Raises StateError / StateMismatchError naming the field (another dataset, seed, order, drop_last, ...).
        The next batch covers the epoch positions ``[cursor, cursor + G)`` of the saved epoch, G this loader's
        global batch: with another global batch than the saved one the rest of the epoch is cut into steps of the
        new G from there (``drop_last=True``: a tail of fewer than G positions is dropped, as any epoch's; False:
        the last step is padded), and the next epoch starts at position 0 (README "Changing the batch size").
        Skipped samples are never read.
        """
        epoch, cursor, shift = self._plan.resume(state, self.dist.world_size)
        self._stop_active()
        self._epoch, self._cursor, self._shift = epoch, cursor, shift

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (an int >= 0) from its beginning at the next ``iter()``; TypeError / ValueError
        naming ``epoch`` otherwise."""
        epoch = check.integer("epoch", epoch, minimum=0)
        self._stop_active()
        if epoch > self._epoch:  # a stream across epochs (a Mixture) continues after the whole current epoch
            self._shift += self._plan.epoch_end(self._cursor) - self.epoch_length
        self._epoch, self._cursor = int(epoch), 0

    # ---- iteration -------------------------------------------------------------------------------------
    def __iter__(self):
        """The rest of the current epoch; a new ``iter()`` stops the previous one and continues from the
        state (batches already handed out are not repeated). The epoch counter advances at its end."""
        if self._closed:
            raise RuntimeError("this Loader is closed")
        self._check_process()
        self._stop_active()
        gen = self._stats.timed(self._epoch_batches())
        self._active = weakref.ref(gen)
        return gen

    def _check_process(self) -> None:
        """Raise RuntimeError at once when this Loader is used in a forked child of the process that created it
        and holds something a fork does not carry over: a URL's fetch threads and connections (fsspec's event
        loop), or decode threads already started (their tasks and locks stay behind in the parent). A Loader
        with neither (a local file whose batches are filled by the calling thread) is the child's from then on.
        """
        pid = os.getpid()
        if pid == self._pid:
            return
        remote = any(ds.remote is not None for ds in self._datasets)
        if not remote and not self._pool.threads:
            self._pid = pid
            return
        lost = ("the store's connections (fsspec's event loop) and its fetch threads" if remote else
                f"its {len(self._pool.threads)} decode threads")
        raise RuntimeError(
            f"{self.path}: this Loader was created in process {self._pid} and is used in process {pid}, a forked "
            f"child: {lost} do not survive a fork. Create the Loader in the child (after the fork, e.g. in the "
            "worker's own code or a DataLoader worker_init_fn), or start the workers with the 'spawn' or "
            "'forkserver' method (multiprocessing.get_context('spawn'), DataLoader(multiprocessing_context="
            "'spawn'))")

    def _stop_active(self) -> None:
        gen = self._active() if self._active is not None else None
        self._active = None
        if gen is not None:
            gen.close()

    def _next_epoch(self, end: int) -> None:
        """The epoch ended at position ``end`` (L, or another end when the global batch changed in it)."""
        self._epoch, self._cursor, self._shift = self._epoch + 1, 0, self._shift + end - self.epoch_length

    def _epoch_batches(self):
        end = self._plan.epoch_end(self._cursor)
        if self._cursor >= end:  # the last batch was handed out but the epoch not closed yet
            self._next_epoch(end)
            end = self.epoch_length
        G, epoch = self.global_batch_size, self._epoch
        # step s covers positions base + s*G + [0, G): base = 0, unless the epoch was resumed from a state of
        # another global batch (then the steps continue from the saved cursor)
        self._base = base = self._cursor % G
        steps = (end - base) // G
        first = self._cursor // G
        order = self._plan.epoch(epoch, self._shift)
        if self._inline:
            first = yield from self._inline_batches(order, epoch, first, steps)
            if first is None:  # the epoch is done
                return
        scheduled: list[Slot] = []
        nxt = first
        # remote pages: fetch the next steps' pages ahead (unless only index columns are loaded: no page reads),
        # each remote file the pages of its own samples in each step
        planned = [(src.pages, functools.partial(self._step_pages, order, k, base))
                   for k, src in enumerate(self._sources)
                   if src.pages.prefetches and any(s.pages is not None for s in src.stages)]
        for pages, pages_of_step in planned:
            pages.plan(pages_of_step, first, steps, min_ahead=self.batches_ahead)
        try:
            for step in range(first, steps):
                self._check_process()  # a generator carried over a fork: say so before touching its threads
                if self._closed:
                    raise RuntimeError(f"{self.path}: the Loader was closed (by another thread) during this epoch")
                for pages, _ in planned:
                    pages.advance(step)
                while nxt < steps and nxt - step < self.batches_ahead:
                    scheduled.append(self._schedule(order, epoch, nxt))
                    nxt += 1
                slot = scheduled.pop(0)
                self._stats.note_ready(slot.done.is_set() + sum(s.done.is_set() for s in scheduled))
                self._wait(slot)
                batch = self._handout(slot)
                self._cursor = base + (step + 1) * G
                self._prefetch_to_device(scheduled[0] if scheduled else None)
                yield batch
            self._next_epoch(end)
        finally:
            self._pool.cancel()
            for slot in scheduled if os.getpid() == self._pid and not self._closed else ():  # (forked child: no
                self._wait(slot, raise_errors=False)  # thread runs them) let in-flight slices finish first
            if self._closed:  # closed by another thread while this epoch ran: release now
                self._release()

    def _inline_batches(self, order, epoch: int, first: int, steps: int):
        """Steps ``[first, steps)`` of ``epoch``, each filled here, by the thread calling next() (``_inline``).

        Returns None at the end of the epoch, or the next step when the fills turned out slow (the median of
        ``_INLINE_CHECK`` fills above ``_INLINE_SLOW_S``: reads waiting on a disk or a network file system): the
        threads are then started and the caller prepares the rest of the epoch ahead with them.
        """
        G, B, base = self.global_batch_size, self.batch_size, self._base
        times = self._fill_times
        for step in range(first, steps):
            self._check_process()
            slot = self._next_slot()
            self._reclaim(slot)
            self._prepare(slot, order, epoch, step)
            times.append(self._run_slice(slot, 0, B, self._ctx))
            batch = self._handout(slot, owned=True)
            self._cursor = base + (step + 1) * G
            if len(times) >= self._INLINE_CHECK:
                slow = sorted(times)[len(times) // 2] > self._INLINE_SLOW_S
                times.clear()
                if slow:
                    self._leave_inline()
                    yield batch
                    return step + 1
            yield batch
        self._next_epoch(base + steps * G)
        return None

    def _leave_inline(self) -> None:
        """From now on, prepare batches ahead on ``num_threads`` threads, over the whole ring of slots (allocated
        at construction); the next batch takes slot 2, never one of the two the inline batches used."""
        self._inline = False
        self._turn = 2
        self._pool.start(self.num_threads)

    def _step_pages(self, order, k: int, base: int, step: int) -> np.ndarray:
        """Sorted unique pages of file ``k`` that this rank reads at ``step`` (its remote page source prefetches
        them): positions ``base + step*G + rank*B + [0, B)``, those :meth:`_prepare` reads."""
        from .remote_pages import span_pages

        start = base + step * self.global_batch_size + self.dist.rank * self.batch_size
        src = self._sources[k]
        starts, lens = src.spans(order.file_ids(k, start, start + self.batch_size))
        ds = src.ds
        return span_pages(np.asarray(starts, np.int64), np.asarray(lens, np.int64), ds.data_offset, ds.page_size,
                          ds.page_count)

    def stats(self, reset: bool = False) -> dict:
        """Where the time went since construction or the last ``stats(reset=True)``; always on (see below).

        Consumer side (the thread iterating the loader): ``wall_s`` (seconds since construction / the last reset),
        ``batches`` (handed out), ``next_s`` (seconds spent inside ``next()``: waiting for a batch, filling it
        when batches are filled inline, helping the threads; the call that ends an epoch included), ``step_s``
        (seconds between a batch handed out and the next ``next()`` of the same loop: the training step) over
        ``steps`` such intervals; within one loop ``next_s + step_s`` is its wall time. ``ready_ahead``: at each
        ``next()`` of the threaded path, the batches already prepared (the one asked for included; 0: the consumer
        had to wait): ``{"mean", "min", "count"}``, None when every batch was filled inline.

        Work: ``fill_s`` (wall seconds filling batch slices, all threads and the consumer together), ``slices``,
        ``rows``; ``stages`` ({field: wall seconds of its stage}; an image field's stage is one fused kernel:
        read, decode, crop, resize, flip, normalize; a token field's reads and widens in one kernel; a file
        loading one field counts whole slices); ``read_s`` (part of the stages' time: reads of records' bytes
        into a thread's staging buffer, ``pread`` or copies out of the process page cache; token windows read by
        their kernel are not split out); ``bytes_read`` (bytes read from local files with ``pread``: with
        ``page_cache="os"`` the sum of the records' lengths read (a token window: ``(seq_len + 1) * itemsize``
        bytes); with ``"process"`` the pages read into the cache and records read around it); ``threads``
        (per decode thread and the consumer: ``name``, ``fill_s``, ``slices``, ``rows``, and for decode threads
        ``cpu_s`` from the thread's CPU clock, None where the platform has none); ``num_threads`` (threads
        started), ``inline`` (batches filled by the thread calling next()), ``page_cache`` (``{"hits",
        "misses"}`` page lookups of ``page_cache="process"``, else None), ``remote`` (:meth:`remote_stats`).

        Cost: a few ``time.perf_counter`` reads per batch and slice (~50 ns each), no lock; under 1% of the
        fastest batch (a token batch filled inline, ~0.05-0.2 ms). Threads count their own numbers: while batches
        are being prepared, ``stats()`` may see a slice half counted (its time, not yet its row count).
        """
        reset = check.boolean("reset", reset)
        self._pool.refresh()  # process mode: the child's threads' counters, fetched now (threads: no-op)
        out = self._stats.collect([c[STATS_KEY] for c in self._pool.contexts[:len(self._pool.threads)]],
                                  self._ctx[STATS_KEY], self._pool.threads, reset)
        if len(self._stages) == 1:  # one field: its stage is the whole slice
            out["stages"] = {self._stages[0].name: out["fill_s"]}
        counted = self._pool.page_counters()  # process mode: the child's files are the ones read
        if counted is None:
            cache = page_counters(self._sources)
            caches = cache.pop("cached")
        else:
            caches, cache = counted
        prev = self._cache_base or {k: 0 for k in cache}
        if reset:
            self._cache_base = cache
        cache = {k: v - prev[k] for k, v in cache.items()}
        out["bytes_read"] = out.pop("read_bytes") + cache.pop("bytes_read")
        out.update(num_threads=len(self._pool.threads), inline=self._inline, page_cache=cache if caches else None,
                   remote=self.remote_stats())
        return out

    def bottleneck(self, step_seconds: float | None = None) -> dict:
        """Is the training loop waiting on the loader? From :meth:`stats` (since construction or its last reset).

        Returns ``{"verdict", "text", "wait_share", "work_s_per_batch", "step_s", "num_threads", "inline",
        "recommended_num_threads", "thread_cpu_share"}``: ``wait_share`` = ``next_s / (next_s + step_s)``, the share of the consumer's
        loop spent in ``next()``; ``verdict`` ``"loader-bound"`` when it exceeds 5%, else ``"step-bound"``
        (``"unknown"`` before two batches of one loop); ``work_s_per_batch`` = ``fill_s / batches`` (wall
        seconds of filling per batch, all threads together); ``recommended_num_threads`` = ``ceil(work / step)``
        (at least 1): the threads that keep up with a step of ``step_s`` seconds, cores permitting;
        ``thread_cpu_share``: the decode threads' CPU seconds (their CPU clocks) per second of filling, None
        without threads: well under 1 when they wait for a core or the GIL, then the text says so (loader-bound
        although ``num_threads`` would suffice: free cores rather than add threads).
        ``step_seconds`` (float > 0, seconds): judge against this step time instead of the measured one (e.g.
        the GPU step a CPU test run stands in for): loader-bound when ``work / num_threads`` exceeds it.
        ``text``: one line, e.g. ``"loader-bound: the step waited 37.0% of its time in next(); ..."``.
        """
        if step_seconds is not None:
            step_seconds = check.real("step_seconds", step_seconds, low=0, low_open=True)
        return bottleneck(self.stats(), len(self._pool.threads) or self.num_threads, self._inline, step_seconds,
                          os.cpu_count())

    def remote_stats(self) -> dict | None:
        """For a URL: what was fetched (requests, bytes_fetched, pages_fetched, pages_used, memory_hits, waits,
        disk_hits / disk_misses with cache_dir); None for a local file. For several files (a Mixture, a FileSet):
        those counters summed over its files read from URLs, plus ``"per_source"``: each file's own dict (None
        for a local file); None when every file is local."""
        per_source = [src.pages.stats() for src in self._sources]
        remote = [d for d in per_source if d is not None]
        if len(per_source) == 1 or not remote:  # one file: its own counters (None when local)
            return per_source[0]
        total: dict = {}
        for d in remote:
            for key, value in d.items():
                total[key] = total.get(key, 0) + value
        return {**total, "per_source": per_source}

    def _prefetch_to_device(self, slot: Slot | None) -> None:
        """Issue the next batch's host-to-device copy now, if it is ready, so it overlaps the step the consumer
        is about to run on the batch just handed out (CUDA queue only)."""
        if (slot is not None and self._queue is not None and self._queue.prefetch and slot.prefetched is None
                and slot.done.is_set() and slot.error is None):
            slot.prefetched = self._issue(slot, None)

    def _issue(self, slot: Slot, view):
        """The device queue's copy of a filled slot. Process mode with a CUDA queue: the slot's shared buffers
        are first copied into the slot's pinned ones (one host copy, in this process), which the DMA reads."""
        if self._pinned is None:
            return self._queue.issue(self._stages, slot, view)
        staged = self._pinned[slot.index]
        for dst, src in zip(staged.arrays, slot.arrays):
            for key, value in src.items():
                if isinstance(value, np.ndarray):
                    np.copyto(dst[key], value)
                else:
                    dst[key] = list(value)
        staged.ids, staged.padding, staged.event = slot.ids, slot.padding, None
        pending = self._queue.issue(self._stages, staged, view)
        slot.event = staged.event  # _reclaim waits on it before the pinned buffers are written again
        return pending

    def _next_slot(self) -> Slot:
        slot = self._slots[self._turn % (2 if self._inline else len(self._slots))]
        self._turn += 1
        return slot

    def _schedule(self, order, epoch: int, step: int) -> Slot:
        slot = self._next_slot()
        self._reclaim(slot)
        self._prepare(slot, order, epoch, step)
        B, n = self.batch_size, self._n_slices
        slot.done.clear()
        slot.pending = n
        for i in range(n):
            self._pool.submit(slot, i * B // n, (i + 1) * B // n)
        return slot

    def _prepare(self, slot: Slot, order, epoch: int, step: int) -> None:
        """Set the slot up for ``step``: each row's file and record id, padding, ``_index``, augmentation keys."""
        # rank_positions(step, rank, world_size, G, N, drop_last) without re-validating what __init__ checked
        # (step is in [0, steps of the epoch) here): positions base + step*G + rank*B + j; the plan flags padding
        B = self.batch_size
        start = self._base + step * self.global_batch_size + self.dist.rank * B
        slot.step, slot.generation, slot.error, slot.prefetched = step, self._pool.generation, None, None
        slot.sources, slot.read_ids, slot.padding, slot.ids = order.batch(start, start + B)
        slot.keys = (sample_keys(self.seed, epoch, np.arange(start, start + B, dtype=np.int64))
                     if self._needs_keys else None)

    def _reclaim(self, slot: Slot) -> None:
        """Make the slot's buffers safe to overwrite: wait for a GPU copy out of it, and give it new buffers
        where the user still holds a batch made from the old ones."""
        if slot.event is not None:
            slot.event.synchronize()
            slot.event = None
        if any(ref() is not None for ref in slot.handed):
            slot.arrays = (self._shared.arrays(slot.index) if self._shared is not None else
                           [s.alloc(self.batch_size, self._empty) for s in self._stages])
        slot.handed = []

    def _run_slice(self, slot: Slot, lo: int, hi: int, ctx: dict) -> float:
        """Fill rows ``[lo, hi)`` of ``slot`` (in the thread whose scratch is ``ctx``); the wall seconds it took."""
        t0 = time.perf_counter()
        # slot.keys: None when no stage uses augmentation keys
        self._reader.fill(slot.arrays, lo, hi, slot.sources, slot.read_ids, slot.keys, ctx)
        dt = time.perf_counter() - t0
        st = ctx[STATS_KEY]
        st.fill_s += dt
        st.slices += 1
        st.rows += hi - lo
        return dt

    def _wait(self, slot: Slot, raise_errors: bool = True) -> None:
        # run queued slices (this batch's, else the next ones') here rather than sleeping until a thread is done
        while raise_errors and self._help and not slot.done.is_set() and self._pool.help(self._ctx):
            pass
        t0 = time.monotonic()
        while not slot.done.wait(0.1):
            if self._closed and raise_errors:
                raise RuntimeError(f"{self.path}: the Loader was closed (by another thread) while next() waited for "
                                   f"batch step {slot.step}")
            if self._pool.alive() < self.num_threads:
                raise RuntimeError(f"{self.path}: a loader thread exited unexpectedly")
            if time.monotonic() - t0 > 3600:
                raise TimeoutError(f"{self.path}: batch step {slot.step} not ready after an hour")
        if slot.error is not None and raise_errors:
            exc, slot.error = slot.error, None
            raise exc

    def _handout(self, slot: Slot, owned: bool = False) -> dict:
        """The batch of a filled slot; ``owned``: the slot's ids/padding/sources arrays are new for this batch
        (inline filling) and are handed out without a copy."""
        def view(arr):
            v = arr[...]  # a new view object: its lifetime tells whether the user still holds the batch
            slot.handed.append(weakref.ref(v))
            return v

        if self._queue is not None:
            pending, slot.prefetched = slot.prefetched, None
            batch = self._queue.deliver(pending if pending is not None else self._issue(slot, view))
        else:
            batch = {}
            for stage, arrays in zip(self._stages, slot.arrays):
                batch.update(stage.handout(arrays, view))
            batch[INDEX_KEY] = slot.ids if owned else slot.ids.copy()
            batch[PADDING_KEY] = slot.padding if owned else slot.padding.copy()
        if self._plan.hands_sources:
            batch[SOURCE_KEY] = slot.sources if owned else slot.sources.copy()
        if self.array_type == "torch":  # owned copies: from_numpy shares them, costs no copy
            for key in (INDEX_KEY, PADDING_KEY, SOURCE_KEY):
                if isinstance(batch.get(key), np.ndarray):
                    batch[key] = torch.from_numpy(batch[key])
        return batch

    # ---- lifetime --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the epoch in progress, join the threads and release the file. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        gen = self._active() if self._active is not None else None
        if gen is not None and gen.gi_running:
            # next() runs in another thread (a watchdog closing a stuck loader): stop the workers now; that
            # next() raises RuntimeError and its epoch's exit releases the files (never under its feet)
            self._pool.close(timeout=0.5)
            return
        self._stop_active()
        self._release()

    def _release(self) -> None:
        """Join the workers and release the files (once; by close(), or by the epoch a close() ended)."""
        if getattr(self, "_released", False):
            return
        self._released = True
        self._pool.close()
        close_context(self._ctx)
        self._slots = self._pinned = None  # process mode: unmaps the slots' shared files nobody else points at
        for src in self._sources:
            src.close()
        for ds in self._datasets:
            ds.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"Loader({self.path!r}, batch_size={self.batch_size}, order={self.order!r}, "
                + (f"num_workers={self.num_workers}, " if self.num_workers else "")
                + f"rank={self.dist.rank}/{self.dist.world_size}, epoch={self._epoch}, steps_remaining={self.steps_remaining})")


