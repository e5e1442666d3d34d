"""The fast resize mode (``resize_mode="fast"``, pageset.ops.resize_fast) against the exact kernel and Pillow.

The fast kernel gives up Pillow's bits for speed; its stated bound (module docstring, README) is checked here
on real photos (skimage's astronaut, chelsea, coffee; sklearn's china.jpg) with the crops the Loader makes
(RandomResizedCrop(224) boxes of many keys, CenterCrop(224)), against two references: the exact kernel (itself
equal to Pillow 13, see test_image_ops.py) and Pillow's own ``Image.resize(BILINEAR)`` -- the independent
expectation. Also: shapes, dtypes and layouts, flip, determinism, slivers, the scratch bound, errors, and that
the default stays exact (through the Loader).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest
from PIL import Image
from skimage import data as skdata
from sklearn.datasets import load_sample_image

from pageset import CenterCrop, Int, Loader, RandomHorizontalFlip, RandomResizedCrop, RGBImage, open_dataset, write_dataset
from pageset.ops.crop import random_flip
from pageset.ops.image import (
    center_crop_box,
    normalize_table,
    pixel_table,
    random_resized_crop_box,
    random_resized_crop_box_py,
    resize_crop_flip_normalize,
    resize_scratch_size,
)
from pageset.ops.resize_fast import FAST_MAX_ABS_DIFF, FAST_MIN_PSNR_DB, fast_scratch_size, resize_fast
from pageset.order.keys import key_py, sample_keys

JIT = not numba.config.DISABLE_JIT
KEYS = 12 if JIT else 2  # RandomResizedCrop boxes per photo
OUT = 224 if JIT else 24
RRC = (0.08, 1.0, 3 / 4, 4 / 3)

PHOTOS = {
    "astronaut": skdata.astronaut(),  # 512x512
    "chelsea": skdata.chelsea(),  # 300x451
    "coffee": skdata.coffee(),  # 400x600
    "china": load_sample_image("china.jpg"),  # 427x640
}


def run(fn, size_fn, src, box, size_hw, table=None, flip=False, channels_last=True):
    table = pixel_table() if table is None else table
    h, w = size_hw
    out = np.empty((h, w, 3) if channels_last else (3, h, w), dtype=table.dtype)
    scratch = np.empty(size_fn(src.shape[0], src.shape[1], h, w), dtype=np.int32)
    fn(src, *(float(v) for v in box), flip, table, out, channels_last, scratch)
    return out


def fast(src, box, size_hw, **kw):
    return run(resize_fast, fast_scratch_size, src, box, size_hw, **kw)


def exact(src, box, size_hw, **kw):
    return run(resize_crop_flip_normalize, resize_scratch_size, src, box, size_hw, **kw)


def pillow(src, box, size_hw):
    h, w = size_hw
    return np.asarray(Image.fromarray(np.ascontiguousarray(src)).resize((w, h), Image.BILINEAR,
                                                                        box=tuple(float(v) for v in box)))


def max_abs_and_psnr(a: np.ndarray, b: np.ndarray) -> tuple[int, float]:
    d = a.astype(np.float64) - b.astype(np.float64)
    mse = float((d * d).mean())
    return int(np.abs(d).max()), (math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse))


def loader_crops(rgb):
    """(crop view, box) pairs as the Loader resizes them at scale 1/1: RandomResizedCrop boxes + CenterCrop."""
    h, w = rgb.shape[:2]
    boxes = [random_resized_crop_box(h, w, k, *RRC) for k in sample_keys(5, 0, np.arange(KEYS))]
    boxes.append(center_crop_box(h, w, OUT, OUT, 224 / 256))
    return [(rgb[y:y + ch, x:x + cw], (0.0, 0.0, float(cw), float(ch))) for x, y, cw, ch in boxes]


@pytest.mark.parametrize("name", sorted(PHOTOS))
def test_fast_within_stated_bound_of_exact_and_of_pillow(name):
    """The stated bound, per image and pooled: max |fast - ref| <= FAST_MAX_ABS_DIFF and PSNR >= FAST_MIN_PSNR_DB,
    for ref = the exact kernel and ref = Pillow's resize; and the fast mode is not secretly the exact one."""
    rgb = PHOTOS[name]
    pooled = {"exact": [], "pillow": []}
    differs = 0
    for src, box in loader_crops(rgb):
        got = fast(src, box, (OUT, OUT))
        refs = {"exact": exact(src, box, (OUT, OUT)), "pillow": pillow(src, box, (OUT, OUT))}
        for ref_name, ref in refs.items():
            worst, psnr = max_abs_and_psnr(got, ref)
            assert worst <= FAST_MAX_ABS_DIFF, f"{name} box {box} vs {ref_name}: max abs diff {worst}"
            assert psnr >= FAST_MIN_PSNR_DB, f"{name} box {box} vs {ref_name}: PSNR {psnr:.1f} dB"
            pooled[ref_name].append(got.astype(np.int16) - ref)
        differs += bool((got != refs["exact"]).any())
        assert abs(float(got.mean()) - float(refs["exact"].mean())) < 0.05  # no brightness drift
    assert differs > 0, "the fast mode gave the exact kernel's bits on every crop: is it the exact kernel?"


