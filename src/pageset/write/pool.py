"""The writers' ordered worker pool: tasks run in forked worker processes, results yielded in task order, a dead
worker reported at once and no task left writing after a failure."""

from __future__ import annotations

import collections
import multiprocessing
import os
from concurrent import futures
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from ..format.processes import die_with_parent

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
