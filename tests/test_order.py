"""Order v1 without a file or a loader: permutations, rank slices, resume state (design note order.md)."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pageset.order import (
    ORDERS,
    EpochOrder,
    OrderState,
    StateError,
    StateMismatchError,
    check_compatible,
    epoch_length,
    epoch_permutation,
    local_batch,
    normalize_cursor,
    quasi_random_range,
    random_permutation,
    rank_positions,
    rank_span,
    resolve_rank,
    resume_point,
    sequential_range,
    steps_per_epoch,
    window_layout,
)
from pageset.order.keys import MASK64
from pageset.order.shuffle import _shuffled_arange, epoch_permutation_py, fisher_yates_py

# With NUMBA_DISABLE_JIT=1 the kernels run on numpy uint64 scalars, which warn on the (intended) wrapping.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

PROPS = settings(max_examples=100, deadline=None)
SLOW_PROPS = settings(max_examples=40, deadline=None)

seeds = st.integers(0, MASK64)
epochs = st.integers(0, 1000)
# Records per page; 0 is an empty page (a continuation page of a record larger than a page).
layouts = st.lists(st.integers(0, 6), max_size=24)


any_order = st.sampled_from(ORDERS)


@st.composite
def order_cases(draw, layout=layouts, orders=any_order):
    """(page_sizes, seed, epoch, order, window_pages) with M in {1, 2, K, K + 3}."""
    sizes = draw(layout)
    k = len(sizes)
    m = draw(st.sampled_from([1, 2, max(k, 1), k + 3]))
    return sizes, draw(seeds), draw(epochs), draw(orders), m


def ranges(n):
    return st.tuples(st.integers(0, n), st.integers(0, n)).map(sorted)


# --- permutations -------------------------------------------------------------------------------------


@PROPS
@given(st.integers(0, 40), seeds)
def test_fisher_yates_twins(n, base):
    assert _shuffled_arange(np.int64(n), np.uint64(base)).tolist() == fisher_yates_py(list(range(n)), base)


@PROPS
@given(order_cases())
def test_epoch_permutation_is_a_bijection_equal_to_its_twin(case):
    sizes, seed, epoch, order, m = case
    perm = epoch_permutation(sizes, seed, epoch, order, m)
    assert perm.dtype == np.int64 and perm.shape == (sum(sizes),)
    assert np.array_equal(np.sort(perm), np.arange(sum(sizes)))
    assert perm.tolist() == epoch_permutation_py(sizes, seed, epoch, order, m)


@PROPS
@given(order_cases(), st.data())
def test_ranges_equal_slices_of_the_epoch(case, data):
    sizes, seed, epoch, order, m = case
    n = sum(sizes)
    perm = epoch_permutation(sizes, seed, epoch, order, m)
    view = EpochOrder(sizes, seed, epoch, order, m)
    assert view.n_records == n
    for _ in range(4):
        a, b = data.draw(ranges(n))
        assert view.ids(a, b).tolist() == perm[a:b].tolist()
        if order == "quasi_random":
            assert quasi_random_range(sizes, seed, epoch, m, a, b).tolist() == perm[a:b].tolist()
        if order == "sequential":
            assert sequential_range(n, a, b).tolist() == perm[a:b].tolist()
    if n:  # padding positions wrap to the start of the permutation
        assert view.ids(n - 1, 3 * n + 2).tolist() == perm[np.arange(n - 1, 3 * n + 2) % n].tolist()


@PROPS
@given(order_cases(orders=st.just("quasi_random")))
def test_quasi_random_keeps_page_locality(case):
    sizes, seed, epoch, _, m = case
    starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    view = EpochOrder(sizes, seed, epoch, "quasi_random", m)
    page_order, window_starts = window_layout(sizes, seed, epoch, "quasi_random", m)
    assert sorted(page_order.tolist()) == list(range(len(sizes)))
    assert view.n_windows == -(-len(sizes) // m)
    for w in range(view.n_windows):
        pages = view.window_page_ids(w)
        assert pages.tolist() == page_order[w * m : (w + 1) * m].tolist()
        allowed = [i for p in pages for i in range(starts[p], starts[p + 1])]
        lo, hi = window_starts[w], window_starts[w + 1]
        assert sorted(view.ids(lo, hi).tolist()) == sorted(allowed)  # exactly the window's pages' records
        assert set(view.pages(lo, hi).tolist()) <= set(pages.tolist())
        if hi > lo:
            assert view.window_of(lo) == w and view.window_of(hi - 1) == w


def test_window_cache_holds_current_and_next_only():
    """Batch after batch (ranges inside the window the last call read take the fast path; ranges straddling two
    windows do not), the ids equal the permutation's and no window outside the cache stays referenced."""
    sizes = [10] * 50
    perm = epoch_permutation(sizes, 3, 1, "quasi_random", 2)
    view = EpochOrder(sizes, 3, 1, "quasi_random", 2)
    for start in range(0, 500, 7):
        stop = min(start + 7, 500)
        assert view.ids(start, stop).tolist() == perm[start:stop].tolist()
        assert len(view._cache) <= 2
        assert view._last is None or any(ids is view._last[2] for ids in view._cache.values())
    assert view.n_windows == 25
    got = view.ids(np.int64(3), np.int64(9))  # numpy integers: the checked path
    assert got.tolist() == perm[3:9].tolist() and got.flags.writeable


