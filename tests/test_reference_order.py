"""Differential tests: pageset's order (the pure functions of ``pageset.order`` and the real Loader) against the
reference model ``tests/reference/order.py``, written from formats/order.md and formats/mixture.md alone.

Every comparison is position by position with the MODEL, never one run of pageset with another: ids, padding
flags, sources, the state dict, and the stream after ``load_state_dict`` on another world size and thread count
from the model's resume position. Files are real pageset files written here, with 4 KiB pages holding a varying
number of records, records larger than a page (empty pages), a short last page and a single-page file.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import order as model
from resume_contract import model_layout

from pageset import Bytes, Int, Loader, Mixture, TokenWindows, write_dataset, write_tokens
from pageset.order import (
    EpochOrder,
    StateMismatchError,
    epoch_length,
    epoch_permutation,
    key_py,
    quasi_random_range,
    rank_positions,
    sample_keys,
    window_pages_for,
)
from pageset.order.mixture import MixtureOrder, MixtureSchedule, mixture_id, quotas
from pageset.order.subset import SubsetLayout, subset_digest

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

layouts = st.lists(st.integers(0, 9), min_size=1, max_size=12).filter(lambda s: sum(s) > 0)
orders = st.sampled_from(["sequential", "random", "quasi_random"])
seeds = st.one_of(st.integers(0, 100), st.integers(2**64 - 3, 2**64 - 1))


# --- the pure functions -----------------------------------------------------------------------------------------

@FAST
@given(seeds, st.integers(0, 2**64 - 1), st.integers(0, 6), st.integers(0, 2**64 - 1))
def test_keys_equal_the_model(seed, epoch, tag, i):
    assert key_py(seed, epoch, tag, i) == model.key(seed, epoch, tag, i)
    positions = np.array([0, 1, i % 2**62], dtype=np.int64)
    assert sample_keys(seed, epoch % 2**63, positions).tolist() == [
        model.aug_key(seed, epoch % 2**63, int(p)) for p in positions]


@FAST
@given(layouts, seeds, st.integers(0, 5), orders, st.integers(1, 5))
def test_epoch_permutation_equals_the_model(sizes, seed, epoch, order, m):
    want = model.permutation(sizes, seed, epoch, order, m)
    assert epoch_permutation(sizes, seed, epoch, order, m).tolist() == want
    n = sum(sizes)
    lo = (seed * 7 + epoch) % n
    hi = min(n, lo + 1 + (seed % 5))
    if order == "quasi_random":
        assert quasi_random_range(sizes, seed, epoch, m, lo, hi).tolist() == want[lo:hi]
    # EpochOrder: any range, positions past N wrap (padding)
    assert EpochOrder(sizes, seed, epoch, order, m).ids(lo, lo + 2 * n).tolist() == [
        want[p % n] for p in range(lo, lo + 2 * n)]


@FAST
@given(st.integers(1, 60), st.sampled_from([1, 2, 3, 4, 6, 12]), st.booleans(), st.data())
def test_epoch_length_and_rank_positions_equal_the_model(n, g, drop_last, data):
    if drop_last and n < g:
        with pytest.raises(ValueError):
            epoch_length(n, g, drop_last)
        return
    length = model.epoch_length(n, g, drop_last)
    assert epoch_length(n, g, drop_last) == length
    w = data.draw(st.sampled_from([d for d in range(1, g + 1) if g % d == 0]))
    step, rank = data.draw(st.integers(0, length // g - 1)), data.draw(st.integers(0, w - 1))
    positions, padding = rank_positions(step, rank, w, g, n, drop_last)
    want = model.rank_positions(step, rank, w, g)
    assert positions.tolist() == want and padding.tolist() == [p >= n for p in want]


@FAST
@given(layouts, st.data(), seeds, orders, st.integers(1, 4))
def test_subset_order_equals_the_model(sizes, data, seed, order, m):
    n = sum(sizes)
    idx = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=30))  # any order, repeats
    layout = SubsetLayout(sizes, np.array(idx), order)
    ref = model.FileOrder(sizes, seed, order, m, False, 1, subset=idx)
    for epoch in (0, 3):
        got = layout.epoch_order(seed, epoch, order, m).ids(0, 2 * len(idx)).tolist()
        assert got == [ref.record(epoch, p)[0] for p in range(2 * len(idx))]
    assert layout.digest == subset_digest(np.array(idx)) == model.subset_digest(idx)
    if len(set(idx)) > 1:  # the same ids in another order are another subset (never a digest of sorted ids)
        other = idx[1:] + idx[:1] if idx[1:] + idx[:1] != idx else idx[::-1]
        if other != idx:
            assert subset_digest(np.array(other)) == model.subset_digest(other) != model.subset_digest(idx)


@FAST
@given(st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(any))
def test_schedule_equals_the_model(q):
    assert MixtureSchedule(q).slots.tolist() == model.schedule(q)


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1 / 3, 1 / 3, 1 / 3], [0.999, 0.001], [2.0, 1.0],
                                     [7, 0, 3], [0.123456, 0.654321], [1e-3, 1.0, 0.0], [3, 1e-7 + 1]])
def test_quotas_equal_the_model(weights):
    assert list(quotas(weights)) == model.quotas(weights)


@FAST
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=4).filter(any), min_size=1, max_size=4),
       st.data(), seeds, orders, st.integers(1, 3))
def test_mixture_lookup_and_cursors_equal_the_model(pages, data, seed, order, m):
    q = data.draw(st.lists(st.integers(0, 5), min_size=len(pages), max_size=len(pages)).filter(any))
    ref = model.MixtureModel(q, pages, seed, order, m, False, 1)
    got = MixtureOrder(MixtureSchedule(q), pages, seed, order, m)
    start = data.draw(st.integers(0, 200))
    src, ids = got.lookup(start, start + 40)
    assert list(zip(src.tolist(), ids.tolist())) == [ref.sample(g) for g in range(start, start + 40)]
    assert [tuple(c) for c in got.cursors(start)] == ref.cursors(start)
    sids = [f"{k:064x}" for k in range(len(pages))]
    assert mixture_id(sids, tuple(ref.q), 17) == model.MixtureModel(q, pages, seed, order, m, False, 1, 17) \
        .dataset_id(sids)


# --- files ----------------------------------------------------------------------------------------------------

def _write_records(path, sizes):
    """Records with label = record id and a payload of the given byte sizes, on 4 KiB pages."""
    records = [(i, bytes([i % 251]) * s) for i, s in enumerate(sizes)]
    write_dataset(path, records, {"label": Int(), "payload": Bytes()}, num_workers=0, page_size=4096,
                  progress=False)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("refo")
    rng = random.Random(5)
    # 150 records: mostly 1-900 bytes (1-30 per page), three larger than a page (5-9 KiB: they own whole pages,
    # leaving empty pages), a short last page
    sizes = [rng.choice([rng.randint(1, 60), rng.randint(100, 900)]) for _ in range(150)]
    for j in (20, 21, 90):
        sizes[j] = rng.randint(5000, 9000)
    out = {"varied": _write_records(d / "varied.pageset", sizes),
           "single": _write_records(d / "single.pageset", [10, 3, 40, 1, 7, 22, 5]),
           "tiny": _write_records(d / "tiny.pageset", [30, 1, 2000, 9, 4]),
           "zero": _write_records(d / "zero.pageset", [5] * 12)}
    docs = [[rng.randrange(1000) for _ in range(rng.randint(1, 120))] for _ in range(150)]
    write_tokens(d / "tokens.pageset", docs, eos_id=1000, num_workers=0, page_size=4096, progress=False)
    out["tokens"] = d / "tokens.pageset"
    return out


_layout = model_layout  # (page_sizes, dataset_id) of a written file, via the model


def test_layouts_cover_the_edge_cases(files):
    sizes, _ = _layout(files["varied"])
    assert 0 in sizes and max(sizes) > 8 and sum(sizes) == 150  # empty pages, many records on one page
    assert _layout(files["single"])[0] == [7]


# --- the Loader -----------------------------------------------------------------------------------------------

def _loaders(path, w, g, threads=1, **kw):
    return [Loader(path, batch_size=g // w, rank=r, world_size=w, num_threads=threads, **kw) for r in range(w)]


def _steps(loaders, iters, steps, mixture=False):
    """``steps`` global steps: each rank's batch concatenated in rank order, [(source or 0, id, padding)]."""
    out = []
    for _ in range(steps):
        for k, ld in enumerate(loaders):
            try:
                b = next(iters[k])
            except StopIteration:  # the epoch ended: the loader's next iter() is the next epoch
                iters[k] = iter(ld)
                b = next(iters[k])
            src = b["_source"].tolist() if mixture else [0] * len(b["_index"])
            if "label" in b:  # every record file here has label = record id: the data is the record's own
                assert np.asarray(b["label"]).tolist() == b["_index"].tolist()
            out += list(zip(src, b["_index"].tolist(), b["_is_padding"].tolist()))
    return out


