"""The ops a Loader pipeline is made of, with torchvision's names and semantics.

An op here is a small frozen description; the loader compiles a field's list of ops once, at construction,
into buffers of known shape and dtype and a call of precompiled Numba kernels (no code generation).

Image pipelines read ``[crop, flip?, normalize?, layout?, ToTensor?, ToDevice?]``::

    [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(IMAGENET_MEAN, IMAGENET_STD), ToTorchImage(),
     ToTensor(), ToDevice("cuda")]

- the crop decodes only the JPEG region it needs, at the smallest DCT scale that keeps the crop at or above
  the output size, and resizes it (antialiased when shrinking) into the batch buffer;
- without ``Normalize`` the output is uint8 (normalize on the GPU if you prefer: 4x less to copy);
- layout: NHWC ``[B, H, W, 3]`` by default; ``ToTorchImage(channels_last=True)`` gives an NCHW-shaped tensor in
  channels_last memory (an NHWC buffer), ``channels_last=False`` a contiguous NCHW buffer;
- ``ToTensor()`` hands torch tensors out (zero-copy over the batch buffer), otherwise numpy arrays.

Scalar, array, bytes and JSON fields use the decoders at the bottom (defaults when a field has no pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
OUT_DTYPES = ("float32", "float16", "bfloat16")


def _size2(size) -> tuple[int, int]:
    """(height, width) from an int or a pair, as torchvision does."""
    if isinstance(size, int):
        h = w = size
    else:
        h, w = (int(s) for s in size)
    if h < 1 or w < 1:
        raise ValueError(f"size must be positive, got {size!r}")
    return h, w


@dataclass(frozen=True)
class RandomResizedCrop:
    """Crop a random area (``scale`` of the image area, aspect ``ratio``) and resize it to ``size``.

    torchvision's ``RandomResizedCrop.get_params`` algorithm (10 tries, then a central fallback), drawn from the
    sample's (seed, epoch, position) key. ``size``: int or (height, width), output pixels.
    """

    size: int | tuple = 224
    scale: tuple = (0.08, 1.0)
    ratio: tuple = (3 / 4, 4 / 3)

    def __post_init__(self):
        object.__setattr__(self, "size", _size2(self.size))
        if not 0 < self.scale[0] <= self.scale[1]:
            raise ValueError(f"scale must satisfy 0 < lo <= hi, got {self.scale}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < lo <= hi, got {self.ratio}")


@dataclass(frozen=True)
class CenterCrop:
    """A centred crop of ``ratio`` times the shorter side (FFCV's evaluation crop), resized to ``size``.

    With ``ratio=224/256`` this equals torchvision's ``Resize(256) + CenterCrop(224)`` geometry for square
    outputs, decoded and resized in one pass.
    """

    size: int | tuple = 224
    ratio: float = 224 / 256

    def __post_init__(self):
        object.__setattr__(self, "size", _size2(self.size))
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")


@dataclass(frozen=True)
class RandomHorizontalFlip:
    """Flip left-right with probability ``p`` (decided by the sample's key, not by thread timing)."""

    p: float = 0.5

    def __post_init__(self):
        if not 0 <= self.p <= 1:
            raise ValueError(f"p must be in [0, 1], got {self.p}")


@dataclass(frozen=True)
class Normalize:
    """``(x / 255 - mean) / std`` per channel, written as ``dtype`` ("float32", "float16" or "bfloat16"; a torch
    dtype is accepted too). ``mean``/``std`` in torchvision's 0-1 convention."""

    mean: tuple = IMAGENET_MEAN
    std: tuple = IMAGENET_STD
    dtype: object = "float32"

    def __post_init__(self):
        name = str(self.dtype).replace("torch.", "")
        if name not in OUT_DTYPES:
            raise ValueError(f"Normalize dtype must be one of {OUT_DTYPES}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", name)
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ValueError(f"mean and std need 3 values (std > 0), got {self.mean}, {self.std}")


@dataclass(frozen=True)
class ToTorchImage:
    """Hand images out as NCHW-shaped tensors: ``channels_last=True`` keeps an NHWC buffer (torch's
    channels_last memory format, what convolutions prefer on GPUs); ``False`` writes a contiguous NCHW buffer."""

    channels_last: bool = True


@dataclass(frozen=True)
class ToTensor:
    """Hand the field out as a torch tensor (zero-copy over the batch buffer) instead of a numpy array."""


@dataclass(frozen=True)
class IntDecoder:
    """An Int field as ``int64[B]`` (or ``dtype``)."""

    dtype: str = "int64"


@dataclass(frozen=True)
class FloatDecoder:
    """A Float field as ``float32[B]`` (or ``dtype``)."""

    dtype: str = "float32"


@dataclass(frozen=True)
class NDArrayDecoder:
    """An NDArray field as ``dtype[B, *shape]`` (the stored dtype)."""


@dataclass(frozen=True)
class BytesDecoder:
    """A Bytes field as ``(uint8[B, max_len] zero-padded, int64[B] lengths)``; ``max_len`` is the longest value in
    the file, so the buffer is allocated once; bytes past a sample's length are always zero."""


@dataclass(frozen=True)
class JSONDecoder:
    """A JSON field as a list of B decoded values."""


@dataclass(frozen=True)
class TokenWindows:
    """Token-file pipeline: windows of ``seq_len + 1`` tokens at stride ``seq_len`` (chosen at load time, never
    stored): ``input`` = window[:-1] and ``target`` = window[1:], ``[B, seq_len]``, int64 (``input_dtype``
    "int32" halves the input copy). With ``document_outputs=True`` the batch also holds ``position_ids``
    (int64[B, L], 0 at each row start and after each EOS), ``doc_ids`` (int32[B, L]), ``labels`` (int64[B, L],
    target with -100 where the input is EOS), ``cu_seqlens`` (int32[S + 1] over the flattened batch) and
    ``max_seqlen`` (int); see ``pageset.ops.tokens`` for the exact segment rules."""

    seq_len: int
    document_outputs: bool = False
    input_dtype: str = "int64"

    def __post_init__(self):
        if not isinstance(self.seq_len, int) or isinstance(self.seq_len, bool) or self.seq_len < 1:
            raise ValueError(f"seq_len must be an int >= 1, got {self.seq_len!r}")
        if self.input_dtype not in ("int64", "int32"):
            raise ValueError(f"input_dtype must be 'int64' or 'int32', got {self.input_dtype!r}")
