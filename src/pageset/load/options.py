"""The Loader's argument groups as objects: :class:`PageOptions` (how local pages are read and the quasi-random
window) and :class:`RemoteOptions` (a URL's fetching and on-disk cache), each checked when it is made; and
:class:`LoaderDescription`, a whole Loader's reading as one picklable object (what process mode's child builds from).

``Loader(path, batch_size=..., page_options=PageOptions(page_cache="process"), remote_options=RemoteOptions(
cache_dir="/scratch/cache"))`` is the same Loader as the flat ``Loader(path, batch_size=..., page_cache="process",
cache_dir="/scratch/cache")``; giving a group both ways (an object and a flat argument of that group that is not
at its default) is a ValueError naming the argument. The fields' meanings, units and defaults are those of the
flat arguments in ``Loader``'s docstring (as Grain groups its ``ReadOptions``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ..format import arguments as check
from .parts import PageSource


@dataclass(frozen=True)
class PageOptions:
    """``page_cache`` ("os", "process", or a :class:`~pageset.load.parts.PageSource` subclass), ``cache_pages``
    (int >= 1 pages, or None: the default), ``verify_pages`` (bool), ``window_pages`` / ``window_records``
    (ints >= 1 or None; at most one given)."""

    page_cache: object = "os"
    cache_pages: int | None = None
    verify_pages: bool = False
    window_pages: int | None = None
    window_records: int | None = None

    def __post_init__(self):
        """Every field checked at construction (TypeError / ValueError naming the argument and what it accepts)."""
        page_cache = self.page_cache
        if not (isinstance(page_cache, type) and issubclass(page_cache, PageSource)):  # else a storage kind
            page_cache = check.choice("page_cache", page_cache, ("os", "process"))
        window_pages = check.integer("window_pages", self.window_pages, minimum=1, optional=True)
        window_records = check.integer("window_records", self.window_records, minimum=1, optional=True)
        if window_pages is not None and window_records is not None:
            raise ValueError(f"window_pages={window_pages} and window_records={window_records} both size the "
                             "quasi-random window: give one (window_pages: M pages a window; window_records: M sized "
                             "so a window holds that many records)")
        _set(self, page_cache, check.integer("cache_pages", self.cache_pages, minimum=1, optional=True),
             check.boolean("verify_pages", self.verify_pages), window_pages, window_records)


@dataclass(frozen=True)
class RemoteOptions:
    """For URLs: ``storage_options`` (dict for fsspec, or None), ``cache_dir`` (folder or None),
    ``cache_limit_bytes`` (bytes or None: 10 GiB; only with ``cache_dir``), ``prefetch_bytes`` (bytes >= 0 or
    None: 64 MiB), ``max_requests`` (>= 1), ``request_timeout`` (seconds > 0), ``request_attempts`` (>= 1)."""

    storage_options: dict | None = None
    cache_dir: object = None
    cache_limit_bytes: int | None = None
    prefetch_bytes: int | None = None
    max_requests: int = 8
    request_timeout: float = 30.0
    request_attempts: int = 5

    def __post_init__(self):
        """Every field checked at construction (TypeError / ValueError / NotADirectoryError naming the argument)."""
        storage_options = check.mapping("storage_options", self.storage_options, optional=True)
        cache_dir = self.cache_dir
        if cache_dir is not None and (isinstance(cache_dir, bytes) or not isinstance(cache_dir, (str, os.PathLike))):
            raise TypeError(f"cache_dir must be a folder path (str or os.PathLike) or None, got {cache_dir!r}")
        if cache_dir is not None and not os.fspath(cache_dir):
            raise ValueError("cache_dir='' names no folder (it would cache into the current folder): pass a folder "
                             "path, or None for no on-disk cache")
        if cache_dir is not None and os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
            raise NotADirectoryError(f"cache_dir {os.fspath(cache_dir)!r} is a file, not a folder; pass cache_dir= a "
                                     "folder path (created if missing) for the on-disk page cache")
        cache_limit_bytes = check.integer("cache_limit_bytes", self.cache_limit_bytes, minimum=1, optional=True)
        if cache_limit_bytes is not None and cache_dir is None:
            raise ValueError(f"cache_limit_bytes={cache_limit_bytes:,} bounds the on-disk page cache of cache_dir=, "
                             "and no cache_dir is given: pass cache_dir=<folder> too, or leave cache_limit_bytes out")
        _set(self, storage_options, cache_dir, cache_limit_bytes,
             check.integer("prefetch_bytes", self.prefetch_bytes, minimum=0, optional=True),
             check.integer("max_requests", self.max_requests, minimum=1),
             check.real("request_timeout", self.request_timeout, low=0, low_open=True),
             check.integer("request_attempts", self.request_attempts, minimum=1))


@dataclass(frozen=True)
class LoaderDescription:
    """What a Loader reads and how, as one picklable value: the child process of ``num_workers=1``
    (load/process_worker.py) builds its Loader from it, ``description.build(cls)``, instead of from keyword
    arguments. Made by the parent's Loader once its arguments are checked (``Loader._describe()``), so every
    field is the parent's resolved value.

    ``path`` (a path, or a plan spec: a Mixture, a FileSet, a subset's source), ``batch_size`` (rows per rank),
    ``pipelines`` (field name -> ops, or None; without ToDevice ops: the parent copies to the device), ``order``,
    ``seed``, ``drop_last``, ``num_threads`` and ``batches_ahead`` (resolved ints), ``rank`` and ``world_size``
    (the parent's: the child fills the parent's slice), ``page_options`` (a :class:`PageOptions`; its
    ``window_records`` is the parent's, None when ``window_pages`` sizes the window), ``indices`` (a subset's ids,
    or None) and ``array_type``. No URL options: process mode reads local files only.
    """

    path: object
    batch_size: int
    pipelines: dict | None
    order: str
    seed: int
    drop_last: bool
    num_threads: int
    batches_ahead: int
    rank: int
    world_size: int
    page_options: PageOptions
    indices: object
    array_type: str

    def build(self, cls):
        """``cls(path, ...)`` (``cls`` the Loader or a subclass) with these arguments."""
        return cls(self.path, batch_size=self.batch_size, pipelines=self.pipelines, order=self.order,
                   seed=self.seed, drop_last=self.drop_last, num_threads=self.num_threads,
                   batches_ahead=self.batches_ahead, rank=self.rank, world_size=self.world_size,
                   page_options=self.page_options, indices=self.indices, array_type=self.array_type)


def _set(options, *values) -> None:
    """Store the checked ``values`` into the frozen ``options``' fields, in field order."""
    for f, value in zip(dataclasses.fields(options), values):
        object.__setattr__(options, f.name, value)


def resolve(kind: type, given, flat):
    """The group's options: ``given`` (an instance of ``kind``, or None) or else ``flat`` (``kind`` built from the
    flat arguments; both checked when made). TypeError when ``given`` is not a ``kind``; ValueError naming each
    flat argument of the group that is set besides ``given``."""
    if given is None:
        return flat
    name = "page_options" if kind is PageOptions else "remote_options"
    if not isinstance(given, kind):
        raise TypeError(f"{name} must be a pageset.{kind.__name__} (or None), got {given!r}")
    default = kind()
    both = [f.name for f in dataclasses.fields(kind) if getattr(flat, f.name) != getattr(default, f.name)]
    if both:
        raise ValueError(f"{', '.join(both)} given both as an argument and in {name}=: give each option one way "
                         f"(in {name}={kind.__name__}(...), or as the flat argument)")
    return given
