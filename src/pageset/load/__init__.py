"""The Loader: threads, buffer ring, order, state."""

from .loader import Loader
from .ring import INDEX_KEY, PADDING_KEY, SOURCE_KEY
from .stages import DecodeError, PipelineError

__all__ = ["INDEX_KEY", "PADDING_KEY", "SOURCE_KEY", "DecodeError", "Loader", "PipelineError"]
