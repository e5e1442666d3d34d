"""The ops a Loader pipeline is made of, with torchvision's names and semantics.

An op here is a small frozen description; the loader compiles a field's list of ops once, at construction,
into buffers of known shape and dtype and a call of precompiled Numba kernels (no code generation).

Image pipelines read ``[crop, flip?, normalize?, layout?, ToDevice?]``::

    [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(IMAGENET_MEAN, IMAGENET_STD), ToTorchImage(),
     ToDevice("cuda")]

- the crop decodes only the JPEG region it needs, at the smallest DCT scale that keeps the crop at or above
  the output size, and resizes it (antialiased when shrinking) into the batch buffer;
- without ``Normalize`` the output is uint8 (normalize on the GPU if you prefer: 4x less to copy);
- layout: NHWC ``[B, H, W, 3]`` by default; ``ToTorchImage(channels_last=True)`` gives an NCHW-shaped tensor in
  channels_last memory (an NHWC buffer), ``channels_last=False`` a contiguous NCHW buffer;
- batches hold torch tensors (zero-copy over the batch buffers) for every field, or numpy arrays for every
  field with ``Loader(..., array_type="numpy")``; ``ToTensor()`` is accepted and changes nothing.

Scalar, array, bytes and JSON fields use the decoders at the bottom (defaults when a field has no pipeline).

Every op checks its arguments when it is made: ``TypeError`` for a wrong kind of value (``RandomResizedCrop("224")``,
``TokenWindows(2048.0)``), ``ValueError`` for one out of range, both naming the argument and what it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..format import arguments as check
from ..format.constants import FLOAT_DTYPES, INT_DTYPES

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
OUT_DTYPES = ("float32", "float16", "bfloat16")
# The largest output side of a crop op: JPEG's own limit (a 16-bit side), so no stored JPEG is larger; a larger
# size is a typo (its batch buffer alone would be tens of GiB per image). The Loader also refuses, at
# construction, batch buffers larger than the machine's memory (naming the op, the field and the bytes).
MAX_OUTPUT_SIDE = 65535
# The crops' resize kernels: "exact" is Pillow's BILINEAR resample bit for bit (pageset.ops.resize); "fast" the
# same antialiased filter in 12-bit fixed point, within 2 uint8 levels of it (pageset.ops.resize_fast).
RESIZE_MODES = ("exact", "fast")


@dataclass(frozen=True)
class RandomResizedCrop:
    """Crop a random area (``scale`` of the image area, aspect ``ratio``) and resize it to ``size``.

    torchvision's ``RandomResizedCrop.get_params`` algorithm (10 tries, then a central fallback), drawn from the
    sample's (seed, epoch, position) key. ``size``: int or (height, width), output pixels, each in
    ``[1, MAX_OUTPUT_SIDE]`` (65535, JPEG's limit). ``resize_mode``: "exact" (default; Pillow's
    ``resize(BILINEAR)``, what torchvision does on PIL images, bit for bit) or "fast" (the same antialiased
    filter in 12-bit fixed point, ~3x cheaper: uint8 values within 2 levels of exact, PSNR >= 50 dB on real
    photos; see ``pageset.ops.resize_fast``).
    """

    size: int | tuple = 224
    scale: tuple = (0.08, 1.0)
    ratio: tuple = (3 / 4, 4 / 3)
    resize_mode: str = "exact"

    def __post_init__(self):
        object.__setattr__(self, "size", check.pair_of_ints("RandomResizedCrop.size", self.size,
                                                                   maximum=MAX_OUTPUT_SIDE))
        scale = check.ordered_pair("RandomResizedCrop.scale", self.scale)
        if scale[1] > 1:
            raise ValueError(f"RandomResizedCrop.scale must be (lo, hi) with 0 < lo <= hi <= 1 (fractions of the "
                             f"image area), got {self.scale!r}")
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "ratio", check.ordered_pair("RandomResizedCrop.ratio", self.ratio))
        object.__setattr__(self, "resize_mode", check.choice("RandomResizedCrop.resize_mode", self.resize_mode,
                                                             RESIZE_MODES))


@dataclass(frozen=True)
class CenterCrop:
    """A centred crop of ``ratio`` times the shorter side (FFCV's evaluation crop), resized to ``size``.

    With ``ratio=224/256`` this equals torchvision's ``Resize(256) + CenterCrop(224)`` geometry for square
    outputs, decoded and resized in one pass. ``size``, ``resize_mode``: as for :class:`RandomResizedCrop`.
    """

    size: int | tuple = 224
    ratio: float = 224 / 256
    resize_mode: str = "exact"

    def __post_init__(self):
        object.__setattr__(self, "size", check.pair_of_ints("CenterCrop.size", self.size, maximum=MAX_OUTPUT_SIDE))
        object.__setattr__(self, "ratio", check.real("CenterCrop.ratio", self.ratio, low=0, high=1, low_open=True))
        object.__setattr__(self, "resize_mode", check.choice("CenterCrop.resize_mode", self.resize_mode,
                                                             RESIZE_MODES))


@dataclass(frozen=True)
class SmartResize:
    """Dynamic resolution on a patch grid, as Qwen2-VL's image processor does it (an RGBImages field's pipeline:
    ``[SmartResize(...), Normalize(mean, std)?, ToTensor?, ToDevice?]``). Each image is resized to its own size:
    both sides multiples of ``patch_size * merge_size``, ``min_pixels <= H * W <= max_pixels``, the aspect kept
    (transformers' ``smart_resize``), then cut into ``H * W / patch_size**2`` flattened patches of ``3 *
    temporal_patch_size * patch_size**2`` values (``Qwen2VLImageProcessor``'s ``pixel_values`` layout; see
    ``pageset.ops.patches``). Defaults: Qwen2-VL's published ones (patch 14, merge 2, temporal 2, 56*56 to
    28*28*1280 pixels).

    The batch holds ``<field>`` ``[B, P, 3 * temporal_patch_size * patch_size**2]`` (row j's images' patches back
    to back from patch 0, zero after them; P = ``max_pixels_per_row / patch_size**2``), ``<field>_grid_thw``
    int64[B, M, 3] (``(1, H / patch_size, W / patch_size)`` per image, zero past the row's images; M: the most
    images in a record) and ``<field>_counts`` int64[B]. ``max_pixels_per_row``: the pixel budget of a row (None:
    M * max_pixels, room for any row); a row whose images need more is a DecodeError naming the sample.
    ``resize_mode``: as for :class:`RandomResizedCrop` (Pillow's BILINEAR filter, where Qwen2-VL's processor
    uses BICUBIC: the pixels differ within the PSNR README states). ``ExpandImageTokens(image_token_id,
    images=<field>)`` without ``tokens_per_image`` then gives each image ``H * W / (patch_size * merge_size)**2``
    tokens."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    max_pixels_per_row: int | None = None
    resize_mode: str = "exact"

    def __post_init__(self):
        for arg in ("patch_size", "merge_size", "temporal_patch_size"):
            object.__setattr__(self, arg, check.integer(f"SmartResize.{arg}", getattr(self, arg), minimum=1,
                                                        maximum=1024))
        factor = self.patch_size * self.merge_size
        object.__setattr__(self, "min_pixels", check.integer("SmartResize.min_pixels", self.min_pixels, minimum=1,
                                                             maximum=1 << 40))
        object.__setattr__(self, "max_pixels", check.integer("SmartResize.max_pixels", self.max_pixels,
                                                             minimum=max(self.min_pixels, factor * factor),
                                                             maximum=1 << 40))
        object.__setattr__(self, "max_pixels_per_row", check.integer(
            "SmartResize.max_pixels_per_row", self.max_pixels_per_row, minimum=self.patch_size ** 2,
            maximum=1 << 40, optional=True))
        object.__setattr__(self, "resize_mode", check.choice("SmartResize.resize_mode", self.resize_mode,
                                                             RESIZE_MODES))


