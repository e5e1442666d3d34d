"""Explicit little-endian layouts of every binary structure of format v1 (never native byte order)."""

from __future__ import annotations

import numpy as np

from .constants import HEADER_SIZE

HEADER = np.dtype(
    [
        ("magic", "u1", (8,)),
        ("major", "<u2"),
        ("minor", "<u2"),
        ("header_size", "<u4"),
        ("page_size", "<u8"),
        ("required_features", "<u8"),
        ("optional_features", "<u8"),
        ("record_count", "<u8"),
        ("data_offset", "<u8"),
        ("data_length", "<u8"),
        ("page_count", "<u8"),
        ("section_table_offset", "<u8"),
        ("section_count", "<u8"),
        ("file_size", "<u8"),
        ("dataset_id", "u1", (32,)),
        ("section_table_crc", "<u4"),
        ("reserved", "u1", (24,)),
        ("header_crc", "<u4"),
    ]
)
assert HEADER.itemsize == HEADER_SIZE

SECTION_ENTRY = np.dtype(
    [
        ("kind", "<u4"),
        ("flags", "<u4"),
        ("offset", "<u8"),
        ("length", "<u8"),
        ("crc", "<u4"),
        ("reserved", "<u4"),
    ]
)

# Columns every index row starts with: the record's byte span in the data area (absolute file offsets).
RECORD_COLUMNS = (("_offset", "<u8"), ("_length", "<u8"))

# Columns a variable-length field adds (absolute offset and length of its bytes inside the record span).
SPAN_COLUMNS = (("offset", "<u8"), ("length", "<u8"))
# Extra columns of an image field.
IMAGE_COLUMNS = (("height", "<u4"), ("width", "<u4"), ("encoding", "u1"))
# Extra column of an image-list field: how many images the record holds.
IMAGES_COLUMNS = (("count", "<u4"),)
# An image-list value starts with its image count (<u4), then one entry per image (formats/v1.md section 5).
IMAGES_ENTRY = np.dtype([("height", "<u4"), ("width", "<u4"), ("length", "<u4"), ("encoding", "u1"),
                         ("reserved", "V3")])

PAGE_CHECKSUM = np.dtype("<u4")


def index_dtype(columns) -> np.dtype:
    """Packed (unaligned) structured dtype of one index row from ``[(name, dtype_str), ...]``."""
    return np.dtype([(name, dt) for name, dt in columns])
