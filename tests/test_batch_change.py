"""Changing the global batch on resume (formats/order.md section 5.1, formats/mixture.md sections 2.4, 2.5).

A run saves its state with global batch G on W ranks; a Loader of another global batch G' on W' ranks loads it
and goes on. Every test compares the all-gathered stream of the real Loaders (ids, padding flags, sources and
the bytes read) and their state dicts with ``tests/reference/order.py`` (written from the spec alone): the
positions handed out before and after a change are the epoch's, each once, in order; the epoch ends by the
spec's drop / padding rule; the next epoch starts at position 0 with the new G. Real files written here: a record
file (records of varying size over several 4 KiB pages, some larger than a page), a token file, a subset and a
mixture of two record files.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from reference import order as model
from resume_contract import model_layout

from pageset import Bytes, Int, Loader, Mixture, TokenWindows, write_dataset, write_tokens
from pageset.order import StateError

SEED, M, SEQ = 31, 2, 16
WEIGHTS, SPE = [0.6, 0.4], 45
SUBSET = [40, 3, 3, 17, 0, 44, 12, 5, 6, 7, 20, 21, 22, 9, 14, 3, 28, 1, 33, 31, 30, 2, 11, 47, 46, 8, 19, 49,
          10, 10, 36, 37, 25, 24, 41]  # any order, repeats


def _write_records(path, tag, sizes):
    """Records i = (label tag * 1000 + i, payload of sizes[i] bytes): the label tells which record was read."""
    records = [(tag * 1000 + i, bytes([tag, i % 256]) * (s // 2 + 1)) for i, s in enumerate(sizes)]
    write_dataset(path, records, {"label": Int(), "payload": Bytes()}, num_workers=0, page_size=4096,
                  progress=False)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch_change")
    rng = random.Random(3)
    sizes = [rng.choice([rng.randint(1, 60), rng.randint(100, 900)]) for _ in range(50)]
    sizes[9] = 6000  # larger than a page: an empty page follows
    docs = [[rng.randrange(2, 1000) for _ in range(rng.randint(1, 60))] for _ in range(40)]
    write_tokens(d / "tokens.pageset", docs, eos_id=1, num_workers=0, page_size=4096, progress=False)
    docs2 = [[rng.randrange(2, 1000) for _ in range(rng.randint(1, 40))] for _ in range(15)]
    write_tokens(d / "tokens2.pageset", docs2, eos_id=1, num_workers=0, page_size=4096, progress=False)
    streams = []
    for dd in (docs, docs2):
        tokens = []
        for doc in dd:
            tokens += doc + [1]
        streams.append(np.array(tokens, dtype=np.int64))
    return {"records": _write_records(d / "records.pageset", 1, sizes),
            "other": _write_records(d / "other.pageset", 2, [rng.randint(1, 300) for _ in range(23)]),
            "tokens": d / "tokens.pageset", "tokens2": d / "tokens2.pageset", "token_streams": streams}


class Kind:
    """One kind of data: how to build its Loader and what the reference model expects of each position."""

    def __init__(self, files, name, order, drop_last):
        self.name, self.order, self.drop_last = name, order, drop_last
        self.kw = dict(order=order, seed=SEED, window_pages=M, drop_last=drop_last, num_threads=1,
                       array_type="numpy")
        self.files = files
        if name in ("mixture", "token_mixture"):  # (a mixture of token files is filled by the calling thread)
            names, seq = (("records", "other"), None) if name == "mixture" else (("tokens", "tokens2"), SEQ)
            layouts = [model_layout(files[k], seq) for k in names]
            self.path = Mixture([files[k] for k in names], WEIGHTS, samples_per_epoch=SPE)
            if seq:
                self.kw["pipelines"] = {"tokens": [TokenWindows(SEQ)]}
            self.sizes, self.ids = [s for s, _ in layouts], [i for _, i in layouts]
            self.n = SPE
            return
        seq = SEQ if name == "tokens" else None
        sizes, self.dataset_id = model_layout(files["tokens" if seq else "records"], seq)
        self.path = files["tokens" if seq else "records"]
        if seq:
            self.kw["pipelines"] = {"tokens": [TokenWindows(SEQ)]}
        subset = SUBSET if name == "subset" else None
        if subset:
            self.kw["indices"] = subset
        self.ref = model.FileOrder(sizes, SEED, order, M, drop_last, 1, subset=subset)
        self.n = self.ref.n

    def loader(self, rank, world_size, batch_size):
        return Loader(self.path, batch_size=batch_size, rank=rank, world_size=world_size, **self.kw)

    def expected(self, epoch, origin, position):
        """(source, id, padding) the spec puts at ``position`` of ``epoch`` (a mixture: global origin + position)."""
        if self.name.endswith("mixture"):
            mm = model.MixtureModel(WEIGHTS, self.sizes, SEED, self.order, M, self.drop_last, 1, SPE)
            return (*mm.sample(origin + position), False)
        rid, pad = self.ref.record(epoch, position)
        return 0, rid, pad

    def state(self, g, epoch, cursor, origin):
        """The model's state dict of a loader of global batch ``g`` at (epoch, cursor), its epoch at ``origin``."""
        if self.name.endswith("mixture"):
            mm = model.MixtureModel(WEIGHTS, self.sizes, SEED, self.order, M, self.drop_last, g, SPE)
            return mm.state_dict(self.ids, epoch, cursor, origin=origin,
                                 seq_len=SEQ if self.name == "token_mixture" else 0)
        return model.state_dict(self.dataset_id, SEED, epoch, cursor, g, self.order, M, self.drop_last,
                                subset=SUBSET if self.name == "subset" else None,
                                seq_len=SEQ if self.name == "tokens" else 0)

    def check_rows(self, batch, rows):
        """The bytes read are those of the ids: record labels, or the token window of each id."""
        if self.name.startswith("token"):
            streams = self.files["token_streams"]
            want = [streams[src][i * SEQ : i * SEQ + SEQ].tolist() for src, i, _ in rows]
            assert batch["input"].tolist() == want
        else:
            tags = [1 + src for src, _, _ in rows]
            assert batch["label"].tolist() == [t * 1000 + i for t, (_, i, _) in zip(tags, rows)]


