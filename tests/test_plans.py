"""The Plan interface (order/plan.py): each kind against the reference model, the many-file set end to end.

Every plan (a file, a subset, a mixture, a many-file set) is compared with ``tests/reference/order.py`` (written
from formats/order.md and formats/mixture.md alone): the rows of every rank's batch (file, record id, padding,
``_index``), the per-file ids a remote prefetch asks for, the state dict and the resume position, for every
order x drop_last x a few world sizes and steps. A many-file set is order v1 over its members' concatenated
page lists: its Loader is checked against the reference order over that list applied to the records of
``merge_datasets`` of the same members (which concatenates records in order). A fifth kind, defined here in a
few lines, runs through the Loader unchanged: the Loader holds one plan and asks nothing about its kind.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from reference import order as model
from resume_contract import check_resume, model_layout

from pageset import Bytes, Int, Loader, merge_datasets, open_dataset, write_dataset
from pageset.order import StateError, StateMismatchError
from pageset.order.fileset import FileSet, ManyFilePlan
from pageset.order.mixture import MixturePlan, quotas
from pageset.order.plan import FilePlan, Member, OrderParams, Plan, PlanBatch, PlanEpoch, PlanSpec
from pageset.order.subset import OneFile
from pageset.order.subset import SubsetPlan

ORDERS = ("sequential", "random", "quasi_random")
G = 12
WORLD_SIZES = (1, 3, 4)
SEED, M = 77, 2
# pages with empty ones and single-record ones (formats/order.md section 1 allows both)
PAGES = [5, 0, 1, 9, 3, 0, 7, 2, 4, 1]  # N = 32
MEMBERS = [[5, 0, 1], [9, 3], [0], [7, 2, 4, 1]]  # concatenated: PAGES; member 2 has no records
HEX = "ab" * 32


def _params(order, drop_last, seq_len=0):
    return OrderParams(SEED, order, M, G, drop_last, seq_len)


def _steps(length):
    steps = length // G
    return sorted({0, min(1, steps - 1), steps - 1})


def _check_rows(plan, epoch, expected):
    """``expected(step, rank, w) -> (sources or None, ids, padding, index)`` lists; compares every rank's rows."""
    view = plan.epoch(epoch)
    for w in WORLD_SIZES:
        b = G // w
        for step in _steps(plan.epoch_length):
            for r in range(w):
                start = step * G + r * b
                got = view.batch(start, start + b)
                want = expected(step, r, w)
                assert (None if got.sources is None else got.sources.tolist()) == want[0], (w, step, r)
                assert got.ids.tolist() == want[1] and got.padding.tolist() == want[2], (w, step, r)
                assert got.index.tolist() == want[3], (w, step, r)
                assert got.ids.dtype == np.int64 and got.padding.dtype == bool and got.index.dtype == np.int64
                if got.sources is not None:
                    assert got.sources.dtype == np.int16
                    for k in range(max(want[0]) + 1):
                        assert view.file_ids(k, start, start + b).tolist() == [
                            i for s, i in zip(want[0], want[1]) if s == k], (w, step, r, k)
                else:
                    assert view.file_ids(0, start, start + b).tolist() == want[1]


