"""A many-file set's manifest and members (``formats/manyfile.md``): a folder or URL prefix of member pageset
files and ``pageset.manifest.json``, as every reader of a set sees it (the record reader
:mod:`pageset.read.set_dataset`, the Loader's :mod:`pageset.load.set_source`, ``pageset merge``).

The manifest is read and validated at open (:func:`~pageset.format.manifest.parse_manifest`, under a lease that
keeps a rewrite from removing the members while they are read); :func:`many_file_members` gives what a loader
needs from it alone. A member is checked against the manifest when it is opened (:class:`CheckedMembers`),
before any record of it is returned: its schema (naming the first differing field), dataset id, size, page and
record counts; a member that is missing, truncated or replaced raises an error naming it and what differs.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

from ..format import locks
from ..format.errors import FormatError, MemberMismatchError, SchemaError
from ..format.manifest import MANIFEST_NAME, Manifest, parse_manifest, schema_difference
from .remote import local_path, url_scheme



def _join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}" if url_scheme(folder) else os.path.join(folder, name)


def split_path(path) -> tuple[str, str] | None:
    """``(folder, manifest path)`` when ``path`` names a many-file dataset by its form (a local folder, a path or
    URL ending in ``pageset.manifest.json`` or ``/``), else None (it may still be a URL prefix: see
    :func:`manifest_exists`)."""
    path = local_path(os.fspath(path))
    if not isinstance(path, str):
        return None
    if path.rstrip("/").endswith("/" + MANIFEST_NAME) or path == MANIFEST_NAME:
        folder = path.rstrip("/")[: -len(MANIFEST_NAME)].rstrip("/") or "."
        return folder, _join(folder, MANIFEST_NAME)
    if url_scheme(path) is not None:
        if path.endswith("/"):
            return path.rstrip("/"), _join(path.rstrip("/"), MANIFEST_NAME)
        return None
    if os.path.isdir(path):
        return path, os.path.join(path, MANIFEST_NAME)
    return None


def manifest_exists(url: str, storage_options: dict | None) -> bool:
    """Whether ``<url>/pageset.manifest.json`` exists (for a URL prefix opened without its trailing ``/``)."""
    try:
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(_join(url, MANIFEST_NAME), **dict(storage_options or {}))
        return bool(fs.exists(path))
    except Exception:  # the caller raises its own FileNotFoundError
        return False


class ManifestLease:
    """A reader's shared lock on the local manifest file it read (``formats/manyfile.md`` section 9): while it is
    held, a write that replaces the set keeps the members this manifest lists. ``close()`` releases it (also
    when the lease is garbage-collected, or the process ends); a pickled copy holds nothing."""

    def __init__(self, fd: int = -1):
        self._finalizer = weakref.finalize(self, os.close, fd) if fd >= 0 else None

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    def __reduce__(self):
        return (ManifestLease, ())


LEASE_TRIES = 1000  # manifests replaced between our open and our lock, at most (each retry reads the newer one)


def _read_local(manifest_path: str) -> tuple[bytes, ManifestLease]:
    """The bytes of the local manifest and a shared lock on that very file (an inert lease where the file system
    has no locks). A manifest replaced between the open and the lock is read again (the new one)."""
    for _ in range(LEASE_TRIES):
        fd = os.open(manifest_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            try:
                held = locks.flock(fd, "shared")
            except OSError:  # a lock error never stops a read: this reader is then not protected
                held = None
            if held and not locks.same_file(fd, manifest_path):
                os.close(fd)
                continue
            with os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read()
        except BaseException:
            os.close(fd)
            raise
        if not held:
            os.close(fd)
            return raw, ManifestLease()
        return raw, ManifestLease(fd)
    raise OSError(f"{manifest_path}: the manifest was replaced {LEASE_TRIES} times while it was being opened")


def read_manifest(manifest_path: str, storage_options: dict | None = None, lease: bool = False):
    """Read and validate the manifest at ``manifest_path``: a :class:`~pageset.format.manifest.Manifest`, or with
    ``lease=True`` ``(manifest, ManifestLease)`` (a local manifest: a shared lock on the file read, which keeps
    its members from being removed by a rewrite until it is closed; a URL's lease holds nothing).
    FileNotFoundError names the folder and says that its write may not have finished; FormatError subclasses
    name the manifest."""
    held = ManifestLease()
    try:
        if url_scheme(manifest_path) is not None:
            from fsspec.core import url_to_fs

            fs, target = url_to_fs(manifest_path, **dict(storage_options or {}))
            raw = fs.cat_file(target)
        else:
            if storage_options:
                raise ValueError(f"{manifest_path}: storage_options apply to URLs (s3://, http://, ...), not to "
                                 "local paths")
            raw, held = _read_local(manifest_path)
    except FileNotFoundError:
        folder = manifest_path[: -len(MANIFEST_NAME)].rstrip("/") or "."
        raise FileNotFoundError(f"{folder}: no {MANIFEST_NAME}: not a many-file pageset dataset, or its write has "
                                "not finished (the manifest is written last); open a pageset file by its path, or "
                                f"run `pageset clean {folder}` after a killed write") from None
    try:
        if raw[:2] == b"\x1f\x8b":  # not JSON: gzip's magic, a body compressed on the way (or stored so)
            raise FormatError(manifest_path, "manifest", None, "the bytes read are gzip-compressed (they start with "
                              "1f 8b), not the manifest's JSON: a server or a proxy compressed the body "
                              "(Content-Encoding: gzip, the header dropped or not decoded on the way) or it was stored "
                              "compressed; serve the set's files as stored (compression off for them), or store the "
                              "manifest uncompressed")
        manifest = parse_manifest(raw, manifest_path)
    except BaseException:
        held.close()
        raise
    if not lease:
        held.close()
        return manifest
    return manifest, held


@dataclass(frozen=True)
class ManyFileSet:
    """What a loader needs of a many-file dataset, from its manifest alone (no member is opened):
    ``folder``, ``manifest_path``, ``dataset_id`` (hex: the set's id), ``kind`` (``"records"`` / ``"tokens"``),
    ``page_size``, ``paths`` (each member's path or URL, in order), ``member_ids`` (hex), ``records``,
    ``pages``, ``bytes``, ``tokens`` and ``documents`` (tuples of ints, one per member; 0 where the kind has
    none), ``records_per_page`` (record sets: a tuple of int64[max(pages, 1)] arrays, records whose first byte
    lies in each page of that member; token sets: None), ``manifest`` (the parsed
    :class:`~pageset.format.manifest.Manifest`), ``lease`` (a :class:`ManifestLease`: while it is held, a
    rewrite of a local set keeps these members; its holder closes it when done reading)."""

    folder: str
    manifest_path: str
    dataset_id: str
    kind: str
    page_size: int
    paths: tuple
    member_ids: tuple
    records: tuple
    pages: tuple
    bytes: tuple
    tokens: tuple
    documents: tuple
    records_per_page: tuple | None
    manifest: Manifest
    lease: ManifestLease = field(default_factory=ManifestLease, compare=False, repr=False)


def many_file_members(path, storage_options: dict | None = None) -> ManyFileSet:
    """The member files of the many-file dataset at ``path`` (its folder, its manifest, or a URL prefix), read
    from the validated manifest: see :class:`ManyFileSet`. Raises FileNotFoundError (no manifest) and
    FormatError subclasses naming the manifest."""
    where = split_path(path)
    if where is None:
        p = os.fspath(path)
        if url_scheme(p) is None:
            raise FileNotFoundError(f"{p}: not a folder holding a many-file dataset (no such folder)")
        where = (p.rstrip("/"), _join(p.rstrip("/"), MANIFEST_NAME))
    folder, manifest_path = where
    m, lease = read_manifest(manifest_path, storage_options, lease=True)
    ms = m.members
    return ManyFileSet(folder, manifest_path, m.dataset_id, m.kind, m.page_size,
                       tuple(_join(folder, x.name) for x in ms), tuple(x.dataset_id for x in ms),
                       tuple(x.records for x in ms), tuple(x.pages for x in ms), tuple(x.bytes for x in ms),
                       tuple(x.tokens for x in ms), tuple(x.documents for x in ms),
                       tuple(x.records_per_page for x in ms) if m.kind == "records" else None, m, lease)


class CheckedMembers:
    """Members of a set opened by ``opener(path)`` and checked against the manifest (``open(k)``; the errors
    name the member, ``context(k)``). Caching them is the caller's (:class:`~pageset.read.member_cache.MemberCache`)."""

    def __init__(self, info: ManyFileSet, opener, storage_options):
        self.info, self.opener, self.storage_options = info, opener, storage_options

    def context(self, k: int) -> str:
        m = self.info.manifest.members[k]
        return (f"member {k} of the many-file dataset {self.info.folder} (its manifest lists {m.name} with "
                f"{m.bytes:,} bytes and dataset id {m.dataset_id[:16]}...)")

    def open(self, k: int):
        path, m = self.info.paths[k], self.info.manifest.members[k]
        try:
            ds = self.opener(path)
        except FileNotFoundError as exc:
            now = self._replaced()
            if now is not None:
                raise FileNotFoundError(f"{path}: missing: the set {self.info.folder} was replaced while it was read "
                                        f"(generation {self.info.manifest.generation}, now generation "
                                        f"{now.generation}): open it again to read the new set (a new Loader); "
                                        f"{self.context(k)}; on an object store, or a file system without locks, "
                                        "a rewrite removes the old members once its manifest is in") from None
            raise FileNotFoundError(f"{path}: missing: {self.context(k)}; the set is incomplete: restore the file "
                                    f"or rewrite the set ({exc})") from None
        except FormatError as exc:
            try:
                err = type(exc)(exc.path, exc.section, exc.offset, f"{exc.detail}; {self.context(k)}")
            except TypeError:
                raise exc from None
            raise err from exc
        try:
            self.check(k, ds, path, m)
        except BaseException:
            ds.close()
            raise
        return ds

    def _replaced(self):
        """The folder's current manifest when it is another set than the one read (a rewrite), else None (also
        when it cannot be read: the caller's error stands)."""
        try:
            now = read_manifest(self.info.manifest_path, self.storage_options if url_scheme(self.info.folder)
                                else None)
        except Exception:
            return None
        return now if now.dataset_id != self.info.dataset_id or now.generation != self.info.manifest.generation \
            else None

    def check(self, k: int, ds, path: str, m) -> None:
        base = getattr(ds, "dataset", ds)  # a TokenDataset holds its Dataset
        diff = schema_difference(self.info.manifest.schema, base.schema)
        if diff is not None:
            raise SchemaError(path, "schema", None, f"the member's schema differs from the set's: {diff}; "
                              f"{self.context(k)}; members of one set need the same fields and settings")
        checks = [("dataset id", base.dataset_id, m.dataset_id), ("size in bytes", base.file_size, m.bytes),
                  ("page count", base.page_count, m.pages)]
        if self.info.kind == "records":
            checks.append(("record count", base.record_count, m.records))
        else:
            checks += [("token count", len(ds), m.tokens), ("document count", ds.documents, m.documents)]
        for what, found, want in checks:
            if found != want:
                raise MemberMismatchError(path, "header", None, f"its {what} is {found}, the manifest lists {want}: "
                                          f"the file was replaced or rewritten after the manifest was written; "
                                          f"{self.context(k)}; restore the member or rewrite the set")


def is_many_file(path, storage_options: dict | None = None) -> bool:
    """Whether ``path`` names a many-file dataset: a local folder, a manifest path, a URL ending in ``/`` or
    ``pageset.manifest.json`` (a URL prefix without a trailing ``/`` is found when no object has its name)."""
    return split_path(path) is not None


__all__ = ["CheckedMembers", "ManyFileSet", "is_many_file", "manifest_exists", "many_file_members", "read_manifest",
           "split_path"]
