"""Encoding of one value per field kind into (payload bytes, index column values). Runs in worker processes.

Images go through Pillow: EXIF orientation, conversion to RGB, LANCZOS shrink to ``max_resolution``, then JPEG
or raw pixels (see :class:`pageset.format.RGBImage`).
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from ..format.constants import ENCODING_JPEG, ENCODING_RAW
from ..format.fields import JSON, Bytes, Field, Float, Int, NDArray, RGBImage
from ..format.schema import canonical_json

# JPEG stores sizes in 16 bits and libjpeg caps them at 65500: larger images are stored raw.
JPEG_MAX_SIDE = 65500
_SUBSAMPLING = {"4:4:4": 0, "4:2:2": 1, "4:2:0": 2}


def load_image(value) -> Image.Image:
    """A PIL image from a PIL image, an HWC/HW uint8 array, encoded bytes or a path; raises ValueError."""
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, (str, os.PathLike)):
        with open(value, "rb") as f:
            data = f.read()
        if not data:
            raise ValueError(f"image file {os.fspath(value)!r} is empty (0 bytes)")
        return _open_bytes(data, f"image file {os.fspath(value)!r}")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _open_bytes(bytes(value), "encoded image bytes")
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8:
            raise ValueError(f"image arrays must be uint8 HWC, got dtype {value.dtype}; convert with .astype(np.uint8)")
        if value.ndim == 2 or (value.ndim == 3 and value.shape[2] in (1, 3, 4)):
            arr = value[:, :, 0] if value.ndim == 3 and value.shape[2] == 1 else value
            return Image.fromarray(np.ascontiguousarray(arr))
        raise ValueError(f"image arrays must be HxW or HxWxC with C in (1, 3, 4), got shape {value.shape}")
    raise ValueError(f"cannot read an image from {type(value).__name__}; give a path, bytes, PIL image or uint8 array")


def _open_bytes(data: bytes, what: str) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Exception as exc:  # Pillow raises many types: UnidentifiedImageError, OSError, SyntaxError...
        detail = re.sub(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "the data", str(exc))
        raise ValueError(f"{what} could not be decoded as an image ({type(exc).__name__}: {detail})") from exc
    return img


def to_rgb(img: Image.Image) -> Image.Image:
    """Apply the EXIF orientation and convert any mode to RGB (alpha dropped; palette and CMYK converted)."""
    img = ImageOps.exif_transpose(img)
    if img.mode == "RGB":
        return img
    if img.mode == "P":  # palette with a transparency entry converts via RGBA; alpha is then dropped
        img = img.convert("RGBA")
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16/32-bit grayscale: scale to 8 bits, do not clip
        arr = np.asarray(img, dtype=np.float64)
        hi = 65535.0 if img.mode.startswith("I;16") else max(float(arr.max()), 1.0)
        img = Image.fromarray(np.clip(arr * (255.0 / hi) + 0.5, 0, 255).astype(np.uint8))
    return img.convert("RGB")


def shrink(img: Image.Image, max_resolution: int | None) -> Image.Image:
    """Shrink so that the longer side is ``max_resolution`` (LANCZOS, aspect kept); never enlarge."""
    w, h = img.size
    if max_resolution is None or max(w, h) <= max_resolution:
        return img
    scale = max_resolution / max(w, h)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return img.resize(size, Image.LANCZOS)


def encode_image(value, field: RGBImage) -> tuple[bytes, dict]:
    """Payload and index columns (height, width, encoding) of one image value."""
    src = load_image(value)
    if field.jpeg_passthrough and field.encoding == "jpeg":
        kept = _passthrough(value, src, field.max_resolution)
        if kept is not None:
            w, h = src.size
            return kept, {"height": h, "width": w, "encoding": ENCODING_JPEG}
    img = shrink(to_rgb(src), field.max_resolution)
    w, h = img.size
    if field.encoding == "raw" or max(w, h) > JPEG_MAX_SIDE:
        return np.asarray(img, dtype=np.uint8).tobytes(), {"height": h, "width": w, "encoding": ENCODING_RAW}
    buf = io.BytesIO()
    # Pillow's JPEG writer is deterministic for fixed settings; no EXIF or ICC goes into the stored bytes.
    img.save(buf, format="JPEG", quality=field.jpeg_quality, subsampling=_SUBSAMPLING[field.jpeg_subsampling])
    jpeg = buf.getvalue()
    if field.encoding == "auto" and h * w * 3 <= field.auto_raw_ratio * len(jpeg):
        return np.asarray(img, dtype=np.uint8).tobytes(), {"height": h, "width": w, "encoding": ENCODING_RAW}
    return jpeg, {"height": h, "width": w, "encoding": ENCODING_JPEG}


def _passthrough(value, img: Image.Image, max_resolution: int | None) -> bytes | None:
    """The input's own JPEG bytes when storing them unchanged is equivalent to converting: an 8-bit RGB/YCbCr or
    grayscale JPEG (the loader's decoder replicates gray to RGB) without an EXIF rotation, that needs no shrink.
    ``None`` otherwise (CMYK, rotated, too large, or not given as bytes / a path)."""
    if img.format != "JPEG" or img.mode not in ("RGB", "L"):
        return None
    if img.getexif().get(0x0112, 1) != 1:
        return None
    if max_resolution is not None and max(img.size) > max_resolution:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (str, os.PathLike)):
        with open(value, "rb") as f:
            return f.read()
    return None


def encode_scalar(value, field: Int | Float):
    """The value as a numpy scalar of the field's dtype; raises ValueError when it does not fit exactly."""
    dt = np.dtype(field.dtype)
    if isinstance(field, Int):
        if isinstance(value, (bool, np.bool_)) or dt == np.bool_:
            if not isinstance(value, (bool, np.bool_, int, np.integer)) or (dt == np.bool_ and value not in (0, 1)):
                raise ValueError(f"expected a bool for dtype {dt}, got {value!r}")
            return dt.type(value)
        if not isinstance(value, (int, np.integer)):
            raise ValueError(f"expected an integer, got {type(value).__name__} {value!r}")
        info = np.iinfo(dt)
        if not info.min <= int(value) <= info.max:
            raise ValueError(f"{value} does not fit {dt} [{info.min}, {info.max}]; choose a wider Int(dtype=...)")
        return dt.type(value)
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_)):
        raise ValueError(f"expected a float, got {type(value).__name__} {value!r}")
    return dt.type(value)


