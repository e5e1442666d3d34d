"""Counter-based 64-bit keys: the only source of randomness in pageset (order v1, ``order_algo = 1``).

``key(seed, epoch, tag, i)`` chains splitmix64 (Steele, Lea & Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014; constants from Vigna's reference ``splitmix64.c``) over the integers. It is a pure
function of its arguments: no Python ``hash()``, no ``np.random``, no thread state, so the same (seed, epoch,
position) gives the same bits in any process, rank or thread.

Each function exists twice with identical results: ``*_py`` on Python ints (exact, masked to 64 bits) and a
Numba version on ``uint64`` (wrapping arithmetic). ``tests/test_keys.py`` checks that they agree.
"""

from __future__ import annotations

import numba
import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15

# Stream tags: which decision a key drives. Fixed integers, part of order v1 (never reorder or reuse).
TAG_PERMUTATION = 1  # the full-shuffle permutation of ids (order="random")
TAG_PAGES = 2  # the permutation of pages (order="quasi_random")
TAG_WINDOW = 3  # the permutation of ids inside one window of pages (i = window index)
TAG_AUG = 4  # augmentation randomness of the sample at epoch position i
TAG_MIXTURE_SOURCE = 5  # the order seed of source i of a mixture (epoch 0)


def splitmix64_py(x: int) -> int:
    """One splitmix64 output for state ``x`` (Python int in [0, 2**64)); returns a Python int."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def key_py(seed: int, epoch: int, tag: int, i: int) -> int:
    """``key(seed, epoch, tag, i)`` on Python ints: a 64-bit value (Python int)."""
    h = splitmix64_py(seed & MASK64)
    h = splitmix64_py(h ^ (epoch & MASK64))
    h = splitmix64_py(h ^ (tag & MASK64))
    return splitmix64_py(h ^ (i & MASK64))


@numba.njit(nogil=True)
def splitmix64(x):
    """Numba twin of :func:`splitmix64_py`: ``x`` uint64 -> uint64 (wrapping arithmetic)."""
    z = numba.uint64(x) + numba.uint64(GOLDEN)
    z = (z ^ (z >> numba.uint64(30))) * numba.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> numba.uint64(27))) * numba.uint64(0x94D049BB133111EB)
    return z ^ (z >> numba.uint64(31))


@numba.njit(nogil=True)
def key(seed, epoch, tag, i):
    """Numba twin of :func:`key_py`; all arguments are cast to uint64, returns uint64."""
    h = splitmix64(numba.uint64(seed))
    h = splitmix64(h ^ numba.uint64(epoch))
    h = splitmix64(h ^ numba.uint64(tag))
    return splitmix64(h ^ numba.uint64(i))


@numba.njit(nogil=True)
def _sample_keys(seed, epoch, positions, out):
    for j in range(positions.shape[0]):
        out[j] = key(seed, epoch, TAG_AUG, positions[j])


def sample_keys(seed: int, epoch: int, positions: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Augmentation keys for epoch positions.

    positions: int64[n] (epoch positions, not record ids: the same record at two positions of one epoch gets
    two keys). out: optional uint64[n] written in place. Returns uint64[n], ``key(seed, epoch, TAG_AUG, p)``.
    """
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    if out is None:
        out = np.empty(positions.shape[0], dtype=np.uint64)
    _sample_keys(np.uint64(seed & MASK64), np.uint64(epoch & MASK64), positions, out)
    return out


@numba.njit(nogil=True)
def uniform(k, counter):
    """A float64 in [0, 1) from key ``k`` (uint64) and draw number ``counter``: 53 high bits of one mix."""
    z = splitmix64(numba.uint64(k) ^ (numba.uint64(counter) * numba.uint64(GOLDEN)))
    return (z >> numba.uint64(11)) * (1.0 / 9007199254740992.0)


def uniform_py(k: int, counter: int) -> float:
    """Python twin of :func:`uniform`."""
    z = splitmix64_py((k ^ ((counter * GOLDEN) & MASK64)) & MASK64)
    return (z >> 11) * (1.0 / 9007199254740992.0)