def test_window_pages_extremes():
    sizes = [3, 1, 0, 5, 2]
    one = epoch_permutation(sizes, 9, 0, "quasi_random", 1)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    pages = window_layout(sizes, 9, 0, "quasi_random", 1)[0]
    # M = 1: page-local, pages in permuted order, each page's records contiguous in positions.
    expected_blocks = [sorted(range(starts[p], starts[p + 1])) for p in pages]
    pos = 0
    for block in expected_blocks:
        assert sorted(one[pos : pos + len(block)].tolist()) == block
        pos += len(block)
    # M >= K: one window holding every page.
    for m in (5, 6, 100):
        assert EpochOrder(sizes, 9, 0, "quasi_random", m).n_windows == 1
    assert epoch_permutation(sizes, 9, 0, "sequential", 2).tolist() == list(range(11))
    assert EpochOrder(sizes, 9, 0, "random").n_windows == 1


def test_empty_dataset():
    for order in ORDERS:
        assert epoch_permutation([], 1, 0, order, 1).shape == (0,)
        assert epoch_permutation([0, 0], 1, 0, order, 1).shape == (0,)
        view = EpochOrder([0, 0], 1, 0, order, 1)
        assert view.ids(0, 0).shape == (0,)
        with pytest.raises(ValueError, match="no records"):
            view.ids(0, 1)


def test_orders_differ_between_epochs_and_seeds():
    sizes = GOLDEN_LAYOUT
    for order in ("random", "quasi_random"):
        base = epoch_permutation(sizes, 42, 0, order, 2)
        assert not np.array_equal(base, epoch_permutation(sizes, 42, 1, order, 2))
        assert not np.array_equal(base, epoch_permutation(sizes, 43, 0, order, 2))
    assert not np.array_equal(
        epoch_permutation(sizes, 42, 0, "random"), epoch_permutation(sizes, 42, 0, "quasi_random", 50)
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(page_sizes=[1, -2]), r"page_sizes\[1\] = -2"),
        (dict(page_sizes=[[1, 2]]), "1-D"),
        (dict(page_sizes=[1.5, 2.0]), "integers"),
        (dict(order="shuffle"), "order must be one of"),
        (dict(window_pages=0), "window_pages must be >= 1"),
        (dict(seed=-1), "seed must be in"),
        (dict(seed=2**64), "seed must be in"),
        (dict(epoch=-1), "epoch must be >= 0"),
    ],
)
def test_permutation_argument_errors(kwargs, match):
    args = dict(page_sizes=[2, 3], seed=1, epoch=0, order="quasi_random", window_pages=1) | kwargs
    with pytest.raises(ValueError, match=match):
        epoch_permutation(**args)


def test_range_errors():
    with pytest.raises(ValueError, match="past the end"):
        quasi_random_range([2, 3], 1, 0, 1, 0, 6)
    with pytest.raises(ValueError, match="start <= stop"):
        EpochOrder([2, 3], 1, 0, "random").ids(3, 2)
    with pytest.raises(TypeError, match="bool"):
        random_permutation(True, 1, 0)


