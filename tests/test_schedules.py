"""Mixture weight schedules (formats/mixture.md section 3): step stages, linear ramps, weights edited on resume.

Every stream is compared position by position with the reference model (tests/reference/order.py, written from
the document), plus hand-derived per-stage counts and golden vectors: the all-gathered stream of 1, 2 and 4 ranks,
resumes in every stage and across every stage boundary on another world size and global batch, edited schedules
and edited constant weights at resume (and a later resume of the edited run), token weights per stage, a
many-file set as a source, process mode.
"""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
from reference import order as model
from resume_contract import model_layout

from pageset import Bytes, Int, Loader, Mixture, Schedule, TokenWindows, write_dataset, write_tokens
from pageset.order import StateError, StateMismatchError
from pageset.order.quotas import quotas
from pageset.order.schedule import StreamSchedule, apportion

SIZES = [300, 10, 120]  # source 1 is tiny: it runs through many epochs of its own
STAGES = [(0, [0.7, 0.2, 0.1]), (96, [0.2, 0.3, 0.5]), (200, [0.0, 0.1, 0.9])]
INTERP = ["step", "linear"]  # warm-up (step), a ramp from the main mix to the anneal, then the anneal
BLOCK = 10
SPE = 104  # a mixture epoch: 104 positions, so epochs and stages cross each other


def _schedule():
    return Schedule(STAGES, INTERP, block=BLOCK)


def _model_schedule(stages=STAGES, interp=INTERP, block=BLOCK, until=2000):
    return model.ScheduleModel([s for s, _ in stages], [model.quotas(w) for _, w in stages], interp, block, until)


def _write(path, n, source):
    """n records: label = record id + 1000 * source, a payload of 1..80 bytes (pages of varying record counts)."""
    write_dataset(path, [(i + 1000 * source, bytes([source]) * (i % 80 + 1)) for i in range(n)],
                  {"label": Int(), "payload": Bytes()}, num_workers=0, page_size=4096, progress=False)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("sched")
    return [_write(d / f"{c}.pageset", n, k) for k, (c, n) in enumerate(zip("abc", SIZES))]


@pytest.fixture(scope="module")
def layouts(files):
    return [model_layout(p) for p in files]


def _mix_model(layouts, sched, order, G, seed=5, drop_last=True, m=2):
    return model.ScheduledMixtureModel(sched, [s for s, _ in layouts], seed, order, m, drop_last, G,
                                       samples_per_epoch=SPE)


def _loader(mix, rank, world, batch, order="quasi_random", seed=5, **kw):
    return Loader(mix, batch_size=batch, rank=rank, world_size=world, order=order, seed=seed, window_pages=2,
                  num_threads=kw.pop("num_threads", 1), array_type="numpy", **kw)


def _gather(loaders, steps=None):
    """[(source, id)] of the next ``steps`` global steps (across epoch ends), or of the rest of the current epoch
    (None), ranks in order (so in global position order), checking every sample's own data."""
    out = []
    its = [iter(ld) for ld in loaders]
    n = 0
    while steps is None or n < steps:
        try:
            batches = [next(it) for it in its]
        except StopIteration:
            if steps is None:
                break
            its = [iter(ld) for ld in loaders]
            continue
        for b in batches:
            assert (np.asarray(b["label"]) == b["_index"] + 1000 * b["_source"]).all()
            out += list(zip(b["_source"].tolist(), b["_index"].tolist()))
        n += 1
    return out


# --- the schedule: pure functions against the model ------------------------------------------------------------


