"""What every pageset writer shares: the ordered worker pool, lineage, and the file's tail (sections, section
table, header) written after the pages, so that the header, which makes the file valid, is written last."""

from __future__ import annotations

import collections
import datetime
import errno
import glob
import multiprocessing
import os
import platform
import shutil
import socket
import sys
import tempfile
from concurrent import futures
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from ..format import constants as C
from ..format.checksum import crc32
from ..format.layout import HEADER, SECTION_ENTRY
from ..format.processes import die_with_parent
from ..format.store_errors import one_try_options

WAIT_ON_FAILURE_S = 600.0  # after a failure, how long to wait for running tasks before deleting their shards


def executor_map(executor: futures.Executor, fn, tasks, ahead: int):
    """Yield ``fn(*task)`` results in task order, keeping at most ``ahead`` tasks submitted and not yet consumed.

    On an exception (here or in a task) or an early exit: tasks not started are cancelled and those running are
    waited for (up to ``WAIT_ON_FAILURE_S``), so no task writes a shard after the caller removed the folder.
    """
    pending: collections.deque = collections.deque()
    tasks = iter(tasks)
    try:
        while True:
            while len(pending) < ahead:
                task = next(tasks, None)
                if task is None:
                    break
                pending.append(executor.submit(fn, *task))
            if not pending:
                return
            yield pending.popleft().result()
    finally:
        if pending:
            for fut in pending:
                fut.cancel()
            futures.wait(pending, timeout=WAIT_ON_FAILURE_S)


def _start_worker(parent_pid: int, initializer, initargs) -> None:
    die_with_parent(parent_pid, exit_code=1)
    if initializer is not None:
        initializer(*initargs)


# Worker processes of one write at most: each holds a process, its pipes and a copy of the encoder's state; the
# pool forks them all at once, so a typo (num_workers=99999) would fork until the machine runs out of processes.
MAX_WORKERS = 1024


