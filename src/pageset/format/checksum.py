"""The file's checksum: CRC-32 (ISO-HDLC, as in zlib/PNG), check value ``crc32(b"123456789") == 0xCBF43926``."""

from __future__ import annotations

import zlib

ALGORITHM = "crc32"
CHECK_VALUE = 0xCBF43926


def crc32(data, value: int = 0) -> int:
    """CRC-32 of a bytes-like object (bytes, memoryview, contiguous numpy array) as an int in [0, 2**32);
    ``value`` continues a running CRC (the CRC of the bytes before ``data``)."""
    return zlib.crc32(data, value) & 0xFFFFFFFF