def _expected_state(ref_steps, c, g):
    """(epoch, cursor) after c global steps (formats/order.md section 8: an epoch end is (e, L))."""
    if c and c % ref_steps == 0:
        return c // ref_steps - 1, ref_steps * g
    return c // ref_steps, (c % ref_steps) * g


def _check_loader(path, ref, state_of, w_list, g, epochs, cuts, mixture=False, **kw):
    """Every W of ``w_list``: the global stream of ``epochs`` epochs equals the model's; at each cut the state
    equals the model's, and a loader on the next W (another thread count) resumes with the MODEL's stream."""
    total = ref.steps * epochs

    def want(epoch, step, n_steps):
        """The model's global batches (positions s*G .. s*G + G - 1) of n_steps steps from (epoch, step)."""
        out = []
        for _ in range(n_steps):
            if step == ref.steps:
                epoch, step = epoch + 1, 0
            if mixture:
                s, i = ref.batch(epoch, step, 0, 1)
                out += list(zip(s, i, [False] * len(i)))
            else:
                i, p = ref.batch(epoch, step, 0, 1)
                out += list(zip([0] * len(i), i, p))
            step += 1
        return out

    for k, w in enumerate(w_list):
        loaders = _loaders(path, w, g, threads=1 + k % 2, **kw)
        iters = [iter(ld) for ld in loaders]
        try:
            assert all(len(ld) == ref.steps for ld in loaders)
            done = 0
            for c in sorted(set(cuts)) + [total]:
                c = min(c, total)
                got = _steps(loaders, iters, c - done, mixture)
                assert got == want(*divmod(done, ref.steps), c - done), (w, done, c)
                done = c
                if c == total:
                    break
                state = json.loads(json.dumps(loaders[0].state_dict()))
                assert all(ld.state_dict() == state for ld in loaders)
                epoch, cursor = _expected_state(ref.steps, c, g)
                assert state == state_of(epoch, cursor)
                w2 = w_list[(k + 1) % len(w_list)]
                resumed = _loaders(path, w2, g, threads=2 - k % 2, **kw)
                try:
                    for ld in resumed:
                        ld.load_state_dict(state)
                    e, s = model.resume_position(state, ref.length)
                    rest = min(total - c, ref.steps + 1)
                    got = _steps(resumed, [iter(ld) for ld in resumed], rest, mixture)
                    assert got == want(e, s, rest), (w, w2, c)
                finally:
                    for ld in resumed:
                        ld.close()
        finally:
            for ld in loaders:
                ld.close()


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("order", ["sequential", "random", "quasi_random"])
@pytest.mark.parametrize(("name", "g", "w_list"), [("varied", 8, [1, 2, 4]), ("single", 4, [2, 1, 4])])
def test_loader_streams_and_resume_equal_the_model(files, name, g, w_list, order, drop_last):
    sizes, dataset_id = _layout(files[name])
    seed, m = 11, 2
    ref = model.FileOrder(sizes, seed, order, m, drop_last, g)
    kw = dict(order=order, seed=seed, window_pages=m, drop_last=drop_last, pipelines={"payload": None})
    rng = random.Random(f"{name}{order}{drop_last}")
    cuts = [rng.randrange(1, 2 * ref.steps), ref.steps]  # a random step and exactly an epoch end

    def state_of(epoch, cursor):
        return model.state_dict(dataset_id, seed, epoch, cursor, g, order, m, drop_last)

    _check_loader(files[name], ref, state_of, w_list, g, 2, cuts, **kw)


