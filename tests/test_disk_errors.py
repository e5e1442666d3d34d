"""A full disk (or any write error) while writing: an OSError with the same errno that names the file written,
its folder and free space, the bytes written so far and the fix; the temp files go, the previous output stays.

Two ways: a real 1 MiB tmpfs (root only, as in CI), and ENOSPC injected where every writer opens the files it
writes (``write/disk.py _open_raw``), which needs no root and reaches every path: write_dataset (in process, forked
workers, an executor's shards), write_tokens (direct, spill file), merge_datasets, an importer, a URL's local copy.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pageset import Int, import_nanogpt, merge_datasets, write_dataset, write_tokens

KW = {"progress": False, "lineage": False}


def _tokens(n):
    return [np.arange(1, n, dtype=np.uint32) % 60_000 + 1]


def _check_message(exc: OSError, file_prefix: str, folder: str, choose: str):
    """The error says where: errno kept, the file (a temp name starting with ``file_prefix``), the folder and its
    free space, the bytes written so far, and the fix."""
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    assert isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ENOSPC
    msg = str(exc)
    assert msg.startswith("[Errno 28] No space left on device: writing ")
    assert f", at {file_prefix}" in msg, msg
    assert f"(folder {folder}: " in msg and " bytes free of " in msg, msg
    written = re.search(r"failed after ([\d,]+) bytes written", msg)
    assert written, msg
    assert f"free space in {folder} (or raise the quota there), or choose {choose} on a disk with room" in msg, msg
    return int(written.group(1).replace(",", ""))


class _Quota:
    """A file that takes ``room`` bytes, then fails like a full disk: the write that does not fit raises ENOSPC,
    and so does closing afterwards (a buffered file still holding bytes fails its final flush again)."""

    def __init__(self, f, room: int):
        self.f, self.room, self.full = f, room, False

    def write(self, data):
        n = memoryview(data).nbytes
        if n > self.room:
            self.full = True
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return self.f.write(data)

    def close(self):
        self.f.close()
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.fixture
def full_disk(monkeypatch):
    """``full_disk(pattern, room)``: files whose name contains ``pattern`` take ``room`` bytes, then ENOSPC."""
    import pageset.write.disk as fw

    real = fw._open_raw

    def arm(pattern: str, room: int):
        def opened(target, mode, name):
            f = real(target, mode, name)
            return _Quota(f, room) if pattern in name else f
        monkeypatch.setattr(fw, "_open_raw", opened)
    return arm


def _leftovers(folder, keep):
    return sorted(set(os.listdir(folder)) - set(keep))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_write_dataset_disk_full_names_the_temp_file_and_keeps_the_previous_output(tmp_path, full_disk,
                                                                                   num_workers):
    out = tmp_path / "d.pageset"
    write_dataset(out, [(1,)], {"y": Int()}, num_workers=0, **KW)
    before = out.read_bytes()
    full_disk(".tmp-", 200_000)
    with pytest.raises(OSError) as ei:
        write_dataset(out, [(i,) for i in range(60_000)], {"y": Int()}, num_workers=num_workers,
                      page_size=1 << 12, **KW)
    written = _check_message(ei.value, f"{out}.tmp-", str(tmp_path), "another output path")
    assert 0 < written <= 200_000 + 4096  # what the file took (the 4 KiB header page is a hole until the end)
    assert re.search(r"bytes written \(writing [\d,]+ more\), at", str(ei.value))  # the failed write's error
    assert out.read_bytes() == before and _leftovers(tmp_path, ["d.pageset"]) == []


def test_executor_shards_on_a_full_shard_dir_name_the_shard_and_shard_dir(tmp_path, full_disk):
    shards = tmp_path / "shards"
    shards.mkdir()
    out = tmp_path / "d.pageset"
    full_disk(".shard.tmp-", 1000)
    with ThreadPoolExecutor(2) as ex, pytest.raises(OSError) as ei:
        write_dataset(out, [(i,) for i in range(5000)], {"y": Int()}, executor=ex, shard_dir=str(shards),
                      chunk_size=1000, **KW)
    msg = str(ei.value)
    assert re.search(rf"writing a shard \(on worker host [^)]+\) failed after \d[\d,]* bytes written \(writing "
                     rf"[\d,]+ more\), at {re.escape(str(shards))}/d\.pageset\.shards-", msg), msg
    folder = re.search(r"\(folder (\S+): ", msg).group(1)
    _check_message(ei.value, f"{shards}/d.pageset.shards-", folder, "another shard_dir (a folder every worker "
                   "can write)")
    assert os.listdir(shards) == [] and _leftovers(tmp_path, ["shards"]) == []


def test_token_writers_merge_and_importers_name_their_files(tmp_path, full_disk):
    docs = _tokens(100_000)
    a, b = tmp_path / "a.pageset", tmp_path / "b.pageset"
    write_tokens(a, docs, None, eos_id=0, num_workers=0, **KW)
    write_tokens(b, docs, None, eos_id=0, num_workers=0, **KW)
    nano = tmp_path / "train.bin"
    np.concatenate([docs[0].astype(np.uint16), [50256]]).astype("<u2").tofile(nano)
    keep = sorted(os.listdir(tmp_path))
    out = tmp_path / "out.pageset"
    write_tokens(out, [np.arange(5)], None, eos_id=0, num_workers=0, **KW)
    before, keep = out.read_bytes(), keep + ["out.pageset"]
    full_disk(".tmp-", 100_000)
    cases = {
        "write_tokens direct": lambda: write_tokens(out, docs, None, eos_id=0, dtype="uint32", num_workers=0, **KW),
        "merge_datasets": lambda: merge_datasets(out, [a, b], **KW),
        "import_nanogpt": lambda: import_nanogpt(out, nano),
    }
    for what, call in cases.items():
        with pytest.raises(OSError) as ei:
            call()
        _check_message(ei.value, f"{out}.tmp-", str(tmp_path), "another output path")
        assert f"writing the output {out} (its temp file) failed" in str(ei.value), what
        assert out.read_bytes() == before and _leftovers(tmp_path, keep) == [], what
    full_disk(".spill-", 100_000)  # no dtype known before the end: ids are staged in a spill file next to the output
    with pytest.raises(OSError) as ei:
        write_tokens(out, docs, None, eos_id=0, num_workers=0, **KW)
    assert f"writing the spill file of the output {out} (token ids kept until the largest is known)" in str(ei.value)
    _check_message(ei.value, f"{out}.spill-", str(tmp_path), "another output path")
    assert out.read_bytes() == before and _leftovers(tmp_path, keep) == []


def test_a_url_output_whose_local_copy_hits_a_full_tmpdir(tmp_path, full_disk, monkeypatch):
    """Stores without multipart streaming (here memory://) get the file assembled in TMPDIR first."""
    import tempfile

    import fsspec

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    full_disk("pageset-upload-", 50_000)
    with pytest.raises(OSError) as ei:
        write_dataset("memory://disk-full/a.pageset", [(i,) for i in range(20_000)], {"y": Int()}, num_workers=0,
                      **KW)
    assert "writing the local copy of memory://disk-full/a.pageset (uploaded at the end) failed" in str(ei.value)
    _check_message(ei.value, f"{tmp_path}/pageset-upload-", str(tmp_path), "another temp folder (TMPDIR)")
    assert os.listdir(tmp_path) == [] and not fsspec.filesystem("memory").exists("/disk-full/a.pageset")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs at ``tmp_path / "small"`` (root only; unmounted at the end)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    small = tmp_path / "small"
    small.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], capture_output=True,
                         text=True, timeout=60)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield small
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True, timeout=60)


