"""Encoding of one value per field kind into (payload bytes, index column values). Runs in worker processes.

Images go through Pillow: EXIF orientation, conversion to RGB, LANCZOS shrink to ``max_resolution``, then JPEG
or raw pixels (see :class:`pageset.format.RGBImage`). A JPEG input at least twice ``max_resolution`` is decoded
at a reduced DCT scale first (``jpeg_draft``); a JPEG input that needs no conversion may be kept as given
(``jpeg_passthrough``), validated by a 1/8-scale decode instead of a full one.
"""

from __future__ import annotations

import io
import os
import re
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from ..format.constants import ENCODING_JPEG, ENCODING_RAW
from ..format.fields import JSON, Bytes, Field, Float, Int, NDArray, RGBImage, RGBImages, TokenIds
from ..format.layout import IMAGES_ENTRY
from ..format.schema import canonical_json
from . import turbo

# JPEG stores sizes in 16 bits and libjpeg caps them at 65500: larger images are stored raw.
JPEG_MAX_SIDE = 65500
_SUBSAMPLING = {"4:4:4": 0, "4:2:2": 1, "4:2:0": 2}
# jpeg_draft keeps at least this many times the target size before the LANCZOS step (Pillow's thumbnail()
# calls it reducing_gap): at 2.0, PSNR >= 44.9 dB (mean 55-65) against a full decode on the real photos; 1.0 went
# down to 36 dB.
DRAFT_GAP = 2.0
_ORIENTATION = 0x0112
# How each EXIF orientation's transpose (ImageOps.exif_transpose) moves the margins (left, top, right, bottom)
# of an image: the indices of the old margins that become the new left, top, right and bottom.
_MARGIN_MOVES = {1: (0, 1, 2, 3), 2: (2, 1, 0, 3), 3: (2, 3, 0, 1), 4: (0, 3, 2, 1), 5: (1, 0, 3, 2),
                 6: (3, 0, 1, 2), 7: (3, 2, 1, 0), 8: (1, 2, 3, 0)}


def load_image(value) -> Image.Image:
    """A decoded PIL image from a PIL image, an HWC/HW uint8 array, encoded bytes or a path; raises ValueError."""
    img = open_image(value)
    decode(img, value)
    return img


def open_image(value) -> Image.Image:
    """Like :func:`load_image`, but an encoded input (a path or bytes) is only opened: its header is parsed and
    its pixels are decoded by :func:`decode` (so a JPEG can still be drafted). Raises ValueError."""
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, (str, os.PathLike)):
        with open(value, "rb") as f:
            data = f.read()
        if not data:
            raise ValueError(f"image file {os.fspath(value)!r} is empty (0 bytes)")
        return _open_bytes(data, _what(value))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _open_bytes(bytes(value), _what(value))
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8:
            raise ValueError(f"image arrays must be uint8 HWC, got dtype {value.dtype}; convert with .astype(np.uint8)")
        if value.ndim == 2 or (value.ndim == 3 and value.shape[2] in (1, 3, 4)):
            arr = value[:, :, 0] if value.ndim == 3 and value.shape[2] == 1 else value
            return Image.fromarray(np.ascontiguousarray(arr))
        raise ValueError(f"image arrays must be HxW or HxWxC with C in (1, 3, 4), got shape {value.shape}")
    raise ValueError(f"cannot read an image from {type(value).__name__}; give a path, bytes, PIL image or uint8 array")


def _what(value) -> str:
    return f"image file {os.fspath(value)!r}" if isinstance(value, (str, os.PathLike)) else "encoded image bytes"


def _open_bytes(data: bytes, what: str) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data))
    except Exception as exc:  # Pillow raises many types: UnidentifiedImageError, OSError, SyntaxError...
        raise _not_an_image(what, exc) from exc
    img.pageset_bytes = data  # the input's own bytes, for jpeg_passthrough
    return img


def decode(img: Image.Image, value) -> None:
    """Decode the pixels of an image from :func:`open_image` (no-op when already decoded); raises ValueError."""
    try:
        img.load()
    except Exception as exc:
        raise _not_an_image(_what(value), exc) from exc


