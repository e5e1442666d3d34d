"""The writer's JPEG shortcuts on real photos: jpeg_passthrough (input bytes kept as given) and jpeg_draft (a large
JPEG decoded at a reduced DCT scale before the LANCZOS shrink), with their quality bound and determinism."""

from __future__ import annotations

import io
from pathlib import Path

import numba
import numpy as np
import pytest
from PIL import Image

from pageset import RGBImage, SampleError, open_dataset, write_dataset
from pageset.ops.jpeg import JpegDecoder
from pageset.write.encode import encode_image

DRAFT_PSNR_MIN = 40.0  # dB against a full decode + LANCZOS; measured 45-65 dB on the wheel and Debian photos


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def real_jpegs(photos) -> list[bytes]:
    """The wheels' real JPEG files as they are (640x427 to 1411x1411, baseline, 4:2:0/4:4:4)."""
    return [Path(p).read_bytes() for p in photos if p.endswith(".jpg")]


@pytest.fixture(scope="module")
def flavours(photo_arrays) -> dict[str, bytes]:
    """One real photo in each JPEG flavour passthrough accepts."""
    img = Image.fromarray(photo_arrays[0]).crop((0, 0, 301, 237))  # odd sizes: partial iMCUs at the edges
    return {"444": _jpeg(img, quality=90, subsampling=0), "422": _jpeg(img, quality=80, subsampling=1),
            "420": _jpeg(img, quality=95, subsampling=2), "progressive": _jpeg(img, quality=85, progressive=True),
            "gray": _jpeg(img.convert("L"), quality=90)}


def _stored(path) -> list[tuple[bytes, int, int]]:
    with open_dataset(path) as ds:
        return [(ds[i]["image"].data, ds[i]["image"].height, ds[i]["image"].width) for i in range(len(ds))]


def test_passthrough_keeps_the_bytes_and_the_loader_decodes_them_like_pillow(tmp_path, real_jpegs, flavours):
    inputs = real_jpegs + list(flavours.values())
    files = []
    for k, data in enumerate(inputs):  # paths and bytes both pass through
        files.append(tmp_path / f"{k}.jpg")
        files[-1].write_bytes(data)
    samples = [(str(f),) if k % 2 else (f.read_bytes(),) for k, f in enumerate(files)]
    out = tmp_path / "kept.pageset"
    write_dataset(out, samples, {"image": RGBImage(jpeg_passthrough=True)}, num_workers=0, progress=False)
    with JpegDecoder() as dec:
        for k, (data, (stored, h, w)) in enumerate(zip(inputs, _stored(out))):
            assert stored == data
            ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
            assert (h, w) == ref.shape[:2]
            if numba.config.DISABLE_JIT and k < len(real_jpegs):
                continue  # plain-Python kernels: ~1 s per 200k pixels; the small flavours still run
            np.testing.assert_array_equal(dec.decode(stored, scale=(1, 1)), ref)


def test_passthrough_converts_what_it_cannot_keep(tmp_path, photo_arrays, flavours):
    img = Image.fromarray(photo_arrays[0]).crop((0, 0, 301, 237))
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = _jpeg(img, quality=90, exif=exif)
    cmyk = _jpeg(img.convert("CMYK"), quality=90)
    png = io.BytesIO()
    img.save(png, format="PNG")
    inputs = [rotated, cmyk, png.getvalue(), flavours["420"]]
    out = tmp_path / "mixed.pageset"
    write_dataset(out, [(b,) for b in inputs], {"image": RGBImage(jpeg_passthrough=True, max_resolution=256)},
                  num_workers=0, progress=False)
    stored = _stored(out)
    for data, (kept, _, _) in zip(inputs, stored):
        assert kept != data and Image.open(io.BytesIO(kept)).info.get("progressive") is None
    assert [(h, w) for _, h, w in stored] == [(256, 202), (202, 256), (202, 256), (202, 256)]  # rotated; shrunk
    # the same bytes as without passthrough
    write_dataset(tmp_path / "conv.pageset", [(b,) for b in inputs], {"image": RGBImage(max_resolution=256)},
                  num_workers=0, progress=False)
    assert _stored(tmp_path / "conv.pageset") == stored


