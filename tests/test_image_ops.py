"""Image kernels (pageset.ops.image) against the libraries whose semantics they promise.

- Resizing is compared pixel by pixel with Pillow's ``Image.resize(..., Image.BILINEAR, box=...)`` on real
  photos (skimage's astronaut, chelsea, coffee; sklearn's china.jpg) and on noise: the kernel replicates
  Pillow's fixed-point arithmetic and pass order, so the measured tolerance is 0 (exact) on Pillow >= 13;
  older Pillow always ran the horizontal pass first, which moves a few pixels by 1 in vertical-first cases.
- Normalization, flip, layouts and float16 / bfloat16 bits are compared with numpy and torch (CPU).
- RandomResizedCrop sampling is compared with its pure-Python twin and checked statistically against the
  torchvision algorithm driven by an independent generator.

Also run with ``NUMBA_DISABLE_JIT=1`` (kernel bodies as Python); sizes and example counts shrink then.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import PIL
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from skimage import data as skdata
from sklearn.datasets import load_sample_image

from pageset.ops.image import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    OUTPUT_STORAGE,
    bfloat16_bits,
    center_crop_box,
    normalize_table,
    pixel_table,
    random_flip,
    random_resized_crop_box,
    random_resized_crop_box_py,
    resize_crop_flip_normalize,
    resize_scratch_size,
    resized_crop,
)
from pageset.ops.resize import _vertical_first
from pageset.order.keys import sample_keys

JIT = not numba.config.DISABLE_JIT
EXAMPLES = 60 if JIT else 6
MAX_OUT = 260 if JIT else 40  # output side in property tests; pure Python is ~1000x slower
MAX_SRC = 3000 if JIT else 240  # source side where only the kernel's bookkeeping is checked
PILLOW_13 = int(PIL.__version__.split(".")[0]) >= 13
TOLERANCE = 0 if PILLOW_13 else 1  # max |kernel - Pillow| on uint8 (see module docstring)
RRC = (0.08, 1.0, 3 / 4, 4 / 3)  # torchvision's RandomResizedCrop defaults: scale, ratio
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

PHOTOS = {
    "astronaut": skdata.astronaut(),  # 512x512
    "chelsea": skdata.chelsea(),  # 300x451
    "coffee": skdata.coffee(),  # 400x600
    "china": load_sample_image("china.jpg"),  # 427x640
}


def pillow_resize(rgb: np.ndarray, box, size_hw) -> np.ndarray:
    """The reference: uint8[H, W, 3] from Pillow's BILINEAR resize of ``box`` (x0, y0, x1, y1)."""
    h, w = size_hw
    return np.asarray(Image.fromarray(rgb).resize((w, h), Image.BILINEAR, box=tuple(float(v) for v in box)))


def assert_close_to_pillow(got: np.ndarray, ref: np.ndarray) -> None:
    diff = np.abs(got.astype(np.int16) - ref.astype(np.int16))
    assert diff.max() <= TOLERANCE, f"max diff {diff.max()} at {np.unravel_index(diff.argmax(), diff.shape)}"


def kernel(rgb, box, size_hw, table=None, flip=False, channels_last=False):
    """One call of the njit kernel with freshly sized buffers."""
    table = pixel_table() if table is None else table
    h, w = size_hw
    out = np.empty((h, w, 3) if channels_last else (3, h, w), dtype=table.dtype)
    scratch = np.empty(resize_scratch_size(rgb.shape[0], rgb.shape[1], h, w), dtype=np.int32)
    x0, y0, x1, y1 = (float(v) for v in box)
    resize_crop_flip_normalize(rgb, x0, y0, x1, y1, flip, table, out, channels_last, scratch)
    return out


def small(size_hw):
    """Shrink an output size under NUMBA_DISABLE_JIT (keeps the ratio roughly, at least 1)."""
    if JIT:
        return size_hw
    scale = min(1.0, MAX_OUT / max(size_hw))
    return tuple(max(1, int(v * scale)) for v in size_hw)


