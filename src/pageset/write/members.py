"""Writing a many-file dataset (``formats/manyfile.md``): member files written by the tasks themselves, then
one manifest, written last and atomically.

Each task encodes one member's range of the source into a complete pageset v1 file and makes it visible itself
(local: temp file + fsync + rename; an fsspec URL: one upload completed at its end), returning only a small
summary (:func:`summary`). Nothing of the data passes through the calling process. The caller then writes the
manifest (:func:`commit_manifest`): local, a temp file fsynced and renamed over ``pageset.manifest.json``; on
an object store one PUT, after every member exists. A reader therefore sees the old set or the new one.

Member cuts are a pure function of the source and the settings (``records_per_member`` samples, or groups of
whole input files / documents of ``member_bytes``), and member names a function of the manifest generation and
the member's position, so any executor, worker count or retry writes the same members.
"""

from __future__ import annotations

import errno
import os
import socket
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from ..format import constants as C
from ..format import locks
from ..format.errors import FormatError
from ..format.manifest import (
    MANIFEST_NAME,
    MEMBER_RE,
    Member,
    build_manifest,
    common_schema,
    member_name,
    parse_manifest,
    schema_difference,
    schema_digest,
)
from ..format.store_errors import one_try_options
from .disk import fsync_dir
from .output import Output, is_url, local_path, temp_file
from .setlock import lock_set

TMP_MARK = ".tmp-"  # temp files of members and of the manifest: "<name>.tmp-<host>-<pid>-<random>"


def join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}" if is_url(folder) else os.path.join(local_path(folder), name)


def _fs(url: str, storage_options: dict | None):
    from fsspec.core import url_to_fs

    return url_to_fs(url, **one_try_options(url, storage_options))


# ---- the folder ---------------------------------------------------------------------------------------------

def list_names(folder: str, storage_options: dict | None) -> list[str]:
    """The file names directly in ``folder`` (an empty list when it does not exist)."""
    if is_url(folder):
        fs, path = _fs(folder, storage_options)
        fs.invalidate_cache()
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
        except FileNotFoundError:
            return []
    try:
        return sorted(os.listdir(local_path(folder)))
    except FileNotFoundError:
        return []


def read_manifest(folder: str, storage_options: dict | None = None):
    """The folder's current :class:`~pageset.format.manifest.Manifest`, or None when it has none. Raises
    FormatError naming the manifest when it is damaged."""
    url = join(folder, MANIFEST_NAME)
    try:
        if is_url(folder):
            fs, path = _fs(url, storage_options)
            fs.invalidate_cache()
            raw = fs.cat_file(path)
        else:
            with open(url, "rb") as f:
                raw = f.read()
    except FileNotFoundError:
        return None
    return parse_manifest(raw, url)


def is_stray(name: str) -> bool:
    """A name a writer of many-file sets makes (a member or a temp file of one, a manifest temp file)."""
    base = name.split(TMP_MARK, 1)[0]
    return bool(MEMBER_RE.match(base)) or (base == MANIFEST_NAME and TMP_MARK in name)


def is_own(name: str) -> bool:
    """A name pageset makes in a set's folder: a stray's (:func:`is_stray`), the writer lock, a retired manifest."""
    return is_stray(name) or name == locks.LOCK_NAME or name.startswith(MANIFEST_NAME + locks.RETIRED_MARK)


@dataclass
class CleanReport:
    """What :func:`clean_set` did: ``removed`` (paths of members, temp files, aborted uploads), ``retired`` (paths
    of replaced manifests no reader holds any more, removed), ``kept`` (``(generation, members)`` of replaced sets
    a reader still reads: their members stay)."""

    removed: list = field(default_factory=list)
    retired: list = field(default_factory=list)
    kept: list = field(default_factory=list)


