"""``write_dataset``: encode a source in worker processes and write one pageset file atomically.

Bytes on disk depend on the input only: workers encode chunks in parallel, but the main process places
records in sample order (``packing.place_record``), so the file is identical for any ``num_workers``.
The file is written to ``<path>.tmp-<random>`` in the target's folder (pages, then sections, section table and
header), fsynced and renamed over ``path``: a crash or an error never leaves a file at ``path``, and a previous
file there survives until the rename.
"""

from __future__ import annotations

import hashlib
import os
import time
import traceback
import zlib
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from ..format import arguments as check
from ..format import constants as C
from ..format.checksum import ALGORITHM
from ..format.fields import Field
from ..format.layout import PAGE_CHECKSUM
from ..format.schema import build_schema, canonical_json, parse_schema
from .encode import describe_path, encode_value
from .filewriter import (
    check_not_input,
    check_output_path,
    lineage,
    ordered_map,
    remove_stale_temps,
    temp_file,
    write_tail,
)
from .packing import page_count, place_record
from .sources import ImageList, SampleError, Source, WorkerTraceback, open_source

# Said once under a failing sample's message when on_error="raise" (the CLI says --on-error skip instead).
ON_ERROR_HINT = ("To leave bad samples out instead, pass on_error='skip': their indices and errors are recorded in "
                 "the file's lineage (WriteResult.skipped).")


@dataclass(frozen=True)
class WriteResult:
    """What ``write_dataset`` wrote: ``path``, ``records`` written, ``skipped`` sample indices, ``dataset_id``
    (hex SHA-256), ``bytes`` (file size), ``seconds`` (wall time)."""

    path: str
    records: int
    skipped: tuple
    dataset_id: str
    bytes: int
    seconds: float


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
    chunk_size: int = 8,
    lineage: bool = True,
) -> WriteResult:
    """Convert ``source`` into one pageset file at ``path``.

    Args:
        path: output file (any extension; ``.pageset`` is conventional). Replaced atomically.
        source: an ImageFolder directory, a list of image paths, a file list (the path of a text file of image
            paths, optionally ``<path>\t<label>``, relative to its folder; see :class:`ImageList`), or any object
            with ``__len__`` and ``__getitem__`` returning a tuple (one value per field, in field order) or a dict.
        fields: ``{name: Field}`` in storage order, e.g. ``{"image": RGBImage(max_resolution=512), "label":
            Int()}``; defaults exist for ImageFolder and path lists.
        num_workers: encoding processes (``None``: ``os.cpu_count()``; ``0``: encode in this process). Worker
            processes are forked where the platform allows, so the source need not be picklable there.
        page_size: bytes per page, a power of two in [4 KiB, 1 GiB] (default 8 MiB).
        progress: show a tqdm progress bar.
        on_error: ``"raise"`` (stop at the first bad sample, nothing written) or ``"skip"`` (leave bad samples
            out; their indices and errors are recorded in the file's lineage metadata).
        metadata: a JSON-serialisable dict stored as user metadata (outside the dataset id).
        chunk_size: samples per task sent to a worker.
        lineage: record when, where and by which versions the file was written (metadata section, outside the
            dataset id). With ``False`` only the source description and skipped samples are recorded, so the
            whole file is byte-identical across runs, machines and ``num_workers``.

    Returns:
        :class:`WriteResult`.

    Raises:
        SampleError: a sample could not be read or encoded (names the source, sample index, field and cause,
            and how to skip bad samples; a worker's traceback is its ``__cause__``); ``TypeError`` (wrong kind of
            value) / ``ValueError`` (out of range) for invalid arguments, naming the argument, before any work;
            FileNotFoundError: the output folder does not exist;
        RuntimeError: a worker process died (killed or crashed).
    """
    t0 = time.perf_counter()
    path = check_output_path(path)
    fields = check.mapping("fields", fields, optional=True, example="{'image': RGBImage(), 'label': Int()}")
    num_workers = check.integer("num_workers", num_workers, minimum=0, optional=True)
    _check_page_size(page_size)
    progress = check.boolean("progress", progress)
    on_error = check.choice("on_error", on_error, ("raise", "skip"))
    metadata = check.mapping("metadata", metadata, optional=True)
    chunk_size = check.integer("chunk_size", chunk_size, minimum=1)
    lineage = check.boolean("lineage", lineage)
    if num_workers is None:
        num_workers = os.cpu_count() or 1
    src, fields = open_source(source, fields)
    writer_params = {"page_size": page_size, "checksum": ALGORITHM}
    schema = build_schema(fields, src.attributes, writer_params)
    parse_schema(schema)  # the writer must never produce a schema its own reader refuses
    canonical_json(metadata or {})  # fail early on non-JSON metadata, before any work

    folder = os.path.dirname(os.path.abspath(path))
    if isinstance(source, (str, os.PathLike)):
        check_not_input(path, [source])
    elif isinstance(src.data, list) and src.data and isinstance(src.data[0], str):  # a list of image paths
        check_not_input(path, src.data)
    elif isinstance(src.data, ImageList):
        check_not_input(path, [src.data.path] + [row[0] for row in src.data.rows])
    remove_stale_temps(path)
    fd, tmp = temp_file(path)
    try:
        with os.fdopen(fd, "wb") as f:
            stats = _write_body(f, src, fields, schema, page_size, num_workers, chunk_size, on_error, progress,
                                metadata or {}, lineage)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except SampleError as exc:
        _unlink(tmp)
        if exc.hint:
            raise
        raise SampleError(exc.source, exc.index, exc.field, exc.detail, ON_ERROR_HINT) from exc.__cause__
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(folder)
    return WriteResult(path, stats["records"], tuple(stats["skipped"]), stats["dataset_id"], stats["bytes"],
                       time.perf_counter() - t0)


