"""Every read path against the independent reference reader (``tests/reference/format.py``, written from
formats/v1.md alone): record ids and BYTES, never a run of pageset compared with another run of pageset.

Files are small and seeded, with page_size 4096 so that records cross 2 and 3 pages, a record holds empty
fields, the last page is short, and one file has a single page; token files hold documents that cross pages
(uint16 and uint32, written from ids and imported from a nanoGPT .bin). Read paths: ``ds[i]`` / ``ds.read`` /
``iter(ds)`` / ``ds.buffer`` / the index and page checksums, the Loader (``page_cache="os"`` and ``"process"``,
``verify_pages`` on and off), token windows and document outputs, ``s3://`` and ``http://`` with and without
``cache_dir`` (cache page files damaged, truncated or copied from another dataset), and a Mixture of a local
and a URL member. Damage: a flipped byte in every section and in pages at every position is refused or named,
and the page named is the one the reference finds bad.
"""

from __future__ import annotations

import io
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from reference.format import read_file  # noqa: E402
from remote_servers import MotoS3, StaticHTTP, s3_options  # noqa: E402

from pageset import (  # noqa: E402
    JSON,
    Bytes,
    ChecksumMismatchError,
    Float,
    FormatError,
    Int,
    NDArray,
    RGBImage,
    import_nanogpt,
    open_dataset,
    open_tokens,
    write_dataset,
    write_tokens,
)

PAGE = 4096
BUCKET = "pageset-reference"
# blob sizes: empty, small, two records sharing a page, 2 pages, 3 pages, exactly one page (+ the other
# fields: 2 pages), and a small last record (a short last page)
BLOB_SIZES = [0, 100, 3000, 2900, 5000, 200, 9000, 0, 4096, 4097, 700, 50, 1300, 0, 2500, 60]
SQUARE = 40  # side of the image file's crops: 40 x 40 x 3 raw bytes = 4800 > one page


def _records(photo_arrays, seed, sizes=BLOB_SIZES):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(sizes):
        a = photo_arrays[i % len(photo_arrays)]
        y, x = (int(v) for v in rng.integers(0, 64, 2))
        meta = [] if i % 3 == 0 else {"i": i, "s": "x" * int(rng.integers(0, 40)), "l": [1, 2.5, None]}
        out.append((int(rng.integers(-2**62, 2**62)), float(rng.standard_normal()),
                    rng.integers(0, 256, n, dtype=np.uint8).tobytes(), meta,
                    rng.integers(0, 65536, (2, 4), dtype=np.uint16), a[y:y + 60, x:x + 90].copy()))
    return out


FIELDS = {"id": Int("int64"), "score": Float("float32"), "blob": Bytes(), "meta": JSON(),
          "arr": NDArray("uint16", (2, 4)), "img": RGBImage(max_resolution=32, jpeg_quality=85)}


def _token_docs(rng, n_docs, high, eos_id, max_len=700):
    docs = []
    for _ in range(n_docs):
        d = rng.integers(0, high, int(rng.integers(1, max_len)))
        d[d == eos_id] = 1  # EOS only where a document ends
        docs.append(d)
    return docs


@pytest.fixture(scope="module")
def files(tmp_path_factory, photo_arrays):
    root = tmp_path_factory.mktemp("reference_read")
    write_dataset(root / "records.pageset", _records(photo_arrays, 1), FIELDS, page_size=PAGE, num_workers=0,
                  progress=False)
    write_dataset(root / "records2.pageset", _records(photo_arrays, 2, BLOB_SIZES[::-1]), FIELDS, page_size=PAGE,
                  num_workers=0, progress=False)
    write_dataset(root / "single.pageset", _records(photo_arrays, 3, [0, 10, 20]), FIELDS, page_size=PAGE,
                  num_workers=0, progress=False)
    rng = np.random.default_rng(4)
    squares = []
    for i in range(10):
        a = photo_arrays[i % len(photo_arrays)]
        y, x = (int(v) for v in rng.integers(0, 100, 2))
        crop = a[y:y + SQUARE, x:x + SQUARE].copy()
        squares.append((crop, crop))
    write_dataset(root / "images.pageset", squares, {"raw": RGBImage(encoding="raw"), "jpg": RGBImage(encoding="jpeg")},
                  page_size=PAGE, num_workers=0, progress=False)
    write_tokens(root / "tok16.pageset", _token_docs(rng, 60, 60000, 60001), eos_id=60001, num_workers=0,
                 page_size=PAGE, progress=False)
    write_tokens(root / "tok32.pageset", _token_docs(rng, 40, 200000, 200001), eos_id=200001, num_workers=0,
                 page_size=PAGE, progress=False)
    stream = np.concatenate([np.append(d, 50256) for d in _token_docs(rng, 30, 50000, 50256)] +
                            [rng.integers(0, 50000, 37)]).astype("<u2")  # the last document lacks its EOS
    (root / "nanogpt.bin").write_bytes(stream.tobytes())
    import_nanogpt(root / "nanogpt.pageset", root / "nanogpt.bin", page_size=PAGE)
    return root


