"""Reading: open + validate a pageset file, record access."""

from .open import open_dataset, open_tokens
from .reader import Dataset, EncodedImage

__all__ = ["Dataset", "EncodedImage", "open_dataset", "open_tokens"]