def _unlink(name: str) -> None:
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


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


def _fsync_dir(folder: str) -> None:
    try:
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


class _PageWriter:
    """Writes the data area sequentially and keeps a CRC-32 per page (the last page may be short)."""

    def __init__(self, f, page_size: int):
        self.f, self.page_size = f, page_size
        self.pos = 0  # bytes of the data area written so far
        self.crc = 0
        self.crcs: list[int] = []

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            room = self.page_size - self.pos % self.page_size
            chunk = mv[:room]
            self.f.write(chunk)
            self.crc = zlib.crc32(chunk, self.crc)
            self.pos += len(chunk)
            mv = mv[room:]
            if self.pos % self.page_size == 0:
                self.crcs.append(self.crc)
                self.crc = 0

    def pad_to(self, target: int) -> None:
        zeros = bytes(min(target - self.pos, 1 << 20))
        while self.pos < target:
            self.write(zeros[: target - self.pos])

    def finish(self) -> np.ndarray:
        if self.pos % self.page_size:
            self.crcs.append(self.crc)
        return np.asarray(self.crcs, dtype=PAGE_CHECKSUM)


# ---- encoding, in this process or in workers -------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(src: Source, fields: dict) -> None:
    _WORKER["src"], _WORKER["fields"] = src, fields


def encode_sample(src: Source, fields: dict[str, Field], i: int) -> tuple[list, dict]:
    """Encode sample ``i``: ``(payloads of the non-inline fields in order, {index column: value})``."""
    try:
        values = src.sample(i)
    except SampleError:
        raise
    except Exception as exc:
        raise SampleError(src.description, i, None, f"reading the sample raised {type(exc).__name__}: {exc}") from exc
    payloads, columns = [], {}
    for name, field in fields.items():
        try:
            payload, cols = encode_value(values[name], field)
        except Exception as exc:
            where = describe_path(values[name])
            detail = f"{type(exc).__name__}: {exc}" + (where if where.strip(" ()") not in str(exc) else "")
            raise SampleError(src.description, i, name, detail) from exc
        if payload is not None:
            payloads.append(payload)
        for suffix, value in cols.items():
            columns[f"{name}.{suffix}" if suffix else name] = value
    return payloads, columns


def _encode_chunk(start: int, stop: int, on_error: str, src=None, fields=None) -> list:
    """Encode samples ``[start, stop)``: a list of ``("ok", payloads, cols)``, ``("skip", index, field, detail)``
    or, in a worker with on_error="raise", ``("error", index, field, detail, traceback)`` entries."""
    in_worker = src is None
    src = src if src is not None else _WORKER["src"]
    fields = fields if fields is not None else _WORKER["fields"]
    out = []
    for i in range(start, stop):
        try:
            out.append(("ok",) + encode_sample(src, fields, i))
        except SampleError as exc:
            if on_error == "skip":
                out.append(("skip", exc.index, exc.field, exc.detail))
            elif in_worker:  # the cause's traceback only: the SampleError adds nothing to it but its message
                cause = exc.__cause__ if exc.__cause__ is not None else exc
                tb = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
                out.append(("error", exc.index, exc.field, exc.detail, tb))
                return out
            else:
                raise
    return out


