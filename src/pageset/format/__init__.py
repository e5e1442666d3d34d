"""File format v1: constants, little-endian layouts, checksum, fields, schema and errors (numpy only)."""

from .errors import (
    BadMagicError,
    ChecksumMismatchError,
    FileChangedError,
    FormatError,
    IndexBoundsError,
    ObjectChangedError,
    RemoteReadError,
    SchemaError,
    TruncatedFileError,
    UnsupportedFeatureError,
    UnsupportedVersionError,
)
from .fields import JSON, Bytes, Field, Float, Int, NDArray, RGBImage

__all__ = [
    "JSON",
    "BadMagicError",
    "Bytes",
    "ChecksumMismatchError",
    "FileChangedError",
    "Field",
    "Float",
    "FormatError",
    "IndexBoundsError",
    "Int",
    "NDArray",
    "ObjectChangedError",
    "RGBImage",
    "RemoteReadError",
    "SchemaError",
    "TruncatedFileError",
    "UnsupportedFeatureError",
    "UnsupportedVersionError",
]