@pytest.mark.parametrize(
    "box, size_hw",
    [((0, 0, "w", "h"), (224, 224)), ((0, 0, "w", "h"), (37, 300)), ((10.25, 20.5, 110.75, 90.125), (224, 224)),
     ((33.3, 7.7, 290.1, 280.9), (64, 48)), ((0, 0, "w", "h"), ("h", "w")), ((1.5, 2.5, 101.5, 102.5), (100, 100)),
     ((0, 0, 1.0, 1.0), (3, 2)), ((0, 0, "w", "h"), (9, 11))],
)
def test_fast_boxes_shrink_enlarge_identity(box, size_hw):
    """Whole-image boxes on the full photo (boxes whose taps read outside the box), enlargements, identity, a 40x
    shrink (taps not unrolled), against Pillow."""
    for rgb in PHOTOS.values():
        h, w = rgb.shape[:2]
        sub = {"w": w, "h": h}
        b = tuple(sub.get(v, v) if isinstance(v, str) else v for v in box)
        s = tuple(sub.get(v, v) if isinstance(v, str) else v for v in size_hw)
        if not JIT:
            s = tuple(max(1, min(v, 24)) for v in s)
        worst, psnr = max_abs_and_psnr(fast(rgb, b, s), pillow(rgb, b, s))
        assert worst <= FAST_MAX_ABS_DIFF and psnr >= FAST_MIN_PSNR_DB, (b, s, worst, psnr)


@pytest.mark.parametrize(
    "src_hw, out_hw",
    [((1, 1), (1, 1)), ((1, 1), (7, 5)), ((2, 3), (1, 1)), ((1, 700), (1, 64)), ((700, 1), (64, 3)),
     ((3, 7000), (3, 40)), ((5, 5), (60, 3)), ((4, 9), (2, 2))],
)
def test_fast_on_slivers_matches_pillow(src_hw, out_hw):
    """Tiny and extreme sources (noise: no smooth photo to hide an edge error), including rows narrower than the
    tap count (the per-pixel horizontal path)."""
    rgb = np.random.default_rng(7).integers(0, 256, (*src_hw, 3), dtype=np.uint8)
    box = (0.0, 0.0, float(src_hw[1]), float(src_hw[0]))
    worst = np.abs(fast(rgb, box, out_hw).astype(np.int16) - pillow(rgb, box, out_hw)).max()
    assert worst <= FAST_MAX_ABS_DIFF