def _chunks_in_order(src, fields, num_workers, chunk_size, on_error):
    """Yield encoded chunks in sample order; workers run ahead by a bounded number of chunks."""
    n = len(src)
    starts = range(0, n, chunk_size)
    if num_workers == 0:
        for s in starts:
            yield _encode_chunk(s, min(s + chunk_size, n), on_error, src, fields)
        return
    died = (f"{src.description}: a writer worker process died (killed or crashed, e.g. out of memory or a "
            "segfault in a decoder); nothing was written. Retry with num_workers=0 to see the error in this "
            "process.")
    tasks = ((s, min(s + chunk_size, n), on_error) for s in starts)
    yield from ordered_map(_encode_chunk, tasks, num_workers, _init_worker, (src, fields), 4 * num_workers, died)


def _write_body(f, src, fields, schema, page_size, num_workers, chunk_size, on_error, progress, user,
                record_lineage):
    _, row_dtype = parse_schema(schema)
    n = len(src)
    index = np.zeros(n, dtype=row_dtype)
    span_names = [name for name, fld in fields.items() if not fld.inline]
    pages = _PageWriter(f, page_size)
    f.seek(C.DATA_OFFSET)
    cursor = 0
    count = 0
    skipped: list[int] = []
    skip_log: list[dict] = []
    bar = tqdm(total=n, disable=not progress, desc="pageset write", unit="sample", leave=False)
    try:
        for chunk in _chunks_in_order(src, fields, num_workers, chunk_size, on_error):
            for entry in chunk:
                if entry[0] == "error":
                    _, i, field, detail, tb = entry
                    raise SampleError(src.description, i, field, detail) from WorkerTraceback(tb)
                if entry[0] == "skip":
                    skipped.append(entry[1])
                    skip_log.append({"index": entry[1], "field": entry[2], "error": entry[3]})
                    continue
                _, payloads, cols = entry
                length = sum(len(p) for p in payloads)
                start, cursor = place_record(cursor, length, page_size)
                pages.pad_to(start)
                row = index[count]
                row["_offset"], row["_length"] = C.DATA_OFFSET + start, length
                off = C.DATA_OFFSET + start
                for name, payload in zip(span_names, payloads):
                    row[f"{name}.offset"], row[f"{name}.length"] = off, len(payload)
                    off += len(payload)
                    pages.write(payload)
                for col, value in cols.items():
                    row[col] = value
                count += 1
            bar.update(len(chunk))
    finally:
        bar.close()
    if count == 0:
        raise ValueError(f"{src.description}: no sample was written ({len(skipped)} skipped, {n} in the source)")
    index = index[:count]
    data_length = pages.pos
    crcs = pages.finish()
    assert len(crcs) == page_count(data_length, page_size)

    schema_bytes = canonical_json(schema)
    index_bytes = index.tobytes()
    crc_bytes = crcs.tobytes()
    dataset_id = hashlib.sha256(schema_bytes + index_bytes + crc_bytes).digest()
    meta = dict(lineage() if record_lineage else {}, source=src.description, samples_in_source=n,
                skipped=skipped, skipped_errors=skip_log[:1000])
    sections = [
        (C.SECTION_SCHEMA, C.SECTION_FLAG_REQUIRED, schema_bytes),
        (C.SECTION_INDEX, C.SECTION_FLAG_REQUIRED, index_bytes),
        (C.SECTION_PAGE_CHECKSUMS, 0, crc_bytes),
        (C.SECTION_METADATA, 0, canonical_json({"lineage": meta, "user": user})),
    ]
    file_size = write_tail(f, page_size=page_size, data_length=data_length, page_count=len(crcs),
                           record_count=count, required_features=0, dataset_id=dataset_id, sections=sections)
    return {"records": count, "skipped": skipped, "dataset_id": dataset_id.hex(), "bytes": file_size}
