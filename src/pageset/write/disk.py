"""Files written to disk whose OSErrors say where: the file, its folder and the space free there, the bytes
written so far, and the fix (:func:`disk_error`, :class:`DiskFile`); ``fsync_dir``."""

from __future__ import annotations

import errno
import os
import shutil

def disk_error(exc: OSError, name: str, written: int, what: str, choose: str, pending: int = 0) -> OSError:
    """``exc``, an OSError of writing the file ``name`` (``what`` it is, e.g. "the temp file of the output
    x.pageset") after ``written`` bytes (while writing ``pending`` more, where known), as an OSError of the same
    errno (and subclass) whose message names the file, its folder and the space free there, the bytes written so
    far, and the fix: free space or ``choose`` another folder (e.g. "another output path"). The caller raises it
    ``from exc``. An error made here already is returned as is."""
    if getattr(exc, "pageset_where", False) or not isinstance(exc, OSError):
        return exc
    folder = os.path.dirname(os.path.abspath(name))
    try:
        du = shutil.disk_usage(folder)
        space = f"{du.free:,} bytes free of {du.total:,}"
    except OSError:
        space = "free space unknown"
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free space in {folder} (or raise the quota there), or choose {choose} on a disk with room"
    elif exc.errno == errno.EFBIG:
        fix = f"the file system or the process (ulimit -f) limits file sizes: choose {choose} without that limit"
    else:
        fix = f"check that {folder} is writable and its disk healthy, or choose {choose}"
    more = f" (writing {pending:,} more)" if pending else ""
    err = OSError(exc.errno, f"{reason}: writing {what} failed after {written:,} bytes written{more}, at {name} "
                             f"(folder {folder}: {space}); {fix}")
    err.pageset_where = True
    return err


def _open_raw(target, mode: str, name: str):
    """``open(target, mode)`` for a path or fd: the one place written files are opened (tests inject disk errors
    here)."""
    return open(target, mode)


class DiskFile:
    """A binary file open for writing (and reading back) at ``name``, whose OSErrors say where
    (:func:`disk_error`: ``what`` the file is, the folder and free space, the bytes written so far, and the fix:
    free space or ``choose`` another folder). ``written`` counts the bytes written."""

    def __init__(self, target, mode: str, name: str, what: str, choose: str):
        self.name, self.what, self.choose, self.written = name, what, choose, 0
        self.f = _open_raw(target, mode, name)

    def _error(self, exc: OSError, pending: int = 0) -> OSError:
        written = self.written
        try:  # what reached the file (a failed write may have written part of its bytes)
            written = max(written, os.fstat(self.f.fileno()).st_size)
        except (OSError, ValueError):
            pass
        return disk_error(exc, self.name, written, self.what, self.choose, pending)

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as exc:
            raise self._error(exc, memoryview(data).nbytes) from exc
        self.written += n
        return n

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except OSError as exc:
            raise self._error(exc) from exc

    def seek(self, pos: int, whence: int = 0) -> int:
        return self._call(self.f.seek, pos, whence)

    def tell(self) -> int:
        return self.f.tell()

    def truncate(self, size: int | None = None) -> int:
        return self._call(self.f.truncate, size)

    def read(self, n: int = -1) -> bytes:
        return self._call(self.f.read, n)

    def flush(self) -> None:
        self._call(self.f.flush)

    def fsync(self) -> None:
        """Flush and ``os.fsync``: the bytes are on the disk (or the error says where they are not)."""
        self._call(self.f.flush)
        self._call(os.fsync, self.f.fileno())

    def fileno(self) -> int:
        return self.f.fileno()

    @property
    def closed(self) -> bool:
        return self.f.closed

    def close(self) -> None:
        self._call(self.f.close)

    def discard(self) -> None:
        """Close without raising: the file is being removed (closing flushes, which fails again on a full disk)."""
        try:
            self.f.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        else:
            self.discard()


def fsync_dir(folder: str) -> None:
    try:
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