# Golden vectors: seed 42, epoch 0, N = 1000 in 50 pages, M = 2. Any change to keys, Lemire's bounded
# integers, Fisher-Yates or the window rules changes these, and then order_algo must change too.
GOLDEN_LAYOUT = [17, 1, 40, 33, 9] * 10
GOLDEN_RANDOM = [
    839, 630, 961, 411, 894, 10, 539, 22, 934, 707, 623, 641, 557, 675, 651, 952,
    218, 26, 195, 846, 737, 304, 768, 973, 584, 598, 477, 692, 308, 127, 184, 724,
    647, 133, 107, 889, 275, 158, 52, 256, 390, 451, 650, 535, 743, 665, 793, 484,
    71, 576, 608, 302, 281, 562, 142, 143, 524, 211, 272, 36, 930, 30, 340, 219,
]  # fmt: skip
GOLDEN_QUASI_RANDOM = [
    710, 302, 708, 307, 312, 310, 306, 706, 716, 309, 301, 703, 305, 709, 315, 707,
    705, 704, 303, 300, 711, 304, 311, 700, 712, 701, 715, 702, 314, 308, 714, 313,
    316, 713, 211, 214, 215, 207, 206, 202, 204, 205, 203, 213, 209, 212, 208, 200,
    216, 617, 201, 210, 267, 10, 279, 4, 275, 281, 265, 14, 266, 278, 270, 282,
]  # fmt: skip


def test_golden_order():
    assert sum(GOLDEN_LAYOUT) == 1000
    for order, golden in (("random", GOLDEN_RANDOM), ("quasi_random", GOLDEN_QUASI_RANDOM)):
        assert epoch_permutation(GOLDEN_LAYOUT, 42, 0, order, 2)[:64].tolist() == golden
        assert epoch_permutation_py(GOLDEN_LAYOUT, 42, 0, order, 2)[:64] == golden


def _digest() -> str:
    h = hashlib.sha256()
    for order in ORDERS:
        h.update(epoch_permutation(GOLDEN_LAYOUT, 2**64 - 5, 3, order, 3).tobytes())
    return h.hexdigest()


def test_same_order_in_another_process():
    code = "from tests.test_order import _digest; print(_digest())"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == _digest()


def test_global_rngs_do_not_matter():
    torch = pytest.importorskip("torch")
    before = _digest()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)
    assert _digest() == before


# --- sharding -----------------------------------------------------------------------------------------


def test_epoch_length_table():
    assert epoch_length(10, 4, True) == 8 and epoch_length(10, 4, False) == 12
    assert epoch_length(12, 4, True) == 12 == epoch_length(12, 4, False)
    assert epoch_length(3, 8, False) == 8  # one padded batch
    assert steps_per_epoch(10, 4, False) == 3
    with pytest.raises(ValueError, match=r"N=3 .*global_batch=8.*drop_last=False"):
        epoch_length(3, 8, True)
    for drop_last in (True, False):
        with pytest.raises(ValueError, match="N=0"):
            epoch_length(0, 4, drop_last)
    with pytest.raises(ValueError, match="global_batch must be >= 1"):
        epoch_length(5, 0, False)


def test_local_batch_errors_name_values_and_fix():
    assert local_batch(12, 4) == 3
    with pytest.raises(ValueError, match=r"global_batch=10 is not divisible by world_size=4.*8 or 12"):
        local_batch(10, 4)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        local_batch(10, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\)"):
        rank_span(0, 2, 2, 4)
    with pytest.raises(ValueError, match="step=3 is past the epoch"):
        rank_positions(3, 0, 2, 4, 10, False)


def with_one_batch(sizes: list[int], g: int) -> list[int]:
    """``sizes`` plus a page of ``g`` records when they hold fewer than one global batch, so every example
    compares streams (drawn layouts of 0-6 records per page are often smaller than g = 12)."""
    return sizes if sum(sizes) >= g else [*sizes, g]


def divisors(g):
    return [w for w in range(1, g + 1) if g % w == 0]