def model_segments(n, drop_last, segments):
    """The spec's stream of a run in segments ``[(G, steps), ...]`` (each a new Loader resuming the previous
    one's state): per global step ``(epoch, origin, positions)``, and per segment the (epoch, cursor, origin) at
    its end. formats/order.md 5.1 and section 8: a resumed epoch is cut at the cursor; an epoch over with the
    saved G, or with no step of the new G left, continues at the next epoch's position 0; epochs tile the stream
    (mixture.md 2.4: origin)."""
    steps_out, ends = [], []
    epoch, cursor, origin, end = 0, 0, 0, None
    for g, steps in segments:
        if end is not None and cursor == end:  # the saved epoch is over (section 8)
            epoch, cursor, origin = epoch + 1, 0, origin + end
        end = model.epoch_end(n, g, drop_last, cursor) if cursor else model.epoch_length(n, g, drop_last)
        if end == cursor:  # no step of the new G left: the tail is dropped (5.1)
            epoch, cursor, origin = epoch + 1, 0, origin + cursor
            end = model.epoch_length(n, g, drop_last)
        for _ in range(steps):
            if cursor == end:
                epoch, cursor, origin = epoch + 1, 0, origin + end
                end = model.epoch_length(n, g, drop_last)
            steps_out.append((epoch, origin, list(range(cursor, cursor + g))))
            cursor += g
        ends.append((epoch, cursor, origin))
    return steps_out, ends