def test_fast_shapes_dtypes_layouts_and_flip():
    """Every output dtype and both layouts carry the same pixels: uint8 = the table lookup of the fast pixels;
    NCHW is NHWC transposed; flip = np.flip of the unflipped result."""
    rgb = PHOTOS["chelsea"]
    src, box = loader_crops(rgb)[0]
    px = fast(src, box, (OUT, OUT))
    assert px.dtype == np.uint8 and px.shape == (OUT, OUT, 3)
    for dtype in ("float32", "float16", "bfloat16"):
        table = normalize_table(dtype)
        nhwc = fast(src, box, (OUT, OUT), table=table)
        nchw = fast(src, box, (OUT, OUT), table=table, channels_last=False)
        assert nhwc.dtype == table.dtype and nchw.shape == (3, OUT, OUT)
        np.testing.assert_array_equal(nhwc, table[np.arange(3), px])  # table[c, px[..., c]]
        np.testing.assert_array_equal(nchw, nhwc.transpose(2, 0, 1))
    np.testing.assert_array_equal(fast(src, box, (OUT, OUT), flip=True), px[:, ::-1])
    # a non-contiguous NHWC output (pixels of a row not packed) gets the same values
    big = np.zeros((OUT, OUT, 4), np.uint8)
    scratch = np.empty(fast_scratch_size(src.shape[0], src.shape[1], OUT, OUT), np.int32)
    resize_fast(src, *box, False, pixel_table(), big[:, :, :3], True, scratch)
    np.testing.assert_array_equal(big[:, :, :3], px)


def test_fast_is_deterministic_and_ignores_stale_scratch():
    """One result per input: repeated calls, a scratch full of garbage, and an odd-aligned scratch agree."""
    src, box = loader_crops(PHOTOS["coffee"])[1]
    first = fast(src, box, (OUT, OUT))
    n = fast_scratch_size(src.shape[0], src.shape[1], OUT, OUT)
    for fill in (0, -1, 0x7FFFFFFF):
        raw = np.full(n + 1, fill, np.int32)
        for scratch in (raw[:n], raw[1:]):  # two alignments of the int64 area
            out = np.empty((OUT, OUT, 3), np.uint8)
            resize_fast(src, *box, False, pixel_table(), out, True, scratch)
            np.testing.assert_array_equal(out, first)