def test_passthrough_still_rejects_a_truncated_jpeg(tmp_path, flavours):
    broken = flavours["420"][: len(flavours["420"]) // 2]
    with pytest.raises(SampleError, match=r"sample 1, field 'image'.*could not be decoded"):
        write_dataset(tmp_path / "t.pageset", [(flavours["444"],), (broken,)],
                      {"image": RGBImage(jpeg_passthrough=True)}, num_workers=0, progress=False)
    assert not (tmp_path / "t.pageset").exists()


def test_draft_stays_within_the_psnr_bound_of_a_full_decode(real_jpegs):
    """A quality check, not a speed check: every real JPEG at sizes where a DCT scale applies."""
    applied = 0
    for data in real_jpegs:
        for max_resolution in (100, 160, 224):
            stats: dict = {}
            fast, cols = encode_image(data, RGBImage(max_resolution=max_resolution, encoding="raw"), stats)
            full, cols_full = encode_image(data, RGBImage(max_resolution=max_resolution, encoding="raw",
                                                          jpeg_draft=False))
            assert cols == cols_full
            shape = (cols["height"], cols["width"], 3)
            a, b = np.frombuffer(fast, np.uint8).reshape(shape), np.frombuffer(full, np.uint8).reshape(shape)
            assert _psnr(a, b) >= DRAFT_PSNR_MIN, (len(data), max_resolution, _psnr(a, b))
            applied += stats.get("draft", 0)
    assert applied >= len(real_jpegs)  # the scale really applied (here to all but the smallest ratios)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_draft_follows_the_exif_orientation(photo_arrays, orientation):
    img = Image.fromarray(photo_arrays[0]).resize((903, 677), Image.LANCZOS)  # 1/2 scale rounds sizes up
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = _jpeg(img, quality=92, exif=exif)
    stats: dict = {}
    fast, cols = encode_image(data, RGBImage(max_resolution=150, encoding="raw"), stats)
    full, cols_full = encode_image(data, RGBImage(max_resolution=150, encoding="raw", jpeg_draft=False))
    assert stats["draft"] == 1 and cols == cols_full
    assert (cols["width"] > cols["height"]) == (orientation < 5)
    shape = (cols["height"], cols["width"], 3)
    psnr = _psnr(np.frombuffer(fast, np.uint8).reshape(shape), np.frombuffer(full, np.uint8).reshape(shape))
    assert psnr >= DRAFT_PSNR_MIN, psnr  # a misplaced margin (half a pixel at 1/4 scale) costs ~10 dB


def test_small_inputs_and_other_formats_are_not_drafted(photo_arrays, real_jpegs):
    png = io.BytesIO()
    Image.fromarray(photo_arrays[0]).save(png, format="PNG")
    stats: dict = {}
    for value in (png.getvalue(), photo_arrays[0], real_jpegs[0]):
        encode_image(value, RGBImage(max_resolution=400), stats)  # a 640 px JPEG needs 4x: no scale fits
    assert stats["images"] == 3 and "draft" not in stats


@pytest.mark.parametrize("passthrough", [False, True])
def test_same_input_same_bytes_with_0_and_2_workers(tmp_path, real_jpegs, flavours, passthrough):
    files = []
    for k, data in enumerate(real_jpegs + list(flavours.values())):
        files.append(str(tmp_path / f"{k}.jpg"))
        Path(files[-1]).write_bytes(data)
    fields = {"image": RGBImage(max_resolution=200, jpeg_passthrough=passthrough)}
    blobs = set()
    for w in (0, 2, 0):
        out = tmp_path / f"w{w}.pageset"
        write_dataset(out, files, fields, num_workers=w, chunk_size=2, lineage=False, progress=False)
        blobs.add(out.read_bytes())
    assert len(blobs) == 1


@pytest.mark.parametrize("max_resolution", [None, 300, 100])
def test_libjpeg_turbo_path_gives_pillows_pixels(monkeypatch, real_jpegs, flavours, max_resolution):
    """Plain JPEGs are decoded by libjpeg-turbo (write/turbo.py), at full size, shrunk and drafted: the pixels
    equal the Pillow path's (its decode is bit-exact with Pillow's at every DCT scale)."""
    from pageset.write import encode

    inputs = real_jpegs + list(flavours.values())
    field = RGBImage(max_resolution=max_resolution, encoding="raw")
    stats: dict = {}
    fast = [encode_image(data, field, stats) for data in inputs]
    assert stats["turbo"] == len(inputs)
    monkeypatch.setattr(encode, "_turbo_decode", lambda img, drafted: None)
    assert [encode_image(data, field) for data in inputs] == fast
    # JPEG encoding through libjpeg-turbo: same settings, a decodable baseline JPEG of the same size
    for data, (raw, cols) in zip(inputs, fast):
        monkeypatch.undo()
        jpeg, jcols = encode_image(data, RGBImage(max_resolution=max_resolution, jpeg_quality=90))
        img = Image.open(io.BytesIO(jpeg))
        assert img.size == (cols["width"], cols["height"]) == (jcols["width"], jcols["height"])
        ref = np.frombuffer(raw, np.uint8).reshape(cols["height"], cols["width"], 3)
        assert _psnr(np.asarray(img.convert("RGB")), ref) > 30.0


def test_same_subsampling_is_re_encoded_from_its_ycbcr_planes(monkeypatch, flavours, real_jpegs):
    """A JPEG that needs no shrink and has the field's subsampling skips the RGB round trip ("yuv"): the result
    is at least as close to the input as the RGB path's, and only such inputs take that path."""
    from pageset.write import turbo

    field = RGBImage(jpeg_quality=90, jpeg_subsampling="4:2:0")
    stats: dict = {}
    inputs = list(flavours.values()) + real_jpegs
    outs = [encode_image(data, field, stats) for data in inputs]
    subsampling = [Image.open(io.BytesIO(d)).layer for d in inputs]  # [(id, h, v, q), ...] per component
    is_420 = [len(s) == 3 and s[0][1:3] == (2, 2) and s[1][1:3] == (1, 1) for s in subsampling]
    assert stats.get("yuv", 0) == sum(is_420) >= 2
    monkeypatch.setattr(turbo, "transcode_yuv", lambda *a: None)
    for data, (jpeg, cols), yuv in zip(inputs, outs, is_420):
        rgb_jpeg, rgb_cols = encode_image(data, field)
        assert cols == rgb_cols and (jpeg != rgb_jpeg) == yuv
        ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        got = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
        via_rgb = np.asarray(Image.open(io.BytesIO(rgb_jpeg)).convert("RGB"))
        assert _psnr(got, ref) >= _psnr(via_rgb, ref) - 0.1