@PROPS
@given(st.integers(1, 60), st.integers(1, 12), st.booleans())
def test_rank_streams_partition_the_epoch(n, g, drop_last):
    if drop_last and n < g:
        with pytest.raises(ValueError):
            epoch_length(n, g, drop_last)
        return
    length = epoch_length(n, g, drop_last)
    steps = steps_per_epoch(n, g, drop_last)
    assert length == steps * g and (length <= n if drop_last else n <= length < n + g)
    for w in divisors(g):
        seen = []
        for s in range(steps):
            step_positions = []
            for r in range(w):
                pos, pad = rank_positions(s, r, w, g, n, drop_last)
                assert pos.dtype == np.int64 and pos.shape == (g // w,) and pad.dtype == np.bool_
                assert pad.tolist() == (pos >= n).tolist()
                assert rank_span(s, r, w, g) == (pos[0], pos[-1] + 1)
                step_positions.extend(pos.tolist())
            assert step_positions == list(range(s * g, (s + 1) * g))  # all-gather in rank order
            seen.extend(step_positions)
        assert sorted(seen) == list(range(length))  # disjoint, covering [0, L), L/G batches per rank


@SLOW_PROPS
@given(
    order_cases(layout=st.lists(st.integers(0, 6), min_size=1, max_size=16)), st.integers(1, 8), st.booleans()
)
def test_global_stream_is_the_same_for_every_world_size(case, g, drop_last):
    sizes, seed, epoch, order, m = case
    sizes = with_one_batch(sizes, g)
    n = sum(sizes)
    config = Config(sizes, seed, order, m, g, drop_last)
    control = list(run(config, fresh_state(config), 1, steps_per_epoch(n, g, drop_last)))
    for w in divisors(g)[1:]:
        assert list(run(config, fresh_state(config), w, len(control))) == control


def test_resolve_rank_sources():
    env = {"RANK": "3", "WORLD_SIZE": "4"}
    assert resolve_rank(1, 2, environ=env) == (1, 2)  # explicit arguments win
    assert resolve_rank(environ=env, probe=lambda: (0, 8)) == (0, 8)  # then torch.distributed
    assert resolve_rank(environ=env, probe=lambda: None) == (3, 4)  # then the environment
    assert resolve_rank(environ={}) == (0, 1)
    with pytest.raises(ValueError, match="both rank and world_size"):
        resolve_rank(1, environ={})
    with pytest.raises(ValueError, match="WORLD_SIZE is missing"):
        resolve_rank(environ={"RANK": "0"})
    with pytest.raises(ValueError, match=r"RANK='x'"):
        resolve_rank(environ={"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match=r"rank=4.*environment"):
        resolve_rank(environ={"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        resolve_rank(0, 0)
    with pytest.raises(ValueError, match=r"rank=-1"):
        resolve_rank(-1, 2)


def test_resolve_rank_reads_os_environ_at_call_time(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resolve_rank() == (1, 2)


# --- resume: a pure simulation of the loader's bookkeeping ---------------------------------------------


@dataclass(frozen=True)
class Config:
    """What a loader is constructed with (everything but the world size)."""

    sizes: list[int]
    seed: int
    order: str
    m: int
    g: int
    drop_last: bool

    @property
    def n(self) -> int:
        return sum(self.sizes)


def fresh_state(c: Config) -> OrderState:
    return OrderState(
        dataset_id="ds-1",
        seed=c.seed,
        global_batch_size=c.g,
        order=c.order,
        window_pages=c.m,
        drop_last=c.drop_last,
    )


def run(c: Config, state: OrderState, world_size: int, n_steps: int, out_state: list | None = None):
    """Yield ``n_steps`` global batches as (epoch, step, ids, padding) tuples, each the rank slices of
    ``world_size`` ranks concatenated in rank order; append the state after each batch to ``out_state``."""
    views: dict[int, EpochOrder] = {}
    for _ in range(n_steps):
        epoch, step = resume_point(state, c.n)
        view = views.setdefault(epoch, EpochOrder(c.sizes, c.seed, epoch, c.order, c.m))
        ids, pad = [], []
        for r in range(world_size):
            start, stop = rank_span(step, r, world_size, c.g)
            ids.extend(view.ids(start, stop).tolist())
            pad.extend(rank_positions(step, r, world_size, c.g, c.n, c.drop_last)[1].tolist())
        yield epoch, step, tuple(ids), tuple(pad)
        state = state.replace(epoch=epoch, cursor=(step + 1) * c.g)
        if out_state is not None:
            out_state.append(state)


def save_and_load(state: OrderState, c: Config, world_size: int) -> OrderState:
    loaded = OrderState.from_dict(json.loads(json.dumps(state.to_dict())))
    check_compatible(loaded, fresh_state(c), world_size, c.n)
    return loaded


@SLOW_PROPS
@given(
    order_cases(layout=st.lists(st.integers(0, 6), min_size=1, max_size=12)),
    st.sampled_from([1, 2, 4, 6, 12]),
    st.booleans(),
    st.lists(st.integers(0, 40), min_size=1, max_size=4),
    st.data(),
)
def test_resume_chain_equals_control(case, g, drop_last, cuts, data):
    sizes, seed, _, order, m = case
    c = Config(with_one_batch(sizes, g), seed, order, m, g, drop_last)
    total = 3 * steps_per_epoch(c.n, g, drop_last)  # three epochs
    control = list(run(c, fresh_state(c), 1, total))
    assert [e for e, *_ in control] == sorted(e for e, *_ in control)
    assert {e for e, *_ in control} == {0, 1, 2}
    stream, state = [], fresh_state(c)
    for cut in sorted(min(x, total) for x in cuts) + [total]:
        w = data.draw(st.sampled_from(divisors(g)))
        states = []
        stream.extend(run(c, save_and_load(state, c, w), w, cut - len(stream), states))
        state = states[-1] if states else state
    assert stream == control


def test_save_at_epoch_end_rolls_to_next_epoch():
    c = Config([5, 0, 3, 4], 7, "quasi_random", 2, 4, False)  # N = 12, G = 4: L = 12, three steps
    states = []
    control = list(run(c, fresh_state(c), 2, 6))
    first_epoch = list(run(c, fresh_state(c), 2, 3, states))
    assert states[-1].epoch == 0 and states[-1].cursor == 12  # cursor == L
    assert resume_point(states[-1], c.n) == (1, 0)
    resumed = list(run(c, save_and_load(states[-1], c, 4), 4, 3))
    assert first_epoch + resumed == control
    assert resumed[0][:2] == (1, 0)
    assert control[0][2] != control[3][2]  # the second epoch has another order


def test_padding_flags_in_stream():
    c = Config([3, 2], 1, "random", 1, 4, False)  # N = 5, G = 4: L = 8, positions 5..7 are padding
    batches = list(run(c, fresh_state(c), 2, 2))
    assert batches[1][3] == (False, True, True, True)
    perm = epoch_permutation(c.sizes, 1, 0, "random")
    assert batches[1][2] == tuple(perm[[4, 0, 1, 2]].tolist())


# --- state ----------------------------------------------------------------------------------------------


def make_state(**kw) -> OrderState:
    base = dict(
        dataset_id="abc",
        seed=2**64 - 1,
        epoch=3,
        cursor=64,
        global_batch_size=32,
        order="quasi_random",
        window_pages=4,
        drop_last=True,
    )
    return OrderState(**(base | kw))


def test_state_round_trip_through_json():
    s = make_state()
    d = s.to_dict()
    assert list(d) == [
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
    ]
    assert OrderState.from_dict(json.loads(json.dumps(d))) == s


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"version": 2}, "version"),
        ({"order_algo": 2}, "order_algo"),
        ({"order_algo": True}, "order_algo"),
        ({"seed": "1"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"epoch": -1}, "epoch"),
        ({"cursor": 65}, "cursor"),
        ({"global_batch_size": 0}, "global_batch_size"),
        ({"order": "shuffled"}, "order"),
        ({"window_pages": 0}, "window_pages"),
        ({"drop_last": 1}, "drop_last"),
        ({"dataset_id": 5}, "dataset_id"),
        ({"extra": 1}, "extra"),
    ],
)
def test_state_from_dict_names_the_bad_field(change, field):
    d = make_state().to_dict() | change
    with pytest.raises(StateError, match=repr(field)) as info:
        OrderState.from_dict(d)
    assert info.value.field == field


def test_state_from_dict_missing_key():
    d = make_state().to_dict()
    del d["cursor"]
    with pytest.raises(StateError, match="'cursor'.*missing"):
        OrderState.from_dict(d)
    with pytest.raises(StateError, match="mapping"):
        OrderState.from_dict([1, 2])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"dataset_id": "other"}, "dataset_id"),
        ({"seed": 1}, "seed"),
        ({"order": "random"}, "order"),
        ({"window_pages": 8}, "window_pages"),
        ({"drop_last": False}, "drop_last"),
    ],
)
def test_check_compatible_names_the_differing_field(change, field):
    saved, current = make_state(), make_state(**change)
    with pytest.raises(StateMismatchError, match=f"{field}=") as info:
        check_compatible(saved, current, world_size=4)
    assert info.value.field == field