# ----------------------------------------------------------------------------------------------------------
# Resize vs Pillow
# ----------------------------------------------------------------------------------------------------------

# (box, (H, W)): shrink, enlarge, identity, non-integer boxes, both of Pillow 13's pass orders.
CASES = [
    ((0, 0, 1.0, 1.0), (3, 2)),  # one pixel enlarged
    ((0, 0, "w", "h"), (224, 224)),  # whole image shrunk (horizontal first)
    ((0, 0, "w", "h"), (37, 300)),  # height shrunk much more than width: vertical first (astronaut)
    ((0, 0, "w", "h"), (20, 450)),  # height shrunk far more than width: vertical first on every photo
    ((10.25, 20.5, 110.75, 90.125), (224, 224)),  # a small fractional box enlarged
    ((33.3, 7.7, 290.1, 280.9), (64, 48)),  # fractional box shrunk ~5x
    ((0, 0, "w", "h"), ("h", "w")),  # identity size
    ((1.5, 2.5, 101.5, 102.5), (100, 100)),  # same size, half-pixel shift
    ((100, 50, 300, 250), (224, 160)),
]


def resolve(case, rgb):
    (box, size) = case
    h, w = rgb.shape[:2]
    sub = {"w": w, "h": h}
    box = tuple(sub.get(v, v) if isinstance(v, str) else v for v in box)
    size = tuple(sub.get(v, v) if isinstance(v, str) else v for v in size)
    return box, small(size)


@pytest.mark.parametrize("name", sorted(PHOTOS))
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_resize_equals_pillow_on_photos(name, case):
    rgb = PHOTOS[name]
    box, size = resolve(case, rgb)
    got = kernel(rgb, box, size, channels_last=True)
    assert_close_to_pillow(got, pillow_resize(rgb, box, size))


@SETTINGS
@given(
    name=st.sampled_from(sorted(PHOTOS)),
    fx0=st.floats(0, 1), fy0=st.floats(0, 1), fx1=st.floats(0, 1), fy1=st.floats(0, 1),
    out_h=st.integers(1, MAX_OUT), out_w=st.integers(1, MAX_OUT),
)
def test_resize_equals_pillow_random_boxes(name, fx0, fy0, fx1, fy1, out_h, out_w):
    rgb = PHOTOS[name]
    h, w = rgb.shape[:2]
    x0, x1 = sorted((fx0 * w, fx1 * w))
    y0, y1 = sorted((fy0 * h, fy1 * h))
    # Pillow parses the box as float32; keep boxes that stay non-empty there.
    if not (np.float32(x1) > np.float32(x0) and np.float32(y1) > np.float32(y0)):
        x1, y1 = min(x0 + 1.0, w), min(y0 + 1.0, h)
        x0, y0 = x1 - 1.0, y1 - 1.0
    box = (x0, y0, x1, y1)
    got = kernel(rgb, box, (out_h, out_w), channels_last=True)
    assert_close_to_pillow(got, pillow_resize(rgb, box, (out_h, out_w)))


@pytest.mark.parametrize("name", sorted(PHOTOS))
def test_resize_equals_pillow_sweep(name):
    """300 seeded boxes per photo, half of them in Pillow 13's vertical-first regime (rare pixel ties
    between the two orders need many cases to show up)."""
    rgb = PHOTOS[name]
    h, w = rgb.shape[:2]
    rng = np.random.default_rng(sorted(PHOTOS).index(name))
    for i in range(300 if JIT else 4):
        x0, x1 = np.sort(rng.uniform(0, w, 2))
        y0, y1 = np.sort(rng.uniform(0, h, 2))
        x1, y1 = max(x1, x0 + 0.5), max(y1, y0 + 0.5)
        out_w = int(rng.integers(1, min(w, MAX_OUT) + 1))
        vertical_first_h = max(2, h - 2 * (w - out_w))  # out_h below this: Pillow 13 resizes vertically first
        out_h = int(rng.integers(1, MAX_OUT + 1)) if i % 2 else int(rng.integers(1, vertical_first_h))
        box = (x0, y0, x1, y1)
        got = kernel(rgb, box, (out_h, out_w), channels_last=True)
        assert_close_to_pillow(got, pillow_resize(rgb, box, (out_h, out_w)))


