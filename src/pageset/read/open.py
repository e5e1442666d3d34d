"""Opening a dataset by path or URL: one file (:class:`~pageset.read.reader.Dataset`, token files
:class:`~pageset.read.tokens.TokenDataset`) or a many-file set (``formats/manyfile.md``:
:mod:`pageset.read.set_dataset`). The one module that knows all three, so none of them imports another's opener."""

from __future__ import annotations

import os

from .set_dataset import ManyFileDataset, ManyFileTokens
from .set_manifest import is_many_file, manifest_exists
from .reader import Dataset, check_open_arguments
from .remote import local_path, url_scheme
from .tokens import TokenDataset


def open_path(path, storage_options, open_file, open_set):
    """The one decision of how to open ``path`` (each opener of pageset calls it): ``open_set(path)`` for a
    many-file set (a folder, its manifest, a URL prefix ending in ``/``: :func:`~pageset.read.set_manifest.is_many_file`),
    else ``open_file(path)``; when that raises FileNotFoundError for a URL below which a manifest exists (a set's
    prefix given without its ``/``), ``open_set(path + "/")``. Returns what the opener returned; raises what it
    raises (the first FileNotFoundError when no set is there either)."""
    if is_many_file(path):
        return open_set(path)
    try:
        return open_file(path)
    except FileNotFoundError:
        p = os.fspath(path)
        if url_scheme(local_path(p)) is not None and manifest_exists(p, storage_options):
            return open_set(p + "/")
        raise


def open_dataset(path, storage_options: dict | None = None, *, request_timeout: float = 30.0,
                 request_attempts: int = 5) -> Dataset:
    """Open and validate a pageset file of records, local or at a URL (``s3://``, ``http(s)://``, any fsspec
    protocol); see :class:`Dataset`. A many-file dataset (a folder or URL prefix holding
    ``pageset.manifest.json``, ``formats/manyfile.md``) opens as a
    :class:`~pageset.read.ManyFileDataset` (the same record API; members opened lazily). Raises FormatError subclasses (BadMagicError for an object that is not a
    pageset file), FileNotFoundError (naming the path or URL), ImportError (no backend for the URL's scheme: the
    message names the package), RemoteReadError, OSError; ValueError for a token file (it has no records: open
    it with :func:`pageset.open_tokens`; ``Dataset(path)`` opens either kind for header, schema and
    ``verify()``); TypeError for a path that is not a str or os.PathLike."""
    check_open_arguments(path, storage_options, request_timeout, request_attempts)
    remote = {"request_timeout": request_timeout, "request_attempts": request_attempts}
    ds = open_path(path, storage_options, lambda p: Dataset(p, storage_options, **remote),
                   lambda p: ManyFileDataset(p, storage_options, **remote))
    if isinstance(ds, ManyFileDataset):
        return ds
    if ds.tokens_info is not None:
        ds.close()
        raise ValueError(f"{ds.path} is a token file ({ds.tokens_info['count']} tokens in "
                         f"{ds.tokens_info['documents']} documents, no records): open it with "
                         "pageset.open_tokens(path), or load it with Loader(path, ..., pipelines={'tokens': "
                         "[TokenWindows(seq_len)]})")
    return ds


def open_tokens(path: str | os.PathLike, storage_options: dict | None = None, **remote) -> TokenDataset:
    """Open and validate a token file, local or at a URL (``storage_options``, ``request_timeout``,
    ``request_attempts``: see :func:`~pageset.read.open_dataset`); see :class:`TokenDataset`. Raises FormatError
    subclasses (a record file is refused, naming open_dataset), FileNotFoundError, ImportError, RemoteReadError,
    OSError, TypeError (a path that is not a str or os.PathLike). A many-file set of token files (a folder or URL
    prefix holding ``pageset.manifest.json``) opens as a :class:`~pageset.read.ManyFileTokens`."""
    unknown = set(remote) - {"request_timeout", "request_attempts"}
    if unknown:
        raise TypeError(f"open_tokens() got unexpected keyword arguments {sorted(unknown)}")
    check_open_arguments(path, storage_options, remote.get("request_timeout", 30.0), remote.get("request_attempts", 5))
    return open_path(path, storage_options, lambda p: TokenDataset(p, storage_options, **remote),
                     lambda p: ManyFileTokens(p, storage_options, **remote))
