"""Crop-only decoding of JPEGs with restart intervals (pageset.ops.jpeg_restart), checked against Pillow.

The expectation is independent of the code under test: Pillow's decode of the whole file (``Image.draft`` at
1/2, 1/4, 1/8), cropped. Crops sit at every edge and corner and on both sides of MCU and restart-interval
boundaries, for every chroma subsampling the writer and Pillow produce, odd sizes, grayscale and CMYK, and several
interval lengths. Damaged markers must give ERR_RESTART (a DecodeError in the Loader), never other pixels.
"""

from __future__ import annotations

import io

import numba
import numpy as np
import pytest
from PIL import Image

from pageset import DecodeError, Loader, RandomHorizontalFlip, RandomResizedCrop, RGBImage, open_dataset, \
    write_dataset
from pageset.ops import jpeg_restart
from pageset.ops.jpeg import ERR_RESTART, OK, JpegDecoder, jpeg_decode, jpeg_decode_window, scaled_size, \
    window_view
from pageset.write import turbo
from pageset.write.encode import restart_blocks

NO_JIT = numba.config.DISABLE_JIT
SCALES = ((1, 1), (1, 2)) if NO_JIT else ((1, 1), (7, 8), (5, 8), (1, 2), (3, 8), (1, 4), (1, 8))


def _jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", **kw)
    return buf.getvalue()


def _markers(data: bytes) -> dict:
    """SOF size and DRI interval read by hand (T.81 B.2.2, B.2.4.4), and the RSTn numbers in order."""
    out, i = {"dri": 0, "rst": []}, 2
    while data[i + 1] != 0xDA:
        marker, length = data[i + 1], int.from_bytes(data[i + 2:i + 4], "big")
        if marker in (0xC0, 0xC1):
            out["height"], out["width"] = int.from_bytes(data[i + 5:i + 7], "big"), int.from_bytes(data[i + 7:i + 9],
                                                                                                  "big")
        if marker == 0xDD:
            out["dri"] = int.from_bytes(data[i + 4:i + 6], "big")
        i += 2 + length
    out["rst"] = [data[j + 1] - 0xD0 for j in range(i, len(data) - 1) if data[j] == 0xFF and 0xD0 <= data[j + 1] <= 0xD7]
    return out


