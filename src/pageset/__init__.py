"""pageset: page-aligned dataset files and a loader that keeps accelerators fed.

Public API::

    from pageset import write_dataset, open_dataset, RGBImage, Int
    write_dataset("train.pageset", "imagenet/train", {"image": RGBImage(max_resolution=512), "label": Int()})
    ds = open_dataset("train.pageset")
"""

from .format import (
    JSON,
    BadMagicError,
    Bytes,
    ChecksumMismatchError,
    Float,
    FormatError,
    IndexBoundsError,
    Int,
    NDArray,
    RGBImage,
    SchemaError,
    TruncatedFileError,
    UnsupportedFeatureError,
    UnsupportedVersionError,
)
from .read import Dataset, EncodedImage, open_dataset
from .write import ImageFolder, SampleError, WriteResult, write_dataset

__all__ = [
    "JSON",
    "BadMagicError",
    "Bytes",
    "ChecksumMismatchError",
    "Dataset",
    "EncodedImage",
    "Float",
    "FormatError",
    "ImageFolder",
    "IndexBoundsError",
    "Int",
    "NDArray",
    "RGBImage",
    "SampleError",
    "SchemaError",
    "TruncatedFileError",
    "UnsupportedFeatureError",
    "UnsupportedVersionError",
    "WriteResult",
    "open_dataset",
    "write_dataset",
]