def _not_an_image(what: str, exc: Exception) -> ValueError:
    detail = re.sub(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "the data", str(exc))
    return ValueError(f"{what} could not be decoded as an image ({type(exc).__name__}: {detail})")


def to_rgb(img: Image.Image) -> Image.Image:
    """Apply the EXIF orientation and convert any mode to RGB (alpha dropped; palette and CMYK converted)."""
    if img.getexif().get(_ORIENTATION, 1) in range(2, 9):  # exif_transpose would copy the image for nothing
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


def target_size(size: tuple[int, int], max_resolution: int | None) -> tuple[int, int] | None:
    """(width, height) with the longer side ``max_resolution`` (aspect kept), or None when no shrink is needed."""
    w, h = size
    if max_resolution is None or max(w, h) <= max_resolution:
        return None
    scale = max_resolution / max(w, h)
    return max(1, round(w * scale)), max(1, round(h * scale))


def shrink(img: Image.Image, max_resolution: int | None) -> Image.Image:
    """Shrink so that the longer side is ``max_resolution`` (LANCZOS, aspect kept); never enlarge."""
    size = target_size(img.size, max_resolution)
    return img if size is None else img.resize(size, Image.LANCZOS)


def draft(img: Image.Image, max_resolution: int | None) -> tuple[tuple[int, int], tuple, int] | None:
    """Before decoding a JPEG that needs a shrink: pick libjpeg's DCT scale (1/2, 1/4 or 1/8) that keeps at
    least ``DRAFT_GAP`` times the target size (``Image.draft``). Returns ``(target size, box, denom)``: the size
    and box for the LANCZOS step, both in display orientation (after EXIF transposing; the box is the area of the
    decoded pixels that the original image covers, as a scaled decode rounds sizes up), and the scale's
    denominator (2, 4 or 8). None when no scale was applied."""
    if img.format != "JPEG" or not hasattr(img, "pageset_bytes"):
        return None
    size = target_size(img.size, max_resolution)
    if size is None:
        return None
    full = img.size
    res = img.draft(None, (max(1, int(size[0] * DRAFT_GAP)), max(1, int(size[1] * DRAFT_GAP))))
    if res is None or img.size == full:
        return None
    box = res[1]
    denom = round(full[0] / box[2])  # Pillow's box is (0, 0, width / scale, height / scale)
    margins = (box[0], box[1], img.size[0] - box[2], img.size[1] - box[3])
    orientation = img.getexif().get(_ORIENTATION, 1)
    moves = _MARGIN_MOVES.get(orientation, _MARGIN_MOVES[1])
    left, top, right, bottom = (margins[k] for k in moves)
    dw, dh = img.size
    if orientation in (5, 6, 7, 8):  # transposed: width and height swap
        size, dw, dh = size[::-1], dh, dw
    return size, (left, top, dw - right, dh - bottom), denom


