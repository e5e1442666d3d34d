"""The writer lock of a local many-file set (``formats/manyfile.md`` section 9): one write at a time per set.

A write (and ``pageset clean``) holds ``FOLDER/pageset.lock`` with an exclusive ``flock`` from before it reads
the manifest until it has written the new one and removed what the old set no longer needs; the file says who
holds it (JSON ``{"host", "pid", "started", "call"}``), for the messages of the others. A second write waits for
it (saying once on stderr whom it waits for), then reads the manifest the first one left: two appends at once
run one after the other. ``pageset clean`` does not wait: it leaves a set being written alone and says so. The
holder removes the file as it releases the lock; a killed holder leaves the file, but not the lock (the kernel
drops it), and the next writer takes it over.

Where the file system refuses locks (``format/locks.py``), the file is still written, and a process that finds
it names a live process of this host (the check of the single file's temp files,
:func:`~pageset.write.output.writer_alive`) is refused with SetBusyError instead of waiting; writes are then
not serialised. URLs (object stores) take no lock at all: :func:`lock_set` returns an inert lock.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import weakref

from ..format import locks
from .output import is_url, local_path, writer_alive

MAX_RACES = 1000  # lock files found removed by their holder between our open and our lock, at most (retried)


class SetBusyError(RuntimeError):
    """Another process is writing the many-file set (``holder``: what its lock file says, or {})."""

    def __init__(self, message: str, holder: dict):
        super().__init__(message)
        self.holder = holder


class SetLock:
    """A held writer lock (``path``, ``fd``; ``exclusive``: False where the file system has no locks), or an inert
    one (``path`` None: a URL's, or a pickled copy). :meth:`release` once the write is done (idempotent)."""

    def __init__(self, path: str | None = None, fd: int = -1, exclusive: bool = False):
        self.path, self.fd, self.exclusive = path, fd, exclusive
        # a lock its owner dropped without release() (a Ray driver whose write never ended) is closed with it
        self._closer = weakref.finalize(self, os.close, fd) if fd >= 0 else None

    def release(self) -> None:
        """Remove the lock file and drop the lock (the file first: a process waiting on it then finds it gone
        and retries on a new one)."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        try:
            if locks.same_file(fd, self.path):
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            try:
                if self.exclusive:
                    locks.flock(fd, "unlock")  # also for forked children holding a copy of the descriptor
            finally:
                self._closer()

    def __reduce__(self):  # a copy sent to a task (a pickled Ray datasink) holds nothing
        return (SetLock, ())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def holder_of(path: str) -> dict:
    """What the lock file at ``path`` says of its writer (``{}`` when it is gone, empty or not JSON)."""
    try:
        with open(path, "rb") as f:
            got = json.loads(f.read() or b"{}")
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def describe(holder: dict) -> str:
    """``"pid 123 on host node1, since 2026-01-01T10:00:00Z: write_dataset(...)"`` (what is known of it)."""
    if not holder.get("pid"):
        return "a process that has not written its pid yet"
    text = f"pid {holder.get('pid')} on host {holder.get('host', '?')}, since {holder.get('started', '?')}"
    return text + (f": {holder['call']}" if holder.get("call") else "")


def _live(holder: dict, every_host: bool) -> bool:
    """Whether the holder a lock file names may still run (no flock here: the single file's live-writer check;
    a writer on another host counts as live unless ``every_host``)."""
    pid, host = holder.get("pid"), holder.get("host")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(host, str):
        return False
    alive = writer_alive(host, pid)
    return (not every_host) if alive is None else alive


def _mine(call: str) -> bytes:
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started, "call": call},
                      sort_keys=True).encode()


def lock_set(folder: str, call: str, wait: bool = True, every_host: bool = False) -> SetLock:
    """Take the writer lock of the local set in ``folder`` (it exists) for ``call`` (shown to others, e.g.
    ``"write_dataset(path, source, fields, records_per_member=...)"``); an inert lock for a URL.

    ``wait=True`` (writers): while another process holds it, print once to stderr whom this write waits for,
    then wait. ``wait=False`` (``pageset clean``): raise SetBusyError naming the holder. Where the file system has
    no locks: SetBusyError when the lock file names a live process (of this host; of any host unless
    ``every_host``), else the lock is taken without excluding anyone. Raises OSError when the folder cannot
    hold the file (read-only: nothing could be written there either)."""
    if is_url(folder):
        return SetLock()
    path = os.path.join(local_path(folder), locks.LOCK_NAME)
    told = False
    for _ in range(MAX_RACES):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
            writable = True
        except PermissionError:  # another user's lock file (a local flock needs no write access)
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            writable = False
        try:
            got = locks.flock(fd, "try")
            if got is None:  # no locks on this file system: the pid in the file is all there is
                holder = holder_of(path)
                if holder.get("pid") != os.getpid() and _live(holder, every_host):
                    if not wait:
                        raise SetBusyError(f"{folder}: a write to this set is running ({describe(holder)})", holder)
                    raise SetBusyError(f"{folder}: another write to this set is running ({describe(holder)}); "
                                       "this file system has no locks, so writes cannot wait for each other: run "
                                       "one at a time", holder)
                if writable:
                    _claim(fd, call)
                return SetLock(path, fd, exclusive=False)
            if not got:
                holder = holder_of(path)
                if not wait:
                    raise SetBusyError(f"{folder}: a write to this set is running ({describe(holder)})", holder)
                if not told:
                    print(f"pageset: {folder}: waiting for another write to this set to finish "
                          f"({describe(holder)})", file=sys.stderr, flush=True)
                    told = True
                locks.flock(fd, "exclusive")
            if not locks.same_file(fd, path):  # its holder removed it as it released it: lock the next one
                os.close(fd)
                continue
            if writable:
                _claim(fd, call)
            return SetLock(path, fd, exclusive=True)
        except BaseException:
            os.close(fd)
            raise
    raise RuntimeError(f"{path}: the lock file was replaced {MAX_RACES} times while this write tried to take it")


def _claim(fd: int, call: str) -> None:
    """Say in the lock file who holds it now."""
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, _mine(call))


__all__ = ["SetBusyError", "SetLock", "describe", "holder_of", "lock_set"]