def test_stream_schedule_equals_the_model_on_random_schedules():
    """Random stages (2-4 sources, zero quotas included), step and linear gaps, blocks of 1 to 17 and the default:
    every position's source and per-source sample number, and counts at arbitrary positions, are the model's."""
    rng = np.random.default_rng(31)
    for trial in range(40):
        s = int(rng.integers(2, 5))
        n_stages = int(rng.integers(2, 5))
        starts = [0] + sorted(int(x) for x in rng.choice(np.arange(1, 400), n_stages - 1, replace=False))
        qs = []
        for _ in range(n_stages):
            q = [int(x) for x in rng.integers(0, 8, size=s)]
            q[int(rng.integers(0, s))] += 1  # at least one positive
            qs.append(tuple(quotas(q)))
        interp = [str(rng.choice(["step", "linear"])) for _ in range(n_stages - 1)]
        block = [None, 1, 3, 17][trial % 4]
        got = StreamSchedule(starts, qs, interp, block)
        want = model.ScheduleModel(starts, qs, interp, block, until=600)
        src, k = got.lookup(0, 600)
        ref = [want.source(g) for g in range(600)]
        assert src.tolist() == [r[0] for r in ref] and k.tolist() == [r[1] for r in ref], (trial, starts, qs, interp)
        for g in (0, 1, starts[-1], 599):
            assert got.counts(g).tolist() == want.counts(g), (trial, g)


def test_golden_vectors_of_formats_mixture_md():
    """formats/mixture.md section 3.5: hand-checked pieces, sources and stage counts."""
    assert apportion(3, [5, 3, 2]) == [1, 1, 1] and apportion(6, [7, 2, 1]) == [4, 1, 1]
    # a step stage of 23 positions at quotas (5, 3, 2): two periods, then a tail of 3 at apportion(3) = (1, 1, 1)
    sched = StreamSchedule([0, 23], [(5, 3, 2), (0, 0, 1)], ["step"])
    assert [(p.start, p.stop, p.quotas) for p, _, _ in sched.pieces_in(0, 30)] == \
        [(0, 20, (5, 3, 2)), (20, 23, (1, 1, 1)), (23, None, (0, 0, 1))]
    assert sched.lookup(18, 25)[0].tolist() == [1, 0, 0, 1, 2, 2, 2]
    assert sched.counts(23).tolist() == [11, 7, 5]
    # a ramp from (1, 0) to (0, 1) over 10 positions in blocks of 4: source 1 is owed T(y) = y^2 / 20, i.e. 0.8,
    # 3.2, 5 at y = 4, 8, 10, source 0 the rest: blocks (3.2, 0.8) -> (3, 1); (4.8 - 3, 3.2 - 1) = (1.8, 2.2) ->
    # (2, 2); (5 - 5, 5 - 3) -> (0, 2)
    ramp = StreamSchedule([0, 10], [(1, 0), (0, 1)], ["linear"], 4)
    assert [(p.start, p.stop, p.quotas) for p, _, _ in ramp.pieces_in(0, 12)] == \
        [(0, 4, (3, 1)), (4, 8, (1, 1)), (8, 10, (0, 1)), (10, None, (0, 1))]
    assert ramp.lookup(0, 12)[0].tolist() == [0, 0, 1, 0, 0, 1, 0, 1, 1, 1, 1, 1]
    # the schedule id (section 3.4) of the schedule the loader tests use: the text's, the model's and ours
    ours = StreamSchedule([0, 96, 200], [quotas(w) for _, w in STAGES], INTERP, BLOCK).schedule_id()
    assert ours == _model_schedule().schedule_id() == "schedule:f9a8973e3487c2b366a3020941e9c58b"
    # the default block: max(ceil(L / 100), 4096): ramps of 800,000, 50,000 and 1,000 positions from (1, 1) to
    # (1, 3) are cut into 100 blocks of 8,000, 13 of 4,096 (the last shorter) and one
    for length, blocks in ((800_000, 100), (50_000, 13), (1000, 1)):
        assert len(StreamSchedule([0, length], [(1, 1), (1, 3)], ["linear"]).pieces_in(0, length)) == blocks


