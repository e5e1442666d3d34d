"""write_dataset from WebDataset tar shards, Parquet files and Hugging Face datasets: the same records give
the same file contents (dataset id, pages and index) whatever the source object."""

from __future__ import annotations

import concurrent.futures
import json

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