def _pillow(data: bytes, num: int, den: int) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        if (num, den) != (1, 1):
            assert den // num in (2, 4, 8) and den % num == 0
            img.draft("RGB", (-(-img.size[0] * num // den), -(-img.size[1] * num // den)))
        return np.asarray(img.convert("RGB"))


def _reference(dec, arr, num, den, sw, sh):
    """Pillow's decode at the scale; where Pillow has none (3/8, 5/8, 7/8; CMYK drafts) libjpeg-turbo's full decode
    of the whole image, which never takes the restart path (tests/test_jpeg.py pins it to Pillow)."""
    if den % num == 0 and den // num in (1, 2, 4, 8):
        ref = _pillow(arr.tobytes(), num, den)
        if ref.shape == (sh, sw, 3):
            return ref
    assert jpeg_restart.sub_image(arr, num, den, 0, 0, sw, sh)[0] == jpeg_restart.NO_RESTART
    ref = np.zeros((sh, sw, 3), np.uint8)
    assert jpeg_decode(dec.handle, arr, num, den, 0, 0, sw, sh, ref, np.empty(sw * sh * 4, np.uint8)) == OK
    return ref


@pytest.fixture(scope="module")
def picture(photo_arrays) -> Image.Image:
    return Image.fromarray(photo_arrays[0]).crop((3, 5, 3 + 301, 5 + 237))  # odd: partial MCUs at two edges


def _flavours(picture):
    """(name, bytes, MCU width, MCU height) with restart intervals, every subsampling, gray, CMYK."""
    gray, cmyk = picture.convert("L"), picture.convert("CMYK")
    yield "420-rows", _jpeg(picture, quality=90, subsampling=2, restart_marker_rows=1), 16, 16
    yield "420-b1", _jpeg(picture, quality=90, subsampling=2, restart_marker_blocks=1), 16, 16  # 19 MCUs a row
    yield "420-2rows", _jpeg(picture, quality=85, subsampling=2, restart_marker_rows=2), 16, 16
    yield "422-b1", _jpeg(picture, quality=90, subsampling=1, restart_marker_blocks=1), 16, 8
    yield "444-b2", _jpeg(picture, quality=95, subsampling=0, restart_marker_blocks=2), 8, 8
    pixels = np.asarray(picture)  # 4:4:0 and 4:1:1, which Pillow does not write: TurboJPEG's TJSAMP 4 and 5
    yield "440-b19", turbo.encode_rgb(pixels, 90, 4, restart_blocks=19), 8, 16
    yield "411-b5", turbo.encode_rgb(pixels, 90, 5, restart_blocks=5), 32, 8
    yield "gray-b2", _jpeg(gray, quality=90, restart_marker_blocks=2), 8, 8
    yield "cmyk-rows", _jpeg(cmyk, quality=90, restart_marker_rows=1), 8, 8


def _regions(sw, sh, mw, mh, rng, n):
    """Corners, edges, the whole image, MCU-boundary neighbours (scaled MCU mw x mh), and random regions."""
    xs = sorted({0, 1, mw - 1, mw, mw + 1, 2 * mw - 2, sw // 2, sw - mw - 1, sw - mw, sw - 2, sw - 1} & set(range(sw)))
    ys = sorted({0, 1, mh - 1, mh, mh + 1, 2 * mh - 2, sh // 2, sh - mh - 1, sh - mh, sh - 2, sh - 1} & set(range(sh)))
    out = [(0, 0, sw, sh)]
    for x in xs:
        for y in ys:
            out.append((x, y, min(sw - x, max(1, mw + 3)), min(sh - y, max(1, mh + 2))))  # small, at that point
            out.append((0, y, x + 1, sh - y))  # from the left edge, to the bottom edge
            out.append((x, 0, sw - x, y + 1))  # to the right edge, from the top edge
    for _ in range(n):
        x, y = int(rng.integers(0, sw)), int(rng.integers(0, sh))
        out.append((x, y, int(rng.integers(1, sw - x + 1)), int(rng.integers(1, sh - y + 1))))
    return out


def test_every_crop_equals_pillows_full_decode_then_crop(picture):
    rng = np.random.default_rng(3)
    cut = checked = 0
    with JpegDecoder() as dec:
        for name, data, mcu_w, mcu_h in _flavours(picture):
            arr = np.frombuffer(data, np.uint8)
            assert _markers(data)["dri"] > 0, name
            assert jpeg_restart.read_header(arr, np.zeros(jpeg_restart.LAYOUT_SIZE, np.int64)) == jpeg_restart.USABLE
            for num, den in SCALES:
                sw, sh = scaled_size(301, num, den), scaled_size(237, num, den)
                ref = _reference(dec, arr, num, den, sw, sh)
                mw, mh = max(1, mcu_w * num // den), max(1, mcu_h * num // den)
                regions = _regions(sw, sh, mw, mh, rng, 4 if NO_JIT else 20)
                if NO_JIT:
                    regions = regions[:: max(1, len(regions) // 12)]
                for x, y, w, h in regions:
                    want = ref[y:y + h, x:x + w]
                    out = np.zeros((h, w, 3), np.uint8)
                    st = jpeg_decode(dec.handle, arr, num, den, x, y, w, h, out, np.empty(sw * sh * 4, np.uint8))
                    assert st == OK and np.array_equal(out, want), (name, num, den, x, y, w, h, st)
                    buf = np.empty(sw * sh * 4, np.uint8)
                    st, h0, w0, row, col = jpeg_decode_window(dec.handle, arr, num, den, x, y, w, h, buf,
                                                              np.empty(sw * sh * 4, np.uint8))
                    assert st == OK and np.array_equal(window_view(buf, h0, w0, row, col, h, w), want), (name, x, y)
                    cut += jpeg_restart.sub_image(arr, num, den, x, y, w, h)[0] == jpeg_restart.USABLE
                    checked += 1
    assert cut > checked // 2  # most regions really went through a sub-JPEG of their intervals


def test_the_sub_jpeg_is_a_valid_jpeg_of_its_rectangle(picture):
    """Pillow itself reads the assembled sub-JPEG: the rectangle's pixels away from the cut (CONTEXT pixels)."""
    data = _jpeg(picture.crop((0, 0, 288, 237)), quality=90, subsampling=2, restart_marker_blocks=2)  # 18 MCUs
    arr = np.frombuffer(data, np.uint8)
    full = _pillow(data, 1, 1)
    st, sub, dx, dy = jpeg_restart.sub_image(arr, 1, 1, 100, 60, 90, 70)
    assert st == jpeg_restart.USABLE and (dx, dy) == (96, 48)  # MCU 16: 100 - 4 -> MCU 6, 2-MCU intervals -> 6
    m = _markers(sub.tobytes())
    assert m["dri"] == 2 and m["rst"] == [k % 8 for k in range(len(m["rst"]))]
    assert (m["width"], m["height"]) == (128, 96)  # MCUs 6..14 (interval-rounded), rows 3..9
    got = _pillow(sub.tobytes(), 1, 1)
    np.testing.assert_array_equal(got[12:12 + 70, 4:4 + 90], full[60:130, 100:190])
    assert sub.size < len(data) // 2


def _damaged(data: bytes) -> dict[str, bytes]:
    positions = [j for j in range(len(data) - 1) if data[j] == 0xFF and 0xD0 <= data[j + 1] <= 0xD7]
    mid = positions[len(positions) // 2]
    renumbered = bytearray(data)
    renumbered[mid + 1] = 0xD0 + (renumbered[mid + 1] - 0xD0 + 3) % 8
    dri = data.index(b"\xff\xdd")
    halved = bytearray(data)
    halved[dri + 5] //= 2  # an interval of 1 MCU instead of 2: twice as many markers expected
    return {"renumbered": bytes(renumbered), "dropped": data[:mid] + data[mid + 2:],
            "extra": data[:mid] + b"\xff\xd0" + data[mid:], "interval": bytes(halved)}


def test_damaged_restart_markers_are_an_error_never_other_pixels(picture):
    data = _jpeg(picture, quality=90, subsampling=0, restart_marker_blocks=2)  # 38 MCUs a row
    assert _markers(data)["dri"] == 2
    with JpegDecoder() as dec:
        for name, bad in _damaged(data).items():
            arr = np.frombuffer(bad, np.uint8)
            for x, y, w, h in ((0, 0, 301, 237), (120, 100, 50, 40), (0, 0, 20, 20)):
                out = np.zeros((h, w, 3), np.uint8)
                assert jpeg_decode(dec.handle, arr, 1, 1, x, y, w, h, out, np.empty(301 * 237 * 4, np.uint8)) == \
                    ERR_RESTART, (name, x, y)


def test_restart_blocks_divide_the_row():
    # (width, subsampling, per_row) -> interval in MCUs, by hand: 512 px = 32 MCUs of 16; 496 = 31 (prime);
    # 301 px 4:4:4 = 38 MCUs of 8 (divisors 1, 2, 19, 38)
    table = {(512, "4:2:0", 4): 8, (512, "4:2:0", 1): 32, (512, "4:2:0", 64): 1, (500, "4:2:2", 3): 16,
             (496, "4:2:0", 4): 31, (301, "4:4:4", 4): 19, (301, "4:4:4", 2): 19, (301, "4:4:4", 38): 1,
             (640, "4:2:0", 0): 0}
    assert {key: restart_blocks(*key) for key in table} == table


@pytest.fixture(scope="module")
def restart_files(tmp_path_factory, photo_arrays):
    root = tmp_path_factory.mktemp("restart")
    imgs = [(np.ascontiguousarray(a[:200 + 7 * k, :260 - 5 * k]),) for k, a in enumerate(photo_arrays[:8])]
    paths = {}
    for n in (0, 1, 4):
        paths[n] = root / f"r{n}.pageset"
        write_dataset(paths[n], imgs, {"image": RGBImage(jpeg_quality=90, jpeg_restart=n)}, num_workers=0,
                      progress=False)
    return paths


def test_writer_restart_intervals_change_the_bytes_not_the_pixels(restart_files):
    # 0 stays out of the schema: a file written without restart intervals has the bytes it had before
    assert b'"jpeg_restart"' not in restart_files[0].read_bytes() and b'"jpeg_restart"' in restart_files[4].read_bytes()
    with open_dataset(restart_files[0]) as plain, open_dataset(restart_files[4]) as cut, \
            open_dataset(restart_files[1]) as rows:
        for i in range(len(plain)):
            p, c, r = plain[i]["image"], cut[i]["image"], rows[i]["image"]
            mp, mc, mr = _markers(p.data), _markers(c.data), _markers(r.data)
            mcus = -(-c.width // 16)
            assert mp["dri"] == 0 and mc["dri"] == restart_blocks(c.width, "4:2:0", 4) and mr["dri"] == mcus
            assert mcus % mc["dri"] == 0 and mcus // mc["dri"] <= 4
            # entropy coding is lossless: the same coefficients, so Pillow decodes the same pixels
            np.testing.assert_array_equal(_pillow(c.data, 1, 1), _pillow(p.data, 1, 1))
            np.testing.assert_array_equal(_pillow(r.data, 1, 1), _pillow(p.data, 1, 1))
            assert len(c.data) > len(p.data)


@pytest.mark.parametrize("resize_mode", ["exact", "fast"])
def test_loader_batches_equal_those_of_the_file_without_restarts(restart_files, resize_mode):
    def epoch(path):
        pipe = [RandomResizedCrop(96, resize_mode=resize_mode), RandomHorizontalFlip()]
        with Loader(path, batch_size=4, seed=5, num_threads=2, pipelines={"image": pipe},
                    array_type="numpy") as loader:
            return [b["image"].copy() for b in loader]
    want = epoch(restart_files[0])
    for n in (1, 4):
        for a, b in zip(epoch(restart_files[n]), want, strict=True):
            np.testing.assert_array_equal(a, b)


def test_loader_names_the_sample_with_damaged_markers(tmp_path, picture):
    good = _jpeg(picture, quality=90, subsampling=0, restart_marker_blocks=2)
    path = tmp_path / "damaged.pageset"
    write_dataset(path, [(good,)] * 3, {"image": RGBImage(jpeg_passthrough=True)}, num_workers=0, progress=False)
    data = bytearray(path.read_bytes())
    with open_dataset(path) as ds:
        off = int(ds.index["image.offset"][1])
    data[off:off + len(good)] = _damaged(good)["renumbered"]  # pages are not verified at load
    path.write_bytes(bytes(data))
    with Loader(path, batch_size=3, order="sequential", pipelines={"image": [RandomResizedCrop(64)]},
                array_type="numpy") as loader, pytest.raises(DecodeError, match=r"sample 1, field 'image'.*restart"):
        list(loader)