def _check_state(plan, length, state_of):
    """plan.state == the model's at a few cursors; plan.resume == the model's resume position on every W."""
    for epoch in (0, 3):
        for cursor in (0, G, length):
            st = state_of(epoch, cursor)
            assert plan.state(epoch, cursor) == st and list(plan.state(epoch, cursor)) == list(st)
            e, step = model.resume_position(st, length)
            for w in WORLD_SIZES:
                assert plan.resume(st, w) == (e, step * G, 0)  # the same G: no shift of the epochs


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("order", ORDERS)
def test_file_plan_equals_the_reference(order, drop_last):
    plan = FilePlan(np.array(PAGES), HEX, _params(order, drop_last), "f.pageset")
    ref = model.FileOrder(PAGES, SEED, order, M, drop_last, G)
    assert (plan.n_records, plan.epoch_length, plan.hands_sources) == (32, ref.length, False)
    for epoch in (0, 1):
        def expected(step, r, w, epoch=epoch):
            ids, pad = ref.batch(epoch, step, r, w)
            return None, ids, pad, ids
        _check_rows(plan, epoch, expected)
    _check_state(plan, ref.length, lambda e, c: model.state_dict(HEX, SEED, e, c, G, order, M, drop_last))


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("order", ORDERS)
def test_subset_plan_equals_the_reference(order, drop_last):
    indices = [30, 3, 3, 17, 0, 31, 12, 5, 6, 7, 20, 21, 22, 9, 14, 3, 28, 1]  # any order, repeats
    plan = SubsetPlan(np.array(PAGES), indices, HEX, _params(order, drop_last, seq_len=8), "f.pageset")
    ref = model.FileOrder(PAGES, SEED, order, M, drop_last, G, subset=indices)
    assert (plan.n_records, plan.epoch_length) == (len(indices), ref.length)
    for epoch in (0, 1):
        def expected(step, r, w, epoch=epoch):
            ids, pad = ref.batch(epoch, step, r, w)
            return None, ids, pad, ids
        _check_rows(plan, epoch, expected)
    _check_state(plan, ref.length, lambda e, c: model.state_dict(HEX, SEED, e, c, G, order, M, drop_last,
                                                                 subset=indices, seq_len=8))
    whole = model.state_dict(HEX, SEED, 0, 0, G, order, M, drop_last, seq_len=8)
    with pytest.raises(StateMismatchError, match="subset"):
        plan.resume(whole, 1)


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("order", ORDERS)
def test_mixture_plan_equals_the_reference(order, drop_last):
    sizes = [[5, 0, 1, 9], [3, 2], [0], [7, 2, 4, 1, 6]]
    weights = [0.5, 0.3, 0, 0.2]
    members = [Member(f"{k}.pageset", f"{k:064x}", np.array(s)) for k, s in enumerate(sizes)]
    ids = [m.dataset_id for m in members]
    plan = MixturePlan(members, quotas(weights), 40, _params(order, drop_last))
    ref = model.MixtureModel(weights, sizes, SEED, order, M, drop_last, G, samples_per_epoch=40)
    assert (plan.n_records, plan.epoch_length, plan.hands_sources) == (40, ref.length, True)
    assert plan.dataset_id == ref.dataset_id(ids)
    for epoch in (0, 2):
        def expected(step, r, w, epoch=epoch):
            src, idx = ref.batch(epoch, step, r, w)
            return src, idx, [False] * len(idx), idx
        _check_rows(plan, epoch, expected)
    _check_state(plan, ref.length, lambda e, c: ref.state_dict(ids, e, c))
    with pytest.raises(StateMismatchError, match="'mixture'"):
        plan.resume(model.state_dict(plan.dataset_id, SEED, 0, 0, G, order, M, drop_last), 1)


def _member_of(gid):
    """(member, local id) of a global record id of MEMBERS, by counting (not the plan's searchsorted)."""
    for k, sizes in enumerate(MEMBERS):
        if gid < sum(sizes):
            return k, gid
        gid -= sum(sizes)
    raise AssertionError(gid)


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("order", ORDERS)
def test_many_file_plan_is_the_order_of_the_concatenated_page_list(order, drop_last):
    members = [Member(f"m{k}.pageset", f"{k:064x}", np.array(s)) for k, s in enumerate(MEMBERS)]
    plan = ManyFilePlan(members, HEX, _params(order, drop_last), "set")
    ref = model.FileOrder([s for m in MEMBERS for s in m], SEED, order, M, drop_last, G)
    assert (plan.n_records, plan.epoch_length, plan.hands_sources) == (32, ref.length, False)
    for epoch in (0, 1):
        def expected(step, r, w, epoch=epoch):
            gids, pad = ref.batch(epoch, step, r, w)
            rows = [_member_of(g) for g in gids]
            return [k for k, _ in rows], [i for _, i in rows], pad, gids
        _check_rows(plan, epoch, expected)
    # the state of one file with the concatenated page list and the set's id: no extra key
    _check_state(plan, ref.length, lambda e, c: model.state_dict(HEX, SEED, e, c, G, order, M, drop_last))
    other = model.state_dict("cd" * 32, SEED, 0, 0, G, order, M, drop_last)  # e.g. the set before an append
    assert model.refused_field(other, plan.state(0, 0), 1) == "dataset_id"
    with pytest.raises(StateMismatchError, match="dataset_id"):
        plan.resume(other, 1)


