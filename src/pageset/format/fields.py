"""Field descriptors: what a record holds, how it is stored, and which index columns it owns.

A field is a small frozen dataclass. The writer encodes values with it, the reader decodes them, and the
schema stores ``{"name", "kind", "params"}`` for each one. Scalars (:class:`Int`, :class:`Float`) live in the
index row itself; every other kind stores its bytes in the pages and owns ``<name>.offset`` and
``<name>.length`` index columns (absolute file offset and byte length).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import arguments as check
from .constants import FLOAT_DTYPES, INT_DTYPES, NDARRAY_DTYPES, TOKEN_DTYPES
from .layout import IMAGE_COLUMNS, IMAGES_COLUMNS, SPAN_COLUMNS


def little_endian(dtype: str) -> str:
    """The explicit little-endian dtype string of a numpy dtype name (``"int32"`` -> ``"<i4"``)."""
    dt = np.dtype(dtype)
    return dt.newbyteorder("<").str if dt.itemsize > 1 else dt.str


@dataclass(frozen=True)
class Field:
    """Base class of all fields. Subclasses set ``kind`` and may add parameters (all JSON-serialisable)."""

    kind: ClassVar[str] = ""
    inline: ClassVar[bool] = False  # True: the value lives in the index row, no bytes in the pages

    def columns(self, name: str) -> list[tuple[str, str]]:
        """Index columns ``[(column_name, little-endian dtype string), ...]`` this field owns."""
        return [(f"{name}.{c}", dt) for c, dt in SPAN_COLUMNS]

    def params(self) -> dict:
        """Parameters as a JSON-serialisable dict (stored in the schema)."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check (and normalise: dtype names, shape tuples) the parameters; raises ``TypeError`` for a wrong kind
        of value and ``ValueError`` for one out of range, naming the parameter and what it accepts. Runs at
        construction."""

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # frozen dataclass: normalised values are set once, in validate()


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class RGBImage(Field):
    """An RGB image, stored as JPEG or as raw HWC uint8 pixels.

    Parameters:
        max_resolution: longest side in pixels after writing; larger images are shrunk (aspect kept, Pillow
            LANCZOS); smaller images are never enlarged. ``None`` keeps every size.
        encoding: ``"jpeg"``, ``"raw"`` or ``"auto"``. ``"auto"`` encodes JPEG and keeps it when the raw pixels
            (``height * width * 3`` bytes) would be more than ``auto_raw_ratio`` times larger than the JPEG;
            otherwise it stores raw pixels (small or noisy images, where JPEG saves little space but still costs
            a decode per read). An image with a side over 65,500 pixels (JPEG's limit) is always stored raw.
        jpeg_quality: 1-100, Pillow/libjpeg quality.
        jpeg_subsampling: chroma subsampling, ``"4:4:4"``, ``"4:2:2"`` or ``"4:2:0"``.
        auto_raw_ratio: the ratio used by ``"auto"`` (default 4.0).
        jpeg_passthrough: with ``encoding="jpeg"``, store a JPEG input's own bytes (no re-encoding: no
            generation loss, faster conversion) when that is equivalent to converting it: 8-bit RGB or grayscale
            (gray is decoded to RGB by the loader), no EXIF rotation, no shrink needed. Progressive files stay
            progressive (slower to decode). Other inputs are converted as usual. The kept file is checked by
            a decode at the 1/8 DCT scale (a truncated or corrupt file is an error, as when converting it).
        jpeg_draft: a JPEG input at least ``4 * max_resolution`` on its longer side is decoded at a reduced DCT
            scale (libjpeg's scaled IDCT, 1/2 to 1/8; Pillow's ``Image.draft``) that still keeps at least twice
            the target size, then shrunk with LANCZOS as usual: 2x less CPU on large photos, at PSNR >= 44.9 dB
            against a full decode + LANCZOS (mean 55-65 dB; the 58 wheel and Debian JPEG photos at max_resolution
            224-512). ``False`` decodes every input in full.
        jpeg_restart: restart intervals per MCU row of each JPEG the writer encodes (0: none, the default). With
            ``n >= 1`` every MCU row (16 pixels for 4:2:0) is cut into at most ``n`` equal intervals (DRI/RSTn,
            ITU-T T.81 B.2.4.4; the interval length divides the row, so a row of a prime number of MCUs is one
            interval), and the loader entropy-decodes only the intervals that cover a crop
            (:mod:`pageset.ops.jpeg_restart`), with the same pixels. Costs bytes (RSTn markers, byte alignment,
            restarted DC prediction) and turns off libjpeg-turbo's fast Huffman decoder for the whole file: see
            the README's image table for what it gains. Inputs kept by ``jpeg_passthrough`` keep their own
            markers (any restart interval that tiles the MCU rows is used too). Not in the schema when 0.

    Conversion at write time: EXIF orientation is applied; grayscale, palette, CMYK, and images with alpha are
    converted to RGB (alpha is dropped, not composited; composite yourself beforehand if you need a
    background colour). A JPEG input that needs no shrink and already has ``jpeg_subsampling`` is re-encoded
    from its YCbCr planes (no RGB round trip, so closer to the input); other JPEGs are decoded to the same RGB
    pixels as Pillow's decoder gives. Index columns: ``.offset``, ``.length``, ``.height`` and ``.width`` (u32 pixels),
    ``.encoding`` (u8: 0 raw, 1 jpeg).
    """

    kind: ClassVar[str] = "rgb_image"
    max_resolution: int | None = None
    encoding: str = "jpeg"
    jpeg_quality: int = 90
    jpeg_subsampling: str = "4:2:0"
    auto_raw_ratio: float = 4.0
    jpeg_passthrough: bool = False
    jpeg_draft: bool = True
    jpeg_restart: int = 0

    def params(self) -> dict:
        params = super().params()
        if not params["jpeg_restart"]:
            del params["jpeg_restart"]  # files written without restart intervals keep their schema bytes
        return params

    def columns(self, name: str) -> list[tuple[str, str]]:
        return super().columns(name) + [(f"{name}.{c}", dt) for c, dt in IMAGE_COLUMNS]

    def validate(self) -> None:
        self._set("max_resolution", check.integer("RGBImage.max_resolution", self.max_resolution, minimum=1,
                                                  optional=True))
        check.choice("RGBImage.encoding", self.encoding, ("jpeg", "raw", "auto"))
        self._set("jpeg_quality", check.integer("RGBImage.jpeg_quality", self.jpeg_quality, minimum=1, maximum=100))
        check.choice("RGBImage.jpeg_subsampling", self.jpeg_subsampling, ("4:4:4", "4:2:2", "4:2:0"))
        check.real("RGBImage.auto_raw_ratio", self.auto_raw_ratio, low=0, low_open=True)  # kept as given: schema
        self._set("jpeg_passthrough", check.boolean("RGBImage.jpeg_passthrough", self.jpeg_passthrough))
        self._set("jpeg_draft", check.boolean("RGBImage.jpeg_draft", self.jpeg_draft))
        self._set("jpeg_restart", check.integer("RGBImage.jpeg_restart", self.jpeg_restart, minimum=0, maximum=64))


@dataclass(frozen=True)
class RGBImages(Field):
    """Zero or more RGB images per record (a conversation's images for vision-language training), each stored as
    :class:`RGBImage` stores one: JPEG or raw HWC uint8 pixels, shrunk to ``max_resolution`` on its longer side.

    The writer takes a list (or tuple) of image values, each anything :class:`RGBImage` takes (a path, bytes, a
    PIL image, an HWC uint8 array); an empty list is a record without images. Parameters are RGBImage's
    (``max_resolution``, ``encoding``, ``jpeg_quality``, ``jpeg_subsampling``, ``auto_raw_ratio``,
    ``jpeg_draft``), applied to every image. Stored bytes: a little-endian u32 image count, one 16-byte entry
    per image (height, width, byte length: <u4; encoding: u1; 3 zero bytes), then the images' bytes back to
    back (formats/v1.md section 5). Index columns: ``.offset``, ``.length`` and ``.count`` (u32 images). The
    loader decodes every image of a batch with the image kernels (:class:`pageset.CenterCrop` /
    :class:`pageset.RandomResizedCrop` pipelines) into ``[B, max_images, ...]`` and hands out
    ``<name>_counts``."""

    kind: ClassVar[str] = "rgb_images"
    max_resolution: int | None = None
    encoding: str = "jpeg"
    jpeg_quality: int = 90
    jpeg_subsampling: str = "4:2:0"
    auto_raw_ratio: float = 4.0
    jpeg_draft: bool = True

    def columns(self, name: str) -> list[tuple[str, str]]:
        return super().columns(name) + [(f"{name}.{c}", dt) for c, dt in IMAGES_COLUMNS]

    def validate(self) -> None:
        self.image()  # the same checks as RGBImage's, naming RGBImage's parameters

    def image(self) -> RGBImage:
        """The :class:`RGBImage` each image is encoded with."""
        return RGBImage(**self.params())


@dataclass(frozen=True)
class Int(Field):
    """An integer scalar stored in the index row. ``dtype``: one of ``INT_DTYPES`` (default ``"int64"``).

    Values must be Python/numpy integers (or bools) that fit the dtype; anything else is an error.
    """

    kind: ClassVar[str] = "int"
    inline: ClassVar[bool] = True
    dtype: str = "int64"

    def columns(self, name: str) -> list[tuple[str, str]]:
        return [(name, little_endian(self.dtype))]

    def validate(self) -> None:
        self._set("dtype", check.dtype_name("Int.dtype", self.dtype, INT_DTYPES))


@dataclass(frozen=True)
class Float(Field):
    """A floating-point scalar stored in the index row. ``dtype``: one of ``FLOAT_DTYPES`` (default float64)."""

    kind: ClassVar[str] = "float"
    inline: ClassVar[bool] = True
    dtype: str = "float64"

    def columns(self, name: str) -> list[tuple[str, str]]:
        return [(name, little_endian(self.dtype))]

    def validate(self) -> None:
        self._set("dtype", check.dtype_name("Float.dtype", self.dtype, FLOAT_DTYPES))


@dataclass(frozen=True)
class NDArray(Field):
    """A fixed-shape array of ``dtype`` (one of ``NDARRAY_DTYPES``), stored C-order little-endian in the pages.

    Values are cast to ``dtype`` only when numpy's ``"safe"`` casting allows it (``int16 -> float32`` yes,
    ``float64 -> float32`` no: that would lose precision silently); the shape must match exactly.
    """

    kind: ClassVar[str] = "ndarray"
    dtype: str = "float32"
    shape: tuple = ()

    def validate(self) -> None:
        self._set("dtype", check.dtype_name("NDArray.dtype", self.dtype, NDARRAY_DTYPES))
        self._set("shape", check.ints_tuple("NDArray.shape", self.shape, minimum=0))

    @property
    def nbytes(self) -> int:
        """Bytes of one value: ``prod(shape) * itemsize``."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Bytes(Field):
    """A variable-length byte string (``bytes``, ``bytearray``, ``memoryview`` or a uint8 array)."""

    kind: ClassVar[str] = "bytes"


