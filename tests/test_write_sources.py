"""write_dataset from WebDataset tar shards, Parquet files and Hugging Face datasets: the same records give
the same file contents (dataset id, pages and index) whatever the source object."""

from __future__ import annotations

import concurrent.futures
import io
import json
import pickle
import tarfile

import pytest

from pageset import (
    JSON,
    Int,
    ParquetSource,
    RGBImage,
    SampleError,
    WebDatasetSource,
    open_dataset,
    write_dataset,
)

wds = pytest.importorskip("webdataset")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

FIELDS = {"image": RGBImage(max_resolution=64), "label": Int(), "meta": JSON()}


@pytest.fixture(scope="module")
def records(imagenet_like):
    """(JPEG bytes, label, {"n": i}) of 14 real photos."""
    paths = sorted(p for p in imagenet_like.rglob("*.jpg"))[:14]
    return [(p.read_bytes(), i % 5, {"n": i, "name": p.stem}) for i, p in enumerate(paths)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, records):
    path = tmp_path_factory.mktemp("ref") / "ref.pageset"
    write_dataset(path, records, FIELDS, num_workers=0, progress=False, lineage=False)
    return _contents(path)


def _contents(path):
    """(dataset_id, data area bytes, index rows): what must not depend on the source object."""
    with open_dataset(path) as ds:
        data = bytes(ds.buffer[ds.data_offset : ds.data_offset + ds.data_length])
        return ds.dataset_id, data, ds.index.tobytes(), len(ds)


def _write_shards(folder, records, per_shard=5, drop=None):
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(0, len(records), per_shard):
        with wds.TarWriter(str(folder / f"train-{s // per_shard:03d}.tar")) as sink:
            for i in range(s, min(s + per_shard, len(records))):
                img, label, meta = records[i]
                sample = {"__key__": f"sample{i:05d}", "jpg": img, "cls": label, "json": meta}
                if drop is not None and i == drop:
                    del sample["cls"]
                sink.write(sample)
    return len(range(0, len(records), per_shard))


def test_webdataset_shards_give_the_same_file(tmp_path, records, reference):
    n = _write_shards(tmp_path / "shards", records)
    fields = {"image": "jpg", "label": "cls", "meta": "json"}
    for urls in (str(tmp_path / "shards" / f"train-{{000..{n - 1:03d}}}.tar"),  # brace pattern
                 str(tmp_path / "shards" / "train-*.tar"),  # glob
                 [f"file://{tmp_path}/shards/train-{k:03d}.tar" for k in range(n)]):  # fsspec URLs
        src = WebDatasetSource(urls, fields=fields)
        assert len(src) == len(records)
        out = tmp_path / "wds.pageset"
        write_dataset(out, src, FIELDS, num_workers=0, progress=False, lineage=False)
        assert _contents(out) == reference
    with concurrent.futures.ProcessPoolExecutor(2) as pool:  # the source travels to workers by pickle
        write_dataset(out, src, FIELDS, executor=pool, chunk_size=4, progress=False, lineage=False)
    assert _contents(out) == reference


def test_webdataset_member_without_a_field(tmp_path, records):
    _write_shards(tmp_path / "shards", records, drop=7)
    src = WebDatasetSource(str(tmp_path / "shards" / "*.tar"), fields={"image": "jpg", "label": "cls", "meta": "json"})
    with pytest.raises(SampleError, match=r"train-001\.tar: sample 7, field 'label': member 'sample00007' has no "
                                          r"'cls' file"):
        write_dataset(tmp_path / "x.pageset", src, FIELDS, num_workers=0, progress=False)
    assert not (tmp_path / "x.pageset").exists()
    res = write_dataset(tmp_path / "y.pageset", src, FIELDS, num_workers=0, progress=False, on_error="skip")
    assert res.skipped == (7,) and res.records == len(records) - 1
    with open_dataset(tmp_path / "y.pageset") as ds:
        assert [ds[i]["meta"]["n"] for i in range(len(ds))] == [i for i in range(len(records)) if i != 7]
    with pytest.raises(ValueError, match="no file matches"):
        WebDatasetSource(str(tmp_path / "none-*.tar"), fields={"image": "jpg"})