def test_plans_refuse_what_they_cannot_read():
    with pytest.raises(ValueError, match=r"set: drop_last=True with N=5 records and global_batch=12 leaves no"):
        ManyFilePlan([Member("a", HEX, np.array([3])), Member("b", HEX, np.array([2]))], HEX,
                     _params("random", True), "set")
    with pytest.raises(ValueError, match=r"f\.pageset: indices\[1\] = 32 is outside \[0, 32\)"):
        OneFile("f.pageset", [0, 32]).plan([Member("f.pageset", HEX, np.array(PAGES))], _params("random", True))
    with pytest.raises(ValueError, match="cannot be combined with a FileSet"):
        FileSet(["a", "b"], HEX).with_indices([0])
    with pytest.raises(ValueError, match=r"b: member 1 of the set has dataset id 0{64}, but the set lists 1{64}"):
        FileSet(["a", "b"], HEX, member_ids=["0" * 64, "1" * 64]).plan(
            [Member("a", "0" * 64, np.array([20])), Member("b", "0" * 64, np.array([20]))], _params("random", True))
    with pytest.raises(TypeError, match="paths must be a list of member files"):
        FileSet("a.pageset", HEX)
    with pytest.raises(TypeError, match="dataset_id must be a non-empty str"):
        FileSet(["a"], None)
    with pytest.raises(StateError, match="'cursor'"):  # a cursor between steps, without batch_offset
        FilePlan(np.array(PAGES), HEX, _params("random", True), "f").resume(
            model.state_dict(HEX, SEED, 0, 0, G, "random", M, True) | {"cursor": 5}, 1)


# --- end to end: a Loader over member files -----------------------------------------------------------------


def _write(path, n, tag, page_size=4096):
    """n records: label = tag * 1000 + i, a payload of 1..60 bytes (records of varying size: varying pages)."""
    records = [(tag * 1000 + i, bytes([tag, i % 256]) * (i % 30 + 1)) for i in range(n)]
    write_dataset(path, records, {"label": Int(), "payload": Bytes()}, num_workers=0, page_size=page_size,
                  progress=False)
    return path


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    d = tmp_path_factory.mktemp("set")
    return [_write(d / "a.pageset", 230, 1), _write(d / "b.pageset", 41, 2), _write(d / "c.pageset", 150, 3)]


def _rows(batch):
    data, lengths = batch["payload"]
    data, lengths = np.asarray(data), np.asarray(lengths)
    return [(int(lab), bytes(data[j, : lengths[j]])) for j, lab in enumerate(np.asarray(batch["label"]))]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("order", ORDERS)
def test_loader_over_a_file_set_reads_the_merged_records_in_the_concatenated_order(members, tmp_path, order,
                                                                                  drop_last):
    merged = tmp_path / "merged.pageset"
    merge_datasets(merged, members, progress=False, lineage=False)
    sizes = [s for p in members for s in model_layout(p)[0]]  # the reference model's page layouts, concatenated
    ref = model.FileOrder(sizes, 5, order, 2, drop_last, 16)
    assert model_layout(merged)[0] != sizes  # merge re-packs the pages: only ids and bytes are the set's
    with open_dataset(merged) as ds:
        records = [(int(ds[i]["label"]), bytes(ds[i]["payload"])) for i in range(len(ds))]
    assert len(records) == ref.n == 230 + 41 + 150
    fs = FileSet(members, "ef" * 32)
    loaders = [Loader(fs, batch_size=8, rank=r, world_size=2, order=order, seed=5, window_pages=2,
                      drop_last=drop_last, num_threads=2, array_type="numpy") for r in range(2)]
    try:
        assert loaders[0].epoch_length == ref.length and loaders[0].dataset_id == "ef" * 32
        for epoch in range(2):
            got, index, padding = [], [], []
            for b0, b1 in zip(*loaders):
                for b in (b0, b1):  # the all-gather, in rank order
                    assert "_source" not in b
                    got += _rows(b)
                    index += b["_index"].tolist()
                    padding += b["_is_padding"].tolist()
            want = ref.global_stream(epoch, 0, ref.steps)
            assert index == [i for i, _ in want] and padding == [p for _, p in want], epoch
            assert got == [records[i] for i, _ in want], epoch
        st = loaders[0].state_dict()  # (zip ran its iterator to the end: the epoch counter moved on)
        assert st == model.state_dict("ef" * 32, 5, 2, 0, 16, order, 2, drop_last)
    finally:
        for ld in loaders:
            ld.close()
    with Loader(merged, batch_size=16, order=order, seed=5, window_pages=2, drop_last=drop_last) as one:
        with pytest.raises(StateMismatchError, match="dataset_id"):
            one.load_state_dict(st)  # the merged file is another dataset


