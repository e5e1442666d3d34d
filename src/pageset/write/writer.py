"""``write_dataset``: source -> encode(range) -> assemble -> one pageset file, made visible atomically.

The source is cut into contiguous index ranges. Each range is encoded (``ranges.encode_range``) in this process,
in forked worker processes (``num_workers``), or by any ``concurrent.futures.Executor`` (``executor=``: Dask,
Ray, a process pool), whose tasks write shard files to shared storage. One assembly step (``assemble``) places
the records in sample order, so the bytes depend on the input only, never on the cut or the workers.
The file is written to ``<path>.tmp-<random>`` in the target's folder (pages, then sections, section table and
header), fsynced and renamed over ``path`` (for an fsspec URL: uploaded, and completed only at the end): a crash
or an error never leaves a file at ``path``, and a previous file there survives until the rename.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from tqdm.auto import tqdm

from ..format import arguments as check
from ..format import constants as C
from ..format.checksum import ALGORITHM
from ..format.fields import Field
from ..format.schema import build_schema, canonical_json, parse_schema
from .assemble import Assembly
from .output import Output, check_not_input, check_output_path, check_replaceable
from .pool import MAX_WORKERS, executor_map, ordered_map
from .tail import lineage as lineage_info
from .ranges import (
    ShardPart,
    check_picklable,
    cut,
    encode_range,
    encode_range_to_shard,
    new_shard_folder,
    remove_shard_folder,
)
from .sources import ImageList, SampleError, Source, open_source
from .upload import WritePolicy

# Said once under a failing sample's message when on_error="raise" (the CLI says --on-error skip instead).
ON_ERROR_HINT = ("To leave bad samples out instead, pass on_error='skip': their indices and errors are recorded in "
                 "the file's lineage (WriteResult.skipped).")


@dataclass(frozen=True)
class WriteResult:
    """What ``write_dataset`` wrote: ``path``, ``records`` written, ``skipped`` sample indices, ``dataset_id``
    (hex SHA-256), ``bytes`` (file size), ``seconds`` (wall time); for a many-file dataset ``path`` is the folder,
    ``records``, ``dataset_id`` and ``bytes`` are the whole set's and ``members`` names the member files this
    call wrote (empty for one file)."""

    path: str
    records: int
    skipped: tuple
    dataset_id: str
    bytes: int
    seconds: float
    members: tuple = ()


def write_dataset(
    path,
    source,
    fields: dict[str, Field] | None = None,
    *,
    num_workers: int | None = None,
    page_size: int = C.DEFAULT_PAGE_SIZE,
    progress: bool = True,
    on_error: str = "raise",
    metadata: dict | None = None,
    chunk_size: int | None = None,
    lineage: bool = True,
    executor=None,
    shard_dir: str | None = None,
    storage_options: dict | None = None,
    request_timeout: float = 30.0,
    request_attempts: int = 5,
    records_per_member: int | None = None,
    append: bool = False,
) -> WriteResult:
    """Convert ``source`` into one pageset file at ``path``.

    Args:
        path: output file (any extension; ``.pageset`` is conventional), or an fsspec URL such as
            ``"s3://bucket/train.pageset"``: to S3 the file streams into one multipart upload while it is
            written, no local copy (the first 64 MiB part, which holds the header, stays in memory and goes up
            last; the object becomes visible only when the upload completes); other stores get the file assembled
            in the local temp folder (``TMPDIR``), then uploaded. Replaced atomically either way.
        source: an ImageFolder directory, a list of image paths, a file list (the path of a text file of image
            paths, optionally ``<path>\t<label>``, relative to its folder; see :class:`ImageList`), or any object
            with ``__len__`` and ``__getitem__`` returning a tuple (one value per field, in field order) or a dict.
        fields: ``{name: Field}`` in storage order, e.g. ``{"image": RGBImage(max_resolution=512), "label":
            Int()}``; defaults exist for ImageFolder and path lists.
        num_workers: encoding processes (``None``: ``os.cpu_count()``; ``0``: encode in this process; at most
            1024, ValueError beyond), never more than there are chunks (members) to encode. Worker processes are
            forked where the platform allows, so the source need not be picklable there. Ignored when
            ``executor`` is given.
        page_size: bytes per page, a power of two in [4 KiB, 1 GiB] (default 8 MiB).
        progress: show a tqdm progress bar.
        on_error: ``"raise"`` (stop at the first bad sample, nothing written) or ``"skip"`` (leave bad samples
            out; their indices and errors are recorded in the file's lineage metadata).
        metadata: a JSON-serialisable dict stored as user metadata (outside the dataset id).
        chunk_size: samples per task (a contiguous index range); default 8 for ``num_workers``, 1024 for an
            ``executor`` (each executor task writes one shard file of that many encoded samples).
        lineage: record when, where and by which versions the file was written (metadata section, outside the
            dataset id). With ``False`` only the source description and skipped samples are recorded, so the
            whole file is byte-identical across runs, machines, ``num_workers``, executors and ``chunk_size``.
        executor: any ``concurrent.futures.Executor`` to encode ranges on, e.g. a Dask cluster's
            ``Client(...).get_executor()``, or ``ProcessPoolExecutor``. The source part and ``fields`` are
            pickled to its workers (TypeError up front, naming the attribute that cannot be). A task that dies
            and is retried by the engine rewrites the same shard.
        shard_dir: where executor tasks write shards, a folder or fsspec URL every worker can reach; default
            next to ``path`` (``<path>.shards-<host>-<pid>-<random>``). Removed at the end, also on failure.
        storage_options: passed to fsspec for URLs (``path`` and ``shard_dir``), e.g. ``{"endpoint_url": ...}``;
            with an ``executor`` they reach the workers too (credentials for a URL ``shard_dir``).
        request_timeout, request_attempts: URL ``path`` only: seconds per request to the store and attempts per
            request (as for reading, :func:`~pageset.open_dataset`); a store that never answers fails after about
            ``request_attempts * request_timeout`` seconds with TimeoutError naming the URL.
        records_per_member: write a many-file dataset (``formats/manyfile.md``) instead of one file: ``path`` is
            a folder (created; or an fsspec URL prefix) that receives member files of this many samples each
            (``m<generation>-<k>.pageset``, the last one shorter), each encoded and written by its own task
            (``num_workers`` processes or ``executor`` tasks; nothing passes through this process), then
            ``pageset.manifest.json``, written last and atomically. Members depend on the source and settings
            only: byte-identical for any executor, worker count or retry with ``lineage=False``. A folder that
            holds a set already gets a new set (its old members are removed once the new manifest is in
            place), or with ``append=True`` more members. Read it with :func:`~pageset.open_dataset`.
        append: with ``records_per_member``: add the source's samples as new members after those of the set at
            ``path`` (old members are not rewritten; the set's dataset id changes). The fields and settings
            must be those of the set (ValueError naming the field otherwise).

    Returns:
        :class:`WriteResult`.

    Raises:
        SampleError: a sample could not be read or encoded (names the source, sample index, field and cause,
            and how to skip bad samples; a worker's traceback is its ``__cause__``); ``TypeError`` (wrong kind of
            value) / ``ValueError`` (out of range) for invalid arguments, naming the argument, before any work, or
            a source that cannot be pickled for ``executor``, an http(s) ``path`` (read-only), or an existing ``path``
            (file or object) that is not a pageset file; FileNotFoundError: the output folder or bucket does not
            exist; PermissionError: no credentials or access for a URL (naming it: output or shard_dir);
            TimeoutError / ConnectionError: the store did not answer within ``request_attempts`` attempts;
        RuntimeError: a worker process died (killed or crashed); with an executor, whatever the engine raises
            once it gives up on a task (Dask: ``KilledWorker`` after ``allowed-failures`` deaths).
        An ``s3://`` output goes up in parts of 64 MiB growing by 64 MiB every 500 parts
        (:class:`~pageset.write.upload.PartPlan`), within S3's limits for any file up to 5 TiB; a larger one
        raises ValueError naming the limit, before its bytes past 5 TiB are uploaded.
    """
    t0 = time.perf_counter()
    records_per_member = check.integer("records_per_member", records_per_member, minimum=1, optional=True)
    append = check.boolean("append", append)
    if append and records_per_member is None:
        raise ValueError("append=True adds members to a many-file dataset: give records_per_member= too")
    if records_per_member is not None:
        path = check_folder_path(path)
    else:
        path = check_output_path(path)
    fields = check.mapping("fields", fields, optional=True, example="{'image': RGBImage(), 'label': Int()}")
    num_workers = check.integer("num_workers", num_workers, minimum=0, maximum=MAX_WORKERS, optional=True)
    _check_page_size(page_size)
    progress = check.boolean("progress", progress)
    on_error = check.choice("on_error", on_error, ("raise", "skip"))
    metadata = check.mapping("metadata", metadata, optional=True)
    chunk_size = check.integer("chunk_size", chunk_size, minimum=1, optional=True)
    lineage = check.boolean("lineage", lineage)
    if executor is not None and not callable(getattr(executor, "submit", None)):
        raise TypeError(f"executor must be a concurrent.futures.Executor (with .submit), got {type(executor).__name__}")
    shard_dir = check.text("shard_dir", shard_dir, optional=True)
    storage_options = check.mapping("storage_options", storage_options, optional=True)
    policy = WritePolicy(check.real("request_timeout", request_timeout, low=0, low_open=True),
                         check.integer("request_attempts", request_attempts, minimum=1))
    if num_workers is None:
        num_workers = os.cpu_count() or 1
    if chunk_size is None:
        chunk_size = 1024 if executor is not None else 8
    src, fields = open_source(source, fields)
    writer_params = {"page_size": page_size, "checksum": ALGORITHM}
    schema = build_schema(fields, src.attributes, writer_params)
    _, row_dtype = parse_schema(schema)  # the writer must never produce a schema its own reader refuses
    check.json_metadata("metadata", metadata)  # fail early on non-JSON metadata, before any work
    canonical_json(metadata or {})

    if isinstance(source, (str, os.PathLike)):
        check_not_input(path, [source])
    elif isinstance(src.data, list) and src.data and isinstance(src.data[0], str):  # a list of image paths
        check_not_input(path, src.data)
    if isinstance(src.data, ImageList):
        check_not_input(path, [src.data.path] + [row[0] for row in src.data.rows])
    if records_per_member is not None:
        return _write_many(path, src, fields, schema, row_dtype, page_size, records_per_member, append,
                           num_workers, chunk_size, on_error, executor, storage_options, policy, lineage,
                           metadata, progress, t0)
    # after check_not_input: its message is sharper
    check_replaceable(path, "write_dataset(path, source, fields)", storage_options, policy)
    ranges = cut(len(src), chunk_size)
    if executor is not None and ranges:
        check_picklable(src.part(*ranges[0]).data, "source", executor)
        check_picklable(fields, "fields", executor)
    out = Output(path, storage_options, policy=policy)
    try:
        parts = _encoded_parts(src, fields, row_dtype, ranges, num_workers, on_error, executor, path, shard_dir,
                               storage_options)
        asm = Assembly(out.f, schema, row_dtype, [n for n, f in fields.items() if not f.inline], page_size,
                       src.description)
        bar = tqdm(total=len(src), disable=not progress, desc="pageset write", unit="sample", leave=False)
        try:
            for part in parts:
                asm.add(part)
                bar.update(part.stop - part.start)
        finally:
            bar.close()
            parts.close()
        stats = asm.finish(len(src), lineage_info() if lineage else {}, metadata or {})
        out.commit()
    except SampleError as exc:
        out.abort()
        if exc.hint:
            raise
        raise SampleError(exc.source, exc.index, exc.field, exc.detail, ON_ERROR_HINT) from exc.__cause__
    except BaseException:
        out.abort()
        raise
    return WriteResult(out.path, stats["records"], tuple(stats["skipped"]), stats["dataset_id"], stats["bytes"],
                       time.perf_counter() - t0)


def check_folder_path(path) -> str:
    """The output folder of a many-file dataset as a str (its parent must exist; checked at the write)."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be the output folder's path or URL (str or os.PathLike), got {path!r} "
                        f"({type(path).__name__})")
    path = os.fspath(path)
    if not path:
        raise ValueError("path must name a folder, got ''")
    if path.lower().startswith(("http://", "https://")):
        raise ValueError(f"cannot write {path}: http(s) URLs are read-only; write to a local folder or an object "
                         "store URL (s3://, gs://, az://, ...)")
    return path.rstrip("/") or "/"


def _write_many(folder, src, fields, schema, row_dtype, page_size, per_member, append, num_workers, chunk_size,
                on_error, executor, storage_options, policy, lineage, metadata, progress, t0) -> WriteResult:
    """write_dataset(records_per_member=...): one task per member writes it whole; then the manifest."""
    from . import members as M

    call = "write_dataset(path, source, fields, records_per_member=...)"
    *prepared, lock = M.prepare_folder(folder, storage_options, "records", schema, append, call)
    with lock:  # the set's writer lock (formats/manyfile.md section 9), released however the write ends
        return _write_members(prepared, folder, src, fields, schema, row_dtype, page_size, per_member, num_workers,
                              chunk_size, on_error, executor, storage_options, policy, lineage, metadata, progress,
                              t0)


def _write_members(prepared, folder, src, fields, schema, row_dtype, page_size, per_member, num_workers, chunk_size,
                   on_error, executor, storage_options, policy, lineage, metadata, progress, t0) -> WriteResult:
    """_write_many's work, under the set's writer lock: ``prepared`` is what prepare_folder found."""
    from . import members as M

    previous, generation, kept = prepared
    cuts = cut(len(src), per_member)
    meta, user = (lineage_info() if lineage else {}), (metadata or {})
    chunk = chunk_size or 1024
    if executor is not None and cuts:
        check_picklable(src.part(*cuts[0]).data, "source", executor)
        check_picklable(fields, "fields", executor)
    names = [M.member_name(generation, k) for k in range(len(cuts))]
    if executor is None and num_workers > 0:
        fn = M.record_member_in_worker
        tasks = ((schema, page_size, a, b, chunk, on_error, folder, n, storage_options, meta, user, policy)
                 for (a, b), n in zip(cuts, names))
    else:
        fn = M.write_record_member
        tasks = ((src if executor is None else src.part(a, b), fields, row_dtype, schema, page_size, a, b, chunk,
                  on_error, folder, n, storage_options, meta, user, policy, executor is None)
                 for (a, b), n in zip(cuts, names))
    died = (f"{src.description}: a writer worker process died (killed or crashed, e.g. out of memory or a "
            "segfault in a decoder); no manifest was written. Retry with num_workers=0 to see the error in this "
            "process.")
    workers = min(num_workers, max(1, len(cuts)))  # no more processes than members to write
    results = M.run_tasks(fn, tasks, workers, executor, M.init_record_worker, (src, fields, row_dtype), died)
    done, skipped = [], []
    bar = tqdm(total=len(src), disable=not progress, desc="pageset write", unit="sample", leave=False)
    try:
        try:
            for (a, b), s in zip(cuts, results):
                if "error" in s:
                    i, name, detail, tb, *where = s["error"]
                    from .sources import WorkerTraceback

                    cause = WorkerTraceback(tb) if tb else None
                    raise SampleError(where[0] if where else src.description, i, name, detail,
                                      ON_ERROR_HINT) from cause
                skipped += [e["index"] for e in s["skipped"]]
                if not s.get("empty"):
                    done.append(s)
                bar.update(b - a)
        finally:
            bar.close()
            results.close()  # cancels and waits for tasks still in flight
        manifest = M.finish(folder, "records", schema, page_size, previous, generation, kept, done,
                            storage_options, policy)
    except SampleError as exc:
        M.abandon(folder, storage_options, previous)
        if exc.hint:
            raise
        raise SampleError(exc.source, exc.index, exc.field, exc.detail, ON_ERROR_HINT) from exc.__cause__
    except BaseException:
        M.abandon(folder, storage_options, previous)
        raise
    return WriteResult(folder, manifest.records, tuple(skipped), manifest.dataset_id,
                       sum(m.bytes for m in manifest.members), time.perf_counter() - t0,
                       tuple(s["name"] for s in done))


def _check_page_size(page_size: int) -> None:
    if not check.is_int(page_size):
        raise TypeError(f"page_size must be an int, a power of two in [{C.MIN_PAGE_SIZE}, {C.MAX_PAGE_SIZE}], "
                        f"got {page_size!r} ({type(page_size).__name__})")
    if (
        page_size < C.MIN_PAGE_SIZE
        or page_size > C.MAX_PAGE_SIZE
        or page_size & (page_size - 1)
    ):
        raise ValueError(
            f"page_size must be a power of two in [{C.MIN_PAGE_SIZE}, {C.MAX_PAGE_SIZE}], got {page_size!r}; "
            f"the default is {C.DEFAULT_PAGE_SIZE}"
        )


# ---- encoding: in this process, in forked workers, or on an executor through shards -----------------------

_WORKER: dict = {}


def _init_worker(src: Source, fields: dict, row_dtype) -> None:
    _WORKER["src"], _WORKER["fields"], _WORKER["row_dtype"] = src, fields, row_dtype


def _encode_in_worker(start: int, stop: int, on_error: str):
    return encode_range(_WORKER["src"], _WORKER["fields"], _WORKER["row_dtype"], start, stop, on_error)


def _encoded_parts(src, fields, row_dtype, ranges, num_workers, on_error, executor, path, shard_dir,
                   storage_options):
    """Yield the encoded ranges in order (:class:`EncodedRange` or :class:`ShardPart`)."""
    if executor is not None:
        folder = new_shard_folder(path, shard_dir, storage_options)
        tasks = ((src.part(a, b), fields, row_dtype, a, b, on_error, folder, storage_options) for a, b in ranges)
        results = executor_map(executor, encode_range_to_shard, tasks, ahead=64)
        try:
            for (a, b), summary in zip(ranges, results):
                part = ShardPart(summary, row_dtype, storage_options)
                part.start, part.stop = a, b
                yield part
        finally:
            results.close()  # cancels and waits for tasks still in flight before their folder goes
            remove_shard_folder(folder, storage_options)
        return
    if num_workers == 0:
        for a, b in ranges:
            yield encode_range(src, fields, row_dtype, a, b, on_error, in_process=True)
        return
    died = (f"{src.description}: a writer worker process died (killed or crashed, e.g. out of memory or a "
            "segfault in a decoder); nothing was written. Retry with num_workers=0 to see the error in this "
            "process.")
    tasks = ((a, b, on_error) for a, b in ranges)
    num_workers = max(1, min(num_workers, len(ranges)))  # no more processes than ranges to encode
    yield from ordered_map(_encode_in_worker, tasks, num_workers, _init_worker, (src, fields, row_dtype),
                           4 * num_workers, died)