@pytest.mark.parametrize("src_h, src_w, out_h, out_w", [(300, 451, 224, 224), (10, 7000, 3, 40), (600, 5, 1, 224)])
def test_fast_scratch_size_covers_every_box(src_h, src_w, out_h, out_w):
    """fast_scratch_size(h, w, H, W) is enough for any box of the source: a few boxes up to the whole image."""
    rgb = np.random.default_rng(1).integers(0, 256, (src_h, src_w, 3), dtype=np.uint8)
    n = fast_scratch_size(src_h, src_w, out_h, out_w)
    out = np.empty((out_h, out_w, 3), np.uint8)
    for box in ((0.0, 0.0, src_w, src_h), (0.5, 0.25, src_w - 0.5, src_h - 0.1), (1.0, 1.0, 2.0, 2.0)):
        if box[2] <= box[0] or box[3] <= box[1]:
            continue
        resize_fast(rgb, *(float(v) for v in box), False, pixel_table(), out, True, np.zeros(n, np.int32))
    with pytest.raises(ValueError, match="scratch holds.*size it with fast_scratch_size"):
        resize_fast(rgb, 0.0, 0.0, float(src_w), float(src_h), False, pixel_table(), out, True,
                    np.zeros(n // 2, np.int32))


def test_fast_rejects_what_the_exact_kernel_rejects():
    rgb = PHOTOS["chelsea"]
    out = np.empty((8, 8, 3), np.uint8)
    scratch = np.empty(fast_scratch_size(rgb.shape[0], rgb.shape[1], 8, 8), np.int32)
    with pytest.raises(ValueError, match="need 0 <= x0 < x1 <= w"):
        resize_fast(rgb, 0.0, 0.0, 1e6, 10.0, False, pixel_table(), out, True, scratch)
    with pytest.raises(ValueError, match="table and out dtypes differ"):
        resize_fast(rgb, 0.0, 0.0, 10.0, 10.0, False, normalize_table(), out, True, scratch)
    with pytest.raises(ValueError, match="pixels of a src row must be contiguous"):
        resize_fast(rgb[:, ::-1], 0.0, 0.0, 10.0, 10.0, False, pixel_table(), out, True, scratch)


# ----------------------------------------------------------------------------------------------------------
# Through the Loader: the option, and the default staying exact
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def image_file(tmp_path_factory, imagenet_like):
    path = tmp_path_factory.mktemp("fast") / "train.pageset"
    write_dataset(path, imagenet_like, {"image": RGBImage(jpeg_quality=90), "label": Int()}, num_workers=0,
                  page_size=1 << 16, progress=False)
    return path


def _batches(path, crop, seed=7):
    with Loader(path, batch_size=16, seed=seed, num_threads=2, array_type="numpy",
                pipelines={"image": [crop, RandomHorizontalFlip()], "label": None}) as loader:
        return [(b["_index"].copy(), b["image"].copy()) for b in loader]


def test_loader_default_stays_exact_and_fast_mode_is_within_bound(image_file):
    """Default crops resize exactly (every sample equals Pillow's crop(box).resize(BILINEAR), mirrored when the
    key says so: these <= 220 px photos all decode at DCT scale 1/1 for a 224 output); resize_mode="fast" gives
    the same crops and flips within the stated bound of both, and is not the exact result."""
    assert RandomResizedCrop().resize_mode == "exact" and CenterCrop().resize_mode == "exact"
    default = _batches(image_file, RandomResizedCrop(224))
    quick = _batches(image_file, RandomResizedCrop(224, resize_mode="fast"))
    differs = 0
    with open_dataset(image_file) as ds:
        for step, ((ids, imgs), (ids_f, imgs_f)) in enumerate(zip(default, quick)):
            np.testing.assert_array_equal(ids, ids_f)
            for j, rid in enumerate(ids):
                rec = ds[int(rid)]["image"]
                k = key_py(7, 0, 4, step * 16 + j)
                x, y, w, h = random_resized_crop_box_py(rec.height, rec.width, k, *RRC)
                ref = np.asarray(Image.fromarray(rec.to_numpy()).crop((x, y, x + w, y + h))
                                 .resize((224, 224), Image.BILINEAR))
                if random_flip(np.uint64(k), 0.5):
                    ref = ref[:, ::-1]
                np.testing.assert_array_equal(imgs[j], ref, err_msg=f"default mode not exact: sample {rid}")
                worst, psnr = max_abs_and_psnr(imgs_f[j], ref)
                assert worst <= FAST_MAX_ABS_DIFF and psnr >= FAST_MIN_PSNR_DB, (rid, worst, psnr)
                differs += bool((imgs_f[j] != ref).any())
    assert differs > len(ds) // 2
    for (_, a), (_, b) in zip(_batches(image_file, CenterCrop(96)), _batches(image_file,
                                                                               CenterCrop(96, resize_mode="fast"))):
        worst, psnr = max_abs_and_psnr(a, b)  # reduced DCT scales here: the same decode, two resizes
        assert worst <= FAST_MAX_ABS_DIFF and psnr >= FAST_MIN_PSNR_DB


@pytest.mark.parametrize("value", [0, 1, 128, 254, 255])
def test_fast_keeps_flat_images_flat(value):
    """The filter is normalized (each pixel's weights sum to exactly 1 in fixed point): a constant image stays the
    same constant, saturated white included, for shrinks, enlargements and fractional boxes (as in Pillow)."""
    rgb = np.full((97, 131, 3), value, np.uint8)
    for box, size in (((0, 0, 131, 97), (224, 224)), ((0, 0, 131, 97), (13, 29)), ((3.3, 1.7, 120.9, 95.2), (50, 61)),
                      ((0, 0, 131, 97), (97, 131))):
        out = fast(rgb, box, size)
        assert (out == value).all(), (box, size, np.unique(out))