@pytest.mark.parametrize("name", sorted(PHOTOS))
def test_resize_equals_pillow_when_the_width_grows_and_the_height_shrinks(name):
    """An image narrower than the output but taller (a RandomResizedCrop crop view upscaled in width, shrunk in
    height: common with small crops): Pillow 13 resizes vertically first there too (its order depends on the
    image's height being shrunk by more than twice the width's shrink, a negative number here), and the two
    orders round differently on a few pixels. 120 seeded crop views per photo against Pillow's
    ``crop(...).resize(...)``, as torchvision's ``resized_crop`` does it."""
    rgb = PHOTOS[name]
    rng = np.random.default_rng(100 + sorted(PHOTOS).index(name))
    vertical = 0
    for _ in range(120 if JIT else 3):
        w, h = int(rng.integers(4, 120)), int(rng.integers(8, 200))
        out_w, out_h = int(rng.integers(w + 1, w + 100)), int(rng.integers(2, h))
        x, y = int(rng.integers(0, rgb.shape[1] - w)), int(rng.integers(0, rgb.shape[0] - h))
        crop = rgb[y : y + h, x : x + w]  # a view, as the loader passes it
        vertical += _vertical_first(h, w, out_h, out_w)
        got = kernel(crop, (0, 0, w, h), (out_h, out_w), channels_last=True)
        ref = np.asarray(Image.fromarray(rgb).crop((x, y, x + w, y + h)).resize((out_w, out_h), Image.BILINEAR))
        assert_close_to_pillow(got, ref)
    assert vertical == (120 if JIT else 3)  # every case in Pillow 13's vertical-first order


@pytest.mark.parametrize(
    "src_hw, out_hw",
    [((1, 1), (1, 1)), ((1, 1), (7, 5)), ((2, 3), (1, 1)), ((1, 700), (1, 64)), ((700, 1), (64, 3)),
     ((1, 7000), (3, 40)), ((3000, 2), (40, 1)), ((5, 5), (260, 3))],
)
def test_resize_equals_pillow_on_slivers(src_hw, out_hw):
    rgb = np.random.default_rng(7).integers(0, 256, (*src_hw, 3), dtype=np.uint8)
    box = (0.0, 0.0, float(src_hw[1]), float(src_hw[0]))
    out_hw = small(out_hw)
    assert_close_to_pillow(kernel(rgb, box, out_hw, channels_last=True), pillow_resize(rgb, box, out_hw))


@pytest.mark.parametrize("name", sorted(PHOTOS))
def test_crop_view_reproduces_torchvision_resized_crop(name):
    """torchvision's F.resized_crop on PIL is img.crop(...).resize(...): a crop view, box (0, 0, w, h)."""
    rgb = PHOTOS[name]
    keys = sample_keys(3, 0, np.arange(4))
    for key in keys:
        x0, y0, w, h = random_resized_crop_box(rgb.shape[0], rgb.shape[1], key, *RRC)
        size = small((224, 224))
        crop = Image.fromarray(rgb).crop((x0, y0, x0 + w, y0 + h))
        ref = np.asarray(crop.resize(size[::-1], Image.BILINEAR))
        got = kernel(rgb[y0:y0 + h, x0:x0 + w], (0, 0, w, h), size, channels_last=True)
        assert_close_to_pillow(got, ref)