@dataclass(frozen=True)
class RandomHorizontalFlip:
    """Flip left-right with probability ``p`` (decided by the sample's key, not by thread timing)."""

    p: float = 0.5

    def __post_init__(self):
        object.__setattr__(self, "p", check.real("RandomHorizontalFlip.p", self.p, low=0, high=1))


@dataclass(frozen=True)
class Normalize:
    """``(x / 255 - mean) / std`` per channel, written as ``dtype`` ("float32", "float16" or "bfloat16"; a torch
    dtype is accepted too). ``mean``/``std`` in torchvision's 0-1 convention."""

    mean: tuple = IMAGENET_MEAN
    std: tuple = IMAGENET_STD
    dtype: object = "float32"

    def __post_init__(self):
        name = self.dtype  # a name, a torch dtype (str: "torch.float16"), a numpy dtype or scalar type
        if isinstance(name, type):
            name = name.__name__
        elif not isinstance(name, str):
            name = str(name).replace("torch.", "")
        object.__setattr__(self, "dtype", check.choice("Normalize.dtype", name, OUT_DTYPES))
        object.__setattr__(self, "mean", check.numbers_tuple("Normalize.mean", self.mean, 3))
        object.__setattr__(self, "std", check.numbers_tuple("Normalize.std", self.std, 3, low=0, low_open=True))


