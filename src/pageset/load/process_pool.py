"""The loader's process mode (``Loader(num_workers=1)``): the decode threads run in one child process.

The parent (the trainer) keeps everything that decides *what* a batch is: the plan, each slot's ids, padding
and augmentation keys, state_dict / load_state_dict, the hand-out. The child (``process_worker``) opens the same
files, builds the same stages and fills each slot's rows with the same ``RowReader`` code the threads run in
process, on ``num_threads`` threads of its own, directly into the slot's buffers. Those buffers live in
anonymous shared memory mapped by both processes (zero copies):

- one anonymous file per slot (``shared_slots``: ``os.memfd_create``, else an unlinked temporary file): no name
  in ``/dev/shm``, nothing left to clean after a crash or a SIGKILL (the kernel frees it with its last mapping);
- its file descriptor goes to the child over a ``socketpair`` (``SCM_RIGHTS``) with the first fill of the slot;
  a slot given new buffers (the user still holds a batch made from the old ones) gets a new file, and the old
  mapping lives as long as the user's arrays;
- per fill, one small message (slot, step, generation, row slices: ~100 bytes); the slot's record ids, files and
  keys (B-long arrays) are written into a header at the start of its shared file, never pickled.

A receiver thread in the parent reads the child's replies ("slot k done", or the exception with the child's
traceback) and sets ``slot.done`` / ``slot.error``; a child that dies (SIGKILL, segfault, OOM) fails every
batch in flight, and every later one, with a RuntimeError naming its exit code or signal. The child exits when
its socket reaches EOF or its parent process is gone (checked every second; and ``PR_SET_PDEATHSIG`` on Linux).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref

from .parts import Pool
from .shared_slots import SharedBuffers
from .stats import STATS_KEY

_CHUNK = 1 << 16  # bytes of payload per SOCK_SEQPACKET message (well under the default 208 KiB socket buffer)
_STOP_TIMEOUT_S = 10.0  # close(): seconds the child gets to stop its threads before it is killed


# ---- messages: pickled objects over a SOCK_SEQPACKET socketpair, chunked, file descriptors on the first chunk ----
def send_msg(sock: socket.socket, obj, fds=(), lock: threading.Lock | None = None) -> None:
    """Send ``obj`` (pickled) and the file descriptors ``fds``; chunks of ``_CHUNK`` bytes, one message each
    (flag byte 1: more follow). Raises OSError (BrokenPipeError) when the other end is gone."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    parts = [data[i:i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]
    if lock is None:
        lock = _NO_LOCK
    with lock:
        for i, part in enumerate(parts):
            msg = (b"\x01" if i + 1 < len(parts) else b"\x00") + part
            if i == 0 and fds:
                socket.send_fds(sock, [msg], list(fds))
            else:
                sock.sendall(msg)


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_LOCK = _NoLock()


def recv_msg(sock: socket.socket):
    """``(obj, fds)`` of the next message; ``(None, [])`` at EOF (the other end closed or died)."""
    parts, fds = [], []
    while True:
        try:
            data, got, _flags, _addr = socket.recv_fds(sock, _CHUNK + 1, 8)
        except ConnectionResetError:  # the other end died with messages it had not read: EOF too
            data, got = b"", []
        fds += got
        if not data:
            for fd in fds:
                os.close(fd)
            return None, []
        parts.append(data[1:])
        if data[:1] == b"\x00":
            return pickle.loads(b"".join(parts)), fds


def wait_readable(sock: socket.socket, timeout: float) -> bool:
    """True when a message (or EOF) can be read from ``sock`` within ``timeout`` seconds."""
    return bool(select.select([sock], [], [], timeout)[0])


# ---- the parent's side ---------------------------------------------------------------------------------------
class ChildTraceback(Exception):
    """The traceback of an exception raised in the loader's child process (the ``__cause__`` of the re-raised
    exception, as ``concurrent.futures`` does: printed under it)."""

    def __str__(self):
        return "\n" + self.args[0]


def remote_exception(payload: tuple) -> BaseException:
    """The exception a child's ``(pickled exception or None, type name, message, traceback text)`` stands for:
    the original (unpickled, with the child's traceback as its ``__cause__``), else a RuntimeError naming it."""
    blob, type_name, message, tb = payload
    exc = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(f"{type_name}: {message} (raised in the loader's child process)")
    exc.__cause__ = ChildTraceback(tb)
    return exc


def exception_payload(exc: BaseException) -> tuple:
    """What :func:`remote_exception` rebuilds ``exc`` from (in the child)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(blob)  # an exception class whose __init__ takes other arguments than its args cannot return
    except Exception:
        blob = None
    return blob, type(exc).__name__, str(exc), tb


class _ChildThread:
    """Stands for one of the child's decode threads in ``Loader.stats()`` (its CPU seconds as last reported)."""

    def __init__(self, pool: "ProcessPool", i: int):
        self.name, self.ident, self._pool, self._i = f"child thread {i}", ("child", id(pool), i), pool, i

    def cpu_seconds(self) -> float | None:
        cpu = self._pool._report.get("cpu_s")
        return cpu[self._i] if cpu is not None and self._i < len(cpu) else None

    def is_alive(self) -> bool:
        return self._pool.alive() > 0