def clean_set(folder: str, storage_options: dict | None = None, manifest=None,
              every_host: bool = False) -> CleanReport:
    """Remove what killed or failed writes left in ``folder`` (:func:`clean_folder`), saying also which replaced
    sets were kept for their readers and which were let go. ``every_host``: where the file system has no locks,
    a lock file naming a process of another host (whose liveness cannot be checked from here) does not stop it.
    Raises :class:`~pageset.write.setlock.SetBusyError` as :func:`clean_folder`."""
    if not is_url(folder) and not os.path.isdir(local_path(folder)):
        return CleanReport()
    lock = lock_set(folder, "pageset clean", wait=False, every_host=every_host)
    try:
        if manifest is None:
            manifest = read_manifest(folder, storage_options)
        report = CleanReport()
        _remove_strays(folder, storage_options, manifest, report)
        return report
    finally:
        lock.release()


def clean_folder(folder: str, storage_options: dict | None = None, manifest=None) -> list[str]:
    """Remove what killed or failed writes left in ``folder``: member files (``m<generation>-<k>.pageset``) that
    the current manifest does not list (nor a replaced manifest a reader still holds: formats/manyfile.md
    section 9), temp files of members and of the manifest, and on S3 the incomplete multipart uploads of such
    members (a writer killed mid-upload leaves its parts stored, and billed, until they are aborted).
    ``manifest``: the current one when the caller has it (else it is read). Returns the paths removed (an
    aborted upload as ``"<url> (incomplete upload <id>)"``).

    A local folder: the set's writer lock is taken first, without waiting: SetBusyError naming the writer (pid,
    host, since when) when a write to the set runs, and nothing of it is touched. An object store has no lock:
    this also removes the members, temp files and uploads of a write still running there; run it only when no
    write to that prefix runs."""
    return clean_set(folder, storage_options, manifest).removed


def _remove_strays(folder: str, storage_options: dict | None, manifest, report: CleanReport) -> None:
    """:func:`clean_folder`'s work, by a caller that holds the set's writer lock."""
    keep = {m.name for m in manifest.members} if manifest is not None else set()
    retired = [] if is_url(folder) else _retired(folder, keep, report)
    try:
        removed = report.removed
        removed += _abort_uploads(folder, storage_options, keep)
        for name in list_names(folder, storage_options):
            if name in keep or not is_stray(name):
                continue
            url = join(folder, name)
            try:
                if is_url(folder):
                    fs, path = _fs(url, storage_options)
                    fs.rm(path)
                else:
                    os.unlink(url)
                removed.append(url)
            except FileNotFoundError:
                pass
        for path, _ in retired:  # the members first: a clean killed in between finds the manifest again
            try:
                os.unlink(path)
                report.retired.append(path)
            except FileNotFoundError:
                pass
    finally:
        for _, fd in retired:  # (their exclusive locks, held until now)
            os.close(fd)


def _retired(folder: str, keep: set, report: CleanReport) -> list:
    """The replaced manifests of a local ``folder`` (``pageset.manifest.json.retired-<generation>``): the members
    of those a reader still holds (a shared lock) join ``keep`` and ``report.kept``; the others are returned as
    ``(path, descriptor holding the exclusive lock)`` to remove once their members are gone. Where the file
    system has no locks no reader can hold one: all are returned. A retired manifest that cannot be checked
    (EBADF: NFS refuses an exclusive lock on a file opened read-only) is kept."""
    out = []
    prefix = MANIFEST_NAME + locks.RETIRED_MARK
    for name in list_names(folder, None):
        if not name.startswith(prefix):
            continue
        path = join(folder, name)
        try:
            try:
                fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))  # NFS locks exclusively only so
            except PermissionError:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            continue
        except OSError:  # cannot be checked: its members stay (if they are still listed there)
            fd = -1
        try:
            free = locks.flock(fd, "try") if fd >= 0 else False
        except OSError:
            free = False
        if free is not False:
            out.append((path, fd))
            continue
        try:
            with open(path, "rb") as f:
                old = parse_manifest(f.read(), path)
            keep.update(m.name for m in old.members)
            report.kept.append((old.generation, len(old.members)))
        except (OSError, FormatError):  # unreadable, or not a manifest: nothing to keep for it
            pass
        finally:
            if fd >= 0:
                os.close(fd)
    return out


