"""The loader's thread pool: persistent threads running slices of batches; failures are forwarded.

Each task fills rows ``[lo, hi)`` of one slot for every stage. Threads live as long as the Loader (no re-spawn
per epoch). Every wait has a timeout and checks the stop event; every exception, BaseException included, is
caught in the thread and handed to the consumer with the thread's traceback, so a failing op can never hang
the training loop or die silently.
"""

from __future__ import annotations

import collections
import threading
import weakref
from dataclasses import dataclass, field

from .parts import Pool


@dataclass
class Slot:
    """A ring slot: preallocated buffers of one batch and the bookkeeping of its fill."""

    index: int
    arrays: list  # per stage: dict of output key -> buffer
    step: int = -1
    generation: int = -1
    ids: object = None  # int64[B] what "_index" shows (record ids; a FileSet's global ids)
    sources: object = None  # int16[B] file of each row (a Mixture, a FileSet), else None: all rows from file 0
    read_ids: object = None  # int64[B] record id of each row within its file (ids, except for a FileSet)
    padding: object = None  # bool[B]
    keys: object = None  # uint64[B]
    pending: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    handed: list = field(default_factory=list)  # weakrefs to the views handed out from this slot
    event: object = None  # CUDA event of the last copy out of this slot (device queue)
    prefetched: object = None  # a device copy issued before the batch was asked for (device queue)


class WorkerFailed(RuntimeError):
    """Wraps nothing: the original exception is re-raised; this names where it happened (``__cause__``)."""


class ThreadPool(Pool):
    """``num_threads`` daemon threads executing ``(slot, lo, hi, generation)`` tasks with ``run_slice``.

    The consumer runs queued tasks itself while it waits (:meth:`help`): a loader-bound training loop gets one
    more worker for free. (Batches cheaper than a hand-off, a token batch, never come here: the Loader fills
    them on the calling thread and starts the pool with no threads.)
    """

    def __init__(self, num_threads: int, run_slice, name: str = "pageset", contexts: list | None = None):
        # per-thread scratch (``contexts[i]`` for thread i, made and pre-sized by the caller; else made here)
        self.contexts = list(contexts or [])
        self._tasks: collections.deque = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self._stop = threading.Event()
        # A weak reference: the threads must not keep the Loader alive, so ``del loader`` can close it.
        self._run_slice = weakref.WeakMethod(run_slice)
        self._lock = threading.Lock()
        self.generation = 0
        self._name = name
        self.threads: list[threading.Thread] = []
        self.start(num_threads)

    def start(self, num_threads: int) -> None:
        """Start threads until ``num_threads`` run (a pool made with none starts them when first needed)."""
        new = [threading.Thread(target=self._loop, args=(i,), name=f"{self._name}-{i}", daemon=True)
               for i in range(len(self.threads), num_threads)]
        self.threads += new
        for t in new:
            t.start()

    def submit(self, slot: Slot, lo: int, hi: int) -> None:
        with self._cv:
            self._tasks.append((slot, lo, hi, slot.generation))
            self._cv.notify()

    def _loop(self, i: int) -> None:
        ctx: dict = self.contexts[i] if i < len(self.contexts) else {"thread": i}  # scratch, JPEG decoder handle
        while not self._stop.is_set():
            with self._cv:
                if not self._tasks:
                    self._cv.wait(0.1)
                    if not self._tasks:
                        continue
                task = self._tasks.popleft()
            self.run(task, ctx)
        close_context(ctx)

    def help(self, ctx: dict) -> bool:
        """Run the oldest queued task in the calling thread (with its scratch ``ctx``); False if none is queued.

        The consumer calls it while the batch it waits for is not ready: a queued slice of that batch, or of
        the next one (tasks are queued in batch order), gets done instead of the consumer sleeping.
        """
        with self._cv:
            if not self._tasks:
                return False
            task = self._tasks.popleft()
        self.run(task, ctx)
        return True

    def run(self, task: tuple, ctx: dict) -> None:
        """Run one task; its exception, BaseException included, is stored on the slot for the consumer."""
        slot, lo, hi, gen = task
        try:
            run = self._run_slice()
            if run is not None and gen == self.generation and slot.error is None:
                run(slot, lo, hi, ctx)
            del run
        except BaseException as exc:  # forwarded to the consumer, never swallowed
            exc.pageset_where = f"thread {threading.current_thread().name}, batch step {slot.step}, rows {lo}:{hi}"
            slot.error = exc
        finally:
            with self._lock:
                slot.pending -= 1
                if slot.pending == 0:
                    slot.done.set()

    def cancel(self) -> None:
        """Make queued tasks of the current generation no-ops (they still count down their slots)."""
        with self._lock:
            self.generation += 1

    def close(self, timeout: float = 10.0) -> None:
        """Stop and join every thread."""
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        for t in self.threads:
            if t is not threading.current_thread():  # a Loader collected inside one of its own threads
                t.join(timeout)

    def alive(self) -> int:
        return sum(t.is_alive() for t in self.threads)


def close_context(ctx: dict) -> None:
    """Release what a thread's scratch context holds (the JPEG decoder handle)."""
    dec = ctx.pop("decoder", None)
    if dec is not None:
        dec.close()
