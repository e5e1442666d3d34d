"""What every pageset writer shares: the ordered worker pool, lineage, and the file's tail (sections, section
table, header) written after the pages, so that the header, which makes the file valid, is written last."""

from __future__ import annotations

import collections
import datetime
import glob
import multiprocessing
import os
import platform
import socket
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from ..format import constants as C
from ..format.checksum import crc32
from ..format.layout import HEADER, SECTION_ENTRY


def ordered_map(fn, tasks, num_workers: int, initializer, initargs, ahead: int, died: str):
    """Yield ``fn(*task)`` for each task of the iterable ``tasks``, in task order, from ``num_workers`` forked
    worker processes (spawned where fork is unavailable) running at most ``ahead`` tasks ahead.

    A dead worker (SIGKILL, out of memory, segfault) raises ``RuntimeError(died)`` at once instead of hanging;
    leaving the generator early (an exception in the caller) cancels queued tasks and joins the workers.
    """
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    pool = ProcessPoolExecutor(num_workers, mp_context=ctx, initializer=initializer, initargs=initargs)
    pending: collections.deque = collections.deque()
    tasks = iter(tasks)
    try:
        while True:
            while len(pending) < ahead:
                task = next(tasks, None)
                if task is None:
                    break
                pending.append(pool.submit(fn, *task))
            if not pending:
                return
            try:
                yield pending.popleft().result()
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


def remove_stale_temps(path: str) -> list[str]:
    """Delete temp files of ``path`` left by dead writer processes on this host; returns the names removed."""
    host = socket.gethostname()
    removed = []
    for kind in ("tmp", "spill"):
        for name in glob.glob(glob.escape(os.path.abspath(path)) + f".{kind}-{glob.escape(host)}-*-*"):
            try:
                pid = int(name.rsplit("-", 2)[-2])
            except ValueError:
                continue
            try:
                os.kill(pid, 0)
                continue  # that writer is alive (or the pid was reused): leave it
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            try:
                os.unlink(name)
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def check_output_path(path) -> str:
    """``path`` (str or os.PathLike) as a str, if its folder exists; TypeError / FileNotFoundError otherwise.

    Called first by every writer, so that a missing folder is reported as such before any work (and not as a
    missing temp file once the work is done)."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be the output file's path (str or os.PathLike), got {path!r} "
                        f"({type(path).__name__})")
    path = os.fspath(path)
    if not path or path.endswith(os.sep):
        raise ValueError(f"path must name a file, got {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise FileNotFoundError(f"cannot write {path}: the output folder {folder} {what}; create it first "
                                f"(e.g. os.makedirs({folder!r}, exist_ok=True))")
    if os.path.isdir(path):
        raise IsADirectoryError(f"cannot write {path}: it is a folder; give a file name, e.g. "
                                f"{os.path.join(path, 'train.pageset')}")
    return path


def check_not_input(path: str, inputs) -> None:
    """ValueError when the output ``path`` is one of the ``inputs`` (writing would destroy the source)."""
    out = os.path.realpath(path)
    for src in inputs:
        if isinstance(src, (str, os.PathLike)) and os.path.realpath(src) == out:
            raise ValueError(f"the output {os.fspath(path)!r} is the input {os.fspath(src)!r}: writing would destroy "
                             "the source; choose another output path")
