"""formats/v1.md is the source of truth: parse its tables and compare them with the code's constants."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from pageset.format import constants as C
from pageset.format.checksum import ALGORITHM, CHECK_VALUE, crc32
from pageset.format.fields import FIELD_KINDS, Int, RGBImage
from pageset.format.layout import HEADER, IMAGE_COLUMNS, SECTION_ENTRY, SPAN_COLUMNS

SPEC = Path(__file__).resolve().parents[1] / "formats" / "v1.md"


def table(name: str) -> list[dict]:
    text = SPEC.read_text(encoding="utf-8")
    m = re.search(rf"<!-- table: {name} -->\n((?:\|.*\n)+)", text)
    assert m, f"table {name!r} missing from {SPEC}"
    lines = [line.strip() for line in m.group(1).strip().splitlines()]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert set(lines[1].replace("|", "").strip()) <= {"-", " "}
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def dtype_of(type_str: str) -> np.dtype:
    m = re.fullmatch(r"(u1)\[(\d+)\]", type_str)
    return np.dtype((m.group(1), (int(m.group(2)),))) if m else np.dtype(type_str)


@pytest.mark.parametrize("name, layout", [("header", HEADER), ("section_entry", SECTION_ENTRY)])
def test_byte_tables_match_layouts(name, layout):
    rows = table(name)
    assert [r["name"] for r in rows] == list(layout.names)
    for r in rows:
        dt, off = layout.fields[r["name"]]
        assert int(r["offset"]) == off, r
        assert int(r["size"]) == dt.itemsize, r
        assert dtype_of(r["type"]) == dt, r
    last = rows[-1]
    assert int(last["offset"]) + int(last["size"]) == layout.itemsize


def test_header_size_and_magic():
    assert HEADER.itemsize == C.HEADER_SIZE == 160
    magic_row = table("header")[0]
    hex_bytes = re.search(r"`([0-9A-F ]+)`", magic_row["meaning"]).group(1)
    assert bytes.fromhex(hex_bytes) == C.MAGIC


def test_section_kinds():
    rows = table("section_kinds")
    assert {int(r["kind"]): r["name"] for r in rows} == C.SECTION_NAMES


def test_features():
    rows = table("features")
    assert [(r["kind"], int(r["bit"]), r["name"]) for r in rows] == [
        ("optional", 0, "page_checksums"), ("required", 0, "tokens"), ("required", 1, "loss_mask")]
    assert C.OPTIONAL_PAGE_CHECKSUMS == 1 << 0
    assert C.REQUIRED_TOKENS == 1 << 0 and C.REQUIRED_LOSS_MASK == 1 << 1
    assert C.KNOWN_REQUIRED_FEATURES == C.REQUIRED_TOKENS | C.REQUIRED_LOSS_MASK


def test_token_dtypes():
    rows = table("token_dtypes")
    assert tuple(r["dtype"] for r in rows) == C.TOKEN_DTYPES
    assert [np.dtype(r["type"]) for r in rows] == [np.dtype(d).newbyteorder("<") for d in C.TOKEN_DTYPES]


def test_field_kinds_and_dtypes():
    assert sorted(r["kind"] for r in table("field_kinds")) == sorted(FIELD_KINDS)
    dtypes = {r["field kind"]: r["dtypes"].split() for r in table("dtypes")}
    assert dtypes == {"int": list(C.INT_DTYPES), "float": list(C.FLOAT_DTYPES), "ndarray": list(C.NDARRAY_DTYPES)}
    cols = dict(RGBImage().columns("x"))
    assert cols == {f"x.{c}": dt for c, dt in SPAN_COLUMNS + IMAGE_COLUMNS}
    assert Int("int32").columns("y") == [("y", "<i4")]


def test_image_encodings():
    assert {int(r["value"]): r["name"] for r in table("image_encodings")} == C.ENCODING_NAMES


def test_checksum_check_value():
    (row,) = table("checksum")
    assert row["name"] == ALGORITHM
    assert int(row["check_value"], 16) == CHECK_VALUE == crc32(b"123456789")


def test_crc32_check_value_and_running_crc():
    """The check value, and a CRC continued over pieces equals the CRC of the whole (the writer's page CRCs)."""
    assert crc32(b"123456789") == CHECK_VALUE
    assert crc32(b"456789", crc32(b"123")) == CHECK_VALUE
    assert crc32(b"") == 0 and crc32(b"", 12345) == 12345
    import numpy as np

    arr = np.frombuffer(b"123456789", np.uint8)
    assert crc32(arr[3:], crc32(memoryview(arr[:3]))) == CHECK_VALUE
