"""Every write path checked against the input through the reference reader (tests/reference/format.py).

The expectation is the input itself (the records or documents the test made), read back from the written bytes by
a reader that shares no code with pageset: a source that serves one file's rows for another's, a writer that
drops, repeats or reorders records, a merge that launders a damaged page, all give a difference here. The
records are made to cross pages: 4 KiB pages, payloads of 0 B to ~3 pages, a short last page.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import random
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from reference.format import read_bytes, read_file  # noqa: E402

from pageset import (  # noqa: E402
    JSON,
    Bytes,
    ChecksumMismatchError,
    ImageFolder,
    Int,
    ParquetSource,
    RGBImage,
    WebDatasetSource,
    merge_datasets,
    write_dataset,
    write_tokens,
)

PAGE = 4096
FIELDS = {"blob": Bytes(), "label": Int("int32"), "meta": JSON()}
KW = {"progress": False, "lineage": False, "page_size": PAGE}


def make_records(photos, n, seed):
    """``n`` records (blob, label, meta): blobs are slices of real JPEG files of 0 B .. ~3 pages, some empty;
    meta is an empty list or a small dict."""
    rng = random.Random(seed)
    data = [Path(p).read_bytes() for p in photos]
    sizes = [0, 1, 700, 2500, PAGE - 40, PAGE, PAGE + 1, 2 * PAGE + 300, 3 * PAGE - 10]
    out = []
    for i in range(n):
        size = rng.choice(sizes)
        src = data[rng.randrange(len(data))]
        start = rng.randrange(0, len(src) - size)
        meta = [] if rng.random() < 0.2 else {"i": i, "seed": seed, "s": "x" * rng.randrange(0, 30)}
        out.append((src[start:start + size], rng.randrange(-2**31, 2**31), meta))
    return out


def check_records(ref, records):
    """The file read by the reference equals ``records`` (in order), no page is damaged, and the layout has what
    these tests rely on: a record over 2+ pages, and a short last page."""
    assert len(ref.records) == len(records)
    for i, (rec, (blob, label, meta)) in enumerate(zip(ref.records, records)):
        assert (rec["blob"], rec["label"], rec["meta"]) == (blob, label, meta), f"record {i}"
    assert ref.bad_pages() == []
    return ref


def layout_is_hard(ref):
    assert any(len(ref.record_pages(i)) >= 2 for i in range(len(ref.records)))
    assert ref.header["data_length"] % PAGE != 0


@pytest.fixture(scope="module")
def records(photos):
    return make_records(photos, 23, seed=5)


def test_list_source_every_worker_setting(tmp_path, records):
    out = tmp_path / "a.pageset"
    for kw in ({"num_workers": 0}, {"num_workers": 2}):
        write_dataset(out, records, FIELDS, **kw, **KW)
        layout_is_hard(check_records(read_file(out), records))
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        write_dataset(out, records, FIELDS, executor=pool, chunk_size=3, **KW)
    check_records(read_file(out), records)


def test_single_page_file(tmp_path, photos):
    recs = [(b"", 1, []), (b"abc", -2, {"k": 1}), (b"\x00" * 100, 3, {})]
    out = tmp_path / "one.pageset"
    write_dataset(out, recs, FIELDS, num_workers=0, **KW)
    ref = check_records(read_file(out), recs)
    assert ref.header["page_count"] == 1 and ref.header["record_count"] == 3


# ---- multi-file sources: each file a different number of rows ---------------------------------------------------

SHARD_SIZES = [4, 1, 7, 3, 8]


def _cuts(n, sizes):
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    assert starts[-1] == n
    return list(zip(starts, starts[1:]))


def test_webdataset_several_shards(tmp_path, records):
    folder = tmp_path / "shards"
    folder.mkdir()
    for k, (a, b) in enumerate(_cuts(len(records), SHARD_SIZES)):
        with tarfile.open(folder / f"part-{k:02d}.tar", "w") as tar:
            for i in range(a, b):
                blob, label, meta = records[i]
                for ext, payload in (("bin", blob), ("cls", str(label).encode()),
                                     ("json", json.dumps(meta).encode())):
                    info = tarfile.TarInfo(f"s{i:04d}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    src = WebDatasetSource(str(folder / "part-*.tar"), fields={"blob": "bin", "label": "cls", "meta": "json"})
    assert len(src.urls) == len(SHARD_SIZES)
    out = tmp_path / "w.pageset"
    for kw in ({"num_workers": 0}, {"num_workers": 2}):
        write_dataset(out, src, FIELDS, **kw, **KW)
        check_records(read_file(out), records)


class JsonMeta:
    """A ParquetSource whose ``meta`` column holds JSON text (picklable, for worker processes)."""

    def __init__(self, src):
        self.src = src

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        row = self.src[i]
        return {**row, "meta": json.loads(row["meta"])}


def _parquet_files(folder, records):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder.mkdir()
    paths = []
    for k, (a, b) in enumerate(_cuts(len(records), SHARD_SIZES)):
        rows = records[a:b]
        table = pa.table({"blob": [r[0] for r in rows], "label": [r[1] for r in rows],
                          "meta": [json.dumps(r[2]) for r in rows], "row": list(range(a, b))})
        path = folder / f"part-{k:02d}.parquet"
        pq.write_table(table, path, row_group_size=2)  # several row groups per file, one in the 1-row file
        paths.append(path)
    return paths


def test_parquet_several_files(tmp_path, records):
    paths = _parquet_files(tmp_path / "pq", records)
    src = JsonMeta(ParquetSource([str(p) for p in paths], columns={"blob": "blob", "label": "label", "meta": "meta"}))
    out = tmp_path / "p.pageset"
    for kw in ({"num_workers": 0}, {"num_workers": 2}):
        write_dataset(out, src, FIELDS, **kw, **KW)
        check_records(read_file(out), records)
    # a glob gives the same files in sorted order
    glob_src = JsonMeta(ParquetSource(str(tmp_path / "pq" / "*.parquet"),
                                      columns={"blob": "blob", "label": "label", "meta": "meta"}))
    write_dataset(out, glob_src, FIELDS, num_workers=0, **KW)
    check_records(read_file(out), records)


def test_huggingface_dataset_of_several_parquet_files(tmp_path, records):
    datasets = pytest.importorskip("datasets")
    paths = _parquet_files(tmp_path / "pq", records)
    hf = datasets.Dataset.from_parquet([str(p) for p in paths], cache_dir=str(tmp_path / "hf-cache"))
    assert hf["row"] == list(range(len(records)))

    class Rows:
        def __len__(self):
            return len(hf)

        def __getitem__(self, i):
            row = hf[i]
            return {"blob": row["blob"], "label": row["label"], "meta": json.loads(row["meta"])}

    out = tmp_path / "h.pageset"
    write_dataset(out, Rows(), FIELDS, num_workers=0, **KW)
    check_records(read_file(out), records)


def test_imagefolder_and_file_list_with_passthrough(tmp_path, imagenet_like):
    fields = {"image": RGBImage(max_resolution=4096, encoding="jpeg", jpeg_passthrough=True), "label": Int()}
    classes = sorted(p.name for p in imagenet_like.iterdir() if p.is_dir())
    expected = [(p.read_bytes(), k) for k, c in enumerate(classes) for p in sorted((imagenet_like / c).iterdir())]
    assert len(classes) >= 3 and len(expected) >= 20
    out = tmp_path / "f.pageset"
    for src, kw in ((str(imagenet_like), {"num_workers": 0}), (ImageFolder(str(imagenet_like)), {"num_workers": 2})):
        write_dataset(out, src, fields, **kw, **KW)
        ref = read_file(out)
        assert [(r["image"]["data"], r["label"]) for r in ref.records] == expected
        assert ref.schema["attributes"]["class_names"] == classes
    # a file list, relative paths, in the list's own order (reversed here), labels as written
    listed = list(reversed([(p, k) for k, c in enumerate(classes) for p in sorted((imagenet_like / c).iterdir())]))
    lst = imagenet_like.parent / "files.txt"
    lst.write_text("".join(f"{p.relative_to(imagenet_like.parent)}\t{k}\n" for p, k in listed))
    write_dataset(out, str(lst), fields, num_workers=0, **KW)
    assert [(r["image"]["data"], r["label"]) for r in read_file(out).records] == [(p.read_bytes(), k)
                                                                                   for p, k in listed]


# ---- merge -------------------------------------------------------------------------------------------------------


def _inputs(tmp_path, photos, sizes=(9, 1, 13)):
    parts, paths = [], []
    for k, n in enumerate(sizes):
        recs = make_records(photos, n, seed=200 + k)
        path = tmp_path / f"in{k}.pageset"
        write_dataset(path, recs, FIELDS, num_workers=0, **KW)
        parts.append(recs)
        paths.append(path)
    return parts, paths


def test_merge_equals_the_concatenated_inputs(tmp_path, photos):
    parts, paths = _inputs(tmp_path, photos)
    out = tmp_path / "m.pageset"
    merge_datasets(out, paths, progress=False, lineage=False)
    ref = check_records(read_file(out), [r for p in parts for r in p])
    layout_is_hard(ref)
    # a merge into bigger pages re-packs, same records
    merge_datasets(out, paths, progress=False, lineage=False, page_size=4 * PAGE)
    assert [r["blob"] for r in read_file(out).records] == [r[0] for p in parts for r in p]


def _damage_positions(ref):
    """Page numbers to damage: the first, a middle one, the short last page and a page inside a record that spans
    pages (not its first), each with the offset of a byte inside a record's payload on that page."""
    do, ps = ref.header["data_offset"], ref.header["page_size"]
    spans = {}
    for i, rec in enumerate(ref.records):
        if rec["_length"]:
            for k in ref.record_pages(i):
                lo, hi = max(rec["_offset"], do + k * ps), min(rec["_offset"] + rec["_length"], do + (k + 1) * ps)
                spans.setdefault(k, (lo + hi) // 2)
    last = ref.header["page_count"] - 1
    inner = next(k for i in range(len(ref.records)) for k in ref.record_pages(i)[1:])
    chosen = {"first": 0, "middle": last // 2, "last (short)": last, "inside a spanning record": inner}
    return {name: (k, spans[k]) for name, k in chosen.items() if k in spans}


def test_merge_refuses_damage_in_every_page_position(tmp_path, photos):
    parts, paths = _inputs(tmp_path, photos)
    victim = read_file(paths[2])
    positions = _damage_positions(victim)
    assert set(positions) == {"first", "middle", "last (short)", "inside a spanning record"}
    assert len(victim.pages[-1]) < PAGE
    good = paths[2].read_bytes()
    for name, (page, offset) in positions.items():
        raw = bytearray(good)
        raw[offset] ^= 0x04
        paths[2].write_bytes(bytes(raw))
        assert read_bytes(bytes(raw)).bad_pages() == [page], name
        out = tmp_path / "m.pageset"
        with pytest.raises(ChecksumMismatchError, match=f"page {page} CRC-32"):
            merge_datasets(out, paths, progress=False, lineage=False)
        assert not out.exists(), name
        assert sorted(p.name for p in tmp_path.iterdir()) == ["in0.pageset", "in1.pageset", "in2.pageset"], name
    paths[2].write_bytes(good)


def test_merge_token_files_equals_the_concatenated_streams(tmp_path):
    rng = random.Random(3)
    docs = [[rng.randrange(1, 60000) for _ in range(rng.randrange(0, 1500))] for _ in range(17)]
    cut = [docs[:6], docs[6:7], docs[7:]]
    paths = []
    for k, part in enumerate(cut):
        path = tmp_path / f"t{k}.pageset"
        write_tokens(path, part, None, eos_id=0, num_workers=0, **KW)
        paths.append(path)
    wide = tmp_path / "wide.pageset"  # a uint32 input widens the merged stream
    write_tokens(wide, [[70000, 5]], None, eos_id=0, num_workers=0, **KW)
    out = tmp_path / "m.pageset"
    merge_datasets(out, paths + [wide], progress=False, lineage=False)
    ref = read_file(out)
    expected = [t for d in docs + [[70000, 5]] for t in d + [0]]
    assert ref.schema["tokens"]["dtype"] == "uint32" and ref.tokens == expected
    offsets = [0]
    for d in docs + [[70000, 5]]:
        offsets.append(offsets[-1] + len(d) + 1)
    assert ref.doc_offsets == offsets and ref.bad_pages() == []


# ---- tokens from several text files --------------------------------------------------------------------------


def byte_tokens(text: str) -> list[int]:
    """A plain callable tokenizer: UTF-8 bytes + 1 (0 stays free for EOS). Module-level: picklable."""
    return [b + 1 for b in text.encode("utf-8")]


def test_write_tokens_several_files_every_worker_setting(tmp_path):
    rng = random.Random(11)
    words = ["page", "set", "token", "ï", "€", "windows", "\n", "  ", "résumé"]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randrange(1, 900))) for _ in range(14)]
    folder = tmp_path / "corpus"
    folder.mkdir()
    # three JSONL files of 5, 1, 8 documents, read in sorted order
    for k, (a, b) in enumerate(_cuts(len(docs), [5, 1, 8])):
        with open(folder / f"{k:02d}.jsonl", "w", encoding="utf-8") as f:
            for d in docs[a:b]:
                f.write(json.dumps({"text": d}) + "\n")
    expected = [t for d in docs for t in byte_tokens(d) + [0]]
    out = tmp_path / "t.pageset"
    for kw in ({"num_workers": 0}, {"num_workers": 2, "chunk_docs": 3}):
        write_tokens(out, folder, byte_tokens, eos_id=0, **kw, **KW)
        ref = read_file(out)
        assert ref.tokens == expected and ref.schema["tokens"]["documents"] == len(docs)
        assert ref.header["data_length"] > 2 * PAGE and ref.bad_pages() == []
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        write_tokens(out, folder, byte_tokens, eos_id=0, executor=pool, **KW)
    assert read_file(out).tokens == expected