@pytest.mark.parametrize("order", ["random", "quasi_random", "sequential"])
def test_subset_streams_resume_and_reordered_ids_equal_the_model(files, order):
    sizes, dataset_id = _layout(files["varied"])
    rng = random.Random(order)
    idx = rng.sample(range(150), 50) + [7, 7, 20]  # unsorted, repeats, a record that owns whole pages
    seed, m, g = 3, 2, 8
    ref = model.FileOrder(sizes, seed, order, m, False, g, subset=idx)
    kw = dict(order=order, seed=seed, window_pages=m, drop_last=False, pipelines={"payload": None}, indices=idx)

    def state_of(epoch, cursor):
        return model.state_dict(dataset_id, seed, epoch, cursor, g, order, m, False, subset=idx)

    _check_loader(files["varied"], ref, state_of, [1, 2, 4], g, 2, [rng.randrange(1, 2 * ref.steps)], **kw)
    # a state from this subset is refused by the same ids in another order (and by the whole file)
    with Loader(files["varied"], batch_size=g, num_threads=1, **kw) as ld:
        next(iter(ld))
        state = ld.state_dict()
    reordered = idx[::-1]
    assert sorted(reordered) == sorted(idx) and model.refused_field(state, model.state_dict(
        dataset_id, seed, 0, 0, g, order, m, False, subset=reordered), 1) == "subset"
    for other in (dict(kw, indices=reordered), dict(kw, indices=None)):
        with Loader(files["varied"], batch_size=g, num_threads=1, **other) as ld:
            with pytest.raises(StateMismatchError, match="subset"):
                ld.load_state_dict(state)


