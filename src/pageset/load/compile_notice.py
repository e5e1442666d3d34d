"""One line on stderr when this process compiles pageset's Numba kernels (a Numba disk-cache miss).

The kernels are cached on disk (``__pycache__`` next to their modules, or ``NUMBA_CACHE_DIR``), so only the first
process after an install or an upgrade compiles them, during its first batches; without a word it would look
hung. Numba fires its ``numba:compile`` event only after a cache lookup failed, so a process that loads every
kernel from the cache prints nothing. The listener reacts to pageset's own kernels only (a user's ``@njit``
functions never trigger it) and prints at most once per process. It is registered by the first Loader, at run
time, never at import; stderr, like tqdm's bars and nanoGPT's "compiling the model...".
"""

from __future__ import annotations

import sys
import threading

# measured (benchmarks/cold_start.py, README "Start-up"): ~13 CPU seconds after import torch before the first
# image batch of a fresh cache, ~2 s for tokens; 20-60 s of wall time on 2 loaded cores
COMPILE_SECONDS = "up to ~20 s per image pipeline on 2 idle cores, more under load"

_lock = threading.Lock()
_listener = None


def announce_compiles() -> None:
    """Register (once per process) the listener that prints the line at the first compile of a pageset kernel."""
    global _listener
    import numba
    from numba.core import event

    if numba.config.DISABLE_JIT:
        return
    with _lock:
        if _listener is not None:
            return

        class _Notice(event.Listener):
            printed = False

            def on_start(self, ev):
                if self.printed:
                    return
                disp = (ev.data or {}).get("dispatcher")
                module = getattr(getattr(disp, "py_func", None), "__module__", "") or ""
                if module.startswith("pageset."):
                    self.printed = True
                    print(f"pageset: compiling the Numba kernels (once after an install or an upgrade: "
                          f"{COMPILE_SECONDS}; cached on disk for later processes; `pageset warmup` does it ahead "
                          f"of time)", file=sys.stderr, flush=True)

            def on_end(self, ev):
                pass

        _listener = _Notice()
        event.register("numba:compile", _listener)