def test_check_compatible_rules():
    saved = make_state(order="random", window_pages=4)
    check_compatible(saved, make_state(order="random", window_pages=9, epoch=0, cursor=0), world_size=8)
    # another global batch is accepted (formats/order.md section 5.1); the loader's own G must divide by W
    check_compatible(saved, make_state(order="random", global_batch_size=20, cursor=0), world_size=5)
    with pytest.raises(StateError, match=r"global_batch=20 is not divisible by world_size=3"):
        check_compatible(saved, make_state(order="random", global_batch_size=20, cursor=0), world_size=3)
    with pytest.raises(StateError, match=r"global_batch=32 is not divisible by world_size=5"):
        check_compatible(saved, saved, world_size=5)
    check_compatible(saved, saved, world_size=1, n_records=64)  # cursor == L is fine
    with pytest.raises(StateError, match=r"cursor=64 is past the epoch length L=32"):
        check_compatible(saved, saved, world_size=1, n_records=40)


def test_normalize_cursor():
    assert normalize_cursor(2, 0, 96) == (2, 0)
    assert normalize_cursor(2, 64, 96) == (2, 64)
    assert normalize_cursor(2, 96, 96) == (3, 0)
    with pytest.raises(StateError, match="cursor=128"):
        normalize_cursor(2, 128, 96)
    assert resume_point(make_state(epoch=3, cursor=64), 64) == (4, 0)
    assert resume_point(make_state(epoch=3, cursor=64), 100) == (3, 2)


