"""Conversion on a Ray cluster: a ``concurrent.futures.Executor`` whose tasks are Ray tasks.

``write_dataset`` / ``write_tokens`` take any executor (``executor=``); each task encodes one contiguous range of
the source into a shard file that the task writes itself, so the bytes never pass through the driver. Dask's
client has ``get_executor()``; Ray has no executor of its own, hence this small adapter over ``ray.remote``:
submitting ``fn(*args)`` starts a Ray task, and its ``ObjectRef`` future becomes the returned Future.

Why tasks and not actors: a task that dies with its worker (a SIGKILL, an out-of-memory kill, a lost node) is
rerun by Ray (``max_retries``) and the rerun rewrites the same shard, so the output is byte-identical to
``num_workers=0`` whatever failed. Exceptions raised by the task itself are not retried (``retry_exceptions``
stays off): a bad sample is reported once, naming its index, not retried ``max_retries`` times.
"""

from __future__ import annotations

import threading
from concurrent import futures

from ..format import arguments as check


class _RayFuture(futures.Future):
    """A Future bound to one Ray task: ``cancel()`` also cancels the task (when not yet finished)."""

    def __init__(self, ref):
        super().__init__()
        self._ref = ref

    def cancel(self) -> bool:
        import ray

        if self.done():
            return False
        try:
            ray.cancel(self._ref)
        except Exception:  # already finished, or the cluster is gone: the Future still gets cancelled
            pass
        # CANCELLED, not yet "notified": futures.wait() counts it as done only once the task has ended (see
        # settle), so a caller that cancels and waits knows that no cancelled task still writes a shard
        return super().cancel()


class RayExecutor(futures.Executor):
    """Run ``write_dataset`` / ``write_tokens`` tasks as Ray tasks on the current Ray cluster.

    Usage::

        import ray
        ray.init()                     # or ray.init(address="auto") on a cluster node
        write_dataset("train.pageset", source, fields, executor=RayExecutor())

    Args:
        max_retries: reruns of a task whose worker process died (int >= 0; Ray's default is 3). A rerun
            writes the same shard, so the output does not change.
        num_cpus: CPUs Ray reserves per task (a number > 0; default 1): the encoding is single-threaded.
        memory: bytes of memory Ray reserves per task (int >= 1, or None: no reservation), so that Ray does not
            pack more tasks on a node than its memory holds (a task holds ``chunk_size`` encoded samples).

    Ray must be installed (``pip install 'pageset[ray]'``); ``ray.init`` is the caller's: a task submitted
    before it starts a local Ray instance, as any ``.remote()`` call does. ``submit`` raises RuntimeError
    after ``shutdown``. Task errors reach the caller through the Future as Ray raises them (``RayTaskError``
    subclasses the task's own exception type, so ``except SampleError`` still works); a task whose workers died
    more than ``max_retries`` times raises ``ray.exceptions.WorkerCrashedError``.
    """

    def __init__(self, *, max_retries: int = 3, num_cpus: float = 1, memory: int | None = None):
        self.max_retries = check.integer("max_retries", max_retries, minimum=0)
        self.num_cpus = check.real("num_cpus", num_cpus, low=0, low_open=True)
        self.memory = check.integer("memory", memory, minimum=1, optional=True)
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ImportError("RayExecutor needs Ray: pip install 'pageset[ray]' (or 'ray[data]')") from None
        self._remotes: dict = {}  # fn -> its ray.remote wrapper (one registration per function)
        self._lock = threading.Lock()
        self._shutdown = False

    def _remote(self, fn):
        import ray

        with self._lock:
            remote = self._remotes.get(fn)
            if remote is None:
                options = {"max_retries": self.max_retries, "retry_exceptions": False, "num_cpus": self.num_cpus}
                if self.memory is not None:
                    options["memory"] = self.memory
                remote = self._remotes[fn] = ray.remote(fn).options(**options)
        return remote

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        if self._shutdown:
            raise RuntimeError("cannot submit to a RayExecutor after shutdown()")
        ref = self._remote(fn).remote(*args, **kwargs)
        out = _RayFuture(ref)  # stays PENDING until the task ends: cancel() works until then

        def settle(inner: futures.Future) -> None:
            if out.cancelled():  # the task has ended after cancel(): now wait() may count it as done
                out.set_running_or_notify_cancel()
                return
            try:
                out.set_result(inner.result())
            except futures.CancelledError:
                out.set_exception(futures.CancelledError(f"Ray task {ref.task_id().hex()} was cancelled"))
            except BaseException as exc:  # noqa: BLE001  (handed to the caller through the Future)
                out.set_exception(exc)

        ref.future().add_done_callback(settle)
        return out

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more submissions; the Ray cluster itself stays up (it is the caller's: ``ray.shutdown()``)."""
        self._shutdown = True

    def __repr__(self) -> str:
        return f"RayExecutor(max_retries={self.max_retries}, num_cpus={self.num_cpus}, memory={self.memory})"
