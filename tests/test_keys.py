"""Counter-based keys and bounded integers: Numba kernels equal their pure-Python twins, and stay pinned."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pageset.order.keys import (
    MASK64,
    TAG_AUG,
    key,
    key_base,
    key_base_py,
    key_py,
    key_step,
    key_step_py,
    randbelow,
    randbelow_py,
    sample_keys,
    splitmix64,
    splitmix64_py,
    uniform,
    uniform_py,
)

# With NUMBA_DISABLE_JIT=1 the kernels run on numpy uint64 scalars, which warn on the (intended) wrapping.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

u64 = st.integers(0, MASK64)
FAST = settings(max_examples=200, deadline=None)
U = np.uint64  # Numba types a Python int >= 2**63 as an overflow: pass uint64 scalars


@FAST
@given(u64)
def test_splitmix64_twins(x):
    assert int(splitmix64(U(x))) == splitmix64_py(x)


@FAST
@given(u64, u64, st.integers(0, 8), u64)
def test_key_twins_and_stream_split(seed, epoch, tag, i):
    expected = key_py(seed, epoch, tag, i)
    assert int(key(U(seed), U(epoch), U(tag), U(i))) == expected
    assert key_step_py(key_base_py(seed, epoch, tag), i) == expected
    assert int(key_step(U(key_base(U(seed), U(epoch), U(tag))), U(i))) == expected


def test_key_golden():
    # Pinned values: a change here changes every order and augmentation (order_algo must then change).
    assert splitmix64_py(0) == 0xE220A8397B1DCDAF  # first output of Vigna's splitmix64.c from state 0
    got = [key_py(42, 0, t, i) for t, i in [(1, 0), (1, 1), (2, 0), (3, 7), (4, 123456789)]]
    assert got == [0x79AC3B16DBC3B641, 0x4B06E83846747453, 0x6C2E6FF84B5D979D, 0x534F0085608CF2E0,
                   0x63AF14AAEC9FF34E]  # fmt: skip


@FAST
@given(
    u64, st.one_of(st.integers(1, 10), st.integers(1, 2**32), st.integers(2**63, MASK64), u64.filter(bool))
)
def test_randbelow_twins_and_range(k, n):
    r = randbelow_py(k, n)
    assert 0 <= r < n
    assert int(randbelow(U(k), U(n))) == r
    low = (k * n) & MASK64
    if low >= n:  # accepted on the first draw: the high word of the 128-bit product
        assert r == (k * n) >> 64


def test_randbelow_rejection_path():
    # n = 2**63 + 1: 2**64 mod n = 2**63 - 1, so about half the draws are rejected. k = 2 gives low word 2.
    n = 2**63 + 1
    threshold = (2**64 - n) % n
    assert (2 * n) & MASK64 < threshold
    x = splitmix64_py(2)
    while (x * n) & MASK64 < threshold:
        x = splitmix64_py(x)
    assert randbelow_py(2, n) == (x * n) >> 64
    assert int(randbelow(U(2), U(n))) == randbelow_py(2, n)


def test_randbelow_rejects_bad_n():
    for n in (0, -1, 2**64):
        with pytest.raises(ValueError, match="n="):
            randbelow_py(1, n)


def test_randbelow_is_uniform():
    # Deterministic keys, so no flakiness: 60,000 draws into 6 bins, each within 3% of 10,000 (sd ~ 91).
    counts = np.bincount([randbelow_py(key_py(7, 0, 9, i), 6) for i in range(60_000)], minlength=6)
    assert counts.sum() == 60_000
    assert np.all(np.abs(counts - 10_000) < 300), counts


@FAST
@given(u64, st.integers(0, 1000))
def test_uniform_twins(k, counter):
    v = uniform_py(k, counter)
    assert 0.0 <= v < 1.0
    assert uniform(U(k), counter) == v


@settings(max_examples=50, deadline=None)
@given(u64, u64, st.lists(st.integers(0, 2**40), max_size=20))
def test_sample_keys_twin(seed, epoch, positions):
    got = sample_keys(seed, epoch, np.array(positions, dtype=np.int64))
    assert got.dtype == np.uint64
    assert got.tolist() == [key_py(seed, epoch, TAG_AUG, p) for p in positions]
