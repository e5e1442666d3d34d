"""write_dataset -> open_dataset round trips on real photos: every field, every image mode, determinism."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image

from pageset import JSON, Bytes, Float, Int, NDArray, RGBImage, open_dataset, write_dataset


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_every_field_round_trips(tmp_path, photo_arrays):
    rng = np.random.default_rng(0)
    samples = []
    for k, arr in enumerate(photo_arrays):
        samples.append({
            "raw": arr,
            "jpeg": arr,
            "label": k,
            "score": float(k) / 3,
            "emb": rng.standard_normal((4, 5)).astype(np.float32),
            "blob": bytes(rng.integers(0, 256, size=k * 37, dtype=np.uint8)),
            "meta": {"k": k, "name": f"photo {k}", "tags": ["a", "ü"], "none": None},
        })
    fields = {
        "raw": RGBImage(encoding="raw"),
        "jpeg": RGBImage(encoding="jpeg", jpeg_quality=90),
        "label": Int("int32"),
        "score": Float("float64"),
        "emb": NDArray("float32", (4, 5)),
        "blob": Bytes(),
        "meta": JSON(),
    }
    out = tmp_path / "all.pageset"
    res = write_dataset(out, samples, fields, num_workers=0, page_size=1 << 16, progress=False)
    assert res.records == len(samples)
    with open_dataset(out) as ds:
        assert len(ds) == len(samples)
        ds.verify()
        for s, rec in zip(samples, ds):
            raw = rec["raw"]
            assert raw.encoding == "raw" and (raw.height, raw.width) == s["raw"].shape[:2]
            np.testing.assert_array_equal(raw.to_numpy(), s["raw"])  # bit-exact
            jp = rec["jpeg"]
            assert jp.encoding == "jpeg" and jp.data[:2] == b"\xff\xd8"
            assert _psnr(jp.to_numpy(), s["jpeg"]) > 30.0  # q90 4:2:0 on photos: 33-45 dB measured
            assert rec["label"] == s["label"] and isinstance(rec["label"], int)
            assert rec["score"] == s["score"]
            np.testing.assert_array_equal(rec["emb"], s["emb"])
            assert rec["emb"].dtype == np.float32
            assert rec["blob"] == s["blob"]
            assert rec["meta"] == s["meta"]
        assert ds.read(2, "label") == 2
        with pytest.raises(IndexError):
            ds[len(samples)]
        with pytest.raises(KeyError):
            ds.read(0, "nope")


def test_imagefolder_and_determinism_across_workers(tmp_path, imagenet_like):
    a, b, c = tmp_path / "a.pageset", tmp_path / "b.pageset", tmp_path / "c.pageset"
    ra = write_dataset(a, imagenet_like, num_workers=1, page_size=1 << 16, progress=False)
    rb = write_dataset(b, imagenet_like, num_workers=2, page_size=1 << 16, progress=False, chunk_size=3)
    rc = write_dataset(c, imagenet_like, num_workers=0, page_size=1 << 16, progress=False)
    assert ra.dataset_id == rb.dataset_id == rc.dataset_id
    with open_dataset(a) as da, open_dataset(b) as db:
        # Everything but the lineage (time, host) is byte-identical (see the lineage=False test for whole files).
        meta_a = da.file_size - (da.header["section_table_offset"] - 0)
        assert meta_a > 0
        bytes_a = open(a, "rb").read()
        bytes_b = open(b, "rb").read()
        end = da.data_offset + da.data_length
        assert bytes_a[4096:end] == bytes_b[4096:end]
        assert da.index.tobytes() == db.index.tobytes()
        classes = da.schema["attributes"]["class_names"]
        assert classes == sorted(p.name for p in imagenet_like.iterdir())
        labels = da.index["label"]
        assert set(labels.tolist()) == set(range(len(classes)))
        assert (np.diff(labels) >= 0).all()  # sorted class folders, integer labels in that order
        assert da.page_count > 1


def test_whole_file_byte_identical_without_lineage(tmp_path, imagenet_like):
    paths = [tmp_path / f"{w}.pageset" for w in (1, 2)]
    for w, p in zip((1, 2), paths):
        write_dataset(p, imagenet_like, num_workers=w, page_size=1 << 16, progress=False, lineage=False,
                      chunk_size=2 + w)
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_image_inputs_and_modes(tmp_path, photo_arrays):
    rgb = photo_arrays[0][:120, :160]
    pil = Image.fromarray(rgb)
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    path = tmp_path / "x.png"
    pil.save(path)
    gray = Image.fromarray(rgb).convert("L")
    cmyk = Image.fromarray(rgb).convert("CMYK")
    cmyk_buf = io.BytesIO()
    cmyk.save(cmyk_buf, format="JPEG", quality=95)
    rgba = Image.fromarray(rgb).convert("RGBA")
    rgba.putalpha(17)
    pal = Image.fromarray(rgb).convert("P", palette=Image.ADAPTIVE, colors=64)
    items = [rgb, pil, buf.getvalue(), str(path), gray, cmyk_buf.getvalue(), rgba, pal, np.asarray(gray)]
    out = tmp_path / "modes.pageset"
    write_dataset(out, [(x,) for x in items], {"img": RGBImage(encoding="raw")}, num_workers=0, progress=False)
    with open_dataset(out) as ds:
        decoded = [ds[i]["img"].to_numpy() for i in range(len(ds))]
    for k in range(4):
        np.testing.assert_array_equal(decoded[k], rgb)
    g = np.asarray(gray)
    np.testing.assert_array_equal(decoded[4], np.stack([g] * 3, axis=-1))
    np.testing.assert_array_equal(decoded[8], np.stack([g] * 3, axis=-1))
    cmyk_ref = np.asarray(Image.open(io.BytesIO(cmyk_buf.getvalue())).convert("RGB"))
    np.testing.assert_array_equal(decoded[5], cmyk_ref)
    np.testing.assert_array_equal(decoded[6], rgb)  # alpha dropped, colour untouched
    np.testing.assert_array_equal(decoded[7], np.asarray(pal.convert("RGB")))


def test_exif_orientation_applied(tmp_path, photo_arrays):
    rgb = photo_arrays[1][:90, :140]
    img = Image.fromarray(rgb)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW on display
    buf = io.BytesIO()
    img.save(buf, format="PNG", exif=exif)
    out = tmp_path / "exif.pageset"
    write_dataset(out, [(buf.getvalue(),)], {"img": RGBImage(encoding="raw")}, num_workers=0, progress=False)
    with open_dataset(out) as ds:
        got = ds[0]["img"].to_numpy()
    np.testing.assert_array_equal(got, np.rot90(rgb, k=-1))


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_max_resolution_and_huge_and_sliver_images(tmp_path, photo_arrays):
    base = Image.fromarray(photo_arrays[0])
    huge = base.resize((12000, 9000), Image.BILINEAR)
    sliver = np.repeat(photo_arrays[0][:1, :, :], 1, axis=0)
    sliver = np.asarray(Image.fromarray(sliver).resize((70000, 1), Image.NEAREST))
    small = photo_arrays[0][:50, :60]
    fields = {"img": RGBImage(encoding="jpeg", jpeg_quality=85)}
    out = tmp_path / "sizes.pageset"
    write_dataset(out, [(huge,), (sliver,), (small,)], fields, num_workers=0, page_size=1 << 16, progress=False)
    with open_dataset(out) as ds:
        h = ds[0]["img"]
        assert (h.height, h.width) == (9000, 12000)
        assert h.to_numpy().shape == (9000, 12000, 3)
        s = ds[1]["img"]
        assert (s.height, s.width) == (1, 70000) and s.encoding == "raw"  # over JPEG's 65500 limit
        assert ds[2]["img"].to_numpy().shape == (50, 60, 3)
        # the huge record is larger than a page: it starts on a page boundary
        start = int(ds.index["_offset"][0]) - ds.data_offset
        assert start % ds.page_size == 0 and int(ds.index["_length"][0]) > ds.page_size
        ds.verify()
    out2 = tmp_path / "shrunk.pageset"
    write_dataset(out2, [(huge,), (small,)], {"img": RGBImage(max_resolution=256, encoding="raw")},
                  num_workers=0, progress=False)
    with open_dataset(out2) as ds:
        assert (ds[0]["img"].height, ds[0]["img"].width) == (192, 256)
        assert (ds[1]["img"].height, ds[1]["img"].width) == (50, 60)  # never enlarged


def test_auto_encoding_rule(tmp_path, photo_arrays):
    tiny = photo_arrays[0][:8, :8]  # raw 192 B; a JPEG has ~600 B of headers alone
    big = photo_arrays[0]  # 512x512 photo: raw 786 KB vs JPEG ~60 KB
    out = tmp_path / "auto.pageset"
    write_dataset(out, [(tiny,), (big,)], {"img": RGBImage(encoding="auto")}, num_workers=0, progress=False)
    with open_dataset(out) as ds:
        assert ds[0]["img"].encoding == "raw"
        assert ds[1]["img"].encoding == "jpeg"


def test_field_names_are_stored_in_full(tmp_path):
    a, b = "a_very_long_prefix_0123456789_one", "a_very_long_prefix_0123456789_two"
    assert a[:16] == b[:16]
    out = tmp_path / "names.pageset"
    write_dataset(out, [(1, 2), (3, 4)], {a: Int(), b: Int()}, num_workers=0, progress=False)
    with open_dataset(out) as ds:
        assert list(ds.fields) == [a, b]
        assert ds[1] == {a: 3, b: 4}


def test_previous_file_replaced_atomically(tmp_path):
    out = tmp_path / "x.pageset"
    write_dataset(out, [(1,)], {"y": Int()}, num_workers=0, progress=False)
    write_dataset(out, [(1,), (2,)], {"y": Int()}, num_workers=0, progress=False)
    with open_dataset(out) as ds:
        assert len(ds) == 2
    assert os.listdir(tmp_path) == ["x.pageset"]
