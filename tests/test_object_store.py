"""Output to object storage: write_dataset / write_tokens / merge to s3:// on moto's S3 server (127.0.0.1),
through the real s3fs client; an interrupted upload is aborted and the previous object stays."""

from __future__ import annotations

import numpy as np
import pytest

from pageset import Int, RGBImage, SampleError, merge_datasets, write_dataset, write_tokens

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")


@pytest.fixture(scope="module")
def moto_s3():
    """A moto S3 server on 127.0.0.1 (free port) with a bucket ``pageset-test``; storage_options for s3fs."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    opts = {"key": "testing", "secret": "testing", "endpoint_url": f"http://{host}:{port}",
            "client_kwargs": {"region_name": "us-east-1"}, "skip_instance_cache": True}
    fs = s3fs.S3FileSystem(**opts)
    fs.call_s3("create_bucket", Bucket="pageset-test")
    try:
        yield opts
    finally:
        server.stop()


def _fs(opts):
    return s3fs.S3FileSystem(**opts)


def _keys(opts, prefix):
    """Every object under ``pageset-test/<prefix>`` (shards included), as bucket-relative names."""
    fs = _fs(opts)
    fs.invalidate_cache()
    return sorted(p.split("/", 1)[1] for p in fs.find(f"pageset-test/{prefix}"))


def _uploads(opts) -> list:
    fs = _fs(opts)
    return fs.call_s3("list_multipart_uploads", Bucket="pageset-test").get("Uploads", [])


def test_write_dataset_to_s3_same_bytes_as_local(tmp_path, photos, moto_s3):
    fields = {"image": RGBImage(max_resolution=96), "label": Int()}
    src = [(p, k) for k, p in enumerate(photos[:8])]
    kw = {"num_workers": 0, "progress": False, "lineage": False, "page_size": 1 << 14}
    ref = write_dataset(tmp_path / "ref.pageset", src, fields, **kw)
    url = "s3://pageset-test/images/train.pageset"
    res = write_dataset(url, src, fields, storage_options=moto_s3, **kw)
    assert res.path == url and res.dataset_id == ref.dataset_id
    assert _fs(moto_s3).cat_file(url) == (tmp_path / "ref.pageset").read_bytes()
    assert _keys(moto_s3, "images") == ["images/train.pageset"] and _uploads(moto_s3) == []
    # tokens and merge write to URLs the same way
    docs = [np.arange(1, 30) + k for k in range(12)]
    write_tokens(tmp_path / "t.pageset", docs, None, eos_id=0, num_workers=0, progress=False, lineage=False)
    write_tokens("s3://pageset-test/tok/t.pageset", docs, None, eos_id=0, num_workers=0, progress=False,
                 lineage=False, storage_options=moto_s3)
    assert _fs(moto_s3).cat_file("s3://pageset-test/tok/t.pageset") == (tmp_path / "t.pageset").read_bytes()
    merge_datasets("s3://pageset-test/tok/m.pageset", [tmp_path / "t.pageset"] * 2, progress=False,
                   storage_options=moto_s3)
    assert _keys(moto_s3, "tok") == ["tok/m.pageset", "tok/t.pageset"]


class FailsAt:
    """Raw-image rows that fail at ``bad``; before failing it records the parts S3 already holds for the upload
    in progress (so the test sees that the interruption really came mid-upload)."""

    def __init__(self, photos, n, bad, opts):
        self.photos, self.n, self.bad, self.opts, self.seen = photos, n, bad, opts, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            fs = _fs(self.opts)
            for up in _uploads(self.opts):
                parts = fs.call_s3("list_parts", Bucket="pageset-test", Key=up["Key"], UploadId=up["UploadId"])
                self.seen.append((up["Key"], len(parts.get("Parts", []))))
            raise OSError(f"row {i}: connection to the image store lost")
        return (self.photos[i % len(self.photos)],)


def test_interrupted_upload_is_aborted_and_previous_object_stays(tmp_path, photos, moto_s3, monkeypatch):
    import pageset.write.filewriter as fw

    url = "s3://pageset-test/big/train.pageset"
    write_dataset(url, photos[:1], {"image": RGBImage(max_resolution=32)}, num_workers=0, progress=False,
                  storage_options=moto_s3)
    before = _fs(moto_s3).cat_file(url)
    monkeypatch.setattr(fw, "UPLOAD_BLOCK", 5 << 20)  # S3's smallest part, so a few MB make several parts
    src = FailsAt(photos, 44, 40, moto_s3)
    with pytest.raises(SampleError, match="connection to the image store lost"):
        write_dataset(url, src, {"image": RGBImage(max_resolution=512, encoding="raw")}, num_workers=0,
                      progress=False, storage_options=moto_s3, page_size=1 << 16)
    assert src.seen and src.seen[0][0] == "big/train.pageset" and src.seen[0][1] >= 1  # parts were up
    assert _fs(moto_s3).cat_file(url) == before
    assert _uploads(moto_s3) == []  # aborted: no part left behind
    assert _keys(moto_s3, "big") == ["big/train.pageset"]
    # the same source without the failure: the multipart upload completes, same bytes as a local write
    src.bad = -1
    kw = {"num_workers": 0, "progress": False, "page_size": 1 << 16, "lineage": False}
    fields = {"image": RGBImage(max_resolution=512, encoding="raw")}
    write_dataset(url, src, fields, storage_options=moto_s3, **kw)
    write_dataset(tmp_path / "ref.pageset", src, fields, **kw)
    assert _fs(moto_s3).cat_file(url) == (tmp_path / "ref.pageset").read_bytes()
    assert (tmp_path / "ref.pageset").stat().st_size > 3 * (5 << 20) and _uploads(moto_s3) == []


def test_other_fsspec_urls_upload_a_local_temp_file(tmp_path):
    """Stores without S3's multipart API (here fsspec's in-memory one) get the file assembled locally, then
    uploaded on commit; file:// URLs are local paths."""
    import fsspec

    rows = [(i,) for i in range(50)]
    kw = {"num_workers": 0, "progress": False, "lineage": False, "page_size": 1 << 12}
    write_dataset(tmp_path / "ref.pageset", rows, {"y": Int()}, **kw)
    res = write_dataset("memory://pageset-test/a.pageset", rows, {"y": Int()}, **kw)
    mem = fsspec.filesystem("memory")
    try:
        assert res.path == "memory://pageset-test/a.pageset"
        assert mem.cat_file("/pageset-test/a.pageset") == (tmp_path / "ref.pageset").read_bytes()
    finally:
        mem.rm("/pageset-test", recursive=True)
    res = write_dataset(f"file://{tmp_path}/b.pageset", rows, {"y": Int()}, **kw)
    assert res.path == str(tmp_path / "b.pageset")
    assert (tmp_path / "b.pageset").read_bytes() == (tmp_path / "ref.pageset").read_bytes()