def retire(folder: str, previous) -> None:
    """Before a new manifest replaces ``previous`` in the local ``folder``: give the current manifest file a
    second name, ``pageset.manifest.json.retired-<generation>``, so that readers holding it (a shared lock) can
    be found after the rename, and their members kept (:func:`clean_folder`). Where the file system has no hard
    links the old members are removed at once, as on an object store."""
    if previous is None or is_url(folder):
        return
    current = join(folder, MANIFEST_NAME)
    path = join(folder, locks.retired_name(MANIFEST_NAME, previous.generation))
    try:
        os.link(current, path)
    except FileExistsError:
        if not os.path.samefile(current, path):  # left by an older write of the same generation: replace it
            os.unlink(path)
            os.link(current, path)
    except (PermissionError, NotImplementedError):
        return
    except OSError as exc:
        if exc.errno in locks.UNSUPPORTED or exc.errno == errno.EPERM:
            return
        raise


MAX_UPLOAD_PAGES = 10_000  # list_multipart_uploads pages (1,000 uploads each) looked at, at most


def _abort_uploads(folder: str, storage_options: dict | None, keep: set) -> list[str]:
    """Abort the incomplete multipart uploads of member names directly in the s3:// ``folder`` that ``keep``
    (the manifest's members) does not hold; other stores have no such uploads. Returns what was aborted."""
    if not folder.startswith(("s3://", "s3a://")):
        return []
    from .upload import WritePolicy, bounded

    fs, path = _fs(folder, storage_options)
    bucket, _, prefix = path.rstrip("/").partition("/")
    prefix = prefix + "/" if prefix else ""
    args, out = {"Bucket": bucket, "Prefix": prefix}, []
    for _ in range(MAX_UPLOAD_PAGES):
        page = bounded(fs, lambda: fs._call_s3("list_multipart_uploads", **args), folder,
                       "listing incomplete uploads", WritePolicy())
        for up in page.get("Uploads", []):
            name = up["Key"][len(prefix):]
            if "/" in name or name in keep or not is_stray(name):
                continue
            key, upload_id = up["Key"], up["UploadId"]
            bounded(fs, lambda k=key, u=upload_id: fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=k,
                                                               UploadId=u),
                    folder, "aborting an incomplete upload", WritePolicy())
            out.append(f"{join(folder, name)} (incomplete upload {upload_id})")
        if not page.get("IsTruncated"):
            break
        args["KeyMarker"], args["UploadIdMarker"] = page.get("NextKeyMarker", ""), page.get("NextUploadIdMarker", "")
    return out


def prepare_folder(folder: str, storage_options: dict | None, kind: str, schema: dict, append: bool,
                   call: str):
    """Check the output folder before any work, take the set's writer lock (a local folder: waiting for a write
    that holds it, ``write/setlock.py``) and clean what killed writes left there. Returns ``(current manifest or
    None, generation of the new manifest, members kept from the current one, the lock)``: the caller releases
    the lock (``lock.release()``) once it has called :func:`finish` or :func:`abandon`.

    Raises ValueError: ``folder`` is a file, or a folder holding other files and no manifest (a source, or
    arguments swapped: ``call`` shows the order), or (``append=True``) a set of the other kind or with another
    schema (naming the field); FormatError for a damaged manifest; SetBusyError where the file system has no
    locks and the lock names a live writer."""
    if not is_url(folder):
        local = local_path(folder)
        if os.path.isfile(local):
            raise ValueError(f"the output {folder} is a file; a many-file dataset (records_per_member= / "
                             "member_bytes=) is written to a folder: give a folder path (it is created)")
        parent = os.path.dirname(os.path.abspath(local))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"cannot write {folder}: its parent folder {parent} does not exist; create it "
                                    f"first (e.g. os.makedirs({parent!r}, exist_ok=True))")
        os.makedirs(local, exist_ok=True)
    current = read_manifest(folder, storage_options)
    if current is None:
        other = [n for n in list_names(folder, storage_options) if not is_own(n)]
        if other:
            shown = ", ".join(other[:5]) + (" ..." if len(other) > 5 else "")
            raise ValueError(f"the output folder {folder} holds files that are not a pageset set ({shown}) and no "
                             f"{MANIFEST_NAME}: refusing to write there (are the arguments swapped? the order is "
                             f"{call}); choose a new or empty folder")
    lock = lock_set(folder, call)
    try:
        current = read_manifest(folder, storage_options)  # again: a write we waited for may have replaced it
        _remove_strays(folder, storage_options, current, CleanReport())
        if current is None:
            return None, 1, (), lock
        if append:
            if current.kind != kind:
                raise ValueError(f"{join(folder, MANIFEST_NAME)}: cannot append {kind} to a set of {current.kind}")
            diff = schema_difference(current.schema, schema)
            if diff is not None:
                raise ValueError(f"{join(folder, MANIFEST_NAME)}: cannot append: the new members' schema differs "
                                 f"from the set's: {diff}; append members written with the same fields= and "
                                 "settings")
            return current, current.generation + 1, current.members, lock
        return current, current.generation + 1, (), lock
    except BaseException:
        lock.release()
        raise