def test_box_reads_outside_the_crop_unlike_a_crop_view():
    """Documented difference: a box on the full image filters across the box edge, a crop view does not."""
    rgb = PHOTOS["astronaut"]
    box = (100, 100, 300, 300)
    whole = kernel(rgb, box, (50, 50))
    view = kernel(rgb[100:300, 100:300], (0, 0, 200, 200), (50, 50))
    differs = whole != view
    assert differs.any()
    assert not differs[:, 2:-2, 2:-2].any()  # only at the border: the support is 4 source px = 1 output px


# ----------------------------------------------------------------------------------------------------------
# Flip, layouts, normalize, dtypes
# ----------------------------------------------------------------------------------------------------------

BOX = (12.5, 30.25, 400.0, 290.75)  # inside chelsea (300x451)


# A tall strip of chelsea (451x60) shrunk to a narrow output: Pillow's vertical-first order (the flip is applied
# in the horizontal pass, which runs second there).
TALL = np.ascontiguousarray(PHOTOS["chelsea"].transpose(1, 0, 2)[:, :60])
TALL_BOX = (2.5, 10.25, 58.0, 440.75)


@pytest.mark.parametrize("order", ["horizontal_first", "vertical_first"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_flip_equals_np_flip(channels_last, order):
    rgb, box, size = ((PHOTOS["chelsea"], BOX, small((96, 128))) if order == "horizontal_first" else
                      (TALL, TALL_BOX, small((96, 48))))
    assert _vertical_first(rgb.shape[0], rgb.shape[1], *size) == (order == "vertical_first")
    table = normalize_table("float32")
    plain = kernel(rgb, box, size, table, flip=False, channels_last=channels_last)
    flipped = kernel(rgb, box, size, table, flip=True, channels_last=channels_last)
    np.testing.assert_array_equal(flipped, np.flip(plain, axis=1 if channels_last else 2))


@pytest.mark.parametrize("dtype", sorted(OUTPUT_STORAGE))
def test_nchw_and_nhwc_are_transposes(dtype):
    rgb, size = PHOTOS["chelsea"], small((70, 90))
    table = pixel_table() if dtype == "uint8" else normalize_table(dtype)
    nchw = kernel(rgb, BOX, size, table, flip=True)
    nhwc = kernel(rgb, BOX, size, table, flip=True, channels_last=True)
    assert nchw.dtype == nhwc.dtype == OUTPUT_STORAGE[dtype]
    np.testing.assert_array_equal(nchw, nhwc.transpose(2, 0, 1))


def test_float32_equals_torchvision_to_tensor_normalize():
    rgb, size = PHOTOS["coffee"], small((224, 224))
    pixels = kernel(rgb, BOX, size)  # uint8 [3, H, W]
    got = kernel(rgb, BOX, size, normalize_table("float32", IMAGENET_MEAN, IMAGENET_STD))
    # torchvision: ToTensor = img.float().div(255); Normalize = tensor.sub_(mean).div_(std), all float32.
    t = torch.from_numpy(pixels.copy()).float().div(255)
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float32)[:, None, None]
    std = torch.tensor(IMAGENET_STD, dtype=torch.float32)[:, None, None]
    np.testing.assert_array_equal(got, t.sub_(mean).div_(std).numpy())
    # ...and within float32 rounding of the exact float64 formula.
    exact = (pixels / 255.0 - np.array(IMAGENET_MEAN)[:, None, None]) / np.array(IMAGENET_STD)[:, None, None]
    np.testing.assert_allclose(got, exact, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(exact).max())


def test_float16_bits_equal_numpy_astype():
    rgb, size = PHOTOS["china"], small((80, 100))
    f32 = kernel(rgb, BOX, size, normalize_table("float32"))
    f16 = kernel(rgb, BOX, size, normalize_table("float16"))
    np.testing.assert_array_equal(f16, f32.astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(f16, torch.from_numpy(f32).half().view(torch.int16).numpy().view(np.uint16))


def test_bfloat16_bits_equal_torch():
    rgb, size = PHOTOS["china"], small((80, 100))
    f32 = kernel(rgb, BOX, size, normalize_table("float32"))
    bf16 = kernel(rgb, BOX, size, normalize_table("bfloat16"))
    ref = torch.from_numpy(f32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bf16, ref)


def test_bfloat16_bits_rounding_on_all_kinds_of_floats():
    bits = np.random.default_rng(1).integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001, 0x3F808000, 0x3F818000,
                        0x3F807FFF, 0x7F7FFFFF, 0x7FC00000], dtype=np.uint32)  # ties, inf, max, denormal
    x = np.concatenate([bits, special]).view(np.float32)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = bfloat16_bits(x)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(got[finite], ref[finite])
    assert np.all((got[~finite] & 0x7F80) == 0x7F80) and np.all(got[~finite] & 0x7F)  # still NaN