def encode_ndarray(value, field: NDArray) -> bytes:
    """C-order little-endian bytes of the array; raises ValueError on a shape or unsafe dtype mismatch."""
    arr = np.asarray(value)
    want = np.dtype(field.dtype)
    if arr.dtype != want and not np.can_cast(arr.dtype, want, casting="safe"):
        raise ValueError(
            f"array of dtype {arr.dtype} cannot be stored as {want} without losing information; "
            f"cast it yourself (e.g. .astype(np.{want.name})) or declare NDArray(dtype={arr.dtype.name!r})"
        )
    if arr.shape != field.shape:
        raise ValueError(f"array shape {arr.shape} does not match the field's shape {field.shape}")
    return np.ascontiguousarray(arr, dtype=want.newbyteorder("<")).tobytes()


def encode_bytes(value) -> bytes:
    """The value as bytes (bytes-like or a uint8 array)."""
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8:
            raise ValueError(f"Bytes fields take bytes or uint8 arrays, got an array of {value.dtype}")
        return value.tobytes()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise ValueError(f"Bytes fields take bytes, bytearray, memoryview or uint8 arrays, got {type(value).__name__}")


def encode_value(value, field: Field) -> tuple[bytes | None, dict]:
    """Encode one value: ``(payload or None for inline fields, {column suffix or "": value})``."""
    if isinstance(field, RGBImage):
        return encode_image(value, field)
    if isinstance(field, (Int, Float)):
        return None, {"": encode_scalar(value, field)}
    if isinstance(field, NDArray):
        return encode_ndarray(value, field), {}
    if isinstance(field, Bytes):
        return encode_bytes(value), {}
    if isinstance(field, JSON):
        try:
            return canonical_json(value), {}
        except (TypeError, ValueError) as exc:
            raise ValueError(f"value is not JSON-serialisable: {exc}") from exc
    raise TypeError(f"unknown field type {type(field).__name__}")


def describe_path(value) -> str:
    """A short description of where a value came from, for error messages (the path when it is one)."""
    return f" ({os.fspath(value)})" if isinstance(value, (str, Path)) else ""
