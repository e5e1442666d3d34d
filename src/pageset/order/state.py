"""The loader's resume state (order v1): a small frozen record, its JSON form and the resume checks.

The state counts batches handed to the caller by ``next()`` (never batches decoded, queued or in flight) as
``cursor``: global samples (epoch positions) consumed in the current epoch, a multiple of the global batch G
unless G changed during the epoch (then ``batch_offset = cursor % G`` says so). Nothing in it is per rank or per
thread, so a run saved on W ranks resumes on any W', and with any global batch G' (a multiple of W'): the
remaining steps of the epoch cover positions ``[cursor + k*G', cursor + (k+1)*G')`` (:func:`resume_cursor`),
recomputed with the pure functions of ``shuffle.py`` and ``sharding.py``. A state saved right after the last
batch of an epoch (``cursor`` at the epoch's end) means the next epoch starts at position 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .keys import MASK64
from .sharding import epoch_end, epoch_length, local_batch
from .shuffle import ORDERS

STATE_VERSION = 1  # layout of the state dict
ORDER_ALGO = 1  # keys + Fisher-Yates + window rules of order v1; a new algorithm gets a new number

FIELDS = (
    "version",
    "order_algo",
    "dataset_id",
    "seed",
    "epoch",
    "cursor",
    "global_batch_size",
    "order",
    "window_pages",
    "drop_last",
)
# Keys present only when they differ from their default (so whole-file states keep the layout above).
# seq_len: the TokenWindows length of a token file's loader (0: a record file); the cursor counts its windows.
# packing: "" for stride windows (and record files), else the packing of a token file's rows (formats/packing.md
# section 7): the rows are the records, so the cursor means nothing under another packing.
# batch_offset: cursor % global_batch_size, not 0 only in an epoch in which the global batch changed (the steps
# of the rest of that epoch start at positions batch_offset + k*G).
# window_records: R when the quasi-random window is sized in records (window_pages is then 0, formats/order.md
# section 4.1); absent when window_pages gives M.
OPTIONAL_FIELDS = {"window_records": 0, "subset": "", "seq_len": 0, "packing": "", "batch_offset": 0}


class StateError(ValueError):
    """A resume state is malformed or cannot be used; ``field`` names the offending state field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"state field {field!r}: {message}")
        self.field = field
        self._args = (field, message)

    def __reduce__(self):  # pickled as its constructor's arguments (a Loader's child process, a process pool)
        return (type(self), self._args, self.__dict__)


class StateMismatchError(StateError):
    """The saved state and the current loader disagree on ``field`` (``saved`` vs ``current`` values)."""

    def __init__(self, field: str, saved: Any, current: Any, hint: str):
        super().__init__(
            field, f"saved state has {field}={saved!r}, this loader has {field}={current!r}. {hint}"
        )
        self.saved = saved
        self.current = current
        self._args = (field, saved, current, hint)