def commit_manifest(folder: str, manifest, storage_options: dict | None, policy=None) -> None:
    """Make ``manifest`` the folder's current one, atomically: local, a temp file next to it, fsynced, renamed
    over ``pageset.manifest.json`` and the folder fsynced; on an object store one PUT of the whole object."""
    data = manifest.to_json()
    url = join(folder, MANIFEST_NAME)
    if is_url(folder):
        from .upload import pipe_bounded

        fs, path = _fs(url, storage_options)
        pipe_bounded(fs, path, data, url, "writing the manifest", policy)
        fs.invalidate_cache()
        return
    fd, tmp = temp_file(url)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, url)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(local_path(folder))


def finish(folder: str, kind: str, schema: dict, page_size: int, previous, generation: int, kept, summaries,
           storage_options: dict | None, policy=None):
    """Check the new members' summaries, write the manifest over ``kept + new`` members, remove the members the
    new manifest does not list (those of a replaced set, unless a reader still holds its manifest: see
    :func:`retire`). The caller holds the set's writer lock. Returns the manifest."""
    digest = schema_digest(schema)
    new = []
    for s in summaries:
        if s["schema_digest"] != digest:  # a task ran with other settings: never list it
            raise FormatError(join(folder, s["name"]), "schema", None, "the member's schema differs from the "
                              f"set's: {schema_difference(schema, s['schema'])}")
        rpp = np.asarray(s["records_per_page"], np.int64) if s.get("records_per_page") is not None else None
        new.append(Member(s["name"], s["dataset_id"], s["bytes"], s["pages"], digest, records=s.get("records", 0),
                          records_per_page=rpp, tokens=s.get("tokens", 0), documents=s.get("documents", 0)))
    if not new and not kept:
        raise ValueError(f"{folder}: no member was written (every sample was skipped, or the source is empty)")
    appended = ({"generation": previous.generation, "dataset_id": previous.dataset_id, "members": len(kept)}
                if kept else None)
    manifest = build_manifest(kind, generation, schema, page_size, list(kept) + new, appended)
    retire(folder, previous)
    commit_manifest(folder, manifest, storage_options, policy)
    try:
        _remove_strays(folder, storage_options, manifest, CleanReport())
    except Exception as exc:  # the new set is in place: a failure here must not undo it (abandon)
        warnings.warn(f"{folder}: the new set is written, but removing the old members failed ({exc}); run "
                      f"`pageset clean {folder}`", stacklevel=2)
    return manifest


def abandon(folder: str, storage_options: dict | None, previous) -> None:
    """After a failed write (the caller holds the writer lock): remove the members it wrote (the previous
    manifest, if any, stays current)."""
    try:
        _remove_strays(folder, storage_options, previous, CleanReport())
    except Exception:  # the write's own error is what the caller raises
        pass


# ---- one member, written by its task ------------------------------------------------------------------------

def member_output(url: str, storage_options: dict | None, policy=None) -> Output:
    """The member file's :class:`~pageset.write.output.Output` (temp + rename, or one upload)."""
    return Output(url, storage_options, policy=policy)


