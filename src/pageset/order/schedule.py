"""Mixture weights that change along the stream (``formats/mixture.md`` section 3): :class:`Schedule`, the user's
stages, and :class:`StreamSchedule`, the stream they give: every global position's source and every source's
sample counts, as a pure function of the stages' quotas (and, after weights edited on resume, of the position
and counts where the edit took effect).

A schedule is cut into *pieces*: stretches of the stream over which one set of integer quotas repeats with the
EDF period of section 2.2 (:class:`~pageset.order.quotas.MixtureSchedule`), starting at the piece's first
position. A step stage of finite length L is ``L div D`` whole periods of its quotas and one *tail* piece of the
rest ``r = L mod D`` positions, whose quotas share r by largest remainder; the last stage is one piece without
end. A linear ramp between two stages is cut into blocks; each block is one piece whose quotas share its length by
largest remainder of what each source is owed at the block's end (the integral of the interpolated shares, less
what it got in the ramp so far), so the rounding never accumulates. Counts at a piece's start are sums over the
pieces before it, computed once, as far as the stream has been asked for.

Pure functions of integers and numpy arrays: no file, no torch.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import numbers
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from .quotas import MAX_SOURCES, RESOLUTION, MixtureSchedule, quotas

INTERPOLATIONS = ("step", "linear")
MAX_BLOCK = RESOLUTION  # a ramp block is one EDF period at most this long (its slots are built when it is read)
DEFAULT_RAMP_BLOCKS = 100  # block=None: a ramp of L positions in blocks of max(ceil(L / 100), 4096)
MIN_DEFAULT_BLOCK = 4096  # a piece costs ~25 us to generate and read: keep that near 0.005 us per sample


class Schedule:
    """Mixture weights as a function of the global sample position: ``Mixture(sources, weights=Schedule(...))``.

    ``Schedule(stages, interpolate="step", *, block=None)``:

    - ``stages``: a sequence of ``(start, weights)`` pairs; ``start`` an int >= 0, the global position (samples of
      the mixture stream over all epochs, all ranks together: step s of a run with global batch G starts at
      ``s * G``) from which the stage's weights hold; the first stage starts at 0 and the starts increase.
      ``weights``: one finite number >= 0 per source, not all zero (only their ratios matter, as for constant
      weights: ``formats/mixture.md`` section 2.1).
    - ``interpolate``: ``"step"`` (a stage's weights hold until the next stage starts) or ``"linear"`` (the shares
      move linearly from one stage's to the next one's, reaching them at its start), for every gap between two
      stages, or a sequence with one of these per gap (``len(stages) - 1`` values). The last stage holds forever.
    - ``block``: samples per block of a linear ramp, an int in ``[1, 10**6]``; None: ``max(ceil(L / 100),
      4096)`` for a ramp of L positions (at most 100 blocks of at least 4096 samples, each at most 10**6: more
      blocks for a ramp over 10**8). Each block gets whole samples: what every source is owed at the block's end
      (the integral of its interpolated share over the ramp so far), less what it already got, shared out by
      largest remainder (``formats/mixture.md`` section 3.2). A block is a piece of the stream, which costs ~25 us
      to plan and read: blocks of a few samples make a batch that crosses many of them cost more than the batch.

    Attributes: ``starts`` (tuple of ints), ``weights`` (tuple of tuples of floats, as given),
    ``stage_quotas`` (each stage's weights resolved by ``quotas``), ``interpolate`` (tuple, one per gap),
    ``block``, ``n_weights`` (weights per stage).

    Raises TypeError / ValueError naming the stage (index and start): not a sequence of pairs, a start that is
    not an int >= 0, a first stage not at 0, starts out of order or repeated, stages with different numbers of
    weights, a weight that is negative, NaN or infinite, weights that are all zero; a bad ``interpolate`` or
    ``block``.
    """

    def __init__(self, stages, interpolate="step", *, block: int | None = None):
        if isinstance(stages, (str, bytes, dict)) or not hasattr(stages, "__len__"):
            raise TypeError(f"stages must be a sequence of (start, weights) pairs, e.g. Schedule([(0, [0.9, 0.1]), "
                            f"(100_000, [0.5, 0.5])]), got {stages!r}")
        stages = list(stages)
        if not stages:
            raise ValueError("stages is empty: give at least one (start, weights) pair, the first at start 0")
        starts, weights, stage_quotas = [], [], []
        for j, stage in enumerate(stages):
            if isinstance(stage, (str, bytes)) or not hasattr(stage, "__len__") or len(stage) != 2:
                raise TypeError(f"stages[{j}] = {stage!r} is not a (start, weights) pair")
            start, w = stage
            if isinstance(start, (bool, np.bool_)) or not isinstance(start, numbers.Integral) or start < 0:
                raise ValueError(f"stages[{j}]: start {start!r} is not an int >= 0 (the global sample position "
                                 "from which the stage's weights hold)")
            start = int(start)
            if j == 0 and start != 0:
                raise ValueError(f"stages[0] starts at {start}: the first stage starts at position 0 (which weights "
                                 "would hold before it?)")
            if j and start <= starts[-1]:
                what = "repeats" if start == starts[-1] else "is before"
                raise ValueError(f"stages[{j}] starts at {start}, which {what} the start of stages[{j - 1}] "
                                 f"({starts[-1]}): list the stages once each, in increasing order of start")
            if isinstance(w, (str, bytes)) or not hasattr(w, "__len__"):
                raise TypeError(f"stages[{j}] (start {start}): weights must be a sequence of numbers, one per "
                                f"source, got {w!r}")
            if weights and len(w) != len(weights[0]):
                raise ValueError(f"stages[{j}] (start {start}) has {len(w)} weights, stages[0] has "
                                 f"{len(weights[0])}: give every stage one weight per source")
            try:
                q = quotas(w)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"stages[{j}] (start {start}): {exc}") from None
            starts.append(start)
            weights.append(tuple(float(x) for x in w))
            stage_quotas.append(q)
        if len(weights[0]) > MAX_SOURCES:
            raise ValueError(f"{len(weights[0])} weights per stage: at most {MAX_SOURCES} sources")
        gaps = len(stages) - 1
        if isinstance(interpolate, str):
            interp = (interpolate,) * gaps
            given = [interpolate]
        elif hasattr(interpolate, "__len__"):
            interp = tuple(interpolate)
            given = list(interp)
            if len(interp) != gaps:
                raise ValueError(f"interpolate has {len(interp)} values for {gaps} gaps between {len(stages)} "
                                 "stages: give one per gap, or one string for all")
        else:
            raise TypeError(f"interpolate must be 'step', 'linear' or a sequence of them, got {interpolate!r}")
        for k, v in enumerate(given):
            if v not in INTERPOLATIONS:
                where = "" if isinstance(interpolate, str) else f"[{k}]"
                raise ValueError(f"interpolate{where} = {v!r}: use one of {INTERPOLATIONS}")
        if block is not None:
            if isinstance(block, (bool, np.bool_)) or not isinstance(block, numbers.Integral) \
                    or not 1 <= block <= MAX_BLOCK:
                raise ValueError(f"block must be an int in [1, {MAX_BLOCK}] (samples per block of a linear ramp) "
                                 f"or None (max(ceil(L / {DEFAULT_RAMP_BLOCKS}), {MIN_DEFAULT_BLOCK}) for a ramp "
                                 f"of L samples), got {block!r}")
            block = int(block)
        self.starts = tuple(starts)
        self.weights = tuple(weights)
        self.given = tuple(tuple(stage[1]) for stage in stages)  # as given (ints stay ints: exact token weights)
        self.stage_quotas = tuple(stage_quotas)
        self.interpolate = interp
        self.block = block

    @property
    def n_weights(self) -> int:
        return len(self.weights[0])

    def __len__(self) -> int:
        return len(self.starts)

    def __repr__(self) -> str:
        stages = [(s, list(w)) for s, w in zip(self.starts, self.weights)]
        interp = self.interpolate[0] if len(set(self.interpolate)) == 1 else list(self.interpolate)
        return f"Schedule({stages!r}, interpolate={interp or 'step'!r}, block={self.block!r})"


def apportion(n: int, weights) -> list[int]:
    """``n`` (int >= 0) shared out in proportion to ``weights`` (ints >= 0, positive sum) by largest remainder:
    ``floor(n * w_i / W)`` each, then one more to the largest remainders ``n * w_i mod W`` (ties to the lower
    index) until they sum to n. Exact integer arithmetic (Python ints)."""
    total = sum(weights)
    parts = [divmod(n * w, total) for w in weights]
    out = [f for f, _ in parts]
    short = n - sum(out)
    if short:
        for i in sorted(range(len(out)), key=lambda i: (-parts[i][1], i))[:short]:
            out[i] += 1
    return out


def _reduced(q) -> tuple[int, ...]:
    g = math.gcd(*q)
    return tuple(x // g for x in q)


class Piece(NamedTuple):
    """A stretch ``[start, stop)`` of the stream (``stop`` None: no end) over which ``quotas`` repeat from
    ``start`` with their EDF period; ``base`` (tuple of ints): every source's samples before ``start``;
    ``stage``: the stage it belongs to."""

    start: int
    stop: int | None
    quotas: tuple
    base: tuple
    stage: int


class StreamSchedule:
    """The source of every global position of a mixture stream and every source's counts, for constant quotas or
    a schedule (``formats/mixture.md`` sections 2.2 and 3).

    ``StreamSchedule(starts, stage_quotas, interpolate=(), block=None, base=None)``: starts (ints, the first 0,
    increasing), stage_quotas (one tuple of ints >= 0 per stage, at least one positive each), interpolate (one
    ``"step"`` / ``"linear"`` per gap), block (int or None, as :class:`Schedule`); ``base`` ``(g0, counts)``:
    weights edited at position g0, where each source had taken ``counts[i]`` samples (section 3.3): from g0 on the
    counts are those of this schedule plus the difference. :meth:`constant` for constant quotas.

    Methods: :meth:`counts` (samples of each source before g), :meth:`lookup` (sources and per-source sample
    numbers of a position range), :meth:`pieces_in` (the pieces a range crosses), :meth:`piece_at`,
    :meth:`shares_at` (the weights in effect). Pieces are generated once, lazily, as far as asked for; EDF periods
    are built when a piece is read (a few are kept). One caller at a time.
    """

    PERIODS_KEPT = 16

    def __init__(self, starts, stage_quotas, interpolate=(), block=None, base=None):
        self.starts = tuple(int(s) for s in starts)
        self.stage_quotas = tuple(tuple(int(x) for x in q) for q in stage_quotas)
        self.interpolate = tuple(interpolate)
        self.block = block
        if len(self.starts) != len(self.stage_quotas) or not self.starts or self.starts[0] != 0 \
                or len(self.interpolate) != len(self.starts) - 1:
            raise ValueError(f"a schedule needs starts from 0 with one quota tuple each and one interpolation per "
                             f"gap; got starts {self.starts}, {len(self.stage_quotas)} quota tuples, "
                             f"interpolate {self.interpolate}")
        self.n_sources = len(self.stage_quotas[0])
        self.quotas = self.stage_quotas[0]  # the first stage's (a constant mixture's only) quotas
        self._periods: OrderedDict[tuple, MixtureSchedule] = OrderedDict()
        self._pieces: list[Piece] = []
        self._piece_starts: list[int] = []
        self._gen = self._generate()
        self._extend()
        self.edit_position, self.offset = 0, np.zeros(self.n_sources, dtype=np.int64)
        if base is not None:
            self.set_base(*base)

    @classmethod
    def constant(cls, quota_values) -> StreamSchedule:
        """The schedule of constant quotas (one stage from 0): a plain Mixture's."""
        return cls((0,), (tuple(quota_values),))

    @property
    def is_constant(self) -> bool:
        return len(self.starts) == 1

    def schedule_id(self) -> str:
        """``"schedule:<32 hex>"``: the SHA-256 of the stages' quotas, starts, interpolation and block (section
        3.4); another schedule, or the same weights resolving to other quotas, gives another id."""
        text = json.dumps({"block": self.block, "interpolate": list(self.interpolate),
                           "stages": [[s, list(q)] for s, q in zip(self.starts, self.stage_quotas)]}, sort_keys=True)
        return "schedule:" + hashlib.sha256(text.encode()).hexdigest()[:32]

    # --- pieces -------------------------------------------------------------------------------------------
    def _generate(self):
        """Yield the pieces in stream order (section 3.1, 3.2), each with the natural counts at its start."""
        counts = [0] * self.n_sources
        last = len(self.starts) - 1
        for j, (s, q) in enumerate(zip(self.starts, self.stage_quotas)):
            if j == last:
                yield Piece(s, None, _reduced(q), tuple(counts), j)
                return
            e = self.starts[j + 1]
            length = e - s
            if self.interpolate[j] == "step":
                q = _reduced(q)
                d = sum(q)
                m, r = divmod(length, d)
                if m:
                    yield Piece(s, s + m * d, q, tuple(counts), j)
                    counts = [c + m * x for c, x in zip(counts, q)]
                if r:
                    tail = apportion(r, q)
                    yield Piece(s + m * d, e, _reduced(tail), tuple(counts), j)
                    counts = [c + x for c, x in zip(counts, tail)]
                continue
            # linear ramp from stage j's shares p = q / D to stage j + 1's p' = q' / D' over `length` positions:
            # source i is owed T_i(y) = p_i y + (p'_i - p_i) y^2 / (2 length) samples by ramp offset y; in units
            # of 1 / K, K = 2 length D D': K T_i(y) = 2 length y q_i D' + (q'_i D - q_i D') y^2
            q2 = self.stage_quotas[j + 1]
            d, d2 = sum(q), sum(q2)
            k = 2 * length * d * d2
            b = self.block or max(-(-length // DEFAULT_RAMP_BLOCKS), MIN_DEFAULT_BLOCK)
            b = min(b, MAX_BLOCK)
            lin = [2 * length * a * d2 for a in q]
            quad = [a2 * d - a * d2 for a, a2 in zip(q, q2)]
            got = [0] * self.n_sources  # k times the samples of each source in the ramp so far
            sources = range(self.n_sources)
            for x in range(0, length, b):
                y = min(x + b, length)
                yy, size = y * y, min(b, length - x)
                owed = [max(u * y + v * yy - c, 0) for u, v, c in zip(lin, quad, got)]
                total = sum(owed)  # apportion(size, owed), inline: this loop runs once per block
                parts = [divmod(size * w, total) for w in owed]
                n = [f for f, _ in parts]
                short = size - sum(n)
                if short:
                    for i in sorted(sources, key=lambda i: (-parts[i][1], i))[:short]:
                        n[i] += 1
                g = math.gcd(*n)
                yield Piece(s + x, s + y, tuple(v // g for v in n), tuple(counts), j)
                counts = [c + v for c, v in zip(counts, n)]
                got = [c + k * v for c, v in zip(got, n)]

    def _extend(self, g: int | None = None) -> None:
        """Generate pieces until one holds position ``g`` (None: just the first)."""
        pieces, starts, gen = self._pieces, self._piece_starts, self._gen
        if not pieces:
            pieces.append(next(gen))
            starts.append(pieces[-1].start)
        if g is None:
            return
        last = pieces[-1]
        while last.stop is not None and last.stop <= g:
            last = next(gen)
            pieces.append(last)
            starts.append(last.start)

    def piece_at(self, g: int) -> Piece:
        """The piece holding global position ``g`` (int >= 0)."""
        g = int(g)
        self._extend(g)
        return self._pieces[bisect.bisect_right(self._piece_starts, g) - 1]

    def pieces_in(self, start: int, stop: int):
        """``[(piece, lo, hi)]``: the pieces crossed by positions ``[start, stop)``, each with its part."""
        out, g = [], int(start)
        while g < stop:
            p = self.piece_at(g)
            hi = stop if p.stop is None else min(stop, p.stop)
            out.append((p, g, hi))
            g = hi
        return out

    def period(self, q: tuple) -> MixtureSchedule:
        """The EDF period of quotas ``q`` (built once; the last few are kept)."""
        sched = self._periods.get(q)
        if sched is None:
            sched = MixtureSchedule(q)
            self._periods[q] = sched
            if len(self._periods) > self.PERIODS_KEPT:
                self._periods.popitem(last=False)
        else:
            self._periods.move_to_end(q)
        return sched

    # --- counts -------------------------------------------------------------------------------------------
    def natural_counts(self, g: int) -> np.ndarray:
        """int64[S]: samples of each source among positions ``[0, g)`` of this schedule run from 0 (no edit)."""
        g = int(g)
        p = self.piece_at(g)
        if g == p.start:
            return np.asarray(p.base, dtype=np.int64)
        return np.asarray(p.base, dtype=np.int64) + self.period(p.quotas).counts(g - p.start)

    def set_base(self, g0: int, counts) -> None:
        """Weights edited at ``g0``: from there on each source continues from ``counts[i]`` samples taken."""
        counts = np.asarray([int(c) for c in counts], dtype=np.int64)
        if counts.shape != (self.n_sources,) or (counts < 0).any():
            raise ValueError(f"base counts must be {self.n_sources} ints >= 0, got {counts.tolist()}")
        self.edit_position = int(g0)
        self.offset = counts - self.natural_counts(g0)

    def _check_after_edit(self, start: int) -> None:
        if start < self.edit_position:
            raise ValueError(f"position {start} is before position {self.edit_position}, where this loader's weights "
                             "took over from the resumed state's: the stream before it was made with the saved "
                             "weights. Resume from a state saved after it (or with the saved weights).")

    def counts(self, g: int) -> np.ndarray:
        """int64[S]: samples taken from each source among global positions ``[0, g)``."""
        if int(g) < self.edit_position:
            self._check_after_edit(int(g))
        return self.natural_counts(g) + self.offset

    def lookup(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """``(sources int16[n], k int64[n])`` for global positions ``[start, stop)``: ``k[j]`` is the index of that
        sample in its source's own stream."""
        self._check_after_edit(int(start))
        src = np.empty(stop - start, dtype=np.int16)
        k = np.empty(stop - start, dtype=np.int64)
        for p, lo, hi in self.pieces_in(start, stop):
            s, kk = self.period(p.quotas).lookup(lo - p.start, hi - p.start)
            src[lo - start : hi - start] = s
            k[lo - start : hi - start] = kk + (np.asarray(p.base, dtype=np.int64) + self.offset)[s]
        return src, k

    def shares_at(self, g: int) -> tuple[int, list[float]]:
        """``(stage, shares)``: the stage in effect at position g and the sources' shares there (a ramp's
        interpolated at g; floats summing to 1)."""
        j = bisect.bisect_right(self.starts, int(g)) - 1
        q = self.stage_quotas[j]
        p = [x / sum(q) for x in q]
        if j + 1 < len(self.starts) and self.interpolate[j] == "linear":
            q2 = self.stage_quotas[j + 1]
            f = (int(g) - self.starts[j]) / (self.starts[j + 1] - self.starts[j])
            p = [a + (x / sum(q2) - a) * f for a, x in zip(p, q2)]
        return j, p