@dataclass(frozen=True, kw_only=True)
class OrderState:
    """Where a loader is in its sample stream; enough to recompute every later batch on any world size.

    version: int, STATE_VERSION. order_algo: int, ORDER_ALGO. dataset_id: str, the file's content hash.
    seed: int in [0, 2**64). epoch: int >= 0. cursor: int >= 0, global samples (epoch positions) consumed in
    this epoch (``cursor % global_batch_size == batch_offset``). global_batch_size: int >= 1, G, the global
    batch of the loader that saved the state. order: one of ORDERS. window_pages:
    int >= 1, M, or 0 when M is sized by ``window_records`` (int >= 1; 0 otherwise). drop_last: bool. subset: str, ``""`` for a whole file, else the subset's digest
    (``"<n>:<sha256>"``, see ``subset.py``). seq_len: int >= 0, the window length of a token file's loader
    (0 for a record file): windows are the records, so the cursor means nothing under another seq_len.
    packing: str, ``""`` for stride windows, else the packing of packed rows (``"best_fit:pages=<P>"``).
    batch_offset: int in ``[0, G)``, ``cursor % G``: 0 unless the global batch changed in this epoch (a state
    saved by a loader that resumed mid-epoch from a state of another global batch).
    Construction validates each field (StateError naming it).
    """

    version: int = STATE_VERSION
    order_algo: int = ORDER_ALGO
    dataset_id: str
    seed: int
    epoch: int = 0
    cursor: int = 0
    global_batch_size: int
    order: str
    window_pages: int = 1
    drop_last: bool
    window_records: int = 0
    subset: str = ""
    seq_len: int = 0
    packing: str = ""
    batch_offset: int = 0

    def __post_init__(self) -> None:
        _expect(
            type(self.version) is int and self.version == STATE_VERSION,
            "version",
            f"unsupported value {self.version!r}: this pageset reads version {STATE_VERSION}",
        )
        _expect(
            type(self.order_algo) is int and self.order_algo == ORDER_ALGO,
            "order_algo",
            f"unsupported value {self.order_algo!r}: this pageset implements order_algo {ORDER_ALGO}; "
            f"resume with the pageset version that wrote the state",
        )
        _expect(isinstance(self.dataset_id, str), "dataset_id", f"must be a str, got {self.dataset_id!r}")
        for name, low in (
            ("seed", 0),
            ("epoch", 0),
            ("cursor", 0),
            ("global_batch_size", 1),
            ("window_pages", 0),
            ("window_records", 0),
            ("seq_len", 0),
            ("batch_offset", 0),
        ):
            value = getattr(self, name)
            _expect(type(value) is int, name, f"must be an int, got {type(value).__name__} ({value!r})")
            _expect(value >= low, name, f"must be >= {low}, got {value}")
        _expect(self.seed <= MASK64, "seed", f"must be < 2**64, got {self.seed}")
        _expect(self.order in ORDERS, "order", f"must be one of {ORDERS}, got {self.order!r}")
        _expect(type(self.drop_last) is bool, "drop_last", f"must be a bool, got {self.drop_last!r}")
        _expect(self.window_pages >= 1 or self.window_records >= 1, "window_pages",
                "must be >= 1 (M), or 0 with window_records >= 1 (a window sized in records), got 0 without "
                "window_records")
        _expect(self.window_pages == 0 or self.window_records == 0, "window_records",
                f"must be absent (0) when window_pages gives M ({self.window_pages}), got {self.window_records}")
        _expect(isinstance(self.subset, str), "subset", f"must be a str, got {self.subset!r}")
        _expect(isinstance(self.packing, str), "packing", f"must be a str, got {self.packing!r}")
        _expect(
            self.batch_offset < self.global_batch_size,
            "batch_offset",
            f"must be < global_batch_size={self.global_batch_size}, got {self.batch_offset}",
        )
        if self.batch_offset == 0:
            _expect(
                self.cursor % self.global_batch_size == 0,
                "cursor",
                f"cursor={self.cursor} is not a multiple of global_batch_size={self.global_batch_size}: "
                f"states are taken between steps",
            )
        else:  # the global batch changed in this epoch: the steps started at batch_offset
            _expect(
                self.cursor % self.global_batch_size == self.batch_offset,
                "cursor",
                f"cursor={self.cursor} is not batch_offset={self.batch_offset} plus a multiple of "
                f"global_batch_size={self.global_batch_size}: states are taken between steps",
            )

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-serialisable dict (str, int, bool values) with the keys of FIELDS, in that order, then
        the OPTIONAL_FIELDS that differ from their defaults (``subset`` for a loader on a subset, ``seq_len``
        for one on a token file, ``batch_offset`` in an epoch in which the global batch changed)."""
        d = {name: getattr(self, name) for name in FIELDS}
        d.update({name: getattr(self, name) for name, default in OPTIONAL_FIELDS.items()
                  if getattr(self, name) != default})
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OrderState:
        """Validate and rebuild a state from :meth:`to_dict` output (e.g. after ``json.loads``).

        StateError (a ValueError) naming the field: missing or unknown keys, unsupported ``version`` or
        ``order_algo`` (checked first, so a future layout is reported as such), wrong types or ranges.
        """
        if not isinstance(d, Mapping):
            raise StateError("version", f"a state must be a mapping, got {type(d).__name__}")
        for name, supported in (("version", STATE_VERSION), ("order_algo", ORDER_ALGO)):
            _expect(name in d, name, "missing")
            _expect(
                d[name] == supported and type(d[name]) is int,
                name,
                f"unsupported value {d[name]!r}: this pageset reads {name} {supported}",
            )
        unknown = sorted(set(d) - set(FIELDS) - set(OPTIONAL_FIELDS))
        if unknown:
            raise StateError(unknown[0], f"unknown key(s) {unknown} for state version {STATE_VERSION}")
        for name in FIELDS:
            _expect(name in d, name, "missing")
        optional = {name: d.get(name, default) for name, default in OPTIONAL_FIELDS.items()}
        return cls(**{name: d[name] for name in FIELDS}, **optional)

    def replace(self, **changes: Any) -> OrderState:
        """A copy with ``changes`` applied (validated), e.g. ``state.replace(cursor=state.cursor + G)``."""
        return dataclasses.replace(self, **changes)


def _expect(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise StateError(field, message)


_HINTS = {
    "dataset_id": ("The state belongs to another dataset: open the file it was saved with (a many-file set gets a "
                   "new dataset id whenever its members change, an append included: resume on the set as it was, "
                   "or start the grown set fresh)."),
    "order_algo": "The order algorithm changed: resume with the pageset version that wrote the state.",
    "seed": "Construct the loader with the saved seed, or start fresh instead of loading the state.",
    "order": "Construct the loader with the saved order, or start fresh instead of loading the state.",
    "window_pages": ("Construct the loader with the saved window_pages (0: window_pages=None, the window sized "
                     "in records by window_records), or start fresh."),
    "window_records": "Construct the loader with the saved window_records (and window_pages=None), or start fresh.",
    "drop_last": "Construct the loader with the saved drop_last: it changes the epoch length.",
    "subset": "The state was saved on another subset of records (indices=, '' = the whole file): construct "
              "the loader with the same indices, in the same order.",
    "packing": "The cursor counts rows of the saved packing ('' = stride windows or records; ':records' = "
               "PadTokens(packing=...) of a TokenIds field): construct TokenWindows (a token file) or PadTokens "
               "(TokenIds records) with the same packing and pack_pages to resume (formats/packing.md sections 7 "
               "and 8); another one needs a fresh start (set_epoch instead of the state).",
    "seq_len": "The cursor counts windows of the saved seq_len (0: a record file; packed TokenIds records: "
               "PadTokens' max_length): construct TokenWindows (or the packing PadTokens) with the saved length to "
               "resume; a new length needs a fresh start (set_epoch instead of the state).",
}


def check_compatible(
    saved: OrderState, current: OrderState, world_size: int, n_records: int | None = None
) -> None:
    """Raise unless the loader described by ``current`` can resume ``saved`` on ``world_size`` ranks.

    Compares dataset_id, subset, seq_len (when the saved one is not 0), packing, order_algo, seed, order, window_pages
    and window_records (only for ``"quasi_random"``, the one order they change) and drop_last: StateMismatchError naming the first
    differing field with both values. ``global_batch_size`` may differ (the epoch continues at the saved position
    in steps of the current G: :func:`resume_cursor`); ``current.epoch`` and ``current.cursor`` are ignored (the
    saved ones win). Then requires ``current.global_batch_size % world_size == 0`` (StateError on
    ``global_batch_size``) and, when ``n_records`` is given, that the cursor is not past the end of the saved
    epoch (``L`` of the saved G, or :func:`~pageset.order.sharding.epoch_end` from the saved ``batch_offset``;
    StateError on ``cursor``). ``cursor % G == batch_offset`` holds by construction of OrderState.
    """
    fields = ["dataset_id", "subset", "seq_len", "packing", "order_algo", "seed", "order", "drop_last"]
    if saved.order == "quasi_random":
        fields[fields.index("drop_last"):fields.index("drop_last")] = ["window_pages", "window_records"]
    for name in fields:
        a, b = getattr(saved, name), getattr(current, name)
        if name == "seq_len" and a == 0:
            continue  # a record file's state, or a token state saved before seq_len was recorded
        if a != b:
            raise StateMismatchError(name, a, b, _HINTS[name])
    try:
        local_batch(current.global_batch_size, world_size)
    except ValueError as exc:
        raise StateError("global_batch_size", str(exc)) from None
    if n_records is not None:
        end = saved_end(saved, n_records)
        where = (f"the epoch length L={end}" if saved.batch_offset == 0 else
                 f"the end of the epoch at position {end} (steps from batch_offset={saved.batch_offset})")
        _expect(
            saved.cursor <= end,
            "cursor",
            f"cursor={saved.cursor} is past {where} (N={n_records}, "
            f"global_batch_size={saved.global_batch_size}, drop_last={saved.drop_last})",
        )


def saved_end(saved: OrderState, n_records: int) -> int:
    """Where the saved epoch ends with the saved G (``n_records`` N): L, or, when the global batch changed in
    it, :func:`~pageset.order.sharding.epoch_end` from ``batch_offset``. StateError on ``global_batch_size``
    when the saved G leaves no step (``drop_last=True`` and N < G: no loader saved that)."""
    try:
        if saved.batch_offset == 0:
            return epoch_length(n_records, saved.global_batch_size, saved.drop_last)
        return epoch_end(n_records, saved.global_batch_size, saved.drop_last, saved.batch_offset)
    except ValueError as exc:
        raise StateError("global_batch_size", f"the saved global batch gives no epoch: {exc}") from None


def normalize_cursor(epoch: int, cursor: int, epoch_length: int) -> tuple[int, int]:
    """``(epoch, cursor)`` with an epoch end rolled over: ``cursor == L`` -> ``(epoch + 1, 0)``.

    ValueError if ``cursor`` is outside ``[0, L]``.
    """
    if not 0 <= cursor <= epoch_length:
        raise StateError("cursor", f"cursor={cursor} is outside [0, L={epoch_length}]")
    if cursor == epoch_length:
        return epoch + 1, 0
    return epoch, cursor


def resume_cursor(saved: OrderState, n_records: int, global_batch: int) -> tuple[int, int, int]:
    """``(epoch, cursor, passed)``: where a loader of global batch ``global_batch`` (G', any value) continues
    from ``saved`` (checked with :func:`check_compatible`), and ``passed``, the positions of ``saved.epoch`` that
    were rolled over (its length when the loader continues at the next epoch, else 0).

    The next step covers epoch positions ``[cursor, cursor + G')``, the ones after it follow at ``+ G'``, so the
    positions handed out before and after a change of the global batch are the epoch's, each once, in order.
    The saved epoch is over (``(epoch + 1, 0)``) when the cursor is at its end with the saved G, or when the
    positions left cannot make a step of G' (``drop_last=True``: fewer than G' left, dropped like any epoch's
    tail; ``drop_last=False`` never leaves a step out: the last is padded). StateError on a cursor past the end.
    """
    end = saved_end(saved, n_records)
    epoch, cursor = normalize_cursor(saved.epoch, saved.cursor, end)
    if cursor == 0:
        return epoch, 0, end if epoch != saved.epoch else 0
    end = epoch_end(n_records, global_batch, saved.drop_last, cursor)
    if end == cursor:  # no step of G' left in this epoch (drop_last=True): its tail is dropped
        return epoch + 1, 0, cursor
    return epoch, cursor, 0


def resume_point(state: OrderState, n_records: int) -> tuple[int, int]:
    """``(epoch, step)`` at which a loader restarted from ``state`` continues.

    Its next batch is step ``step`` of epoch ``epoch`` with the saved G (``step = cursor // G`` after
    :func:`normalize_cursor`; its positions start at ``batch_offset + step * G``); no sample is read to get there.
    Errors as :func:`epoch_length`.
    """
    epoch, cursor = normalize_cursor(state.epoch, state.cursor, saved_end(state, n_records))
    return epoch, cursor // state.global_batch_size