@dataclass(frozen=True)
class ToTorchImage:
    """Hand images out as NCHW-shaped tensors: ``channels_last=True`` keeps an NHWC buffer (torch's
    channels_last memory format, what convolutions prefer on GPUs); ``False`` writes a contiguous NCHW buffer."""

    channels_last: bool = True

    def __post_init__(self):
        object.__setattr__(self, "channels_last", check.boolean("ToTorchImage.channels_last", self.channels_last))


@dataclass(frozen=True)
class ToTensor:
    """Hand the field out as a torch tensor (zero-copy over the batch buffer). Tensors are the Loader's default
    (``array_type="torch"``), so this op changes nothing there; it is kept so that FFCV-style pipelines read
    as before, and refused with ``array_type="numpy"``."""


@dataclass(frozen=True)
class IntDecoder:
    """An Int field as ``int64[B]`` (or ``dtype``, one of the Int field dtypes)."""

    dtype: str = "int64"

    def __post_init__(self):
        object.__setattr__(self, "dtype", check.dtype_name("IntDecoder.dtype", self.dtype, INT_DTYPES))


@dataclass(frozen=True)
class FloatDecoder:
    """A Float field as ``float32[B]`` (or ``dtype``: "float16", "float32" or "float64")."""

    dtype: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "dtype", check.dtype_name("FloatDecoder.dtype", self.dtype, FLOAT_DTYPES))


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
class PadTokens:
    """A TokenIds field (e.g. captions) as model-ready rows of ``max_length`` columns: the field's key holds
    ``input_ids`` (int64[B, max_length]: the record's ids, then ``pad_id``) and ``<field>_attention_mask``
    (int64[B, max_length]: 1 on ids, 0 on padding), what a Hugging Face tokenizer returns with
    ``padding="max_length", truncation=True, max_length=max_length``.

    A record longer than ``max_length`` keeps its first ``max_length`` ids; with ``keep_last_token=True`` its
    first ``max_length - 1`` and its own last id (the end-of-text token CLIP's tokenizers always end a truncated
    caption with: ``open_clip.tokenize``, and ``CLIPTokenizer`` with ``truncation=True``); with
    ``truncation=False`` it is a DecodeError naming the file, sample and field. Without a pipeline a TokenIds
    field is padded with 0 to its longest record.

    ``packing="best_fit"``: records packed whole into rows of ``max_length`` columns (SFT and vision-language
    conversations; formats/packing.md section 8), never split: best-fit decreasing of the records' lengths
    (image tokens counted, with :class:`ExpandImageTokens`) within groups of ``pack_pages`` consecutive pages
    (None: the whole file); the rows are then the records the order, ``len``, ranks and resume count. The batch
    also holds ``<field>_labels`` (-100 on each record's first token, image tokens, mask-0 tokens and padding),
    ``<field>_position_ids`` (int64[B, L], restarting at 0 in every record and in the padding),
    ``<field>_cu_seqlens`` (int32[S + 1] over the flattened batch) and ``<field>_max_seqlen`` (int). A record
    longer than ``max_length`` fills a row alone, cut as above, or is a ValueError naming the file, sample and
    field when the Loader is built with ``truncation=False``. An RGBImages field of the file is then handed out
    per row (every image of the row's records, in token order)."""

    max_length: int
    pad_id: int = 0
    truncation: bool = True
    keep_last_token: bool = False
    packing: str | None = None
    pack_pages: int | None = 1

    def __post_init__(self):
        object.__setattr__(self, "max_length", check.integer("PadTokens.max_length", self.max_length, minimum=1,
                                                             maximum=1 << 24))
        object.__setattr__(self, "pad_id", check.integer("PadTokens.pad_id", self.pad_id, minimum=0,
                                                         maximum=(1 << 32) - 1))
        object.__setattr__(self, "truncation", check.boolean("PadTokens.truncation", self.truncation))
        object.__setattr__(self, "keep_last_token", check.boolean("PadTokens.keep_last_token",
                                                                  self.keep_last_token))
        object.__setattr__(self, "packing", None if self.packing is None else
                           check.choice("PadTokens.packing", self.packing, ("best_fit",)))
        object.__setattr__(self, "pack_pages",
                           check.integer("PadTokens.pack_pages", self.pack_pages, minimum=1, optional=True))