def test_per_stage_counts_equal_the_quotas_exactly(files):
    """The stream of the Loader, counted per stage: the warm-up's 96 positions at quotas (7, 2, 1) are 9 periods
    and a tail of 6 = apportion(6, (7, 2, 1)) = (4, 1, 1), so (67, 19, 10); the anneal's first 100 positions at
    quotas (0, 1, 9) are 10 periods: (0, 10, 90) (hand-derived). The ramp's 104 positions from shares (.2, .3, .5)
    to (0, .1, .9) owe 104 * (.1, .2, .7) = (10.4, 20.8, 72.8): its counts are within 1 of that and are the model's
    (11, 21, 72): source 0 was 0.6 ahead at position 100 and owed less than that by the end, so it got none of the
    last block)."""
    mix = Mixture(files, _schedule(), samples_per_epoch=SPE)
    with _loader(mix, 0, 1, 4) as ld:
        stream = _gather([ld]) + _gather([ld]) + _gather([ld])
    src = np.array([s for s, _ in stream])
    assert len(src) == 312
    counts = [np.bincount(src[a:b], minlength=3).tolist() for a, b in [(0, 96), (96, 200), (200, 300)]]
    assert counts == [[67, 19, 10], [11, 21, 72], [0, 10, 90]]
    assert all(abs(c - t) < 1 for c, t in zip(counts[1], [10.4, 20.8, 72.8]))
    ref = _model_schedule()
    assert [[b - a for a, b in zip(ref.counts(lo), ref.counts(hi))] for lo, hi in [(0, 96), (96, 200), (200, 300)]] \
        == counts


def test_ramp_tracks_the_integral_of_its_shares():
    """At every block end of a ramp each source's count is within 1 sample of the integral of its interpolated
    share, for blocks of 1 sample to the whole ramp (the carried remainders keep the rounding from adding up); at
    every position, with blocks of at most 7 samples, within 2 (inside a block the share is the block's own)."""
    rng = np.random.default_rng(5)
    for trial in range(30):
        s = int(rng.integers(2, 5))
        q1 = quotas([int(x) + (i == 0) for i, x in enumerate(rng.integers(0, 20, size=s))])
        q2 = quotas([int(x) + (i == s - 1) for i, x in enumerate(rng.integers(0, 20, size=s))])
        length = int(rng.integers(50, 400))
        block = int(rng.choice([1, 2, 7, 33, length]))
        ramp = StreamSchedule([0, length], [q1, q2], ["linear"], block)
        p1 = [Fraction(x, sum(q1)) for x in q1]
        p2 = [Fraction(x, sum(q2)) for x in q2]
        src, _ = ramp.lookup(0, length)
        c = np.zeros(s, dtype=np.int64)
        for y in range(length + 1):
            for i in range(s):
                target = p1[i] * y + (p2[i] - p1[i]) * Fraction(y * y, 2 * length)
                if y % block == 0 or y == length:
                    assert abs(c[i] - target) < 1, (trial, y, i)
                if block <= 7:
                    assert abs(c[i] - target) < 2, (trial, y, i)
            if y < length:
                c[src[y]] += 1