RECORD_FILES = ["records.pageset", "records2.pageset", "single.pageset", "images.pageset"]
TOKEN_FILES = ["tok16.pageset", "tok32.pageset", "nanogpt.pageset"]


def test_the_files_have_the_shapes_the_tests_need(files):
    """The generators give what the read paths must be tested on (checked on the reference's view)."""
    ref = read_file(files / "records.pageset")
    spans = [len(ref.record_pages(i)) for i in range(len(ref.records))]
    assert 2 in spans and 3 in spans and 1 in spans
    assert 0 < len(ref.pages[-1]) < PAGE
    assert any(r["blob"] == b"" for r in ref.records) and any(r["meta"] == [] for r in ref.records)
    assert {r["img"]["encoding"] for r in ref.records} == {"jpeg"}
    assert read_file(files / "single.pageset").header["page_count"] == 1
    img = read_file(files / "images.pageset")
    assert all(len(img.record_pages(i)) >= 2 for i in range(len(img.records)))
    assert {(r["raw"]["encoding"], r["jpg"]["encoding"]) for r in img.records} == {("raw", "jpeg")}
    for name, dtype in [("tok16.pageset", "uint16"), ("tok32.pageset", "uint32"), ("nanogpt.pageset", "uint16")]:
        tok = read_file(files / name)
        assert tok.schema["tokens"]["dtype"] == dtype and tok.header["page_count"] >= 3
        item = 2 if dtype == "uint16" else 4
        crossing = [d for d in range(len(tok.doc_offsets) - 1)
                    if tok.doc_offsets[d] * item // PAGE != (tok.doc_offsets[d + 1] - 1) * item // PAGE]
        assert crossing, name
    assert read_file(files / "nanogpt.pageset").tokens[-1] != 50256


# ---- records: ds[i] and the Dataset's other read APIs ---------------------------------------------------------

def _check_value(field, got, want, where):
    if isinstance(field, RGBImage):
        assert (got.height, got.width, got.encoding) == (want["height"], want["width"], want["encoding"]), where
        assert got.data == want["data"], where
    elif isinstance(field, NDArray):
        assert got.dtype == np.dtype(field.dtype) and got.shape == tuple(field.shape), where
        assert got.astype(got.dtype.newbyteorder("<")).tobytes() == want, where
    elif isinstance(field, Float):
        assert got == want or (got != got and want != want), where  # struct's float32 -> double, same value
    else:
        assert type(got) is type(want) and got == want, where


def _check_dataset(ds, ref, local=True):
    assert len(ds) == len(ref.records) and ds.dataset_id == ref.dataset_id
    assert ds.page_count == ref.header["page_count"] and ds.data_offset == ref.header["data_offset"]
    assert ds.page_checksums.tolist() == ref.page_crcs
    assert ds.index.tobytes() == ref.index_bytes
    assert ds.record_pages().tolist() == [ref.record_pages(i)[0] for i in range(len(ref.records))]
    for i, want in enumerate(ref.records):
        rec = ds[i]
        assert list(rec) == [f["name"] for f in ref.schema["fields"]]
        for name, field in ds.fields.items():
            _check_value(field, rec[name], want[name], (ds.path, i, name))
            _check_value(field, ds.read(i, name), want[name], (ds.path, i, name, "read"))
    for i, rec in enumerate(ds):
        for name, field in ds.fields.items():
            _check_value(field, rec[name], ref.records[i][name], (ds.path, i, name, "iter"))
    if local:
        assert ds.buffer.tobytes() == ref.data


@pytest.mark.parametrize("name", RECORD_FILES)
def test_dataset_reads_equal_the_reference(files, name):
    with open_dataset(files / name) as ds:
        _check_dataset(ds, read_file(files / name))
        ds.verify()


@pytest.mark.parametrize("name", TOKEN_FILES)
def test_token_dataset_reads_equal_the_reference(files, name):
    ref = read_file(files / name)
    with open_tokens(files / name) as td:
        assert len(td) == len(ref.tokens) and td.documents == len(ref.doc_offsets) - 1
        assert td.tokens.tolist() == ref.tokens
        assert td.read(0, len(td)).tolist() == ref.tokens
        cut = PAGE // td.tokens.dtype.itemsize  # a read across the first page boundary
        assert td.read(cut - 3, cut + 5).tolist() == ref.tokens[cut - 3:cut + 5]
        for d in range(td.documents):
            assert td.document(d).tolist() == ref.tokens[ref.doc_offsets[d]:ref.doc_offsets[d + 1]], d
        for L in (7, 100, 2048):
            assert td.num_windows(L) == ref.num_windows(L)
        td.verify()


# ---- the Loader over records ------------------------------------------------------------------------------------

def _record_pipelines():
    from pageset import BytesDecoder, FloatDecoder, IntDecoder, JSONDecoder, NDArrayDecoder

    return {"id": [IntDecoder()], "score": [FloatDecoder()], "blob": [BytesDecoder()], "meta": [JSONDecoder()],
            "arr": [NDArrayDecoder()], "img": None}


def _image_pipelines():
    from pageset import CenterCrop

    return {"raw": [CenterCrop(SQUARE, ratio=1.0)], "jpg": [CenterCrop(SQUARE, ratio=1.0)]}


def _pillow_full(jpeg: bytes) -> np.ndarray:
    """The reference's JPEG bytes decoded by Pillow, cropped to the whole image and resized to its own size:
    README: CenterCrop at DCT scale 1/1 equals Pillow's crop(box).resize(size, BILINEAR) bit for bit."""
    with Image.open(io.BytesIO(jpeg)) as im:
        return np.asarray(im.convert("RGB").crop((0, 0, SQUARE, SQUARE)).resize((SQUARE, SQUARE), Image.BILINEAR))


def _check_batch(batch, refs, source=None):
    """Every real sample of ``batch`` equals the reference record its ``_index`` (and ``_source``) names; returns
    the (source, id) pairs checked."""
    ids = np.asarray(batch["_index"]).tolist()
    srcs = np.asarray(batch["_source"]).tolist() if "_source" in batch else [0] * len(ids)
    pad = np.asarray(batch["_is_padding"]).tolist()
    seen = []
    for j, (s, i) in enumerate(zip(srcs, ids)):
        want = refs[s].records[i]
        where = (s, i, j)
        if "blob" in batch:
            data, lens = (np.asarray(a) for a in batch["blob"])
            assert data[j, :lens[j]].tobytes() == want["blob"] and not data[j, lens[j]:].any(), where
            assert np.asarray(batch["id"])[j].item() == want["id"], where
            assert np.asarray(batch["score"])[j].item() == want["score"], where
            assert batch["meta"][j] == want["meta"], where
            assert np.asarray(batch["arr"])[j].astype("<u2").tobytes() == want["arr"], where
        if "raw" in batch:
            assert np.asarray(batch["raw"])[j].tobytes() == want["raw"]["data"], where
            assert np.array_equal(np.asarray(batch["jpg"])[j], _pillow_full(want["jpg"]["data"])), where
        if not pad[j]:
            seen.append((s, i))
    return seen


def _epoch(path, refs, pipelines, **kw):
    from pageset import Loader

    seen = []
    with Loader(path, pipelines=pipelines, array_type="numpy", **kw) as loader:
        for batch in loader:
            seen += _check_batch(batch, refs)
        return seen, (loader.remote_stats() if kw.get("storage_options") or "://" in str(path) else None)


LOADER_CASES = [("os", False), ("process", False), ("os", True), ("process", True)]


@pytest.mark.parametrize("page_cache,verify", LOADER_CASES)
@pytest.mark.parametrize("name", ["records.pageset", "images.pageset", "single.pageset"])
def test_loader_batches_equal_the_reference(files, name, page_cache, verify):
    ref = read_file(files / name)
    pipes = _image_pipelines() if name == "images.pageset" else _record_pipelines()
    kw = dict(cache_pages=2) if page_cache == "process" else {}  # 2 slots: pages are evicted and read again
    seen, _ = _epoch(files / name, [ref], pipes, batch_size=3, order="random", seed=7, drop_last=False,
                     num_threads=2, page_cache=page_cache, verify_pages=verify, **kw)
    assert sorted(i for _, i in seen) == list(range(len(ref.records)))  # every record once, compared above



@pytest.fixture(scope="module")
def sets(files):
    """Many-file sets (formats/manyfile.md) of the records of ``records.pageset`` and ``images.pageset``, 5 and 3
    records per member: global id i is record i of the single file, whose reference view is the expectation."""
    root = files / "sets"
    root.mkdir(exist_ok=True)
    recs = read_file(files / "records.pageset").records
    src = [(r["id"], r["score"], r["blob"], r["meta"], np.frombuffer(r["arr"], "<u2").reshape(2, 4), None)
           for r in recs]
    fields = {k: v for k, v in FIELDS.items() if k != "img"}
    write_dataset(root / "records", [x[:5] for x in src], fields, page_size=PAGE, num_workers=0,
                  records_per_member=5, progress=False)
    squares = [np.frombuffer(r["raw"]["data"], np.uint8).reshape(SQUARE, SQUARE, 3)
               for r in read_file(files / "images.pageset").records]
    write_dataset(root / "images", [(a, a) for a in squares], {"raw": RGBImage(encoding="raw"),
                  "jpg": RGBImage(encoding="jpeg")}, page_size=PAGE, num_workers=0, records_per_member=3,
                  progress=False)
    return root


@pytest.mark.parametrize("page_cache,verify", LOADER_CASES)
@pytest.mark.parametrize("name", ["records", "images"])
@pytest.mark.parametrize("order", ["random", "quasi_random"])
def test_a_many_file_set_loads_like_the_reference_of_its_records(files, sets, name, page_cache, verify, order,
                                                                 monkeypatch):
    """page_cache="os" without verification reads the set flat (one gather across members, load/set_records.py),
    the other cases member by member; at most 2 members stay open, so members are closed and opened again."""
    from pageset.read import member_cache

    monkeypatch.setattr(member_cache, "MAX_OPEN_MEMBERS", 2)
    monkeypatch.setattr(member_cache, "MAX_OPEN_FILES", 2)
    ref = read_file(files / f"{name}.pageset")
    pipes = _image_pipelines() if name == "images" else {k: v for k, v in _record_pipelines().items() if k != "img"}
    kw = dict(cache_pages=2) if page_cache == "process" else {}
    seen, _ = _epoch(sets / name, [ref], pipes, batch_size=4, order=order, seed=3, drop_last=False, num_threads=2,
                     window_pages=2, page_cache=page_cache, verify_pages=verify, **kw)
    assert sorted(i for _, i in seen) == list(range(len(ref.records)))  # every record once, compared above


def test_a_mixture_of_a_set_and_a_file_equals_the_reference(files, sets):
    """A set's rows scattered among another file's rows (Mixture): the flat set's fill_rows path."""
    from pageset import Loader, Mixture

    refs = [read_file(files / "records.pageset"), read_file(files / "records2.pageset")]
    pipes = {k: v for k, v in _record_pipelines().items() if k != "img"}
    pipes["img"] = None
    seen = []
    with Loader(Mixture([sets / "records", files / "records2.pageset"], [0.5, 0.5], samples_per_epoch=64),
                batch_size=8, order="random", seed=9, num_threads=2, array_type="numpy", pipelines=pipes,
                drop_last=False) as loader:
        for batch in loader:
            seen += _check_batch(batch, refs)
    assert {i for s, i in seen if s == 0} == set(range(len(refs[0].records)))


# ---- token windows and document outputs ------------------------------------------------------------------------

def _document_expectation(ref, windows, L):
    """position_ids, doc_ids, labels, cu_seqlens, max_seqlen for windows ``windows`` from the reference's
    tokens and doc_offsets (README / pageset.ops.tokens docstring): each row starts a segment; a segment also
    starts at the column after each document's end (a document's last token is its EOS, except maybe the
    stream's last); labels are targets with -100 where the input is a document's last token (its EOS)."""
    starts = set(ref.doc_offsets[1:-1])
    pos, docs, labels, lengths = [], [], [], []
    for w in windows:
        inp, tgt = ref.window(w, L)
        p = d = 0
        seg = 0
        prow, drow, lrow = [], [], []
        for c in range(L):
            t = w * L + c
            if c > 0 and t in starts:
                lengths.append(seg)
                p, d, seg = 0, d + 1, 0
            prow.append(p)
            drow.append(d)
            lrow.append(-100 if (t + 1) in starts else tgt[c])
            p, seg = p + 1, seg + 1
        lengths.append(seg)
        pos.append(prow)
        docs.append(drow)
        labels.append(lrow)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return pos, docs, labels, cu, max(lengths)


@pytest.mark.parametrize("page_cache", ["os", "process"])
@pytest.mark.parametrize("name,seq_len", [("tok16.pageset", 1000), ("tok32.pageset", 300),
                                          ("nanogpt.pageset", 513)])
def test_token_windows_and_document_outputs_equal_the_reference(files, name, seq_len, page_cache):
    from pageset import Loader, TokenWindows

    ref = read_file(files / name)
    eos = ref.schema["tokens"]["eos_id"]
    assert all(ref.tokens[o - 1] == eos for o in ref.doc_offsets[1:-1])  # the rule above relies on it
    assert all(t != eos for d in range(len(ref.doc_offsets) - 1)
               for t in ref.tokens[ref.doc_offsets[d]:ref.doc_offsets[d + 1] - 1])
    seen = []
    kw = dict(cache_pages=2) if page_cache == "process" else {}
    with Loader(files / name, batch_size=3, order="random", seed=3, num_threads=2, page_cache=page_cache,
                array_type="numpy", pipelines={"tokens": [TokenWindows(seq_len, document_outputs=True)]},
                **kw) as loader:
        for batch in loader:
            ws = np.asarray(batch["_index"]).tolist()
            assert np.asarray(batch["input"]).tolist() == [ref.window(w, seq_len)[0] for w in ws]
            assert np.asarray(batch["target"]).tolist() == [ref.window(w, seq_len)[1] for w in ws]
            pos, docs, labels, cu, max_len = _document_expectation(ref, ws, seq_len)
            assert np.asarray(batch["position_ids"]).tolist() == pos
            assert np.asarray(batch["doc_ids"]).tolist() == docs
            assert np.asarray(batch["labels"]).tolist() == labels
            assert np.asarray(batch["cu_seqlens"]).tolist() == cu
            assert int(batch["max_seqlen"]) == max_len
            seen += ws
    n = ref.num_windows(seq_len)
    assert len(seen) == n - n % 3 and len(set(seen)) == len(seen)


# ---- damage: every section, pages at every position --------------------------------------------------------------

def _flip(src: Path, dst: Path, offset: int) -> Path:
    data = bytearray(src.read_bytes())
    data[offset] ^= 0x5A
    dst.write_bytes(bytes(data))
    return dst


SECTION_NAMES = {1: "schema", 2: "index", 3: "page_checksums", 4: "metadata", 5: "doc_offsets"}


@pytest.mark.parametrize("name", ["records.pageset", "tok16.pageset"])
def test_a_flipped_byte_in_any_section_or_table_is_refused_at_open(files, tmp_path, name):
    from reference.format import RefError

    ref = read_file(files / name)
    targets = {"header": 40, "section table": ref.header["section_table_offset"] + 9,
               "padding": 2000}
    for kind, (_, off, length, _) in ref.sections.items():
        if length == 0:  # a token file's index: no bytes to flip (its table entry is under the table's CRC)
            assert ref.is_tokens and kind == 2
            continue
        targets[SECTION_NAMES[kind]] = off + length // 2
    expected = {1, 2, 3, 4} | ({5} if ref.is_tokens else set())
    assert set(ref.sections) == expected
    opener = open_tokens if ref.is_tokens else open_dataset
    for what, offset in targets.items():
        bad = _flip(files / name, tmp_path / f"{what}.pageset", offset)
        with pytest.raises(RefError):
            read_file(bad)
        with pytest.raises(FormatError, match=re.escape(str(bad))):
            opener(bad).close()


def _page_targets(ref):
    """{position: (page, byte offset in the file)}: first, middle, short last page, a later page of a record
    spanning pages (or, for a token file, a page a document crosses into). The byte is a record's or a token's."""
    do, n = ref.header["data_offset"], ref.header["page_count"]
    out = {"first": 0, "middle": n // 2, "last": n - 1}
    if ref.records:
        out["inside a record spanning pages"] = next(
            ref.record_pages(i)[-1] for i in range(len(ref.records)) if len(ref.record_pages(i)) == 3)
    else:
        out["inside a record spanning pages"] = 1
    assert len(ref.pages[-1]) < ref.header["page_size"]
    result = {}
    for pos, k in out.items():
        start = do + k * ref.header["page_size"]
        page = ref.pages[k]
        nonzero = [j for j, b in enumerate(page) if b]
        result[pos] = (k, start + nonzero[len(nonzero) // 2])
    return result


def _loader_raises(path, pipelines, k, **kw):
    from pageset import Loader

    with pytest.raises(ChecksumMismatchError, match=rf"page {k}\b"):
        with Loader(path, pipelines=pipelines, array_type="numpy", batch_size=2, order="sequential",
                    drop_last=False, num_threads=1, **kw) as loader:
            for _ in loader:
                pass


@pytest.mark.parametrize("name", ["records.pageset", "tok32.pageset"])
def test_a_flipped_byte_in_a_page_is_named_by_verify_and_the_verifying_loader(files, tmp_path, name):
    """Pages are not checked at open (spec section 8: on request): ``verify()`` and ``Loader(verify_pages=True)``
    name the page the reference finds bad. The default local Loader does not check pages (README, Pages)."""
    from pageset import TokenWindows

    ref = read_file(files / name)
    for pos, (k, offset) in _page_targets(ref).items():
        bad = _flip(files / name, tmp_path / f"{k}.pageset", offset)
        assert read_file(bad).bad_pages() == [k], pos
        if ref.is_tokens:
            with open_tokens(bad) as td, pytest.raises(ChecksumMismatchError, match=rf"page {k}\b"):
                td.verify()
            pipes = {"tokens": [TokenWindows(500)]}
        else:
            with open_dataset(bad) as ds, pytest.raises(ChecksumMismatchError, match=rf"page {k} "):
                ds.verify()
            pipes = _record_pipelines()
        for page_cache in ("os", "process"):
            _loader_raises(bad, pipes, k, verify_pages=True, page_cache=page_cache)


# ---- object storage: s3:// and http://, with and without cache_dir ------------------------------------------------

@pytest.fixture(scope="module")
def servers(files):
    s3 = MotoS3()
    http = StaticHTTP(files)
    try:
        client = s3.client()
        client.create_bucket(Bucket=BUCKET)
        for name in RECORD_FILES + TOKEN_FILES:
            client.upload_file(str(files / name), BUCKET, name)
        yield {"http": http.url, "opts": s3_options(s3.url)}
    finally:
        http.stop()
        s3.stop()


def _url(servers, scheme, name):
    if scheme == "s3":
        return f"s3://{BUCKET}/{name}", servers["opts"]
    return f"{servers['http']}/{name}", None


@pytest.mark.parametrize("scheme", ["s3", "http"])
def test_remote_dataset_reads_equal_the_reference(files, servers, scheme):
    for name in ("records.pageset", "images.pageset"):
        url, opts = _url(servers, scheme, name)
        with open_dataset(url, opts) as ds:
            _check_dataset(ds, read_file(files / name), local=False)
    url, opts = _url(servers, scheme, "tok32.pageset")
    ref = read_file(files / "tok32.pageset")
    with open_tokens(url, opts) as td:
        cut = PAGE // 4
        assert td.read(0, len(td)).tolist() == ref.tokens
        assert td.read(cut - 5, cut + 3 * cut).tolist() == ref.tokens[cut - 5:cut + 3 * cut]


def _remote_epoch(url, opts, ref, name, cache_dir=None, **kw):
    pipes = _image_pipelines() if name == "images.pageset" else _record_pipelines()
    return _epoch(url, [ref], pipes, batch_size=3, order="random", seed=11, drop_last=False, num_threads=2,
                  storage_options=opts, cache_dir=cache_dir, prefetch_bytes=3 * PAGE, max_requests=2, **kw)


@pytest.mark.parametrize("scheme", ["s3", "http"])
def test_remote_loader_equals_the_reference_with_and_without_cache_dir(files, servers, scheme, tmp_path):
    for name in ("records.pageset", "images.pageset"):
        ref = read_file(files / name)
        url, opts = _url(servers, scheme, name)
        for cache in (None, tmp_path / name):
            seen, stats = _remote_epoch(url, opts, ref, name, cache)
            assert sorted(i for _, i in seen) == list(range(len(ref.records)))
            if cache is not None:
                assert stats["disk_misses"] == ref.header["page_count"]


def test_damaged_cache_pages_are_never_served(files, servers, tmp_path):
    """Cache page files flipped, truncated, emptied or copied from another dataset's cache are fetched again:
    every byte the Loader returns equals the reference, the bad files are replaced by the right pages, and the
    good ones were served from the disk (a cache that dropped everything would not pass)."""
    name = "records.pageset"
    ref = read_file(files / name)
    other = read_file(files / "records2.pageset")
    cache = tmp_path / "cache"
    url, opts = _url(servers, "s3", name)
    _remote_epoch(url, opts, ref, name, cache)
    _remote_epoch(*_url(servers, "s3", "records2.pageset"), other, "records2.pageset", cache)
    folder, other_folder = cache / ref.dataset_id, cache / other.dataset_id
    n = ref.header["page_count"]
    assert sorted(int(p.stem) for p in folder.glob("*.page")) == list(range(n))
    for k in range(n):
        assert (folder / f"{k}.page").read_bytes() == ref.pages[k], k
    span = next(i for i in range(len(ref.records)) if len(ref.record_pages(i)) == 3)
    damaged = {0: "flip", ref.record_pages(span)[1]: "flip", n - 1: "truncate", n // 2: "other", 3: "empty"}
    for k, how in damaged.items():
        path = folder / f"{k}.page"
        data = bytearray(path.read_bytes())
        if how == "flip":
            data[len(data) // 2] ^= 0x01
        elif how == "truncate":
            data = data[:-1]
        elif how == "empty":
            data = b""
        else:
            data = (other_folder / f"{k}.page").read_bytes()
            assert data != ref.pages[k]
        path.write_bytes(bytes(data))
    seen, stats = _remote_epoch(url, opts, ref, name, cache)
    assert sorted(i for _, i in seen) == list(range(len(ref.records)))
    assert stats["disk_misses"] == len(damaged) and stats["disk_hits"] >= n - len(damaged), stats
    for k in range(n):
        assert (folder / f"{k}.page").read_bytes() == ref.pages[k], k
    # and through the Dataset's own page reader (ds[i]) a damaged cache never matters: it reads no cache_dir
    shutil.rmtree(other_folder)


def test_mixture_of_a_local_and_a_url_member_equals_the_reference(files, servers, tmp_path):
    from pageset import Loader, Mixture

    refs = [read_file(files / "records.pageset"), read_file(files / "records2.pageset")]
    url, opts = _url(servers, "s3", "records2.pageset")
    mix = Mixture([files / "records.pageset", url], [0.6, 0.4], samples_per_epoch=80)  # both wrap: 48 + 32
    seen = []
    for cache in (None, tmp_path / "mix"):
        with Loader(mix, batch_size=4, order="quasi_random", seed=5, num_threads=2, array_type="numpy",
                    pipelines=_record_pipelines(), storage_options=opts, cache_dir=cache, drop_last=False) as loader:
            for batch in loader:
                seen += _check_batch(batch, refs)
    assert {s for s, _ in seen} == {0, 1}
    # every record of both files is reached (each file keeps its own epochs)
    assert {i for s, i in seen if s == 0} == set(range(len(refs[0].records)))
    assert {i for s, i in seen if s == 1} == set(range(len(refs[1].records)))


def test_remote_damaged_page_is_named_with_the_reference_page(files, servers, tmp_path):
    """A damaged page in the object itself: the Loader (and ds[i]) over the URL name the page the reference finds
    bad; nothing of it is served."""
    name = "records.pageset"
    ref = read_file(files / name)
    targets = _page_targets(ref)
    k, offset = targets["inside a record spanning pages"]
    bad = _flip(files / name, tmp_path / "bad.pageset", offset)
    assert read_file(bad).bad_pages() == [k]
    (files / "bad_remote.pageset").write_bytes(bad.read_bytes())
    url, opts = f"{servers['http']}/bad_remote.pageset", None
    victim = next(i for i in range(len(ref.records)) if k in ref.record_pages(i))
    with open_dataset(url, opts) as ds:
        with pytest.raises(ChecksumMismatchError, match=rf"page {k} "):
            ds[victim]
    from pageset import Loader

    with pytest.raises(ChecksumMismatchError, match=rf"page {k} "):
        with Loader(url, batch_size=2, order="sequential", drop_last=False, num_threads=1, array_type="numpy",
                    pipelines=_record_pipelines(), cache_dir=tmp_path / "c") as loader:
            for _ in loader:
                pass
    assert not (tmp_path / "c" / ref.dataset_id / f"{k}.page").exists()