@pytest.mark.parametrize("order", ["random", "quasi_random"])
def test_file_set_resume_contract(members, order):
    sizes = [s for p in members for s in model_layout(p)[0]]
    ref = model.FileOrder(sizes, 3, order, 2, True, 12)
    fs = FileSet(members, "12" * 32, member_ids=[model_layout(p)[1] for p in members])

    def make(rank, world_size, batch_size, threads):
        return Loader(fs, batch_size=batch_size, rank=rank, world_size=world_size, order=order, seed=3,
                      window_pages=2, num_threads=threads, page_cache="process", verify_pages=True)

    check_resume(make, 12, [1, 2, 3], [1, ref.steps, ref.steps + 4],
                 expected=lambda n: [(0, i) for i, _ in ref.global_stream(0, 0, n // 12)])


def test_file_set_of_token_files_reads_each_members_windows(tmp_path):
    from pageset import TokenWindows, write_tokens

    docs = [np.arange(k * 10000, k * 10000 + n, dtype=np.uint16) for k, n in enumerate([3000, 970, 2110])]
    paths = []
    for k, doc in enumerate(docs):
        paths.append(tmp_path / f"t{k}.pageset")
        write_tokens(paths[-1], [doc], eos_id=60001, num_workers=0, page_size=4096, progress=False)
    streams = [np.append(doc, np.uint16(60001)) for doc in docs]  # each document then its EOS
    seq = 16
    counts = [(len(s) - 1) // seq for s in streams]
    starts = np.cumsum([0] + counts)
    sizes = [s for p in paths for s in model_layout(p, seq_len=seq)[0]]
    ref = model.FileOrder(sizes, 1, "quasi_random", 2, False, 8)
    with Loader(FileSet(paths, "34" * 32), batch_size=8, order="quasi_random", seed=1, window_pages=2,
                drop_last=False, pipelines={"tokens": [TokenWindows(seq)]}, array_type="numpy") as ld:
        batches = list(ld)
        assert ld.state_dict()["seq_len"] == seq
    got = np.concatenate([b["input"] for b in batches])
    want = []
    for gid, _ in ref.global_stream(0, 0, ref.steps):
        k = int(np.searchsorted(starts, gid, side="right")) - 1
        local = gid - starts[k]
        want.append(streams[k][local * seq : local * seq + seq])
    np.testing.assert_array_equal(got, np.array(want))


# --- a fifth kind plugs in without touching the Loader -------------------------------------------------------


class _Alternate(PlanSpec):
    """Two files, rows alternating a[0], b[0], a[1], b[1], ... (n = 2 * min), sequential, no padding."""

    optional_fields = False

    def __init__(self, a, b):
        self._paths = (a, b)

    @property
    def paths(self):
        return self._paths

    def plan(self, members, params):
        return _AlternatePlan(members, params)


class _AlternateEpoch(PlanEpoch):
    def batch(self, start, stop):
        p = np.arange(start, stop, dtype=np.int64)
        return PlanBatch((p % 2).astype(np.int16), p // 2, np.zeros(stop - start, dtype=bool), p)

    def file_ids(self, k, start, stop):
        return np.arange(start, stop, dtype=np.int64)[np.arange(start, stop) % 2 == k] // 2


class _AlternatePlan(Plan):
    hands_sources = True

    def __init__(self, members, params):
        super().__init__(params)
        self.path, self.dataset_id = "alternate", "alt"
        self.n_records = 2 * min(m.n_records for m in members)
        self.epoch_length = self._epoch_length()

    def epoch(self, epoch, shift=0):
        return _AlternateEpoch()

    def state(self, epoch, cursor, shift=0):
        return {"alternate": [epoch, cursor]}

    def resume(self, state, world_size):
        return (*state["alternate"], 0)


def test_a_new_kind_of_plan_needs_no_change_to_the_loader(members):
    with Loader(_Alternate(members[1], members[0]), batch_size=6, num_threads=2, array_type="numpy") as ld:
        assert (ld.path, ld.dataset_id, ld.n_records, len(ld)) == ("alternate", "alt", 82, 13)
        first = list(itertools.islice(ld, 3))
        assert ld.state_dict() == {"alternate": [0, 18]}
        rows = [r for b in first for r in _rows(b)]
        assert rows == [(t * 1000 + i, bytes([t, i]) * (i % 30 + 1)) for i in range(9) for t in (2, 1)]
        assert first[0]["_source"].tolist() == [0, 1] * 3 and first[1]["_index"].tolist() == list(range(6, 12))
        ld.load_state_dict({"alternate": [0, 72]})
        assert [b["_index"].tolist() for b in ld] == [list(range(72, 78))]  # L = 78: the last step
