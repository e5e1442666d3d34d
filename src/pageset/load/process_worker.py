"""The child process of ``Loader(num_workers=1)`` (see ``process_pool``): fills slots in shared memory.

Started by :class:`~pageset.load.process_pool.ProcessPool` as ``python -c "...; main(fd)"`` with one end of a
socketpair. It builds the parent's Loader again from its pickled description (load/options.py
``LoaderDescription``: same files, same stages, same RowReader; no batch slots of its own), starts
``num_threads`` decode threads (the Loader's ThreadPool, the code they run in process) and serves the parent's
messages on its main thread:

- ``("fill", slot, generation, step, slices, has_sources, has_keys)`` (+ a descriptor of the slot's new shared
  file): each slice goes to the thread pool; when the slot's last slice is done, ``("done", slot, error, lists)``
  goes back (``error``: the exception and its traceback text, None if it filled; ``lists``: a JSON field's values);
- ``("cancel", generation)``: queued slices of older generations become no-ops (as ``ThreadPool.cancel``);
- ``("stats",)``: the threads' counters and page-cache counters (``Loader.stats()`` in the parent);
- ``("stop",)``, or EOF (the parent closed or died): stop the threads and exit.

It sends ``("ready",)`` once its loader is built (until then the parent's close() kills it rather than wait for
its imports), or ``("failed", error)`` if it cannot be built.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

from ..format.processes import die_with_parent
from .loader import Loader
from .process_pool import exception_payload, recv_msg, send_msg, wait_readable
from .parts import page_counters
from .shared_slots import map_file, views
from .stats import STATS_KEY, _thread_cpu
from .workers import Slot

PARENT_POLL_S = 1.0  # seconds between checks that the parent process still exists (it may die without EOF)


class WorkerLoader(Loader):
    """The parent's Loader rebuilt in the child: files, stages, plan and threads, but no batch slots (the parent's
    slots in shared memory are filled instead) and no device queue (the parent copies to the device)."""

    def _setup_buffers(self) -> None:
        self._queue, self._slots, self._empty, self._turn = None, [], None, 0
        self._shared = self._pinned = None

    def report(self) -> dict:
        """The threads' counters (ThreadStats snapshots, CPU seconds) and the files' page-cache counters."""
        n = len(self._pool.threads)
        return {"threads": [c[STATS_KEY].snapshot() for c in self._pool.contexts[:n]],
                "cpu_s": [_thread_cpu(t) for t in self._pool.threads],
                "pages": page_counters(self._sources)}


class _Reply:
    """A slot's ``done`` event in the child: the ThreadPool sets it when the slot's last slice ends; setting it
    sends the slot's reply to the parent."""

    def __init__(self, worker: "Worker", slot: Slot, lists: list):
        self.worker, self.slot, self.lists = worker, slot, lists

    def set(self) -> None:
        self.worker.reply(self.slot, self.lists)

    def is_set(self) -> bool:
        return False


class Worker:
    def __init__(self, sock: socket.socket, setup: dict):
        self.sock, self.lock = sock, threading.Lock()
        self.layout, self.header, self.size = setup["layout"], setup["header"], setup["size"]
        self.parent = setup["parent"]
        self.loader = setup["init"].build(WorkerLoader)  # the parent's LoaderDescription (load/options.py)
        self.pool = self.loader._pool
        self.pool.start(self.loader.num_threads)  # a token file's loader starts none until asked
        self.maps: dict[int, tuple] = {}  # slot index -> (arrays, header views) over its current shared file

    def serve(self) -> None:
        while True:
            if not wait_readable(self.sock, PARENT_POLL_S):
                if os.getppid() != self.parent:  # the parent died; its socket may live on in a forked sibling
                    return
                continue
            msg, fds = recv_msg(self.sock)
            if msg is None or msg[0] == "stop":
                return
            kind = msg[0]
            if kind == "fill":
                self.fill(msg, fds)
            elif kind == "cancel":
                with self.pool._lock:
                    self.pool.generation = msg[1]
            elif kind == "stats":
                send_msg(self.sock, ("stats", self.loader.report()), lock=self.lock)

    def fill(self, msg, fds) -> None:
        _, index, gen, step, slices, has_sources, has_keys = msg
        if fds:  # the slot's new shared file: map it (the previous mapping is no longer filled)
            mm = map_file(fds[0], self.size)
            for fd in fds:
                os.close(fd)
            self.maps[index] = ([views(mm, entries) for entries in self.layout], views(mm, self.header))
        arrays, head = self.maps[index]
        slot = Slot(index, arrays)
        slot.step, slot.generation = step, gen
        slot.read_ids = head["read_ids"]
        slot.sources = head["sources"] if has_sources else None
        slot.keys = head["keys"] if has_keys else None
        lists = [(k, key) for k, entries in enumerate(self.layout) for key, off, _, _ in entries if off is None]
        slot.pending = len(slices)
        slot.done = _Reply(self, slot, lists)
        for lo, hi in slices:
            self.pool.submit(slot, lo, hi)

    def reply(self, slot: Slot, lists: list) -> None:
        error = None if slot.error is None else exception_payload(slot.error)
        values = {(k, key): list(slot.arrays[k][key]) for k, key in lists} if error is None and lists else None
        try:
            send_msg(self.sock, ("done", slot.index, error, values), lock=self.lock)
        except OSError:  # the parent is gone: the main thread sees EOF and exits
            pass

    def close(self) -> None:
        self.loader.close()


def main(fd: int) -> None:
    """Entry point of the child (``fd``: its end of the socketpair)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it then closes the loader
    sock = socket.socket(fileno=fd)
    try:
        setup, _ = recv_msg(sock)  # unpickling the pipelines may fail here (an op the child cannot import)
        if setup is None:
            return
        if setup.get("deathsig"):  # only when the Loader was made on the parent's main thread (PDEATHSIG follows
            die_with_parent(setup["parent"], exit_code=0)  # the thread that started the child, not the process)
        worker = Worker(sock, setup)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, raised by its next()
        try:
            send_msg(sock, ("failed", exception_payload(exc)))
            # read what the parent sent meanwhile until it shuts its side (it does on "failed"): a socket closed
            # with messages unread resets the connection, and the parent's read would lose "failed" to the reset
            sock.settimeout(5.0)
            while recv_msg(sock)[0] is not None:
                pass
        except OSError:
            pass
        return
    try:
        send_msg(sock, ("ready",), lock=worker.lock)
        worker.serve()
    finally:
        worker.close()
        sock.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # threads joined, files closed: skip the interpreter's teardown (~1 s of torch and numba)
