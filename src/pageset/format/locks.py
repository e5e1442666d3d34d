"""Advisory locks in a local many-file set's folder (``formats/manyfile.md`` section 9), with ``flock(2)``.

A writer holds ``pageset.lock`` exclusively while it writes (``write/setlock.py``); a reader holds a shared lock
on the manifest file it read for as long as it reads (``read/set_manifest.py``); a writer that replaced the manifest
keeps the old one under ``pageset.manifest.json.retired-<generation>`` (a second name of the same file) and
removes that generation's members only once it can lock that file exclusively, i.e. when no reader holds it.

``flock`` locks belong to an open file (shared by forked children) and are released by the kernel when the last
descriptor closes, a SIGKILL included: a dead process never leaves a lock held. Linux NFS clients turn them into
byte-range locks that the server sees (NFSv4: across hosts). Where a file system refuses them, :func:`flock`
says so (None) and each caller falls back as its docstring says.
"""

from __future__ import annotations

import errno
import os

LOCK_NAME = "pageset.lock"  # the writer lock; its content: JSON {"host", "pid", "started", "call"} of its writer
RETIRED_MARK = ".retired-"  # "pageset.manifest.json.retired-<generation>": a replaced manifest readers may hold

# errors meaning "no locks here" (a file system without flock, an NFS mount with nolock, FUSE file systems)
UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


def flock(fd: int, op: str) -> bool | None:
    """Lock or unlock the open file ``fd``. ``op``: ``"shared"`` or ``"exclusive"`` (waiting for it), ``"try"``
    (exclusive, without waiting), ``"unlock"``. Returns True when done, False when ``"try"`` found the file locked
    by another open file, None when locks are not supported here (no ``fcntl`` module, or the file system refuses:
    ENOLCK, EOPNOTSUPP, ENOSYS, EINVAL). Other OSErrors are raised (e.g. EBADF: an exclusive lock asked on a
    descriptor opened read-only, which NFS refuses)."""
    try:
        import fcntl
    except ImportError:  # Windows
        return None
    flag = {"shared": fcntl.LOCK_SH, "exclusive": fcntl.LOCK_EX, "try": fcntl.LOCK_EX | fcntl.LOCK_NB,
            "unlock": fcntl.LOCK_UN}[op]
    try:
        fcntl.flock(fd, flag)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in UNSUPPORTED:
            return None
        raise
    return True


def same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (same device and inode); False when it is gone."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)


def retired_name(manifest_name: str, generation: int) -> str:
    return f"{manifest_name}{RETIRED_MARK}{int(generation):04d}"


__all__ = ["LOCK_NAME", "RETIRED_MARK", "flock", "retired_name", "same_file"]
