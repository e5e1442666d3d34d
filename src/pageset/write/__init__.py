"""Offline writer: sources -> encoded records -> one page-aligned file."""

from .sources import ImageFolder, SampleError
from .writer import WriteResult, write_dataset

__all__ = ["ImageFolder", "SampleError", "WriteResult", "write_dataset"]