@dataclass(frozen=True)
class JSON(Field):
    """A JSON value (dict, list, str, number, bool, None), stored as canonical UTF-8 JSON (sorted keys)."""

    kind: ClassVar[str] = "json"


@dataclass(frozen=True)
class Tokens(Field):
    """The token stream of a token file (format 1.1): the whole data area is one flat little-endian stream of
    ``dtype`` (``"uint16"`` or ``"uint32"``) token ids, documents described by the ``doc_offsets`` section.

    A token file has exactly this one field and no records (``record_count`` 0, an empty index), so the field
    owns no index columns. Write one with :func:`pageset.write_tokens`; read it with :func:`pageset.open_tokens`.
    """

    kind: ClassVar[str] = "tokens"
    inline: ClassVar[bool] = True  # no per-record bytes or columns: the stream is described by doc_offsets
    dtype: str = "uint16"

    def columns(self, name: str) -> list[tuple[str, str]]:
        return []

    def validate(self) -> None:
        self._set("dtype", check.dtype_name("Tokens.dtype", self.dtype, TOKEN_DTYPES))


@dataclass(frozen=True)
class TokenIds(Field):
    """A variable-length sequence of token ids per record, e.g. an image's caption for CLIP-style training:
    stored as little-endian ``dtype`` (``"uint16"`` or ``"uint32"``) values back to back in the pages, so a
    value of n ids is ``n * itemsize`` bytes (``.offset``/``.length`` columns, length in bytes).

    The writer takes a 1-D sequence or array of ints, each in ``[0, max of dtype]`` (a tokenizer's ids, e.g.
    ``tokenizer(caption)["input_ids"]``); anything else is a ValueError naming the sample and field. The loader
    pads or truncates each row to a fixed length with :class:`pageset.PadTokens` (``input_ids`` and
    ``attention_mask`` as Hugging Face tokenizers return them with ``padding="max_length"``).

    ``loss_mask=True`` stores a conversation's per-token loss mask with its ids (what
    :class:`pageset.ChatTokenizer` returns, or a tokenizer's ``apply_chat_template(...,
    return_assistant_tokens_mask=True)``): the writer then takes ``{"input_ids": ids, "loss_mask": mask}``
    (``"assistant_masks"`` is taken for ``"loss_mask"``) with one 0/1 value per id, stored as the n ids followed
    by n mask bytes; the loader adds ``<name>_labels`` (the id where the mask is 1, else -100)."""

    kind: ClassVar[str] = "token_ids"
    dtype: str = "uint16"
    loss_mask: bool = False

    def params(self) -> dict:
        params = super().params()
        if not params["loss_mask"]:
            del params["loss_mask"]  # files without a loss mask keep their schema bytes
        return params

    def validate(self) -> None:
        self._set("dtype", check.dtype_name("TokenIds.dtype", self.dtype, TOKEN_DTYPES))
        self._set("loss_mask", check.boolean("TokenIds.loss_mask", self.loss_mask))

    @property
    def record_width(self) -> int:
        """Bytes a stored id takes: the dtype's itemsize, plus a mask byte with ``loss_mask``."""
        return np.dtype(self.dtype).itemsize + (1 if self.loss_mask else 0)


FIELD_KINDS: dict[str, type[Field]] = {
    cls.kind: cls for cls in (RGBImage, RGBImages, Int, Float, NDArray, Bytes, JSON, Tokens, TokenIds)
}


def field_from_schema(kind: str, params: dict) -> Field:
    """Rebuild a field from its schema entry; raises ``KeyError`` (unknown kind) or ``TypeError``/``ValueError``."""
    cls = FIELD_KINDS[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(params) - names
    if unknown:
        raise ValueError(f"unknown parameters {sorted(unknown)} for field kind {kind!r}")
    field = cls(**params)
    field.validate()
    return field