# --- Streams and bounded integers (added with the shuffles; results above are unchanged) ------------------
#
# ``key(seed, epoch, tag, i)`` is ``key_step(key_base(seed, epoch, tag), i)``: hoisting the first three
# mixes out of a loop over i saves 3 of the 4 splitmix64 calls per draw, which matters for a Fisher-Yates
# over 1e8 ids.


def key_base_py(seed: int, epoch: int, tag: int) -> int:
    """The stream state of ``(seed, epoch, tag)`` (Python int in [0, 2**64)); see :func:`key_step_py`."""
    h = splitmix64_py(seed & MASK64)
    h = splitmix64_py(h ^ (epoch & MASK64))
    return splitmix64_py(h ^ (tag & MASK64))


def key_step_py(base: int, i: int) -> int:
    """Draw ``i`` of the stream ``base``: ``key_step_py(key_base_py(s, e, t), i) == key_py(s, e, t, i)``."""
    return splitmix64_py((base ^ (i & MASK64)) & MASK64)


@numba.njit(nogil=True)
def key_base(seed, epoch, tag):
    """Numba twin of :func:`key_base_py`; arguments cast to uint64, returns uint64."""
    h = splitmix64(numba.uint64(seed))
    h = splitmix64(h ^ numba.uint64(epoch))
    return splitmix64(h ^ numba.uint64(tag))


@numba.njit(nogil=True)
def key_step(base, i):
    """Numba twin of :func:`key_step_py`; ``base`` and ``i`` cast to uint64, returns uint64."""
    return splitmix64(numba.uint64(base) ^ numba.uint64(i))


def randbelow_py(k: int, n: int) -> int:
    """An integer uniform in ``[0, n)`` from the 64-bit key ``k``, exactly unbiased (Python ints).

    Lemire's nearly-divisionless method (D. Lemire, "Fast random integer generation in an interval",
    ACM TOMACS 29(1), 2019): the answer is the high word of the 128-bit product ``x * n``; the low word
    rejects the ``2**64 mod n`` values of x that would bias it. The first x is ``k``; a rejected x is
    replaced by ``splitmix64_py(x)``. Rejection has probability ``(2**64 mod n) / 2**64 < n / 2**64``: about
    5e-12 for n = 1e8, so in practice one draw per call. ``n`` must be in [1, 2**64) (ValueError otherwise).
    """
    if not 1 <= n <= MASK64:
        raise ValueError(f"randbelow needs 1 <= n < 2**64, got n={n}")
    x = k & MASK64
    m = x * n
    low = m & MASK64
    if low < n:
        threshold = (MASK64 + 1 - n) % n  # 2**64 mod n: the count of biased low words
        while low < threshold:
            x = splitmix64_py(x)
            m = x * n
            low = m & MASK64
    return m >> 64


@numba.njit(nogil=True)
def _mul_hi_lo(a, b):
    """The 128-bit product of uint64 ``a`` and ``b`` as (high, low) uint64 words (schoolbook on 32-bit
    halves: Numba has no 128-bit integer)."""
    mask = numba.uint64(0xFFFFFFFF)
    s32 = numba.uint64(32)
    a_lo = a & mask
    a_hi = a >> s32
    b_lo = b & mask
    b_hi = b >> s32
    p0 = a_lo * b_lo
    p1 = a_lo * b_hi
    p2 = a_hi * b_lo
    p3 = a_hi * b_hi
    mid = (p0 >> s32) + (p1 & mask) + (p2 & mask)  # < 3 * 2**32: no overflow
    hi = p3 + (p1 >> s32) + (p2 >> s32) + (mid >> s32)
    return hi, a * b


@numba.njit(nogil=True)
def randbelow(k, n):
    """Numba twin of :func:`randbelow_py`: ``k`` and ``n`` cast to uint64 (n >= 1, not checked here: the
    callers pass sizes >= 1), returns uint64 in [0, n)."""
    x = numba.uint64(k)
    n = numba.uint64(n)
    hi, low = _mul_hi_lo(x, n)
    if low < n:
        threshold = (numba.uint64(0) - n) % n  # 2**64 mod n, with wrapping subtraction
        while low < threshold:
            x = splitmix64(x)
            hi, low = _mul_hi_lo(x, n)
    return hi
