"""The manifest of a many-file dataset (``formats/manyfile.md``): build, encode, parse and validate.

A many-file dataset is a folder (or URL prefix) of member pageset v1 files plus one JSON manifest,
``pageset.manifest.json``, written last and atomically. This module holds what the writer and the reader share:
the member names, the common schema and its digest, the set's dataset id, the records-per-page encoding and
the manifest's validation. numpy and the standard library only.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
import zlib
from dataclasses import dataclass

import numpy as np

from .errors import FormatError, SchemaError, UnsupportedVersionError
from .schema import canonical_json

MANIFEST_NAME = "pageset.manifest.json"
MANIFEST_FORMAT = "pageset-manifest"
MANIFEST_MAJOR, MANIFEST_MINOR = 1, 0
SET_ID_PREFIX = b"pageset many-file v1\n"  # the domain prefix of the set's dataset id (spec section 4)
MEMBER_RE = re.compile(r"^m(\d{4,})-(\d{6,})\.pageset$")  # the names writers give members
SAFE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")  # what a manifest may name (no folders)
HEX64 = re.compile(r"^[0-9a-f]{64}$")
KINDS = ("records", "tokens")
# keys of a member's schema that differ between members of one set and are left out of the common schema
PER_MEMBER_TOKEN_KEYS = ("count", "documents", "max_id")
PER_MEMBER_ATTRIBUTES = ("ignored_files",)


def member_name(generation: int, k: int) -> str:
    """The name a writer gives the ``k``-th member added by manifest generation ``generation``."""
    return f"m{generation:04d}-{k:06d}.pageset"


def common_schema(schema: dict) -> dict:
    """A member's schema without its per-member keys (spec section 3): ``attributes.ignored_files`` and, for
    token files, ``tokens.count``, ``tokens.documents`` and ``tokens.max_id``."""
    out = copy.deepcopy(schema)
    attrs = out.get("attributes")
    if isinstance(attrs, dict):
        for key in PER_MEMBER_ATTRIBUTES:
            attrs.pop(key, None)
    tok = out.get("tokens")
    if isinstance(tok, dict):
        for key in PER_MEMBER_TOKEN_KEYS:
            tok.pop(key, None)
    return out


def schema_digest(schema: dict) -> str:
    """Hex SHA-256 of the canonical JSON of ``common_schema(schema)``."""
    return hashlib.sha256(canonical_json(common_schema(schema))).hexdigest()


def set_dataset_id(member_ids) -> str:
    """The set's dataset id: hex SHA-256 of ``SET_ID_PREFIX`` followed by each member's 32-byte id, in order."""
    h = hashlib.sha256(SET_ID_PREFIX)
    for i in member_ids:
        h.update(bytes.fromhex(i))
    return h.hexdigest()


def encode_records_per_page(counts) -> str:
    """``counts`` (records starting in each page) as base64 of zlib-compressed little-endian u4 values."""
    raw = np.ascontiguousarray(counts, dtype="<u4").tobytes()
    return base64.b64encode(zlib.compress(raw, 9)).decode("ascii")


def decode_records_per_page(text: str, n: int) -> np.ndarray:
    """The int64[n] array :func:`encode_records_per_page` encoded; ValueError when it is not that."""
    if not isinstance(text, str):
        raise ValueError(f"records_per_page must be a base64 string, got {type(text).__name__}")
    try:
        raw = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True), bufsize=4 * n + 1)
    except (ValueError, zlib.error, UnicodeEncodeError) as exc:
        raise ValueError(f"records_per_page is not base64 of zlib data ({exc})") from None
    if len(raw) != 4 * n:
        raise ValueError(f"records_per_page holds {len(raw) // 4} values, expected {n} (one per page)")
    return np.frombuffer(raw, dtype="<u4").astype(np.int64)


def _describe(f) -> str:
    return f"{f['name']!r} ({f['kind']} {f.get('params')})" if isinstance(f, dict) and "name" in f else repr(f)


def schema_difference(a: dict, b: dict) -> str | None:
    """None when the common schemas of ``a`` and ``b`` agree; else what differs first, naming the field (or the
    key), as ``"field 1 is 'label' (int {...}) here, 'label' (int {...}) there"``."""
    a, b = common_schema(a), common_schema(b)
    if a == b:
        return None
    fa, fb = a.get("fields", []), b.get("fields", [])
    for k in range(max(len(fa), len(fb))):
        x = fa[k] if k < len(fa) else None
        y = fb[k] if k < len(fb) else None
        if x != y:
            return (f"field {k} is {_describe(y) if y else 'missing'} here, "
                    f"{_describe(x) if x else 'missing'} in the set")
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            va, vb = a.get(key), b.get(key)
            if isinstance(va, dict) and isinstance(vb, dict):
                sub = sorted(k for k in set(va) | set(vb) if va.get(k) != vb.get(k))[0]
                return f"{key}.{sub} is {vb.get(sub)!r:.80} here, {va.get(sub)!r:.80} in the set"
            return f"{key} is {vb!r:.80} here, {va!r:.80} in the set"
    return "the schemas differ"  # pragma: no cover (equal dicts were caught above)


@dataclass(frozen=True)
class Member:
    """One member file as the manifest lists it: ``name`` (file name in the folder), ``dataset_id`` (hex),
    ``bytes`` (file size), ``pages``, ``schema_digest``; record members: ``records`` and ``records_per_page``
    (int64[max(pages, 1)]); token members: ``tokens`` and ``documents`` (``records`` is 0)."""

    name: str
    dataset_id: str
    bytes: int
    pages: int
    schema_digest: str
    records: int = 0
    records_per_page: np.ndarray | None = None
    tokens: int = 0
    documents: int = 0

    def entry(self) -> dict:
        """The member's JSON object in the manifest."""
        out = {"name": self.name, "dataset_id": self.dataset_id, "bytes": self.bytes, "pages": self.pages,
               "schema_digest": self.schema_digest}
        if self.records_per_page is not None:
            out["records"] = self.records
            out["records_per_page"] = encode_records_per_page(self.records_per_page)
        else:
            out["tokens"], out["documents"] = self.tokens, self.documents
        return out


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest: ``kind`` (``"records"``/``"tokens"``), ``generation`` (1, 2, ...: one more
    per manifest written to the folder), ``dataset_id`` (hex), ``schema`` (the common schema), ``schema_digest``,
    ``page_size``, ``members`` (tuple of :class:`Member`), ``appended_to`` (None or ``{"generation",
    "dataset_id", "members"}``: the set this one extends with more members)."""

    kind: str
    generation: int
    dataset_id: str
    schema: dict
    schema_digest: str
    page_size: int
    members: tuple
    appended_to: dict | None = None

    @property
    def records(self) -> int:
        return sum(m.records for m in self.members)

    @property
    def tokens(self) -> int:
        return sum(m.tokens for m in self.members)

    @property
    def documents(self) -> int:
        return sum(m.documents for m in self.members)

    def to_json(self) -> bytes:
        """The manifest's bytes: canonical JSON (sorted keys, no whitespace), UTF-8, then one newline."""
        doc = {"format": MANIFEST_FORMAT, "version": [MANIFEST_MAJOR, MANIFEST_MINOR], "kind": self.kind,
               "generation": self.generation, "dataset_id": self.dataset_id, "schema": self.schema,
               "schema_digest": self.schema_digest, "page_size": self.page_size,
               "members": [m.entry() for m in self.members], "appended_to": self.appended_to}
        if self.kind == "records":
            doc["records"] = self.records
        else:
            doc["tokens"], doc["documents"] = self.tokens, self.documents
        return canonical_json(doc) + b"\n"


