"""Bad input: clear errors naming the sample, field and fix; nothing written; previous files survive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from pageset import Int, NDArray, RGBImage, SampleError, open_dataset, write_dataset
from pageset.write.sources import WorkerTraceback


class RaisesAt:
    """An indexable source whose __getitem__ raises at one index."""

    def __init__(self, n, bad):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise RuntimeError(f"corrupt record {i} in upstream store")
        return (i,)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_getitem_raising_at_5_names_index_and_keeps_previous_file(tmp_path, num_workers):
    out = tmp_path / "d.pageset"
    write_dataset(out, [(7,)], {"y": Int()}, num_workers=0, progress=False)
    before = out.read_bytes()
    t0 = time.monotonic()
    with pytest.raises(SampleError) as ei:
        write_dataset(out, RaisesAt(200, 5), {"y": Int()}, num_workers=num_workers, progress=False)
    assert time.monotonic() - t0 < 600  # a hang check (the error must come, not a speed): room for a cold compile on a loaded machine
    err = ei.value
    assert err.index == 5
    assert "sample 5" in str(err) and "corrupt record 5 in upstream store" in str(err)
    assert "on_error='skip'" in str(err) and str(err).count("corrupt record 5") == 1  # said once, with the fix
    if num_workers:  # the worker's traceback is the cause, shown once below the message
        assert isinstance(err.__cause__, WorkerTraceback) and "__getitem__" in str(err.__cause__)
        assert "Traceback" not in str(err)
    else:
        assert isinstance(err.__cause__, RuntimeError)
    assert out.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["d.pageset"]  # no temp file left behind


@pytest.mark.parametrize("num_workers", [0, 2])
def test_on_error_skip_records_indices(tmp_path, num_workers):
    out = tmp_path / "s.pageset"
    res = write_dataset(out, RaisesAt(20, 5), {"y": Int()}, num_workers=num_workers, progress=False,
                        on_error="skip")
    assert res.skipped == (5,) and res.records == 19
    with open_dataset(out) as ds:
        assert ds.index["y"].tolist() == [i for i in range(20) if i != 5]
        lin = ds.metadata["lineage"]
        assert lin["skipped"] == [5]
        assert "corrupt record 5" in lin["skipped_errors"][0]["error"]


def test_float64_array_for_float32_field(tmp_path):
    with pytest.raises(SampleError, match=r"sample 0, field 'x'.*float64.*float32.*astype"):
        write_dataset(tmp_path / "f.pageset", [(np.zeros(3),)], {"x": NDArray("float32", (3,))},
                      num_workers=0, progress=False)
    # a safe cast is accepted and stored exactly
    write_dataset(tmp_path / "g.pageset", [(np.arange(3, dtype=np.int16),)], {"x": NDArray("float32", (3,))},
                  num_workers=0, progress=False)
    with open_dataset(tmp_path / "g.pageset") as ds:
        np.testing.assert_array_equal(ds[0]["x"], np.arange(3, dtype=np.float32))


def test_wrong_shape_and_out_of_range_int(tmp_path):
    with pytest.raises(SampleError, match=r"shape \(2,\) does not match"):
        write_dataset(tmp_path / "a", [(np.zeros(2, np.float32),)], {"x": NDArray("float32", (3,))},
                      num_workers=0, progress=False)
    with pytest.raises(SampleError, match="does not fit int8"):
        write_dataset(tmp_path / "b", [(300,)], {"x": Int("int8")}, num_workers=0, progress=False)
    with pytest.raises(SampleError, match="expected an integer"):
        write_dataset(tmp_path / "c", [(1.5,)], {"x": Int()}, num_workers=0, progress=False)


def test_dict_sample_missing_a_field(tmp_path):
    src = [{"a": 1, "b": 2}, {"a": 3}]
    with pytest.raises(SampleError, match=r"sample 1, field 'b'.*no key 'b'"):
        write_dataset(tmp_path / "m.pageset", src, {"a": Int(), "b": Int()}, num_workers=0, progress=False)


def test_tuple_of_wrong_length(tmp_path):
    with pytest.raises(SampleError, match="2 values but there are 3 fields"):
        write_dataset(tmp_path / "t", [(1, 2)], {"a": Int(), "b": Int(), "c": Int()}, num_workers=0,
                      progress=False)


def test_non_image_files_in_imagefolder(tmp_path, photos):
    root = tmp_path / "folder"
    (root / "cat").mkdir(parents=True)
    (root / "dog").mkdir()
    from PIL import Image

    Image.open(photos[0]).convert("RGB").resize((64, 48)).save(root / "cat" / "a.jpg")
    Image.open(photos[1]).convert("RGB").resize((64, 48)).save(root / "dog" / "b.png")
    (root / "dog" / "notes.txt").write_text("not an image")  # ignored, as torchvision's ImageFolder does
    res = write_dataset(tmp_path / "ok.pageset", root, num_workers=0, progress=False)
    assert res.records == 2
    with open_dataset(tmp_path / "ok.pageset") as ds:
        assert ds.schema["attributes"] == {"class_names": ["cat", "dog"], "ignored_files": 1}
    (root / "dog" / "c.jpg").write_text("text with an image extension")  # a real error, named
    with pytest.raises(SampleError) as ei:
        write_dataset(tmp_path / "bad.pageset", root, num_workers=2, progress=False)
    assert ei.value.index == 2 and ei.value.field == "image"
    assert "c.jpg" in str(ei.value) and "could not be decoded" in str(ei.value)
    assert not (tmp_path / "bad.pageset").exists()


def test_empty_and_png_named_jpg(tmp_path, photos):
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    with pytest.raises(SampleError, match="empty"):
        write_dataset(tmp_path / "e", [str(empty)], num_workers=0, progress=False)
    from PIL import Image

    png_named_jpg = tmp_path / "really_png.jpg"
    Image.open(photos[0]).convert("RGB").resize((32, 32)).save(png_named_jpg, format="PNG")
    write_dataset(tmp_path / "p.pageset", [str(png_named_jpg)], num_workers=0, progress=False)  # content wins


def test_invalid_arguments(tmp_path):
    with pytest.raises(ValueError, match="power of two"):
        write_dataset(tmp_path / "x", [(1,)], {"y": Int()}, page_size=3000)
    with pytest.raises(ValueError, match="on_error"):
        write_dataset(tmp_path / "x", [(1,)], {"y": Int()}, on_error="ignore")
    with pytest.raises(ValueError, match="must not start with '_'"):
        write_dataset(tmp_path / "x", [(1,)], {"_y": Int()})
    with pytest.raises(ValueError, match="RGBImage.encoding"):
        write_dataset(tmp_path / "x", [(1,)], {"y": RGBImage(encoding="png")})
    with pytest.raises(TypeError, match="pass fields="):
        write_dataset(tmp_path / "x", [(1,)])
    assert list(tmp_path.iterdir()) == []


KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from pageset import write_dataset, NDArray

    class Slow:
        def __len__(self):
            return 10_000
        def __getitem__(self, i):
            if i == 50:
                print("halfway", flush=True)
            if i >= 50:
                time.sleep(0.01)
            return (np.full(4096, i, dtype=np.float64),)

    write_dataset(sys.argv[1], Slow(), {"x": NDArray("float64", (4096,))}, num_workers=int(sys.argv[2]),
                  page_size=1 << 16, progress=False)
    """
)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sigkill_halfway_leaves_previous_file_intact(tmp_path, num_workers):
    out = tmp_path / "target.pageset"
    write_dataset(out, [(np.zeros(4096),)], {"x": NDArray("float64", (4096,))}, num_workers=0, progress=False)
    before = out.read_bytes()
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(out), str(num_workers)],
                            stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline().strip() == b"halfway"
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)  # the writer and its workers, as an OOM killer or a node loss would
    proc.wait(timeout=30)
    assert out.read_bytes() == before
    with open_dataset(out) as ds:
        ds.verify()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "target.pageset"]
    assert all(".tmp-" in name for name in leftovers)  # a killed process cannot clean up; it never renames