def ordered_map(fn, tasks, num_workers: int, initializer, initargs, ahead: int, died: str):
    """Yield ``fn(*task)`` for each task of the iterable ``tasks``, in task order, from ``num_workers`` forked
    worker processes (spawned where fork is unavailable) running at most ``ahead`` tasks ahead.

    A dead worker (SIGKILL, out of memory, segfault) raises ``RuntimeError(died)`` at once instead of hanging;
    leaving the generator early (an exception in the caller) cancels queued tasks and joins the workers; a
    worker whose parent is killed (even by SIGKILL) is killed too (Linux, see
    :func:`~pageset.format.processes.die_with_parent`).
    Callers that know how many tasks there are start no more workers than that (a worker without a task only
    costs its start: the pool forks every worker up front).
    """
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    pool = ProcessPoolExecutor(num_workers, mp_context=ctx, initializer=_start_worker,
                               initargs=(os.getpid(), initializer, initargs))
    try:
        yield from executor_map(pool, fn, tasks, ahead)
    except BrokenProcessPool as exc:
        raise RuntimeError(died) from exc
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def lineage() -> dict:
    """Where and when a file was written (stored in the metadata section, outside the dataset id)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        pkg = version("pageset")
    except PackageNotFoundError:
        pkg = "unknown"
    return {
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "pageset_version": pkg,
        "python": platform.python_version(),
        "platform": sys.platform,
    }


def align(x: int, a: int) -> int:
    """``x`` rounded up to a multiple of ``a``."""
    return -(-x // a) * a


def write_tail(f, *, page_size: int, data_length: int, page_count: int, record_count: int,
               required_features: int, dataset_id: bytes, sections: list) -> int:
    """Write ``sections`` (``[(kind, flags, payload bytes), ...]``) after the data area, then the section table,
    then the header at offset 0; returns the file size. ``f`` is the temp file opened for writing."""
    pos = C.DATA_OFFSET + data_length
    table = np.zeros(len(sections), dtype=SECTION_ENTRY)
    for k, (kind, flags, payload) in enumerate(sections):
        pos = align(pos, C.SECTION_ALIGN)
        f.seek(pos)
        f.write(payload)
        table[k] = (kind, flags, pos, len(payload), crc32(payload), 0)
        pos += len(payload)
    table_offset = align(pos, C.SECTION_ALIGN)
    f.seek(table_offset)
    f.write(table.tobytes())
    file_size = table_offset + table.nbytes
    f.truncate(file_size)

    header = np.zeros((), dtype=HEADER)
    header["magic"] = np.frombuffer(C.MAGIC, dtype=np.uint8)
    header["major"], header["minor"], header["header_size"] = C.FORMAT_MAJOR, C.FORMAT_MINOR, C.HEADER_SIZE
    header["page_size"] = page_size
    header["required_features"] = required_features
    header["optional_features"] = C.OPTIONAL_PAGE_CHECKSUMS
    header["record_count"] = record_count
    header["data_offset"], header["data_length"] = C.DATA_OFFSET, data_length
    header["page_count"] = page_count
    header["section_table_offset"], header["section_count"] = table_offset, len(sections)
    header["file_size"] = file_size
    header["dataset_id"] = np.frombuffer(dataset_id, dtype=np.uint8)
    header["section_table_crc"] = crc32(table.tobytes())
    raw = bytearray(header.tobytes())
    raw[-4:] = crc32(bytes(raw[:-4])).to_bytes(4, "little")
    f.seek(0)
    f.write(raw)
    return file_size


# ---- files written to disk: errors that say where --------------------------------------------------------

def disk_error(exc: OSError, name: str, written: int, what: str, choose: str, pending: int = 0) -> OSError:
    """``exc``, an OSError of writing the file ``name`` (``what`` it is, e.g. "the temp file of the output
    x.pageset") after ``written`` bytes (while writing ``pending`` more, where known), as an OSError of the same
    errno (and subclass) whose message names the file, its folder and the space free there, the bytes written so
    far, and the fix: free space or ``choose`` another folder (e.g. "another output path"). The caller raises it
    ``from exc``. An error made here already is returned as is."""
    if getattr(exc, "pageset_where", False) or not isinstance(exc, OSError):
        return exc
    folder = os.path.dirname(os.path.abspath(name))
    try:
        du = shutil.disk_usage(folder)
        space = f"{du.free:,} bytes free of {du.total:,}"
    except OSError:
        space = "free space unknown"
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free space in {folder} (or raise the quota there), or choose {choose} on a disk with room"
    elif exc.errno == errno.EFBIG:
        fix = f"the file system or the process (ulimit -f) limits file sizes: choose {choose} without that limit"
    else:
        fix = f"check that {folder} is writable and its disk healthy, or choose {choose}"
    more = f" (writing {pending:,} more)" if pending else ""
    err = OSError(exc.errno, f"{reason}: writing {what} failed after {written:,} bytes written{more}, at {name} "
                             f"(folder {folder}: {space}); {fix}")
    err.pageset_where = True
    return err


def _open_raw(target, mode: str, name: str):
    """``open(target, mode)`` for a path or fd: the one place written files are opened (tests inject disk errors
    here)."""
    return open(target, mode)


class DiskFile:
    """A binary file open for writing (and reading back) at ``name``, whose OSErrors say where
    (:func:`disk_error`: ``what`` the file is, the folder and free space, the bytes written so far, and the fix:
    free space or ``choose`` another folder). ``written`` counts the bytes written."""

    def __init__(self, target, mode: str, name: str, what: str, choose: str):
        self.name, self.what, self.choose, self.written = name, what, choose, 0
        self.f = _open_raw(target, mode, name)

    def _error(self, exc: OSError, pending: int = 0) -> OSError:
        written = self.written
        try:  # what reached the file (a failed write may have written part of its bytes)
            written = max(written, os.fstat(self.f.fileno()).st_size)
        except (OSError, ValueError):
            pass
        return disk_error(exc, self.name, written, self.what, self.choose, pending)

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as exc:
            raise self._error(exc, memoryview(data).nbytes) from exc
        self.written += n
        return n

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except OSError as exc:
            raise self._error(exc) from exc

    def seek(self, pos: int, whence: int = 0) -> int:
        return self._call(self.f.seek, pos, whence)

    def tell(self) -> int:
        return self.f.tell()

    def truncate(self, size: int | None = None) -> int:
        return self._call(self.f.truncate, size)

    def read(self, n: int = -1) -> bytes:
        return self._call(self.f.read, n)

    def flush(self) -> None:
        self._call(self.f.flush)

    def fsync(self) -> None:
        """Flush and ``os.fsync``: the bytes are on the disk (or the error says where they are not)."""
        self._call(self.f.flush)
        self._call(os.fsync, self.f.fileno())

    def fileno(self) -> int:
        return self.f.fileno()

    @property
    def closed(self) -> bool:
        return self.f.closed

    def close(self) -> None:
        self._call(self.f.close)

    def discard(self) -> None:
        """Close without raising: the file is being removed (closing flushes, which fails again on a full disk)."""
        try:
            self.f.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        else:
            self.discard()


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (``/proc/self/status``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: the only portable way to read it is to set it back at once
    os.umask(mask)
    return mask


def _tag() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def temp_file(path: str, kind: str = "tmp") -> tuple[int, str]:
    """Create ``<path>.<kind>-<host>-<pid>-<random>`` next to ``path``: (fd, name), readable per the umask.

    The host and pid in the name let a later write remove temp files of writers that were killed (SIGKILL, node
    loss) before they could clean up (:func:`remove_stale_temps`).
    """
    folder = os.path.dirname(os.path.abspath(check_output_path(path)))
    fd, name = tempfile.mkstemp(prefix=f"{os.path.basename(path)}.{kind}-{_tag()}-", dir=folder)
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would make shared datasets unreadable to other users
    return fd, name


def writer_alive(host: str, pid: int) -> bool | None:
    """Whether the writer process ``pid`` on ``host`` may still run: on this host True (a process with that pid
    exists, this user's or another's: it may be a reused pid) or False (none); None for another host (its
    processes cannot be seen from here). The live-writer check of the temp files a write leaves
    (:func:`remove_stale_temps`) and of a many-file set's lock where the file system has no locks
    (``write/setlock.py``)."""
    if host != socket.gethostname():
        return None
    if pid <= 0:  # 0 and negative pids name process groups, not a writer
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):  # not a pid at all
        return False
    return True


def remove_stale_temps(path: str, every_host: bool = False) -> list[str]:
    """Delete what writes of ``path`` left behind when killed: temp files (``<path>.tmp-*``, ``.spill-*``) and
    shard folders (``<path>.shards-*``) of dead writer processes on this host, and with ``every_host=True`` those
    of writers on any host (their liveness cannot be checked from here). Returns the names removed."""
    import shutil

    host = socket.gethostname()
    removed = []
    for kind in ("tmp", "spill", "shards"):
        prefix = os.path.abspath(path) + f".{kind}-"
        pattern = glob.escape(prefix) + ("*-*-*" if every_host else f"{glob.escape(host)}-*-*")
        for name in glob.glob(pattern):
            try:
                writer_host, pid, _ = name[len(prefix):].rsplit("-", 2)
                pid = int(pid)
            except ValueError:
                continue
            if writer_host == host and writer_alive(writer_host, pid):
                continue  # that writer is alive (or the pid was reused): leave it
            try:
                if os.path.isdir(name):
                    shutil.rmtree(name)
                else:
                    os.unlink(name)
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def check_output_path(path) -> str:
    """``path`` (str or os.PathLike) as a str, if its folder exists (fsspec URLs other than ``file://`` pass
    unchecked); TypeError / FileNotFoundError otherwise.

    Called first by every writer, so that a missing folder is reported as such before any work (and not as a
    missing temp file once the work is done)."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be the output file's path (str or os.PathLike), got {path!r} "
                        f"({type(path).__name__})")
    path = os.fspath(path)
    if not path or path.endswith(os.sep):
        raise ValueError(f"path must name a file, got {path!r}")
    if is_url(path):
        if path.lower().startswith(("http://", "https://")):
            raise ValueError(f"cannot write {path}: http(s) URLs are read-only; write to a local path or an object "
                             "store URL (s3://, gs://, az://, ...), then serve that file over HTTP if you like")
        return path  # an object store: no folder to check
    local = local_path(path)
    folder = os.path.dirname(os.path.abspath(local))
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise FileNotFoundError(f"cannot write {path}: the output folder {folder} {what}; create it first "
                                f"(e.g. os.makedirs({folder!r}, exist_ok=True))")
    if os.path.isdir(local):
        raise IsADirectoryError(f"cannot write {path}: it is a folder; give a file name, e.g. "
                                f"{os.path.join(local, 'train.pageset')}")
    return path