class _ChildStats:
    """A child thread's ThreadStats as last reported (``snapshot()`` as ThreadStats has)."""

    def __init__(self, pool: "ProcessPool", i: int):
        self._pool, self._i = pool, i

    def snapshot(self) -> dict:
        threads = self._pool._report.get("threads") or []
        if self._i < len(threads):
            return threads[self._i]
        return {"fill_s": 0.0, "slices": 0, "rows": 0, "stage_s": {}, "read_s": 0.0, "read_bytes": 0}


class ProcessPool(Pool):
    """The pool contract (load/parts.py ``Pool``: ``submit``, ``cancel``, ``help``, ``alive``, ``threads``,
    ``contexts``, ``start``, ``generation``, ``close``, ``refresh``, ``page_counters``) over one child process
    running ``num_threads`` threads.

    ``init``: what the child builds its Loader from (a picklable ``LoaderDescription``, load/options.py); ``shared``: the slots' SharedBuffers;
    ``name``: named in errors (the file's path). The child is started here, in the background: construction
    does not wait for it (it imports, opens the files and builds its stages while the trainer sets up); the first
    batch does.
    """

    def __init__(self, init, shared: SharedBuffers, num_threads: int, name: str):
        self.name, self.shared, self.generation = name, shared, 0
        self.threads = [_ChildThread(self, i) for i in range(num_threads)]
        self.contexts = [{STATS_KEY: _ChildStats(self, i)} for i in range(num_threads)]
        self._report: dict = {}  # the child's last stats report
        self._report_event = threading.Event()
        self._ready = threading.Event()  # the child has built its loader and serves messages
        self._mu = threading.Lock()  # guards _inflight and _failure
        self._send_lock = threading.Lock()
        self._inflight: dict[int, object] = {}  # slot index -> Slot being filled
        self._slices: dict[int, list] = {}  # slot index -> (lo, hi) slices submitted, until the last one
        self._failure: str | None = None  # why no batch can be filled any more (the child died / failed)
        self._closing = False
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = parent
        try:
            code = ("import sys; sys.path[:] = {path!r}; from pageset.load.process_worker import main; "
                    "main({fd})").format(path=list(sys.path), fd=child.fileno())
            self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(child.fileno(),),
                                          stdin=subprocess.DEVNULL)
        except BaseException:
            parent.close()
            child.close()
            raise
        child.close()  # the child has its own copy; EOF on ours when it dies
        self.pid = self._proc.pid
        self._owner = os.getpid()  # a forked copy of this pool must never talk to (or kill) the owner's child
        # kill the child if this pool is collected without close() (it would exit at EOF anyway)
        self._finalizer = weakref.finalize(self, _kill, self._proc, parent, self._owner)
        main = threading.current_thread() is threading.main_thread()
        setup = {"init": init, "layout": shared.layout, "header": shared.header, "size": shared.size,
                 "parent": self._owner, "deathsig": main}
        # the receiver sends the set-up (large with indices=: it waits while the child imports, this need not)
        self._receiver = threading.Thread(target=self._receive, args=(setup,), name="pageset-child-receiver",
                                          daemon=True)
        self._receiver.start()

    # -- the Loader's calls --
    def start(self, num_threads: int) -> None:
        """No-op: the child's threads start with it."""

    def help(self, ctx: dict) -> bool:
        """False: the slices run in the child (taking that work off the trainer's process is the point)."""
        return False

    def submit(self, slot, lo: int, hi: int) -> None:
        """Queue rows ``[lo, hi)`` of ``slot``; the slot's last slice (``slot.pending`` of them) sends one message
        to the child with all of them; its ids, files and keys go into the slot's shared header first."""
        got = self._slices.setdefault(slot.index, [])
        got.append((int(lo), int(hi)))
        if len(got) < slot.pending:
            return
        del self._slices[slot.index]
        head = self.shared.header_of(slot.index)
        head["read_ids"][...] = slot.read_ids
        if slot.sources is not None:
            head["sources"][...] = slot.sources
        if slot.keys is not None:
            head["keys"][...] = slot.keys
        fd = self.shared.take_fd(slot.index)
        msg = ("fill", slot.index, slot.generation, slot.step, got, slot.sources is not None, slot.keys is not None)
        with self._mu:
            failure = self._failure
            if failure is None:
                self._inflight[slot.index] = slot
        try:
            if failure is None:
                send_msg(self._sock, msg, () if fd is None else (fd,), self._send_lock)
        except OSError:
            failure = self._fail(f"the loader's child process (pid {self.pid}) cannot be reached")
        finally:
            if fd is not None:
                os.close(fd)  # the child has its own descriptor now (or never will)
        if failure is not None:
            self._finish(slot, RuntimeError(failure))

    def cancel(self) -> None:
        """Make queued slices of the current generation no-ops in the child (they still report their slots)."""
        self.generation += 1
        self._send(("cancel", self.generation))

    def alive(self) -> int:
        """The child's threads while it runs and the receiver reads its replies, else 0."""
        return len(self.threads) if self._receiver.is_alive() and self._failure is None else 0

    def refresh(self, timeout: float = 10.0) -> None:
        """Ask the child for its threads' counters (``Loader.stats()``); waits up to ``timeout`` seconds, then keeps
        the last report (a dead child's last one)."""
        if self._failure is not None or not self._receiver.is_alive():
            return
        self._report_event.clear()
        if self._send(("stats",)):
            self._report_event.wait(timeout)

    def page_counters(self) -> tuple[bool, dict]:
        """(whether the child's files use ``page_cache="process"``, ``{"hits", "misses", "bytes_read"}``)."""
        pages = self._report.get("pages") or {}
        return bool(pages.get("cached")), {k: int(pages.get(k, 0)) for k in ("hits", "misses", "bytes_read")}

    def close(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """Tell the child to stop, wait for it (``timeout`` seconds), then kill it; reap it; close the socket."""
        if self._closing:
            return
        self._closing = True
        if os.getpid() != self._owner:  # a forked child's copy: drop our descriptor, leave the owner's child alone
            self._finalizer.detach()
            self._sock.close()
            return
        if self._ready.is_set():
            self._send(("stop",))
        else:  # still importing or opening the files: nothing of it to stop cleanly (files read-only, memory
            self._proc.kill()  # anonymous); no need to wait seconds for its imports
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._receiver is not threading.current_thread():
            self._receiver.join(timeout)
        self._sock.close()
        self._finalizer.detach()
        self.shared.close()

    # -- internals --
    def _send(self, msg) -> bool:
        if os.getpid() != self._owner:  # a forked child's copy of this pool (see Loader._check_process)
            return False
        try:
            send_msg(self._sock, msg, lock=self._send_lock)
            return True
        except OSError:
            return False

    def _finish(self, slot, error: BaseException | None) -> None:
        if error is not None and slot.error is None:
            slot.error = error
        slot.pending = 0
        slot.done.set()

    def _fail(self, why: str) -> str:
        """Fail every batch in flight and every later one with ``why``; the first reason wins."""
        with self._mu:
            if self._failure is None:
                self._failure = f"{self.name}: {why}"
            failure, slots = self._failure, list(self._inflight.values())
            self._inflight.clear()
            for slot in slots:  # inside the lock: a waiting next() sees its slot failed before alive() drops
                self._finish(slot, RuntimeError(failure))
        return failure

    def _receive(self, setup: dict) -> None:
        try:
            send_msg(self._sock, setup, lock=self._send_lock)
            while True:
                msg, fds = recv_msg(self._sock)
                for fd in fds:
                    os.close(fd)
                if msg is None:
                    break
                kind = msg[0]
                if kind == "done":
                    _, index, error, lists = msg
                    with self._mu:
                        slot = self._inflight.pop(index, None)
                    if slot is None:
                        continue
                    if lists:
                        for (k, key), values in lists.items():
                            slot.arrays[k][key][:] = values
                    self._finish(slot, None if error is None else remote_exception(error))
                elif kind == "ready":
                    self._ready.set()
                elif kind == "stats":
                    self._report = msg[1]
                    self._report_event.set()
                elif kind == "failed":  # the child could not build its loader
                    exc = remote_exception(msg[1])
                    self._fail(f"the loader's child process (pid {self.pid}) could not start: "
                               f"{type(exc).__name__}: {exc}\n{exc.__cause__}")
                    try:  # the child reads until this side shuts, then exits
                        self._sock.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    break
        except BaseException as exc:  # noqa: BLE001 - a receiver that dies must fail the batches, not hang them
            if not self._closing:
                self._fail(f"the receiver of the loader's child process failed: {type(exc).__name__}: {exc}")
        finally:
            self._report_event.set()
            if self._closing:
                self._fail("this Loader is closed")
            else:
                self._fail(self._death())

    def _death(self) -> str:
        """Why the child is gone: its exit code or signal (waits up to 10 s for the kernel to report it)."""
        deadline = time.monotonic() + 10.0
        while self._proc.poll() is None and time.monotonic() < deadline:
            try:
                self._proc.wait(0.1)
            except subprocess.TimeoutExpired:
                pass
        rc = self._proc.returncode
        if rc is None:
            how = "closed its connection"
        elif rc < 0:
            try:
                how = f"was killed by signal {signal.Signals(-rc).name}"
            except ValueError:
                how = f"was killed by signal {-rc}"
        else:
            how = f"exited with code {rc}"
        return (f"the loader's child process (pid {self.pid}, num_workers=1) {how}; the batches it was preparing "
                "are lost. Make a new Loader (load_state_dict resumes where the last batch handed out left off); "
                "a signal such as SIGKILL often means the machine ran out of memory")


def _kill(proc: subprocess.Popen, sock: socket.socket, owner: int) -> None:
    try:
        sock.close()
        if os.getpid() != owner:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    except Exception:
        pass
