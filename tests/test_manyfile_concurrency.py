"""Several processes on one many-file set (issue 28, item 1; formats/manyfile.md section 9): `pageset clean`
beside a running write, two appends at once, a rewrite while a Loader (or a dataset) reads the old set, and what
an object store (no locks) does instead. Writers and readers are real processes (subprocess); they meet at lines
they print and read, never at a sleep. Every result is checked against the rows the test itself generates."""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from pageset import Int, Loader, NDArray, open_dataset, write_dataset
from pageset.cli import main as cli

TESTS = str(Path(__file__).resolve().parent)
KW = {"progress": False, "lineage": False, "page_size": 1 << 12}
FIELDS = {"label": Int(), "vec": NDArray("uint8", (64,))}
HANG = 300  # seconds a test waits for a line before calling the other process hung (a guard, not a measure)


class Rows:
    """``n`` rows ``(seed * 1000 + i, 64 bytes drawn from seed and i)``: every set's expected content."""

    def __init__(self, n, seed=0):
        self.n, self.seed = n, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        rng = np.random.default_rng([self.seed, i])
        return (self.seed * 1000 + i, rng.integers(0, 255, 64, dtype=np.uint8))


def expected(*parts: Rows) -> list[tuple[int, bytes]]:
    return [(label, vec.tobytes()) for p in parts for label, vec in (p[i] for i in range(len(p)))]


def content(folder) -> list[tuple[int, bytes]]:
    with open_dataset(folder) as ds:
        return [(int(r["label"]), r["vec"].tobytes()) for r in ds]


def members(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".pageset"))


WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_manyfile_concurrency import FIELDS, KW, Rows
    from pageset import write_dataset

    class Pauses(Rows):  # prints "paused" when it reaches row pause_at, then waits for "go" on stdin (once)
        paused = False

        def __getitem__(self, i):
            if i == {pause_at} and not self.paused:
                self.paused = True
                print("paused", flush=True)
                if sys.stdin.readline().strip() != "go":
                    raise SystemExit("no go")
            return super().__getitem__(i)

    # chunk_size=2: a member is encoded two rows at a time, so a pause mid-member leaves its temp file open
    write_dataset({folder!r}, Pauses({n}, seed={seed}), FIELDS, records_per_member=5, chunk_size=2, num_workers=0,
                  append={append}, **KW)
    print("done", flush=True)
""")

READER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_manyfile_concurrency import Rows, expected
    from pageset import Loader, open_dataset

    want = expected(Rows({n}))
    got = []
    if {kind!r} == "loader":
        with Loader({folder!r}, batch_size=5, order="sequential", num_threads=1, array_type="numpy",
                    drop_last=False) as loader:
            it = iter(loader)
            for _ in range(2):
                b = next(it)
                got += [(int(x), v.tobytes()) for x, v in zip(b["label"], b["vec"])]
            print("reading", flush=True)
            if sys.stdin.readline().strip() != "go":
                raise SystemExit("no go")
            for b in it:
                got += [(int(x), v.tobytes()) for x, v in zip(b["label"], b["vec"])]
    else:
        with open_dataset({folder!r}) as ds:
            got.append((int(ds[0]["label"]), ds[0]["vec"].tobytes()))
            print("reading", flush=True)
            if sys.stdin.readline().strip() != "go":
                raise SystemExit("no go")
            got += [(int(ds[i]["label"]), ds[i]["vec"].tobytes()) for i in range(1, len(ds))]
    assert got == want, "the old set read wrong"
    print(f"read {{len(got)}}", flush=True)
""")


def _start(template: str, stdin=subprocess.PIPE, **fmt) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    code = template.format(tests=TESTS, **fmt)
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _line(stream) -> str:
    """The next line of ``stream`` ('' at its end); AssertionError when none comes within HANG seconds."""
    q: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: q.put(stream.readline()), daemon=True).start()
    try:
        return q.get(timeout=HANG)
    except queue.Empty:
        raise AssertionError("the other process printed nothing: hung") from None


def _finish(proc: subprocess.Popen, send: str | None = None) -> tuple[str, str]:
    out, err = proc.communicate(send, timeout=HANG)
    assert proc.returncode == 0, f"exit {proc.returncode}: {err[-3000:]}"
    return out, err


