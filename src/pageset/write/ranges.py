"""Encoding a source in contiguous index ranges, here, in forked workers, or on any executor via shard files.

A range task is a pure module-level function of (source part, fields, range): run twice, it produces the same
bytes. With an executor (Dask, Ray, a ``ProcessPoolExecutor``), each task writes its range to a shard file at
a shared destination (a local folder or an fsspec URL) named by the range, ``<start>-<stop>.shard``: a retried
task overwrites its shard, never adds one. The assembly reads the shards in range order.

Shard file (private to one write, deleted after it): ``b"PGSHARD1"``, u64 little-endian length of a JSON
header, the header (``{"arrays": [[name, nbytes], ...], "crc32": ..., ...}``), then the arrays back to back.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import pickle
import secrets
import socket
import traceback
import zlib

import numpy as np

from ..format.fields import Field
from ..format.store_errors import one_try_options
from .assemble import EncodedRange
from .encode import describe_path, encode_value
from .disk import DiskFile, disk_error
from .output import is_url, local_path
from .sources import SampleError, Source

SHARD_MAGIC = b"PGSHARD1"
READ_BLOCK = 8 << 20  # bytes per read when streaming a shard back


def cut(n: int, size: int) -> list[tuple[int, int]]:
    """Contiguous ranges ``[(start, stop), ...]`` of at most ``size`` samples covering ``[0, n)``."""
    return [(s, min(s + size, n)) for s in range(0, n, size)]


# ---- encoding one range ---------------------------------------------------------------------------------

def encode_sample(src: Source, fields: dict[str, Field], i: int) -> tuple[list, dict]:
    """Encode sample ``i``: ``(payloads of the non-inline fields in order, {index column: value})``."""
    try:
        values = src.sample(i)
    except SampleError:
        raise
    except Exception as exc:
        raise SampleError(src.description, i, None, f"reading the sample raised {type(exc).__name__}: {exc}") from exc
    payloads, columns = [], {}
    for name, fld in fields.items():
        try:
            payload, cols = encode_value(values[name], fld)
        except Exception as exc:
            where = describe_path(values[name])  # the path, unless the message already names it
            detail = f"{type(exc).__name__}: {exc}" + (where if where.strip(" ()") not in str(exc) else "")
            raise SampleError(src.description, i, name, detail) from exc
        if payload is not None:
            payloads.append(payload)
        for suffix, value in cols.items():
            columns[f"{name}.{suffix}" if suffix else name] = value
    return payloads, columns


def encode_range(src: Source, fields: dict[str, Field], row_dtype: np.dtype, start: int, stop: int,
                 on_error: str, in_process: bool = False) -> EncodedRange:
    """Encode samples ``[start, stop)`` of ``src`` into an :class:`EncodedRange`. With ``on_error="raise"`` the
    first bad sample ends the range: returned as ``error`` with its traceback text (for a worker, whose
    exception would lose its chain on the way back), or raised as SampleError when ``in_process``."""
    rows = np.zeros(stop - start, dtype=row_dtype)
    blob = io.BytesIO()
    skipped: list = []
    count = 0
    span_names = [name for name, fld in fields.items() if not fld.inline]
    for i in range(start, stop):
        try:
            payloads, cols = encode_sample(src, fields, i)
        except SampleError as exc:
            if on_error == "skip":
                skipped.append({"index": exc.index, "field": exc.field, "error": exc.detail})
                continue
            if in_process:
                raise
            # The cause's traceback only: the SampleError around it adds nothing but its message.
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            tb = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
            return EncodedRange(start, stop, rows[:count], blob.getvalue(), skipped,
                                (exc.index, exc.field, exc.detail, tb, exc.source))
        row = rows[count]
        row["_length"] = sum(len(p) for p in payloads)
        for name, payload in zip(span_names, payloads):
            row[f"{name}.length"] = len(payload)
            blob.write(payload)
        for col, value in cols.items():
            row[col] = value
        count += 1
    return EncodedRange(start, stop, rows[:count], blob.getvalue(), skipped, None)


# ---- shard files -----------------------------------------------------------------------------------------

def _fs(url: str, storage_options: dict | None):
    from fsspec.core import url_to_fs

    return url_to_fs(url, **one_try_options(url, storage_options))


def shard_name(folder: str, start: int, stop: int) -> str:
    return f"{folder.rstrip('/')}/{start:012d}-{stop:012d}.shard"


MARKER = "_writing"  # present in a shard folder while its write is running


def _exists(url: str, storage_options: dict | None) -> bool:
    if is_url(url):
        fs, path = _fs(url, storage_options)
        fs.invalidate_cache()
        return fs.exists(path)
    return os.path.exists(local_path(url))


def _remove(url: str, storage_options: dict | None) -> None:
    try:
        if is_url(url):
            fs, path = _fs(url, storage_options)
            fs.rm(path)
        else:
            os.unlink(local_path(url))
    except FileNotFoundError:
        pass


def write_shard(url: str, header: dict, arrays: list[tuple[str, object]], storage_options: dict | None) -> int:
    """Write a shard atomically where the store allows (local: temp + rename; S3: one PUT or a completed
    multipart upload). Returns its size in bytes.

    A task still running when its job failed (engines cannot stop a running task) finds the folder's marker gone
    after writing and deletes its own shard: the job removed the marker before the folder, so no shard outlives
    the cleanup."""
    folder = url.rsplit("/", 1)[0]
    if not is_url(folder) and not os.path.isdir(local_path(folder)):
        raise FileNotFoundError(
            f"shard folder {folder} does not exist on worker host {socket.gethostname()}: either its write has "
            "ended, or the folder is not on storage shared with the workers; pass shard_dir= a shared folder or "
            "an fsspec URL (s3://bucket/tmp) that every worker can write")
    try:
        size = _write_shard(url, header, arrays, storage_options)
    except Exception as exc:
        if not is_url(url) or getattr(exc, "pageset_store_error", False):
            raise
        err = shard_error(exc, folder, f"writing a shard on worker host {socket.gethostname()}")
        if err is exc:
            raise
        raise err from None  # the store's traceback does not pickle well through engines; the message says it
    if not _exists(f"{folder}/{MARKER}", storage_options):
        _remove(url, storage_options)
        if not is_url(folder):
            try:
                os.rmdir(local_path(folder))
            except OSError:
                pass
        raise RuntimeError(f"{folder}: the write this shard belongs to has ended; shard discarded")
    return size


def _write_shard(url: str, header: dict, arrays: list[tuple[str, object]], storage_options: dict | None) -> int:
    views = [(name, memoryview(a).cast("B")) for name, a in arrays]
    crc = 0
    for _, v in views:
        crc = zlib.crc32(v, crc)
    head = json.dumps(dict(header, arrays=[[n, len(v)] for n, v in views], crc32=crc)).encode()
    prefix = SHARD_MAGIC + len(head).to_bytes(8, "little") + head
    size = len(prefix) + sum(len(v) for _, v in views)
    if is_url(url):
        fs, path = _fs(url, storage_options)
        # One call for the whole object (S3: one PUT, or a multipart upload completed only at its end), so a task
        # killed midway leaves nothing readable under the shard's name.
        from .upload import pipe_bounded

        pipe_bounded(fs, path, b"".join([prefix] + [v.tobytes() for _, v in views]), url.rsplit("/", 1)[0],
                     f"writing a shard on worker host {socket.gethostname()} in shard_dir")
        return size
    path = local_path(url)
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with DiskFile(tmp, "wb", tmp, f"a shard (on worker host {socket.gethostname()})",
                      "another shard_dir (a folder every worker can write)") as f:
            f.write(prefix)
            for _, v in views:
                f.write(v)
        try:
            os.replace(tmp, path)  # a retried or duplicated task replaces the shard with the same bytes
        except OSError as exc:
            raise disk_error(exc, path, size, f"a shard (renaming {tmp} over it)", "another shard_dir") from exc
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return size


class Shard:
    """A shard opened for reading: ``header`` (dict), then each array in the order written, whole
    (:meth:`read`) or streamed (:meth:`begin`, then :meth:`take` pieces); the CRC-32 and size are checked at the
    end (:meth:`close`). Raises ValueError naming the shard when it is damaged or truncated."""

    def __init__(self, url: str, storage_options: dict | None, expect_size: int | None = None):
        self.url = url
        if is_url(url):
            fs, path = _fs(url, storage_options)
            self.f = fs.open(path, "rb", block_size=READ_BLOCK)
        else:
            self.f = open(local_path(url), "rb")
        try:
            magic = self.f.read(8)
            if magic != SHARD_MAGIC:
                raise ValueError(f"{url}: not a pageset shard (magic {magic!r}); it was changed or truncated by "
                                 "something other than this write")
            n = int.from_bytes(self.f.read(8), "little")
            self.header = json.loads(self.f.read(n))
        except BaseException:
            self.f.close()
            raise
        self.sizes = collections.OrderedDict((name, nbytes) for name, nbytes in self.header["arrays"])
        self.expect_size = expect_size
        self.crc = 0
        self.total = 16 + n

    def begin(self, name: str) -> int:
        """Start reading array ``name`` (the next one written); returns its size in bytes."""
        if not self.sizes:
            raise ValueError(f"{self.url}: no array {name!r} in the shard")
        want, nbytes = self.sizes.popitem(last=False)
        if want != name:
            raise ValueError(f"{self.url}: expected array {want!r} next, asked for {name!r}")
        return nbytes

    def read(self, name: str) -> bytes:
        """The whole of array ``name``."""
        return self._read_exact(self.begin(name))

    def take(self, nbytes: int) -> bytes:
        """The next ``nbytes`` of the current array (for streaming a large array record by record)."""
        return self._read_exact(nbytes)

    def _read_exact(self, nbytes: int) -> bytes:
        data = self.f.read(nbytes)
        if len(data) != nbytes:
            raise ValueError(f"{self.url}: truncated shard (wanted {nbytes} bytes at {self.total}, got {len(data)})")
        self.crc = zlib.crc32(data, self.crc)
        self.total += nbytes
        return data

    def close(self, check: bool = True) -> None:
        try:
            if check:
                if self.crc != self.header["crc32"]:
                    raise ValueError(f"{self.url}: shard checksum mismatch (CRC-32 {self.crc:08x}, written "
                                     f"{self.header['crc32']:08x}); a task's output was damaged in transit")
                if self.expect_size is not None and self.total != self.expect_size:
                    raise ValueError(f"{self.url}: shard has {self.total} bytes, its task wrote {self.expect_size}")
        finally:
            self.f.close()


def encode_range_to_shard(src: Source, fields: dict[str, Field], row_dtype: np.dtype, start: int, stop: int,
                          on_error: str, folder: str, storage_options: dict | None) -> dict:
    """Executor task: encode ``[start, stop)`` and write shard ``<folder>/<start>-<stop>.shard``.

    Returns a small summary ``{"url", "bytes", "records"}`` (the data travels through the shard, not through the
    executor), or ``{"error": (index, field, detail, traceback)}`` when a sample is bad and on_error="raise".
    """
    part = encode_range(src, fields, row_dtype, start, stop, on_error)
    if part.error is not None:
        return {"error": part.error}
    url = shard_name(folder, start, stop)
    size = write_shard(url, {"kind": "records", "start": start, "stop": stop, "records": len(part.rows),
                             "skipped": part.skipped},
                       [("rows", part.rows.tobytes()), ("payloads", part.blob)], storage_options)
    return {"url": url, "bytes": size, "records": len(part.rows)}


class ShardPart:
    """An :class:`EncodedRange` read back from a shard, streaming payloads record by record."""

    def __init__(self, summary: dict, row_dtype: np.dtype, storage_options: dict | None):
        self.error = tuple(summary["error"]) if "error" in summary else None
        self.rows, self.skipped, self._shard = np.zeros(0, row_dtype), [], None
        if self.error is not None:
            return
        self._shard = Shard(summary["url"], storage_options, summary["bytes"])
        try:
            self.skipped = self._shard.header["skipped"]
            self.rows = np.frombuffer(self._shard.read("rows"), dtype=row_dtype)
            self._shard.begin("payloads")  # streamed record by record in payloads()
        except BaseException:
            self._shard.close(check=False)
            raise
        if len(self.rows) != summary["records"]:
            self._shard.close(check=False)
            raise ValueError(f"{summary['url']}: {len(self.rows)} records, its task wrote {summary['records']}")

    def payloads(self):
        try:
            for length in self.rows["_length"].tolist():
                yield self._shard.take(length)
        except BaseException:
            self._shard.close(check=False)
            raise
        self._shard.close()


# ---- executors ---------------------------------------------------------------------------------------------

def shard_error(exc: BaseException, folder: str, what: str) -> BaseException:
    """A store failure on a shard URL as an error naming ``folder``, that it is the shard folder (shard_dir), and
    the fix (credentials reach workers through storage_options); ``exc`` itself when it is not a store failure
    it knows."""
    from .upload import classify

    err = classify(exc, folder, f"{what} in shard_dir")
    if err is None:
        return OSError(f"{folder}: {what} in shard_dir failed ({type(exc).__name__}: {exc}); shard_dir must be "
                       "a folder or URL every worker can write (check its endpoint and credentials in "
                       "storage_options)")
    return err


def new_shard_folder(output: str, shard_dir: str | None, storage_options: dict | None = None) -> str:
    """A fresh folder (or URL prefix) for one write's shards: ``<shard_dir or output>.shards-<host>-<pid>-<hex>``.

    Local folders are created here; object stores need none. The host and pid let ``pageset clean`` and later
    writes remove the shards of a killed job."""
    base = shard_dir.rstrip("/") + "/" + os.path.basename(output.rstrip("/")) if shard_dir else output
    name = f"{base}.shards-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    if is_url(name):
        if name.lower().startswith(("http://", "https://")):
            raise ValueError(f"shard_dir {shard_dir or output!r}: http(s) URLs are read-only; pass shard_dir= a "
                             "folder or an object store URL (s3://bucket/tmp) that every worker can write")
        try:
            from .upload import pipe_bounded

            fs, path = _fs(name, storage_options)
            pipe_bounded(fs, f"{path}/{MARKER}", b"", name, "creating the shard folder in shard_dir")
        except Exception as exc:
            if getattr(exc, "pageset_store_error", False):
                raise
            err = shard_error(exc, name, "creating the shard folder")
            if err is exc:
                raise
            raise err from exc
    else:
        try:
            os.makedirs(local_path(name))
            open(os.path.join(local_path(name), MARKER), "wb").close()
        except OSError as exc:
            raise disk_error(exc, os.path.join(local_path(name), MARKER), 0, "the shard folder of the output "
                             f"{output}", "another shard_dir (shard_dir=, a folder every worker can write)") from exc
    return name


def remove_shard_folder(folder: str, storage_options: dict | None) -> None:
    """Delete one write's shard folder and everything in it (missing is fine): the marker first, so that tasks
    still running discard what they write (see :func:`write_shard`)."""
    _remove(f"{folder}/{MARKER}", storage_options)
    if is_url(folder):
        fs, path = _fs(folder, storage_options)
        try:
            if fs.exists(path) or fs.ls(path, detail=False):
                fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        return
    import shutil

    shutil.rmtree(local_path(folder), ignore_errors=True)


def dumps_for(executor):
    """The pickler ``executor`` uses: cloudpickle for Dask and Ray (when installed), else ``pickle.dumps``."""
    mod = type(executor).__module__ or ""
    if mod.split(".")[0] in ("distributed", "ray", "dask"):
        try:
            import cloudpickle

            return cloudpickle.dumps
        except ImportError:
            pass
    return pickle.dumps


_LOADED: dict = {}


def pickled_once(obj, executor) -> tuple[str, bytes] | None:
    """``obj`` pickled once here, for tasks that would otherwise each unpickle it anew (a tokenizer: ~0.3 s)."""
    if obj is None:
        return None
    blob = dumps_for(executor)(obj)
    return hashlib.sha256(blob).hexdigest(), blob


def unpickled(ref: tuple[str, bytes] | None):
    """The object of :func:`pickled_once`, unpickled once per worker process (the latest one is kept)."""
    if ref is None:
        return None
    digest, blob = ref
    if digest not in _LOADED:
        _LOADED.clear()
        _LOADED[digest] = pickle.loads(blob)
    return _LOADED[digest]


def check_picklable(obj, what: str, executor) -> None:
    """TypeError naming the innermost part of ``obj`` (attribute, key or item) that cannot be pickled, for
    work sent to an executor. Dask and Ray pickle with cloudpickle (lambdas and local classes are fine there);
    other executors with the standard pickle."""
    found = _unpicklable(obj, what, dumps_for(executor), 0)
    if found is not None:
        where, kind, exc = found
        raise TypeError(
            f"executor= sends the source to worker processes, but {where} ({kind}) cannot be pickled "
            f"({type(exc).__name__}: {exc}). Keep only paths, URLs and plain values in the source and open files, "
            "connections or handles lazily inside __getitem__ (or write with num_workers= on one machine, "
            "which forks and needs no pickling)"
        )


def _unpicklable(obj, where: str, dumps, depth: int):
    try:
        dumps(obj)
        return None
    except Exception as exc:  # pickle raises TypeError, PicklingError, AttributeError...
        error = exc
    if depth < 6:
        if isinstance(obj, dict):
            children = [(f"{where}[{k!r}]", v) for k, v in list(obj.items())[:10_000]]
        elif isinstance(obj, (list, tuple)):
            children = [(f"{where}[{k}]", v) for k, v in enumerate(obj[:10_000])]
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            children = [(f"{where}.{k}", v) for k, v in vars(obj).items()]
        else:
            children = []
        for child_where, child in children:
            found = _unpicklable(child, child_where, dumps, depth + 1)
            if found is not None:
                return found
    return where, type(obj).__name__, error