class CountingExecutor(concurrent.futures.Executor):
    """A process pool that measures the pickled size of what each task is sent."""

    def __init__(self):
        self.pool, self.sent = concurrent.futures.ProcessPoolExecutor(2), []

    def submit(self, fn, /, *args, **kwargs):
        self.sent.append(len(pickle.dumps((args, kwargs))))
        return self.pool.submit(fn, *args, **kwargs)

    def shutdown(self, *args, **kwargs):
        self.pool.shutdown(*args, **kwargs)


def test_webdataset_source_holds_an_index_not_the_data(tmp_path, records, reference):
    n = _write_shards(tmp_path / "shards", records)
    shard_bytes = sum(p.stat().st_size for p in (tmp_path / "shards").iterdir())
    src = WebDatasetSource(str(tmp_path / "shards" / "train-*.tar"), fields={"image": "jpg", "label": "cls",
                                                                             "meta": "json"})
    pickled = len(pickle.dumps(src))
    assert pickled < 4000 < shard_bytes // 10, (pickled, shard_bytes)  # keys and offsets, not JPEG bytes
    assert len(src) == len(records) and len(src.urls) == n
    for i in (0, 6, len(records) - 1, -1):  # read on demand: the same values as webdataset decodes them
        img, label, meta = records[i]
        assert src[i] == {"image": img, "label": label, "meta": meta}
    copy = pickle.loads(pickle.dumps(src))
    assert copy[3] == src[3]
    with pytest.raises(IndexError):
        src[len(records)]
    out = tmp_path / "x.pageset"
    ex = CountingExecutor()
    try:
        write_dataset(out, src, FIELDS, executor=ex, chunk_size=4, progress=False, lineage=False)
    finally:
        ex.shutdown()
    assert _contents(out) == reference
    assert len(ex.sent) == 4 and max(ex.sent) < pickled + 4000  # each task: the index, not the shards