ORPHAN_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pageset import write_dataset, Int

    class RecordsWorkers:  # each worker process writes its pid once, then every sample takes a while
        def __len__(self):
            return 100_000
        def __getitem__(self, i):
            mark = os.path.join(sys.argv[2], str(os.getpid()))
            if not os.path.exists(mark):
                open(mark, "w").close()
            time.sleep(0.005)
            return (i,)

    write_dataset(sys.argv[1], RecordsWorkers(), {"y": Int()}, num_workers=2, chunk_size=8, progress=False)
    """
)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux only")
def test_sigkill_of_the_writer_ends_its_workers(tmp_path):
    """SIGKILL to the writer process alone (not its group): its pool's workers must not live on as orphans."""
    marks = tmp_path / "workers"
    marks.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, str(tmp_path / "o.pageset"), str(marks)],
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(marks.iterdir())) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        workers = [int(p.name) for p in marks.iterdir()]
        assert len(workers) == 2 and proc.pid not in workers and all(map(_alive, workers))
        os.kill(proc.pid, signal.SIGKILL)  # the parent only
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, workers)), "worker processes outlived their killed writer"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # clean up, whatever happened
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def test_worker_killed_is_reported(tmp_path):
    class KillsWorker:
        def __len__(self):
            return 100

        def __getitem__(self, i):
            if i == 30:
                os.kill(os.getpid(), signal.SIGKILL)
            return (i,)

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="worker process died"):
        write_dataset(tmp_path / "k.pageset", KillsWorker(), {"y": Int()}, num_workers=2, progress=False)
    assert time.monotonic() - t0 < 600  # a hang check (the error must come, not a speed): room for a cold compile on a loaded machine
    assert not (tmp_path / "k.pageset").exists()