def build_manifest(kind: str, generation: int, schema: dict, page_size: int, members, appended_to=None) -> Manifest:
    """A :class:`Manifest` over ``members`` (in order) with the set's id computed from theirs."""
    members = tuple(members)
    return Manifest(kind, generation, set_dataset_id([m.dataset_id for m in members]), common_schema(schema),
                    schema_digest(schema), page_size, members, appended_to)


def _int(doc: dict, key: str, where: str, err, minimum: int = 0) -> int:
    v = doc.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise err(f"{where}{key} must be an int >= {minimum}, got {v!r:.60}")
    return v


def parse_manifest(raw: bytes, path: str) -> Manifest:
    """Validate the bytes of the manifest at ``path`` (spec section 5) and return it. Raises FormatError naming
    ``path`` (not JSON, a field missing or of the wrong type, totals or ids that do not add up),
    UnsupportedVersionError (another major version) or SchemaError (the schema digest does not match)."""

    def err(detail, cls=FormatError):
        return cls(path, "manifest", None, detail)

    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise err(f"not valid UTF-8 JSON ({exc}); the manifest is damaged: restore it or rewrite the set") from None
    if not isinstance(doc, dict):
        raise err(f"the manifest must be a JSON object, got {type(doc).__name__}")
    if doc.get("format") != MANIFEST_FORMAT:
        raise err(f"format is {doc.get('format')!r:.60}, expected {MANIFEST_FORMAT!r}: not a pageset manifest")
    version = doc.get("version")
    if (not isinstance(version, list) or len(version) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in version)):
        raise err(f"version must be [major, minor], got {version!r:.60}")
    if version[0] != MANIFEST_MAJOR:
        raise err(f"manifest version {version[0]}.{version[1]} is not supported (this pageset reads "
                  f"{MANIFEST_MAJOR}.x); upgrade pageset", UnsupportedVersionError)
    missing = [k for k in ("kind", "generation", "dataset_id", "schema", "schema_digest", "page_size", "members")
               if k not in doc]
    if missing:
        raise err(f"required fields missing: {missing}")
    kind = doc["kind"]
    if kind not in KINDS:
        raise err(f"kind must be one of {KINDS}, got {kind!r:.60}")
    generation = _int(doc, "generation", "", err, 1)
    page_size = _int(doc, "page_size", "", err, 1)
    schema = doc["schema"]
    if not isinstance(schema, dict):
        raise err("schema must be a JSON object")
    digest = doc["schema_digest"]
    if not isinstance(digest, str) or digest != schema_digest(schema):
        raise err(f"schema_digest {digest!r:.70} does not match the schema (SHA-256 {schema_digest(schema)}); the "
                  "manifest was edited or damaged", SchemaError)
    entries = doc["members"]
    if not isinstance(entries, list) or not entries:
        raise err("members must be a non-empty list")
    members, seen = [], set()
    for k, e in enumerate(entries):
        where = f"members[{k}]."
        if not isinstance(e, dict):
            raise err(f"members[{k}] must be a JSON object")
        name = e.get("name")
        if not isinstance(name, str) or not SAFE_NAME_RE.match(name) or name in (".", ".."):
            raise err(f"{where}name must be a file name in the set's folder (letters, digits, '._-'), got "
                      f"{name!r:.80}")
        if name in seen or name == MANIFEST_NAME:
            raise err(f"{where}name {name!r} is listed twice (or is the manifest)")
        seen.add(name)
        where = f"member {name!r}: "
        mid = e.get("dataset_id")
        if not isinstance(mid, str) or not HEX64.match(mid):
            raise err(f"{where}dataset_id must be 64 lowercase hex digits, got {mid!r:.80}")
        size, pages = _int(e, "bytes", where, err), _int(e, "pages", where, err)
        if e.get("schema_digest") != digest:
            raise err(f"{where}schema_digest {e.get('schema_digest')!r:.70} differs from the set's {digest}: its "
                      "fields or settings differ from the other members'", SchemaError)
        if kind == "records":
            records = _int(e, "records", where, err)
            try:
                rpp = decode_records_per_page(e.get("records_per_page"), max(pages, 1))
            except ValueError as exc:
                raise err(f"{where}{exc}") from None
            if int(rpp.sum()) != records:
                raise err(f"{where}records_per_page sums to {int(rpp.sum())}, records is {records}")
            members.append(Member(name, mid, size, pages, digest, records=records, records_per_page=rpp))
        else:
            tokens, docs = _int(e, "tokens", where, err), _int(e, "documents", where, err)
            members.append(Member(name, mid, size, pages, digest, tokens=tokens, documents=docs))
    want = set_dataset_id([m.dataset_id for m in members])
    if doc["dataset_id"] != want:
        raise err(f"dataset_id {doc['dataset_id']!r:.70} is not the digest of the members' ids ({want}); the "
                  "manifest was edited or damaged")
    totals = ({"records": sum(m.records for m in members)} if kind == "records" else
              {"tokens": sum(m.tokens for m in members), "documents": sum(m.documents for m in members)})
    for key, total in totals.items():
        if key in doc and doc[key] != total:
            raise err(f"{key} is {doc[key]!r:.40}, the members hold {total}")
    appended = doc.get("appended_to")
    if appended is not None and not (isinstance(appended, dict) and isinstance(appended.get("members"), int)
                                     and 0 < appended["members"] <= len(members)):
        raise err(f"appended_to must be null or {{'generation', 'dataset_id', 'members'}}, got {appended!r:.80}")
    return Manifest(kind, generation, doc["dataset_id"], schema, digest, page_size, tuple(members), appended)