# ---- object storage output -------------------------------------------------------------------------------------


def test_s3_output_equals_the_input(tmp_path, records):
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import s3fs

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        opts = {"key": "testing", "secret": "testing", "endpoint_url": f"http://{host}:{port}",
                "client_kwargs": {"region_name": "us-east-1"}, "skip_instance_cache": True}
        fs = s3fs.S3FileSystem(**opts)
        fs.call_s3("create_bucket", Bucket="ref")
        url = "s3://ref/out/train.pageset"
        write_dataset(url, records, FIELDS, num_workers=0, storage_options=opts, **KW)
        check_records(read_bytes(fs.cat_file(url)), records)
        merge_datasets("s3://ref/out/merged.pageset", [url, url], progress=False, lineage=False,
                       storage_options=opts)
        check_records(read_bytes(fs.cat_file("s3://ref/out/merged.pageset")), records + records)
        # token files: the merged stream is the inputs' streams one after the other (formats/v1.md token stream)
        docs = [[5, 6, 7], [300, 2], [9]]
        tok = "s3://ref/out/tokens.pageset"
        write_tokens(tok, docs, None, eos_id=0, num_workers=0, storage_options=opts, **KW)
        merge_datasets("s3://ref/out/tokens2.pageset", [tok, tok], progress=False, lineage=False,
                       storage_options=opts)
        stream = [t for d in docs for t in d + [0]]
        assert read_bytes(fs.cat_file("s3://ref/out/tokens2.pageset")).tokens == stream + stream
    finally:
        server.stop()


