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
from dataclasses import dataclass

from ..format import arguments as check
from ..order import DEFAULT_WINDOW_RECORDS, ORDERS, enable_kernel_cache, resolve_rank, window_pages_of
from ..order.keys import MASK64
from ..order.plan import Member, OrderParams, PlanSpec
from ..order.subset import OneFile
from ..read.remote import url_scheme
from .inputs import Input, open_input
from .options import LoaderDescription, PageOptions, RemoteOptions, resolve
from .source import FileSource, RowReader, check_same_fields, split_cache_pages
from .epoch import EpochRunner
from .ring import SlotRing
from .stats import STATS_KEY, LoaderReport, LoaderStats, ThreadStats
from .compile_notice import announce_compiles
from .process_pool import ProcessPool
from .workers import ThreadPool, close_context

ARRAY_TYPES = ("torch", "numpy")  # what a batch's arrays are: torch tensors (default) or numpy arrays


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


class Loader(SlotRing, EpochRunner, LoaderReport):
    """Batches from a pageset file.

    Args:
        path: the pageset file, or a :class:`~pageset.Mixture` of files read as one stream in fixed
            proportions or on a :class:`~pageset.Schedule` of weights (see ``formats/mixture.md``): each batch
            then also carries ``"_source"`` (int16[B],
            the file of each sample) and ``"_index"`` holds record ids within that file; or a
            ``pageset.order.fileset.FileSet`` of member files read as one dataset (ids run through the members in
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
        page_options, remote_options: the same arguments grouped as objects (``pageset.PageOptions``: page_cache,
            cache_pages, verify_pages, window_pages, window_records; ``pageset.RemoteOptions``: storage_options,
            cache_dir, cache_limit_bytes, prefetch_bytes, max_requests, request_timeout, request_attempts;
            load/options.py). ValueError naming an argument given both in the object and flat; TypeError for
            another type.

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

    def __init__(self, path, *, batch_size: int, pipelines: dict | None = None, order: str = "random",
                 seed: int = 0, drop_last: bool = True, num_threads: int | None = None,
                 batches_ahead: int | None = None, rank: int | None = None, world_size: int | None = None,
                 page_cache: str = "os", window_pages: int | None = None,
                 window_records: int | None = None, cache_pages: int | None = None,
                 verify_pages: bool = False, indices=None, storage_options: dict | None = None, cache_dir=None,
                 cache_limit_bytes: int | None = None, prefetch_bytes: int | None = None, max_requests: int = 8,
                 request_timeout: float = 30.0, request_attempts: int = 5, array_type: str = "torch",
                 num_workers: int = 0, page_options: PageOptions | None = None,
                 remote_options: RemoteOptions | None = None):
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
        pages = resolve(PageOptions, page_options, PageOptions(page_cache, cache_pages, verify_pages, window_pages,
                                                               window_records))
        page_cache, cache_pages, verify_pages = pages.page_cache, pages.cache_pages, pages.verify_pages
        window_pages = pages.window_pages
        window_records = DEFAULT_WINDOW_RECORDS if pages.window_records is None else pages.window_records
        remote = resolve(RemoteOptions, remote_options, RemoteOptions(
            storage_options, cache_dir, cache_limit_bytes, prefetch_bytes, max_requests, request_timeout,
            request_attempts))
        storage_options, request_timeout, request_attempts = (remote.storage_options, remote.request_timeout,
                                                               remote.request_attempts)
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
        # process mode: the child process builds this Loader again from its description (see _describe())
        self._described = dict(path=path, batch_size=batch_size, pipelines=pipelines, order=order, seed=seed,
                               drop_last=drop_last, num_threads=num_threads, batches_ahead=batches_ahead,
                               page_options=PageOptions(page_cache, cache_pages, verify_pages, window_pages,
                                                        window_records if window_pages is None else None),
                               indices=indices, array_type=array_type)
        self._sources: list[FileSource] = []
        self._inputs: list[Input] = []
        self._datasets = []  # each input's dataset (a Dataset, or a many-file set's ManyFileInput)
        self._remote_options = dict(prefetch_bytes=remote.prefetch_bytes, max_requests=remote.max_requests,
                                    cache_dir=remote.cache_dir, cache_limit_bytes=remote.cache_limit_bytes)
        try:
            # storage_options go to the URL members of a Mixture; with no URL at all, Dataset refuses them
            any_url = any(url_scheme(p) is not None for p in spec.paths)
            for p in spec.paths:
                opts = storage_options if url_scheme(p) is not None or not any_url else None
                # records or a token file, or a many-file set's manifest (load/set_source.py)
                self._inputs.append(open_input(p, opts, request_timeout, request_attempts))
                self._datasets.append(self._inputs[-1].dataset)
            self._ds = self._datasets[0]
            self._setup(spec, page_cache, cache_pages, pipelines, verify_pages)
            self._setup_buffers()
            self._pool = None
            if num_workers:  # started now: the child imports and opens the files while the trainer sets up
                self._pool = ProcessPool(self._describe(), self._shared, num_threads, str(self.path))
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
        for inp, cache_pages in zip(self._inputs, per_file):
            # a file's FileSource, or a many-file set's ManyFileSource (members opened when first read)
            self._sources.append(inp.source(pipelines, page_cache, cache_pages, verify_pages,
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

    def _describe(self) -> LoaderDescription:
        """What the child process of ``num_workers=1`` builds its Loader from: a picklable
        :class:`~pageset.load.options.LoaderDescription` of the arguments as resolved here, rank and world size
        included, pipelines without ToDevice (the parent copies to the device); local files only (no URL
        options). TypeError naming the field and op that cannot be pickled (the child is another interpreter)."""
        args = self._described
        pipes = args["pipelines"]
        if pipes is not None:
            pipes = {name: ops if not isinstance(ops, (list, tuple)) else
                     [op for op in ops if not getattr(op, "is_to_device", False)] for name, ops in pipes.items()}
        desc = LoaderDescription(**{**args, "pipelines": pipes, "rank": self.dist.rank,
                                    "world_size": self.dist.world_size})
        try:
            pickle.dumps(desc, protocol=pickle.HIGHEST_PROTOCOL)
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
        return desc

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
        ``dataset_id``, ``epoch`` and ``cursor`` (its own stream's position); with a Schedule its id and the stage,
        after weights edited on resume the ``base`` and ``edits`` (formats/mixture.md section 3)."""
        return self._plan.state(self._epoch, self._cursor, self._shift)

    def _seq_len(self) -> int:
        """The TokenWindows length of a token file (of a mixture's token files), 0 for record files."""
        return next((int(st.seq_len) for st in self._stages if st.seq_len), 0)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (possibly saved with another world size, thread count or global batch).

        Raises StateError / StateMismatchError naming the field (another dataset, seed, order, drop_last, ...).
        A Mixture whose weights differ from the saved ones is not refused: its weights take over at the saved
        position (README "Schedules", formats/mixture.md section 3.3).
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