def run_segments(kind, segments):
    """Run ``[(G, W, steps), ...]`` with real Loaders (a new set of W loaders per segment, resuming the previous
    segment's state); returns the all-gathered (source, id, padding) rows, the states, and each segment's
    ``steps_remaining`` right after load_state_dict."""
    rows, states, remaining_after_load = [], [], []
    state = None
    for g, w, steps in segments:
        loaders = [kind.loader(r, w, g // w) for r in range(w)]
        try:
            if state is not None:
                for ld in loaders:
                    ld.load_state_dict(state)
            remaining_after_load.append(loaders[0].steps_remaining)
            left = steps
            while left:
                k = min(left, loaders[0].steps_remaining)
                its = [iter(ld) for ld in loaders]
                for _ in range(k):
                    for it in its:
                        b = next(it)
                        src = b["_source"].tolist() if "_source" in b else [0] * len(b["_index"])
                        got = list(zip(src, b["_index"].tolist(), b["_is_padding"].tolist()))
                        kind.check_rows(b, got)
                        rows += got
                left -= k
                if left:  # the rest of the epoch was taken: the iterators end there (no extra batch), the
                    for it in its:  # epoch counter moves on
                        with pytest.raises(StopIteration):
                            next(it)
            per_rank = [ld.state_dict() for ld in loaders]
            assert all(s == per_rank[0] for s in per_rank), "the state must be the same on every rank"
            state = per_rank[0]
            states.append(state)
        finally:
            for ld in loaders:
                ld.close()
    return rows, states, remaining_after_load


def check_run(kind, segments):
    """The Loaders' stream, states and steps_remaining equal the model's for the run ``segments``."""
    want_steps, ends = model_segments(kind.n, kind.drop_last, [(g, s) for g, _, s in segments])
    rows, states, remaining = run_segments(kind, segments)
    want = [kind.expected(e, o, p) for e, o, ps in want_steps for p in ps]
    assert rows == want
    for (g, _, _), st, (e, c, o) in zip(segments, states, ends):
        assert st == kind.state(g, e, c, o) and list(st) == list(kind.state(g, e, c, o))
    # steps_remaining after a load: the steps of the cut epoch (formats/order.md 5.1), or a whole epoch
    for i, (g, _, _) in enumerate(segments[1:], 1):
        e2, c2 = model.resume_cursor(states[i - 1], kind.n, g)  # (states[i - 1] equals the model's: above)
        cut = model.cut_epoch(kind.n, g, kind.drop_last, c2)
        assert remaining[i] == len(cut), (i, e2, c2)
    return rows, want_steps


def _covers_each_position_once(kind, want_steps, epoch):
    """The positions of ``epoch`` in the run are 0, 1, ..., E - 1 in order, E its end by the spec's rule."""
    got = [p for e, _, ps in want_steps if e == epoch for p in ps]
    assert got == list(range(len(got)))
    return len(got)


# (G, G'): integer and non-integer ratios, up and down
CHANGES = [(6, 4), (4, 6), (5, 7), (8, 3)]
KINDS = ["records", "tokens", "subset", "mixture", "token_mixture"]
ORDERS = ["random", "quasi_random", "sequential"]


def _worlds(g_old, g_new):
    """(W, W'): a few ranks before and one after, and the reverse (W dividing G, W' dividing G')."""
    def most(g):
        return max(w for w in (1, 2, 3, 4) if g % w == 0)
    return [(most(g_old), 1), (1, most(g_new))]


def _change_case(files, name, order, drop_last, g_old, g_new, w_old, w_new):
    kind = Kind(files, name, order, drop_last)
    cut = 3  # steps of G before the change: a cursor (3 * G) that is mid-epoch and rarely a multiple of G'
    rows, want_steps = check_run(kind, [(g_old, w_old, cut),
                                        (g_new, w_new, _rest_and_one_epoch(kind, g_old, g_new, cut))])
    end = _covers_each_position_once(kind, want_steps, 0)
    assert end == model.epoch_end(kind.n, g_new, drop_last, cut * g_old)  # the spec's drop / padding rule
    # the next epoch: position 0 on, steps of G'
    nxt = [ps for e, _, ps in want_steps if e == 1]
    assert nxt and nxt[0][0] == 0 and len(nxt) == model.epoch_length(kind.n, g_new, drop_last) // g_new
    return rows


def _rest_and_one_epoch(kind, g_old, g_new, cut):
    c = cut * g_old
    rest = (model.epoch_end(kind.n, g_new, kind.drop_last, c) - c) // g_new
    return rest + model.epoch_length(kind.n, g_new, kind.drop_last) // g_new


@pytest.mark.parametrize(("g_old", "g_new"), CHANGES)
@pytest.mark.parametrize("name", KINDS)
def test_a_change_mid_epoch_covers_the_epoch_once(files, name, g_old, g_new):
    """Default run: each kind x each change, order and drop_last varied across rows, ranks changing too."""
    i = KINDS.index(name) + CHANGES.index((g_old, g_new))
    order, drop_last = ORDERS[i % 3], bool(i % 2)
    w_old, w_new = _worlds(g_old, g_new)[i % 2]
    _change_case(files, name, order, drop_last, g_old, g_new, w_old, w_new)


@pytest.mark.slow
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(("g_old", "g_new"), CHANGES)
@pytest.mark.parametrize("name", KINDS)
def test_a_change_mid_epoch_covers_the_epoch_once_everywhere(files, name, g_old, g_new, order, drop_last):
    for w_old, w_new in _worlds(g_old, g_new):
        _change_case(files, name, order, drop_last, g_old, g_new, w_old, w_new)


@pytest.mark.parametrize("name", ["records", "mixture", "token_mixture"])
def test_a_ramp_of_three_loaders(files, name):
    """256 -> 512 -> 1024 sequences scaled down to 4 -> 8 -> 16 (and the world size 1 -> 2 -> 4), each change
    mid-epoch at a cursor that is not a multiple of the new G, the last one running into the next epochs; then
    a fourth Loader of G = 16 resumes the third's state (the same G: nothing changes)."""
    kind = Kind(files, name, "quasi_random", True)
    segments = [(4, 1, 3), (8, 2, 2), (16, 4, 5), (16, 2, 3)]
    _, want_steps = check_run(kind, segments)
    assert max(e for e, _, _ in want_steps) >= 1  # the last segments run on into later epochs
    _covers_each_position_once(kind, want_steps, 0)
    assert [len(ps) for e, _, ps in want_steps if e == 0] == [4, 4, 4, 8, 8] + [16] * (
        (model.epoch_end(kind.n, 16, True, 28) - 28) // 16)


def test_the_epoch_end_rule_by_hand(files):
    """Hand-checked cut of a sequential epoch of the 50-record file (position p reads record p, padding
    positions >= 50 read p - 50): G=8 for 4 steps (cursor 32), then G'=6: drop_last=True gives [32, 38),
    [38, 44), [44, 50) (E = 50: nothing dropped), G'=7 gives [32, 39), [39, 46) and drops 46..49;
    drop_last=False with G'=7 pads [46, 53): records 46..49, then 0, 1, 2 flagged."""
    for drop_last, g_new, want in [
        (True, 6, [list(range(32, 38)), list(range(38, 44)), list(range(44, 50))]),
        (True, 7, [list(range(32, 39)), list(range(39, 46))]),
        (False, 7, [list(range(32, 39)), list(range(39, 46)), [46, 47, 48, 49, 0, 1, 2]]),
    ]:
        kw = dict(order="sequential", drop_last=drop_last, num_threads=1, array_type="numpy")
        with Loader(files["records"], batch_size=8, **kw) as a:
            it = iter(a)
            for _ in range(4):
                next(it)
            state = a.state_dict()
        assert state["cursor"] == 32 and "batch_offset" not in state
        with Loader(files["records"], batch_size=g_new, **kw) as b:
            b.load_state_dict(state)
            assert b.steps_remaining == len(want) and len(b) == (50 // g_new if drop_last else -(-50 // g_new))
            got = list(b)
            assert [x["_index"].tolist() for x in got] == want
            assert [x["label"].tolist() for x in got] == [[1000 + i for i in w] for w in want]
            pads = [x["_is_padding"].tolist() for x in got]
            assert pads[-1] == ([False] * 4 + [True] * 3 if not drop_last else [False] * g_new)
            # the next epoch starts at position 0 in steps of g_new
            assert b.state_dict()["epoch"] == 1 and b.state_dict()["cursor"] == 0
            assert next(iter(b))["_index"].tolist() == list(range(g_new))


def test_no_step_of_the_new_global_batch_left_starts_the_next_epoch(files):
    """drop_last=True, 50 records, G=8 for 5 steps (cursor 40): 10 positions left; G'=12 cannot make a step, so
    the epoch is over (its tail of 10 dropped, as any tail shorter than a step) and the next starts at 0."""
    kw = dict(order="sequential", num_threads=1, array_type="numpy")
    with Loader(files["records"], batch_size=8, **kw) as a:
        it = iter(a)
        for _ in range(5):
            next(it)
        state = a.state_dict()
    with Loader(files["records"], batch_size=12, **kw) as b:
        b.load_state_dict(state)
        assert b.state_dict()["epoch"] == 1 and b.state_dict()["cursor"] == 0
        assert b.steps_remaining == len(b) == 4
        assert [x["_index"].tolist() for x in b][0] == list(range(12))
    # a state saved at the epoch's end (G=8: L=48, cursor 48) is over whatever the new G: G'=2 does not read
    # positions 48, 49 (they are the dropped tail of the saved epoch)
    with Loader(files["records"], batch_size=8, **kw) as a:
        it = iter(a)
        for _ in range(6):
            next(it)
        state = a.state_dict()
    assert state["cursor"] == 48 and state["epoch"] == 0
    with Loader(files["records"], batch_size=2, **kw) as b:
        b.load_state_dict(state)
        assert b.state_dict()["epoch"] == 1 and b.state_dict()["cursor"] == 0 and b.steps_remaining == 25


def test_a_state_from_before_the_change_still_loads(files):
    """A state dict as pageset wrote it before this change (no batch_offset key), typed in: it resumes with the
    saved G at its step and with another G at its cursor; a state saved after a change records batch_offset."""
    _, dataset_id = model_layout(files["records"])
    old = {"version": 1, "order_algo": 1, "dataset_id": dataset_id, "seed": 0, "epoch": 2, "cursor": 16,
           "global_batch_size": 8, "order": "sequential", "window_pages": 8, "drop_last": True}
    # window_pages=8: the loader as it was built then (its default; a window sized in records is saved as
    # window_pages 0 + window_records, and the order compares neither for "sequential")
    kw = dict(order="sequential", num_threads=1, array_type="numpy", window_pages=8)
    with Loader(files["records"], batch_size=8, **kw) as a:
        a.load_state_dict(dict(old))
        assert next(iter(a))["_index"].tolist() == list(range(16, 24))
        assert a.state_dict() == old | {"cursor": 24}  # byte-identical layout: no new key without a change
    with Loader(files["records"], batch_size=3, rank=1, world_size=2, **kw) as b:  # G' = 6
        b.load_state_dict(dict(old))
        assert b.steps_remaining == (50 - 16) // 6
        assert next(iter(b))["_index"].tolist() == [19, 20, 21]  # rank 1 of [16, 22)
        assert b.state_dict() == old | {"cursor": 22, "global_batch_size": 6, "batch_offset": 4}


def test_bad_batch_offsets_are_refused(files):
    _, dataset_id = model_layout(files["records"])
    base = {"version": 1, "order_algo": 1, "dataset_id": dataset_id, "seed": 0, "epoch": 0, "cursor": 22,
            "global_batch_size": 6, "order": "random", "window_pages": 8, "drop_last": True, "batch_offset": 4}
    with Loader(files["records"], batch_size=6, num_threads=1, array_type="numpy") as ld:
        ld.load_state_dict(dict(base))  # valid
        for change, field, text in [
            ({"batch_offset": 3}, "cursor", "cursor=22 is not batch_offset=3 plus a multiple of global_batch_size=6"),
            ({"batch_offset": 6, "cursor": 6}, "batch_offset", "must be < global_batch_size=6, got 6"),
            ({"batch_offset": -1}, "batch_offset", "must be >= 0, got -1"),
            ({"batch_offset": 4, "cursor": 52}, "cursor", "cursor=52 is past the end of the epoch at position 46"),
            ({"batch_offset": 0, "cursor": 22}, "cursor", "cursor=22 is not a multiple of global_batch_size=6"),
        ]:
            with pytest.raises(StateError, match=text) as info:
                ld.load_state_dict(base | change)
            assert info.value.field == field
    mix = Kind(files, "mixture", "random", True)
    with mix.loader(0, 1, 6) as ld:
        st = ld.state_dict()
        st["mixture"]["origin"] = -1
        with pytest.raises(StateError, match="must be an int >= 0") as info:
            ld.load_state_dict(st)
        assert info.value.field == "mixture.origin"
        st["mixture"]["origin"] = 7  # not where the per-source cursors are
        with pytest.raises(StateError, match="disagree with the schedule") as info:
            ld.load_state_dict(st)
        assert info.value.field == "mixture.sources"


def test_set_epoch_after_a_change_keeps_the_mixture_stream_tiled(files):
    """A mixture resumed with another G mid-epoch, then set_epoch(1) before the epoch's end: epoch 1 starts
    where epoch 0 would have ended (O_1 = E of 0, mixture.md 2.4), not at 1 * L of the new G."""
    kind = Kind(files, "mixture", "random", False)
    with kind.loader(0, 1, 4) as a:
        it = iter(a)
        for _ in range(3):
            next(it)
        state = a.state_dict()
    with kind.loader(0, 1, 5) as b:
        b.load_state_dict(state)
        b.set_epoch(1)
        first = next(iter(b))
    end0 = model.epoch_end(SPE, 5, False, 12)  # 12 + ceil(33 / 5) * 5 = 47
    assert end0 == 47 and model.epoch_length(SPE, 5, False) == 45
    want = [kind.expected(1, end0, p) for p in range(5)]
    assert list(zip(first["_source"].tolist(), first["_index"].tolist())) == [(s, i) for s, i, _ in want]


def test_the_prefetch_plans_the_pages_of_the_new_steps(files):
    """What a URL's prefetch asks for at each step after a change (Loader._step_pages) is the pages of the token
    windows at the model's positions of that rank: [c + k*G' + r*B, ... + B) (a window w spans the bytes of tokens
    [w*seq_len, w*seq_len + seq_len + 1))."""
    from pageset.read import Dataset

    kind = Kind(files, "tokens", "quasi_random", True)
    with kind.loader(0, 2, 2) as a:
        it = iter(a)
        for _ in range(5):
            next(it)
        state = a.state_dict()
    with Dataset(files["tokens"]) as ds:
        size, count = ds.page_size, ds.page_count
        assert np.dtype(ds.tokens_info["dtype"]).itemsize == 2
    for rank in range(3):
        with kind.loader(rank, 3, 2) as b:
            b.load_state_dict(state)
            assert b.steps_remaining == len(model.cut_epoch(kind.n, 6, True, 20))
            for k, positions in enumerate(model.cut_epoch(kind.n, 6, True, 20)):
                mine = positions[rank * 2 : rank * 2 + 2]
                pages = set()
                for p in mine:
                    w, _ = kind.ref.record(0, p)
                    first, last = w * SEQ * 2, (w * SEQ + SEQ + 1) * 2 - 1  # uint16 tokens
                    pages |= set(range(min(first // size, count - 1), min(last // size, count - 1) + 1))
                got = b._step_pages(b._plan.epoch(0), 0, 20 % 6, k)
                assert got.tolist() == sorted(pages), (rank, k)