def summary(name: str, schema: dict, dataset_id: str, size: int, pages: int, **counts) -> dict:
    """What a member task returns to the caller (small: counts and ids, never the data)."""
    return dict(counts, name=name, schema=common_schema(schema), schema_digest=schema_digest(schema),
                dataset_id=dataset_id, bytes=size, pages=pages, host=socket.gethostname())


def write_record_member(src, fields, row_dtype, schema, page_size: int, start: int, stop: int, chunk: int,
                        on_error: str, folder: str, name: str, storage_options: dict | None, meta: dict,
                        user: dict, policy=None, in_process: bool = False) -> dict:
    """Task: encode samples ``[start, stop)`` of ``src`` (in sub-ranges of ``chunk``) into the member file
    ``folder/name``, made visible by rename or a completed upload. Returns :func:`summary` with ``records``,
    ``records_per_page`` (list), ``skipped`` (``{"index", "field", "error"}``, indices of the whole source),
    or ``{"error": (index, field, detail, traceback, source)}`` for a bad sample with on_error="raise", or
    ``{"empty": True, "skipped": [...]}`` when every sample was skipped (no file)."""
    from .assemble import Assembly
    from .ranges import encode_range

    span_names = [n for n, f in fields.items() if not f.inline]
    parts, skipped = [], []
    out = None
    try:
        for a in range(start, stop, chunk):
            part = encode_range(src, fields, row_dtype, a, min(stop, a + chunk), on_error, in_process=in_process)
            if part.error is not None:
                if out is not None:
                    out.abort()
                return {"error": part.error, "name": name}
            skipped += part.skipped
            if not len(part.rows):
                continue
            if out is None:
                out = member_output(join(folder, name), storage_options, policy)
                asm = Assembly(out.f, schema, row_dtype, span_names, page_size, src.description)
            part.skipped = [dict(e, index=e["index"] - start) for e in part.skipped]  # a member counts from 0
            asm.add(part)
            parts.append(len(part.rows))
        if out is None:
            return {"empty": True, "skipped": skipped, "name": name}
        stats = asm.finish(stop - start, meta, user)
        pages = -(-asm.pages.pos // page_size)
        index = np.concatenate(asm.rows)
        first = np.minimum((index["_offset"].astype(np.int64) - C.DATA_OFFSET) // page_size, max(pages - 1, 0))
        rpp = np.bincount(first, minlength=max(pages, 1))
        out.commit()
    except BaseException:
        if out is not None:
            out.abort()
        raise
    return summary(name, schema, stats["dataset_id"], stats["bytes"], pages, records=stats["records"],
                   records_per_page=rpp.tolist(), skipped=skipped)


_WORKER: dict = {}


def init_record_worker(src, fields, row_dtype) -> None:
    _WORKER["src"], _WORKER["fields"], _WORKER["row_dtype"] = src, fields, row_dtype


def record_member_in_worker(*args) -> dict:
    """:func:`write_record_member` in a forked worker, with the source set by :func:`init_record_worker`."""
    return write_record_member(_WORKER["src"], _WORKER["fields"], _WORKER["row_dtype"], *args)


def run_tasks(fn, tasks, num_workers: int, executor, initializer, initargs, died: str):
    """Yield ``fn(*task)`` in task order: in this process (``num_workers=0``), in forked workers, or on
    ``executor``. Leaving early cancels what has not started and waits for what runs."""
    from .pool import executor_map, ordered_map

    if executor is not None:
        yield from executor_map(executor, fn, tasks, ahead=64)
    elif num_workers == 0:
        for task in tasks:
            yield fn(*task)
    else:
        yield from ordered_map(fn, tasks, num_workers, initializer, initargs, 2 * num_workers, died)


def elapsed(t0: float) -> float:
    return time.perf_counter() - t0


__all__ = ["MANIFEST_NAME", "CleanReport", "clean_folder", "clean_set", "commit_manifest", "finish", "member_name",
           "prepare_folder", "read_manifest", "retire", "write_record_member"]
