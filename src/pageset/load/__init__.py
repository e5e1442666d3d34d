"""The Loader: threads, buffer ring, order, state."""

from .loader import INDEX_KEY, PADDING_KEY, SOURCE_KEY, Loader
from .stages import DecodeError, PipelineError

__all__ = ["INDEX_KEY", "PADDING_KEY", "SOURCE_KEY", "DecodeError", "Loader", "PipelineError"]
