"""``open_dataset``: open and validate a pageset file, then read records.

Validation at open follows ``formats/v1.md``: magic -> version and feature bits -> header checksum -> file
size vs sections -> section checksums -> zero padding -> schema -> index bounds. Each step raises its own
:class:`~pageset.format.FormatError` subclass naming the path, section and byte offset. Page checksums are
checked by :meth:`Dataset.verify` (``pageset verify``), not at open: that would read the whole file. The zero
padding (bytes ``[160, data_offset)`` and the alignment gaps around the sections) is checked at open and again
by ``verify()``: it is a few KiB, and no CRC covers it.
Every offset and length taken from the file is checked against the file size before it is used, so a
damaged index can never make a reader (or a Numba kernel fed from it) touch memory outside the file.

Records, pages and sections are read with ``pread`` (``os.preadv``), never through a memory map: a file
truncated or rewritten in place under an open Dataset raises :class:`TruncatedFileError` (naming the byte
range that could not be read) or :class:`FileChangedError` instead of killing the process with SIGBUS, as a
mapped page past the new end of the file would. Only :attr:`Dataset.buffer` (and ``TokenDataset.tokens``)
map the file, on first use, for callers that want zero-copy views and own the file.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import mmap
import os
import threading
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import numpy as np

from ..format import arguments as check
from ..format import constants as C
from ..format.checksum import crc32
from ..format.errors import (
    BadMagicError,
    ChecksumMismatchError,
    FileChangedError,
    FormatError,
    IndexBoundsError,
    SchemaError,
    TruncatedFileError,
    UnsupportedFeatureError,
    UnsupportedVersionError,
)
from ..format.fields import JSON, Bytes, Field, Float, Int, NDArray, RGBImage
from ..format.layout import HEADER, PAGE_CHECKSUM, SECTION_ENTRY
from .remote import local_path, url_scheme
from .token_sections import validate_loss_mask, validate_token_sections

MAX_SECTIONS = 1024
MAX_IMAGE_SIDE = (1 << 31) - 1  # keeps height * width * 3 inside uint64 arithmetic
# A JPEG stores its sides in 16 bits (SOF marker), so a JPEG record claiming more is damaged: refusing it at open
# also keeps a loader from sizing decode buffers for a 2^31 x 2^31 image (found by tools/fuzz.py: an edited
# ``image.height`` made the loader allocate height * width * 3 bytes).
MAX_JPEG_SIDE = 65535
READ_CHUNK = 1 << 22  # bytes per pread when checksumming a page or checking padding (page_size is up to 1 GiB)
REMOTE_HEAD = 1 << 16  # a URL's first request at open: the header and the zero padding up to data_offset
REMOTE_RUN = 8 << 20  # bytes per range request of verify() on a URL


@dataclass(frozen=True)
class EncodedImage:
    """An image as stored: ``data`` (bytes: a JPEG, or ``height*width*3`` raw HWC RGB uint8 bytes), ``height``
    and ``width`` (pixels), ``encoding`` (``"jpeg"`` or ``"raw"``)."""

    data: bytes = dataclass_field(repr=False)
    height: int
    width: int
    encoding: str

    def to_numpy(self) -> np.ndarray:
        """Decode to uint8[height, width, 3] RGB (Pillow for JPEG; a reshape for raw)."""
        if self.encoding == "raw":
            return np.frombuffer(self.data, dtype=np.uint8).reshape(self.height, self.width, 3).copy()
        from PIL import Image

        with Image.open(io.BytesIO(self.data)) as img:
            return np.asarray(img.convert("RGB"))


class Dataset:
    """A validated, read-only pageset file.

    ``len(ds)`` records; ``ds[i]`` -> ``{field: value}``; ``ds.read(i, field)``; ``ds.schema`` (dict),
    ``ds.fields`` (name -> Field), ``ds.dataset_id`` (hex str), ``ds.header`` (dict), ``ds.metadata`` (dict with
    ``lineage`` and ``user``), ``ds.index`` (read-only structured array, one row per record),
    ``ds.page_size``, ``ds.page_count``, ``ds.data_offset``. Use as a context manager or call ``close()``.

    Reads use ``pread``: if the file is truncated or modified in place while it is open, reads raise
    TruncatedFileError / FileChangedError (never SIGBUS); a file replaced by a rename keeps being read whole.
    Page sources build on ``ds.read_into(offset, out)`` and ``ds.check_unchanged()``.

    ``path`` may be a URL (``s3://bucket/key``, ``http(s)://...``, any fsspec protocol; see
    :mod:`pageset.read.remote`): the header, section table and sections are fetched at open (three requests)
    and validated exactly like a local file's; records and pages are then read by range requests, each page's
    CRC-32 checked on arrival, every request pinned to the object's ETag (ObjectChangedError otherwise).
    ``storage_options`` go to the fsspec filesystem (endpoint, credentials); ``request_timeout`` (seconds) and
    ``request_attempts`` bound every request. ``ds.remote`` is the pinned
    :class:`~pageset.read.remote.RemoteFile` (None for a local file).
    """

    def __init__(self, path, storage_options: dict | None = None, *, request_timeout: float = 30.0,
                 request_attempts: int = 5):
        path = local_path(path)
        self._mm, self._file, self.remote = None, None, None
        self._mm_lock = threading.Lock()
        if url_scheme(path) is not None:
            from .remote import RemoteFile, RetryPolicy

            self.path = path
            self.remote = RemoteFile(path, storage_options, RetryPolicy(request_timeout, request_attempts))
        else:
            if storage_options:
                raise ValueError(f"{os.fspath(path)}: storage_options apply to URLs (s3://, http://, ...), "
                                 "not to local paths")
            self.path = os.fspath(path)
            self._file = open(self.path, "rb")
        try:
            try:
                self._open()
            except ChecksumMismatchError:
                if self.remote is None:
                    raise
                self.remote.drop_cached()
                self._open()  # a flipped bit on the wire: read the metadata once more before calling it damaged
        except BaseException:
            self._release()
            raise
        finally:
            if self.remote is not None:
                self.remote.drop_cached()

    # ---- validation ------------------------------------------------------------------------------------
    def _err(self, cls, section, offset, detail):
        return cls(self.path, section, offset, detail)

    def _open(self) -> None:
        if self.remote is not None:
            size, self._mtime_ns = self.remote.size, None
            self.remote.load_range(0, min(size, REMOTE_HEAD))  # header + padding: one request
        else:
            st = os.fstat(self._file.fileno())
            size, self._mtime_ns = st.st_size, st.st_mtime_ns
        self.file_size = size
        head = self._pread(0, min(size, C.HEADER_SIZE))
        if len(head) < len(C.MAGIC):
            raise self._err(TruncatedFileError, "header", 0, f"file is {size} bytes, too short for a pageset header")
        if head[: len(C.MAGIC)] != C.MAGIC:
            raise self._err(
                BadMagicError, "header", 0,
                f"bad magic {head[:8]!r} (expected {C.MAGIC!r}): not a pageset file, or damaged by a text-mode copy",
            )
        if len(head) < C.HEADER_SIZE:
            raise self._err(TruncatedFileError, "header", 0, f"file is {size} bytes, header needs {C.HEADER_SIZE}")
        h = np.frombuffer(head, dtype=HEADER, count=1)[0]
        major, minor = int(h["major"]), int(h["minor"])
        if major != C.FORMAT_MAJOR:
            raise self._err(
                UnsupportedVersionError, "header", 8,
                f"format version {major}.{minor} is not supported (this pageset reads {C.FORMAT_MAJOR}.x); "
                "upgrade pageset or rewrite the file",
            )
        unknown = int(h["required_features"]) & ~C.KNOWN_REQUIRED_FEATURES
        if unknown:
            raise self._err(
                UnsupportedFeatureError, "header", 24,
                f"required feature bits {unknown:#x} are unknown to this pageset version; upgrade pageset",
            )
        stored_crc = int(h["header_crc"])
        if crc32(head[: C.HEADER_SIZE - 4]) != stored_crc:
            raise self._err(ChecksumMismatchError, "header", C.HEADER_SIZE - 4, "header CRC-32 mismatch")
        self.header = {name: (bytes(h[name]).hex() if h[name].shape else int(h[name])) for name in HEADER.names}
        self.header.pop("reserved")
        self.header["magic"] = bytes(h["magic"])
        self.version = (major, minor)
        self.page_size = int(h["page_size"])
        self.record_count = int(h["record_count"])
        self.data_offset = int(h["data_offset"])
        self.data_length = int(h["data_length"])
        self.page_count = int(h["page_count"])
        self.dataset_id = bytes(h["dataset_id"]).hex()
        self._check_geometry(h, size)
        sections = self._read_section_table(h, size)
        self._check_padding()
        self.schema = self._read_schema(sections)
        self.index = self._read_index(sections)
        self._page_crcs = self._read_page_crcs(sections, h)
        self.metadata = self._read_json_section(sections, C.SECTION_METADATA, "metadata", default={})
        self.tokens_info = None  # token files (format 1.1): see pageset.read.tokens
        self.loss_mask_bits = None  # token files with a loss mask: uint8[ceil(count / 8)], LSB first
        if int(h["required_features"]) & C.REQUIRED_TOKENS or any(f.kind == "tokens" for f in self.fields.values()):
            self.tokens_info, self.doc_offsets = validate_token_sections(self, sections)
            self.loss_mask_bits = validate_loss_mask(self, sections, self.tokens_info, self.data_length //
                                                     np.dtype(self.tokens_info["dtype"]).itemsize)
        elif int(h["required_features"]) & C.REQUIRED_LOSS_MASK:
            raise self._err(FormatError, "header", 24, "the 'loss_mask' feature bit is set on a file without tokens")
        self.page_reader = None
        if self.remote is not None:
            from .remote import PageReader

            self.page_reader = PageReader(self.remote, self.data_offset, self.data_length, self.page_size,
                                          self._page_crcs)
            self._recent: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
            self._recent_lock = threading.Lock()

    def _check_geometry(self, h, size) -> None:
        if int(h["file_size"]) != size:
            cls = TruncatedFileError if size < int(h["file_size"]) else FormatError
            raise self._err(cls, "header", 88, f"header says {int(h['file_size'])} bytes, the file has {size}")
        ps = self.page_size
        if ps < C.MIN_PAGE_SIZE or ps > C.MAX_PAGE_SIZE or ps & (ps - 1):
            raise self._err(FormatError, "header", 16, f"page_size {ps} is not a power of two in [4 KiB, 1 GiB]")
        if self.data_offset < C.HEADER_SIZE or self.data_offset % C.DATA_ALIGN:
            raise self._err(FormatError, "header", 48, f"data_offset {self.data_offset} is not 4096-aligned")
        if self.data_length > size - self.data_offset:
            raise self._err(TruncatedFileError, "header", 56, f"data area ends past the end of the file ({size})")
        if self.page_count != -(-self.data_length // ps):
            raise self._err(FormatError, "header", 64, f"page_count {self.page_count} does not match data_length")

    def _read_section_table(self, h, size) -> dict:
        off, count = int(h["section_table_offset"]), int(h["section_count"])
        if count > MAX_SECTIONS or off < self.data_offset + self.data_length or off > size - count * SECTION_ENTRY.itemsize:
            raise self._err(TruncatedFileError, "section table", off, f"{count} entries do not fit in the file")
        if self.remote is not None:  # the table and every section follow the data: one request for all
            self.remote.load_range(self.data_offset + self.data_length, size)
        raw = self._pread(off, count * SECTION_ENTRY.itemsize)
        if crc32(raw) != int(h["section_table_crc"]):
            raise self._err(ChecksumMismatchError, "section table", off, "section table CRC-32 mismatch")
        table = np.frombuffer(raw, dtype=SECTION_ENTRY)
        self._section_entries = table
        sections = {}
        data_end = self.data_offset + self.data_length
        for k, e in enumerate(table):
            kind, s_off, s_len = int(e["kind"]), int(e["offset"]), int(e["length"])
            name = C.SECTION_NAMES.get(kind, f"section kind {kind}")
            entry_at = off + k * SECTION_ENTRY.itemsize
            if s_off < data_end or s_len > size - s_off:
                raise self._err(TruncatedFileError, name, entry_at, f"section [{s_off}, +{s_len}) lies outside the file")
            if kind not in C.SECTION_NAMES:
                if int(e["flags"]) & C.SECTION_FLAG_REQUIRED:
                    raise self._err(UnsupportedFeatureError, name, entry_at, "unknown required section; upgrade pageset")
                continue
            if kind in sections:
                raise self._err(FormatError, name, entry_at, "section appears twice")
            payload = self._pread(s_off, s_len)
            if crc32(payload) != int(e["crc"]):
                raise self._err(ChecksumMismatchError, name, s_off, f"{name} section CRC-32 mismatch")
            sections[kind] = (s_off, payload)
        for kind in (C.SECTION_SCHEMA, C.SECTION_INDEX):
            if kind not in sections:
                raise self._err(FormatError, C.SECTION_NAMES[kind], None, "required section is missing")
        return sections

    def _check_padding(self) -> None:
        """Every byte outside the header, the data area, the sections and the section table is zero padding
        (``formats/v1.md`` section 1): no CRC covers it, so open and ``verify()`` read it (a few KiB)."""
        size = self.file_size
        table_off, count = int(self.header["section_table_offset"]), int(self.header["section_count"])
        covered = [(0, C.HEADER_SIZE), (self.data_offset, self.data_offset + self.data_length),
                   (table_off, table_off + count * SECTION_ENTRY.itemsize)]
        covered += [(int(e["offset"]), int(e["offset"]) + int(e["length"])) for e in self._section_entries]
        pos = 0
        for start, stop in sorted(covered) + [(size, size)]:
            for off in range(pos, start, READ_CHUNK):  # the gap [pos, start)
                chunk = np.frombuffer(self._pread(off, min(READ_CHUNK, start - off)), dtype=np.uint8)
                bad = np.flatnonzero(chunk)
                if bad.size:
                    self.check_unchanged()  # a change under the reader, not damage at rest
                    at = off + int(bad[0])
                    raise self._err(FormatError, "padding", at,
                                    f"byte {at} is {int(chunk[bad[0]]):#04x} in the zero padding [{pos}, {start}): "
                                    "the file is damaged; rewrite it or restore a copy")
            pos = max(pos, stop)

    def _read_json_section(self, sections, kind, name, default=None):
        if kind not in sections:
            return default
        off, payload = sections[kind]
        try:
            return json.loads(payload.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            cls = SchemaError if kind == C.SECTION_SCHEMA else FormatError
            raise self._err(cls, name, off, f"not valid UTF-8 JSON: {exc}") from None

    def _read_schema(self, sections) -> dict:
        from ..format.schema import parse_schema

        off, payload = sections[C.SECTION_SCHEMA]
        if len(payload) > C.MAX_SCHEMA_BYTES:
            raise self._err(SchemaError, "schema", off, f"schema is {len(payload)} bytes (limit {C.MAX_SCHEMA_BYTES})")
        doc = self._read_json_section(sections, C.SECTION_SCHEMA, "schema")
        try:
            self.fields, self._row_dtype = parse_schema(doc)
        except (ValueError, TypeError) as exc:
            raise self._err(SchemaError, "schema", off, str(exc)) from None
        return doc

    def _read_index(self, sections) -> np.ndarray:
        off, payload = sections[C.SECTION_INDEX]
        want = self.record_count * self._row_dtype.itemsize
        if len(payload) != want:
            raise self._err(
                IndexBoundsError, "index", off,
                f"index is {len(payload)} bytes, expected {self.record_count} rows x {self._row_dtype.itemsize}",
            )
        index = np.frombuffer(payload, dtype=self._row_dtype)
        self._check_index(index, off)
        return index

    def _check_index(self, index: np.ndarray, off: int) -> None:
        """Vectorised bounds checks; the first bad row is named (sample index, field, byte offset of the row)."""
        lo = np.uint64(self.data_offset)
        hi = np.uint64(self.data_offset + self.data_length)
        rec_off, rec_len = index["_offset"], index["_length"]

        def fail(mask, what):
            bad = np.flatnonzero(mask)
            if bad.size:
                i = int(bad[0])
                raise self._err(
                    IndexBoundsError, "index", off + i * self._row_dtype.itemsize,
                    f"record {i}: {what} ({bad.size} records affected)",
                )

        fail((rec_off < lo) | (rec_off > hi) | (rec_len > hi - np.minimum(rec_off, hi)),
             "record bytes lie outside the data area")
        if index.size > 1:
            fail(np.concatenate([[False], rec_off[1:] < rec_off[:-1]]), "record offsets are not in sample order")
        rec_end = rec_off + rec_len
        for name, field in self.fields.items():
            if field.inline:
                continue
            f_off, f_len = index[f"{name}.offset"], index[f"{name}.length"]
            fail((f_off < rec_off) | (f_off > rec_end) | (f_len > rec_end - np.minimum(f_off, rec_end)),
                 f"field {name!r} bytes lie outside the record")
            if isinstance(field, RGBImage):
                h, w, enc = index[f"{name}.height"], index[f"{name}.width"], index[f"{name}.encoding"]
                fail((h == 0) | (w == 0) | (h > MAX_IMAGE_SIDE) | (w > MAX_IMAGE_SIDE), f"field {name!r}: bad image size")
                fail(~np.isin(enc, list(C.ENCODING_NAMES)), f"field {name!r}: unknown image encoding")
                fail((enc == C.ENCODING_JPEG) & ((h > MAX_JPEG_SIDE) | (w > MAX_JPEG_SIDE)),
                     f"field {name!r}: a JPEG side is larger than {MAX_JPEG_SIDE} pixels")
                raw = enc == C.ENCODING_RAW
                fail(raw & (f_len != h.astype(np.uint64) * w.astype(np.uint64) * np.uint64(3)),
                     f"field {name!r}: raw image length is not height*width*3")
            elif isinstance(field, NDArray):
                fail(f_len != np.uint64(field.nbytes), f"field {name!r}: array length is not {field.nbytes} bytes")

    def _read_page_crcs(self, sections, h) -> np.ndarray | None:
        if C.SECTION_PAGE_CHECKSUMS not in sections:
            if int(h["optional_features"]) & C.OPTIONAL_PAGE_CHECKSUMS:
                raise self._err(FormatError, "page_checksums", None, "header announces page checksums; none found")
            return None
        off, payload = sections[C.SECTION_PAGE_CHECKSUMS]
        if len(payload) != self.page_count * PAGE_CHECKSUM.itemsize:
            raise self._err(FormatError, "page_checksums", off, f"expected {self.page_count} CRCs, got {len(payload) // 4}")
        return np.frombuffer(payload, dtype=PAGE_CHECKSUM)

    # ---- access ----------------------------------------------------------------------------------------
    def _pread(self, offset: int, length: int) -> bytes:
        if self.remote is not None:
            data = self.remote.pread(offset, length)
            if len(data) != length:
                raise self._err(TruncatedFileError, "file", offset, f"short read: {len(data)} of {length} bytes")
            return data
        out = bytearray(length)
        self.read_into(offset, out)
        return bytes(out)

    def _span(self, off: int, length: int) -> np.ndarray:
        """URL only: uint8[length], bytes ``[off, off + length)`` of the data area from CRC-checked pages (the
        last few pages are kept, so reading records in order costs one request per page)."""
        if length == 0:
            return np.empty(0, np.uint8)
        ps, rel = self.page_size, off - self.data_offset
        k0, k1 = rel // ps, (rel + length - 1) // ps + 1
        with self._recent_lock:
            have = {k: self._recent[k] for k in range(k0, k1) if k in self._recent}
        missing = [k for k in range(k0, k1) if k not in have]
        if missing:
            have.update(zip(range(missing[0], missing[-1] + 1), self.page_reader.read_run(missing[0], missing[-1] + 1)))
        pages = [have[k] for k in range(k0, k1)]
        with self._recent_lock:
            for k in range(k0, k1):
                self._recent[k] = pages[k - k0]
                self._recent.move_to_end(k)
            while len(self._recent) > 8:
                self._recent.popitem(last=False)
        data = pages[0] if len(pages) == 1 else np.concatenate(pages)
        lo = rel - k0 * ps
        return data[lo : lo + length]

    def read_into(self, offset: int, out) -> None:
        """Fill ``out`` (a writable contiguous buffer: bytearray, uint8 numpy array) with the file's bytes
        ``[offset, offset + len(out))`` using ``pread``; thread-safe, releases the GIL.

        Raises TruncatedFileError naming the file and the byte range when the file ends first (it was truncated
        or rewritten in place after it was opened).
        """
        view = memoryview(out).cast("B")
        if self.remote is not None:
            view[:] = self._span(offset, len(view)).tobytes()
            return
        length, done, fd = len(view), 0, self._file.fileno()
        while done < length:  # a single read returns at most ~2 GiB on Linux
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                now = os.fstat(fd).st_size
                raise self._err(
                    TruncatedFileError, "file", offset,
                    f"short read of bytes [{offset}, {offset + length}): {done} bytes read; the file shrank "
                    f"to {now} bytes ({self.file_size} when opened): it was truncated or rewritten in place while "
                    "being read. Replace files by renaming a new one over them, as write_dataset does")
            done += n

    def check_unchanged(self) -> None:
        """Raise if the file changed in place since it was opened (one ``fstat``, ~1 us).

        Call it after reading: bytes read before a call that passes are the file as opened (a write updates
        the file's mtime before its data). Raises TruncatedFileError (the file shrank) or FileChangedError
        (another size, or a new modification time: rewritten, overwritten or touched).
        """
        if self.remote is not None:
            return  # a URL: every request carries the pinned ETag (ObjectChangedError)
        st = os.fstat(self._file.fileno())
        if st.st_size == self.file_size and st.st_mtime_ns == self._mtime_ns:
            return
        if st.st_size < self.file_size:
            raise self._err(
                TruncatedFileError, "file", None,
                f"the file shrank to {st.st_size} bytes ({self.file_size} when opened): it was truncated or "
                "rewritten in place while being read. Replace files by renaming a new one over them, as "
                "write_dataset does")
        raise self._err(
            FileChangedError, "file", None,
            f"the file was modified in place after it was opened ({self.file_size} -> {st.st_size} bytes, "
            "modification time changed): bytes read from it may mix old and new content. Replace files by "
            "renaming a new one over them, as write_dataset does, and open the new file")

    def _read_checked(self, offset: int, length: int) -> bytes:
        if self.remote is not None:
            return self._span(offset, length).tobytes()
        data = self._pread(offset, length)
        self.check_unchanged()
        return data

    def __len__(self) -> int:
        return self.record_count

    def _row(self, i: int):
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"record indices are ints, got {type(i).__name__}")
        n = self.record_count
        if not -n <= i < n:
            raise IndexError(f"{self.path}: record {i} is out of range for {n} records")
        return self.index[int(i) % n]

    def read(self, i: int, name: str):
        """The decoded value of field ``name`` of record ``i``.

        Int/Float -> Python int/float (bool for a bool Int); NDArray -> a new array of the field's dtype and
        shape; Bytes -> bytes; JSON -> the value; RGBImage -> :class:`EncodedImage`.
        Raises IndexError (out-of-range i) or KeyError (unknown field).
        """
        if name not in self.fields:
            raise KeyError(f"{self.path}: no field {name!r}; fields are {list(self.fields)}")
        return self._decode(self._row(i), name, self.fields[name])

    def _bytes(self, off: int, length: int) -> bytes:
        return self._read_checked(off, length)

    def _decode(self, row, name: str, field: Field):
        if isinstance(field, (Int, Float)):
            return row[name].item()
        off, length = int(row[f"{name}.offset"]), int(row[f"{name}.length"])
        if isinstance(field, RGBImage):
            enc = C.ENCODING_NAMES[int(row[f"{name}.encoding"])]
            return EncodedImage(self._bytes(off, length), int(row[f"{name}.height"]), int(row[f"{name}.width"]), enc)
        if isinstance(field, NDArray):
            dt = np.dtype(field.dtype).newbyteorder("<")
            return np.frombuffer(self._bytes(off, length), dtype=dt).reshape(field.shape).astype(field.dtype)
        if isinstance(field, Bytes):
            return self._bytes(off, length)
        if isinstance(field, JSON):
            return json.loads(self._bytes(off, length).decode("utf-8"))
        raise TypeError(f"unknown field type {type(field).__name__}")

    def __getitem__(self, i: int) -> dict:
        row = self._row(i)
        return {name: self._decode(row, name, field) for name, field in self.fields.items()}

    def __iter__(self):
        for i in range(self.record_count):
            yield self[i]

    @property
    def buffer(self) -> np.ndarray:
        """The whole file as a read-only uint8 array over a memory map, made on first use (valid until
        ``close()``). Zero-copy, but unguarded: if the file is truncated or rewritten in place while the map is
        in use, touching a page past its new end kills the process with SIGBUS (like SQLite with
        ``mmap_size``). Only use it on files nobody modifies in place; ``ds[i]``, ``read``, ``verify`` and the
        Loader never use it. Raises ValueError for a URL (no whole-file buffer)."""
        if self.remote is not None:
            raise ValueError(f"{self.path}: a remote dataset has no whole-file buffer; read records with ds[i] / "
                             "ds.read(i, field) or load it with Loader")
        with self._mm_lock:
            if self._mm is None:
                if self._file.closed:
                    raise ValueError(f"{self.path}: the dataset is closed")
                self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if self.file_size else b""
            return np.frombuffer(self._mm, dtype=np.uint8)

    def fileno(self) -> int:
        """The open file's descriptor (valid until ``close()``). Raises ValueError for a URL."""
        if self.remote is not None:
            raise ValueError(f"{self.path}: a remote dataset has no file descriptor")
        return self._file.fileno()

    @property
    def page_checksums(self) -> np.ndarray | None:
        """uint32[page_count] stored CRC-32 of each page, or None when the file has none."""
        return self._page_crcs

    def check_page(self, k: int, sample: int | None = None) -> None:
        """Recompute page ``k``'s CRC-32; raise ChecksumMismatchError naming the page, its byte offset and
        ``sample`` (the sample index that needed it) on a mismatch."""
        start = self.data_offset + k * self.page_size
        if self._page_crc(k) != int(self._page_crcs[k]):
            self.check_unchanged()  # a change under the reader, not damage at rest
            who = f" (needed by sample {sample})" if sample is not None else ""
            raise self._err(ChecksumMismatchError, f"page {k}", start, f"page CRC-32 mismatch{who}; the file is "
                            "damaged: rewrite it or restore a copy")

    def _page_crc(self, k: int, scratch: np.ndarray | None = None) -> int:
        """CRC-32 of page ``k``'s stored bytes, read with pread in chunks of at most READ_CHUNK bytes."""
        start = self.data_offset + k * self.page_size
        length = min(self.page_size, self.data_offset + self.data_length - start)
        if self.remote is not None:  # the stored bytes as they are (not through the CRC-checking page reader)
            return crc32(np.frombuffer(self.remote.read(start, start + length), dtype=np.uint8))
        if scratch is None:
            scratch = np.empty(min(length, READ_CHUNK), dtype=np.uint8)
        crc = 0
        for pos in range(0, length, scratch.shape[0]):
            chunk = scratch[: min(scratch.shape[0], length - pos)]
            self.read_into(start + pos, chunk)
            crc = crc32(chunk, crc)
        return crc

    def _stored_page_crcs(self, scratch: np.ndarray):
        """Yield ``(k, CRC-32 of page k as stored)`` for every page: pread chunks, or for a URL range requests of
        up to REMOTE_RUN bytes (many pages each)."""
        if self.remote is None:
            for k in range(self.page_count):
                yield k, self._page_crc(k, scratch)
            return
        ps, end = self.page_size, self.data_offset + self.data_length
        step = max(1, REMOTE_RUN // ps)
        for a in range(0, self.page_count, step):
            b = min(self.page_count, a + step)
            lo = self.data_offset + a * ps
            run = np.frombuffer(self.remote.read(lo, min(end, self.data_offset + b * ps)), dtype=np.uint8)
            for k in range(a, b):
                rel = k * ps - a * ps
                yield k, crc32(run[rel : rel + ps])

    def record_pages(self) -> np.ndarray:
        """int64[N]: the page holding each record's first byte (zero-length records: the page of their offset,
        clamped to the last page). With no pages at all (only scalar fields), every record is on page 0."""
        if self.page_count == 0:
            return np.zeros(self.record_count, dtype=np.int64)
        pages = (self.index["_offset"].astype(np.int64) - self.data_offset) // self.page_size
        return np.minimum(pages, self.page_count - 1)

    def records_per_page(self) -> np.ndarray:
        """int64[max(page_count, 1)]: records whose first byte lies in each page (records are in page order)."""
        return np.bincount(self.record_pages(), minlength=max(self.page_count, 1)).astype(np.int64)

    def verify(self) -> None:
        """Recompute every page CRC-32 and the dataset id, and re-check the zero padding.

        Raises ChecksumMismatchError naming the first bad page, its byte offset and the sample indices stored
        in it; FormatError for a non-zero padding byte or a file without page checksums; TruncatedFileError /
        FileChangedError for a file changed in place since it was opened.
        """
        if self._page_crcs is None:
            raise self._err(FormatError, "page_checksums", None, "this file has no page checksums to verify")
        if self.remote is not None:  # the padding lies in the head and the tail: two requests, as at open
            try:
                self.remote.load_range(0, min(self.file_size, REMOTE_HEAD))
                self.remote.load_range(self.data_offset + self.data_length, self.file_size)
                self._check_padding()
            finally:
                self.remote.drop_cached()
        else:
            self._check_padding()
        ps = self.page_size
        scratch = np.empty(min(ps, READ_CHUNK), dtype=np.uint8)
        for k, crc in self._stored_page_crcs(scratch):
            start = self.data_offset + k * ps
            if crc != int(self._page_crcs[k]):
                self.check_unchanged()  # a change under the reader, not damage at rest
                if self.tokens_info is not None:  # a token file: no records; say which tokens and documents
                    size = np.dtype(self.tokens_info["dtype"]).itemsize
                    t0 = k * ps // size
                    t1 = min((k + 1) * ps, self.data_length) // size
                    offs = self.doc_offsets.astype(np.int64)
                    d0 = max(0, int(np.searchsorted(offs, t0, side="right")) - 1)
                    d1 = max(d0, int(np.searchsorted(offs, t1, side="left")) - 1)
                    raise self._err(
                        ChecksumMismatchError, f"page {k}", start,
                        f"page CRC-32 mismatch; this page holds tokens [{t0}, {t1}) (documents {d0}..{d1})",
                    )
                pages = self.record_pages()
                ends = (self.index["_offset"] + self.index["_length"]).astype(np.int64)
                hit = np.flatnonzero((self.index["_offset"].astype(np.int64) < start + ps) & (ends > start))
                hit = np.union1d(hit, np.flatnonzero(pages == k))
                shown = ", ".join(map(str, hit[:20])) + (" ..." if hit.size > 20 else "")
                raise self._err(
                    ChecksumMismatchError, f"page {k}", start,
                    f"page CRC-32 mismatch; samples stored in this page: [{shown}]",
                )
        schema_bytes = _canonical(self.schema)
        extra = self.doc_offsets.tobytes() if self.tokens_info is not None else b""  # token files (1.1)
        if self.tokens_info is not None and self.loss_mask_bits is not None:
            extra += self.loss_mask_bits.tobytes()  # token files with a loss mask (1.1, section 10.1)
        digest = hashlib.sha256(schema_bytes + self.index.tobytes() + self._page_crcs.tobytes() + extra).hexdigest()
        self.check_unchanged()
        if digest != self.dataset_id:
            raise self._err(ChecksumMismatchError, "header", 96, "dataset id does not match the file's content")

    def close(self) -> None:
        """Release the mmap and the file. Arrays obtained from ``buffer`` must not be used afterwards."""
        if isinstance(getattr(self, "_mm", None), mmap.mmap):
            try:
                self._mm.close()
            except BufferError:  # a caller still holds a view; the mapping is freed with the last view
                pass
            self._mm = None
        self._release()

    def _release(self) -> None:
        if self._file is not None:
            self._file.close()
        if self.remote is not None:
            self.remote.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}: {f.kind}" for n, f in self.fields.items())
        return f"Dataset({self.path!r}, records={self.record_count}, fields={{{fields}}}, id={self.dataset_id[:12]})"


def _canonical(doc) -> bytes:
    from ..format.schema import canonical_json

    return canonical_json(doc)


def check_path(path) -> None:
    """TypeError unless ``path`` is a str or os.PathLike (an int would be taken as an open file descriptor)."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be the pageset file's path or URL (str or os.PathLike), got {path!r} "
                        f"({type(path).__name__})")


def check_open_arguments(path, storage_options, request_timeout, request_attempts) -> None:
    """The checks shared by open_dataset and open_tokens: TypeError / ValueError naming the argument."""
    check_path(path)
    check.mapping("storage_options", storage_options, optional=True)
    check.real("request_timeout", request_timeout, low=0, low_open=True)
    check.integer("request_attempts", request_attempts, minimum=1)
