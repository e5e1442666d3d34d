"""What the Loader opens for each path of its spec (:func:`open_input`): a
:class:`~pageset.read.reader.Dataset` (records or tokens, local or at a URL), or for a many-file set a
:class:`~pageset.load.set_source.ManyFileInput` (its manifest only; the members are opened by the set's
source when first read, :mod:`pageset.load.set_source`). The choice is
:func:`pageset.read.open.open_path`'s, the one every opener of pageset makes."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ..read.open import open_path
from ..read.reader import Dataset
from ..read.set_manifest import many_file_members
from .set_source import ManyFileInput, ManyFileSource
from .source import FileSource


@dataclass(frozen=True)
class Input:
    """One opened path of a Loader's spec: ``dataset`` (a :class:`~pageset.read.reader.Dataset`, or a
    :class:`~pageset.load.set_source.ManyFileInput` for a many-file set) and how its rows are read: ``source(pipelines, page_cache,
    cache_pages, verify_pages, in_mixture=, remote_options=, array_type=)`` -> its
    :class:`~pageset.load.parts.Source` (a :class:`~pageset.load.source.FileSource` or a
    :class:`~pageset.load.set_source.ManyFileSource`, chosen when the path was opened). ``close()`` closes
    ``dataset`` (the Source closes what it opened itself)."""

    dataset: object
    make: Callable

    def source(self, *args, **kwargs):
        return self.make(self.dataset, *args, **kwargs)

    def close(self) -> None:
        self.dataset.close()


def open_input(path, storage_options, request_timeout: float, request_attempts: int) -> Input:
    """What ``Loader`` opens for one path of its spec (:class:`Input`): a :class:`~pageset.read.reader.Dataset`
    read by a FileSource, or for a many-file set (a folder, its manifest, a URL prefix) a :class:`~pageset.load.set_source.ManyFileInput`
    (only the manifest is read) read by a ManyFileSource; the choice is :func:`~pageset.read.open.open_path`'s.
    Raises what Dataset and ``many_file_members`` raise (FileNotFoundError naming the path, FormatError), TypeError
    for a path that is not a str or os.PathLike."""
    remote = {"request_timeout": request_timeout, "request_attempts": request_attempts}
    if not isinstance(path, (str, os.PathLike)):
        return Input(Dataset(path, storage_options, **remote), FileSource)  # (Dataset raises the TypeError)
    return open_path(path, storage_options,
                     lambda p: Input(Dataset(p, storage_options, **remote), FileSource),
                     lambda p: Input(ManyFileInput(many_file_members(p, storage_options), storage_options, remote),
                                     ManyFileSource))