def test_uint8_output_is_pillow_pixels():
    rgb, size = PHOTOS["astronaut"], small((224, 224))
    got = kernel(rgb, BOX, size)  # pixel_table: uint8 NCHW
    assert got.dtype == np.uint8
    assert_close_to_pillow(got.transpose(1, 2, 0), pillow_resize(rgb, BOX, size))


def test_normalize_table_rejects_bad_arguments():
    with pytest.raises(ValueError, match="pixel_table"):
        normalize_table("uint8")
    with pytest.raises(ValueError, match="dtype must be one of"):
        normalize_table("float64")
    with pytest.raises(ValueError, match="std must be > 0"):
        normalize_table("float32", std=(0.2, 0.0, 0.2))


# ----------------------------------------------------------------------------------------------------------
# Errors, scratch and njit callers
# ----------------------------------------------------------------------------------------------------------


def test_kernel_errors_name_the_problem():
    rows = PHOTOS["chelsea"]
    table = normalize_table("float32")
    out = np.empty((3, 32, 32), np.float32)
    scratch = np.empty(resize_scratch_size(300, 451, 32, 32), np.int32)
    with pytest.raises(ValueError, match="box"):
        resize_crop_flip_normalize(rows, 0.0, 0.0, 452.0, 10.0, False, table, out, False, scratch)
    with pytest.raises(ValueError, match="box"):
        resize_crop_flip_normalize(rows, 5.0, 0.0, 5.0, 10.0, False, table, out, False, scratch)
    with pytest.raises(ValueError, match="scratch"):
        resize_crop_flip_normalize(rows, 0.0, 0.0, 451.0, 300.0, False, table, out, False, scratch[:100])
    with pytest.raises(ValueError, match="dtypes differ"):
        resize_crop_flip_normalize(rows, 0.0, 0.0, 9.0, 9.0, False, pixel_table(), out, False, scratch)
    with pytest.raises(ValueError, match="out must be"):
        resize_crop_flip_normalize(rows, 0.0, 0.0, 9.0, 9.0, False, table, out, True, scratch)
    with pytest.raises(ValueError, match="src must be"):
        resize_crop_flip_normalize(rows[:, :, :2], 0.0, 0.0, 9.0, 9.0, False, table, out, False, scratch)
    with pytest.raises(ValueError, match="contiguous"):
        resize_crop_flip_normalize(rows[:, ::-1], 0.0, 0.0, 9.0, 9.0, False, table, out, False, scratch)
    with pytest.raises(ValueError, match="src must be"):
        resized_crop(rows.astype(np.float32), (0, 0, 9, 9), (4, 4))
    # The Python wrapper copies views the kernel cannot read in place.
    mirrored = rows[:, ::-1]
    np.testing.assert_array_equal(resized_crop(mirrored, (3, 4, 50, 60), (9, 7)),
                                  resized_crop(mirrored.copy(), (3, 4, 50, 60), (9, 7)))