@pytest.mark.parametrize("order", ["random", "quasi_random"])
def test_token_windows_as_records_equal_the_model(files, order):
    seq_len, g, seed, m = 32, 6, 9, 3
    sizes, dataset_id = _layout(files["tokens"], seq_len)
    assert len(sizes) > 3
    ref = model.FileOrder(sizes, seed, order, m, False, g)
    kw = dict(order=order, seed=seed, window_pages=m, drop_last=False, pipelines={"tokens": [TokenWindows(seq_len)]})

    def state_of(epoch, cursor):
        return model.state_dict(dataset_id, seed, epoch, cursor, g, order, m, False, seq_len=seq_len)

    rng = random.Random(order)
    _check_loader(files["tokens"], ref, state_of, [1, 3, 2], g, 2, [rng.randrange(1, 2 * ref.steps)], **kw)


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("order", ["random", "quasi_random", "sequential"])
def test_mixture_streams_and_resume_equal_the_model(files, order, drop_last):
    """Tiny sources that wrap many times per mixture epoch, a zero-weight source, samples_per_epoch not a
    multiple of G: sources, ids, the state (per-source cursors) and resume equal the model's."""
    names = ["varied", "tiny", "zero", "single"]
    weights, spe, g, seed, m = [0.5, 0.3, 0.0, 0.2], 45, 8, 21, 2
    layouts = [_layout(files[n]) for n in names]
    ref = model.MixtureModel(weights, [s for s, _ in layouts], seed, order, m, drop_last, g, spe)
    ids = [i for _, i in layouts]
    mix = Mixture([files[n] for n in names], weights, samples_per_epoch=spe)
    kw = dict(order=order, seed=seed, window_pages=m, drop_last=drop_last, pipelines={"payload": None})

    def state_of(epoch, cursor):
        return ref.state_dict(ids, epoch, cursor)

    rng = random.Random(f"{order}{drop_last}")
    _check_loader(mix, ref, state_of, [1, 2, 4], g, 3, [rng.randrange(1, 3 * ref.steps), ref.steps], mixture=True,
                  **kw)


