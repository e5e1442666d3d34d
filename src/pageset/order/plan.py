"""Plans: what a Loader reads, in what order, and its resume state, as one interface.

A Loader reads one *plan*. The plan knows the records (``n_records``, the epoch length), maps the epoch
positions of a step to rows (``epoch(e).batch(start, stop)``: which file, which record in it, which rows are
padding, what ``_index`` shows), tells which records of each file a position range needs (remote prefetch) and
writes and checks the state dict. The Loader never asks what kind of plan it holds.

Four kinds, each a pair of a *spec* (what the user passes as ``Loader(path)``: a :class:`PlanSpec`) and a plan:

=================  ========================================  ==============================================
spec               plan                                      order
=================  ========================================  ==============================================
a path (OneFile)   :class:`FilePlan` (this module)           order v1 over the file's page layout
``indices=``       ``SubsetPlan`` (``subset.py``)            order v1 over the subset's virtual layout
``Mixture``        ``MixturePlan`` (``mixture.py``)          the mixture schedule over per-file orders
``FileSet``        ``ManyFilePlan`` (``fileset.py``)         order v1 over the members' concatenated pages
=================  ========================================  ==============================================

``OneFile`` (a path, or a subset of it) lives in ``subset.py``, which builds on this module.

How a new kind plugs in (one new module, no change to the Loader):

1. a spec, a subclass of :class:`PlanSpec`: ``paths`` (the files to open, in order), ``optional_fields``
   (True: a field mapped to None in ``pipelines`` may be missing from some files) and
   ``plan(members, params) -> Plan``, which gets one :class:`Member` per opened file (its path, dataset id
   and records per page) and the loader's :class:`OrderParams`;
2. a plan, a subclass of :class:`Plan` (or of :class:`FilePlan` when its order is order v1 over some page
   layout): ``path``, ``dataset_id``, ``n_records``, ``epoch_length``, ``hands_sources``, ``epoch(e, shift)``,
   ``state(epoch, cursor, shift)`` and ``resume(state, world_size)`` (``shift``: see :class:`Plan`);
3. its epoch view, a subclass of :class:`PlanEpoch`: ``batch(start, stop)`` -> :class:`PlanBatch` (the
   per-batch hot path: keep it to a few numpy calls) and ``file_ids(k, start, stop)``;
4. ``Loader(path=<the spec>)`` accepts any PlanSpec; a row whose ``sources`` entry is k is read from
   ``paths[k]`` with record id ``ids`` (the Loader's multi-file reader), ``sources=None`` reads file 0.

Pure: numpy arrays and ints in, numpy arrays and dicts out; nothing here opens a file.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .sharding import epoch_end, epoch_length
from .shuffle import DEFAULT_WINDOW_RECORDS, EpochOrder, _as_page_sizes, window_pages_for
from .state import OrderState, StateMismatchError, check_compatible, resume_cursor


@dataclass(frozen=True)
class OrderParams:
    """The loader's order parameters (validated by the Loader): seed in ``[0, 2**64)``, order (one of ORDERS),
    window_pages (M >= 1, or None: sized by window_records per page layout, :meth:`pages_per_window`),
    global_batch_size (G >= 1), drop_last, seq_len (the TokenWindows length of token files, 0 for record files:
    recorded in the state), packing, window_records (R >= 1, used when window_pages is None)."""

    seed: int
    order: str
    window_pages: int | None
    global_batch_size: int
    drop_last: bool
    seq_len: int = 0
    packing: str = ""  # "" for stride windows and record files, else a token file's packing (formats/packing.md)
    window_records: int = DEFAULT_WINDOW_RECORDS

    def pages_per_window(self, page_sizes) -> int:
        """M of the quasi-random windows over the layout ``page_sizes`` (int64[K] records per page):
        ``window_pages``, or sized by ``window_records`` (formats/order.md section 4.1)."""
        return window_pages_for(page_sizes, self.window_pages, self.window_records)


@dataclass(frozen=True)
class Member:
    """One opened file as a plan sees it: ``path`` (str, for messages), ``dataset_id`` (64 hex digits),
    ``page_sizes`` (int64[K], records per page: formats/order.md sections 6, 7; N = sum), ``tokens`` (int: the
    predictions of all its token rows, padding excluded; None for records that are not token rows)."""

    path: str
    dataset_id: str
    page_sizes: np.ndarray
    tokens: int | None = None

    @property
    def n_records(self) -> int:
        return int(self.page_sizes.sum())


class PlanBatch(NamedTuple):
    """The rows of one batch (positions ``[start, stop)`` of an epoch), n = stop - start.

    sources: int16[n], the file (index into the spec's ``paths``) of each row, or None: every row from file 0.
    ids: int64[n], the record id of each row within its file (what is read).
    padding: bool[n], True for wrap-around rows of ``drop_last=False`` (``_is_padding``).
    index: int64[n], what ``_index`` shows: ``ids``, or a many-file set's global record ids.
    """

    sources: np.ndarray | None
    ids: np.ndarray
    padding: np.ndarray
    index: np.ndarray


class PlanEpoch(ABC):
    """One epoch of a plan: epoch positions -> rows."""

    @abstractmethod
    def batch(self, start: int, stop: int) -> PlanBatch:
        """The rows of positions ``[start, stop)``, ``0 <= start <= stop <= epoch_length``. The arrays may be
        views of a range looked up ahead, but two calls never share memory (the caller may keep them)."""

    @abstractmethod
    def file_ids(self, k: int, start: int, stop: int) -> np.ndarray:
        """int64 record ids of file ``k`` read at positions ``[start, stop)``, in position order (the pages a
        remote file must fetch follow from them). Does not disturb :meth:`batch`'s look-ahead."""


class Plan(ABC):
    """What a Loader reads, in what order, and its resume state (see the module docstring).

    Attributes: ``path`` (str, names the data in messages and ``Loader.path``), ``dataset_id`` (str, the
    state's), ``n_records`` (N, samples of one epoch before rounding to whole steps), ``epoch_length`` (L,
    positions per epoch at the loader's global batch: formats/order.md section 5), ``hands_sources`` (batches
    carry ``"_source"``).

    Epochs, cursors and shifts: an epoch's steps start at position 0, or, in the epoch in which the loader
    resumed from a state of another global batch, at the saved cursor (``cursor % G`` is then not 0); the epoch
    ends at :meth:`epoch_end` (L when the steps start at 0). ``shift`` (int) places the epochs of a plan whose
    epochs are parts of one stream (a mixture: epoch e starts at stream position ``e*L + shift``): 0 unless the
    global batch changed during the run; plans whose epochs are independent (a file) ignore it.
    """

    hands_sources = False
    path: str
    dataset_id: str
    n_records: int
    epoch_length: int

    def __init__(self, params: OrderParams):
        self.params = params

    @abstractmethod
    def epoch(self, epoch: int, shift: int = 0) -> PlanEpoch:
        """The view of epoch ``epoch`` (an int >= 0) placed by ``shift`` (see the class docstring)."""

    @abstractmethod
    def state(self, epoch: int, cursor: int, shift: int = 0) -> dict:
        """The state dict at ``(epoch, cursor)`` (formats/order.md section 8; key order fixed)."""

    @abstractmethod
    def resume(self, state, world_size: int) -> tuple[int, int, int]:
        """``(epoch, cursor, shift)`` to continue from a saved ``state`` on ``world_size`` ranks at this plan's
        global batch (the saved one or another: :func:`~pageset.order.state.resume_cursor`; an epoch end rolled
        over to the next epoch). StateError / StateMismatchError naming the field when the state is malformed or
        belongs to other data or parameters."""

    def describe(self, epoch: int, cursor: int, shift: int = 0) -> dict | None:
        """What ``Loader.stats()["mixture"]`` shows at ``(epoch, cursor)``: None unless the plan mixes sources."""
        return None

    def epoch_end(self, cursor: int) -> int:
        """The position at which the current epoch ends when its next step starts at ``cursor`` (int >= 0):
        :func:`~pageset.order.sharding.epoch_end` of N, G and drop_last; ``epoch_length`` for a cursor that is a
        multiple of G."""
        p = self.params
        if cursor % p.global_batch_size == 0:
            return self.epoch_length
        return epoch_end(self.n_records, p.global_batch_size, p.drop_last, cursor)

    def _order_state(self, epoch: int, cursor: int, subset: str = "") -> OrderState:
        p = self.params
        return OrderState(dataset_id=self.dataset_id, seed=p.seed, epoch=epoch, cursor=cursor,
                          global_batch_size=p.global_batch_size, order=p.order,
                          window_pages=0 if p.window_pages is None else p.window_pages,
                          window_records=p.window_records if p.window_pages is None else 0,
                          drop_last=p.drop_last, subset=subset, seq_len=p.seq_len,
                          packing=p.packing, batch_offset=cursor % p.global_batch_size)

    def _epoch_length(self) -> int:
        """epoch_length(N, G, drop_last); its ValueError (no full step) names ``path``, and for token files says
        that the records are seq_len windows."""
        p = self.params
        try:
            return epoch_length(self.n_records, p.global_batch_size, p.drop_last)
        except ValueError as exc:
            unit = "packed rows" if p.packing else "windows"
            what = ("" if not p.seq_len else f" (the records of a token file are its {unit}: {self.n_records} of "
                    f"seq_len={p.seq_len} here; a smaller seq_len gives more)")
            if p.packing.endswith(":records"):  # PadTokens(packing=...): whole records packed into rows
                what = (f" (the records are packed rows of whole records: {self.n_records} of max_length="
                        f"{p.seq_len} here; a smaller max_length gives more)")
            raise ValueError(f"{self.path}: {exc}{what}") from None


class PlanSpec(ABC):
    """What a Loader is given to read: ``paths`` (tuple of str / os.PathLike, the files, in order),
    ``optional_fields`` (bool) and ``plan(members, params)``. See the module docstring."""

    optional_fields = False

    @property
    @abstractmethod
    def paths(self) -> tuple:
        """The files to open, in order (str or os.PathLike; local paths or URLs)."""

    @abstractmethod
    def plan(self, members: list[Member], params: OrderParams) -> Plan:
        """The plan over the opened ``members`` (one per path, same order). ValueError naming the file for
        data the plan cannot read (no full step, a weighted source without records, ...)."""

    def with_indices(self, indices) -> PlanSpec:
        """This spec restricted to ``indices`` (None: unchanged). Only one file has record ids to select;
        ValueError for other kinds."""
        if indices is None:
            return self
        raise ValueError(f"indices= selects records of one file; it cannot be combined with a {type(self).__name__} "
                         "(write the subsets to files of their own and use those)")


def refuse_mixture_state(state, path: str) -> None:
    """Raise StateMismatchError (field ``"mixture"``) when ``state``, given to the loader of one file ``path``,
    was saved by a loader reading a Mixture; any other state passes (it is validated as order v1 next)."""
    if not isinstance(state, Mapping) or "mixture" not in state:
        return
    mix = state["mixture"]
    sources = mix.get("sources") if isinstance(mix, Mapping) else None
    saved = f"a Mixture of {len(sources)} files" if isinstance(sources, list) else "a Mixture"
    raise StateMismatchError("mixture", saved, f"one file ({path})",
                             "The state was saved by a Loader reading a Mixture: resume it with a Loader on the "
                             "same Mixture (the same files, weights and samples_per_epoch).")


class FileEpoch(PlanEpoch):
    """An epoch of order v1 over ``order``'s page layout (N records), ids mapped through ``members`` (int64[N]
    or None: the identity)."""

    def __init__(self, order: EpochOrder, members: np.ndarray | None = None):
        self.order, self.members, self.n = order, members, order.n_records

    def batch(self, start: int, stop: int) -> PlanBatch:
        ids = self.order.ids(start, stop)
        if self.members is not None:
            ids = self.members[ids]
        # padding: positions >= N (only the last steps of a drop_last=False epoch have any)
        padding = (np.zeros(stop - start, dtype=bool) if stop <= self.n
                   else np.arange(start, stop, dtype=np.int64) >= self.n)
        return PlanBatch(None, ids, padding, ids)

    def file_ids(self, k: int, start: int, stop: int) -> np.ndarray:
        ids = self.order.ids(start, stop)
        return ids if self.members is None else self.members[ids]


class FilePlan(Plan):
    """Order v1 over one page layout: a file (formats/order.md).

    ``FilePlan(page_sizes, dataset_id, params, path)``: page_sizes int64[K] records per page (N = sum);
    dataset_id the file's (64 hex digits); path names it in messages. ValueError naming ``path`` when the file
    has no full step (``drop_last=True`` and N < G, or N = 0).
    """

    def __init__(self, page_sizes, dataset_id: str, params: OrderParams, path: str):
        super().__init__(params)
        self.page_sizes = _as_page_sizes(page_sizes)
        self.dataset_id, self.path = dataset_id, path
        self.n_records = int(self.page_sizes.sum())
        self.window_pages = params.pages_per_window(self.page_sizes)  # M of this layout
        self.epoch_length = self._epoch_length()

    def epoch(self, epoch: int, shift: int = 0) -> PlanEpoch:
        p = self.params
        return FileEpoch(EpochOrder(self.page_sizes, p.seed, epoch, p.order, self.window_pages))

    def _subset(self) -> str:
        """The state's ``subset`` key ("" for a whole file)."""
        return ""

    def state(self, epoch: int, cursor: int, shift: int = 0) -> dict:
        return self._order_state(epoch, cursor, self._subset()).to_dict()

    def resume(self, state, world_size: int) -> tuple[int, int, int]:
        refuse_mixture_state(state, self.path)
        saved = OrderState.from_dict(state)
        check_compatible(saved, self._order_state(0, 0, self._subset()), world_size, self.n_records)
        epoch, cursor, _ = resume_cursor(saved, self.n_records, self.params.global_batch_size)
        return epoch, cursor, 0