# ---- the executor's shard writer, called in this process (mutmut traces no worker process) ---------------------

def test_a_shard_that_cannot_be_renamed_into_place_names_the_shard_and_the_fix(tmp_path):
    import errno
    import socket

    from pageset.write.ranges import write_shard

    folder = tmp_path / "x.shards-1"
    folder.mkdir()
    (folder / "_writing").write_bytes(b"")
    target = folder / "000000000000-000000000002.shard"
    target.mkdir()  # a directory (not empty) where the shard goes: the rename fails
    (target / "keep").write_bytes(b"1")
    with pytest.raises(OSError) as ei:
        write_shard(str(target), {"kind": "records"}, [("rows", b"abc"), ("payloads", b"")], None)
    msg = str(ei.value)
    assert ei.value.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST), msg
    assert f"writing a shard (renaming {target}.tmp-{socket.gethostname()}-{os.getpid()}-" in msg, msg
    assert f"bytes written, at {target} (folder {folder}: " in msg, msg
    assert msg.endswith(f"; check that {folder} is writable and its disk healthy, or choose another shard_dir"), msg
    assert sorted(p.name for p in folder.iterdir()) == ["000000000000-000000000002.shard", "_writing"]  # no temp
    assert (target / "keep").read_bytes() == b"1"


def test_a_shard_whose_job_has_ended_is_discarded_with_its_folder(tmp_path):
    from pageset.write.ranges import write_shard

    folder = tmp_path / "x.shards-2"
    folder.mkdir()
    with pytest.raises(RuntimeError) as ei:  # no marker: the job removed it before the folder
        write_shard(str(folder / "0-1.shard"), {"kind": "records"}, [("rows", b"abc")], None)
    assert str(ei.value) == f"{folder}: the write this shard belongs to has ended; shard discarded"
    assert not folder.exists()
    from pageset.write.ranges import remove_shard_folder

    remove_shard_folder(str(folder), None)  # already gone: fine (the job's cleanup after its stragglers)
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "0-1.shard").write_bytes(b"x")
    remove_shard_folder(str(folder), None)
    assert not folder.exists()


def test_shard_error_words_a_store_fault_and_keeps_a_bug():
    from pageset.write.ranges import shard_error

    err = shard_error(ConnectionResetError(104, "Connection reset by peer"), "s3://b/tmp/x.shards-1",
                      "writing a shard on worker host h")
    assert type(err) is OSError
    assert str(err) == ("s3://b/tmp/x.shards-1: writing a shard on worker host h in shard_dir failed "
                        "(ConnectionResetError: [Errno 104] Connection reset by peer); shard_dir must be a folder or "
                        "URL every worker can write (check its endpoint and credentials in storage_options)")
    bug = TypeError("unsupported operand")
    assert shard_error(bug, "s3://b/tmp/x.shards-1", "writing a shard") is bug
    denied = shard_error(PermissionError("Access Denied"), "s3://b/tmp/x.shards-1", "writing a shard")
    assert type(denied) is PermissionError
    assert str(denied).startswith("s3://b/tmp/x.shards-1: writing a shard in shard_dir: access denied (Access "
                                  "Denied); check the credentials"), str(denied)


def test_a_worker_unpickles_a_shared_object_once_and_keeps_the_latest():
    import hashlib

    from pageset.write.ranges import pickled_once, unpickled

    assert pickled_once(None, None) is None and unpickled(None) is None
    a = pickled_once({"vocab": [1, 2, 3]}, None)
    assert a[0] == hashlib.sha256(a[1]).hexdigest()
    first = unpickled(a)
    assert first == {"vocab": [1, 2, 3]}
    assert unpickled(a) is first  # once per process
    b = pickled_once(("other", 4), None)
    assert unpickled(b) == ("other", 4)
    again = unpickled(a)
    assert again == first and again is not first  # only the latest object is kept