def test_written_to_s3_reads_back_through_the_url(tmp_path, photos, moto_s3):
    """What write_dataset / write_tokens upload is a pageset file the readers open by URL: open_dataset,
    open_tokens and the Loader give the local file's records, tokens and batches."""
    from pageset import Loader, TokenWindows, open_dataset, open_tokens

    fields = {"image": RGBImage(max_resolution=64), "label": Int()}
    src = [(p, k) for k, p in enumerate(photos[:6])]
    kw = {"num_workers": 0, "progress": False, "lineage": False, "page_size": 1 << 14}
    write_dataset(tmp_path / "ref.pageset", src, fields, **kw)
    url = "s3://pageset-test/readback/train.pageset"
    write_dataset(url, src, fields, storage_options=moto_s3, **kw)
    with open_dataset(tmp_path / "ref.pageset") as local, open_dataset(url, moto_s3) as remote:
        assert remote.dataset_id == local.dataset_id and len(remote) == len(local) == 6
        for i in range(6):
            a, b = local[i], remote[i]
            assert a["label"] == b["label"] == i
            np.testing.assert_array_equal(a["image"].to_numpy(), b["image"].to_numpy())
        remote.verify()
    docs = [np.arange(1, 40) + k for k in range(10)]
    write_tokens(tmp_path / "t.pageset", docs, None, eos_id=0, num_workers=0, progress=False, lineage=False)
    turl = "s3://pageset-test/readback/t.pageset"
    write_tokens(turl, docs, None, eos_id=0, num_workers=0, progress=False, lineage=False, storage_options=moto_s3)
    with open_tokens(tmp_path / "t.pageset") as local, open_tokens(turl, moto_s3) as remote:
        assert remote.documents == local.documents == 10 and len(remote) == len(local)
        for i in range(10):
            np.testing.assert_array_equal(remote.document(i), local.document(i))
    kw = dict(batch_size=4, order="random", seed=1, num_threads=1, pipelines={"tokens": [TokenWindows(8)]})
    with Loader(tmp_path / "t.pageset", **kw) as a, Loader(turl, storage_options=moto_s3, **kw) as b:
        got_a = [x["input"].tolist() for x in a]
        got_b = [x["input"].tolist() for x in b]
    assert len(got_a) == len(got_b) > 0 and got_a == got_b
