"""Offline writer: sources -> encoded records -> one page-aligned file."""

from .external import ParquetSource, WebDatasetSource
from .sources import ImageFolder, SampleError
from .writer import WriteResult, write_dataset

__all__ = ["ImageFolder", "ParquetSource", "SampleError", "WebDatasetSource", "WriteResult", "write_dataset"]