def test_a_shard_is_read_back_as_its_layout_says_and_each_damage_is_named(tmp_path):
    """The shard of a local executor task, byte by byte against the layout in write/ranges.py's docstring
    (``PGSHARD1``, u64 LE header length, JSON header, arrays back to back), read back by ShardPart, then damaged
    in each way the reader checks: magic, CRC-32, truncation, size and record count, array order."""
    import json
    import zlib
    from pathlib import Path

    from pageset import Bytes
    from pageset.format.schema import build_schema, parse_schema
    from pageset.write.ranges import Shard, ShardPart, encode_range_to_shard, new_shard_folder, shard_name
    from pageset.write.sources import open_source

    values = [(b"abc", 1), (b"", 2), (bytes(range(256)) * 20, 3), ("not bytes", 4)]
    src, fields = open_source(values, {"blob": Bytes(), "y": Int()})
    _, row_dtype = parse_schema(build_schema(fields, {}, {"page_size": 4096, "checksum": "crc32"}))
    folder = new_shard_folder(str(tmp_path / "out.pageset"), None)
    summary = encode_range_to_shard(src, fields, row_dtype, 0, 4, "skip", folder, None)
    url = shard_name(folder, 0, 4)
    raw = Path(url).read_bytes()
    assert summary == {"url": url, "bytes": len(raw), "records": 3}
    assert url.endswith("/000000000000-000000000004.shard")
    assert raw[:8] == b"PGSHARD1"
    n = int.from_bytes(raw[8:16], "little")
    head, body = json.loads(raw[16:16 + n]), raw[16 + n:]
    nrows = 3 * row_dtype.itemsize
    assert head["arrays"] == [["rows", nrows], ["payloads", 3 + 0 + 5120]]
    assert head["crc32"] == zlib.crc32(body) and len(body) == nrows + 5123
    assert (head["kind"], head["start"], head["stop"], head["records"]) == ("records", 0, 4, 3)
    assert [(s["index"], s["field"]) for s in head["skipped"]] == [(3, "blob")]

    part = ShardPart(summary, row_dtype, None)
    assert part.error is None and part.skipped == head["skipped"]
    assert part.rows.dtype == row_dtype
    assert part.rows["_length"].tolist() == [3, 0, 5120] and part.rows["y"].tolist() == [1, 2, 3]
    assert list(part.payloads()) == [b"abc", b"", bytes(range(256)) * 20]

    failed = ShardPart({"error": [5, "blob", "bad value", "Traceback ...", "a list"]}, row_dtype, None)
    assert failed.error == (5, "blob", "bad value", "Traceback ...", "a list")
    assert failed.rows.dtype == row_dtype and len(failed.rows) == 0 and failed.skipped == []

    def damaged(data: bytes, **change):
        Path(url).write_bytes(data)
        return ShardPart({**summary, **change}, row_dtype, None)

    with pytest.raises(ValueError) as ei:
        damaged(b"X" + raw[1:])
    assert str(ei.value) == (f"{url}: not a pageset shard (magic b'XGSHARD1'); it was changed or truncated by "
                             "something other than this write")
    flipped = bytearray(raw)
    flipped[-7] ^= 1
    with pytest.raises(ValueError) as ei:
        list(damaged(bytes(flipped)).payloads())
    assert str(ei.value) == (f"{url}: shard checksum mismatch (CRC-32 {zlib.crc32(bytes(flipped[16 + n:])):08x}, "
                             f"written {head['crc32']:08x}); a task's output was damaged in transit")
    with pytest.raises(ValueError) as ei:
        list(damaged(raw[:-10]).payloads())
    assert str(ei.value) == f"{url}: truncated shard (wanted 5120 bytes at {16 + n + nrows + 3}, got 5110)"
    with pytest.raises(ValueError) as ei:
        list(damaged(raw, bytes=len(raw) + 1).payloads())
    assert str(ei.value) == f"{url}: shard has {len(raw)} bytes, its task wrote {len(raw) + 1}"
    with pytest.raises(ValueError) as ei:
        damaged(raw, records=4)
    assert str(ei.value) == f"{url}: 3 records, its task wrote 4"
    Path(url).write_bytes(raw)
    shard = Shard(url, None)
    with pytest.raises(ValueError) as ei:
        shard.begin("payloads")
    assert str(ei.value) == f"{url}: expected array 'rows' next, asked for 'payloads'"
    assert shard.read("payloads")[:3] == body[:3]  # read from where the header ends: the rows' bytes
    with pytest.raises(ValueError) as ei:
        shard.begin("more")
    assert str(ei.value) == f"{url}: no array 'more' in the shard"
    shard.close(check=False)
    assert shard.f.closed