def restart_blocks(width: int, subsampling: str, per_row: int) -> int:
    """The restart interval in MCUs for an image ``width`` pixels wide: the shortest that divides its MCU row into
    at most ``per_row`` intervals (``RGBImage.jpeg_restart``); 0 (no restart markers) when ``per_row`` is 0.
    MCUs are 8 pixels wide for 4:4:4 and 16 for 4:2:2 and 4:2:0 (ITU-T T.81 A.2.4)."""
    if not per_row:
        return 0
    mcus = -(-width // (8 if subsampling == "4:4:4" else 16))
    return next(k for k in range(1, mcus + 1) if mcus % k == 0 and mcus // k <= per_row)


def encode_image(value, field: RGBImage, stats: dict | None = None) -> tuple[bytes, dict]:
    """Payload and index columns (height, width, encoding) of one image value.

    A plain JPEG input (8-bit YCbCr/RGB/gray, no EXIF rotation) is decoded and encoded by libjpeg-turbo
    (``turbo``: the same pixels as Pillow's decode, no Pillow image copies); other inputs go through Pillow. One
    that needs no shrink and already has the field's chroma subsampling is re-encoded from its YCbCr planes
    (``yuv``: no RGB round trip) with ``encoding="jpeg"``.

    ``stats`` (for benchmarks), when given, accumulates counts ``"images"``, ``"passthrough"``, ``"yuv"``,
    ``"draft"`` and ``"turbo"`` (how often each applied) and thread CPU seconds per stage: ``"open_s"`` (read +
    header), ``"check_s"`` (passthrough's 1/8-scale check decode), ``"transcode_s"`` (the YCbCr re-encode),
    ``"decode_s"``, ``"convert_s"`` (EXIF transpose + RGB), ``"resize_s"`` and ``"encode_s"`` (JPEG encode or
    raw copy)."""
    clock = [time.thread_time()] if stats is not None else None
    src = open_image(value)
    _tick(stats, clock, "open_s", "images")
    if field.jpeg_passthrough and field.encoding == "jpeg":
        kept = _passthrough(src, value, field.max_resolution)
        if kept is not None:
            _tick(stats, clock, "check_s", "passthrough")
            w, h = src.size
            return kept, {"height": h, "width": w, "encoding": ENCODING_JPEG}
    if field.encoding == "jpeg" and _plain_jpeg(src) and target_size(src.size, field.max_resolution) is None:
        kept = turbo.transcode_yuv(src.pageset_bytes, field.jpeg_quality, _SUBSAMPLING[field.jpeg_subsampling],
                                   restart_blocks(src.size[0], field.jpeg_subsampling, field.jpeg_restart))
        if kept is not None:  # same size and subsampling: re-encoded from its YCbCr planes
            _tick(stats, clock, "transcode_s", "yuv")
            return kept[0], {"height": kept[2], "width": kept[1], "encoding": ENCODING_JPEG}
    drafted = draft(src, field.max_resolution) if field.jpeg_draft else None
    pixels = _turbo_decode(src, drafted)
    if pixels is not None:  # a plain JPEG: libjpeg-turbo decodes and encodes, Pillow only resizes
        _tick(stats, clock, "decode_s", "draft" if drafted is not None else None)
        _tick(stats, clock, "convert_s", "turbo")
        size = drafted[0] if drafted is not None else target_size(src.size, field.max_resolution)
        if size is not None:
            box = drafted[1] if drafted is not None else None
            pixels = np.asarray(Image.fromarray(pixels).resize(size, Image.LANCZOS, box=box))
        _tick(stats, clock, "resize_s")
        h, w = pixels.shape[:2]
        if field.encoding == "raw":
            raw = pixels.tobytes()
            _tick(stats, clock, "encode_s")
            return raw, {"height": h, "width": w, "encoding": ENCODING_RAW}
        jpeg = turbo.encode_rgb(pixels, field.jpeg_quality, _SUBSAMPLING[field.jpeg_subsampling],
                                restart_blocks(w, field.jpeg_subsampling, field.jpeg_restart))
        _tick(stats, clock, "encode_s")
        if field.encoding == "auto" and h * w * 3 <= field.auto_raw_ratio * len(jpeg):
            return pixels.tobytes(), {"height": h, "width": w, "encoding": ENCODING_RAW}
        return jpeg, {"height": h, "width": w, "encoding": ENCODING_JPEG}
    decode(src, value)
    _tick(stats, clock, "decode_s", "draft" if drafted is not None else None)
    rgb = to_rgb(src)
    _tick(stats, clock, "convert_s")
    if drafted is not None:
        size, box, _ = drafted
        img = rgb.resize(size, Image.LANCZOS, box=box)
    else:
        img = shrink(rgb, field.max_resolution)
    _tick(stats, clock, "resize_s")
    w, h = img.size
    if field.encoding == "raw" or max(w, h) > JPEG_MAX_SIDE:
        raw = np.asarray(img, dtype=np.uint8).tobytes()
        _tick(stats, clock, "encode_s")
        return raw, {"height": h, "width": w, "encoding": ENCODING_RAW}
    buf = io.BytesIO()
    # Pillow's JPEG writer is deterministic for fixed settings; no EXIF or ICC goes into the stored bytes.
    k = restart_blocks(w, field.jpeg_subsampling, field.jpeg_restart)
    restart = {"restart_marker_blocks": k} if k else {}
    img.save(buf, format="JPEG", quality=field.jpeg_quality, subsampling=_SUBSAMPLING[field.jpeg_subsampling],
             **restart)
    jpeg = buf.getvalue()
    _tick(stats, clock, "encode_s")
    if field.encoding == "auto" and h * w * 3 <= field.auto_raw_ratio * len(jpeg):
        return np.asarray(img, dtype=np.uint8).tobytes(), {"height": h, "width": w, "encoding": ENCODING_RAW}
    return jpeg, {"height": h, "width": w, "encoding": ENCODING_JPEG}


def _turbo_decode(img: Image.Image, drafted) -> np.ndarray | None:
    """RGB pixels of a JPEG input that needs no conversion but the shrink (8-bit YCbCr, RGB or gray, no EXIF
    rotation), decoded by libjpeg-turbo at the DCT scale ``draft`` chose (equal to Pillow's decode of the same
    bytes at that scale); None for every other input or when libjpeg-turbo reports anything (Pillow decides)."""
    if not _plain_jpeg(img):
        return None
    return turbo.decode_rgb(img.pageset_bytes, drafted[2] if drafted is not None else 1)


def _plain_jpeg(img: Image.Image) -> bool:
    """An encoded 8-bit YCbCr/RGB or gray JPEG input without an EXIF rotation."""
    return (hasattr(img, "pageset_bytes") and img.format == "JPEG" and img.mode in ("RGB", "L")
            and img.getexif().get(_ORIENTATION, 1) == 1)


def _tick(stats: dict | None, clock: list | None, stage: str, count: str | None = None) -> None:
    """Add the thread CPU time since the last tick to ``stats[stage]`` (and 1 to ``stats[count]``)."""
    if stats is None:
        return
    now = time.thread_time()
    stats[stage] = stats.get(stage, 0.0) + now - clock[0]
    clock[0] = now
    if count is not None:
        stats[count] = stats.get(count, 0) + 1


def _passthrough(img: Image.Image, value, max_resolution: int | None) -> bytes | None:
    """The input's own JPEG bytes when storing them unchanged is equivalent to converting: an 8-bit RGB/YCbCr or
    grayscale JPEG (the loader's decoder replicates gray to RGB) without an EXIF rotation, that needs no shrink.
    ``None`` otherwise (CMYK, rotated, too large, or not given as bytes / a path). The file is checked by a
    decode at the 1/8 DCT scale (the whole entropy-coded scan is read, so a truncated or corrupt file raises
    ValueError here, as it would when converted), about half the cost of a full decode."""
    data = getattr(img, "pageset_bytes", None)
    if data is None or img.format != "JPEG" or img.mode not in ("RGB", "L"):
        return None
    if img.getexif().get(_ORIENTATION, 1) != 1:
        return None
    if max_resolution is not None and max(img.size) > max_resolution:
        return None
    check = Image.open(io.BytesIO(data))
    check.draft(None, (1, 1))
    decode(check, value)
    return data


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


def encode_token_ids(value, field: TokenIds) -> bytes:
    """Little-endian ``field.dtype`` bytes of a 1-D sequence of token ids (then one 0/1 byte per id with
    ``loss_mask``); ValueError (what is wrong and the fix) for anything but ints in ``[0, max of dtype]``."""
    mask = None
    if field.loss_mask:
        if not isinstance(value, dict) or "input_ids" not in value:
            raise ValueError(f"TokenIds(loss_mask=True) fields take {{'input_ids': ids, 'loss_mask': mask}} (a "
                             f"ChatTokenizer's output), got {type(value).__name__}")
        key = "loss_mask" if "loss_mask" in value else "assistant_masks"
        if key not in value:
            raise ValueError("TokenIds(loss_mask=True) fields take {'input_ids': ids, 'loss_mask': mask}; the "
                             f"value has no 'loss_mask' (keys {sorted(value)})")
        value, mask = value["input_ids"], np.asarray(value[key])
    elif isinstance(value, dict):
        raise ValueError("TokenIds fields take a 1-D sequence of token ids, got a dict; a conversation's ids with "
                         "its loss mask need TokenIds(loss_mask=True)")
    if isinstance(value, (str, bytes, bytearray)):
        raise ValueError(f"TokenIds fields take a 1-D sequence of token ids, got {type(value).__name__}; tokenize "
                         "the text first, e.g. tokenizer(text)['input_ids']")
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"TokenIds fields take a 1-D sequence of token ids, got an array of shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"TokenIds fields take integer token ids, got {arr.dtype} values; pass the tokenizer's "
                         "ids (ints)")
    want = np.dtype(field.dtype)
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        top = np.iinfo(want).max
        if lo < 0 or hi > top:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} does not fit {want.name} [0, {top}]; declare "
                             f"TokenIds(dtype='uint32') for vocabularies over 65,536 ids")
    data = arr.astype(want.newbyteorder("<")).tobytes()
    if mask is None:
        return data
    if mask.shape != arr.shape:
        raise ValueError(f"the loss mask has shape {mask.shape}, the ids {arr.shape}: give one 0/1 value per id")
    if mask.size and (mask.dtype.kind not in "biu" or int(mask.min()) < 0 or int(mask.max()) > 1):
        raise ValueError("the loss mask holds values other than 0 and 1 (or True/False); give one 0/1 value per id")
    return data + mask.astype(np.uint8).tobytes()


