"""Assembly: encoded ranges, in sample order, -> one data area, index and page checksums -> one file.

Every writer ends here: ``write_dataset`` (ranges encoded in this process, in forked workers, or by any
``concurrent.futures.Executor`` through shard files) and ``merge_datasets`` (records of finished files). Pages
are assigned once, in sample order (``packing.place_record``), so the bytes do not depend on how the source was
cut into ranges or which worker encoded what.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass, field

import numpy as np

from ..format import constants as C
from ..format.layout import PAGE_CHECKSUM
from ..format.schema import canonical_json
from .tail import write_tail
from .packing import page_count, place_record
from .sources import SampleError, WorkerTraceback


class PageWriter:
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


@dataclass
class EncodedRange:
    """Samples ``[start, stop)`` encoded: ``rows`` (index rows of the records kept, offsets still 0; lengths and
    inline columns filled), ``blob`` (their payloads back to back, each record's span fields in field order),
    ``skipped`` (``{"index", "field", "error"}`` per sample left out) and ``error`` (``(index, field, detail,
    traceback)`` of the first bad sample with ``on_error="raise"``, else None)."""

    start: int
    stop: int
    rows: np.ndarray
    blob: bytes = b""
    skipped: list = field(default_factory=list)
    error: tuple | None = None

    def payloads(self):
        """Each record's payload (a memoryview into ``blob``), in row order."""
        mv = memoryview(self.blob)
        pos = 0
        for length in self.rows["_length"].tolist():
            yield mv[pos:pos + length]
            pos += length


class Assembly:
    """Places records part by part: ``add(part)`` for each part in sample order (any object with ``rows``,
    ``payloads()``, ``skipped``, ``error``, ``start``), then :meth:`finish` writes the sections and the header.

    ``source`` names the source in errors and lineage; ``f`` is the output's temp file (seekable, binary).
    """

    def __init__(self, f, schema: dict, row_dtype: np.dtype, span_names: list[str], page_size: int, source: str):
        self.f, self.schema, self.row_dtype = f, schema, row_dtype
        self.span_names, self.page_size, self.source = span_names, page_size, source
        self.pages = PageWriter(f, page_size)
        f.seek(C.DATA_OFFSET)
        self.cursor = 0
        self.rows: list[np.ndarray] = []
        self.count = 0
        self.skipped: list[int] = []
        self.skip_log: list[dict] = []

    def add(self, part) -> None:
        if part.error is not None:
            i, name, detail, tb, *where = part.error  # where: the SampleError's own source (e.g. a shard)
            source = where[0] if where else self.source
            if tb:  # a worker's traceback: the cause, shown once below the message (as concurrent.futures does)
                raise SampleError(source, i, name, detail) from WorkerTraceback(tb)
            raise SampleError(source, i, name, detail)
        for entry in part.skipped:
            self.skipped.append(entry["index"])
            if len(self.skip_log) < 1000:
                self.skip_log.append(entry)
        if part.rows.dtype != self.row_dtype:
            raise ValueError(f"{self.source}: a part's index rows have dtype {part.rows.dtype}, expected "
                             f"{self.row_dtype}")
        rows = part.rows.copy()  # offsets are filled in here
        n_rows = len(rows)
        payloads = part.payloads()
        span_len = [rows[f"{name}.length"] for name in self.span_names]
        for k, payload in zip(range(n_rows), payloads):
            length = int(rows["_length"][k])
            if len(payload) != length:
                raise ValueError(f"{self.source}: record {self.count + k} has {len(payload)} payload bytes, its "
                                 f"index row says {length}")
            start, self.cursor = place_record(self.cursor, length, self.page_size)
            self.pages.pad_to(start)
            off = C.DATA_OFFSET + start
            rows["_offset"][k] = off
            for name, lengths in zip(self.span_names, span_len):
                rows[f"{name}.offset"][k] = off
                off += int(lengths[k])
            self.pages.write(payload)
        self.rows.append(rows)
        self.count += n_rows

    def finish(self, samples_in_source: int, meta: dict, user: dict) -> dict:
        """Write schema, index, page checksums and metadata (``meta`` + source, counts, skipped), the section
        table and the header. Returns ``{"records", "skipped", "dataset_id" (hex), "bytes"}``."""
        if self.count == 0:
            raise ValueError(f"{self.source}: no sample was written ({len(self.skipped)} skipped, "
                             f"{samples_in_source} in the source)")
        index = np.concatenate(self.rows) if self.rows else np.zeros(0, self.row_dtype)
        data_length = self.pages.pos
        crcs = self.pages.finish()
        assert len(crcs) == page_count(data_length, self.page_size)
        schema_bytes = canonical_json(self.schema)
        index_bytes = index.tobytes()
        crc_bytes = crcs.tobytes()
        dataset_id = hashlib.sha256(schema_bytes + index_bytes + crc_bytes).digest()
        lineage = dict(meta, source=self.source, samples_in_source=samples_in_source, skipped=self.skipped,
                       skipped_errors=self.skip_log)
        sections = [
            (C.SECTION_SCHEMA, C.SECTION_FLAG_REQUIRED, schema_bytes),
            (C.SECTION_INDEX, C.SECTION_FLAG_REQUIRED, index_bytes),
            (C.SECTION_PAGE_CHECKSUMS, 0, crc_bytes),
            (C.SECTION_METADATA, 0, canonical_json({"lineage": lineage, "user": user})),
        ]
        file_size = write_tail(self.f, page_size=self.page_size, data_length=data_length, page_count=len(crcs),
                               record_count=self.count, required_features=0, dataset_id=dataset_id,
                               sections=sections)
        return {"records": self.count, "skipped": self.skipped, "dataset_id": dataset_id.hex(), "bytes": file_size}
