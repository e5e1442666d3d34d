"""Reading: open + validate a pageset file, record access."""

from .reader import Dataset, EncodedImage, open_dataset

__all__ = ["Dataset", "EncodedImage", "open_dataset"]
