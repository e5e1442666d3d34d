"""Open-time validation of a pageset file (``formats/v1.md``), in order: magic -> version and feature bits ->
header checksum -> file size vs sections -> section checksums -> zero padding -> schema -> index bounds. Each step
raises its own :class:`~pageset.format.FormatError` subclass naming the path, section and byte offset. Every
offset and length taken from the file is checked against the file size before it is used, so a damaged index
can never make a reader (or a Numba kernel fed from it) touch memory outside the file.

The functions take the :class:`~pageset.read.reader.Dataset` being opened and read through its ``_io`` (a local
file or a URL: :mod:`pageset.read.file_access`, the same methods), so a local file and a URL are validated by
the same code.
"""

from __future__ import annotations

import json

import numpy as np

from ..format import constants as C
from ..format.checksum import crc32
from ..format.errors import (
    BadMagicError,
    ChecksumMismatchError,
    FormatError,
    IndexBoundsError,
    SchemaError,
    TruncatedFileError,
    UnsupportedFeatureError,
    UnsupportedVersionError,
)
from ..format.fields import NDArray, RGBImage, RGBImages, TokenIds
from ..format.layout import IMAGES_ENTRY
from ..format.layout import HEADER, PAGE_CHECKSUM, SECTION_ENTRY
from .token_sections import validate_loss_mask, validate_token_sections

MAX_SECTIONS = 1024
MAX_IMAGE_SIDE = (1 << 31) - 1  # keeps height * width * 3 inside uint64 arithmetic
# A JPEG stores its sides in 16 bits (SOF marker), so a JPEG record claiming more is damaged: refusing it at open
# also keeps a loader from sizing decode buffers for a 2^31 x 2^31 image (found by tools/fuzz.py: an edited
# ``image.height`` made the loader allocate height * width * 3 bytes).
MAX_JPEG_SIDE = 65535
READ_CHUNK = 1 << 22  # bytes per pread when checking padding (page_size is up to 1 GiB)


def read_metadata(ds) -> None:
    """Read and validate ``ds``'s header, section table, padding, schema, index, page CRCs, metadata and (token
    files) token sections through ``ds._io`` (a :class:`~pageset.read.file_access.LocalFile` or
    :class:`~pageset.read.file_access.URLFile`), setting the Dataset's attributes; the first violation raises its
    FormatError subclass naming the path, section and byte offset (``formats/v1.md``)."""
    size = ds.file_size = ds._io.begin_open()  # (a URL: the header and the padding up to data_offset, one request)
    head = ds._io.pread(0, min(size, C.HEADER_SIZE))
    if len(head) < len(C.MAGIC):
        raise ds._err(TruncatedFileError, "header", 0, f"file is {size} bytes, too short for a pageset header")
    if head[: len(C.MAGIC)] != C.MAGIC:
        raise ds._err(
            BadMagicError, "header", 0,
            f"bad magic {head[:8]!r} (expected {C.MAGIC!r}): not a pageset file, or damaged by a text-mode copy",
        )
    if len(head) < C.HEADER_SIZE:
        raise ds._err(TruncatedFileError, "header", 0, f"file is {size} bytes, header needs {C.HEADER_SIZE}")
    h = np.frombuffer(head, dtype=HEADER, count=1)[0]
    major, minor = int(h["major"]), int(h["minor"])
    if major != C.FORMAT_MAJOR:
        raise ds._err(
            UnsupportedVersionError, "header", 8,
            f"format version {major}.{minor} is not supported (this pageset reads {C.FORMAT_MAJOR}.x); "
            "upgrade pageset or rewrite the file",
        )
    unknown = int(h["required_features"]) & ~C.KNOWN_REQUIRED_FEATURES
    if unknown:
        raise ds._err(
            UnsupportedFeatureError, "header", 24,
            f"required feature bits {unknown:#x} are unknown to this pageset version; upgrade pageset",
        )
    stored_crc = int(h["header_crc"])
    if crc32(head[: C.HEADER_SIZE - 4]) != stored_crc:
        raise ds._err(ChecksumMismatchError, "header", C.HEADER_SIZE - 4, "header CRC-32 mismatch")
    ds.header = {name: (bytes(h[name]).hex() if h[name].shape else int(h[name])) for name in HEADER.names}
    ds.header.pop("reserved")
    ds.header["magic"] = bytes(h["magic"])
    ds.version = (major, minor)
    ds.page_size = int(h["page_size"])
    ds.record_count = int(h["record_count"])
    ds.data_offset = int(h["data_offset"])
    ds.data_length = int(h["data_length"])
    ds.page_count = int(h["page_count"])
    ds.dataset_id = bytes(h["dataset_id"]).hex()
    check_geometry(ds, h, size)
    sections = read_section_table(ds, h, size)
    check_padding(ds)
    ds.schema = read_schema(ds, sections)
    ds.index = read_index(ds, sections)
    ds._page_crcs = read_page_crcs(ds, sections, h)
    ds.metadata = read_json_section(ds, sections, C.SECTION_METADATA, "metadata", default={})
    ds.tokens_info = None  # token files (format 1.1): see pageset.read.tokens
    ds.loss_mask_bits = None  # token files with a loss mask: uint8[ceil(count / 8)], LSB first
    if int(h["required_features"]) & C.REQUIRED_TOKENS or any(f.kind == "tokens" for f in ds.fields.values()):
        ds.tokens_info, ds.doc_offsets = validate_token_sections(ds, sections)
        ds.loss_mask_bits = validate_loss_mask(ds, sections, ds.tokens_info, ds.data_length //
                                               np.dtype(ds.tokens_info["dtype"]).itemsize)
    elif int(h["required_features"]) & C.REQUIRED_LOSS_MASK:
        raise ds._err(FormatError, "header", 24, "the 'loss_mask' feature bit is set on a file without tokens")
    ds._io.attach(ds.data_offset, ds.data_length, ds.page_size, ds._page_crcs)


