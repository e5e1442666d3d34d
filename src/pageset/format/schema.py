"""The schema section: canonical JSON describing the fields, the index row layout and writer parameters.

Canonical JSON (sorted keys, no whitespace, UTF-8) makes the bytes, and so the dataset id, a pure function of
the content.
"""

from __future__ import annotations

import json

import numpy as np

from .constants import FORMAT_MAJOR, FORMAT_MINOR, MAX_FIELD_NAME_BYTES, MAX_FIELDS
from .fields import Field, field_from_schema
from .layout import RECORD_COLUMNS, index_dtype


def canonical_json(obj) -> bytes:
    """UTF-8 bytes of ``obj`` as JSON with sorted keys and no insignificant whitespace."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def check_field_name(name) -> None:
    """Raise ``ValueError`` unless ``name`` is a valid field name.

    Valid: a non-empty ``str`` of at most 255 UTF-8 bytes, not starting with ``_`` (reserved for record
    columns) and without ``.`` (it separates a field from its index column), control characters or NUL.
    Names are stored in full, so two names sharing a prefix never collide.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"field names must be non-empty strings, got {name!r}")
    if len(name.encode("utf-8")) > MAX_FIELD_NAME_BYTES:
        raise ValueError(f"field name {name[:40]!r}... is longer than {MAX_FIELD_NAME_BYTES} UTF-8 bytes")
    if name.startswith("_") or "." in name or any(ord(c) < 32 for c in name):
        raise ValueError(
            f"field name {name!r} is invalid: it must not start with '_' or contain '.' or control characters"
        )


def index_columns(fields: dict[str, Field]) -> list[tuple[str, str]]:
    """All index columns, in order: the record span, then each field's columns in field order."""
    cols = list(RECORD_COLUMNS)
    for name, field in fields.items():
        cols.extend(field.columns(name))
    return cols


def build_schema(fields: dict[str, Field], attributes: dict | None, writer: dict) -> dict:
    """The schema document (a dict) for ``fields`` (name -> Field), dataset ``attributes`` and writer params."""
    if not fields:
        raise ValueError("a dataset needs at least one field")
    if len(fields) > MAX_FIELDS:
        raise ValueError(f"at most {MAX_FIELDS} fields, got {len(fields)}")
    for name, field in fields.items():
        check_field_name(name)
        if not isinstance(field, Field):
            raise TypeError(f"field {name!r} must be a pageset field such as RGBImage() or Int(), got {field!r}")
        field.validate()
    return {
        "format": "pageset",
        "version": [FORMAT_MAJOR, FORMAT_MINOR],
        "fields": [{"name": n, "kind": f.kind, "params": f.params()} for n, f in fields.items()],
        "index_columns": [list(c) for c in index_columns(fields)],
        "attributes": attributes or {},
        "writer": writer,
    }


def parse_schema(doc: dict) -> tuple[dict[str, Field], np.dtype]:
    """Fields (name -> Field) and the index row dtype from a schema document.

    Raises ``ValueError`` describing the first problem (the reader wraps it in a ``SchemaError`` with path and
    offset): unknown kinds or parameters, invalid or duplicate names, or ``index_columns`` that disagree with
    the fields.
    """
    if not isinstance(doc, dict) or doc.get("format") != "pageset":
        raise ValueError("not a pageset schema (missing \"format\": \"pageset\")")
    entries = doc.get("fields")
    if not isinstance(entries, list) or not entries or len(entries) > MAX_FIELDS:
        raise ValueError(f"\"fields\" must be a list of 1..{MAX_FIELDS} entries")
    fields: dict[str, Field] = {}
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("params"), dict):
            raise ValueError(f"field entry {entry!r} must be an object with name, kind and params")
        name = entry.get("name")
        check_field_name(name)
        if name in fields:
            raise ValueError(f"duplicate field name {name!r}")
        try:
            fields[name] = field_from_schema(entry.get("kind"), entry["params"])
        except KeyError:
            raise ValueError(f"field {name!r} has unknown kind {entry.get('kind')!r}") from None
        except TypeError as exc:
            raise ValueError(f"field {name!r}: {exc}") from None
    expected = [list(c) for c in index_columns(fields)]
    if doc.get("index_columns") != expected:
        raise ValueError(f"\"index_columns\" {doc.get('index_columns')!r} do not match the fields ({expected!r})")
    return fields, index_dtype(index_columns(fields))
