"""Counting the resources a test itself created: descriptors, Python threads and native threads.

A leak check that compares plain process-wide counts fails when something an EARLIER test left running (a
server's connection, a client's event-loop thread, a pool worker) happens to exit during the check: the count
drops and equality breaks, though nothing leaked (CI saw exactly that: 31 -> 29 descriptors in a soak test).
``Resources`` snapshots what exists before the test starts and from then on counts only what is new: a
descriptor whose (number, target) pair was not open at the snapshot, a ``threading.Thread`` not alive then, a
native thread id not present then. Something foreign that exits is simply not counted; something the test
leaks is.

Linux only (``/proc/self``); callers skip elsewhere.
"""

from __future__ import annotations

import os
import threading
import time


def _fd_entries() -> set[tuple[str, str]]:
    entries = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            entries.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # closed between listdir and readlink (the listing's own descriptor, for one)
            pass
    return entries


def _tids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _thread_name(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # the thread exited meanwhile
        return "?"


class Resources:
    """A snapshot of the process's descriptors and threads; methods count what appeared since."""

    def __init__(self) -> None:
        self.fds = _fd_entries()
        self.threads = set(threading.enumerate())
        self.tids = _tids()

    def new_fds(self) -> list[tuple[str, str]]:
        """Descriptors open now that were not open at the snapshot, as (number, target)."""
        return sorted(_fd_entries() - self.fds)

    def new_py_threads(self) -> list[str]:
        """Names of the live ``threading.Thread`` objects started since the snapshot."""
        return sorted(t.name for t in threading.enumerate() if t not in self.threads)

    def new_native_threads(self) -> list[str]:
        """Names (``comm``) of the native threads started since the snapshot and still present."""
        return sorted(_thread_name(tid) for tid in _tids() - self.tids)

    def native_threads_at_most(self, target: int, timeout: float = 60.0) -> int:
        """Count of new native threads, polled until at most ``target`` (bounded by ``timeout``):
        ``Thread.join()`` returns when the Python side is done and the OS thread leaves a moment later, which on
        a loaded machine can take long. Only an excess that lasts ``timeout`` seconds (a leak) is reported."""
        deadline = time.monotonic() + timeout
        n = len(_tids() - self.tids)
        while n > target and time.monotonic() < deadline:
            time.sleep(0.02)
            n = len(_tids() - self.tids)
        return n

    def sample(self) -> dict:
        return {"fds": len(self.new_fds()), "py_threads": len(self.new_py_threads()),
                "threads": len(_tids() - self.tids)}
