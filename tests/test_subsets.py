"""Loader(indices=...): subsets and splits of one file behave like a file of their own (order v1, resume)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from resume_contract import check_resume, file_expectation

from pageset import (
    Bytes,
    Int,
    Loader,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RGBImage,
    TokenWindows,
    ToTensor,
    open_dataset,
    write_dataset,
    write_tokens,
)
from pageset.order import EpochOrder, StateMismatchError
from pageset.order.subset import SubsetLayout, as_indices, subset_digest

N = 600


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    """600 records (label = record id, a payload of 20-300 bytes) on 4 KiB pages: ~25 records per page."""
    rng = np.random.default_rng(3)
    records = [(i, bytes(rng.integers(0, 256, size=int(rng.integers(20, 300)), dtype=np.uint8)))
               for i in range(N)]
    path = tmp_path_factory.mktemp("subset") / "small.pageset"
    write_dataset(path, records, {"label": Int(), "payload": Bytes()}, num_workers=0, page_size=4096,
                  progress=False)
    return path


@pytest.fixture(scope="module")
def record_pages(small_file):
    with open_dataset(small_file) as ds:
        return ds.record_pages().astype(np.int64)


def _stream(loader):
    """(record ids, labels, padding) of one epoch."""
    ids, labels, pad = [], [], []
    for b in loader:
        ids += b["_index"].tolist()
        labels += np.asarray(b["label"]).tolist()
        pad += b["_is_padding"].tolist()
    return np.array(ids), np.array(labels), np.array(pad)


@pytest.mark.parametrize("order", ["random", "quasi_random", "sequential"])
def test_split_90_10_is_disjoint_and_complete(small_file, order):
    perm = np.random.default_rng(11).permutation(N)
    train, val = perm[: N * 9 // 10], perm[N * 9 // 10 :]
    with Loader(small_file, batch_size=32, order=order, seed=5, drop_last=False, num_threads=2,
                indices=train, window_pages=2) as tl, \
            Loader(small_file, batch_size=16, order="sequential", drop_last=False, num_threads=2,
                   indices=val) as vl:
        assert tl.n_records == train.size and len(tl) == -(-train.size // 32)
        t_ids, t_labels, t_pad = _stream(tl)
        v_ids, v_labels, v_pad = _stream(vl)
    np.testing.assert_array_equal(t_labels, t_ids)  # the data is the record's, not another's
    np.testing.assert_array_equal(v_labels, v_ids)
    t_real, v_real = t_ids[~t_pad], v_ids[~v_pad]
    assert sorted(t_real.tolist()) == sorted(train.tolist())  # each member exactly once
    np.testing.assert_array_equal(v_real, val)  # sequential follows the given order
    assert not set(t_real.tolist()) & set(v_real.tolist())
    assert sorted(t_real.tolist() + v_real.tolist()) == list(range(N))
    assert set(t_ids[t_pad].tolist()) <= set(train.tolist())  # padding wraps inside the subset


def test_repeats_and_any_order(small_file):
    idx = [5, 5, 599, 0, 5, 17]
    with Loader(small_file, batch_size=3, order="sequential", indices=idx, num_threads=1) as ld:
        ids, labels, _ = _stream(ld)
    assert ids.tolist() == idx and labels.tolist() == idx
    with Loader(small_file, batch_size=2, order="random", seed=1, indices=idx, num_threads=2) as ld:
        ids, _, _ = _stream(ld)
    assert sorted(ids.tolist()) == sorted(idx)


def test_quasi_random_subset_reads_stay_page_local(small_file, record_pages):
    """Every window of M virtual pages reads at most M file pages; with M = 1 each file page is read in one
    contiguous run of the stream (it is never revisited within the epoch)."""
    sub = np.flatnonzero(np.random.default_rng(2).random(N) < 0.3)[::-1].copy()  # ~30%, reversed order
    for m in (1, 3):
        with Loader(small_file, batch_size=8, order="quasi_random", seed=9, window_pages=m, drop_last=False,
                    indices=sub, num_threads=2) as ld:
            ids, _, pad = _stream(ld)
        ids = ids[~pad]
        pages = record_pages[ids]
        layout = SubsetLayout(np.bincount(record_pages), sub, "quasi_random")
        starts = EpochOrder(layout.page_sizes, 9, 0, "quasi_random", m).window_starts
        assert starts[-1] == sub.size
        for w in range(starts.size - 1):
            assert np.unique(pages[starts[w] : starts[w + 1]]).size <= m
        if m == 1:
            runs = 1 + np.count_nonzero(np.diff(pages))
            assert runs == np.unique(pages).size


def test_state_refuses_another_subset(small_file):
    a, b = list(range(0, 300)), list(range(1, 301))
    with Loader(small_file, batch_size=10, indices=a, num_threads=1) as ld:
        it = iter(ld)
        next(it), next(it)
        state = json.loads(json.dumps(ld.state_dict()))
    assert state["subset"] == subset_digest(np.array(a)) and state["cursor"] == 20
    swapped = a[:5] + [a[6], a[5]] + a[7:]  # the same ids, two of them swapped; and the same ids reversed
    for other_ids in (b, swapped, a[::-1]):
        with Loader(small_file, batch_size=10, indices=other_ids, num_threads=1) as other:
            with pytest.raises(StateMismatchError, match="subset"):
                other.load_state_dict(state)
    with Loader(small_file, batch_size=10, num_threads=1) as whole:
        with pytest.raises(StateMismatchError, match="subset"):
            whole.load_state_dict(state)
        whole_state = whole.state_dict()
    assert "subset" not in whole_state  # whole-file states keep their layout
    with Loader(small_file, batch_size=10, indices=a, num_threads=1) as same:
        with pytest.raises(StateMismatchError, match="subset"):
            same.load_state_dict(whole_state)
        same.load_state_dict(state)
        assert same.steps_remaining == 30 - 2 and len(same) == 30


@pytest.mark.parametrize(("bad", "exc", "match"), [
    ([0, 1, 2, N, 4], ValueError, r"indices\[3\] = 600 is outside \[0, 600\)"),
    ([0, -1], ValueError, r"indices\[1\] = -1 is outside"),
    ([0, 1.5, 2], TypeError, r"indices\[1\] = 1.5 is not an integer"),
    ([0, 1, "2"], TypeError, r"indices\[2\] = '2' is not an integer"),
    (np.array([0.0, 1.0]), TypeError, r"indices\[0\] = 0.0 is not an integer"),
    (np.zeros(N, dtype=bool), TypeError, "boolean mask"),
    ([], ValueError, "empty"),
    ([[0, 1]], ValueError, "1-D"),
    (7, TypeError, "sequence of record ids"),
    (np.array([0, 2**63 + 5], dtype=np.uint64), ValueError, r"indices\[1\] = 9223372036854775813"),
])
def test_bad_indices_name_the_first_bad_position(small_file, bad, exc, match):
    with pytest.raises(exc, match=match) as info:
        Loader(small_file, batch_size=1, indices=bad, num_threads=1)
    assert str(small_file) in str(info.value)


def test_as_indices_accepts_ranges_and_integer_types():
    np.testing.assert_array_equal(as_indices(range(3, 9, 2), 10), [3, 5, 7])
    np.testing.assert_array_equal(as_indices([np.int32(4), 2, np.uint8(1)], 5), [4, 2, 1])
    assert as_indices(np.array([1, 2], dtype=np.uint16), 3).dtype == np.int64


@pytest.fixture(scope="module")
def images(tmp_path_factory, imagenet_like):
    path = tmp_path_factory.mktemp("subset") / "img.pageset"
    write_dataset(path, imagenet_like, {"image": RGBImage(max_resolution=80), "label": Int()}, num_workers=0,
                  page_size=1 << 14, progress=False)
    return path


@pytest.mark.parametrize("order", ["random", "quasi_random"])
def test_resume_contract_on_a_subset(images, order):
    idx = [int(i) for i in np.random.default_rng(4).permutation(48)[:37]] + [3, 3]  # unsorted, with repeats

    def make(rank, world, batch, threads):
        return Loader(images, batch_size=batch, rank=rank, world_size=world, num_threads=threads, order=order,
                      seed=17, window_pages=2, drop_last=False, indices=idx,
                      pipelines={"image": [RandomResizedCrop(24), RandomHorizontalFlip(), Normalize(), ToTensor()]})

    check_resume(make, global_batch=8, world_sizes=[1, 2, 4], cuts=[0, 3, 5, 9],
                 expected=file_expectation(images, order, 17, 2, False, 8, indices=idx))


def test_token_windows_subset(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=int(rng.integers(1, 90))) for _ in range(200)]
    path = tmp_path / "tok.pageset"
    write_tokens(path, docs, eos_id=1000, num_workers=0, page_size=4096, progress=False)
    stream = np.concatenate([np.append(d, 1000) for d in docs])
    idx = np.arange(0, 150, 3)
    with Loader(path, batch_size=5, order="quasi_random", seed=1, indices=idx, num_threads=2,
                pipelines={"tokens": [TokenWindows(32)]}) as ld:
        seen = []
        for b in ld:
            for w, inp in zip(b["_index"], b["input"]):
                np.testing.assert_array_equal(inp, stream[w * 32 : w * 32 + 32])
                seen.append(int(w))
    assert sorted(seen) == idx.tolist()


# ---- the subset functions on their own (issue 18: every mutant of order/subset.py killed or listed) ----------------
# Messages are compared whole (hand-written here), the layout against a plain-Python grouping of the ids by page.

@pytest.mark.parametrize(("bad", "exc", "message"), [
    ({1, 2}, TypeError, "indices is a set: sets are unordered, and the order of the ids is the order of the subset; "
                        "pass a list or 1-D integer array of record ids (e.g. sorted(...))"),
    (frozenset([1]), TypeError, "indices is a frozenset: sets are unordered, and the order of the ids is the order "
                                "of the subset; pass a list or 1-D integer array of record ids (e.g. sorted(...))"),
    ("012", TypeError, "indices must be a sequence of record ids (a list, range or 1-D integer array), got str"),
    (b"\x00", TypeError, "indices must be a sequence of record ids (a list, range or 1-D integer array), got bytes"),
    (np.zeros((2, 2), dtype=np.int64), ValueError, "indices must be 1-D (record ids), got shape (2, 2)"),
    (np.zeros(0, dtype=np.int64), ValueError, "indices is empty: a subset needs at least one record id"),
    ([True, False], TypeError, "indices is a boolean mask; pass record ids instead, e.g. numpy.flatnonzero(mask)"),
    ([1, "2"], TypeError, "indices[1] = '2' is not an integer record id (str); pass integer ids in [0, 10)"),
    ([1, True], TypeError, "indices[1] = True is not an integer record id (bool); pass integer ids in [0, 10)"),
    ((3, np.True_), TypeError, "indices[1] = True is not an integer record id (bool); pass integer ids in [0, 10)"),
    ([1, 2.0], TypeError, "indices[1] = 2.0 is not an integer record id (float); pass integer ids in [0, 10)"),
    ([1, 2**70], ValueError, f"indices[1] = {2**70} is outside [0, 10) (the file has 10 records)"),
    ([3, -1, 11], ValueError, "indices[1] = -1 is outside [0, 10) (the file has 10 records)"),
    (np.array([0, 10, 2**63 + 5], dtype=np.uint64), ValueError,
     "indices[1] = 10 is outside [0, 10) (the file has 10 records)"),
    (np.array([0, 2**63 + 5, 10], dtype=np.uint64), ValueError,
     f"indices[1] = {2**63 + 5} is outside [0, 10) (the file has 10 records)"),
    (np.array([0, 9, 12], dtype=np.uint16), ValueError, "indices[2] = 12 is outside [0, 10) (the file has 10 records)"),
    # Python ints (object arrays, huge values): the first bad position, 0 and n - 1 allowed
    (np.array([0, 9, 10, 2**70], dtype=object), ValueError,
     "indices[2] = 10 is outside [0, 10) (the file has 10 records)"),
    (np.array([0, 9, -2, 2**70], dtype=object), ValueError,
     "indices[2] = -2 is outside [0, 10) (the file has 10 records)"),
    ([1, 2**63 + 5], ValueError,  # numpy makes this list float64: the message still shows the exact id
     f"indices[1] = {2**63 + 5} is outside [0, 10) (the file has 10 records)"),
])
def test_as_indices_messages_in_full(bad, exc, message):
    with pytest.raises(exc) as info:
        as_indices(bad, 10)
    assert str(info.value) == message


def test_as_indices_names_the_argument_and_the_unit():
    with pytest.raises(ValueError) as info:
        as_indices([0, 7], 5, what="split", unit="window")
    assert str(info.value) == "split[1] = 7 is outside [0, 5) (the file has 5 windows)"
    with pytest.raises(TypeError) as info:
        as_indices([0, 0.5], 5, what="split", unit="window")
    assert str(info.value) == "split[1] = 0.5 is not an integer window id (float); pass integer ids in [0, 5)"


@pytest.mark.parametrize("given", [[9, 0, 4], np.array([9, 0, 4], dtype=np.uint64), [np.int8(9), 0, np.uint32(4)],
                                   np.array([9, 0, 4], dtype=np.int32)[::1], np.array([9, 9, 0, 0, 4, 4])[::2],
                                   np.array([9, 0, 4], dtype=object), [np.int64(9), 0, 4]])
def test_as_indices_returns_contiguous_int64(given):
    got = as_indices(given, 10)
    assert got.dtype == np.int64 and got.flags.c_contiguous and got.tolist() == [9, 0, 4]


def test_subset_digest_is_length_and_sha256_of_little_endian_int64():
    import hashlib
    import struct

    ids = [5, 0, 2**40, 5]
    want = "4:" + hashlib.sha256(struct.pack("<4q", *ids)).hexdigest()[:32]
    assert subset_digest(np.array(ids, dtype=np.int64)) == want
    assert subset_digest(np.array(ids, dtype=">i8")) == want  # byte order of the input does not matter


def test_subset_layout_groups_by_file_page_keeping_the_given_order():
    """Pages of 3, 1, 4 and 2 records (ids 0-2 | 3 | 4-7 | 8-9); the subset skips page 1 except one id, repeats ids
    and lists pages out of order. Expected by hand: members grouped by page (stable), one virtual page each."""
    sizes = [3, 1, 4, 2]
    ids = np.array([9, 4, 0, 3, 7, 2, 4, 8, 0], dtype=np.int64)
    q = SubsetLayout(sizes, ids, "quasi_random")
    assert q.page_sizes.tolist() == [3, 1, 3, 2] and q.page_sizes.dtype == np.int64
    assert q.members.tolist() == [0, 2, 0, 3, 4, 7, 4, 9, 8]
    assert q.n_records == 9 and q.digest == subset_digest(ids) and not q.members.flags.writeable
    assert SubsetLayout(sizes, ids.astype(np.int32), "random").members.dtype == np.int64
    for order in ("sequential", "random"):
        lay = SubsetLayout(sizes, ids, order)
        assert lay.page_sizes.tolist() == [9] and lay.members.tolist() == ids.tolist()
        assert not lay.members.flags.writeable
    ids[0] = 1  # the layout keeps its own copy
    assert q.members.tolist()[-2:] == [9, 8] and lay.members[0] == 9
    with pytest.raises(ValueError) as info:
        SubsetLayout(sizes, ids, "shuffled")
    assert str(info.value) == "order must be one of ('sequential', 'random', 'quasi_random'), got 'shuffled'"


def test_subset_layout_grouping_is_stable_on_long_runs():
    """600 ids on 24 pages of 25, given in reverse: each page's members keep the given (descending) order. A
    non-stable sort of the page numbers reorders them (numpy's default quicksort does, past 16 elements)."""
    sizes = [25] * 24
    ids = np.arange(599, -1, -1, dtype=np.int64)
    rng = np.random.default_rng(7)
    ids = np.concatenate([ids, rng.integers(0, 600, 300)])
    page_of = {int(i): int(i) // 25 for i in ids}
    want = sorted(ids.tolist(), key=lambda i: page_of[i])  # Python's sort is stable
    lay = SubsetLayout(sizes, ids, "quasi_random")
    assert lay.members.tolist() == want
    assert lay.page_sizes.tolist() == [sum(1 for i in ids if i // 25 == p) for p in range(24)]


def test_subset_order_maps_virtual_positions_through_the_members():
    sizes = [3, 1, 4, 2]
    ids = np.array([9, 4, 0, 3, 7, 2, 4, 8, 0], dtype=np.int64)
    for order in ("sequential", "random", "quasi_random"):
        lay = SubsetLayout(sizes, ids, order)
        o = lay.epoch_order(seed=5, epoch=2, order=order)
        ref = EpochOrder(lay.page_sizes, 5, 2, order, 1)
        assert o.n_records == 9
        assert o.ids(0, 12).tolist() == lay.members[ref.ids(0, 12)].tolist()
    assert SubsetLayout(sizes, ids, "sequential").epoch_order(0, 0, "sequential").ids(0, 9).tolist() == ids.tolist()