# --- windows sized in records (formats/order.md section 4.1): the Loader's default ---------------------------

@FAST
@given(layouts, st.one_of(st.none(), st.integers(1, 6)), st.integers(1, 60))
def test_window_size_equals_the_model(sizes, window_pages, window_records):
    assert window_pages_for(sizes, window_pages, window_records) == model.window_pages_for(
        sizes, window_pages, window_records)


@pytest.mark.parametrize(("kind", "window_records"), [("file", 40), ("subset", 9), ("tokens", 70), ("mixture", 11)])
def test_windows_sized_in_records_stream_state_and_resume_equal_the_model(files, kind, window_records):
    """window_pages left out (the default): every layout gets the M of section 4.1 for ``window_records``, a
    mixture each source its own; streams, the state (window_pages 0 and window_records) and resume on other
    world sizes equal the model's."""
    seed, g, drop_last = 13, 4, kind != "subset"
    kw = dict(order="quasi_random", seed=seed, drop_last=drop_last, window_records=window_records)
    if kind == "mixture":
        names, weights = ["tiny", "varied", "single"], [0.2, 0.5, 0.3]
        layouts = [_layout(files[n]) for n in names]
        ref = model.MixtureModel(weights, [s for s, _ in layouts], seed, "quasi_random", None, drop_last, g,
                                 window_records=window_records)
        assert ref.m[0] != ref.m[1] < len(ref.sizes[1])  # the sources' windows differ; varied's is not the file
        _check_loader(Mixture([files[n] for n in names], weights), ref,
                      lambda e, c: ref.state_dict([i for _, i in layouts], e, c), [1, 2, 4], g, 2,
                      [3, ref.steps], mixture=True, pipelines={"payload": None}, **kw)
        return
    seq_len = 32 if kind == "tokens" else None
    sizes, dataset_id = _layout(files["tokens" if seq_len else "varied"], seq_len)
    idx = random.Random(4).sample(range(150), 60) + [20, 20] if kind == "subset" else None
    ref = model.FileOrder(sizes, seed, "quasi_random", None, drop_last, g, subset=idx, window_records=window_records)
    assert 1 < ref.m < len(ref.vsizes), (ref.m, len(ref.vsizes))  # a window of several pages, not the whole file
    pipelines = {"tokens": [TokenWindows(seq_len)]} if seq_len else {"payload": None}

    def state_of(epoch, cursor):
        st_ = model.state_dict(dataset_id, seed, epoch, cursor, g, "quasi_random", None, drop_last, subset=idx,
                               seq_len=seq_len or 0, window_records=window_records)
        assert st_["window_pages"] == 0 and st_["window_records"] == window_records
        return st_

    _check_loader(files["tokens" if seq_len else "varied"], ref, state_of, [1, 2, 4], g, 2, [5, ref.steps],
                  pipelines=pipelines, indices=idx, **kw)


