"""A mixture's weights as integer quotas and the schedule of its sources (``formats/mixture.md`` sections 2-3):
:func:`quotas` resolves weights to integer quotas ``q_i``; :class:`MixtureSchedule` assigns every global position
of the stream to a source by earliest-deadline-first on Tijdeman's windows (the chairman assignment problem), so
that after every prefix of n samples ``|count_i(n) - n * q_i / D| < 1``, with per-source counts in closed form;
:func:`source_seed` gives each source its own order v1 seed. Pure functions of integers and numpy arrays.
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction

import numba
import numpy as np

from .keys import TAG_MIXTURE_SOURCE, key_py

RESOLUTION = 10**6  # float weights are resolved to integer quotas summing to (a divisor of) this
MAX_SOURCES = 32767  # the batch's "_source" is int16


def quotas(weights) -> tuple[int, ...]:
    """Integer quotas with the shares of ``weights``, reduced by their gcd: a tuple of ints >= 0.

    Python / numpy integers summing to at most RESOLUTION are kept exactly (``[999, 1]`` -> ``(999, 1)``).
    Otherwise shares within 1e-9 of simple fractions (denominators <= 1000, summing to 1) are taken as those
    fractions (``[0.5, 0.3, 0.2]`` -> ``(5, 3, 2)``, ``[1/3, 1/3, 1/3]`` -> ``(1, 1, 1)``); any other weights are
    apportioned to RESOLUTION by largest remainder on their exact values (ties to the lower index).
    ValueError naming the weight: not a real number, NaN, infinite, negative, all zero, or a positive weight
    below ``1 / RESOLUTION`` of the total (it would never be scheduled).
    """
    ws = list(weights)
    if not ws:
        raise ValueError("weights is empty: give one weight per source")
    exact = []
    for i, w in enumerate(ws):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Real):
            raise TypeError(f"weights[{i}] = {w!r} is not a number")
        if isinstance(w, numbers.Integral):
            exact.append(Fraction(int(w)))
            continue
        f = float(w)
        if math.isnan(f) or math.isinf(f):
            raise ValueError(f"weights[{i}] = {f} is not finite: weights are finite numbers >= 0")
        exact.append(Fraction(f))
    for i, w in enumerate(exact):
        if w < 0:
            raise ValueError(f"weights[{i}] = {float(w)} is negative: weights are finite numbers >= 0")
    total = sum(exact)
    if total == 0:
        raise ValueError(f"all weights are zero ({ws}): give at least one source a positive weight")
    if all(w.denominator == 1 for w in exact) and total <= RESOLUTION:
        q = [int(w) for w in exact]
    else:
        q = _simple_shares(exact, total) or _largest_remainder(exact, total)
    for i, (w, qi) in enumerate(zip(exact, q)):
        if w > 0 and qi == 0:
            raise ValueError(f"weights[{i}] = {float(w)} is below 1/{RESOLUTION} of the total {float(total)}: "
                             f"it would never be scheduled; raise it or drop the source")
    g = math.gcd(*q)
    return tuple(qi // g for qi in q)


def _simple_shares(exact: list[Fraction], total: Fraction) -> list[int] | None:
    """Quotas when every share is within 1e-9 of a fraction with denominator <= 1000 and those fractions sum
    to 1 (``[1/3, 1/3, 1/3]`` -> ``[1, 1, 1]``, ``[0.5, 0.3, 0.2]`` -> ``[5, 3, 2]``); else None."""
    shares = [w / total for w in exact]
    simple = [s.limit_denominator(1000) for s in shares]
    if sum(simple) != 1 or any(abs(a - b) > Fraction(1, 10**9) for a, b in zip(simple, shares)):
        return None
    d = math.lcm(*(f.denominator for f in simple))
    if d > RESOLUTION:
        return None
    return [int(f * d) for f in simple]


def _largest_remainder(exact: list[Fraction], total: Fraction) -> list[int]:
    """Quotas summing to RESOLUTION by largest remainder on the exact shares (ties to the lower index)."""
    scaled = [w * RESOLUTION / total for w in exact]
    q = [math.floor(s) for s in scaled]
    short = RESOLUTION - sum(q)
    for i in sorted(range(len(q)), key=lambda i: (-(scaled[i] - q[i]), i))[:short]:
        q[i] += 1
    return q


def source_seed(seed: int, source: int) -> int:
    """The order v1 seed of source ``source`` of a mixture with seed ``seed`` (``key(seed, 0, TAG, i)``):
    sources never share a permutation, even when two are the same file."""
    return key_py(seed, 0, TAG_MIXTURE_SOURCE, source)


@numba.njit(nogil=True)
def _edf_period(q, out, rank):
    """Fill ``out`` (int16[D], D = sum(q)) with the source of each slot of one period (EDF, see module doc) and
    ``rank`` (int32[D]) with the slots of the same source before each slot.

    Integer arithmetic only: with a = 2S' - 2 and b = 2S' - 3 (S' positive quotas, d = b / a), the k-th
    (1-based) sample of source i is released at slot t (1-based) when ``k * D * a <= t * q_i * a + b * D`` and
    its deadline is slot ``D * ((k - 1) * a + b) / (q_i * a)``; the released sample with the earliest deadline
    is taken, ties to the lower index. Returns the
    number of slots where no sample was released (0: the bound holds; the caller checks).
    """
    s = q.shape[0]
    d = 0
    positive = 0
    for i in range(s):
        d += q[i]
        if q[i] > 0:
            positive += 1
    a = np.int64(2 * positive - 2)
    b = np.int64(2 * positive - 3)
    counts = np.zeros(s, dtype=np.int64)
    idle = 0
    for t in range(1, d + 1):
        best = -1
        for i in range(s):
            if q[i] == 0:
                continue
            k = counts[i] + 1
            if positive > 1 and k * d * a > t * q[i] * a + b * d:
                continue  # not released yet: taking it now would put source i more than d ahead
            if best < 0:
                best = i
            elif ((k - 1) * a + b) * q[best] < (counts[best] * a + b) * q[i]:
                best = i  # earlier deadline: ((k - 1) a + b) / q_i < ((k_best - 1) a + b) / q_best
        if best < 0:  # never happens for EDF on Tijdeman's windows; fall back to the largest deficit
            idle += 1
            best = 0
            for i in range(s):
                if t * q[i] - counts[i] * d > t * q[best] - counts[best] * d:
                    best = i
        out[t - 1] = best
        rank[t - 1] = counts[best]
        counts[best] += 1
    return idle


class MixtureSchedule:
    """The source of every global position of a mixture stream, and per-source counts, in closed form.

    ``MixtureSchedule(quotas)``: quotas as from :func:`quotas` (ints >= 0, at least one positive, at most
    MAX_SOURCES). Attributes: ``quotas``, ``period`` (D), ``slots`` (read-only int16[D], the source of each
    slot of a period), ``rank`` (read-only int32[D], the slots of the same source before each slot).
    """

    def __init__(self, quota_values):
        q = np.asarray([int(x) for x in quota_values], dtype=np.int64)
        if q.ndim != 1 or q.size == 0 or q.size > MAX_SOURCES or (q < 0).any() or q.sum() == 0:
            raise ValueError(f"quotas must be 1 to {MAX_SOURCES} ints >= 0, not all zero; got {quota_values}")
        self.quotas = tuple(int(x) for x in q)
        self.period = int(q.sum())
        self.slots = np.empty(self.period, dtype=np.int16)
        rank = np.empty(self.period, dtype=np.int32)
        if _edf_period(q, self.slots, rank):
            raise AssertionError(f"mixture schedule for quotas {self.quotas} left a slot without a released "
                                 "sample (the EDF bound failed); please report it")
        self.slots.flags.writeable = False
        # rank[r]: slots of source slots[r] before slot r in a period, so count_i(g) for i = slots[g mod D] is
        # (g // D) * q_i + rank[g mod D] (the index of the sample at g in its source's stream) in O(1)
        rank.flags.writeable = False
        self.rank = rank
        self._quota_array = q
        self._positions = None  # the slots of each source, sorted: built by counts() when first asked

    @property
    def _slot_positions(self) -> list:
        """``[int64[q_i]]``: the slots of source i in one period, sorted (``c_i(r) = searchsorted(..., r)``)."""
        if self._positions is None:
            flat = np.argsort(self.slots, kind="stable").astype(np.int64)
            bounds = np.zeros(self._quota_array.size + 1, dtype=np.int64)
            np.cumsum(self._quota_array, out=bounds[1:])
            self._positions = [flat[bounds[i]:bounds[i + 1]] for i in range(self._quota_array.size)]
        return self._positions

    @property
    def n_sources(self) -> int:
        return len(self.quotas)

    def counts(self, g: int) -> np.ndarray:
        """int64[S]: samples taken from each source among global positions ``[0, g)``."""
        periods, r = divmod(int(g), self.period)
        return np.array([periods * qi + int(np.searchsorted(pos, r)) for qi, pos in
                         zip(self.quotas, self._slot_positions)], dtype=np.int64)

    def sources(self, start: int, stop: int) -> np.ndarray:
        """int16[stop - start]: the source of global positions ``[start, stop)``."""
        return self.slots[np.arange(start, stop, dtype=np.int64) % self.period]

    def lookup(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """``(sources int16[n], k int64[n])`` for global positions ``[start, stop)``: ``k[j]`` is the index of
        that sample within its source's own stream (``count_source(start + j)``)."""
        g = np.arange(int(start), int(stop), dtype=np.int64)
        periods, r = np.divmod(g, self.period)
        src = self.slots[r]
        return src, periods * self._quota_array[src] + self.rank[r]
