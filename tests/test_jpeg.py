"""JPEG decoding through libjpeg-turbo from Numba kernels, checked against Pillow on real photos.

Pillow (libjpeg-turbo inside its wheel, ISLOW IDCT, fancy upsampling) is the reference: full decodes at 1/1
equal ``Image.open(f).convert("RGB")`` and DCT-scaled decodes at 1/2, 1/4, 1/8 equal ``Image.draft`` +
``convert("RGB")`` byte for byte; cropped decodes equal the crop of the full decode at the same scale.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numba
import numpy as np
import pytest
from PIL import Image, ImageFile

from pageset.ops import jpeg, turbo
from pageset.ops.jpeg import (
    ERR_DATA,
    ERR_EMPTY,
    ERR_LIBJPEG,
    ERR_NO_IMAGE,
    ERR_OUT,
    ERR_REGION,
    ERR_SCALE,
    ERR_SCRATCH,
    OK,
    SCALES,
    WARNING,
    JpegDecodeError,
    JpegDecoder,
    choose_scale,
    jpeg_decode,
    jpeg_decode_window,
    jpeg_info,
    scale_region,
    scaled_size,
    scratch_size,
    window_view,
)

NO_JIT = numba.config.DISABLE_JIT
# Crop checks per (image, scale), and scales for the crop checks: under NUMBA_DISABLE_JIT the kernels copy
# (and CMYK-convert) pixels in plain Python, about 1 s per 200k pixels; any scale covers the same lines.
CROPS_PER_SCALE = 2 if NO_JIT else 10
CROP_SCALES = ((1, 8), (1, 2)) if NO_JIT else SCALES


def encode(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


def jpeg_bytes(path: str) -> bytes:
    """The file itself for a JPEG, else the photo encoded as JPEG q90 (Pillow's default 4:2:0)."""
    if path.lower().endswith(".jpg"):
        return Path(path).read_bytes()
    with Image.open(path) as img:
        return encode(img.convert("RGB"), quality=90)


def pillow_rgb(data: bytes, denom: int = 1) -> np.ndarray:
    """Pillow's RGB decode; for denom in (2, 4, 8) through Image.draft, i.e. libjpeg's DCT scaling."""
    with Image.open(io.BytesIO(data)) as img:
        width, height = img.size
        if denom > 1:
            img.draft("RGB", (width // denom, height // denom))
        assert img.size == (-(-width // denom), -(-height // denom))  # the scale really applied
        return np.asarray(img.convert("RGB"))


def random_regions(rng, width: int, height: int, n: int):
    """n random regions (x, y, w, h) inside a width x height image, plus edge cases."""
    out = [(0, 0, width, height), (width - 1, height - 1, 1, 1), (0, height // 3, width, max(1, height // 3))]
    for _ in range(n):
        w = int(rng.integers(1, width + 1))
        h = int(rng.integers(1, height + 1))
        out.append((int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h))
    return out


@pytest.fixture(scope="module")
def decoder():
    with JpegDecoder() as dec:
        yield dec


@pytest.fixture(scope="module")
def photo_jpegs(photos) -> dict[str, bytes]:
    return {Path(p).name: jpeg_bytes(p) for p in photos}


@pytest.fixture(scope="module")
def astronaut(photos) -> Image.Image:
    path = next(p for p in photos if p.endswith("astronaut.png"))
    with Image.open(path) as img:
        # Odd sizes exercise partial iMCUs at the right and bottom edges.
        return img.convert("RGB").crop((0, 0, 509, 379))


@pytest.fixture(scope="module")
def variants(astronaut) -> dict[str, bytes]:
    """One real photo in each JPEG flavour the decoder must handle."""
    return {
        "444": encode(astronaut, quality=90, subsampling=0),
        "422": encode(astronaut, quality=90, subsampling=1),
        "420": encode(astronaut, quality=90, subsampling=2),
        "progressive": encode(astronaut, quality=85, progressive=True),
        "gray": encode(astronaut.convert("L"), quality=90),
        "cmyk": encode(astronaut.convert("CMYK"), quality=90),
    }


# ---------------------------------------------------------------- bit-exactness against Pillow


@pytest.mark.parametrize("denom", [1, 2, 4, 8])
def test_full_decode_equals_pillow(decoder, photo_jpegs, denom):
    for name, data in photo_jpegs.items():
        got = decoder.decode(data, scale=(1, denom))
        ref = pillow_rgb(data, denom)
        assert got.shape == ref.shape, name
        assert np.array_equal(got, ref), f"{name} at 1/{denom}"


@pytest.mark.parametrize("kind", ["444", "422", "420", "progressive", "gray", "cmyk"])
def test_variants_equal_pillow_at_every_pillow_scale(decoder, variants, kind):
    data = variants[kind]
    for denom in (1, 2, 4, 8):
        assert np.array_equal(decoder.decode(data, scale=(1, denom)), pillow_rgb(data, denom)), denom


def test_header_reports_subsampling_and_colorspace(decoder, variants):
    expect = {
        "444": (turbo.TJSAMP_444, turbo.TJCS_YCBCR),
        "422": (turbo.TJSAMP_422, turbo.TJCS_YCBCR),
        "420": (turbo.TJSAMP_420, turbo.TJCS_YCBCR),
        "progressive": (turbo.TJSAMP_420, turbo.TJCS_YCBCR),
        "gray": (turbo.TJSAMP_GRAY, turbo.TJCS_GRAY),
    }
    for kind, (subsamp, colorspace) in expect.items():
        assert decoder.header(variants[kind]) == (509, 379, subsamp, colorspace), kind
    width, height, _, colorspace = decoder.header(variants["cmyk"])
    assert (width, height) == (509, 379) and colorspace in (turbo.TJCS_CMYK, turbo.TJCS_YCCK)
    assert decoder.info(variants["420"]) == (509, 379)


@pytest.mark.parametrize("kind", ["444", "422", "420", "progressive", "gray", "cmyk"])
def test_cropped_decode_equals_crop_of_full_decode(decoder, variants, kind):
    data = variants[kind]
    rng = np.random.default_rng(sum(kind.encode()))
    for num, denom in CROP_SCALES:
        full = decoder.decode(data, scale=(num, denom))
        assert full.shape[:2] == (scaled_size(379, num, denom), scaled_size(509, num, denom))
        for x, y, w, h in random_regions(rng, full.shape[1], full.shape[0], CROPS_PER_SCALE):
            got = decoder.decode(data, scale=(num, denom), region=(x, y, w, h))
            assert np.array_equal(got, full[y : y + h, x : x + w]), (kind, num, denom, (x, y, w, h))



def _unknown_subsampling(data: bytes) -> bytes:
    """Cb sampled 2x1 next to Y 2x2 (a 4:2:0 file's SOF edited): no TJSAMP level, so it cannot be cropped."""
    data = bytearray(data)
    sof = data.find(b"\xff\xc0")
    assert data[sof + 14] == 0x11  # component 2 (Cb): h=1, v=1
    data[sof + 14] = 0x21
    return bytes(data)


@pytest.mark.parametrize("kind", ["444", "422", "420", "progressive", "gray", "cmyk", "unknown"])
def test_window_decode_equals_region_decode(decoder, variants, kind):
    """jpeg_decode_window (no copy: the loader's path) gives jpeg_decode's pixels for every scale and region, and
    ERR_SCRATCH (never a partial write) when the window does not fit ``buf``."""
    data = _unknown_subsampling(variants["420"]) if kind == "unknown" else variants[kind]
    arr = np.frombuffer(data, dtype=np.uint8)
    rng = np.random.default_rng(sum(kind.encode()) + 1)
    scratch = np.empty(509 * 379 * 4, dtype=np.uint8)
    for num, denom in CROP_SCALES:
        sw, sh = scaled_size(509, num, denom), scaled_size(379, num, denom)
        for x, y, w, h in random_regions(rng, sw, sh, CROPS_PER_SCALE):
            want = np.empty((h, w, 3), dtype=np.uint8)
            st_want = jpeg_decode(decoder.handle, arr, num, denom, x, y, w, h, want, scratch)
            buf = np.empty(sw * sh * 3 if kind == "unknown" else (w + 96) * h * 3, dtype=np.uint8)
            st, h0, w0, row, col = jpeg_decode_window(decoder.handle, arr, num, denom, x, y, w, h, buf, scratch)
            assert st == st_want and st >= 0, (kind, st, st_want)
            got = window_view(buf, h0, w0, row, col, h, w)
            assert got.shape == (h, w, 3) and np.array_equal(got, want), (kind, num, denom, (x, y, w, h))
    small = np.zeros(8 * 8 * 3, dtype=np.uint8)
    st = jpeg_decode_window(decoder.handle, arr, 1, 1, 0, 0, 100, 100, small, scratch)[0]
    assert st == ERR_SCRATCH and not small.any()

def test_cropped_decode_of_photos(decoder, photo_jpegs):
    rng = np.random.default_rng(7)
    for name, data in photo_jpegs.items():
        for num, denom in ((1, 1), (1, 2), (3, 8)):
            full = decoder.decode(data, scale=(num, denom))
            for x, y, w, h in random_regions(rng, full.shape[1], full.shape[0], CROPS_PER_SCALE // 2):
                got = decoder.decode(data, scale=(num, denom), region=(x, y, w, h))
                assert np.array_equal(got, full[y : y + h, x : x + w]), (name, num, denom, (x, y, w, h))


def _tj3_encode(pixels: np.ndarray, pixel_format: int, subsamp: int, quality: int = 90) -> bytes:
    """Encode with libjpeg-turbo itself: 4:4:0 and 4:1:1 (Pillow cannot), and TJPF_CMYK -> YCCK + Adobe."""
    lib = ctypes.CDLL(str(turbo.find_library()))  # own function objects: leave pageset's bindings alone
    lib.tj3Init.restype = ctypes.c_void_p
    lib.tj3Init.argtypes = [ctypes.c_int]
    lib.tj3Set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.tj3Compress8.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
    ]  # fmt: skip
    lib.tj3Free.argtypes = [ctypes.c_void_p]
    lib.tj3Destroy.argtypes = [ctypes.c_void_p]
    handle = lib.tj3Init(0)  # TJINIT_COMPRESS
    try:
        assert lib.tj3Set(handle, 3, quality) == 0  # TJPARAM_QUALITY
        assert lib.tj3Set(handle, 4, subsamp) == 0  # TJPARAM_SUBSAMP
        buf, size = ctypes.c_void_p(), ctypes.c_size_t()
        src = np.ascontiguousarray(pixels)
        height, width = src.shape[:2]
        assert lib.tj3Compress8(handle, src.ctypes.data, width, 0, height, pixel_format, buf, size) == 0
        data = ctypes.string_at(buf, size.value)
        lib.tj3Free(buf)
        return data
    finally:
        lib.tj3Destroy(handle)


def _check_against_pillow_and_full(decoder, data: bytes) -> None:
    for denom in (1, 2, 8):
        assert np.array_equal(decoder.decode(data, scale=(1, denom)), pillow_rgb(data, denom)), denom
    rng = np.random.default_rng(11)
    for num, denom in ((1, 1), (3, 8)):
        full = decoder.decode(data, scale=(num, denom))
        for x, y, w, h in random_regions(rng, full.shape[1], full.shape[0], CROPS_PER_SCALE):
            got = decoder.decode(data, scale=(num, denom), region=(x, y, w, h))
            assert np.array_equal(got, full[y : y + h, x : x + w]), (num, denom, (x, y, w, h))


@pytest.mark.parametrize("subsamp", [turbo.TJSAMP_440, turbo.TJSAMP_411], ids=["440", "411"])
def test_libjpeg_turbo_subsamplings(decoder, astronaut, subsamp):
    data = _tj3_encode(np.asarray(astronaut), turbo.TJPF_RGB, subsamp)
    assert decoder.header(data)[2] == subsamp
    _check_against_pillow_and_full(decoder, data)


def test_ycck_equals_pillow(decoder, astronaut):
    data = _tj3_encode(np.asarray(astronaut.convert("CMYK")), turbo.TJPF_CMYK, turbo.TJSAMP_420)
    assert decoder.header(data)[3] == turbo.TJCS_YCCK
    _check_against_pillow_and_full(decoder, data)


def test_unknown_subsampling_decodes_whole_then_crops(decoder, variants):
    # Cb sampled 2x1 next to Y 2x2: no TJSAMP level, so tj3SetCroppingRegion refuses it; the kernel decodes
    # the whole scaled image into scratch. (The scan no longer fits the header: libjpeg warns, and the
    # pixels are garbage, but the same garbage Pillow gets.)
    data = _unknown_subsampling(variants["420"])
    width, height, subsamp, colorspace = decoder.header(data)
    assert subsamp == -1
    assert scratch_size(width, height, subsamp, colorspace, 1, 1, 37, 11, 20, 20) == width * height * 3
    _check_against_pillow_and_full(decoder, bytes(data))


# ---------------------------------------------------------------- broken input


def test_truncated_jpeg_is_a_warning_with_pillows_image(decoder, photo_jpegs, monkeypatch):
    data = photo_jpegs["china.jpg"]
    cut = data[: len(data) // 2]
    img = decoder.decode(cut)
    assert decoder.last_warning == "Premature end of JPEG file"
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    assert np.array_equal(img, pillow_rgb(cut))
    # A region above the cut decodes cleanly: libjpeg-turbo stops after the last requested row, and its pixels are
    # that region of the intact file's decode (and of the truncated file's full decode).
    region = decoder.decode(cut, region=(16, 16, 64, 64))
    assert decoder.last_warning is None
    assert region.shape == (64, 64, 3)
    assert np.array_equal(region, decoder.decode(data)[16:80, 16:80])
    assert np.array_equal(region, img[16:80, 16:80])


def test_junk_before_marker_is_a_warning(decoder, photo_jpegs):
    data = photo_jpegs["china.jpg"]
    sos = data.find(b"\xff\xda")
    junk = data[:sos] + b"\x00\x11\x22" + data[sos:]
    assert np.array_equal(decoder.decode(junk), decoder.decode(data))
    img = decoder.decode(junk)
    assert img.shape == (427, 640, 3)
    assert "extraneous bytes before marker" in decoder.last_warning


def test_kernel_returns_warning_status(decoder, photo_jpegs):
    data = np.frombuffer(photo_jpegs["china.jpg"][:20000], dtype=np.uint8)
    out = np.zeros((427, 640, 3), np.uint8)
    assert jpeg_decode(decoder.handle, data, 1, 1, 0, 0, 640, 427, out, np.empty(0, np.uint8)) == WARNING


@pytest.mark.parametrize(
    "blob, text",
    [
        (b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8, "Not a JPEG file"),
        (np.random.default_rng(3).integers(0, 256, 5000, dtype=np.uint8).tobytes(), "Not a JPEG file"),
    ],
    ids=["png", "garbage"],
)
def test_not_a_jpeg_raises_with_libjpeg_message(decoder, blob, text):
    with pytest.raises(JpegDecodeError, match=text) as err:
        decoder.decode(blob)
    assert err.value.status == ERR_LIBJPEG
    with pytest.raises(JpegDecodeError, match=text):
        decoder.info(blob)


@pytest.mark.parametrize("cut", [2, 4, 300, 600], ids=["soi", "soi+4", "in-tables", "in-header"])
def test_no_scan_is_an_error_not_the_previous_header(decoder, photo_jpegs, cut):
    # TurboJPEG reports success for a stream that ends before its first scan and leaves tj3Get returning
    # the previous image's size (here 640x427): the kernel must say ERR_NO_IMAGE instead.
    data = photo_jpegs["china.jpg"]
    assert data.find(b"\xff\xda") > 600
    decoder.decode(data)
    for blob in (data[:cut], data[:cut] + b"\xff\xd9"):
        with pytest.raises(JpegDecodeError, match="no image") as err:
            decoder.info(blob)
        assert err.value.status == ERR_NO_IMAGE
        with pytest.raises(JpegDecodeError):
            decoder.decode(blob)


def test_real_png_file_raises(decoder, photos):
    png = Path(next(p for p in photos if p.endswith(".png"))).read_bytes()
    with pytest.raises(JpegDecodeError, match=r"Not a JPEG file: starts with 0x89 0x50"):
        decoder.decode(png)


def test_empty_input_is_a_clear_error(decoder):
    for empty in (b"", np.empty(0, np.uint8)):
        with pytest.raises(JpegDecodeError, match="empty input") as err:
            decoder.decode(empty)
        assert err.value.status == ERR_EMPTY
    assert jpeg_info(decoder.handle, np.empty(0, np.uint8))[0] == ERR_EMPTY


def test_kernel_argument_errors(decoder, variants):
    data = np.frombuffer(variants["420"], dtype=np.uint8)
    handle, out, none = decoder.handle, np.zeros((379, 509, 3), np.uint8), np.empty(0, np.uint8)
    big = np.empty(1 << 20, np.uint8)
    assert jpeg_decode(handle, data, 1, 1, 0, 0, 509, 379, out, none) == OK
    assert jpeg_decode(handle, data, 4, 8, 0, 0, 10, 10, out, big) == ERR_SCALE  # must be reduced: 1/2
    assert jpeg_decode(handle, data, 1, 2, 0, 0, 256, 190, out, big) == ERR_REGION  # 255x190 at 1/2
    assert jpeg_decode(handle, data, 1, 1, -1, 0, 10, 10, out, big) == ERR_REGION
    assert jpeg_decode(handle, data, 1, 1, 0, 0, 509, 379, out[:, :100], big) == ERR_OUT
    assert jpeg_decode(handle, data, 1, 1, 0, 0, 10, 10, np.zeros((10, 10, 4), np.uint8), big) == ERR_OUT
    assert jpeg_decode(handle, data, 1, 1, 40, 40, 100, 100, out, big[:100]) == ERR_SCRATCH
    assert jpeg_decode(handle, data, 1, 1, 40, 40, 100, 100, out, big[::2]) == ERR_SCRATCH
    packed_rows_only = np.zeros((379, 509, 4), np.uint8)[:, :, :3]  # strides (.., 4, 1): no direct decode
    assert jpeg_decode(handle, data, 1, 1, 0, 0, 509, 379, packed_rows_only, none) == ERR_SCRATCH
    assert jpeg_decode(handle, data, 1, 1, 0, 0, 509, 379, packed_rows_only, big) == OK
    strided = np.repeat(data, 2)[::2]
    assert jpeg_decode(handle, strided, 1, 1, 0, 0, 10, 10, out, big) == ERR_DATA
    with pytest.raises(JpegDecodeError, match=r"outside the 255x190 image"):
        decoder.decode(data, scale=(1, 2), region=(0, 0, 256, 190))
    with pytest.raises(JpegDecodeError, match="unsupported scale"):
        decoder.decode(data, scale=(2, 8))


def test_scratch_size_rules(decoder, variants):
    width, height, subsamp, colorspace = decoder.header(variants["420"])
    # Full-width regions of RGB/YCbCr/gray decode straight into `out`.
    assert scratch_size(width, height, subsamp, colorspace, 1, 1, 0, 10, width, 50) == 0
    # A crop: widened to 16-px iMCUs plus one iMCU each side: x 100..300 -> decoded columns 80..320.
    assert scratch_size(width, height, subsamp, colorspace, 1, 1, 100, 0, 200, 50) == (320 - 80) * 50 * 3
    # CMYK always goes through scratch, 4 bytes per pixel.
    cw, ch, csub, ccs = decoder.header(variants["cmyk"])
    assert scratch_size(cw, ch, csub, ccs, 1, 1, 0, 0, cw, ch) == cw * ch * 4
    assert jpeg.scratch_bound(cw, ch) >= scratch_size(cw, ch, csub, ccs, 1, 1, 0, 0, cw, ch)


# ---------------------------------------------------------------- scale arithmetic


def test_choose_scale_is_the_smallest_that_covers_the_output():
    assert choose_scale(640, 480, 640, 480, 224, 224) == (1, 2)  # 3/8 gives 180 rows < 224
    assert choose_scale(4000, 3000, 4000, 3000, 224, 224) == (1, 8)
    assert choose_scale(500, 375, 300, 300, 224, 224) == (3, 4)
    assert choose_scale(100, 100, 100, 100, 224, 224) == (1, 1)  # upsampling: full size
    rng = np.random.default_rng(0)
    for _ in range(200):
        width, height = (int(v) for v in rng.integers(16, 5000, 2))
        cw, ch = int(rng.integers(8, width + 1)), int(rng.integers(8, height + 1))
        ow, oh = (int(v) for v in rng.integers(8, 600, 2))
        num, denom = choose_scale(width, height, cw, ch, ow, oh)
        i = SCALES.index((num, denom))
        if (num, denom) != (1, 1) or (cw >= ow and ch >= oh):
            assert cw * num // denom >= ow and ch * num // denom >= oh
        if i > 0:
            pn, pd = SCALES[i - 1]
            assert cw * pn // pd < ow or ch * pn // pd < oh


def test_scale_region_covers_the_original_region():
    for num, denom in SCALES:
        sx, sy, sw, sh = scale_region(1000, 700, 333, 101, 250, 377, num, denom)
        assert sx * denom <= 333 * num and (sx + sw) * denom >= (333 + 250) * num
        assert sy * denom <= 101 * num and (sy + sh) * denom >= (101 + 377) * num
        assert sx + sw <= scaled_size(1000, num, denom) and sy + sh <= scaled_size(700, num, denom)


# ---------------------------------------------------------------- big images, threads, njit callers


def test_12000x9000_jpeg(decoder, photos, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # 108 Mpx trips Pillow's decompression-bomb guard
    path = next(p for p in photos if p.endswith("china.jpg"))
    with Image.open(path) as img:
        data = encode(img.resize((12000, 9000), Image.NEAREST), quality=75)
    assert decoder.info(data) == (12000, 9000)
    small = decoder.decode(data, scale=(1, 8))
    assert small.shape == (1125, 1500, 3)
    assert np.array_equal(small, pillow_rgb(data, 8))
    # A corner at full resolution: decodes 300 x 300 pixels (after entropy-decoding the rows above).
    corner = decoder.decode(data, region=(11700, 8700, 300, 300))
    quarter = decoder.decode(data, scale=(1, 4))
    assert quarter.shape == (2250, 3000, 3)
    assert np.array_equal(
        decoder.decode(data, scale=(1, 4), region=(2925, 2175, 75, 75)), quarter[-75:, -75:]
    )
    if not NO_JIT:
        full = decoder.decode(data)
        assert np.array_equal(corner, full[8700:, 11700:])


def test_two_threads_with_own_decoders_match_sequential(photo_jpegs):
    tasks = []
    for data in photo_jpegs.values():
        for scale in ((1, 1), (1, 2), (1, 4)):
            tasks.append((data, scale, None))
        tasks.append((data, (1, 2), (8, 5, 100, 60)))
    with JpegDecoder() as dec:
        expected = [dec.decode(d, scale=s, region=r) for d, s, r in tasks]

    def worker(rounds: int) -> list[np.ndarray]:
        with JpegDecoder() as own:
            return [own.decode(d, scale=s, region=r) for _ in range(rounds) for d, s, r in tasks]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(worker, [3, 3]))
    for result in results:
        for i, img in enumerate(result):
            assert np.array_equal(img, expected[i % len(tasks)])


@numba.njit(nogil=True)
def _decode_center_crops(handle, blob, offsets, out_w, out_h, out, scratch, meta):
    # What a loader's fused loop does: header, scale choice, scaled region, decode into a batch slot.
    for i in range(offsets.size - 1):
        data = blob[offsets[i] : offsets[i + 1]]
        status, width, height, subsamp, colorspace = jpeg_info(handle, data)
        if status < 0:
            meta[i, 0] = status
            continue
        num, denom = choose_scale(width, height, width, height, out_w, out_h)
        sw, sh = scaled_size(width, num, denom), scaled_size(height, num, denom)
        w, h = min(sw, out.shape[2]), min(sh, out.shape[1])
        x, y = (sw - w) // 2, (sh - h) // 2
        if scratch_size(width, height, subsamp, colorspace, num, denom, x, y, w, h) > scratch.size:
            meta[i, 0] = -100
            continue
        meta[i, 0] = jpeg_decode(handle, data, num, denom, x, y, w, h, out[i], scratch)
        meta[i, 1], meta[i, 2], meta[i, 3], meta[i, 4], meta[i, 5], meta[i, 6] = x, y, w, h, num, denom


def test_kernels_work_inside_another_njit_function(decoder, photo_jpegs):
    datas = list(photo_jpegs.values())
    blob = np.frombuffer(b"".join(datas), dtype=np.uint8)
    offsets = np.cumsum([0] + [len(d) for d in datas]).astype(np.int64)
    out = np.zeros((len(datas), 160, 200, 3), np.uint8)
    scratch = np.empty((200 + 4 * 32) * 160 * 4, np.uint8)  # scratch_size's bound for a 200 x 160 crop
    meta = np.zeros((len(datas), 7), np.int64)
    _decode_center_crops(decoder.handle, blob, offsets, 200, 160, out, scratch, meta)
    for i, data in enumerate(datas):
        status, x, y, w, h, num, denom = (int(v) for v in meta[i])
        assert status == OK, i
        assert (num, denom) == choose_scale(*decoder.info(data), *decoder.info(data), 200, 160)
        ref = decoder.decode(data, scale=(num, denom), region=(x, y, w, h))
        assert np.array_equal(out[i, :h, :w], ref)


# ---------------------------------------------------------------- lifecycle, loading, caching


def test_decoder_close_is_idempotent_and_final(variants):
    dec = JpegDecoder()
    handle = dec.handle
    assert isinstance(handle, int) and handle != 0
    dec.close()
    dec.close()
    assert dec.handle == 0
    with pytest.raises(ValueError, match="closed"):
        dec.decode(variants["420"])


def test_error_string_for_a_handle(decoder):
    with pytest.raises(JpegDecodeError):
        decoder.decode(b"not a jpeg at all")
    assert "Not a JPEG file" in jpeg.error_string(decoder.handle)


def test_missing_wheel_names_the_pip_command(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    with pytest.raises(ImportError, match=r"pip install 'turbojpeg==0.0.2'") as err:
        turbo.find_library()
    assert isinstance(err.value, turbo.TurboJpegNotFoundError)


def _run(code: str, *args: str, env: dict | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_loads_and_compiles_nothing():
    code = (
        "import json, sys; from pageset.ops import jpeg;"
        "maps = open('/proc/self/maps').read();"
        "r = dict(loaded='libturbojpeg' in maps, compiled=len(getattr(jpeg.jpeg_decode, 'overloads', ())));"
        "jpeg.JpegDecoder().close();"
        "r['loaded_after'] = 'libturbojpeg' in open('/proc/self/maps').read();"
        "r['pyturbojpeg'] = 'turbojpeg' in sys.modules; print(json.dumps(r))"
    )
    assert _run(code) == {"loaded": False, "compiled": 0, "loaded_after": True, "pyturbojpeg": False}


CACHE_PROBE = """
import json, sys, time
from pageset.ops import jpeg
data = open(sys.argv[1], "rb").read()
with jpeg.JpegDecoder() as dec:
    t = time.perf_counter()
    dec.decode(data, scale=(1, 2), region=(8, 8, 64, 48))
    first = time.perf_counter() - t
stats = jpeg.jpeg_decode.stats
print(json.dumps(dict(first_call_s=first, hits=sum(stats.cache_hits.values()),
                      misses=sum(stats.cache_misses.values()))))
"""


@pytest.mark.slow
@pytest.mark.skipif(NO_JIT, reason="nothing is compiled (or cached) under NUMBA_DISABLE_JIT")
def test_compiled_kernels_are_reused_by_a_second_process(tmp_path, photos):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    path = next(p for p in photos if p.endswith("china.jpg"))
    first = _run(CACHE_PROBE, path, env=env)
    second = _run(CACHE_PROBE, path, env=env)
    print(f"first-call time: compile {first['first_call_s']:.2f} s, cached {second['first_call_s']:.2f} s")
    assert first["misses"] >= 1 and first["hits"] == 0
    assert second["hits"] >= 1 and second["misses"] == 0
    assert any(tmp_path.rglob("*jpeg_decode*.nbi"))