def check_replaceable(path: str, call: str, storage_options: dict | None = None, policy=None,
                      inputs=()) -> None:
    """ValueError when the output ``path`` exists, is not empty and is not a pageset file.

    Every writer replaces its output whole; a call with the output and the source swapped (``call`` shows the
    right order, e.g. ``"write_tokens(path, source, tokenizer)"``) would otherwise replace the user's source
    file (a corpus, a photo, a file list) with a pageset file. Empty files pass. A URL's first bytes are read
    through fsspec (``storage_options``; every request bounded by ``policy``, a
    :class:`~pageset.write.upload.WritePolicy`), and the URL must not be one of the URL ``inputs``; see
    :func:`~pageset.write.upload.check_url_output` for the errors about buckets, credentials and timeouts."""
    if is_url(path):
        from .upload import check_url_output

        check_url_output(path, storage_options, call, policy, [os.fspath(p) for p in inputs
                                                              if isinstance(p, (str, os.PathLike))])
        return
    local = local_path(path)
    if not os.path.isfile(local) or os.path.getsize(local) == 0:
        return
    with open(local, "rb") as f:
        if f.read(len(C.MAGIC)) == C.MAGIC:
            return
    raise ValueError(f"the output {path} exists and is not a pageset file: refusing to replace it (are the "
                     f"arguments swapped? the order is {call}); remove it or choose another output path")