# --- the loader against the model --------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["quasi_random", "random"])
def test_all_gathered_stream_of_1_2_4_ranks_is_the_models(files, layouts, order):
    """Three mixture epochs (312 positions: the warm-up, the ramp, the anneal) on 1, 2 and 4 ranks: every global
    step's (_source, _index), gathered over the ranks, is the model's; each source's samples, in stream order, are
    whole permutations of its records per epoch of its own (none repeated before its permutation is through)."""
    mix = Mixture(files, _schedule(), samples_per_epoch=SPE)
    G = 8
    ref = _mix_model(layouts, _model_schedule(), order, G)
    want = [ref.sample(g) for g in range(3 * ref.length)]
    for world in (1, 2, 4):
        loaders = [_loader(mix, r, world, G // world, order) for r in range(world)]
        try:
            got = _gather(loaders) + _gather(loaders) + _gather(loaders)
        finally:
            for ld in loaders:
                ld.close()
        assert got == want, world
    for i, n in enumerate(SIZES):
        ids = [x for s, x in want if s == i]
        for e in range(len(ids) // n):
            assert sorted(ids[e * n : (e + 1) * n]) == list(range(n)), (i, e)


# positions of the cuts (global batch 8): inside the warm-up, just before and at the first boundary, inside the
# ramp, at the ramp's end, inside the anneal, and at an epoch end (104) that is inside the ramp
CUT_STEPS = [3, 11, 12, 13, 18, 25, 33]


@pytest.mark.parametrize("new_world,new_batch", [(2, 6), (4, 3), (3, 5)])
def test_resume_in_every_stage_and_across_boundaries_on_another_world_size_and_batch(files, layouts, new_world,
                                                                                      new_batch):
    """Cut a 1-rank run (global batch 8) at each of CUT_STEPS; resume on ``new_world`` ranks of ``new_batch``
    (another global batch): the samples continue at the next global position, consecutive, for 2 more epochs'
    worth, as the model's (uninterrupted) stream says; the saved state is the model's."""
    mix = Mixture(files, _schedule(), samples_per_epoch=SPE)
    ref = _mix_model(layouts, _model_schedule(), "quasi_random", 8)
    ids = [d for _, d in layouts]
    with _loader(mix, 0, 1, 8) as ld:
        states, it = {}, iter(ld)
        for step in range(max(CUT_STEPS) + 1):
            if step and step % ld.steps_per_epoch == 0:
                it = iter(ld)
            next(it)
            if step + 1 in CUT_STEPS:
                states[step + 1] = json.loads(json.dumps(ld.state_dict()))
    for cut, state in states.items():
        g = cut * 8
        epoch, cursor = divmod(g - 1, ref.length)  # an epoch's last step: the state is (epoch, L) until iter()
        cursor += 1
        assert state == ref.state_dict(ids, epoch, cursor), cut
        loaders = [_loader(mix, r, new_world, new_batch) for r in range(new_world)]
        try:
            for ld in loaders:
                ld.load_state_dict(state)
            got = _gather(loaders) + _gather(loaders) + _gather(loaders)
        finally:
            for ld in loaders:
                ld.close()
        assert got == [ref.sample(x) for x in range(g, g + len(got))], (cut, new_world, new_batch)
        assert len(got) >= 2 * new_world * new_batch


# --- edited weights at resume --------------------------------------------------------------------------------

EDITED = [(0, [1, 1, 1]), (150, [0, 1, 1]), (260, [3, 1, 0])]


@pytest.mark.parametrize("edit", ["schedule", "constant", "from_constant"])
def test_edited_weights_at_resume_continue_as_the_model_says(files, layouts, edit):
    """A run saved at position 120 (inside the ramp) resumes into a loader with another schedule (or constant
    weights; or a constant-weight run into a schedule): from 120 on the stream is the new schedule's, each source
    continuing from its saved count (model: ScheduleModel.edit), nothing before the cursor re-read and no sample
    of a source repeated within its epoch; the state records the edit, and a later resume of the edited run (on 2
    ranks, global batch 6) continues it exactly."""
    ids = [d for _, d in layouts]
    if edit == "from_constant":
        old_mix = Mixture(files, [0.5, 0.3, 0.2], samples_per_epoch=SPE)
        old = model.ScheduleModel([0], [model.quotas([0.5, 0.3, 0.2])], [], None)
    else:
        old_mix, old = Mixture(files, _schedule(), samples_per_epoch=SPE), _model_schedule()
    if edit == "constant":
        new_mix = Mixture(files, [0.1, 0.1, 0.8], samples_per_epoch=SPE)
        new = model.ScheduleModel([0], [model.quotas([0.1, 0.1, 0.8])], [], None)
    else:
        new_mix = Mixture(files, Schedule(EDITED, "step"), samples_per_epoch=SPE)
        new = model.ScheduleModel([0, 150, 260], [model.quotas(w) for _, w in EDITED], ["step", "step"], None)
    with _loader(old_mix, 0, 1, 8) as ld:
        before = _gather([ld], 15)
        state = json.loads(json.dumps(ld.state_dict()))
    ref_old = _mix_model(layouts, old, "quasi_random", 8)
    assert before == [ref_old.sample(g) for g in range(120)]
    new.edit(120, old.counts(120))
    ref = _mix_model(layouts, new, "quasi_random", 8)
    ref.edits = [120]
    with _loader(new_mix, 0, 1, 8) as ld:
        ld.load_state_dict(state)
        assert ld.state_dict() == ref.state_dict(ids, 1, 16)
        after = _gather([ld], 8)  # to position 184: the rest of epoch 1 (ends at 208) is left for the next run
        state2 = json.loads(json.dumps(ld.state_dict()))
        stats = ld.stats()["mixture"]
    assert after == [ref.sample(g) for g in range(120, 184)]
    assert state2 == ref.state_dict(ids, 1, 80)
    assert state2["mixture"]["edits"] == [120]
    assert state2["mixture"]["base"] == {"position": 120, "counts": old.counts(120)}
    assert stats["position"] == 184 and stats["edits"] == [120] and stats["counts"] == new.counts(184)
    loaders = [_loader(new_mix, r, 2, 3) for r in range(2)]
    try:
        for ld in loaders:
            ld.load_state_dict(state2)
        later = _gather(loaders) + _gather(loaders)
    finally:
        for ld in loaders:
            ld.close()
    assert later == [ref.sample(g) for g in range(184, 184 + len(later))]
    stream = before + after + later
    for i, n in enumerate(SIZES):  # per source: whole permutations per epoch of its own, across the edit
        own = [x for s, x in stream if s == i]
        for e in range(len(own) // n):
            assert sorted(own[e * n : (e + 1) * n]) == list(range(n)), (edit, i, e)


def test_edited_state_is_checked_and_earlier_epochs_are_refused(files):
    """With the edited weights a damaged base or cursor is refused; set_epoch before the edit position says why."""
    old_mix = Mixture(files, _schedule(), samples_per_epoch=SPE)
    new_mix = Mixture(files, Schedule(EDITED, "step"), samples_per_epoch=SPE)
    with _loader(old_mix, 0, 1, 8) as ld:
        _gather([ld], 15)
        state = ld.state_dict()
    with _loader(new_mix, 0, 1, 8) as ld:
        ld.load_state_dict(state)
        _gather([ld], 2)
        edited = json.loads(json.dumps(ld.state_dict()))
        ld.set_epoch(0)
        with pytest.raises(ValueError, match="before position 120, where this loader's weights took over"):
            next(iter(ld))
    bad = json.loads(json.dumps(edited))
    bad["mixture"]["base"]["counts"][0] += 1
    with _loader(new_mix, 0, 1, 8) as ld, pytest.raises(StateError, match="disagree with the schedule"):
        ld.load_state_dict(bad)
    bad = json.loads(json.dumps(edited))
    bad["mixture"]["edits"] = [500]
    with _loader(new_mix, 0, 1, 8) as ld, pytest.raises(StateError, match="mixture.edits"):
        ld.load_state_dict(bad)
    bad = json.loads(json.dumps(edited))
    bad["mixture"]["sources"][1]["cursor"] = 10  # source 1 has 10 records
    with _loader(new_mix, 0, 1, 8) as ld, pytest.raises(StateError, match=r"mixture.sources\[1\]"):
        ld.load_state_dict(bad)
    with _loader(Mixture(files[:2], Schedule([(0, [1, 1]), (50, [1, 2])]), samples_per_epoch=SPE), 0, 1, 8) as ld:
        with pytest.raises(StateMismatchError, match=r"mixture.sources.*Removed: source 2 \(dataset_id [0-9a-f]{64}\)"):
            ld.load_state_dict(edited)  # another set of sources is refused, weights edited or not, naming them
        two = ld.state_dict()
    with _loader(new_mix, 0, 1, 8) as ld, \
            pytest.raises(StateMismatchError, match=r"Added: .*c.pageset \(dataset_id [0-9a-f]{64}\)\.$"):
        ld.load_state_dict(two)
    with _loader(new_mix, 0, 1, 8) as ld:  # a refused state leaves the loader as it was
        ld.load_state_dict(edited)
        with pytest.raises(StateError):
            ld.load_state_dict(bad)
        assert ld.state_dict() == edited


# --- together with what exists ------------------------------------------------------------------------------


def test_stats_show_the_stage_weights_and_counts(files):
    mix = Mixture(files, _schedule(), samples_per_epoch=SPE)
    with _loader(mix, 0, 1, 8) as ld:
        assert ld.stats()["mixture"] == {"position": 0, "stage": 0, "weights": [0.7, 0.2, 0.1], "counts": [0, 0, 0],
                                         "stage_counts": [0, 0, 0], "edits": []}
        _gather([ld], 12)  # to the first boundary (96)
        st = ld.stats()["mixture"]
        assert st["stage"] == 1 and st["counts"] == [67, 19, 10] and st["stage_counts"] == [0, 0, 0]
        assert st["weights"] == pytest.approx([0.2, 0.3, 0.5])
        _gather([ld], 19)  # 96 + 19 * 8 = 248, in epoch 2
        st = ld.stats()["mixture"]
        assert st["position"] == 248 and st["stage"] == 2 and st["weights"] == pytest.approx([0.0, 0.1, 0.9])
        assert st["stage_counts"] == [a - b for a, b in zip(st["counts"], [78, 40, 82])]  # at 200: the two stages
    with _loader(Mixture(files, [0.5, 0.3, 0.2]), 0, 1, 10) as ld:
        _gather([ld], 1)
        assert ld.stats()["mixture"] == {"position": 10, "stage": 0, "weights": [0.5, 0.3, 0.2],
                                         "counts": [5, 3, 2], "stage_counts": [5, 3, 2], "edits": []}


def test_one_stage_schedule_is_the_constant_mixture(files):
    """Schedule([(0, w)]) is Mixture(w): the same stream and byte-identical states (constant states unchanged)."""
    a = Mixture(files, Schedule([(0, [0.5, 0.3, 0.2])]), samples_per_epoch=SPE)
    b = Mixture(files, [0.5, 0.3, 0.2], samples_per_epoch=SPE)
    with _loader(a, 0, 1, 8) as la, _loader(b, 0, 1, 8) as lb:
        assert _gather([la], 5) == _gather([lb], 5)
        assert json.dumps(la.state_dict()) == json.dumps(lb.state_dict())
        assert "schedule" not in la.state_dict()["mixture"]


def test_token_weights_per_stage_with_a_many_file_set_as_a_source(tmp_path):
    """weight_unit="tokens" under a schedule: each stage's token weights become sample weights w_i * N_i / T_i
    (section 2.6, here of stride windows, so N_i / T_i = 1 / seq_len) and its quotas are the model's; a ramp
    between them; one source is a many-file set. The stream on 2 ranks is the model's, windows their tokens."""
    from reference import manifest as ref_manifest

    L, G = 16, 8
    rng = np.random.default_rng(9)
    docs = [rng.integers(0, 1000, size=int(rng.integers(1, 60))) for _ in range(60)]
    single = tmp_path / "one.pageset"
    write_tokens(single, docs[:30], eos_id=1000, num_workers=0, page_size=4096, progress=False)
    folder = tmp_path / "set"
    write_tokens(folder, docs[30:], eos_id=1000, dtype="uint16", docs_per_member=10, num_workers=0,
                 page_size=4096, progress=False, lineage=False)
    ref_set = ref_manifest.read_set(folder)
    set_sizes = [s for m in ref_set.members for s in model.window_page_sizes(
        len(m.tokens), L, 2, m.header["page_size"], m.header["page_count"])]
    layouts = [model_layout(single, L)[0], set_sizes]
    stages = [(0, [0.134364, 0.847434]), (40, [3, 1])]
    sched = Schedule(stages, "linear", block=7)

    def sample_quotas(w):
        v = [Fraction(x) for x in w]  # N_i / T_i = 1 / L for every source: the token weights' own ratios
        return model.quotas([float(x / max(v)) for x in v])

    ms = model.ScheduleModel([0, 40], [sample_quotas(w) for _, w in stages], ["linear"], 7)
    ref = model.ScheduledMixtureModel(ms, layouts, 4, "random", 1, False, G, samples_per_epoch=50)
    mix = Mixture([single, folder], sched, weight_unit="tokens", samples_per_epoch=50)
    loaders = [Loader(mix, batch_size=G // 2, rank=r, world_size=2, order="random", seed=4, drop_last=False,
                      pipelines={"tokens": [TokenWindows(L)]}, array_type="numpy", num_threads=1) for r in range(2)]
    try:
        got = []
        for _ in range(2):
            for batches in zip(*loaders):
                for b in batches:
                    got += list(zip(b["_source"].tolist(), b["_index"].tolist()))
    finally:
        for ld in loaders:
            ld.close()
    assert got == [ref.sample(g) for g in range(len(got))] and len(got) == 2 * ref.length


def test_process_mode_follows_the_schedule(files, layouts):
    """num_workers=1 (decode in a child process): the parent plans, so the stream is the model's as in-process."""
    mix = Mixture(files, _schedule(), samples_per_epoch=SPE)
    ref = _mix_model(layouts, _model_schedule(), "quasi_random", 8)
    with _loader(mix, 0, 1, 8, num_workers=1) as ld:
        got = _gather([ld]) + _gather([ld])
    assert got == [ref.sample(g) for g in range(2 * ref.length)]


# --- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stages,kw,exc,match", [
    ([], {}, ValueError, "stages is empty"),
    ("0:1", {}, TypeError, "sequence of"),
    ([(5, [1, 1])], {}, ValueError, r"stages\[0\] starts at 5: the first stage starts at position 0"),
    ([(0, [1, 1]), (0, [1, 2])], {}, ValueError, r"stages\[1\] starts at 0, which repeats the start of stages\[0\]"),
    ([(0, [1, 1]), (50, [1, 2]), (20, [2, 1])], {}, ValueError, r"stages\[2\] starts at 20, which is before"),
    ([(0, [1, 1]), (-3, [1, 2])], {}, ValueError, r"stages\[1\]: start -3 is not an int >= 0"),
    ([(0, [1, 1]), (1.5, [1, 2])], {}, ValueError, r"stages\[1\]: start 1.5 is not an int"),
    ([(0, [1, 1]), (10, [1, -2])], {}, ValueError, r"stages\[1\] \(start 10\): weights\[1\] = -2.0 is negative"),
    ([(0, [1, 1]), (10, [0, 0])], {}, ValueError, r"stages\[1\] \(start 10\): all weights are zero"),
    ([(0, [1, 1]), (10, [1, float("nan")])], {}, ValueError, r"stages\[1\] \(start 10\): weights\[1\] = nan"),
    ([(0, [1, 1]), (10, [1, 2, 3])], {}, ValueError, r"stages\[1\] \(start 10\) has 3 weights, stages\[0\] has 2"),
    ([(0, [1, 1]), 7], {}, TypeError, r"stages\[1\] = 7 is not a \(start, weights\) pair"),
    ([(0, [1, 1]), (10, [1, 2])], {"interpolate": "cubic"}, ValueError, "interpolate = 'cubic'"),
    ([(0, [1, 1]), (10, [1, 2])], {"interpolate": ["step", "linear"]}, ValueError, "2 values for 1 gaps"),
    ([(0, [1, 1]), (10, [1, 2])], {"block": 0}, ValueError, r"block must be an int in \[1, 1000000\]"),
])
def test_bad_schedules_are_refused_naming_the_stage(stages, kw, exc, match):
    with pytest.raises(exc, match=match):
        Schedule(stages, **kw)


def test_schedule_against_the_sources_is_checked(files, tmp_path):
    with pytest.raises(ValueError, match="the schedule has 2 weights per stage for 3 sources"):
        Mixture(files, Schedule([(0, [1, 1]), (10, [1, 2])]))
    # a source without records (reachable with plans of opened files; Loader refuses empty files earlier)
    from pageset.order.plan import Member, OrderParams

    members = [Member("a.pageset", "a" * 64, np.array([5, 5])), Member("b.pageset", "b" * 64, np.zeros(0, np.int64))]
    params = OrderParams(seed=0, order="sequential", window_pages=1, global_batch_size=2, drop_last=True)
    Mixture(["a.pageset", "b.pageset"], Schedule([(0, [1, 0]), (40, [1, 0])])).plan(members, params)  # weight 0: fine
    with pytest.raises(ValueError, match=r"b.pageset: stage 1 \(start 40\) of the schedule: source 1 of the "
                                         r"mixture has no records but weight 1.0; give it weight 0 or drop it"):
        Mixture(["a.pageset", "b.pageset"], Schedule([(0, [1, 0]), (40, [1, 1])])).plan(members, params)


def test_packed_rows_weighted_by_tokens_per_stage(tmp_path):
    """Packed rows (best_fit, 16 columns) of two token files under a schedule with weight_unit="tokens": each
    stage's quotas are section 2.6's of its weights (from the reference packing's rows and predictions), the
    stream is the model's and every row's tokens and labels are the reference packing's."""
    from reference import format as ref_format
    from reference import packing as ref_packing

    L = 16
    rng = np.random.default_rng(3)
    docs = [[np.arange(100 + 16 * k, 116 + 16 * k) for k in range(40)],
            [rng.integers(2, 5000, size=int(rng.integers(1, 30))) for _ in range(60)]]
    paths, refs = [], []
    for k, ds in enumerate(docs):
        path = tmp_path / f"p{k}.pageset"
        write_tokens(path, ds, None, eos_id=1, dtype="uint16", num_workers=0, page_size=4096, progress=False,
                     lineage=False)
        ref = ref_format.read_file(path)
        rows = ref_packing.rows(ref.doc_offsets, L, 2, ref.header["page_size"], 1)
        preds = sum(m - 1 for row in rows for _, m in row)
        sizes = ref_packing.row_page_sizes(rows, 2, ref.header["page_size"], ref.header["page_count"])
        paths.append(path)
        refs.append((rows, sizes, preds, ref.tokens))
    stages = [(0, [1, 1]), (30, [1, 3]), (70, [0.25, 0.75])]

    def sample_quotas(w):
        v = [Fraction(x) * len(rows) / t for x, (rows, _, t, _) in zip(w, refs)]
        return model.quotas([float(x / max(v)) for x in v])

    assert [sample_quotas(w) for _, w in stages] != [model.quotas(w) for _, w in stages]  # tokens are not rows
    ms = model.ScheduleModel([s for s, _ in stages], [sample_quotas(w) for _, w in stages], ["linear", "step"], 8)
    ref = model.ScheduledMixtureModel(ms, [r[1] for r in refs], 2, "quasi_random", 2, True, 6, samples_per_epoch=48)
    mix = Mixture(paths, Schedule(stages, ["linear", "step"], block=8), weight_unit="tokens", samples_per_epoch=48)
    got = []
    with Loader(mix, batch_size=3, rank=0, world_size=1, order="quasi_random", seed=2, window_pages=2,
                pipelines={"tokens": [TokenWindows(L, packing="best_fit")]}, array_type="numpy", num_threads=1) as ld:
        for _ in range(3):
            for b in ld:
                for j, (s, i) in enumerate(zip(b["_source"].tolist(), b["_index"].tolist())):
                    rows, _, _, tokens = refs[s]
                    want = ref_packing.row_contents(tokens, rows[i], L, 1)
                    for key in ("input", "target", "labels"):
                        assert np.asarray(b[key][j]).tolist() == want[key], (key, s, i)
                    got.append((s, i))
    assert got == [ref.sample(g) for g in range(len(got))] and len(got) == 3 * 48
