"""Subsets (order v1 on a chosen list of record ids): ``Loader(path, indices=...)``.

A subset is a sequence ``indices`` of n record ids of one file (any order, repeats allowed). It is a new id
space: subset position ``q`` in ``0..n-1`` stands for record ``indices[q]``. The epoch order, the epoch
length, the rank slices and the resume state are those of order v1 applied to n records, then every id is
mapped through the subset. So a subset behaves exactly like a file of n records.

Which n-record "file" the order sees (its pages, for ``quasi_random``):

- ``sequential`` and ``random``: one page of n records, in the given order: ``sequential`` yields
  ``indices[0], indices[1], ...``; ``random`` is the Fisher-Yates permutation of ``0..n-1`` mapped through
  ``indices``.
- ``quasi_random``: the subset positions grouped by the file page holding their record (a stable sort on
  the page, so within a page the given order is kept), one virtual page per file page that holds at least
  one member. Windows of M virtual pages are windows of M file pages: reads stay page-local and the memory
  bound of ``quasi_random`` holds for the subset too.

The state records :func:`subset_digest` (length and SHA-256 of the ids as little-endian int64), so a state
saved on one subset is refused by a loader on another.

Pure functions of numpy arrays: no file, no torch.
"""

from __future__ import annotations

import hashlib
import numbers
import os

import numpy as np

from .plan import FileEpoch, FilePlan, Member, OrderParams, Plan, PlanEpoch, PlanSpec
from .shuffle import ORDERS, EpochOrder, _as_page_sizes


def as_indices(indices, n_records: int, what: str = "indices", unit: str = "record") -> np.ndarray:
    """``indices`` validated against a file of ``n_records`` records: a new int64[n] array.

    Accepts any sequence or 1-D array of integers (Python ints, numpy integer scalars or an integer array;
    floats, bools and strings are refused). ValueError (TypeError for non-integers) naming the first bad
    position and its value: an id outside ``[0, n_records)``, a non-integer, an empty or non-1-D sequence; a set
    (unordered) is refused. ``unit`` names what the ids count in messages (``"window"`` for token files).
    """
    if isinstance(indices, (set, frozenset)):
        raise TypeError(f"{what} is a {type(indices).__name__}: sets are unordered, and the order of the ids is the "
                        f"order of the subset; pass a list or 1-D integer array of {unit} ids (e.g. sorted(...))")
    if isinstance(indices, (str, bytes)) or not hasattr(indices, "__len__"):
        raise TypeError(f"{what} must be a sequence of {unit} ids (a list, range or 1-D integer array), "
                        f"got {type(indices).__name__}")
    arr = np.asarray(indices) if not isinstance(indices, range) else np.arange(
        indices.start, indices.stop, indices.step, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D ({unit} ids), got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{what} is empty: a subset needs at least one {unit} id")
    if arr.dtype.kind == "b":
        raise TypeError(f"{what} is a boolean mask; pass {unit} ids instead, e.g. numpy.flatnonzero(mask)")
    if arr.dtype.kind in "iu" and not isinstance(indices, (np.ndarray, range)):
        # numpy turns [1, True] into int64 [1, 1]: a bool among Python ints is refused as in a float list
        for q, value in enumerate(indices):
            if isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{what}[{q}] = {value} is not an integer {unit} id (bool); pass integer ids in "
                                f"[0, {n_records})")
    if arr.dtype.kind not in "iu":
        for q, value in enumerate(indices):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
                shown = repr(value) if isinstance(value, (str, bytes)) else str(value)
                raise TypeError(f"{what}[{q}] = {shown} is not an integer {unit} id "
                                f"({type(value).__name__}); pass integer ids in [0, {n_records})")
        arr = np.asarray([int(v) for v in indices], dtype=object)  # Python ints: huge values stay exact
        bad = [q for q, v in enumerate(arr) if not 0 <= v < n_records]
        if bad:
            q = bad[0]
            raise ValueError(f"{what}[{q}] = {arr[q]} is outside [0, {n_records}) (the file has {n_records} "
                             f"{unit}s)")
        return arr.astype(np.int64)
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and int(arr.max()) >= n_records:
        q = int(np.argmax(arr >= n_records))
        raise ValueError(f"{what}[{q}] = {int(arr[q])} is outside [0, {n_records}) (the file has {n_records} "
                         f"{unit}s)")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < 0) | (arr >= n_records))
    if bad.size:
        q = int(bad[0])
        raise ValueError(f"{what}[{q}] = {int(arr[q])} is outside [0, {n_records}) (the file has {n_records} "
                         f"{unit}s)")
    return np.ascontiguousarray(arr)


def subset_digest(indices: np.ndarray) -> str:
    """``"<n>:<sha256 hex, 32 digits>"`` of the ids as little-endian int64: what the resume state compares."""
    arr = np.ascontiguousarray(indices, dtype="<i8")
    return f"{arr.shape[0]}:{hashlib.sha256(arr.tobytes()).hexdigest()[:32]}"