def check_not_input(path: str, inputs) -> None:
    """ValueError when the output ``path`` is one of the ``inputs`` (writing would destroy the source)."""
    if is_url(path):
        for src in inputs:
            if isinstance(src, str) and src.rstrip("/") == path.rstrip("/"):
                raise ValueError(f"the output {path!r} is the input {src!r}: writing would destroy the source; "
                                 "choose another output path")
        return
    out = os.path.realpath(path)
    for src in inputs:
        if isinstance(src, (str, os.PathLike)) and os.path.realpath(src) == out:
            raise ValueError(f"the output {os.fspath(path)!r} is the input {os.fspath(src)!r}: writing would destroy "
                             "the source; choose another output path")


def is_url(path: str) -> bool:
    """True for an fsspec URL (``s3://``, ``gs://``, ``memory://``...); ``file://`` and plain paths are local."""
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


UPLOAD_BLOCK = 64 << 20  # bytes per block of the other fsspec stores' uploads (S3 gets a growing PartPlan)


class Output:
    """The one file a writer produces, made visible only by :meth:`commit`.

    A local ``path``: a temp file ``<path>.tmp-<host>-<pid>-<random>`` next to it, fsynced and renamed over
    ``path``. An ``s3://`` URL: one multipart upload streamed while the file is assembled, no local copy
    (:class:`~pageset.write.upload.S3PartsFile`), completed on commit: S3 makes the object visible only then,
    whole. Other fsspec URLs: a temp file ``pageset-upload-<host>-<pid>-*`` in the local temp folder
    (``TMPDIR``), uploaded on commit through ``fsspec`` with ``autocommit=False``. On failure the upload is
    aborted; either way the previous file or object at ``path`` is untouched until the commit. ``f`` is the
    binary file to write (seekable forward; the first ``parts.size(1)`` bytes, 64 MiB by default, may be
    rewritten); :meth:`abort` removes what was written. ``storage_options`` go to ``fsspec.core.url_to_fs``;
    ``policy`` (a :class:`~pageset.write.upload.WritePolicy`) bounds every S3 request; ``parts`` (a
    :class:`~pageset.write.upload.PartPlan`) sizes the S3 parts; ``min_size``, a lower bound of the file's size in
    bytes where the writer knows one, refuses an S3 output over 5 TiB before the upload starts (ValueError).
    """

    def __init__(self, path: str, storage_options: dict | None = None, kind: str = "tmp", parts=None,
                 policy=None, min_size: int = 0):
        self.path, self.storage_options = path, dict(storage_options or {})
        self.upload_block = UPLOAD_BLOCK
        self.remote = is_url(path)
        self.stream = None
        if self.remote:
            from fsspec.core import url_to_fs

            fs, target = url_to_fs(self.path, **one_try_options(self.path, self.storage_options))
            if callable(getattr(fs, "call_s3", None)):
                from .upload import S3PartsFile

                self.tmp = None
                self.f = self.stream = S3PartsFile(fs, target, parts, url=self.path, policy=policy,
                                                   min_size=min_size)
                return
            fd, self.tmp = tempfile.mkstemp(prefix=f"pageset-upload-{_tag()}-", suffix=".pageset")
            what, choose = f"the local copy of {self.path} (uploaded at the end)", "another temp folder (TMPDIR)"
        else:
            self.path = local_path(path)
            remove_stale_temps(self.path)
            fd, self.tmp = temp_file(self.path, kind)
            what, choose = f"the output {self.path} (its temp file)", "another output path"
        try:
            self.f = DiskFile(fd, "w+b", self.tmp, what, choose)
        except BaseException:
            os.close(fd)
            os.unlink(self.tmp)
            raise

    def commit(self) -> None:
        """fsync and rename (local) or upload and complete (URL); removes the temp file either way."""
        if self.stream is not None:
            try:
                self.stream.complete()
            finally:
                self.stream.abort()  # a no-op once completed
            return
        try:
            self.f.flush()
            if self.remote:
                self._upload()
            else:
                self.f.fsync()
                self.f.close()
                try:
                    os.replace(self.tmp, self.path)
                except OSError as exc:
                    raise disk_error(exc, self.path, self.f.written, f"the output {self.path} (renaming "
                                     f"{self.tmp} over it)", "another output path") from exc
                fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        finally:
            self.abort()

    def _upload(self) -> None:
        from fsspec.core import url_to_fs

        fs, target = url_to_fs(self.path, **one_try_options(self.path, self.storage_options))
        self.f.seek(0)
        dst = fs.open(target, "wb", block_size=self.upload_block, autocommit=False)
        try:
            for block in iter(lambda: self.f.read(self.upload_block), b""):
                dst.write(block)
            dst.close()  # uploads the last part; nothing is visible before commit()
            dst.commit()  # S3: complete_multipart_upload (or one PUT for a file smaller than a part)
        except BaseException:
            try:
                if not dst.closed:
                    dst.close()
            except Exception:  # the store is failing already: abort below is what matters
                pass
            dst.discard()  # S3: abort_multipart_upload, so no part is left billed or visible
            raise

    def abort(self) -> None:
        try:
            if isinstance(self.f, DiskFile):
                self.f.discard()
            else:
                self.f.close()  # S3PartsFile: abort_multipart_upload
        finally:
            if self.tmp is not None:
                try:
                    os.unlink(self.tmp)
                except FileNotFoundError:
                    pass


def fsync_dir(folder: str) -> None:
    try:
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