class _OneBad:
    """Records with sample ``bad`` raising in __getitem__ (a source error, skipped with on_error="skip")."""

    def __init__(self, records, bad):
        self.records, self.bad = records, bad

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        if i == self.bad:
            raise OSError(f"sample {i} cannot be read")
        return self.records[i]


@pytest.mark.parametrize("lineage", [False, True])
def test_section_flags_and_metadata_as_the_spec_says(tmp_path, records, lineage):
    """formats/v1.md section 4: schema and index flagged required (bit 0 set), page checksums and metadata not
    (a reader that does not know them must still open the file); the metadata section is canonical JSON
    ``{"lineage": {...}, "user": {...}}`` holding the user's dict as given and the lineage of the write: the source,
    the number of samples in it and the skipped indices (with their errors). The reference reader reads all of it
    from the bytes."""
    user = {"split": "train", "n": [1, 2, {"k": None}]}
    src = _OneBad(records, bad=4)
    write_dataset(tmp_path / "f.pageset", src, FIELDS, on_error="skip", metadata=user,
                  **dict(KW, lineage=lineage))
    ref = read_file(tmp_path / "f.pageset")
    flags = {kind: ref.sections[kind][0] for kind in ref.sections}
    assert flags == {1: 1, 2: 1, 3: 0, 4: 0}, flags
    assert set(ref.metadata) == {"lineage", "user"} and ref.metadata["user"] == user
    lin = ref.metadata["lineage"]
    assert lin["samples_in_source"] == len(records) and lin["skipped"] == [4]
    assert "_OneBad" in lin["source"]
    assert [e["index"] for e in lin["skipped_errors"]] == [4] and "cannot be read" in lin["skipped_errors"][0]["error"]
    base = {"source", "samples_in_source", "skipped", "skipped_errors"}
    assert (set(lin) == base) if not lineage else (set(lin) > base)  # lineage=True adds when/where/versions
    check_records(ref, records[:4] + records[5:])