def _tar(path, members):
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_webdataset_bad_shards_and_members_are_named(tmp_path, records):
    jpg = records[0][0]
    good = tmp_path / "good.tar"
    _tar(good, [("a.jpg", jpg), ("a.cls", b"1"), ("b.jpg", jpg), ("b.cls", b"2")])
    fields = {"image": "jpg", "label": "cls"}
    (tmp_path / "corrupt.tar").write_bytes(b"\x00garbage" * 200)
    with pytest.raises(ValueError, match=r"WebDataset shard .*corrupt\.tar: not a readable tar file"):
        WebDatasetSource([str(good), str(tmp_path / "corrupt.tar")], fields=fields)
    data = good.read_bytes()
    (tmp_path / "trunc.tar").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"WebDataset shard .*trunc\.tar: .*(end of data|truncated)"):
        WebDatasetSource(str(tmp_path / "trunc.tar"), fields=fields)
    with tarfile.open(good) as tf:
        last = tf.getmembers()[-1]
    end = last.offset_data + -(-last.size // 512) * 512  # where the end-of-archive blocks start
    (tmp_path / "tail.tar").write_bytes(data[:end] + b"junk" * 256)  # garbage where a header should be
    with pytest.raises(ValueError, match=r"tail\.tar: invalid tar header at byte"):
        WebDatasetSource(str(tmp_path / "tail.tar"), fields=fields)
    with pytest.raises(ValueError, match=r"none-\{0000\.\.0003\}\.tar: no shard matches this brace pattern"):
        WebDatasetSource(str(tmp_path / "none-{0000..0003}.tar"), fields=fields)
    with pytest.raises(FileNotFoundError, match=r"missing-1\.tar: no such file; 1 of the 2 shards"):
        WebDatasetSource(str(tmp_path / "{good,missing-1}.tar"), fields=fields)

    # A member webdataset cannot decode: an error at read time naming shard, sample, key and field; skippable.
    _tar(tmp_path / "badcls.tar", [("c.jpg", jpg), ("c.cls", b"cat"), ("d.jpg", jpg), ("d.cls", b"4")])
    src = WebDatasetSource([str(good), str(tmp_path / "badcls.tar")], fields=fields)
    assert len(src) == 4
    with pytest.raises(SampleError, match=r"badcls\.tar: sample 2, field 'label': member c\.cls .*cannot be "
                                          r"decoded as 'cls'"):
        src[2]
    assert src[3]["label"] == 4
    for workers in (0, 2):
        out = tmp_path / f"x{workers}.pageset"
        with pytest.raises(SampleError, match=r"WebDataset shard .*badcls\.tar: sample 2, field 'label'"):
            write_dataset(out, src, {"image": RGBImage(max_resolution=64), "label": Int()}, num_workers=workers,
                          chunk_size=2, progress=False)
        assert not out.exists()
        res = write_dataset(out, src, {"image": RGBImage(max_resolution=64), "label": Int()}, num_workers=workers,
                            chunk_size=2, progress=False, on_error="skip")
        assert res.skipped == (2,) and res.records == 3
        with open_dataset(out) as ds:
            assert [int(ds[i]["label"]) for i in range(3)] == [1, 2, 4]


def test_webdataset_compressed_shards_reopen_after_close_and_pickle_after_a_read(tmp_path, records):
    # gzip, bz2 and xz compressed tars (WebDatasetSource's docstring) give the members written; a source whose
    # decompressing stream is open still pickles (the stream stays in its process) and close() reopens on demand
    import bz2
    import gzip
    import lzma

    jpg = records[0][0]
    plain = tmp_path / "p.tar"
    _tar(plain, [("a.jpg", jpg), ("a.cls", b"1"), ("b.jpg", jpg[:100]), ("b.cls", b"2")])
    want = [{"image": jpg, "label": 1}, {"image": jpg[:100], "label": 2}]
    fields = {"image": "jpg", "label": "cls"}
    assert [s for s in WebDatasetSource(f"file://{tmp_path}/p*.tar", fields=fields)] == want  # an fsspec glob
    for name, pack in (("g.tar.gz", gzip.compress), ("b.tar.bz2", bz2.compress), ("x.tar.xz", lzma.compress)):
        (tmp_path / name).write_bytes(pack(plain.read_bytes()))
        src = WebDatasetSource(str(tmp_path / name), fields=fields)
        assert [src[0], src[1]] == want, name
        copy = pickle.loads(pickle.dumps(src))
        src.close()
        assert src[1] == copy[1] == want[1] and src[0] == want[0], name


def test_webdataset_shard_shrunk_after_the_index_names_the_member_bytes(tmp_path, records):
    jpg = records[0][0]
    good = tmp_path / "good.tar"
    _tar(good, [("a.jpg", jpg), ("a.cls", b"1"), ("b.jpg", jpg)])
    with tarfile.open(good) as tf:
        last = tf.getmembers()[-1]
    data = good.read_bytes()
    (tmp_path / "after.tar").write_bytes(data + b"junk")  # bytes after the end-of-archive blocks are ignored
    assert len(WebDatasetSource(str(tmp_path / "after.tar"), fields={"image": "jpg"})) == 2
    cut = last.offset_data + 10  # inside b.jpg's data
    src = WebDatasetSource(str(good), fields={"image": "jpg"})  # the shard shrinks after the source was built
    good.write_bytes(data[:cut])
    with pytest.raises(ValueError) as ei:
        src[1]
    assert str(ei.value) == (f"WebDataset shard {good}: truncated: {len(jpg)} bytes expected at byte "
                             f"{last.offset_data}, 10 read (did the shard change after this source was built?); "
                             "re-create or re-download this shard, or leave it out of urls")


def test_parquet_default_columns_and_row_bounds(tmp_path):
    pq.write_table(pa.table({"text": ["a", "bb", "ccc"], "label": [3, 1, 2]}), tmp_path / "t.parquet",
                   row_group_size=2)
    src = ParquetSource(tmp_path / "t.parquet")  # every column under its own name
    assert [src[i] for i in range(3)] == [{"text": "a", "label": 3}, {"text": "bb", "label": 1},
                                          {"text": "ccc", "label": 2}]
    with pytest.raises(IndexError) as ei:
        src[3]
    assert str(ei.value) == "row 3 is outside [0, 3)"


def test_parquet_bad_files_are_named(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1garbagegarbagePAR1")
    with pytest.raises(ValueError, match=r"Parquet file .*bad\.parquet: not a readable Parquet file \(ArrowInvalid: "):
        ParquetSource(tmp_path / "bad.parquet")
    with pytest.raises(FileNotFoundError, match=r"Parquet file .*nope\.parquet: no such file"):
        ParquetSource(tmp_path / "nope.parquet")


def test_sources_read_urls_with_storage_options(tmp_path, records, reference):
    """Shards and a Parquet file on a real S3 server (moto on 127.0.0.1), reached through storage_options,
    in this process and in executor processes (which reopen the URLs with the same options)."""
    pytest.importorskip("s3fs")
    from remote_servers import MotoS3, s3_options

    n = _write_shards(tmp_path / "shards", records)
    pq.write_table(pa.table({"img": [r[0] for r in records], "label": [r[1] for r in records],
                             "meta": [r[2] for r in records]}), tmp_path / "t.parquet", row_group_size=5)
    with MotoS3() as s3:
        client = s3.client()
        client.create_bucket(Bucket="srcs")
        for k in range(n):
            client.upload_file(str(tmp_path / "shards" / f"train-{k:03d}.tar"), "srcs", f"train-{k:03d}.tar")
        client.upload_file(str(tmp_path / "t.parquet"), "srcs", "t.parquet")
        opts = s3_options(s3.url)
        src = WebDatasetSource(f"s3://srcs/train-{{000..{n - 1:03d}}}.tar", fields={"image": "jpg", "label": "cls",
                               "meta": "json"}, storage_options=opts)
        out = tmp_path / "s3.pageset"
        with concurrent.futures.ProcessPoolExecutor(2) as pool:
            write_dataset(out, src, FIELDS, executor=pool, chunk_size=5, progress=False, lineage=False)
        assert _contents(out) == reference
        with pytest.raises(ValueError, match=r"s3://srcs/none-\{0\.\.1\}\.tar: no shard matches"):
            WebDatasetSource("s3://srcs/none-{0..1}.tar", fields={"image": "jpg"}, storage_options=opts)
        psrc = ParquetSource("s3://srcs/t.parquet", columns={"image": "img", "label": "label", "meta": "meta"},
                             storage_options=opts)
        assert len(psrc) == len(records) and psrc[7]["label"] == records[7][1]
        assert psrc[13]["image"] == records[13][0]


def test_parquet_gives_the_same_file(tmp_path, records, reference):
    table = pa.table({
        "img": [{"bytes": r[0], "path": None} for r in records],  # Hugging Face's image struct
        "y": [r[1] for r in records],
        "meta": [json.dumps(r[2]) for r in records],
        "unused": list(range(len(records))),
    })
    path = tmp_path / "train.parquet"
    pq.write_table(table, path, row_group_size=4)  # 4 row groups: reads cross their bounds
    src = ParquetSource(path, columns={"image": "img", "label": "y", "meta": "meta"})
    assert len(src) == len(records)

    class Decoded:  # JSON strings -> objects: the meta column is text in this file
        def __len__(self):
            return len(src)

        def __getitem__(self, i):
            row = src[i]
            return {**row, "meta": json.loads(row["meta"])}

    out = tmp_path / "pq.pageset"
    for workers in (0, 2):  # worker processes each read their row groups
        write_dataset(out, Decoded(), FIELDS, num_workers=workers, progress=False, lineage=False)
        assert _contents(out) == reference
    with pytest.raises(ValueError, match="no column 'label'"):
        ParquetSource(path, columns={"label": "label"})


def test_huggingface_datasets_give_the_same_file(tmp_path, records, reference):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"image": [r[0] for r in records], "label": [r[1] for r in records],
                                     "meta": [r[2] for r in records]})
    out = tmp_path / "hf.pageset"
    write_dataset(out, ds, FIELDS, num_workers=0, progress=False, lineage=False)
    assert _contents(out) == reference
    # decoded by the Image feature (PIL images), and streamed (an IterableDataset has no len): same file
    decoded = ds.cast_column("image", datasets.Image())
    write_dataset(out, decoded, FIELDS, num_workers=0, progress=False, lineage=False)
    assert _contents(out) == reference
    write_dataset(out, decoded.to_iterable_dataset(), FIELDS, num_workers=0, progress=False, lineage=False)
    assert _contents(out) == reference


def test_generators_are_sources(tmp_path):
    out = tmp_path / "gen.pageset"
    res = write_dataset(out, ((i, {"i": i}) for i in range(9)), {"label": Int(), "meta": JSON()}, num_workers=0,
                        progress=False)
    assert res.records == 9
    with open_dataset(out) as ds:
        assert [ds[i]["label"] for i in range(9)] == list(range(9))
    with pytest.raises(TypeError, match="cannot read samples"):
        write_dataset(tmp_path / "z.pageset", 42, {"label": Int()}, num_workers=0, progress=False)
