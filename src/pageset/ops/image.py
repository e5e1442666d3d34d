"""Image augmentation for the loader, one import: crop sampling, the fused resize kernel, value tables.

Semantics are torchvision's ImageNet recipe on PIL images, reproduced bit for bit. The kernels live with their
stage and are re-exported here:

- :mod:`pageset.ops.crop`: :func:`random_resized_crop_box` (torchvision's ``RandomResizedCrop.get_params``
  on counter-based uniforms), :func:`center_crop_box` (FFCV's), :func:`random_flip`.
- :mod:`pageset.ops.resize`: :func:`resize_crop_flip_normalize`, Pillow's ``resize(BILINEAR, box=...)`` then
  flip, ``ToTensor`` and ``Normalize`` (uint8 equal to Pillow 13's), with weights from
  :mod:`pageset.ops.resize_weights`.

This module holds the [3, 256] value tables (built once per Loader: :func:`normalize_table`,
:func:`pixel_table`), which is how one kernel serves every output dtype, and :func:`resized_crop`, a Python
convenience wrapper.
"""

from __future__ import annotations

import numpy as np

from pageset.ops.crop import (  # noqa: F401  (re-exported: the public names of image augmentation)
    CROP_ATTEMPTS,
    CROP_COUNTER,
    FLIP_COUNTER,
    center_crop_box,
    random_flip,
    random_resized_crop_box,
    random_resized_crop_box_py,
)
from pageset.ops.resize import resize_crop_flip_normalize, resize_scratch_size  # noqa: F401
from pageset.ops.resize_weights import BILINEAR_SUPPORT, PRECISION_BITS, resize_taps  # noqa: F401

# Output storage dtype for each value type. float16 / bfloat16 are written as their IEEE bit patterns in
# uint16 (Numba has no CPU float16 arrays); view the buffer as torch.float16 / torch.bfloat16 afterwards.
OUTPUT_STORAGE = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.uint16),
    "bfloat16": np.dtype(np.uint16),
    "uint8": np.dtype(np.uint8),
}

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# ---------------------------------------------------------------------------------------------------------
# Value tables (built once per Loader) and a Python convenience wrapper
# ---------------------------------------------------------------------------------------------------------


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16, same shape), round to nearest even; NaN -> quiet NaN.

    The rounding torch uses for ``tensor.to(torch.bfloat16)`` (c10 ``round_to_nearest_even``): add
    ``0x7FFF + lsb`` to the float32 bits and keep the high 16.
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def normalize_table(dtype: str = "float32", mean=IMAGENET_MEAN, std=IMAGENET_STD) -> np.ndarray:
    """The per-channel value table of :func:`resize_crop_flip_normalize` for a normalized output.

    ``table[c, v]`` is the output for pixel value v of channel c: ``(float32(v) / 255 - mean[c]) / std[c]``
    in float32 -- the operations and order of torchvision's ``ToTensor`` (``div(255)``) and ``Normalize``
    (``sub_(mean).div_(std)``), so float32 outputs equal torchvision's exactly -- then stored as dtype:
    "float32"; "float16" (rounded to nearest even, as uint16 bits); "bfloat16" (rounded to nearest even like
    torch, as uint16 bits). For raw uint8 pixels use :func:`pixel_table`. mean, std: 3 floats each in 0-1
    units (default ImageNet's), std > 0. Returns a C-contiguous [3, 256] array of ``OUTPUT_STORAGE[dtype]``;
    build it once per Loader.
    """
    if dtype == "uint8":
        raise ValueError("normalize_table: uint8 outputs are not normalized; use pixel_table()")
    if dtype not in OUTPUT_STORAGE:
        raise ValueError(f"normalize_table: dtype must be one of {sorted(OUTPUT_STORAGE)}, got {dtype!r}")
    mean32 = np.asarray(mean, dtype=np.float32).reshape(3, 1)
    std32 = np.asarray(std, dtype=np.float32).reshape(3, 1)
    if not np.all(std32 > 0):
        raise ValueError(f"normalize_table: std must be > 0 for every channel, got {std32.ravel().tolist()}")
    x = np.arange(256, dtype=np.float32).reshape(1, 256) / np.float32(255.0)
    values = (x - mean32) / std32  # float32 throughout, like the torch ops
    if dtype == "float32":
        return np.ascontiguousarray(values)
    if dtype == "float16":
        return np.ascontiguousarray(values.astype(np.float16).view(np.uint16))
    return np.ascontiguousarray(bfloat16_bits(values))


def pixel_table() -> np.ndarray:
    """The identity table uint8[3, 256], ``table[c, v] = v``: raw pixels (FFCV's uint8 pipeline; normalize
    on the device)."""
    return np.ascontiguousarray(np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 256)))


def resized_crop(
    src: np.ndarray,
    box: tuple[float, float, float, float],
    size: tuple[int, int],
    table: np.ndarray | None = None,
    *,
    flip: bool = False,
    channels_last: bool = False,
) -> np.ndarray:
    """Convenience wrapper (allocates; not for the per-sample path): resize ``box`` of ``src`` to ``size``.

    src: uint8[h, w, 3] HWC RGB. box: (x0, y0, x1, y1) float source coordinates. size: (H, W) output
    pixels. table: from :func:`normalize_table`; None means :func:`pixel_table` (uint8 pixels). Returns
    [3, H, W] (or [H, W, 3] with channels_last) of the table's dtype.
    """
    if src.dtype != np.uint8 or src.ndim != 3 or src.shape[2] != 3:
        raise ValueError(f"src must be uint8[h, w, 3] RGB, got {src.dtype}{list(src.shape)}")
    if table is None:
        table = pixel_table()
    out_h, out_w = size
    shape = (out_h, out_w, 3) if channels_last else (3, out_h, out_w)
    out = np.empty(shape, dtype=table.dtype)
    scratch = np.empty(resize_scratch_size(src.shape[0], src.shape[1], out_h, out_w), dtype=np.int32)
    x0, y0, x1, y1 = (float(v) for v in box)
    if src.strides[1] != 3 * src.strides[2]:
        src = np.ascontiguousarray(src)  # e.g. a mirrored view
    resize_crop_flip_normalize(src, x0, y0, x1, y1, bool(flip), table, out, bool(channels_last), scratch)
    return out
