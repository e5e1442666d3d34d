"""Device stage: pinned host slots and non_blocking copies on a side CUDA stream."""

from .cuda import CudaCopyQueue, ToDevice

__all__ = ["CudaCopyQueue", "ToDevice"]
