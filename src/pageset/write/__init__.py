"""Offline writer: sources -> encoded records -> one page-aligned file."""

from .sources import ImageFolder, ImageList, SampleError
from .writer import WriteResult, write_dataset

__all__ = ["ImageFolder", "ImageList", "SampleError", "WriteResult", "write_dataset"]
