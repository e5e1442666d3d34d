"""The file's tail, written after the pages: sections, the section table, then the header at offset 0 (the header,
which makes the file valid, is written last), and the lineage stored in the metadata section."""

from __future__ import annotations

import datetime
import platform
import socket
import sys

import numpy as np

from ..format import constants as C
from ..format.checksum import crc32
from ..format.layout import HEADER, SECTION_ENTRY

def lineage() -> dict:
    """Where and when a file was written (stored in the metadata section, outside the dataset id)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        pkg = version("pageset")
    except PackageNotFoundError:
        pkg = "unknown"
    return {
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "pageset_version": pkg,
        "python": platform.python_version(),
        "platform": sys.platform,
    }


def align(x: int, a: int) -> int:
    """``x`` rounded up to a multiple of ``a``."""
    return -(-x // a) * a


def write_tail(f, *, page_size: int, data_length: int, page_count: int, record_count: int,
               required_features: int, dataset_id: bytes, sections: list) -> int:
    """Write ``sections`` (``[(kind, flags, payload bytes), ...]``) after the data area, then the section table,
    then the header at offset 0; returns the file size. ``f`` is the temp file opened for writing."""
    pos = C.DATA_OFFSET + data_length
    table = np.zeros(len(sections), dtype=SECTION_ENTRY)
    for k, (kind, flags, payload) in enumerate(sections):
        pos = align(pos, C.SECTION_ALIGN)
        f.seek(pos)
        f.write(payload)
        table[k] = (kind, flags, pos, len(payload), crc32(payload), 0)
        pos += len(payload)
    table_offset = align(pos, C.SECTION_ALIGN)
    f.seek(table_offset)
    f.write(table.tobytes())
    file_size = table_offset + table.nbytes
    f.truncate(file_size)

    header = np.zeros((), dtype=HEADER)
    header["magic"] = np.frombuffer(C.MAGIC, dtype=np.uint8)
    header["major"], header["minor"], header["header_size"] = C.FORMAT_MAJOR, C.FORMAT_MINOR, C.HEADER_SIZE
    header["page_size"] = page_size
    header["required_features"] = required_features
    header["optional_features"] = C.OPTIONAL_PAGE_CHECKSUMS
    header["record_count"] = record_count
    header["data_offset"], header["data_length"] = C.DATA_OFFSET, data_length
    header["page_count"] = page_count
    header["section_table_offset"], header["section_count"] = table_offset, len(sections)
    header["file_size"] = file_size
    header["dataset_id"] = np.frombuffer(dataset_id, dtype=np.uint8)
    header["section_table_crc"] = crc32(table.tobytes())
    raw = bytearray(header.tobytes())
    raw[-4:] = crc32(bytes(raw[:-4])).to_bytes(4, "little")
    f.seek(0)
    f.write(raw)
    return file_size