@SETTINGS
@given(src_h=st.integers(1, MAX_SRC), src_w=st.integers(1, MAX_SRC), out_h=st.integers(1, MAX_OUT),
       out_w=st.integers(1, MAX_OUT), fx=st.floats(0, 1), fy=st.floats(0, 1))
def test_scratch_size_covers_every_box_and_crop_view(src_h, src_w, out_h, out_w, fx, fy):
    """The kernel's own need (it raises otherwise) never exceeds resize_scratch_size of the full image."""
    rgb = np.zeros((src_h, src_w, 3), np.uint8)
    n = resize_scratch_size(src_h, src_w, out_h, out_w)
    out = np.empty((3, out_h, out_w), np.uint8)
    scratch = np.empty(n, np.int32)
    # A box from a corner: the widest taps; and a crop view (smaller source, same scratch).
    x1, y1 = max(fx * src_w, 1.0), max(fy * src_h, 1.0)
    resize_crop_flip_normalize(rgb, 0.0, 0.0, x1, y1, False, pixel_table(), out, False, scratch)
    cw, ch = max(int(x1), 1), max(int(y1), 1)
    resize_crop_flip_normalize(rgb[:ch, :cw], 0.0, 0.0, float(cw), float(ch), False, pixel_table(), out,
                               False, scratch)


@numba.njit(nogil=True)
def _augment_batch(images, keys, table, out, scratch):
    """What the loader does: per sample, sample a crop and a flip, then one fused kernel call."""
    for i in range(keys.shape[0]):
        src = images[i]
        x0, y0, cw, ch = random_resized_crop_box(src.shape[0], src.shape[1], keys[i], 0.08, 1.0, 0.75, 4 / 3)
        flip = random_flip(keys[i], 0.5)
        view = src[y0:y0 + ch, x0:x0 + cw]  # a non-contiguous crop view, as the loader passes
        resize_crop_flip_normalize(view, 0.0, 0.0, float(cw), float(ch), flip, table, out[i], False, scratch)


@numba.njit(nogil=True)
def _center_boxes(h, w, out_h, out_w):
    return center_crop_box(h, w, out_h, out_w, 0.875)


def test_kernels_are_callable_from_njit():
    rgb = PHOTOS["coffee"]
    images = np.stack([rgb, rgb[::-1], rgb[:, ::-1]])  # uint8[3, h, w, 3], C-contiguous
    keys = sample_keys(11, 2, np.arange(3))
    size = small((64, 64))
    table = normalize_table("bfloat16")
    out = np.empty((3, 3, *size), np.uint16)
    scratch = np.empty(resize_scratch_size(rgb.shape[0], rgb.shape[1], *size), np.int32)
    _augment_batch(images, keys, table, out, scratch)
    for i in range(3):  # the same thing sample by sample from Python
        x0, y0, cw, ch = random_resized_crop_box_py(rgb.shape[0], rgb.shape[1], int(keys[i]), *RRC)
        src = images[i]
        flip = bool(random_flip(keys[i], 0.5))
        ref = kernel(src[y0:y0 + ch, x0:x0 + cw], (0, 0, cw, ch), size, table, flip=flip)
        np.testing.assert_array_equal(out[i], ref)
    assert _center_boxes(400, 600, 224, 224) == center_crop_box(400, 600, 224, 224, 0.875)


def test_threads_with_own_scratch_match_serial():
    """nogil kernels on 2 threads (one scratch and out per thread) give the serial results."""
    rgb = PHOTOS["china"]
    keys = sample_keys(5, 0, np.arange(16 if JIT else 2))
    size = small((96, 96))
    table = normalize_table("float32")

    def work(chunk):
        out = np.empty((len(chunk), 3, *size), np.float32)
        scratch = np.empty(resize_scratch_size(rgb.shape[0], rgb.shape[1], *size), np.int32)
        for j, k in enumerate(chunk):
            x0, y0, w, h = random_resized_crop_box(rgb.shape[0], rgb.shape[1], k, *RRC)
            resize_crop_flip_normalize(rgb[y0:y0 + h, x0:x0 + w], 0.0, 0.0, float(w), float(h),
                                       random_flip(k, 0.5), table, out[j], False, scratch)
        return out

    serial = work(keys)
    with ThreadPoolExecutor(2) as pool:
        parallel = np.concatenate(list(pool.map(work, [keys[0::2], keys[1::2]])))
    np.testing.assert_array_equal(parallel, np.concatenate([serial[0::2], serial[1::2]]))


