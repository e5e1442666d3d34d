"""The one file a writer produces (:class:`Output`: a temp file renamed over the path, or an upload completed at
the end), its temp names and the cleanup of those of killed writers, and the checks of an output path made before
any work (the folder exists, the output is not the input, an existing file is a pageset file)."""

from __future__ import annotations

import glob
import os
import socket
import tempfile

from ..format import constants as C
from ..format.store_errors import one_try_options
from .disk import DiskFile, disk_error, fsync_dir

def _umask() -> int:
    """The process umask, read without changing it where Linux allows (``/proc/self/status``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: the only portable way to read it is to set it back at once
    os.umask(mask)
    return mask


def _tag() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def temp_file(path: str, kind: str = "tmp") -> tuple[int, str]:
    """Create ``<path>.<kind>-<host>-<pid>-<random>`` next to ``path``: (fd, name), readable per the umask.

    The host and pid in the name let a later write remove temp files of writers that were killed (SIGKILL, node
    loss) before they could clean up (:func:`remove_stale_temps`).
    """
    folder = os.path.dirname(os.path.abspath(check_output_path(path)))
    fd, name = tempfile.mkstemp(prefix=f"{os.path.basename(path)}.{kind}-{_tag()}-", dir=folder)
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would make shared datasets unreadable to other users
    return fd, name


def writer_alive(host: str, pid: int) -> bool | None:
    """Whether the writer process ``pid`` on ``host`` may still run: on this host True (a process with that pid
    exists, this user's or another's: it may be a reused pid) or False (none); None for another host (its
    processes cannot be seen from here). The live-writer check of the temp files a write leaves
    (:func:`remove_stale_temps`) and of a many-file set's lock where the file system has no locks
    (``write/setlock.py``)."""
    if host != socket.gethostname():
        return None
    if pid <= 0:  # 0 and negative pids name process groups, not a writer
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):  # not a pid at all
        return False
    return True


def remove_stale_temps(path: str, every_host: bool = False) -> list[str]:
    """Delete what writes of ``path`` left behind when killed: temp files (``<path>.tmp-*``, ``.spill-*``) and
    shard folders (``<path>.shards-*``) of dead writer processes on this host, and with ``every_host=True`` those
    of writers on any host (their liveness cannot be checked from here). Returns the names removed."""
    import shutil

    host = socket.gethostname()
    removed = []
    for kind in ("tmp", "spill", "shards"):
        prefix = os.path.abspath(path) + f".{kind}-"
        pattern = glob.escape(prefix) + ("*-*-*" if every_host else f"{glob.escape(host)}-*-*")
        for name in glob.glob(pattern):
            try:
                writer_host, pid, _ = name[len(prefix):].rsplit("-", 2)
                pid = int(pid)
            except ValueError:
                continue
            if writer_host == host and writer_alive(writer_host, pid):
                continue  # that writer is alive (or the pid was reused): leave it
            try:
                if os.path.isdir(name):
                    shutil.rmtree(name)
                else:
                    os.unlink(name)
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def check_output_path(path) -> str:
    """``path`` (str or os.PathLike) as a str, if its folder exists (fsspec URLs other than ``file://`` pass
    unchecked); TypeError / FileNotFoundError otherwise.

    Called first by every writer, so that a missing folder is reported as such before any work (and not as a
    missing temp file once the work is done)."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be the output file's path (str or os.PathLike), got {path!r} "
                        f"({type(path).__name__})")
    path = os.fspath(path)
    if not path or path.endswith(os.sep):
        raise ValueError(f"path must name a file, got {path!r}")
    if is_url(path):
        if path.lower().startswith(("http://", "https://")):
            raise ValueError(f"cannot write {path}: http(s) URLs are read-only; write to a local path or an object "
                             "store URL (s3://, gs://, az://, ...), then serve that file over HTTP if you like")
        return path  # an object store: no folder to check
    local = local_path(path)
    folder = os.path.dirname(os.path.abspath(local))
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise FileNotFoundError(f"cannot write {path}: the output folder {folder} {what}; create it first "
                                f"(e.g. os.makedirs({folder!r}, exist_ok=True))")
    if os.path.isdir(local):
        raise IsADirectoryError(f"cannot write {path}: it is a folder; give a file name, e.g. "
                                f"{os.path.join(local, 'train.pageset')}")
    return path


def check_replaceable(path: str, call: str, storage_options: dict | None = None, policy=None,
                      inputs=()) -> None:
    """ValueError when the output ``path`` exists, is not empty and is not a pageset file.

    Every writer replaces its output whole; a call with the output and the source swapped (``call`` shows the
    right order, e.g. ``"write_tokens(path, source, tokenizer)"``) would otherwise replace the user's source
    file (a corpus, a photo, a file list) with a pageset file. Empty files pass. A URL's first bytes are read
    through fsspec (``storage_options``; every request bounded by ``policy``, a
    :class:`~pageset.write.upload.WritePolicy`), and the URL must not be one of the URL ``inputs``; see
    :func:`~pageset.write.upload.check_url_output` for the errors about buckets, credentials and timeouts."""
    if is_url(path):
        from .upload import check_url_output

        check_url_output(path, storage_options, call, policy, [os.fspath(p) for p in inputs
                                                              if isinstance(p, (str, os.PathLike))])
        return
    local = local_path(path)
    if not os.path.isfile(local) or os.path.getsize(local) == 0:
        return
    with open(local, "rb") as f:
        if f.read(len(C.MAGIC)) == C.MAGIC:
            return
    raise ValueError(f"the output {path} exists and is not a pageset file: refusing to replace it (are the "
                     f"arguments swapped? the order is {call}); remove it or choose another output path")


