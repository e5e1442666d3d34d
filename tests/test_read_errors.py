"""Damaged files: each case raises its own FormatError subclass naming the path, section and byte offset."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pageset import (
    JSON,
    BadMagicError,
    ChecksumMismatchError,
    Dataset,
    FileChangedError,
    FormatError,
    IndexBoundsError,
    Int,
    RGBImage,
    RGBImages,
    SchemaError,
    TokenIds,
    TruncatedFileError,
    UnsupportedFeatureError,
    UnsupportedVersionError,
    open_dataset,
    write_dataset,
    write_tokens,
)
from pageset.format.checksum import crc32
from pageset.format.constants import HEADER_SIZE
from pageset.format.layout import HEADER, SECTION_ENTRY


@pytest.fixture()
def good(tmp_path, photo_arrays):
    path = tmp_path / "good.pageset"
    samples = [(a[:160, :200], k) for k, a in enumerate(photo_arrays)]
    write_dataset(path, samples, {"image": RGBImage(), "label": Int()}, num_workers=0, page_size=1 << 14,
                  progress=False)
    return path


def _header(path):
    return np.frombuffer(path.read_bytes()[:HEADER_SIZE], dtype=HEADER)[0]


def _sections(path):
    h = _header(path)
    raw = path.read_bytes()[int(h["section_table_offset"]):]
    return np.frombuffer(raw[: int(h["section_count"]) * SECTION_ENTRY.itemsize], dtype=SECTION_ENTRY)


def _flip(path, offset, out=None):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    target = out or path
    target.write_bytes(bytes(data))
    return target


def _rewrite_header(path, **changes):
    data = bytearray(path.read_bytes())
    h = np.frombuffer(bytes(data[:HEADER_SIZE]), dtype=HEADER).copy()
    for k, v in changes.items():
        h[0][k] = v
    raw = bytearray(h.tobytes())
    raw[-4:] = crc32(bytes(raw[:-4])).to_bytes(4, "little")
    data[:HEADER_SIZE] = raw
    path.write_bytes(bytes(data))


def _check(exc, path, section):
    assert isinstance(exc, FormatError)
    assert exc.path == str(path) and section in exc.section
    assert str(path) in str(exc)


def test_good_file_opens(good):
    with open_dataset(good) as ds:
        ds.verify()


def test_wrong_magic(good, tmp_path):
    p = tmp_path / "m"
    p.write_bytes(b"PK\x03\x04" + good.read_bytes()[4:])
    with pytest.raises(BadMagicError) as ei:
        open_dataset(p)
    _check(ei.value, p, "header")
    assert ei.value.offset == 0


def test_text_mode_damage_caught_by_magic(good, tmp_path):
    p = tmp_path / "crlf"
    p.write_bytes(good.read_bytes().replace(b"\r\n", b"\n"))
    with pytest.raises(BadMagicError):
        open_dataset(p)


def test_flipped_byte_in_header(good):
    _flip(good, 44)  # inside record_count
    with pytest.raises(ChecksumMismatchError) as ei:
        open_dataset(good)
    _check(ei.value, good, "header")


def test_future_major_version(good):
    _rewrite_header(good, major=2)
    with pytest.raises(UnsupportedVersionError, match="upgrade pageset") as ei:
        open_dataset(good)
    assert ei.value.offset == 8


def test_newer_minor_version_is_read(good):
    _rewrite_header(good, minor=7, optional_features=0b1011)  # unknown optional bits are ignored
    with open_dataset(good) as ds:
        assert ds.version == (1, 7)


def test_unknown_required_feature_bit(good):
    _rewrite_header(good, required_features=1 << 5)
    with pytest.raises(UnsupportedFeatureError, match="0x20"):
        open_dataset(good)


def test_flipped_byte_in_section_table(good):
    off = int(_header(good)["section_table_offset"]) + 9
    _flip(good, off)
    with pytest.raises(ChecksumMismatchError) as ei:
        open_dataset(good)
    _check(ei.value, good, "section table")


@pytest.mark.parametrize("kind, name", [(1, "schema"), (2, "index"), (3, "page_checksums"), (4, "metadata")])
def test_flipped_byte_in_each_section(good, kind, name):
    entry = next(e for e in _sections(good) if int(e["kind"]) == kind)
    _flip(good, int(entry["offset"]) + int(entry["length"]) // 2)
    with pytest.raises(ChecksumMismatchError) as ei:
        open_dataset(good)
    _check(ei.value, good, name)
    assert ei.value.offset == int(entry["offset"])


def test_flipped_byte_in_a_page_found_by_verify(good):
    h = _header(good)
    _flip(good, int(h["data_offset"]) + 20000)  # page 1 of 16 KiB pages
    with open_dataset(good) as ds:  # pages are not read at open
        with pytest.raises(ChecksumMismatchError, match=r"page 1.*samples stored in this page: \[\d") as ei:
            ds.verify()
    assert ei.value.section == "page 1"


def test_verify_checks_every_page_first_middle_and_last(good, tmp_path):
    """A flipped byte in the first, a middle or the LAST page (a short one) is reported with that page."""
    with open_dataset(good) as ds:
        n_pages, lo, hi = ds.page_count, ds.data_offset, ds.data_offset + ds.data_length
        ps = ds.page_size
    assert n_pages >= 4 and (hi - lo) % ps  # several pages, the last one short
    for page in (0, n_pages // 2, n_pages - 1):
        offset = min(lo + page * ps + 100, hi - 1)
        bad = _flip(good, offset, tmp_path / f"p{page}.pageset")
        with open_dataset(bad) as ds, pytest.raises(ChecksumMismatchError) as ei:
            ds.verify()
        assert ei.value.section == f"page {page}" and ei.value.offset == lo + page * ps, page


def test_truncated_file(good, tmp_path):
    data = good.read_bytes()
    for cut in (0, 5, 100, len(data) // 2, len(data) - 1):
        p = tmp_path / f"cut{cut}"
        p.write_bytes(data[:cut])
        with pytest.raises(TruncatedFileError) as ei:
            open_dataset(p)
        _check(ei.value, p, "header")


def test_extra_trailing_bytes(good):
    good.write_bytes(good.read_bytes() + b"\0" * 10)
    with pytest.raises(FormatError, match="the file has"):
        open_dataset(good)


def _patch_section(path, kind, new_payload):
    """Replace a section's bytes (same length) and fix its CRC, section table CRC and header CRC: the damage
    is then only visible to the semantic checks behind the checksums."""
    data = bytearray(path.read_bytes())
    h = _header(path)
    table_off = int(h["section_table_offset"])
    table = _sections(path).copy()
    k = next(i for i, e in enumerate(table) if int(e["kind"]) == kind)
    off, length = int(table[k]["offset"]), int(table[k]["length"])
    assert len(new_payload) == length
    data[off : off + length] = new_payload
    table[k]["crc"] = crc32(new_payload)
    data[table_off : table_off + table.nbytes] = table.tobytes()
    path.write_bytes(bytes(data))
    _rewrite_header(path, section_table_crc=crc32(table.tobytes()))
    return off


def test_schema_errors_behind_valid_checksums(good):
    entry = next(e for e in _sections(good) if int(e["kind"]) == 1)
    payload = good.read_bytes()[int(entry["offset"]) : int(entry["offset"]) + int(entry["length"])]
    bad = payload.replace(b'"kind":"int"', b'"kind":"inx"')
    _patch_section(good, 1, bad)
    with pytest.raises(SchemaError, match="unknown kind 'inx'") as ei:
        open_dataset(good)
    assert ei.value.offset == int(entry["offset"])


def test_index_offset_outside_file_behind_valid_checksums(good):
    with open_dataset(good) as ds:
        index = ds.index.copy()
    index[3]["image.offset"] = 10**12
    _patch_section(good, 2, index.tobytes())
    with pytest.raises(IndexBoundsError, match="record 3: field 'image'"):
        open_dataset(good)


@pytest.fixture()
def conversations(tmp_path, photo_arrays):
    """Records with an image list (0-2 images) and a conversation's ids with their loss mask."""
    path = tmp_path / "vlm.pageset"
    rows = [{"images": [a[:40, :48] for a in photo_arrays[k : k + k % 3]],
             "conversation": {"input_ids": [7, 8, 9][: 1 + k % 3], "loss_mask": [0, 1, 1][: 1 + k % 3]}}
            for k in range(6)]
    write_dataset(path, rows, {"images": RGBImages(), "conversation": TokenIds(loss_mask=True)}, num_workers=0,
                  page_size=1 << 14, progress=False)
    return path