# ----------------------------------------------------------------------------------------------------------
# Crop parameters
# ----------------------------------------------------------------------------------------------------------

SIZES = [(1, 1), (1, 2), (2, 1), (1, 70000), (70000, 1), (12000, 9000), (9000, 12000), (375, 500), (500, 375),
         (3, 1000), (224, 224), (7, 9)]
PARAMS = [RRC, (0.35, 1.0, 3 / 4, 4 / 3), (0.25, 0.25, 1.0, 1.0), (0.08, 1.0, 0.1, 10.0),
          (0.9, 1.5, 2.0, 3.0), (0.0, 0.01, 1 / 3, 3.0)]


def check_box(box, height, width):
    x0, y0, w, h = box
    assert w >= 1 and h >= 1
    assert 0 <= x0 and x0 + w <= width and 0 <= y0 and y0 + h <= height


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("size", SIZES)
def test_random_resized_crop_matches_python_twin(size, params):
    keys = sample_keys(123, 5, np.arange(300 if JIT else 40))
    for key in keys:
        got = random_resized_crop_box(size[0], size[1], key, *params)
        ref = random_resized_crop_box_py(size[0], size[1], int(key), *params)
        assert tuple(got) == ref
        check_box(got, *size)


@SETTINGS
@given(height=st.integers(1, 20000), width=st.integers(1, 20000), key=st.integers(0, 2**64 - 1),
       scale=st.tuples(st.floats(0, 2), st.floats(0, 2)).map(sorted),
       ratio=st.tuples(st.floats(0.05, 20), st.floats(0.05, 20)).map(sorted))
def test_random_resized_crop_box_properties(height, width, key, scale, ratio):
    params = (scale[0], scale[1], ratio[0], ratio[1])
    box = random_resized_crop_box(height, width, np.uint64(key), *params)
    check_box(box, height, width)
    assert box == random_resized_crop_box(height, width, np.uint64(key), *params)  # deterministic
    assert tuple(box) == random_resized_crop_box_py(height, width, key, *params)


def test_random_resized_crop_differs_between_keys():
    keys = sample_keys(0, 0, np.arange(200))
    boxes = {tuple(random_resized_crop_box(375, 500, k, *RRC)) for k in keys}
    assert len(boxes) >= 195  # ~4e7 possible boxes: collisions are rare