# --- the package rule: order/ imports nothing of pageset and never torch --------------------------------


def test_order_imports_only_numpy_numba_and_itself():
    allowed = {
        "__future__",
        "abc",
        "bisect",
        "collections",
        "dataclasses",
        "fractions",
        "functools",
        "hashlib",
        "json",
        "math",
        "numba",
        "numbers",
        "numpy",
        "operator",
        "os",
        "threading",
        "typing",
    }
    import pageset.order

    for path in Path(pageset.order.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def _message(fn):
    with pytest.raises(StateError) as info:
        fn()
    return info.value.field, str(info.value)


def test_state_errors_exact_field_and_message():
    """The exact field and text of each state error (mutation-testing survivors: a field name or message
    replaced by None or another string, ``and`` turned into ``or`` in the version checks)."""
    base = make_state().to_dict()
    cases = [
        (lambda: OrderState(**{**base, "version": 2}), "version",
         "unsupported value 2: this pageset reads version 1"),
        (lambda: OrderState(**{**base, "version": True}), "version",
         "unsupported value True: this pageset reads version 1"),
        (lambda: OrderState(**{**base, "order_algo": 7}), "order_algo",
         "unsupported value 7: this pageset implements order_algo 1; resume with the pageset version that wrote "
         "the state"),
        (lambda: OrderState(**{**base, "dataset_id": 5}), "dataset_id", "must be a str, got 5"),
        (lambda: OrderState(**{**base, "seed": "1"}), "seed", "must be an int, got str ('1')"),
        (lambda: OrderState(**{**base, "epoch": -1}), "epoch", "must be >= 0, got -1"),
        (lambda: OrderState(**{**base, "seed": 2**64}), "seed", f"must be < 2**64, got {2**64}"),
        (lambda: OrderState(**{**base, "order": "x"}), "order",
         "must be one of ('sequential', 'random', 'quasi_random'), got 'x'"),
        (lambda: OrderState(**{**base, "drop_last": 1}), "drop_last", "must be a bool, got 1"),
        (lambda: OrderState.from_dict([1]), "version", "a state must be a mapping, got list"),
        (lambda: OrderState.from_dict({**base, "version": 3}), "version",
         "unsupported value 3: this pageset reads version 1"),
        (lambda: OrderState.from_dict({**base, "order_algo": 3}), "order_algo",
         "unsupported value 3: this pageset reads order_algo 1"),
        (lambda: OrderState.from_dict({k: v for k, v in base.items() if k != "epoch"}), "epoch", "missing"),
        (lambda: OrderState.from_dict({k: v for k, v in base.items() if k != "version"}), "version", "missing"),
        (lambda: OrderState.from_dict({**base, "zz": 1, "aa": 2}), "aa",
         "unknown key(s) ['aa', 'zz'] for state version 1"),
        (lambda: normalize_cursor(0, 99, 96), "cursor", "cursor=99 is outside [0, L=96]"),
        (lambda: check_compatible(make_state(), make_state(), world_size=5), "global_batch_size", None),
        (lambda: check_compatible(make_state(), make_state(), world_size=1, n_records=40), "cursor", None),
    ]
    for fn, field, text in cases:
        got_field, got = _message(fn)
        assert got_field == field, (field, got)
        if text is not None:
            assert got == f"state field {field!r}: {text}", got
    with pytest.raises(StateMismatchError) as info:
        check_compatible(make_state(), make_state(seed=11), world_size=1)
    assert (info.value.saved, info.value.current) != (None, None)
    assert info.value.saved == make_state().seed and info.value.current == 11
    assert str(info.value).endswith(f"this loader has seed=11. {'Construct the loader with the saved seed'}"
                                    ", or start fresh instead of loading the state.")
    # quasi_random compares window_pages before global_batch_size (the first differing field is reported)
    saved = make_state(order="quasi_random", window_pages=2)
    with pytest.raises(StateMismatchError) as info:
        check_compatible(saved, make_state(order="quasi_random", window_pages=3, global_batch_size=16, cursor=0),
                         world_size=1)
    assert info.value.field == "window_pages"


def test_order_argument_errors_exact_text():
    """Exact messages of the order functions' argument errors (mutation-testing survivors: names and texts
    replaced by None or other strings)."""
    from pageset.order.shuffle import page_permutation

    cases = [
        (lambda: page_permutation(-1, 0, 0), ValueError, "n_pages must be >= 0, got -1"),
        (lambda: page_permutation(2.0, 0, 0), TypeError, "n_pages must be an integer, got float (2.0)"),
        (lambda: random_permutation(-2, 0, 0), ValueError, "n must be >= 0, got -2"),
        (lambda: random_permutation(True, 0, 0), TypeError, "n must be an integer, got a bool (True)"),
        (lambda: sequential_range("5", 0, 1), TypeError, "n_records must be an integer, got str ('5')"),
        (lambda: sequential_range(5, 0, 6), ValueError, "stop=6 is past the end of the epoch permutation (N=5)"),
        (lambda: epoch_permutation_py([1], 0, 0, "shuffled"), ValueError,
         "order must be one of ('sequential', 'random', 'quasi_random'), got 'shuffled'"),
        (lambda: EpochOrder([2, 3], 0, 0, "random").window_of(-1), ValueError, "position must be >= 0, got -1"),
        (lambda: EpochOrder([2, 3], 0, 0, "random").window_of("1"), TypeError,
         "position must be an integer, got str ('1')"),
        (lambda: EpochOrder([0, 0], 0, 0, "sequential").window_of(0), ValueError,
         "the dataset has no records: no position is valid"),
    ]
    for fn, error, text in cases:
        with pytest.raises(error) as info:
            fn()
        assert str(info.value) == text
    assert sequential_range(5, 1, 4).tolist() == [1, 2, 3] and sequential_range(5, 1, 4).dtype == np.int64
    assert epoch_permutation([3, 0], 1, 0, "sequential").dtype == np.int64


def test_resolve_rank_errors_name_the_source_exactly():
    """Each source is named in the error (mutation-testing survivors: source and argument names replaced)."""
    cases = [
        (lambda: resolve_rank(2, 2, environ={}), ValueError,
         "rank must be in [0, world_size=2), got rank=2 (from arguments)"),
        (lambda: resolve_rank(0, 0, environ={}), ValueError, "world_size must be >= 1, got 0 (from arguments)"),
        (lambda: resolve_rank(1.0, 2, environ={}), TypeError, "rank must be an integer, got float (1.0)"),
        (lambda: resolve_rank(0, "2", environ={}), TypeError, "world_size must be an integer, got str ('2')"),
        (lambda: resolve_rank(environ={}, probe=lambda: (5, 4)), ValueError,
         "rank must be in [0, world_size=4), got rank=5 (from probe (torch.distributed))"),
        (lambda: resolve_rank(environ={}, probe=lambda: (True, 4)), TypeError,
         "rank must be an integer, got a bool (True)"),
        (lambda: resolve_rank(environ={}, probe=lambda: (0, 2.5)), TypeError,
         "world_size must be an integer, got float (2.5)"),
        (lambda: resolve_rank(environ={"RANK": "1", "WORLD_SIZE": "0"}), ValueError,
         "world_size must be >= 1, got 0 (from environment RANK/WORLD_SIZE)"),
    ]
    for fn, error, text in cases:
        with pytest.raises(error) as info:
            fn()
        assert str(info.value) == text
    assert resolve_rank(environ={}, probe=lambda: (np.int64(1), np.int32(3))) == (1, 3)


def test_window_pages_defaults_to_one_page():
    """``window_pages`` defaults to 1 (page-local order) in the kernel and its twin (mutation survivors)."""
    sizes = [3, 4, 2, 5, 1, 3]
    one = epoch_permutation(sizes, 7, 1, "quasi_random", 1)
    assert epoch_permutation(sizes, 7, 1, "quasi_random").tolist() == one.tolist()
    assert epoch_permutation_py(sizes, 7, 1, "quasi_random") == one.tolist()
    assert epoch_permutation(sizes, 7, 1, "quasi_random", 2).tolist() != one.tolist()


def test_sharding_errors_exact_text():
    """Exact argument-error texts of the sharding functions (mutation survivors: names and texts replaced)."""
    cases = [
        (lambda: local_batch(0, 1), ValueError, "global_batch must be >= 1, got 0"),
        (lambda: local_batch("8", 1), TypeError, "global_batch must be an integer, got str ('8')"),
        (lambda: local_batch(8, 2.0), TypeError, "world_size must be an integer, got float (2.0)"),
        (lambda: local_batch(10, 4), ValueError,
         "global_batch=10 is not divisible by world_size=4 (remainder 2): every rank must take the same number of "
         "samples per step. Use a global batch that is a multiple of 4 (e.g. 8 or 12) or a world size that "
         "divides 10."),
        (lambda: epoch_length(1.5, 2, True), TypeError, "n_records must be an integer, got float (1.5)"),
        (lambda: epoch_length(4, None, True), TypeError, "global_batch must be an integer, got NoneType (None)"),
        (lambda: epoch_length(4, 2, 1), TypeError, "drop_last must be a bool, got int (1)"),
        (lambda: epoch_length(-1, 2, True), ValueError, "n_records must be >= 0, got -1"),
        (lambda: epoch_length(0, 2, False), ValueError,
         "the dataset has no records (N=0): an epoch needs at least one record"),
        (lambda: steps_per_epoch(4, "2", True), TypeError, "global_batch must be an integer, got str ('2')"),
        (lambda: rank_span(1.0, 0, 1, 2), TypeError, "step must be an integer, got float (1.0)"),
        (lambda: rank_span(0, "0", 1, 2), TypeError, "rank must be an integer, got str ('0')"),
        (lambda: rank_span(-1, 0, 1, 2), ValueError, "step must be >= 0, got -1"),
        (lambda: resolve_rank(environ={"WORLD_SIZE": "2"}), ValueError,
         "environment sets only one of RANK / WORLD_SIZE (RANK is missing): set both or neither"),
    ]
    for fn, error, text in cases:
        with pytest.raises(error) as info:
            fn()
        assert str(info.value) == text
    with pytest.raises(ValueError, match=r"give 2 steps \(0\.\.1\)"):
        rank_positions(2, 0, 1, 4, 10, True)
    assert rank_positions(1, 1, 2, 4, 10, True)[0].dtype == np.int64
    assert resolve_rank(environ={"RANK": "10", "WORLD_SIZE": "16"}) == (10, 16)  # decimal, base 10
