"""Mixtures (``mixture_algo = 1``): a deterministic weighted interleaving of several sources, exact resume.

The maths is written in ``formats/mixture.md``; in short:

- Weights become integer quotas ``q_i`` (:func:`quotas`), period ``D = sum(q_i)``, shares ``p_i = q_i / D``.
- The schedule assigns every global position ``g = 0, 1, 2, ...`` of the mixture stream (all epochs
  together) to one source. Over one period it is built by earliest-deadline-first on Tijdeman's windows
  (the chairman assignment problem): the k-th sample of source i may be taken from slot ``(k - d) / p_i``
  on and must be taken by slot ``(k - 1 + d) / p_i`` with ``d = 1 - 1 / (2S - 2)`` (S = sources with a positive
  quota). Result: after every prefix of n samples, ``|count_i(n) - n * p_i| <= d < 1`` for every source,
  and ``count_i(D) = q_i`` exactly, so the schedule repeats with period D (it depends on the slot only
  through ``g mod D``).
- ``count_i(g) = (g // D) * q_i + c_i(g mod D)`` in O(log D): no replay, any step of any epoch.
- The sample at g, from source i, is that source's ``k = count_i(g)``-th sample: its own epoch
  ``k // N_i`` and position ``k % N_i`` in its own order v1 (seed :func:`source_seed`). A source that runs
  out starts its next epoch; nothing is read past its end and no source ever waits for another.

Pure functions of integers and numpy arrays: no file, no torch.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
from collections import OrderedDict
from collections.abc import Mapping
from fractions import Fraction

import numba
import numpy as np

from .plan import (  # noqa: F401 (refuse_mixture_state: re-exported, its home was here)
    Member,
    OrderParams,
    Plan,
    PlanBatch,
    PlanEpoch,
    PlanSpec,
    refuse_mixture_state,
)
from .quotas import MAX_SOURCES, MixtureSchedule, quotas, source_seed
from .schedule import Schedule, StreamSchedule
from .shuffle import EpochOrder
from .state import OrderState, StateError, StateMismatchError, check_compatible, resume_cursor, saved_end

MIXTURE_ALGO = 1  # quotas + EDF schedule + per-source order rules; a new algorithm gets a new number
@numba.njit(nogil=True)
def _mixture_ids(slots, rank, q, n_records, start, origin, base, windows, window_ids, src, ids, j0, j1):
    """Kernel of :meth:`MixtureOrder.lookup`: global positions ``start + j`` for ``j`` in ``[j0, j1)``, all in one
    piece of the schedule (quotas ``q`` repeating from position ``origin``, ``base[s]`` samples of source s before
    it) -> ``src[j]`` (the source, from the period's slots) and ``ids[j]`` (the record id, from the cached window of
    that source's order holding the sample).

    The sample at g = start + j is sample ``k = base[s] + ((g - origin) // D) * q[s] + rank[(g - origin) % D]`` of
    source ``s = slots[(g - origin) % D]``: position ``k % n_records[s]`` of its epoch ``k // n_records[s]``. Source
    s has two window slots, ``2s`` and ``2s + 1``: slot t (a column of windows, int64[4, 2S]) holds positions
    ``[lo, lo + len)`` of epoch ``windows[0, t]`` (-1: empty), with ``lo = windows[1, t]``, ``len = windows[2, t]``,
    at ``window_ids[windows[3, t]:]``. Returns -1 when rows ``[j0, j1)`` are written, else the first j whose window
    is in neither slot, with ``src[j] = s`` and ``ids[j] = k`` (the caller loads that window and calls again from j).
    """
    period = slots.shape[0]
    for j in range(j0, j1):
        g = start + j - origin
        r = g % period
        s = slots[r]
        k = base[s] + (g // period) * q[s] + rank[r]
        n = n_records[s]
        epoch = k // n
        pos = k - epoch * n
        t = 2 * s
        if windows[0, t] != epoch or not windows[1, t] <= pos < windows[1, t] + windows[2, t]:
            t += 1
            if windows[0, t] != epoch or not windows[1, t] <= pos < windows[1, t] + windows[2, t]:
                src[j] = s
                ids[j] = k
                return j
        src[j] = s
        ids[j] = window_ids[windows[3, t] + pos - windows[1, t]]
    return -1


class MixtureOrder:
    """Global mixture positions -> (source, record id), each source in its own order v1 and epoch counter.

    ``MixtureOrder(schedule, page_sizes, seed, order, window_pages)``: schedule, a :class:`MixtureSchedule`
    (constant quotas) or a :class:`~pageset.order.schedule.StreamSchedule`; page_sizes is one int64[K_i] per
    source (records per page; N_i = sum); window_pages is M (int >= 1) for every source, or a sequence of one
    M_i per source (a loader's window sized in records gives each source its own, formats/order.md section 4.1).
    Source i's k-th sample is position ``k % N_i`` of its epoch ``k // N_i`` under
    ``EpochOrder(page_sizes[i], source_seed(seed, i), k // N_i, order, M_i)``.
    Keeps the orders of the last two epochs of each source (a tiny source wraps often) and, in one flat
    buffer, the ids of the two order windows each source read last: a lookup is one kernel call
    (:func:`_mixture_ids`) unless a sample lies in a window not loaded yet. One caller at a time (the
    loader's main thread).
    """

    def __init__(self, schedule, page_sizes, seed: int, order: str, window_pages=1):
        # the stream's pieces (a constant mixture: one, from 0, without end)
        self.stream = (StreamSchedule.constant(schedule.quotas) if isinstance(schedule, MixtureSchedule)
                       else schedule)
        if len(page_sizes) != schedule.n_sources:
            raise ValueError(f"{len(page_sizes)} page layouts for {schedule.n_sources} sources")
        per_source = ([int(window_pages)] * schedule.n_sources if isinstance(window_pages, numbers.Integral)
                      else [int(m) for m in window_pages])
        if len(per_source) != schedule.n_sources:
            raise ValueError(f"{len(per_source)} window_pages for {schedule.n_sources} sources")
        self.schedule, self.order, self.window_pages = schedule, order, per_source
        self.page_sizes = [np.asarray(p, dtype=np.int64) for p in page_sizes]
        self.n_records = [int(p.sum()) for p in self.page_sizes]
        weighted = [any(q[i] for q in self.stream.stage_quotas) for i in range(schedule.n_sources)]
        for i, (n, w) in enumerate(zip(self.n_records, weighted)):
            if n == 0 and w:
                raise ValueError(f"source {i} has no records but a positive weight")
        self.seeds = [source_seed(seed, i) for i in range(schedule.n_sources)]
        self._orders: OrderedDict[tuple[int, int], EpochOrder] = OrderedDict()
        self._records = np.asarray(self.n_records, dtype=np.int64)
        # Two window slots per source (2i, 2i + 1), columns of _windows: the epoch (-1: empty), first position,
        # length and place in the flat buffer _window_ids of the window each holds; a slot has room for the
        # largest window of the source's order (its window_pages largest pages; "random": the whole epoch), and
        # one whose window turns out larger gets a new buffer (_grow).
        s = schedule.n_sources
        self._windows = np.zeros((4, 2 * s), dtype=np.int64)
        self._windows[0] = -1
        cap = np.zeros(2 * s, dtype=np.int64)
        for i, (sizes, w) in enumerate(zip(self.page_sizes, weighted)):
            if w:
                m = sizes.shape[0] if order == "random" else self.window_pages[i]
                cap[2 * i : 2 * i + 2] = np.sort(sizes)[::-1][:m].sum()
        self._capacity = cap
        np.cumsum(cap[:-1], out=self._windows[3, 1:])
        self._window_ids = np.empty(int(cap.sum()), dtype=np.int64)
        self._loaded = [0] * (2 * s)  # when each slot was last loaded (the older of a source's two goes)
        self._loads = 0

    def _epoch_order(self, source: int, epoch: int) -> EpochOrder:
        key = (source, epoch)
        order = self._orders.get(key)
        if order is None:
            order = EpochOrder(self.page_sizes[source], self.seeds[source], epoch, self.order,
                               self.window_pages[source])
            self._orders[key] = order
            mine = [k for k in self._orders if k[0] == source]
            for k in mine[:-2]:
                del self._orders[k]
        return order

    def lookup(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """``(sources int16[n], ids int64[n])`` for global positions ``[start, stop)`` (new arrays): record ids
        within each sample's source file. ValueError for positions before an edit of the weights (section 3.3)."""
        n = stop - start
        src = np.empty(n, dtype=np.int16)
        ids = np.empty(n, dtype=np.int64)
        stream = self.stream
        stream._check_after_edit(int(start))
        for piece, lo, hi in stream.pieces_in(start, stop):
            period = stream.period(piece.quotas)
            base = np.asarray(piece.base, dtype=np.int64) + stream.offset
            args = (period.slots, period.rank, period._quota_array, self._records, start, piece.start, base)
            j0, j1 = lo - start, hi - start
            j = _mixture_ids(*args, self._windows, self._window_ids, src, ids, j0, j1)
            for _ in range(j1 - j0):  # a sample in a window not loaded yet: load it, go on from there
                if j < 0:
                    break
                s, was = int(src[j]), j
                self._load_window(s, *divmod(int(ids[j]), self.n_records[s]))
                j = _mixture_ids(*args, self._windows, self._window_ids, src, ids, j, j1)
                if j == was:
                    raise RuntimeError(f"mixture order: the window of source {s} loaded for position {start + j} "
                                       "does not hold it (an internal error: please report it with the Loader's "
                                       "arguments)")
            if j >= 0:
                raise RuntimeError(f"mixture order: positions [{lo}, {hi}) not filled after {j1 - j0} window loads")
        return src, ids

    def _load_window(self, source: int, epoch: int, pos: int) -> None:
        """Copy the ids of the window of source ``source``'s order for ``epoch`` holding position ``pos`` into the
        source's slot loaded longer ago (the same ids as ``EpochOrder.ids``)."""
        order = self._epoch_order(source, epoch)
        w = order.window_of(pos)
        w_lo, w_ids = int(order.window_starts[w]), order.window_ids(w)
        t = 2 * source + (self._loaded[2 * source] > self._loaded[2 * source + 1])
        n = w_ids.shape[0]
        if n > self._capacity[t]:
            self._grow(t, n)
        off = int(self._windows[3, t])
        self._window_ids[off : off + n] = w_ids
        self._windows[:3, t] = epoch, w_lo, n
        self._loads += 1
        self._loaded[t] = self._loads
        if self.order == "random":  # one window, the whole epoch: the slot now holds it, the order need not
            self._orders.pop((source, epoch), None)

    def _grow(self, slot: int, size: int) -> None:
        """A new flat buffer where window slot ``slot`` has room for ``size`` ids (the other slots keep theirs)."""
        cap = self._capacity.copy()
        cap[slot] = size
        windows = self._windows.copy()
        windows[3, 0] = 0
        np.cumsum(cap[:-1], out=windows[3, 1:])
        buf = np.empty(int(cap.sum()), dtype=np.int64)
        for t in np.flatnonzero(self._windows[2]).tolist():
            o, n, new = int(self._windows[3, t]), int(self._windows[2, t]), int(windows[3, t])
            buf[new : new + n] = self._window_ids[o : o + n]
        self._capacity, self._windows, self._window_ids = cap, windows, buf

    def epoch(self, epoch: int, epoch_length: int) -> MixtureEpoch:
        """The view of mixture epoch ``epoch`` (of ``epoch_length`` positions): ``lookup(start, stop)``,
        ``batch(start, stop)``."""
        return MixtureEpoch(self, int(epoch) * int(epoch_length), int(epoch_length))

    def cursors(self, g: int) -> list[tuple[int, int]]:
        """``[(epoch_i, cursor_i)]``: where each source's own stream stands after global positions
        ``[0, g)`` (its epoch and the samples of that epoch already taken)."""
        return [divmod(int(c), n) if n else (0, 0) for c, n in zip(self.stream.counts(g), self.n_records)]


class MixtureEpoch:
    """Epoch positions of one mixture epoch -> (sources, ids): global position = ``origin + position``.

    ``batch(start, stop)`` serves a loader's consecutive batches: it looks up ``BATCHES_AHEAD`` times the
    range at once (within the epoch) and hands out slices of that, while the ranges asked for stay inside it
    (one process reading every rank's positions, world_size 1); the ids are the same as ``lookup``'s.
    """

    BATCHES_AHEAD = 16

    def __init__(self, order: MixtureOrder, origin: int, length: int | None = None):
        self.order, self.origin, self.length = order, origin, length
        # the range looked up ahead: epoch positions [base, end) in src / ids, of which [base, frontier) are out
        self._ahead = (0, 0, 0, None, None)

    def lookup(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """``(sources int16[n], ids int64[n])`` of epoch positions ``[start, stop)`` (new arrays)."""
        return self.order.lookup(self.origin + start, self.origin + stop)

    def batch(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`lookup`, but may return views of one array looked up ahead for several batches; a range is
        handed out once (the views of two calls never overlap: a caller may keep or write its own)."""
        base, frontier, end, src, ids = self._ahead
        if not frontier <= start <= stop <= end:
            end = start + (stop - start) * self.BATCHES_AHEAD
            if self.length is not None:
                end = min(end, self.length)
            base, end = start, max(end, stop)
            src, ids = self.order.lookup(self.origin + base, self.origin + end)
        self._ahead = (base, stop, end, src, ids)
        return src[start - base : stop - base], ids[start - base : stop - base]


# --- the resume state --------------------------------------------------------------------------------------


def mixture_id(dataset_ids, quota_values, samples_per_epoch: int, schedule: str | None = None) -> str:
    """``"mixture:<sha256, 32 hex digits>"`` of the sources' dataset ids, the quotas and samples_per_epoch: the
    mixture's ``dataset_id`` in the state (another file, weight or epoch size gives another id). With a
    ``schedule`` id (``StreamSchedule.schedule_id``) that takes the place of the quotas (section 3.4)."""
    fields = {"mixture_algo": MIXTURE_ALGO, "sources": list(dataset_ids), "samples_per_epoch": int(samples_per_epoch)}
    if schedule is None:
        fields["quotas"] = [int(q) for q in quota_values]
    else:
        fields["schedule"] = schedule
    text = json.dumps(fields, sort_keys=True)
    return "mixture:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def mixture_state(order: MixtureOrder, dataset_ids, samples_per_epoch: int, state: OrderState, g: int,
                  origin: int | None = None, edits=()) -> dict:
    """The state dict of a mixture loader: ``state`` (order v1 fields; its dataset_id is replaced by
    :func:`mixture_id`) plus ``"mixture"``: ``{"mixture_algo", "quotas", "samples_per_epoch", "sources":
    [{"dataset_id", "epoch", "cursor"}, ...]}``, each source's own epoch and samples taken in it after global
    position ``g`` (cross-checked on resume), then for a schedule ``"schedule": {"id", "stage"}`` (``quotas``:
    the quotas of the stage at g), after weights edited on resume ``"base": {"position", "counts"}`` and
    ``"edits"`` (the positions of every edit), and ``"origin"`` (the global position of the epoch's first sample)
    when ``origin`` is given: only when it is not ``epoch * L``, after a change of the global batch
    (formats/mixture.md sections 2.5, 3.4)."""
    stream = order.stream
    stage = 0 if stream.is_constant else stream.shares_at(g)[0]
    sid = None if stream.is_constant else stream.schedule_id()
    d = state.replace(dataset_id=mixture_id(dataset_ids, stream.quotas, samples_per_epoch, sid)).to_dict()
    d["mixture"] = {
        "mixture_algo": MIXTURE_ALGO,
        "quotas": list(stream.stage_quotas[stage]),
        "samples_per_epoch": int(samples_per_epoch),
        "sources": [{"dataset_id": i, "epoch": e, "cursor": c}
                    for i, (e, c) in zip(dataset_ids, order.cursors(g))],
    }
    if sid is not None:
        d["mixture"]["schedule"] = {"id": sid, "stage": stage}
    if edits:
        g0 = stream.edit_position
        d["mixture"]["base"] = {"position": g0, "counts": [int(c) for c in stream.counts(g0)]}
        d["mixture"]["edits"] = [int(e) for e in edits]
    if origin is not None:
        d["mixture"]["origin"] = int(origin)
    return d


def _identity(mix: Mapping):
    """What makes two mixtures' streams the same: a schedule's id, else the quotas."""
    sched = mix.get("schedule")
    if sched is not None:
        if not isinstance(sched, Mapping) or not isinstance(sched.get("id"), str):
            raise StateError("mixture.schedule", f"must be {{'id': str, 'stage': int}}, got {sched!r}")
        return ("schedule", sched["id"])
    return ("quotas", list(mix["quotas"]))


def _saved_counts(sources, n_records) -> list[int]:
    """Every source's samples taken, from the saved ``(epoch, cursor)`` entries (StateError naming the entry)."""
    counts = []
    for i, (a, n) in enumerate(zip(sources, n_records)):
        e, c = a.get("epoch"), a.get("cursor")
        if type(e) is not int or type(c) is not int or e < 0 or not (0 <= c < n or (n == 0 and c == 0)):
            raise StateError(f"mixture.sources[{i}]", f"epoch {e!r}, cursor {c!r}: the epoch must be an int >= 0 "
                             f"and the cursor an int in [0, {n}) (the source's records)")
        counts.append(e * n + c)
    return counts


def _changed_sources(saved, current, paths) -> str:
    """`` Removed: ...; added: ...``: the saved sources missing from this mixture (by dataset id, with their saved
    index) and this mixture's files the saved run did not read (by path); "" when the saved list is malformed."""
    if not isinstance(saved, list) or not all(isinstance(a, Mapping) for a in saved):
        return ""
    saved_ids = [a.get("dataset_id") for a in saved]
    now_ids = [b["dataset_id"] for b in current]
    gone = [f"source {i} (dataset_id {d})" for i, d in enumerate(saved_ids) if d not in now_ids]
    new = [f"{paths[i] if paths else f'source {i}'} (dataset_id {d})" for i, d in enumerate(now_ids)
           if d not in saved_ids]
    parts = ([f"removed: {', '.join(gone)}"] if gone else []) + ([f"added: {', '.join(new)}"] if new else [])
    text = "; ".join(parts)
    return f" {text[:1].upper()}{text[1:]}." if parts else ""


def resume_mixture(state, current: dict, order: MixtureOrder, paths=None) -> tuple[OrderState, int, list[int]]:
    """Validate a saved mixture state against the ``current`` loader's (:func:`mixture_state` at 0) and set
    ``order``'s stream where the saved run stands; returns the saved OrderState (for ``check_compatible``), the
    global position of its epoch's first sample (the saved ``mixture.origin``, else ``epoch * L`` with the saved
    global batch's L) and the positions of the weight edits (the saved ones, plus this one when this loader's
    weights differ from the saved: section 3.3).

    StateError / StateMismatchError naming the field: not a mixture state, another mixture_algo, another number
    of sources (naming the removed and added ones; ``paths``: this mixture's files, for the message), a source
    that is another file (``mixture.sources[i].dataset_id``), another samples_per_epoch, a
    bad ``mixture.origin`` or ``mixture.base``, or, with the saved weights, source cursors that disagree with the
    schedule. Other weights are not an error: the run goes on with them from the saved position.
    """
    if not isinstance(state, Mapping):
        raise StateError("version", f"a state must be a mapping, got {type(state).__name__}")
    saved_mix = state.get("mixture")
    if not isinstance(saved_mix, Mapping):
        raise StateMismatchError("mixture", None, "a Mixture", "The state was saved by a loader on one file: "
                                 "resume it with a Loader on that file.")
    saved = OrderState.from_dict({k: v for k, v in state.items() if k != "mixture"})
    cur = current["mixture"]
    for name in ("mixture_algo", "quotas", "samples_per_epoch", "sources"):
        if name not in saved_mix:
            raise StateError(f"mixture.{name}", "missing")
    if saved_mix["mixture_algo"] != MIXTURE_ALGO:
        raise StateError("mixture.mixture_algo", f"unsupported value {saved_mix['mixture_algo']!r}: this pageset "
                         f"implements mixture_algo {MIXTURE_ALGO}; resume with the version that wrote the state")
    sources = saved_mix["sources"]
    if not isinstance(sources, list) or len(sources) != len(cur["sources"]):
        n = len(sources) if isinstance(sources, list) else sources
        raise StateMismatchError("mixture.sources", n, len(cur["sources"]),
                                 "The mixture has another number of files: construct it with the saved sources."
                                 + _changed_sources(sources, cur["sources"], paths))
    for i, (a, b) in enumerate(zip(sources, cur["sources"])):
        if not isinstance(a, Mapping) or a.get("dataset_id") != b["dataset_id"]:
            got = a.get("dataset_id") if isinstance(a, Mapping) else a
            raise StateMismatchError(f"mixture.sources[{i}].dataset_id", got, b["dataset_id"],
                                     f"Source {i} is another file: pass the saved files in the saved order.")
    if saved_mix["samples_per_epoch"] != cur["samples_per_epoch"]:
        raise StateMismatchError("mixture.samples_per_epoch", saved_mix["samples_per_epoch"],
                                 cur["samples_per_epoch"], "Construct the Mixture with the saved samples_per_epoch.")
    if "origin" in saved_mix:
        origin = saved_mix["origin"]
        if type(origin) is not int or origin < 0:
            raise StateError("mixture.origin", f"must be an int >= 0 (the global position of the epoch's first "
                             f"sample), got {origin!r}")
    else:
        origin = saved.epoch * saved_end(saved.replace(batch_offset=0, cursor=0), saved_mix["samples_per_epoch"])
    g = origin + saved.cursor
    counts = _saved_counts(sources, order.n_records)
    edits = saved_mix.get("edits", [])
    base = saved_mix.get("base")
    if not isinstance(edits, list) or any(type(e) is not int or not 0 <= e <= g for e in edits) \
            or (base is None) != (not edits):
        raise StateError("mixture.edits", f"must list the positions (ints in [0, {g}]) where the weights were "
                         f"edited, with mixture.base, got {edits!r}")
    stream = order.stream
    if _identity(saved_mix) != _identity(cur):  # other weights: this loader's take over from g (section 3.3)
        stream.set_base(g, counts)
        return saved.replace(dataset_id=current["dataset_id"]), origin, [*edits, g]
    if base is not None:
        if not isinstance(base, Mapping) or type(base.get("position")) is not int \
                or base["position"] != edits[-1] or not isinstance(base.get("counts"), list) \
                or len(base["counts"]) != len(sources) \
                or any(type(c) is not int or c < 0 for c in base["counts"]):
            raise StateError("mixture.base", f"must be {{'position': the last edit ({edits[-1]}), 'counts': "
                             f"{len(sources)} ints >= 0}}, got {base!r}")
        stream.set_base(base["position"], base["counts"])
    expected = order.cursors(g)
    got = [(a.get("epoch"), a.get("cursor")) for a in sources]
    if got != [tuple(e) for e in expected]:
        raise StateError("mixture.sources", f"the saved source positions {got} disagree with the schedule at "
                         f"epoch {saved.epoch}, cursor {saved.cursor} ({expected}): the state was edited or "
                         f"damaged")
    return saved, origin, list(edits)


def _exact(w) -> Fraction:
    return Fraction(int(w)) if isinstance(w, numbers.Integral) else Fraction(float(w))


class Mixture(PlanSpec):
    """Several pageset files read as one stream, in fixed proportions or on a schedule of weights.

    ``Mixture(sources, weights, *, samples_per_epoch=None, weight_unit="samples")``: sources, a sequence of S >= 1
    paths (str or os.PathLike) of pageset files with the same loaded fields; weights, S finite numbers >= 0, not
    all zero (only the ratios matter; resolved by :func:`quotas`), or a :class:`~pageset.Schedule` of such
    weights over the global sample position (formats/mixture.md section 3); samples_per_epoch, int >= 1 samples
    in one epoch of the mixture (default: the sum of the sources' sizes, set by the loader); weight_unit, what the
    weights share out: ``"samples"`` (rows) or ``"tokens"`` (token rows only: the predictions they hold,
    padding excluded; formats/mixture.md section 2.6): the loader turns token weights into sample weights
    ``w_i * N_i / T_i`` (N_i rows holding T_i predictions in source i; a schedule's every stage), so sources of
    emptier rows (packed rows with more padding) give more rows for the same share of tokens.

    Pass it to ``Loader`` instead of a path. Raises TypeError / ValueError naming the argument: an empty
    source list, a source that is not a path, a weight count that differs from the source count, or a bad
    weight (see :func:`quotas` and :class:`~pageset.Schedule`), or samples_per_epoch < 1.
    """

    def __init__(self, sources, weights, *, samples_per_epoch: int | None = None, weight_unit: str = "samples"):
        if isinstance(sources, (str, bytes, os.PathLike)):
            raise TypeError("sources must be a list of paths, e.g. Mixture(['a.pageset', 'b.pageset'], [0.7, 0.3])")
        self.sources = tuple(sources)
        if not self.sources:
            raise ValueError("sources is empty: a mixture needs at least one file")
        if len(self.sources) > MAX_SOURCES:
            raise ValueError(f"{len(self.sources)} sources: at most {MAX_SOURCES}")
        for i, s in enumerate(self.sources):
            if not isinstance(s, (str, os.PathLike)):
                raise TypeError(f"sources[{i}] = {s!r} is not a path (str or os.PathLike)")
        if isinstance(weights, Schedule):
            self.schedule = weights
            if weights.n_weights != len(self.sources):
                raise ValueError(f"the schedule has {weights.n_weights} weights per stage for {len(self.sources)} "
                                 "sources: give every stage one weight per source")
            stage_weights = [list(w) for w in weights.given]
        else:
            self.schedule = None
            if isinstance(weights, (str, bytes)) or not hasattr(weights, "__len__"):
                raise TypeError(f"weights must be a sequence of numbers, one per source, or a Schedule, got "
                                f"{weights!r}")
            if len(weights) != len(self.sources):
                raise ValueError(f"{len(weights)} weights for {len(self.sources)} sources: give one weight per "
                                 "source")
            stage_weights = [list(weights)]
            quotas(weights)  # the errors name the weight
        self.stage_quotas = tuple(quotas(w) for w in stage_weights)
        self.quotas = self.stage_quotas[0]
        self.weights = tuple(float(w) for w in stage_weights[0])
        # the weights' exact values (weight_unit="tokens" divides them, not their rounded quotas: section 2.6)
        self._exact = tuple(tuple(_exact(w) for w in ws) for ws in stage_weights)
        if samples_per_epoch is not None:
            if isinstance(samples_per_epoch, bool) or not isinstance(samples_per_epoch, numbers.Integral) \
                    or samples_per_epoch < 1:
                raise ValueError(f"samples_per_epoch must be an int >= 1 (or None: the sum of the sources' "
                                 f"sizes), got {samples_per_epoch!r}")
            samples_per_epoch = int(samples_per_epoch)
        self.samples_per_epoch = samples_per_epoch
        if not isinstance(weight_unit, str):
            raise TypeError(f"weight_unit must be 'samples' or 'tokens', got {weight_unit!r}")
        if weight_unit not in ("samples", "tokens"):
            raise ValueError(f"weight_unit must be 'samples' or 'tokens', got {weight_unit!r}")
        self.weight_unit = weight_unit

    optional_fields = True  # a field mapped to None may be missing from some of the files

    @property
    def paths(self) -> tuple:
        return self.sources

    def _stage_name(self, j: int) -> str:
        return "" if self.schedule is None else f"stage {j} (start {self.schedule.starts[j]}) of the schedule: "

    def plan(self, members: list[Member], params: OrderParams) -> MixturePlan:
        """The :class:`MixturePlan` over the opened sources; ValueError naming the file (and the stage) of a
        source with a positive weight and no records, or (the mixture's epoch) no full step."""
        for j, (ws, qs) in enumerate(zip(self._exact, self.stage_quotas)):
            for i, (m, q) in enumerate(zip(members, qs)):
                if q > 0 and m.n_records == 0:
                    raise ValueError(f"{m.path}: {self._stage_name(j)}source {i} of the mixture has no records but "
                                     f"weight {float(ws[i])}; give it weight 0 or drop it")
        stages = [self._sample_quotas(members, j) for j in range(len(self.stage_quotas))]
        if self.schedule is None:
            stream = StreamSchedule.constant(stages[0])
        else:
            stream = StreamSchedule(self.schedule.starts, stages, self.schedule.interpolate, self.schedule.block)
        return MixturePlan(members, stream, self.samples_per_epoch, params)

    def sample_quotas(self, members: list[Member]) -> tuple[int, ...]:
        """The quotas of rows (of the first stage, for a schedule): :attr:`quotas` for ``weight_unit="samples"``;
        for ``"tokens"`` the quotas of the sample weights ``w_i * N_i / T_i`` (exact rationals of the weights as
        given, not of their quotas: those are rounded when the shares are not simple fractions; formats/mixture.md
        2.6), scaled by ``1 / max``, resolved by :func:`quotas`; N_i and T_i the rows and predictions of source i.
        ValueError naming the file of a weighted source without token rows."""
        return self._sample_quotas(members, 0)

    def _sample_quotas(self, members: list[Member], stage: int) -> tuple[int, ...]:
        if self.weight_unit == "samples":
            return self.stage_quotas[stage]
        weights = []
        for i, (m, q, w) in enumerate(zip(members, self.stage_quotas[stage], self._exact[stage])):
            if q == 0:
                weights.append(Fraction(0))
                continue
            if m.tokens is None or m.tokens <= 0:
                raise ValueError(f"{m.path}: {self._stage_name(stage)}source {i} of the mixture has no token rows, "
                                 "so weight_unit='tokens' cannot weigh it; load token files with TokenWindows(...) "
                                 "or use weight_unit='samples'")
            weights.append(w * m.n_records / m.tokens)
        scale = max(weights)
        return quotas([float(w / scale) for w in weights])

    @property
    def shares(self) -> tuple[float, ...]:
        """The resolved share of each source, ``q_i / sum(q)`` (the first stage's, for a schedule)."""
        d = sum(self.quotas)
        return tuple(q / d for q in self.quotas)

    def __repr__(self) -> str:
        weights = repr(self.schedule) if self.schedule is not None else repr(list(self.weights))
        return (f"Mixture({[os.fspath(s) for s in self.sources]!r}, weights={weights}, "
                f"weight_unit={self.weight_unit!r}, "
                f"samples_per_epoch={self.samples_per_epoch!r})")


class MixturePlanEpoch(PlanEpoch):
    """One mixture epoch as a plan's epoch: rows from :class:`MixtureEpoch`, no padding, ``_source`` shown."""

    def __init__(self, epoch: MixtureEpoch):
        self.view = epoch

    def batch(self, start: int, stop: int) -> PlanBatch:
        sources, ids = self.view.batch(start, stop)
        return PlanBatch(sources, ids, np.zeros(stop - start, dtype=bool), ids)

    def file_ids(self, k: int, start: int, stop: int) -> np.ndarray:
        sources, ids = self.view.lookup(start, stop)
        return ids[sources == k]


class MixturePlan(Plan):
    """A Mixture's plan (formats/mixture.md sections 2, 3): the schedule over the sources' own orders.

    ``MixturePlan(members, quotas, samples_per_epoch, params)``: members, the opened sources; quotas as from
    :func:`quotas`, or a :class:`~pageset.order.schedule.StreamSchedule`; samples_per_epoch int or None (the sum
    of the sources' records). Batches carry ``_source``; the state is :func:`mixture_state`'s, checked on resume
    by :func:`resume_mixture` (which may move the stream to edited weights: :attr:`edits`).
    """

    hands_sources = True

    def __init__(self, members: list[Member], quota_values, samples_per_epoch: int | None, params: OrderParams):
        super().__init__(params)
        self.source_ids = [m.dataset_id for m in members]
        self.source_paths = [m.path for m in members]
        self.n_records = samples_per_epoch or sum(m.n_records for m in members)
        stream = quota_values if isinstance(quota_values, StreamSchedule) else StreamSchedule.constant(quota_values)
        self.order = MixtureOrder(stream, [m.page_sizes for m in members], params.seed,
                                  params.order, [params.pages_per_window(m.page_sizes) for m in members])
        self.stream = stream
        stream.period(stream.piece_at(0).quotas)  # the first EDF period now (its kernel compiles with the plan)
        self.path = f"Mixture of {len(members)} files ({', '.join(m.path for m in members)})"
        self.dataset_id = mixture_id(self.source_ids, stream.quotas, self.n_records,
                                     None if stream.is_constant else stream.schedule_id())
        self.epoch_length = self._epoch_length()
        self.edits: list[int] = []  # positions where this run's weights were edited on resume (section 3.3)

    def epoch(self, epoch: int, shift: int = 0) -> PlanEpoch:
        """Mixture epoch ``epoch``: global positions from ``epoch * L + shift`` on."""
        return MixturePlanEpoch(MixtureEpoch(self.order, epoch * self.epoch_length + shift, self.epoch_length))

    def state(self, epoch: int, cursor: int, shift: int = 0) -> dict:
        origin = epoch * self.epoch_length + shift
        return mixture_state(self.order, self.source_ids, self.n_records, self._order_state(epoch, cursor),
                             origin + cursor, origin if shift else None, self.edits)

    def resume(self, state, world_size: int) -> tuple[int, int, int]:
        """As :meth:`Plan.resume`; the shift places this loader's epochs so that its stream continues at the
        saved global position (another global batch gives another L, so ``epoch * L`` alone would not). With
        other weights than the saved ones, this loader's take over at that position (section 3.3)."""
        stream = self.stream
        kept = (stream.edit_position, stream.offset, self.edits)
        stream.edit_position, stream.offset, self.edits = 0, np.zeros_like(stream.offset), []
        try:
            saved, origin, edits = resume_mixture(state, self.state(0, 0), self.order, self.source_paths)
            check_compatible(saved, self._order_state(0, 0), world_size, self.n_records)
        except BaseException:
            stream.edit_position, stream.offset, self.edits = kept
            raise
        self.edits = edits
        epoch, cursor, passed = resume_cursor(saved, self.n_records, self.params.global_batch_size)
        return epoch, cursor, origin + passed - epoch * self.epoch_length

    def describe(self, epoch: int, cursor: int, shift: int = 0) -> dict:
        """Where the stream stands at ``(epoch, cursor)``: ``{"position", "stage", "weights", "counts",
        "stage_counts", "edits"}``: the global position g, the schedule's stage at g (0 for constant weights), the
        sources' shares there (floats; a ramp's interpolated), every source's samples before g, those taken in the
        current stage (since the later of its start and the last edit), and the edit positions."""
        g = epoch * self.epoch_length + shift + cursor
        stage, shares = self.stream.shares_at(g)
        counts = self.stream.counts(g)
        since = max(self.stream.starts[stage], self.stream.edit_position)
        return {"position": int(g), "stage": stage, "weights": shares, "counts": counts.tolist(),
                "stage_counts": (counts - self.stream.counts(since)).tolist(), "edits": list(self.edits)}