def check_geometry(ds, h, size) -> None:
    if int(h["file_size"]) != size:
        cls = TruncatedFileError if size < int(h["file_size"]) else FormatError
        raise ds._err(cls, "header", 88, f"header says {int(h['file_size'])} bytes, the file has {size}")
    ps = ds.page_size
    if ps < C.MIN_PAGE_SIZE or ps > C.MAX_PAGE_SIZE or ps & (ps - 1):
        raise ds._err(FormatError, "header", 16, f"page_size {ps} is not a power of two in [4 KiB, 1 GiB]")
    if ds.data_offset < C.HEADER_SIZE or ds.data_offset % C.DATA_ALIGN:
        raise ds._err(FormatError, "header", 48, f"data_offset {ds.data_offset} is not 4096-aligned")
    if ds.data_length > size - ds.data_offset:
        raise ds._err(TruncatedFileError, "header", 56, f"data area ends past the end of the file ({size})")
    if ds.page_count != -(-ds.data_length // ps):
        raise ds._err(FormatError, "header", 64, f"page_count {ds.page_count} does not match data_length")


def read_section_table(ds, h, size) -> dict:
    off, count = int(h["section_table_offset"]), int(h["section_count"])
    if count > MAX_SECTIONS or off < ds.data_offset + ds.data_length or off > size - count * SECTION_ENTRY.itemsize:
        raise ds._err(TruncatedFileError, "section table", off, f"{count} entries do not fit in the file")
    ds._io.load_range(ds.data_offset + ds.data_length, size)  # (a URL: the table and the sections, one request)
    raw = ds._io.pread(off, count * SECTION_ENTRY.itemsize)
    if crc32(raw) != int(h["section_table_crc"]):
        raise ds._err(ChecksumMismatchError, "section table", off, "section table CRC-32 mismatch")
    table = np.frombuffer(raw, dtype=SECTION_ENTRY)
    ds._section_entries = table
    sections = {}
    data_end = ds.data_offset + ds.data_length
    for k, e in enumerate(table):
        kind, s_off, s_len = int(e["kind"]), int(e["offset"]), int(e["length"])
        name = C.SECTION_NAMES.get(kind, f"section kind {kind}")
        entry_at = off + k * SECTION_ENTRY.itemsize
        if s_off < data_end or s_len > size - s_off:
            raise ds._err(TruncatedFileError, name, entry_at, f"section [{s_off}, +{s_len}) lies outside the file")
        if kind not in C.SECTION_NAMES:
            if int(e["flags"]) & C.SECTION_FLAG_REQUIRED:
                raise ds._err(UnsupportedFeatureError, name, entry_at, "unknown required section; upgrade pageset")
            continue
        if kind in sections:
            raise ds._err(FormatError, name, entry_at, "section appears twice")
        payload = ds._io.pread(s_off, s_len)
        if crc32(payload) != int(e["crc"]):
            raise ds._err(ChecksumMismatchError, name, s_off, f"{name} section CRC-32 mismatch")
        sections[kind] = (s_off, payload)
    for kind in (C.SECTION_SCHEMA, C.SECTION_INDEX):
        if kind not in sections:
            raise ds._err(FormatError, C.SECTION_NAMES[kind], None, "required section is missing")
    return sections


def check_padding(ds) -> None:
    """Every byte outside the header, the data area, the sections and the section table is zero padding
    (``formats/v1.md`` section 1): no CRC covers it, so open and ``verify()`` read it (a few KiB)."""
    size = ds.file_size
    table_off, count = int(ds.header["section_table_offset"]), int(ds.header["section_count"])
    covered = [(0, C.HEADER_SIZE), (ds.data_offset, ds.data_offset + ds.data_length),
               (table_off, table_off + count * SECTION_ENTRY.itemsize)]
    covered += [(int(e["offset"]), int(e["offset"]) + int(e["length"])) for e in ds._section_entries]
    pos = 0
    for start, stop in sorted(covered) + [(size, size)]:
        for off in range(pos, start, READ_CHUNK):  # the gap [pos, start)
            chunk = np.frombuffer(ds._io.pread(off, min(READ_CHUNK, start - off)), dtype=np.uint8)
            bad = np.flatnonzero(chunk)
            if bad.size:
                ds.check_unchanged()  # a change under the reader, not damage at rest
                at = off + int(bad[0])
                raise ds._err(FormatError, "padding", at,
                                f"byte {at} is {int(chunk[bad[0]]):#04x} in the zero padding [{pos}, {start}): "
                                "the file is damaged; rewrite it or restore a copy")
        pos = max(pos, stop)


def read_json_section(ds, sections, kind, name, default=None):
    if kind not in sections:
        return default
    off, payload = sections[kind]
    try:
        return json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        cls = SchemaError if kind == C.SECTION_SCHEMA else FormatError
        raise ds._err(cls, name, off, f"not valid UTF-8 JSON: {exc}") from None


def read_schema(ds, sections) -> dict:
    from ..format.schema import parse_schema

    off, payload = sections[C.SECTION_SCHEMA]
    if len(payload) > C.MAX_SCHEMA_BYTES:
        raise ds._err(SchemaError, "schema", off, f"schema is {len(payload)} bytes (limit {C.MAX_SCHEMA_BYTES})")
    doc = read_json_section(ds, sections, C.SECTION_SCHEMA, "schema")
    try:
        ds.fields, ds._row_dtype = parse_schema(doc)
    except (ValueError, TypeError) as exc:
        raise ds._err(SchemaError, "schema", off, str(exc)) from None
    return doc


def read_index(ds, sections) -> np.ndarray:
    off, payload = sections[C.SECTION_INDEX]
    want = ds.record_count * ds._row_dtype.itemsize
    if len(payload) != want:
        raise ds._err(
            IndexBoundsError, "index", off,
            f"index is {len(payload)} bytes, expected {ds.record_count} rows x {ds._row_dtype.itemsize}",
        )
    index = np.frombuffer(payload, dtype=ds._row_dtype)
    check_index(ds, index, off)
    return index


def check_index(ds, index: np.ndarray, off: int) -> None:
    """Vectorised bounds checks; the first bad row is named (sample index, field, byte offset of the row)."""
    lo = np.uint64(ds.data_offset)
    hi = np.uint64(ds.data_offset + ds.data_length)
    rec_off, rec_len = index["_offset"], index["_length"]

    def fail(mask, what):
        bad = np.flatnonzero(mask)
        if bad.size:
            i = int(bad[0])
            raise ds._err(
                IndexBoundsError, "index", off + i * ds._row_dtype.itemsize,
                f"record {i}: {what} ({bad.size} records affected)",
            )

    fail((rec_off < lo) | (rec_off > hi) | (rec_len > hi - np.minimum(rec_off, hi)),
         "record bytes lie outside the data area")
    if index.size > 1:
        fail(np.concatenate([[False], rec_off[1:] < rec_off[:-1]]), "record offsets are not in sample order")
    rec_end = rec_off + rec_len
    for name, field in ds.fields.items():
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
        elif isinstance(field, TokenIds):
            fail(f_len % np.uint64(field.record_width) != 0,
                 f"field {name!r}: token_ids length is not a multiple of {field.record_width} bytes")
        elif isinstance(field, RGBImages):
            head = np.uint64(4) + index[f"{name}.count"].astype(np.uint64) * np.uint64(IMAGES_ENTRY.itemsize)
            fail(f_len < head, f"field {name!r}: shorter than its image count's entries")


def read_page_crcs(ds, sections, h) -> np.ndarray | None:
    if C.SECTION_PAGE_CHECKSUMS not in sections:
        if int(h["optional_features"]) & C.OPTIONAL_PAGE_CHECKSUMS:
            raise ds._err(FormatError, "page_checksums", None, "header announces page checksums; none found")
        return None
    off, payload = sections[C.SECTION_PAGE_CHECKSUMS]
    if len(payload) != ds.page_count * PAGE_CHECKSUM.itemsize:
        raise ds._err(FormatError, "page_checksums", off, f"expected {ds.page_count} CRCs, got {len(payload) // 4}")
    return np.frombuffer(payload, dtype=PAGE_CHECKSUM)
