"""Many-file sets: several member files read as ONE dataset, ``Loader(FileSet(paths, dataset_id))``.

The set's records are the members' records concatenated in member order: global record id ``g`` is record
``g - start_k`` of member k, ``start_k`` the records of the members before k. Its page layout is the members'
page lists concatenated (member 0's pages, then member 1's, ...), and its order is order v1 over that layout
(formats/order.md section 4): ``quasi_random`` shuffles pages across all members and stays page-local,
``random`` permutes all ids; rank slices, ``drop_last``, padding and the state are exactly those of one file
with that page list whose dataset id is the set's (no extra state key). ``_index`` holds global record ids.

The members are read as a mixture's files are (each row from its own file), without a schedule.

Pure: page lists and ids in, ids out; opening the members is the Loader's job (a folder or manifest becomes a
:class:`FileSet` in the read layer).
"""

from __future__ import annotations

import os

import numpy as np

from .plan import FileEpoch, FilePlan, Member, OrderParams, PlanBatch, PlanEpoch, PlanSpec
from .shuffle import EpochOrder

MAX_MEMBERS = 32767  # rows name their member in an int16 (as a mixture's "_source")


class FileSet(PlanSpec):
    """Member files read as one dataset: pass it to ``Loader`` instead of a path.

    ``FileSet(paths, dataset_id, *, name=None, member_ids=None)``: paths, a sequence of 1 to MAX_MEMBERS member
    files (str or os.PathLike, local or URLs) in record order; dataset_id (str), the set's id, what the state
    records (a manifest's digest over its members); name (str), what messages call the set (default: a list of
    the members); member_ids, the dataset id each member must have (a manifest's, checked when the Loader
    opens the member: ValueError naming it). TypeError / ValueError naming the argument otherwise.
    """

    def __init__(self, paths, dataset_id: str, *, name: str | None = None, member_ids=None):
        if isinstance(paths, (str, bytes, os.PathLike)) or not hasattr(paths, "__len__"):
            raise TypeError(f"paths must be a list of member files, e.g. FileSet(['a.pageset', 'b.pageset'], id), "
                            f"got {paths!r}")
        self._paths = tuple(paths)
        if not self._paths:
            raise ValueError("paths is empty: a FileSet needs at least one member file")
        if len(self._paths) > MAX_MEMBERS:
            raise ValueError(f"{len(self._paths)} member files: at most {MAX_MEMBERS}")
        for i, p in enumerate(self._paths):
            if isinstance(p, bytes) or not isinstance(p, (str, os.PathLike)):
                raise TypeError(f"paths[{i}] = {p!r} is not a path (str or os.PathLike)")
        if not isinstance(dataset_id, str) or not dataset_id:
            raise TypeError(f"dataset_id must be a non-empty str (the set's id), got {dataset_id!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {name!r}")
        if member_ids is not None:
            member_ids = tuple(member_ids)
            if len(member_ids) != len(self._paths) or not all(isinstance(m, str) for m in member_ids):
                raise ValueError(f"member_ids must be {len(self._paths)} str, one per member file, got "
                                 f"{list(member_ids)!r}")
        self.dataset_id, self.name, self.member_ids = dataset_id, name, member_ids

    @property
    def paths(self) -> tuple:
        return self._paths

    def plan(self, members: list[Member], params: OrderParams) -> ManyFilePlan:
        """The :class:`ManyFilePlan`; ValueError naming the member whose dataset id is not the expected one."""
        if self.member_ids is not None:
            for i, (m, want) in enumerate(zip(members, self.member_ids)):
                if m.dataset_id != want:
                    raise ValueError(f"{m.path}: member {i} of the set has dataset id {m.dataset_id}, but the set "
                                     f"lists {want}: the member was replaced or rewritten; restore it or rebuild "
                                     f"the set's manifest")
        name = self.name or f"FileSet of {len(members)} files ({', '.join(m.path for m in members)})"
        return ManyFilePlan(members, self.dataset_id, params, name)

    def __repr__(self) -> str:
        return f"FileSet({[os.fspath(p) for p in self._paths]!r}, {self.dataset_id!r})"


class ManyFileEpoch(PlanEpoch):
    """An epoch of order v1 over the concatenated page list; rows as (member, local id), ``index`` global."""

    def __init__(self, order: EpochOrder, starts: np.ndarray):
        self.file = FileEpoch(order)
        self.starts = starts  # int64[members + 1]: global id of each member's first record, then N

    def batch(self, start: int, stop: int) -> PlanBatch:
        _, gids, padding, _ = self.file.batch(start, stop)
        member = np.searchsorted(self.starts, gids, side="right") - 1
        return PlanBatch(member.astype(np.int16), gids - self.starts[member], padding, gids)

    def file_ids(self, k: int, start: int, stop: int) -> np.ndarray:
        gids = self.file.file_ids(0, start, stop)
        lo, hi = int(self.starts[k]), int(self.starts[k + 1])
        return gids[(gids >= lo) & (gids < hi)] - lo


class ManyFilePlan(FilePlan):
    """Order v1 over the members' concatenated page lists (see the module docstring).

    ``ManyFilePlan(members, dataset_id, params, path)``: members, the opened member files in order;
    dataset_id, the set's; path names the set in messages. The state is :class:`FilePlan`'s with this
    dataset_id. ValueError naming ``path`` when the set has no full step.
    """

    def __init__(self, members: list[Member], dataset_id: str, params: OrderParams, path: str):
        sizes = [np.asarray(m.page_sizes, dtype=np.int64) for m in members]
        counts = np.array([int(s.sum()) for s in sizes], dtype=np.int64)
        self.starts = np.zeros(len(members) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.starts[1:])
        self.starts.flags.writeable = False
        super().__init__(np.concatenate(sizes), dataset_id, params, path)

    def epoch(self, epoch: int, shift: int = 0) -> PlanEpoch:
        p = self.params
        return ManyFileEpoch(EpochOrder(self.page_sizes, p.seed, epoch, p.order, self.window_pages), self.starts)
