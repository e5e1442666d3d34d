"""Child-process lifetime shared by the writers' worker pool and the Loader's process mode (stdlib only)."""

from __future__ import annotations

import os
import sys

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent_pid: int, exit_code: int) -> None:
    """Make this (child) process end when its parent does, even by SIGKILL: on Linux, ask the kernel for SIGKILL
    at the parent's death (``prctl(PR_SET_PDEATHSIG)``), then ``os._exit(exit_code)`` at once if the parent
    (``parent_pid``) is already gone (it died before the request took effect). The signal follows the thread
    that started the child, not its process. Elsewhere, or where libc has no ``prctl``, a no-op (the callers'
    pipes and sockets end idle children). Raises nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl in this libc (musl builds have it; odd ones may not)
        return
    if os.getppid() != parent_pid:
        os._exit(exit_code)