def test_a_real_full_disk_tmpfs(tmp_path, small_tmpfs):
    out = small_tmpfs / "t.pageset"
    write_tokens(out, [np.arange(1, 1000)], None, eos_id=0, num_workers=0, **KW)
    before = out.read_bytes()
    with pytest.raises(OSError) as ei:  # 1.6 MB of uint32 ids: more than the disk holds
        write_tokens(out, _tokens(400_000), None, eos_id=0, dtype="uint32", num_workers=0, **KW)
    written = _check_message(ei.value, f"{out}.tmp-", str(small_tmpfs), "another output path")
    assert 900_000 < written <= 1 << 20  # the disk filled up: about its size, less the previous output's bytes
    assert out.read_bytes() == before and os.listdir(small_tmpfs) == ["t.pageset"]
    with pytest.raises(OSError) as ei:  # small writes (4 KiB pages) through the file's buffer
        write_dataset(small_tmpfs / "d.pageset", [(i,) for i in range(150_000)], {"y": Int()}, num_workers=0,
                      page_size=1 << 12, **KW)
    _check_message(ei.value, f"{small_tmpfs}/d.pageset.tmp-", str(small_tmpfs), "another output path")
    assert os.listdir(small_tmpfs) == ["t.pageset"]
    shards = small_tmpfs / "shards"
    shards.mkdir()
    with ThreadPoolExecutor(2) as ex, pytest.raises(OSError) as ei:
        write_dataset(tmp_path / "d.pageset", [(i,) for i in range(150_000)], {"y": Int()}, executor=ex,
                      shard_dir=str(shards), chunk_size=50_000, **KW)
    assert ei.value.errno == errno.ENOSPC and "writing a shard (on worker host" in str(ei.value)
    assert f", at {shards}/d.pageset.shards-" in str(ei.value) and "another shard_dir" in str(ei.value)
    assert os.listdir(shards) == [] and not (tmp_path / "d.pageset").exists()