def test_data_area_of_whole_pages_has_one_checksum_per_page(tmp_path):
    """Records that fill the data area to exactly 2 pages (4 records of PAGE/2 bytes, no padding needed): the file
    has page_count 2 and 2 page CRCs, each the CRC-32 of its page (formats/v1.md: one checksum per page, the
    last page short only when the data area is not a whole number of pages)."""
    import zlib

    fields = {"blob": Bytes()}
    # a Bytes record is its span only (no inline columns), so four of PAGE/2 bytes fill two pages exactly
    blobs = [bytes([k + 1]) * (PAGE // 2) for k in range(4)]
    write_dataset(tmp_path / "f.pageset", [(b,) for b in blobs], fields, **KW)
    ref = read_file(tmp_path / "f.pageset")
    assert ref.header["data_length"] == 2 * PAGE and ref.header["page_count"] == 2
    assert ref.page_crcs == [zlib.crc32(p) for p in ref.pages] and len(ref.pages) == 2
    assert [r["blob"] for r in ref.records] == blobs


def test_bad_sample_error_names_the_source_index_and_field(tmp_path, records):
    """A sample that cannot be encoded stops the write with SampleError naming the source (its description),
    the sample index and the field, in this process and in worker processes; nothing is written."""
    from pageset import SampleError

    bad = list(records)
    bad[5] = (bad[5][0], "not an int", bad[5][2])
    for workers in (0, 2):
        with pytest.raises(SampleError) as info:
            write_dataset(tmp_path / "f.pageset", bad, FIELDS, num_workers=workers, **KW)
        err = info.value
        assert (err.index, err.field) == (5, "label") and err.source == "source list", (workers, err.source)
        assert "source list" in str(err) and "sample 5" in str(err)
        assert not (tmp_path / "f.pageset").exists()
