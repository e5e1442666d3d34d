"""A reference reader of pageset format v1.1, written from ``formats/v1.md`` alone.

Small, slow and plain on purpose: the standard library only (struct, zlib, json, hashlib, math), no import of
pageset. The product's tests compare what pageset returns with what this module reads from the same bytes, so
a bug in pageset's reader, page cache, remote reads or writer shows up as a difference instead of agreeing with
itself. ``tests/test_reference_independent.py`` checks the imports.

API::

    ref = read_file(path)                # or read_bytes(data, name=...)
    ref.header                           # dict: every header field by its spec name
    ref.sections                         # dict kind -> (flags, offset, length, crc)
    ref.schema, ref.metadata             # parsed JSON (metadata None when absent)
    ref.records                          # list of dicts, one per record, in record order:
                                         #   int/float fields -> Python int/float (bool fields -> bool)
                                         #   bytes -> bytes, json -> parsed value, ndarray -> raw bytes (C order, LE)
                                         #   rgb_image -> {"height", "width", "encoding": "raw"|"jpeg", "data": bytes}
                                         #   rgb_images -> a list of such dicts; token_ids -> list of ids
                                         #   (with loss_mask: {"input_ids": [...], "loss_mask": [0/1, ...]})
                                         #   plus "_offset" and "_length" (the record's span)
    ref.pages                            # list of bytes, page k as stored (the last one truncated)
    ref.page_crcs                        # list of int or None (no page checksum section)
    ref.bad_pages()                      # page numbers whose CRC-32 differs from the page checksum section
    ref.tokens, ref.doc_offsets          # token files: list of int ids, list of D + 1 offsets (else None)
    ref.window(w, seq_len)               # token window w: (input ids, target ids), each a list of seq_len ints
    ref.num_windows(seq_len)
    ref.record_pages(i)                  # the pages record i's bytes lie in (a list of page numbers)

Every violation of a MUST of the spec raises ``RefError`` with a short reason; nothing is repaired.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib

MAGIC = b"\x89PGS\r\n\x1a\n"
HEADER_SIZE = 160
HEADER_FIELDS = [  # (name, struct code) in order, spec section 2
    ("magic", "8s"), ("major", "H"), ("minor", "H"), ("header_size", "I"), ("page_size", "Q"),
    ("required_features", "Q"), ("optional_features", "Q"), ("record_count", "Q"), ("data_offset", "Q"),
    ("data_length", "Q"), ("page_count", "Q"), ("section_table_offset", "Q"), ("section_count", "Q"),
    ("file_size", "Q"), ("dataset_id", "32s"), ("section_table_crc", "I"), ("reserved", "24s"),
    ("header_crc", "I"),
]
HEADER_STRUCT = "<" + "".join(code for _, code in HEADER_FIELDS)
SECTION_ENTRY = "<IIQQII"
KIND_SCHEMA, KIND_INDEX, KIND_PAGE_CRCS, KIND_METADATA, KIND_DOC_OFFSETS = 1, 2, 3, 4, 5
KNOWN_KINDS = {1, 2, 3, 4, 5}
REQUIRED_TOKENS = 1  # required feature bit 0

# struct codes of the little-endian dtypes the spec allows (section 5 tables)
DTYPE_CODES = {"int8": "b", "int16": "h", "int32": "i", "int64": "q", "uint8": "B", "uint16": "H",
               "uint32": "I", "uint64": "Q", "bool": "?", "float16": "e", "float32": "f", "float64": "d"}
# token_ids fields (spec section 5): the token dtypes of section 10
TOKEN_CODES = {"uint16": "H", "uint32": "I"}
# the dtype strings of index_columns (spec section 5): numpy's little-endian dtype string, "|" for one-byte types
NP_NAMES = {"b": "|i1", "h": "<i2", "i": "<i4", "q": "<i8", "B": "|u1", "H": "<u2", "I": "<u4", "Q": "<u8",
            "?": "|b1", "e": "<f2", "f": "<f4", "d": "<f8"}
ENCODINGS = {0: "raw", 1: "jpeg"}


class RefError(ValueError):
    """A violation of formats/v1.md found by the reference reader."""


def crc32(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def _field_columns(field: dict) -> list[tuple]:
    """(column name, struct code[, dtype string when not NP_NAMES[code]]) of a field in the index row, spec
    section 5 field_kinds table."""
    name, kind, params = field["name"], field["kind"], field["params"]
    if kind in ("int", "float"):
        return [(name, DTYPE_CODES[params["dtype"]])]
    if kind in ("ndarray", "bytes", "json", "token_ids"):
        return [(name + ".offset", "Q"), (name + ".length", "Q")]
    if kind == "rgb_image":
        return [(name + ".offset", "Q"), (name + ".length", "Q"), (name + ".height", "I"),
                (name + ".width", "I"), (name + ".encoding", "B", "u1")]  # spelled "u1", spec section 5
    if kind == "rgb_images":
        return [(name + ".offset", "Q"), (name + ".length", "Q"), (name + ".count", "I")]
    if kind == "tokens":
        return []
    raise RefError(f"unknown field kind {kind!r}")


def _image(i, name, hh, ww, enc, blob) -> dict:
    """One stored image (spec section 5: an rgb_image value, or an entry of an rgb_images value)."""
    if enc not in ENCODINGS or not (1 <= hh <= 2**31 - 1 and 1 <= ww <= 2**31 - 1):
        raise RefError(f"record {i} field {name} image header")
    if enc == 0 and len(blob) != hh * ww * 3:
        raise RefError(f"record {i} field {name} raw length")
    if enc == 1 and (hh > 65535 or ww > 65535):
        raise RefError(f"record {i} field {name} jpeg size")
    return {"height": hh, "width": ww, "encoding": ENCODINGS[enc], "data": blob}


class RefDataset:
    def __init__(self, data: bytes, name: str = "<bytes>"):
        self.name = name
        self.data = data
        self._parse()

    # -- parsing, in the order of spec section 8 --------------------------------------------------------------
    def _parse(self) -> None:
        d = self.data
        if len(d) < HEADER_SIZE:
            raise RefError("shorter than the header")
        values = struct.unpack_from(HEADER_STRUCT, d, 0)
        h = dict(zip([n for n, _ in HEADER_FIELDS], values))
        self.header = h
        if h["magic"] != MAGIC:
            raise RefError("bad magic")
        if h["major"] != 1:
            raise RefError(f"major {h['major']}")
        if h["required_features"] & ~REQUIRED_TOKENS:
            raise RefError("unknown required feature")
        if crc32(d[:156]) != h["header_crc"]:
            raise RefError("header crc")
        if h["header_size"] != HEADER_SIZE or h["reserved"] != bytes(24):
            raise RefError("header_size or reserved")
        ps = h["page_size"]
        if ps < 4096 or ps > 2**30 or ps & (ps - 1):
            raise RefError("page_size")
        if h["file_size"] != len(d):
            raise RefError(f"file_size {h['file_size']} != {len(d)}")
        do, dl = h["data_offset"], h["data_length"]
        if do % 4096 or do < HEADER_SIZE or do + dl > len(d):
            raise RefError("data area")
        if h["page_count"] != -(-dl // ps):
            raise RefError("page_count")
        sto, sc = h["section_table_offset"], h["section_count"]
        if sc > 1024 or sto % 8 or sto < do + dl or sto + 32 * sc > len(d):
            raise RefError("section table bounds")
        table = d[sto:sto + 32 * sc]
        if crc32(table) != h["section_table_crc"]:
            raise RefError("section table crc")
        self.sections = {}
        for k in range(sc):
            kind, flags, off, length, crc, reserved = struct.unpack_from(SECTION_ENTRY, table, 32 * k)
            if reserved:
                raise RefError("section reserved")
            if kind in self.sections:
                raise RefError(f"section kind {kind} twice")
            if kind not in KNOWN_KINDS:
                if flags & 1:
                    raise RefError(f"unknown required section {kind}")
                continue
            if off % 8 or off < do + dl or off + length > len(d):
                raise RefError(f"section {kind} bounds")
            if crc32(d[off:off + length]) != crc:
                raise RefError(f"section {kind} crc")
            self.sections[kind] = (flags, off, length, crc)
        self._check_padding()
        if KIND_SCHEMA not in self.sections or KIND_INDEX not in self.sections:
            raise RefError("schema or index section missing")
        self.schema_bytes = self._section(KIND_SCHEMA)
        self.schema = json.loads(self.schema_bytes.decode("utf-8"))
        canonical = json.dumps(self.schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                               allow_nan=False).encode("utf-8")
        if canonical != self.schema_bytes:
            raise RefError("schema is not canonical JSON")
        self.metadata = (json.loads(self._section(KIND_METADATA).decode("utf-8"))
                         if KIND_METADATA in self.sections else None)
        columns = [("_offset", "Q"), ("_length", "Q")]
        for f in self.schema["fields"]:
            columns += _field_columns(f)
        if [[c[0], c[2] if len(c) > 2 else NP_NAMES[c[1]]] for c in columns] != self.schema["index_columns"]:
            raise RefError("index_columns differ from the fields")
        self.columns = [c[:2] for c in columns]
        self.is_tokens = bool(h["required_features"] & REQUIRED_TOKENS)
        self.pages = [d[do + k * ps: min(do + (k + 1) * ps, do + dl)] for k in range(h["page_count"])]
        self.page_crcs = None
        if KIND_PAGE_CRCS in self.sections:
            raw = self._section(KIND_PAGE_CRCS)
            if len(raw) != 4 * h["page_count"]:
                raise RefError("page checksum section length")
            self.page_crcs = list(struct.unpack(f"<{h['page_count']}I", raw))
        self._parse_index()
        self.tokens = self.doc_offsets = None
        if self.is_tokens:
            self._parse_tokens()
        self._check_dataset_id()

    def _section(self, kind: int) -> bytes:
        _, off, length, _ = self.sections[kind]
        return self.data[off:off + length]

    def _check_padding(self) -> None:
        """Every byte outside header, data area, sections and section table is zero (spec section 1)."""
        h = self.header
        used = [(0, HEADER_SIZE), (h["data_offset"], h["data_offset"] + h["data_length"]),
                (h["section_table_offset"], h["section_table_offset"] + 32 * h["section_count"])]
        used += [(off, off + length) for _, off, length, _ in self.sections.values()]
        pos = 0
        for start, end in sorted(used):
            if start > pos and any(self.data[pos:start]):
                raise RefError(f"non-zero padding in [{pos}, {start})")
            pos = max(pos, end)
        if any(self.data[pos:]):
            raise RefError("non-zero bytes after the last section")

    def _parse_index(self) -> None:
        h, d = self.header, self.data
        row = "<" + "".join(c for _, c in self.columns)
        size = struct.calcsize(row)
        raw = self._section(KIND_INDEX)
        if len(raw) != size * h["record_count"]:
            raise RefError("index length")
        self.index_bytes = raw
        do, dl, ps = h["data_offset"], h["data_length"], h["page_size"]
        self.records = []
        prev = 0
        for i in range(h["record_count"]):
            vals = dict(zip([n for n, _ in self.columns], struct.unpack_from(row, raw, i * size)))
            off, length = vals["_offset"], vals["_length"]
            if off < prev or off < do or off + length > do + dl:
                raise RefError(f"record {i} span")
            prev = off
            # a record straddles a page boundary only if it is larger than a page; then it starts on one
            first, last = (off - do) // ps, (off - do + max(length, 1) - 1) // ps
            if length > ps and (off - do) % ps:
                raise RefError(f"record {i} larger than a page does not start on a page boundary")
            if length <= ps and first != last:
                raise RefError(f"record {i} straddles pages")
            rec = {"_offset": off, "_length": length}
            cursor = off
            for f in self.schema["fields"]:
                name, kind, params = f["name"], f["kind"], f["params"]
                if kind in ("int", "float"):
                    rec[name] = vals[name]
                    continue
                fo, fl = vals[name + ".offset"], vals[name + ".length"]
                if fo < off or fo + fl > off + length:
                    raise RefError(f"record {i} field {name} span")
                if fo != cursor:
                    raise RefError(f"record {i} field {name} is not stored right after the previous field")
                cursor = fo + fl
                blob = d[fo:fo + fl]
                if kind == "bytes":
                    rec[name] = blob
                elif kind == "token_ids":  # spec section 5: n little-endian ids of params.dtype
                    if params.get("dtype") not in TOKEN_CODES:
                        raise RefError(f"field {name} token_ids dtype {params.get('dtype')!r}")
                    code = TOKEN_CODES[params["dtype"]]
                    masked = params.get("loss_mask", False)
                    if masked not in (True, False):
                        raise RefError(f"field {name} token_ids loss_mask {masked!r}")
                    width = struct.calcsize("<" + code) + (1 if masked else 0)
                    if fl % width:
                        raise RefError(f"record {i} field {name} token_ids length")
                    n = fl // width
                    ids = list(struct.unpack("<%d%s" % (n, code), blob[: n * (width - masked)]))
                    if masked:  # n ids, then n mask bytes, each 0 or 1
                        mask = list(blob[n * (width - 1):])
                        if any(v > 1 for v in mask):
                            raise RefError(f"record {i} field {name} loss mask byte")
                        rec[name] = {"input_ids": ids, "loss_mask": mask}
                    else:
                        rec[name] = ids
                elif kind == "rgb_images":  # spec section 5: count, 16-byte entries, the images
                    count = vals[name + ".count"]
                    if fl < 4 + 16 * count or struct.unpack_from("<I", blob)[0] != count:
                        raise RefError(f"record {i} field {name} image count")
                    images, at = [], 4 + 16 * count
                    for k in range(count):
                        hh, ww, ln, enc = struct.unpack_from("<IIIB", blob, 4 + 16 * k)
                        if blob[4 + 16 * k + 13: 4 + 16 * k + 16] != bytes(3):
                            raise RefError(f"record {i} field {name} image entry {k} reserved bytes")
                        images.append(_image(i, name, hh, ww, enc, blob[at: at + ln]))
                        at += ln
                    if at != fl:
                        raise RefError(f"record {i} field {name} image list length")
                    rec[name] = images
                elif kind == "json":
                    rec[name] = json.loads(blob.decode("utf-8"))
                elif kind == "ndarray":
                    n = 1
                    for s in params["shape"]:
                        n *= s
                    if fl != n * struct.calcsize("<" + DTYPE_CODES[params["dtype"]]):
                        raise RefError(f"record {i} field {name} ndarray length")
                    rec[name] = blob
                else:  # rgb_image
                    hh, ww, enc = vals[name + ".height"], vals[name + ".width"], vals[name + ".encoding"]
                    rec[name] = _image(i, name, hh, ww, enc, blob)
            if cursor != off + length:
                raise RefError(f"record {i}: its fields' bytes do not fill its span")
            self.records.append(rec)
        self._check_gaps()

    def _check_gaps(self) -> None:
        """Bytes between records are zero (spec section 6)."""
        h = self.header
        pos = h["data_offset"]
        for rec in self.records:
            if any(self.data[pos:rec["_offset"]]):
                raise RefError(f"non-zero bytes between records before offset {rec['_offset']}")
            pos = max(pos, rec["_offset"] + rec["_length"])
        if not self.is_tokens and any(self.data[pos:h["data_offset"] + h["data_length"]]):
            raise RefError("non-zero bytes after the last record")

    def _parse_tokens(self) -> None:
        h = self.header
        fields = self.schema["fields"]
        if len(fields) != 1 or fields[0]["kind"] != "tokens" or h["record_count"] != 0:
            raise RefError("token file schema")
        meta = self.schema["tokens"]
        dtype = fields[0]["params"]["dtype"]
        if meta["dtype"] != dtype or dtype not in ("uint16", "uint32"):
            raise RefError("token dtype")
        item = 2 if dtype == "uint16" else 4
        if h["data_length"] != meta["count"] * item:
            raise RefError("token count vs data_length")
        stream = self.data[h["data_offset"]:h["data_offset"] + h["data_length"]]
        self.tokens = list(struct.unpack(f"<{meta['count']}{'H' if item == 2 else 'I'}", stream))
        if KIND_DOC_OFFSETS not in self.sections:
            raise RefError("doc_offsets section missing")
        raw = self._section(KIND_DOC_OFFSETS)
        if len(raw) % 8 or len(raw) // 8 != meta["documents"] + 1:
            raise RefError("doc_offsets length")
        offs = list(struct.unpack(f"<{len(raw) // 8}Q", raw))
        if offs[0] != 0 or offs[-1] != meta["count"] or any(b < a for a, b in zip(offs, offs[1:])):
            raise RefError("doc_offsets values")
        self.doc_offsets = offs

    def _check_dataset_id(self) -> None:
        parts = [self.schema_bytes, self.index_bytes]
        if KIND_PAGE_CRCS in self.sections:
            parts.append(self._section(KIND_PAGE_CRCS))
        if self.is_tokens:
            parts.append(self._section(KIND_DOC_OFFSETS))
        if hashlib.sha256(b"".join(parts)).digest() != self.header["dataset_id"]:
            raise RefError("dataset_id")

    # -- queries ------------------------------------------------------------------------------------------------
    @property
    def dataset_id(self) -> str:
        return self.header["dataset_id"].hex()

    def bad_pages(self) -> list[int]:
        if self.page_crcs is None:
            return []
        return [k for k, page in enumerate(self.pages) if crc32(page) != self.page_crcs[k]]

    def record_pages(self, i: int) -> list[int]:
        rec = self.records[i]
        do, ps = self.header["data_offset"], self.header["page_size"]
        first = (rec["_offset"] - do) // ps
        last = (rec["_offset"] - do + max(rec["_length"], 1) - 1) // ps
        return list(range(first, last + 1))

    def num_windows(self, seq_len: int) -> int:
        return max(0, (len(self.tokens) - 1) // seq_len)

    def window(self, w: int, seq_len: int) -> tuple[list[int], list[int]]:
        if not 0 <= w < self.num_windows(seq_len):
            raise IndexError(w)
        span = self.tokens[w * seq_len: w * seq_len + seq_len + 1]
        return span[:-1], span[1:]


def read_bytes(data: bytes, name: str = "<bytes>") -> RefDataset:
    return RefDataset(bytes(data), name)


def read_file(path) -> RefDataset:
    with open(path, "rb") as f:
        return RefDataset(f.read(), str(path))