def torchvision_reference(height, width, rng, n, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """RandomResizedCrop.get_params driven by numpy's generator: area fractions and log aspect ratios."""
    fractions, log_aspects = [], []
    for _ in range(n):
        for _ in range(10):
            target_area = height * width * rng.uniform(*scale)
            aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                break
        else:
            w, h = width, height  # square-ish test images: the fallback is the whole image
        fractions.append(w * h / (height * width))
        log_aspects.append(math.log(w / h))
    return np.array(fractions), np.array(log_aspects)


@pytest.mark.parametrize("size", [(500, 500), (375, 500)])
def test_random_resized_crop_statistics_match_torchvision(size):
    n = 2000
    keys = sample_keys(2024, 1, np.arange(n))
    boxes = np.array([random_resized_crop_box(size[0], size[1], k, *RRC) for k in keys])
    fractions = boxes[:, 2] * boxes[:, 3] / (size[0] * size[1])
    log_aspects = np.log(boxes[:, 2] / boxes[:, 3])
    ref_f, ref_a = torchvision_reference(*size, np.random.default_rng(0), 20000)
    # Means agree within 4 standard errors of a 2000-sample mean (false-alarm rate ~6e-5 per check).
    assert abs(fractions.mean() - ref_f.mean()) < 4 * ref_f.std() / math.sqrt(n)
    assert abs(log_aspects.mean() - ref_a.mean()) < 4 * ref_a.std() / math.sqrt(n)
    assert 0.08 * 0.95 <= fractions.min() and fractions.max() <= 1.0
    assert 0.40 < fractions.mean() < 0.60  # torchvision's scale=(0.08, 1): about 0.5 after rejections
    # Positions are uniform over the valid range: the mean relative offset is ~0.5.
    slack_x = size[1] - boxes[:, 2]
    rel = boxes[slack_x > 0, 0] / slack_x[slack_x > 0]
    assert abs(rel.mean() - 0.5) < 4 * math.sqrt(1 / 12 / rel.size)


def test_random_resized_crop_golden():
    """Pinned boxes: any change to the counter layout or the algorithm shows up here."""
    keys = sample_keys(42, 0, np.arange(6))
    boxes = [tuple(int(v) for v in random_resized_crop_box(375, 500, k, *RRC)) for k in keys]
    assert boxes == GOLDEN_BOXES


GOLDEN_BOXES = [(233, 67, 214, 278), (134, 205, 143, 153), (5, 230, 160, 135), (2, 5, 416, 364),
                (54, 19, 401, 354), (145, 9, 343, 311)]


def test_random_resized_crop_rejects_bad_ranges():
    with pytest.raises(ValueError, match="scale"):
        random_resized_crop_box(10, 10, np.uint64(1), 0.9, 0.1, 0.75, 1.33)
    with pytest.raises(ValueError, match="ratio"):
        random_resized_crop_box(10, 10, np.uint64(1), 0.1, 0.9, 0.0, 1.33)
    with pytest.raises(ValueError, match="size"):
        random_resized_crop_box(0, 10, np.uint64(1), 0.1, 0.9, 0.75, 1.33)


def test_random_flip_frequency_and_extremes():
    keys = sample_keys(9, 3, np.arange(2000))
    flips = np.array([random_flip(k, 0.5) for k in keys])
    assert abs(flips.mean() - 0.5) < 4 * math.sqrt(0.25 / 2000)
    assert not any(random_flip(k, 0.0) for k in keys[:200])
    assert all(random_flip(k, 1.0) for k in keys[:200])
    # The flip draw is independent of the crop draws (different counters): flips split each crop size class.
    small_crop = np.array([random_resized_crop_box(375, 500, k, *RRC)[2] < 250 for k in keys])
    assert abs(flips[small_crop].mean() - 0.5) < 4 * math.sqrt(0.25 / small_crop.sum())


@pytest.mark.parametrize("size", [(375, 500), (500, 375), (256, 256), (1, 1), (1, 70000), (12000, 9000)])
def test_center_crop_box_is_ffcv_for_square_outputs(size):
    height, width = size
    x0, y0, w, h = center_crop_box(height, width, 224, 224, 224 / 256)
    c = max(int(224 / 256 * min(height, width)), 1)  # FFCV's get_center_crop (w, h >= 1 added)
    assert (x0, y0, w, h) == ((width - c) // 2, (height - c) // 2, c, c)
    check_box((x0, y0, w, h), height, width)


def test_center_crop_box_non_square_keeps_output_aspect():
    x0, y0, w, h = center_crop_box(375, 500, 160, 320, 0.875)
    assert (w, h) == (int(0.875 * 375), int(0.875 * 375 * 0.5))
    assert (x0, y0) == ((500 - w) // 2, (375 - h) // 2)
    with pytest.raises(ValueError, match="ratio"):
        center_crop_box(10, 10, 4, 4, 1.5)