def _kill(*procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def test_the_spec_names_the_files_the_code_makes():
    """formats/manyfile.md section 9's table of the files of several processes: the names the code uses."""
    from pageset.format import locks
    from pageset.format.manifest import MANIFEST_NAME

    spec = (Path(TESTS).parent / "formats" / "manyfile.md").read_text()
    table = re.search(r"<!-- table: set_files -->\n((?:\|.*\n)+)", spec).group(1).splitlines()[2:]
    names = [row.split("|")[1].strip().strip("`") for row in table]
    assert names == [locks.LOCK_NAME, MANIFEST_NAME, MANIFEST_NAME + locks.RETIRED_MARK + "<generation>"]
    assert locks.retired_name(MANIFEST_NAME, 7) == "pageset.manifest.json.retired-0007"  # "G zero-padded to 4"


# ---- (a) pageset clean beside a running write ----------------------------------------------------------------

def test_clean_leaves_a_running_many_file_write_alone(tmp_path, capsys):
    """`pageset clean FOLDER` while a write of that set runs in another process (paused in its third member,
    two members finished, the third one's temp file open) removes nothing and names the writer; the write then
    finishes and the set holds every row. (Before: clean removed the finished members and the temp file, and
    the write died.)"""
    folder = tmp_path / "s"
    writer = _start(WRITER, folder=str(folder), pause_at=13, n=20, seed=0, append=False)
    try:
        assert _line(writer.stdout) == "paused\n", writer.stderr.read()
        before = sorted(os.listdir(folder))
        assert {"m0001-000000.pageset", "m0001-000001.pageset"} <= set(before)
        assert any(n.startswith("m0001-000002.pageset.tmp-") for n in before), before
        assert cli(["clean", str(folder)]) == 0
        out = capsys.readouterr().out
        assert sorted(os.listdir(folder)) == before  # nothing of the running write removed
        assert re.search(rf"a write to this set is running \(pid {writer.pid} on host {re.escape(socket.gethostname())}"
                         r", since .*\): nothing removed", out), out
        _finish(writer, "go\n")
    finally:
        _kill(writer)
    assert content(folder) == expected(Rows(20))
    assert sorted(os.listdir(folder)) == [f"m0001-00000{k}.pageset" for k in range(4)] + ["pageset.manifest.json"]


# ---- (b) two appends at once -----------------------------------------------------------------------------------

def test_two_appends_at_once_run_one_after_the_other(tmp_path):
    """Two processes append to one set at once: the second one waits for the first (saying so on stderr, naming
    its pid and host), then appends after it; both succeed and the set holds the old rows, then the first
    append's, then the second's. (Before: each removed the other's members; both failed or the set listed
    members of the other.)"""
    folder = tmp_path / "s"
    write_dataset(folder, Rows(10), FIELDS, records_per_member=5, num_workers=0, **KW)
    first = _start(WRITER, folder=str(folder), pause_at=7, n=10, seed=1, append=True)
    second = None
    try:
        assert _line(first.stdout) == "paused\n", first.stderr.read()  # its member m0002-000000 is written
        second = _start(WRITER, stdin=subprocess.DEVNULL, folder=str(folder), pause_at=-1, n=10, seed=2,
                        append=True)
        notice = ""
        while "waiting" not in notice:  # its stderr, up to the notice or its end
            line = _line(second.stderr)
            if not line:
                break
            notice = line
        assert re.search(rf"waiting for another write to this set to finish \(pid {first.pid} on host "
                         rf"{re.escape(socket.gethostname())}, since .*: write_dataset", notice), notice
        _finish(first, "go\n")
        _finish(second)
    finally:
        _kill(first, *([second] if second else []))
    assert content(folder) == expected(Rows(10), Rows(10, seed=1), Rows(10, seed=2))
    manifest = json.loads((folder / "pageset.manifest.json").read_text())
    assert manifest["generation"] == 3 and manifest["appended_to"]["generation"] == 2
    assert members(folder) == [f"m000{g}-00000{k}.pageset" for g in (1, 2, 3) for k in (0, 1)]
    assert "pageset.lock" not in os.listdir(folder)  # the last writer removed it


# ---- (c) a rewrite while the old set is read --------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["loader", "open_dataset"])
def test_rewrite_keeps_the_old_members_for_a_reader_of_the_old_set(tmp_path, capsys, kind):
    """A Loader (or open_dataset) in another process reads a 40-member set; the set is rewritten meanwhile. The
    reader reads the old set to its end, as a single file rewritten the same way is; the old members stay until
    it is done ('pageset clean' keeps them while it reads), then the next clean removes them. (Before: the rewrite
    removed the old members and the reader died with "the set is incomplete".)"""
    folder = tmp_path / "s"
    write_dataset(folder, Rows(200), FIELDS, records_per_member=5, num_workers=0, **KW)
    old = members(folder)
    assert len(old) == 40
    reader = _start(READER, folder=str(folder), n=200, kind=kind)
    try:
        assert _line(reader.stdout) == "reading\n", reader.stderr.read()
        new = write_dataset(folder, Rows(12, seed=5), FIELDS, records_per_member=5, num_workers=0, **KW)
        assert set(old) <= set(members(folder))  # kept for the reader
        assert content(folder) == expected(Rows(12, seed=5))  # a new reader reads the new set
        assert cli(["clean", str(folder)]) == 0
        assert set(old) <= set(members(folder))
        assert "generation 1 (40 members) kept: a reader still has it open" in capsys.readouterr().out
        out, _ = _finish(reader, "go\n")
        assert "read 200" in out
    finally:
        _kill(reader)
    assert cli(["clean", str(folder)]) == 0
    assert "40 stray members and temp files removed" in capsys.readouterr().out
    assert sorted(os.listdir(folder)) == sorted(new.members) + ["pageset.manifest.json"]


def test_a_loader_in_this_process_holds_the_old_set_against_a_writer_process(tmp_path):
    """The same with the roles swapped: a Loader in this process's threads, the rewrite in another process; the
    next write after the Loader closed removes the old members."""
    folder = tmp_path / "s"
    write_dataset(folder, Rows(100), FIELDS, records_per_member=5, num_workers=0, **KW)
    got = []
    with Loader(folder, batch_size=5, order="sequential", num_threads=2, array_type="numpy", drop_last=False) as ld:
        it = iter(ld)
        b = next(it)
        got += [(int(x), v.tobytes()) for x, v in zip(b["label"], b["vec"])]
        writer = _start(WRITER, stdin=subprocess.DEVNULL, folder=str(folder), pause_at=-1, n=7, seed=3,
                        append=False)
        try:
            _finish(writer)
        finally:
            _kill(writer)
        for b in it:
            got += [(int(x), v.tobytes()) for x, v in zip(b["label"], b["vec"])]
    assert got == expected(Rows(100))
    assert len(members(folder)) == 20 + 2
    write_dataset(folder, Rows(3, seed=4), FIELDS, records_per_member=5, num_workers=0, append=True, **KW)
    assert members(folder) == ["m0002-000000.pageset", "m0002-000001.pageset", "m0003-000000.pageset"]
    assert content(folder) == expected(Rows(7, seed=3), Rows(3, seed=4))


# ---- where no lock can be taken: object stores, file systems without flock ------------------------------------

def test_rewrite_on_s3_is_named_as_a_replaced_set(moto_s3):  # noqa: F811
    """An object store has no locks: a rewrite removes the old members once its manifest is in. A reader of the
    old set then gets an error saying the set was replaced (both generations), not that it is incomplete."""
    url = "s3://pageset-test/sets/replaced"
    write_dataset(url, Rows(20), FIELDS, records_per_member=5, num_workers=0, storage_options=moto_s3, **KW)
    with open_dataset(url, storage_options=moto_s3) as ds:
        assert int(ds[0]["label"]) == 0
        write_dataset(url, Rows(7, seed=3), FIELDS, records_per_member=5, num_workers=0, storage_options=moto_s3,
                      **KW)
        with pytest.raises(FileNotFoundError, match=r"m0001-000002\.pageset: missing: the set s3://pageset-test/sets/"
                                                    r"replaced was replaced while it was read \(generation 1, now "
                                                    r"generation 2\): open it again to read the new set"):
            ds[12]


def test_without_flock_clean_falls_back_to_the_single_files_live_writer_check(tmp_path, monkeypatch, capsys):
    """Where the file system refuses locks, the lock file still names its writer: `pageset clean` leaves the set
    alone while that process lives on this host (the check the single file's temp files get), and cleans once it
    is gone; a rewrite then removes the old members at once and a reader of the old set is told it was
    replaced."""
    from pageset.format import locks

    monkeypatch.setattr(locks, "flock", lambda fd, op: None)  # "not supported here"
    folder = tmp_path / "s"
    write_dataset(folder, Rows(12), FIELDS, records_per_member=5, num_workers=0, **KW)
    stray = folder / "m0002-000000.pageset"
    stray.write_bytes(b"left by a write")
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        (folder / "pageset.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": live.pid,
                                                         "started": "2026-01-01T00:00:00Z", "call": "a test"}))
        assert cli(["clean", str(folder)]) == 0
        assert stray.exists() and f"(pid {live.pid} on host" in capsys.readouterr().out
    finally:
        live.communicate(b"")
    assert cli(["clean", str(folder)]) == 0  # its writer is gone: the lock is stale
    assert not stray.exists() and sorted(os.listdir(folder)) == members(folder) + ["pageset.manifest.json"]
    with open_dataset(folder) as ds:
        assert int(ds[0]["label"]) == 0
        write_dataset(folder, Rows(3, seed=1), FIELDS, records_per_member=5, num_workers=0, **KW)
        with pytest.raises(FileNotFoundError, match=r"was replaced while it was read \(generation 1, now generation "
                                                    r"2\)"):
            ds[7]


from test_object_store import moto_s3  # noqa: E402,F401  (the S3 server fixture, shared)