def test_a_shard_folder_that_cannot_be_made_names_the_output_and_shard_dir(tmp_path):
    from pageset.write.ranges import new_shard_folder

    (tmp_path / "a_file").write_bytes(b"")
    with pytest.raises(OSError) as ei:
        new_shard_folder(str(tmp_path / "out.pageset"), str(tmp_path / "a_file"))  # a file, not a folder
    msg = str(ei.value)
    assert f"writing the shard folder of the output {tmp_path / 'out.pageset'} failed after 0 bytes written" in msg
    assert msg.endswith("or choose another shard_dir (shard_dir=, a folder every worker can write)"), msg
    assert os.listdir(tmp_path) == ["a_file"]


def test_executors_get_the_pickler_they_use(tmp_path):
    """Dask and Ray pickle work with cloudpickle (lambdas are fine there); other executors with pickle, so a
    lambda in the source is refused before any work, naming where it is."""
    import pickle
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

    cloudpickle = pytest.importorskip("cloudpickle")
    from pageset.write.ranges import check_picklable, dumps_for

    class FakeDask:  # the engine is told by the executor's module, as for distributed.Client
        pass

    FakeDask.__module__ = "distributed.client"
    with ThreadPoolExecutor(1) as ex:
        assert dumps_for(ex) is pickle.dumps
    assert dumps_for(FakeDask()) is cloudpickle.dumps
    source = {"paths": ["a.jpg"], "open": lambda p: p}
    with ProcessPoolExecutor(1) as ex, pytest.raises(TypeError) as ei:  # no worker starts before a submit
        check_picklable(source, "source", ex)
    msg = str(ei.value)
    assert msg.startswith("executor= sends the source to worker processes, but source['open'] (function) cannot be "
                          "pickled ("), msg
    assert msg.endswith("). Keep only paths, URLs and plain values in the source and open files, connections or "
                        "handles lazily inside __getitem__ (or write with num_workers= on one machine, which forks "
                        "and needs no pickling)"), msg
    check_picklable(source, "source", FakeDask())  # cloudpickle pickles a lambda


def test_a_bad_sample_in_a_worker_range_carries_its_cause_and_traceback():
    """A worker's range returns the first bad sample as (index, field, detail, traceback text, source) instead of
    raising (its exception would lose its chain on the way back): the traceback is the cause's."""
    from pageset.format.schema import build_schema, parse_schema
    from pageset.write.ranges import encode_range
    from pageset.write.sources import open_source

    src, fields = open_source(RaisesAt(8, 5), {"y": Int()})
    _, row_dtype = parse_schema(build_schema(fields, {}, {"page_size": 4096, "checksum": "crc32"}))
    part = encode_range(src, fields, row_dtype, 2, 8, "raise")
    index, field, detail, tb, source = part.error
    assert (index, field) == (5, None)
    assert detail == "reading the sample raised RuntimeError: corrupt record 5 in upstream store"
    assert tb.startswith("Traceback (most recent call last):\n"), tb
    assert tb.rstrip().endswith("RuntimeError: corrupt record 5 in upstream store"), tb
    assert "raise RuntimeError(f\"corrupt record {i} in upstream store\")" in tb, tb
    assert part.rows["y"].tolist() == [2, 3, 4] and part.skipped == []
    with pytest.raises(SampleError) as ei:
        encode_range(src, fields, row_dtype, 2, 8, "raise", in_process=True)
    assert ei.value.index == 5


@pytest.mark.parametrize("members", [None, 4])
def test_no_more_worker_processes_than_work(tmp_path, monkeypatch, members):
    """num_workers=64 for 10 samples: one range of chunk_size 16 (or 3 members of 4) gets 1 (or 3) processes, not
    64 forked up front; the file is the one num_workers=0 writes."""
    from pageset.write import pool

    pools = []

    class Recording(pool.ProcessPoolExecutor):
        def __init__(self, max_workers=None, **kw):
            pools.append(max_workers)
            super().__init__(max_workers, **kw)

    monkeypatch.setattr(pool, "ProcessPoolExecutor", Recording)
    src = [(i * 7,) for i in range(10)]
    kw = dict(chunk_size=16, progress=False, lineage=False, records_per_member=members)
    write_dataset(tmp_path / "w.pageset", src, {"y": Int()}, num_workers=64, **kw)
    write_dataset(tmp_path / "z.pageset", src, {"y": Int()}, num_workers=0, **kw)
    assert pools == [1 if members is None else 3]
    if members is None:
        assert (tmp_path / "w.pageset").read_bytes() == (tmp_path / "z.pageset").read_bytes()
    with open_dataset(tmp_path / "w.pageset") as ds:
        assert [ds[i]["y"] for i in range(10)] == [i * 7 for i in range(10)]
