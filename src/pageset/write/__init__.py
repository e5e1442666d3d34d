"""Offline writer: sources -> encoded records -> one page-aligned file."""

from .external import ParquetSource, WebDatasetSource
from .sources import ImageFolder, ImageList, SampleError
from .writer import WriteResult, write_dataset

__all__ = ["ImageFolder", "ImageList", "ParquetSource", "SampleError", "WebDatasetSource", "WriteResult",
           "write_dataset"]