def test_image_list_and_masked_ids_index_damage_behind_valid_checksums(conversations, tmp_path):
    """Index invariants of formats/v1.md section 5, checked at open by pageset and by the reference reader: an
    image count whose entries do not fit the value, a masked token_ids length that is not n x (itemsize + 1). A
    count that fits but disagrees with the stored one is found where the value is read: ``ds[i]`` and the Loader
    name the field (and the Loader the sample)."""
    from reference.format import RefDataset, RefError

    from pageset import CenterCrop, DecodeError, Loader

    with open_dataset(conversations) as ds:
        index = ds.index.copy()
    cases = [("images.count", 100, r"record 2: field 'images': shorter than its image count's entries"),
             ("conversation.length", None, r"record 2: field 'conversation': token_ids length is not a multiple "
                                           r"of 3 bytes")]
    for column, value, match in cases:
        path = tmp_path / f"{column}.pageset"
        path.write_bytes(conversations.read_bytes())
        bad = index.copy()
        bad[2][column] = value if value is not None else int(bad[2][column]) - 1
        _patch_section(path, 2, bad.tobytes())
        with pytest.raises(IndexBoundsError, match=match):
            open_dataset(path)
        with pytest.raises(RefError):
            RefDataset(path.read_bytes(), str(path))
    path = tmp_path / "count.pageset"
    path.write_bytes(conversations.read_bytes())
    bad = index.copy()
    assert int(bad[2]["images.count"]) == 2
    bad[2]["images.count"] = 1
    _patch_section(path, 2, bad.tobytes())
    with open_dataset(path) as ds:
        with pytest.raises(FormatError, match=r"field 'images': the image list's entries do not match its bytes"):
            ds[2]
    with Loader(path, batch_size=1, order="sequential", indices=[2], pipelines={"images": [CenterCrop(8)]}) as ld:
        with pytest.raises(DecodeError, match=r"sample 2, field 'images': the stored image list does not match its "
                                              r"index entry"):
            next(iter(ld))