def check_not_input(path: str, inputs) -> None:
    """ValueError when the output ``path`` is one of the ``inputs`` (writing would destroy the source)."""
    if is_url(path):
        for src in inputs:
            if isinstance(src, str) and src.rstrip("/") == path.rstrip("/"):
                raise ValueError(f"the output {path!r} is the input {src!r}: writing would destroy the source; "
                                 "choose another output path")
        return
    out = os.path.realpath(path)
    for src in inputs:
        if isinstance(src, (str, os.PathLike)) and os.path.realpath(src) == out:
            raise ValueError(f"the output {os.fspath(path)!r} is the input {os.fspath(src)!r}: writing would destroy "
                             "the source; choose another output path")


def is_url(path: str) -> bool:
    """True for an fsspec URL (``s3://``, ``gs://``, ``memory://``...); ``file://`` and plain paths are local."""
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


UPLOAD_BLOCK = 64 << 20  # bytes per block of the other fsspec stores' uploads (S3 gets a growing PartPlan)


class Output:
    """The one file a writer produces, made visible only by :meth:`commit`.

    A local ``path``: a temp file ``<path>.tmp-<host>-<pid>-<random>`` next to it, fsynced and renamed over
    ``path``. An ``s3://`` URL: one multipart upload streamed while the file is assembled, no local copy
    (:class:`~pageset.write.upload.S3PartsFile`), completed on commit: S3 makes the object visible only then,
    whole. Other fsspec URLs: a temp file ``pageset-upload-<host>-<pid>-*`` in the local temp folder
    (``TMPDIR``), uploaded on commit through ``fsspec`` with ``autocommit=False``. On failure the upload is
    aborted; either way the previous file or object at ``path`` is untouched until the commit. ``f`` is the
    binary file to write (seekable forward; the first ``parts.size(1)`` bytes, 64 MiB by default, may be
    rewritten); :meth:`abort` removes what was written. ``storage_options`` go to ``fsspec.core.url_to_fs``;
    ``policy`` (a :class:`~pageset.write.upload.WritePolicy`) bounds every S3 request; ``parts`` (a
    :class:`~pageset.write.upload.PartPlan`) sizes the S3 parts; ``min_size``, a lower bound of the file's size in
    bytes where the writer knows one, refuses an S3 output over 5 TiB before the upload starts (ValueError).
    """

    def __init__(self, path: str, storage_options: dict | None = None, kind: str = "tmp", parts=None,
                 policy=None, min_size: int = 0):
        self.path, self.storage_options = path, dict(storage_options or {})
        self.upload_block = UPLOAD_BLOCK
        self.remote = is_url(path)
        self.stream = None
        if self.remote:
            from fsspec.core import url_to_fs

            fs, target = url_to_fs(self.path, **one_try_options(self.path, self.storage_options))
            if callable(getattr(fs, "call_s3", None)):
                from .upload import S3PartsFile

                self.tmp = None
                self.f = self.stream = S3PartsFile(fs, target, parts, url=self.path, policy=policy,
                                                   min_size=min_size)
                return
            fd, self.tmp = tempfile.mkstemp(prefix=f"pageset-upload-{_tag()}-", suffix=".pageset")
            what, choose = f"the local copy of {self.path} (uploaded at the end)", "another temp folder (TMPDIR)"
        else:
            self.path = local_path(path)
            remove_stale_temps(self.path)
            fd, self.tmp = temp_file(self.path, kind)
            what, choose = f"the output {self.path} (its temp file)", "another output path"
        try:
            self.f = DiskFile(fd, "w+b", self.tmp, what, choose)
        except BaseException:
            os.close(fd)
            os.unlink(self.tmp)
            raise

    def commit(self) -> None:
        """fsync and rename (local) or upload and complete (URL); removes the temp file either way."""
        if self.stream is not None:
            try:
                self.stream.complete()
            finally:
                self.stream.abort()  # a no-op once completed
            return
        try:
            self.f.flush()
            if self.remote:
                self._upload()
            else:
                self.f.fsync()
                self.f.close()
                try:
                    os.replace(self.tmp, self.path)
                except OSError as exc:
                    raise disk_error(exc, self.path, self.f.written, f"the output {self.path} (renaming "
                                     f"{self.tmp} over it)", "another output path") from exc
                fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        finally:
            self.abort()

    def _upload(self) -> None:
        from fsspec.core import url_to_fs

        fs, target = url_to_fs(self.path, **one_try_options(self.path, self.storage_options))
        self.f.seek(0)
        dst = fs.open(target, "wb", block_size=self.upload_block, autocommit=False)
        try:
            for block in iter(lambda: self.f.read(self.upload_block), b""):
                dst.write(block)
            dst.close()  # uploads the last part; nothing is visible before commit()
            dst.commit()  # S3: complete_multipart_upload (or one PUT for a file smaller than a part)
        except BaseException:
            try:
                if not dst.closed:
                    dst.close()
            except Exception:  # the store is failing already: abort below is what matters
                pass
            dst.discard()  # S3: abort_multipart_upload, so no part is left billed or visible
            raise

    def abort(self) -> None:
        try:
            if isinstance(self.f, DiskFile):
                self.f.discard()
            else:
                self.f.close()  # S3PartsFile: abort_multipart_upload
        finally:
            if self.tmp is not None:
                try:
                    os.unlink(self.tmp)
                except FileNotFoundError:
                    pass