def test_a_state_of_another_window_is_refused(files):
    """window_pages / window_records name themselves: a window given in pages against one sized in records (the
    state of a pageset whose default was window_pages=8), and another window_records."""
    sizes, dataset_id = _layout(files["varied"])
    saved = model.state_dict(dataset_id, 1, 0, 0, 4, "quasi_random", 8, True)
    for other, field in ((dict(), "window_pages"), (dict(window_records=9), "window_pages")):
        with Loader(files["varied"], batch_size=4, order="quasi_random", seed=1, num_threads=1,
                    pipelines={"payload": None}, **other) as ld:
            assert model.refused_field(saved, ld.state_dict(), 1) == field
            with pytest.raises(StateMismatchError, match=r"window_pages=8.*window_pages=None"):
                ld.load_state_dict(saved)
    by_records = model.state_dict(dataset_id, 1, 0, 0, 4, "quasi_random", None, True, window_records=30)
    with Loader(files["varied"], batch_size=4, order="quasi_random", seed=1, num_threads=1, window_records=31,
                pipelines={"payload": None}) as ld:
        assert model.refused_field(by_records, ld.state_dict(), 1) == "window_records"
        with pytest.raises(StateMismatchError, match="window_records"):
            ld.load_state_dict(by_records)
    with Loader(files["varied"], batch_size=4, order="quasi_random", seed=1, num_threads=1, window_pages=8,
                pipelines={"payload": None}) as ld:
        ld.load_state_dict(saved)  # the old default, given: accepted


# --- more cases (CI) -------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("case", range(12))
def test_more_loader_configurations_equal_the_model(files, case):
    """Other seeds, window_pages (1, 3, 8: page-local to one window), global batches and world sizes, 3 epochs, a
    subset on some cases; the same checks as the default-run cases."""
    rng = random.Random(1000 + case)
    order = ["sequential", "random", "quasi_random"][case % 3]
    drop_last = bool(case // 3 % 2)
    g = rng.choice([6, 12])
    w_list = [w for w in (1, 2, 3, 4, 6) if g % w == 0]
    rng.shuffle(w_list)
    seed, m = rng.randrange(2**64), rng.choice([1, 3, 8])
    sizes, dataset_id = _layout(files["varied"])
    idx = rng.choices(range(150), k=rng.randint(g, 90)) if case >= 6 else None
    ref = model.FileOrder(sizes, seed, order, m, drop_last, g, subset=idx)
    kw = dict(order=order, seed=seed, window_pages=m, drop_last=drop_last, pipelines={"payload": None}, indices=idx)

    def state_of(epoch, cursor):
        return model.state_dict(dataset_id, seed, epoch, cursor, g, order, m, drop_last, subset=idx)

    cuts = [rng.randrange(1, 3 * ref.steps) for _ in range(2)] + [2 * ref.steps]
    _check_loader(files["varied"], ref, state_of, w_list, g, 3, cuts, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(6))
def test_more_mixtures_equal_the_model(files, case):
    rng = random.Random(2000 + case)
    names = ["varied", "tiny", "zero", "single"]
    weights = [rng.choice([0, 0.1, 0.25, 1, 3]) for _ in names]
    weights[case % 4] = 1.0  # never all zero
    order = ["sequential", "random", "quasi_random"][case % 3]
    drop_last, g, seed, m = bool(case % 2), rng.choice([4, 8]), rng.randrange(2**64), rng.choice([1, 2, 5])
    spe = rng.choice([None, 37, 64])
    layouts = [_layout(files[n]) for n in names]
    ref = model.MixtureModel(weights, [s for s, _ in layouts], seed, order, m, drop_last, g, spe)
    mix = Mixture([files[n] for n in names], weights, samples_per_epoch=spe)
    kw = dict(order=order, seed=seed, window_pages=m, drop_last=drop_last, pipelines={"payload": None})
    cuts = [rng.randrange(1, 3 * ref.steps) for _ in range(2)]
    _check_loader(mix, ref, lambda e, c: ref.state_dict([i for _, i in layouts], e, c), [1, 2, 4], g, 3, cuts,
                  mixture=True, **kw)