class SubsetLayout:
    """The n-record virtual file a subset presents to order v1.

    ``SubsetLayout(file_page_sizes, indices, order)``: file_page_sizes int64[K] records per file page;
    indices int64[n] validated ids (see :func:`as_indices`); order one of ORDERS. Attributes: ``page_sizes``
    int64[K'] members per virtual page; ``members`` int64[n], the record id of each virtual id (virtual page
    k holds virtual ids ``[sum(page_sizes[:k]), sum(page_sizes[:k+1]))``); ``n_records`` = n; ``digest``.
    """

    def __init__(self, file_page_sizes, indices: np.ndarray, order: str):
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        sizes = _as_page_sizes(file_page_sizes)
        indices = np.ascontiguousarray(indices, dtype=np.int64)
        self.n_records = int(indices.shape[0])
        self.digest = subset_digest(indices)
        if order == "quasi_random":
            starts = np.zeros(sizes.shape[0] + 1, dtype=np.int64)
            np.cumsum(sizes, out=starts[1:])
            page = np.searchsorted(starts, indices, side="right") - 1
            grouped = np.argsort(page, kind="stable")
            counts = np.bincount(page, minlength=sizes.shape[0])
            self.page_sizes = counts[counts > 0].astype(np.int64)
            self.members = indices[grouped]
        else:
            self.page_sizes = np.array([self.n_records], dtype=np.int64)
            self.members = indices.copy()
        self.members.flags.writeable = False

    def epoch_order(self, seed: int, epoch: int, order: str, window_pages: int = 1) -> SubsetOrder:
        """The order of one epoch: ``ids(start, stop)`` gives record ids of the file."""
        return SubsetOrder(self, EpochOrder(self.page_sizes, seed, epoch, order, window_pages))


class SubsetOrder:
    """An :class:`~pageset.order.EpochOrder` over a subset's virtual ids, mapped to the file's record ids."""

    def __init__(self, layout: SubsetLayout, order: EpochOrder):
        self.layout, self.virtual = layout, order

    @property
    def n_records(self) -> int:
        return self.layout.n_records

    def ids(self, start: int, stop: int) -> np.ndarray:
        """Record ids (of the file) at epoch positions ``[start, stop)``: int64[stop - start]; positions >= n
        wrap as in EpochOrder. Errors as :meth:`EpochOrder.ids`."""
        return self.layout.members[self.virtual.ids(start, stop)]


class SubsetPlan(FilePlan):
    """Order v1 over a subset of one file's records (formats/mixture.md section 1): a :class:`FilePlan` over the
    subset's virtual page layout, ids mapped to the file's record ids; the state adds the ``subset`` digest.

    ``SubsetPlan(file_page_sizes, indices, dataset_id, params, path)``: file_page_sizes int64[K] records per
    file page; indices as :func:`as_indices` accepts (checked against the file's N; TypeError / ValueError
    naming ``path``, the first bad position and, for token files, that the ids are seq_len windows).
    """

    def __init__(self, file_page_sizes, indices, dataset_id: str, params: OrderParams, path: str):
        sizes = _as_page_sizes(file_page_sizes)
        seq_len = params.seq_len
        try:
            ids = as_indices(indices, int(sizes.sum()), unit="window" if seq_len else "record")
        except (TypeError, ValueError) as exc:
            what = f" (a token file's ids are its seq_len={seq_len} windows)" if seq_len else ""
            raise type(exc)(f"{path}: {exc}{what}") from None
        self.layout = SubsetLayout(sizes, ids, params.order)
        super().__init__(self.layout.page_sizes, dataset_id, params, path)

    def epoch(self, epoch: int, shift: int = 0) -> PlanEpoch:
        p = self.params
        return FileEpoch(EpochOrder(self.layout.page_sizes, p.seed, epoch, p.order, self.window_pages),
                         self.layout.members)

    def _subset(self) -> str:
        return self.layout.digest


class OneFile(PlanSpec):
    """One file (``path``: str or os.PathLike, a local path or URL), or a subset of its records
    (``indices``, see ``subset.py``): what ``Loader(path)`` and ``Loader(path, indices=...)`` read."""

    def __init__(self, path, indices=None):
        self.path, self.indices = path, indices

    @property
    def paths(self) -> tuple:
        return (self.path,)

    def with_indices(self, indices) -> PlanSpec:
        return OneFile(self.path, indices)

    def plan(self, members: list[Member], params: OrderParams) -> Plan:
        (m,) = members
        if self.indices is None:
            return FilePlan(m.page_sizes, m.dataset_id, params, m.path)
        return SubsetPlan(m.page_sizes, self.indices, m.dataset_id, params, m.path)

    def __repr__(self) -> str:
        return f"OneFile({os.fspath(self.path)!r})"