def test_index_records_out_of_order_behind_valid_checksums(good):
    with open_dataset(good) as ds:
        index = ds.index.copy()
    index[[1, 2]] = index[[2, 1]]
    _patch_section(good, 2, index.tobytes())
    with pytest.raises(IndexBoundsError, match="record 2: record offsets are not in sample order"):
        open_dataset(good)


def test_not_a_file_at_all(tmp_path):
    p = tmp_path / "README.md"
    p.write_text("# hello\n" * 100)
    with pytest.raises(BadMagicError):
        open_dataset(p)


def _small_files(tmp_path, photo_arrays):
    """A small image file (JPEG and raw records, labels, a JSON field) and a small token file."""
    img = tmp_path / "small.pageset"
    samples = [(a[:16, :16], k, {"k": k}) for k, a in enumerate(photo_arrays[:3])]
    samples += [(a[:6, :6], 10 + k, {"k": [k]}) for k, a in enumerate(photo_arrays[:2])]
    write_dataset(img, samples, {"image": RGBImage(encoding="auto"), "label": Int(), "meta": JSON()},
                  num_workers=0, page_size=1 << 12, progress=False)
    tok = tmp_path / "small_tokens.pageset"
    rng = np.random.default_rng(3)
    write_tokens(tok, [rng.integers(0, 70000, size=n) for n in (50, 1, 300)], eos_id=70001, num_workers=0,
                 page_size=1 << 12, progress=False)
    return img, tok


def _reported(path) -> str | None:
    """The FormatError subclass that open or verify raises for ``path``, or None when both pass."""
    try:
        with Dataset(path) as ds:  # either kind of file (open_dataset refuses token files)
            ds.verify()
    except FormatError as exc:
        return type(exc).__name__
    return None


def test_every_flipped_byte_is_reported_by_open_or_verify(tmp_path, photo_arrays):
    """Flip each byte of small files in turn (the bit flipped cycles through all 8): open or verify reports
    every one, including the zero padding between the header and page 0 and the gaps between sections, which
    no CRC covers."""
    for good in _small_files(tmp_path, photo_arrays):
        data = good.read_bytes()
        assert _reported(good) is None and len(data) < 12_000  # small: a few thousand flips, a few seconds
        missed, kinds = [], set()
        with open(good, "r+b") as f:
            for pos in range(len(data)):
                os.pwrite(f.fileno(), bytes([data[pos] ^ 1 << (pos % 8)]), pos)
                kind = _reported(good)
                os.pwrite(f.fileno(), data[pos : pos + 1], pos)
                if kind is None:
                    missed.append(pos)
                kinds.add(kind)
        assert good.read_bytes() == data
        assert not missed, f"{good.name}: {len(missed)} of {len(data)} flips unreported, first at {missed[:10]}"
        assert {"ChecksumMismatchError", "FormatError"} <= kinds  # CRCs, and the zero padding check


def test_damaged_padding_names_the_byte(tmp_path, photo_arrays):
    good, _ = _small_files(tmp_path, photo_arrays)
    h = _header(good)
    for pos in (HEADER_SIZE, 1000, int(h["data_offset"]) - 1):
        _flip(good, pos, out=tmp_path / "p")
        with pytest.raises(FormatError, match=f"byte {pos} is 0x40 in the zero padding") as ei:
            open_dataset(tmp_path / "p")
        assert ei.value.section == "padding" and ei.value.offset == pos
    entries = sorted((int(e["offset"]), int(e["length"])) for e in _sections(good))
    gaps = [a + n for (a, n), (b, _) in zip(entries, entries[1:]) if a + n < b]
    assert gaps  # sections are 8-byte aligned: this file has gaps between them
    _flip(good, gaps[0], out=tmp_path / "p")
    with pytest.raises(FormatError, match="zero padding"):
        open_dataset(tmp_path / "p")
    st = os.stat(good)
    with open_dataset(good) as ds:  # damaged after open: verify() reads the padding again
        with open(good, "r+b") as f:
            os.pwrite(f.fileno(), b"\x01", 2000)
        with pytest.raises(FileChangedError):  # a write under the reader is named as such
            ds.verify()
        os.utime(good, ns=(st.st_atime_ns, st.st_mtime_ns))  # damage at rest (a bad sector) keeps the mtime
        with pytest.raises(FormatError, match="byte 2000 is 0x01 in the zero padding"):
            ds.verify()