def encode_images(value, field: RGBImages) -> tuple[bytes, dict]:
    """Payload (count, entries, images: formats/v1.md section 5) and ``count`` column of one image list; each
    image is encoded as :func:`encode_image` encodes an RGBImage value. ValueError naming the image for a bad one."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"RGBImages fields take a list of images (paths, bytes, PIL images or arrays), got "
                         f"{type(value).__name__}; wrap a single image in a list")
    image = field.image()
    entries = np.zeros(len(value), dtype=IMAGES_ENTRY)
    parts = []
    for k, item in enumerate(value):
        try:
            data, cols = encode_image(item, image)
        except (ValueError, OSError) as exc:
            raise ValueError(f"image {k} of {len(value)}{describe_path(item)}: {exc}") from exc
        entries[k] = (cols["height"], cols["width"], len(data), cols["encoding"], b"")
        parts.append(data)
    if sum(len(p) for p in parts) + 4 + entries.nbytes >= 1 << 32:
        raise ValueError("the images of one record take 4 GiB or more; shrink them (max_resolution)")
    head = np.array([len(value)], dtype="<u4").tobytes() + entries.tobytes()
    return head + b"".join(parts), {"count": len(value)}


def encode_value(value, field: Field) -> tuple[bytes | None, dict]:
    """Encode one value: ``(payload or None for inline fields, {column suffix or "": value})``."""
    if isinstance(field, RGBImage):
        return encode_image(value, field)
    if isinstance(field, RGBImages):
        return encode_images(value, field)
    if isinstance(field, (Int, Float)):
        return None, {"": encode_scalar(value, field)}
    if isinstance(field, NDArray):
        return encode_ndarray(value, field), {}
    if isinstance(field, Bytes):
        return encode_bytes(value), {}
    if isinstance(field, TokenIds):
        return encode_token_ids(value, field), {}
    if isinstance(field, JSON):
        try:
            return canonical_json(value), {}
        except (TypeError, ValueError) as exc:
            raise ValueError(f"value is not JSON-serialisable: {exc}") from exc
    raise TypeError(f"unknown field type {type(field).__name__}")


def describe_path(value) -> str:
    """A short description of where a value came from, for error messages (the path when it is one)."""
    return f" ({os.fspath(value)})" if isinstance(value, (str, Path)) else ""