@dataclass(frozen=True)
class ExpandImageTokens:
    """A conversation's image placeholders as the image tokens a vision-language model reads: each stored
    ``image_token_id`` becomes ``tokens_per_image`` copies of itself, as transformers' ``LlavaProcessor``
    expands ``<image>`` (LLaVA-1.5 at 336 px: ``(336 // 14) ** 2 = 576``). Goes first in a TokenIds field's
    pipeline, before :class:`PadTokens` (``[ExpandImageTokens(...), PadTokens(max_length)]``).

    The batch then also holds ``<field>_labels`` (int64[B, L]: the id, or -100 on image tokens, padding and
    tokens whose stored loss mask is 0; labels are not shifted, as Hugging Face models shift them). ``images``:
    the RGBImages field of the same record whose image count must equal the number of placeholders (else a
    DecodeError naming the file, sample and both counts); None checks nothing. A row whose expanded length
    exceeds ``max_length`` is cut after its last image only (``truncation=True``); cutting into an image's tokens
    is a DecodeError (the model would get fewer image tokens than image features). Without ``tokens_per_image``
    (dynamic resolution, Qwen2-VL), ``images`` must name an RGBImages field loaded with :class:`SmartResize`:
    each placeholder then becomes that image's ``grid_h * grid_w / merge_size**2`` tokens (transformers'
    ``Qwen2VLProcessor`` expands ``<|image_pad|>`` so)."""

    image_token_id: int
    tokens_per_image: int | None = None
    images: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "image_token_id", check.integer("ExpandImageTokens.image_token_id",
                                                                 self.image_token_id, minimum=0,
                                                                 maximum=(1 << 32) - 1))
        object.__setattr__(self, "tokens_per_image", check.integer("ExpandImageTokens.tokens_per_image",
                                                                   self.tokens_per_image, minimum=1,
                                                                   maximum=1 << 20, optional=True))
        if self.images is not None and (not isinstance(self.images, str) or not self.images):
            raise TypeError(f"ExpandImageTokens.images is the name of an RGBImages field (a str) or None, got "
                            f"{self.images!r}")
        if self.tokens_per_image is None and self.images is None:
            raise ValueError("ExpandImageTokens needs tokens_per_image (a fixed image size, e.g. 576 for LLaVA-1.5) "
                             "or images=<an RGBImages field loaded with SmartResize> (tokens per image from each "
                             "image's size)")


@dataclass(frozen=True)
class TokenWindows:
    """Token-file pipeline: windows of ``seq_len + 1`` tokens at stride ``seq_len`` (chosen at load time, never
    stored): ``input`` = window[:-1] and ``target`` = window[1:], ``[B, seq_len]``, int64 (``input_dtype``
    "int32" halves the input copy). With ``document_outputs=True`` the batch also holds ``position_ids``
    (int64[B, L], 0 at each row start and after each EOS), ``doc_ids`` (int32[B, L]), ``labels`` (int64[B, L],
    target with -100 where the input is EOS), ``cu_seqlens`` (int32[S + 1] over the flattened batch) and
    ``max_seqlen`` (int); see ``pageset.ops.tokens`` for the exact segment rules.

    ``packing="best_fit"``: rows of packed documents instead of stride windows (formats/packing.md): each
    document (cut into pieces of ``seq_len + 1`` tokens overlapping by one when longer, or ValueError naming the
    file and document with ``split_documents=False``) is packed by best-fit decreasing into rows of ``seq_len``
    columns, within groups of ``pack_pages`` consecutive pages (None: the whole file); the rows are the records
    (``len``, order, ``indices=``, resume). The batch then always holds the document outputs: ``position_ids``
    (restarting in every piece), ``doc_ids`` (int32, -1 on padding), ``labels`` and ``target`` (-100 on padding,
    labels also where a loss mask is 0), ``cu_seqlens`` (int32, over the flattened batch: every piece and each
    row's padding a segment) and ``max_seqlen``."""

    seq_len: int
    document_outputs: bool = False
    input_dtype: str = "int64"
    packing: str | None = None
    pack_pages: int | None = 1
    split_documents: bool = True

    def __post_init__(self):
        object.__setattr__(self, "seq_len", check.integer("TokenWindows.seq_len", self.seq_len, minimum=1))
        object.__setattr__(self, "document_outputs",
                           check.boolean("TokenWindows.document_outputs", self.document_outputs))
        object.__setattr__(self, "input_dtype",
                           check.dtype_name("TokenWindows.input_dtype", self.input_dtype, ("int64", "int32")))
        object.__setattr__(self, "packing", None if self.packing is None else
                           check.choice("TokenWindows.packing", self.packing, ("best_fit",)))
        object.__setattr__(self, "pack_pages",
                           check.integer("TokenWindows.pack_pages", self.pack_pages, minimum=1, optional=True))
        object.__setattr__(self, "split_documents",
                           check.boolean("TokenWindows.split_documents", self.split_documents))
