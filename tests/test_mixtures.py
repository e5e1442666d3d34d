"""Mixture: a deterministic weighted schedule (proportions within one sample), per-source epochs, exact and
elastic resume, images and tokens, in-process and with real processes killed by SIGKILL."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from resources import Resources
from resume_contract import batch_digest, check_resume, model_layout

from pageset import (
    JSON,
    Bytes,
    Float,
    Int,
    Loader,
    Mixture,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RGBImage,
    TokenWindows,
    ToTensor,
    ToTorchImage,
    write_dataset,
    write_tokens,
)
from pageset.order import EpochOrder, StateError, StateMismatchError
from pageset.order.mixture import MixtureOrder, MixtureSchedule, quotas, source_seed

# --- the schedule: pure functions -------------------------------------------------------------------------


def _counts(sources, n_sources):
    """int64[n + 1, S]: samples of each source among the first n positions."""
    onehot = np.zeros((sources.shape[0], n_sources), dtype=np.int64)
    onehot[np.arange(sources.shape[0]), sources] = 1
    return np.vstack([np.zeros((1, n_sources), dtype=np.int64), np.cumsum(onehot, axis=0)])


@pytest.mark.parametrize("weights", [[0.999, 0.001], [0.5, 0.3, 0.2], [0.7, 0.2, 0.1]])
def test_proportions_within_one_sample_over_every_window(weights):
    sched = MixtureSchedule(quotas(weights))
    p = np.array(sched.quotas) / sched.period
    n = 3 * sched.period + 17
    c = _counts(sched.sources(0, n).astype(np.int64), len(weights))
    # every prefix: |count_i(n) - n * p_i| <= 1 - 1/(2S - 2) < 1
    bound = 1 - 1 / (2 * len(weights) - 2)
    assert np.abs(c - np.arange(n + 1)[:, None] * p).max() <= bound + 1e-12
    # every window of every length (a global step of any size G): within 1 sample of its target
    for length in range(1, min(n, 1200)):
        window = c[length:] - c[:-length]
        assert np.abs(window - length * p).max() <= 1 + 1e-9, length


def test_prefix_bound_for_random_weights():
    rng = np.random.default_rng(0)
    for _ in range(300):
        q = [int(x) for x in rng.integers(0, 40, size=int(rng.integers(2, 8)))]
        if sum(q) == 0:
            continue
        sched = MixtureSchedule(q)
        s = sum(1 for x in q if x)
        p = np.array(q) / sched.period
        c = _counts(sched.sources(0, 2 * sched.period).astype(np.int64), len(q))
        dev = np.abs(c - np.arange(c.shape[0])[:, None] * p)
        assert dev.max() <= (1 - 1 / (2 * s - 2) if s > 1 else 0) + 1e-9, q
        assert (c[sched.period] == q).all()  # one period holds exactly the quotas: the schedule repeats


def test_counts_in_closed_form_equal_a_replay():
    sched = MixtureSchedule(quotas([0.6, 0.25, 0.15]))
    n = 5 * sched.period + 3
    c = _counts(sched.sources(0, n).astype(np.int64), 3)
    for g in [0, 1, 7, sched.period, sched.period + 1, 3 * sched.period - 1, n]:
        np.testing.assert_array_equal(sched.counts(g), c[g])
    src, k = sched.lookup(11, 11 + 40)
    for j in range(40):
        assert k[j] == c[11 + j, src[j]]


def test_golden_vectors():
    """Pinned outputs of mixture_algo 1: any change to the schedule, the source seeds or the lookup shows up."""
    assert MixtureSchedule((5, 3, 2)).slots.tolist() == [0, 1, 0, 2, 0, 1, 0, 2, 1, 0]
    assert MixtureSchedule((7, 2, 1)).slots.tolist() == [0, 0, 1, 0, 0, 2, 0, 0, 1, 0]
    assert int(np.flatnonzero(MixtureSchedule((999, 1)).slots == 1)[0]) == 500
    assert source_seed(7, 0) == 1376248881940584641 and source_seed(7, 1) == 17112811334948500749
    order = MixtureOrder(MixtureSchedule((5, 3, 2)), [[3, 4, 5], [2, 2], [1, 1, 1]], 7, "quasi_random", 2)
    sources, ids = order.lookup(0, 24)
    assert sources.tolist() == [0, 1, 0, 2, 0, 1, 0, 2, 1, 0, 0, 1, 0, 2, 0, 1, 0, 2, 1, 0, 0, 1, 0, 2]
    assert ids.tolist() == [6, 3, 5, 2, 1, 2, 4, 0, 0, 2, 3, 1, 0, 1, 8, 2, 10, 0, 3, 7, 9, 1, 11, 1]
    assert order.cursors(24) == [(1, 0), (1, 3), (1, 2)]  # 12 of 12, 7 of 4, 5 of 3 records taken


def _lookup_reference(order, seed, start, stop):
    """(sources, ids) of global positions [start, stop) from the schedule's closed-form counts and each source's
    EpochOrder, one position at a time (no window cache)."""
    src, k = order.schedule.lookup(start, stop)
    ids = []
    for s, kj in zip(src.tolist(), k.tolist()):
        n = order.n_records[s]
        ep = EpochOrder(order.page_sizes[s], source_seed(seed, s), kj // n, order.order,
                        order.window_pages[s])
        ids.append(int(ep.ids(kj % n, kj % n + 1)[0]))
    return src, np.array(ids, dtype=np.int64)


@pytest.mark.parametrize("order_name", ["quasi_random", "random", "sequential"])
def test_lookup_kernel_equals_per_position_orders(order_name):
    """MixtureOrder.lookup (one kernel call over cached windows) gives each position the id of its source's own
    order: tiny sources wrapping several times in one call, a zero weight, jumps back and forth between far
    positions (both window slots of a source in use, then replaced), and a window slot that must grow."""
    pages = [[3, 4, 5, 2, 6], [2, 2], [1], [4, 4]]
    order = MixtureOrder(MixtureSchedule((5, 3, 1, 0)), pages, 7, order_name, 2)
    ranges = [(0, 40), (40, 41), (41, 97), (500, 530), (97, 130), (0, 40), (1000, 1003), (131, 132), (2, 9)]
    for start, stop in ranges:
        src, ids = order.lookup(start, stop)
        assert src.dtype == np.int16 and ids.dtype == np.int64 and src.shape == ids.shape == (stop - start,)
        want_src, want_ids = _lookup_reference(order, 7, start, stop)
        np.testing.assert_array_equal(src, want_src)
        np.testing.assert_array_equal(ids, want_ids)
    assert (order.lookup(0, 200)[0] != 3).all()  # weight 0: never scheduled
    order._capacity[:] = order._windows[2]  # no room to spare: larger windows grow the buffer, the others stay
    for start, stop in [(300, 340), (0, 40), (301, 305), (2000, 2100)]:
        np.testing.assert_array_equal(order.lookup(start, stop)[1], _lookup_reference(order, 7, start, stop)[1])


def test_epoch_batches_looked_up_ahead_equal_lookup():
    """MixtureEpoch.batch (ranges looked up several batches ahead, handed out as slices) gives lookup's ids for
    consecutive batches, a rank's strided batches, jumps back, the epoch's last batch, and a kept batch that
    the caller writes to does not change the next one."""
    order = MixtureOrder(MixtureSchedule((5, 3, 2)), [[30, 40, 50], [20, 20], [10, 10, 10]], 3, "quasi_random", 2)
    epoch = order.epoch(2, 200)
    ref = order.epoch(2, 200)
    kept = []
    for start, stop in [(0, 8), (8, 16), (16, 24), (40, 48), (56, 64), (8, 16), (192, 200), (100, 130), (130, 131)]:
        src, ids = epoch.batch(start, stop)
        want_src, want_ids = ref.lookup(start, stop)
        np.testing.assert_array_equal(src, want_src)
        np.testing.assert_array_equal(ids, want_ids)
        kept.append(ids)
        ids[:] = -1  # the caller's own batch: the next batches are unaffected
    assert all((k == -1).all() for k in kept)
    assert epoch._ahead[2] == 200  # looked up ahead up to the epoch's end, not past it


def test_quotas_resolve_weights():
    assert quotas([0.5, 0.3, 0.2]) == (5, 3, 2)
    assert quotas([0.999, 0.001]) == (999, 1)
    assert quotas([1 / 3, 1 / 3, 1 / 3]) == (1, 1, 1)
    assert quotas([6, 2, 0]) == (3, 1, 0)
    q = quotas([math.pi, math.e, 1.0])
    assert sum(q) == 10**6 and abs(q[0] / 10**6 - math.pi / (math.pi + math.e + 1)) < 1e-6


@pytest.mark.parametrize(("weights", "exc", "match"), [
    ([1.0, -0.5], ValueError, r"weights\[1\] = -0.5 is negative"),
    ([0, 0.0], ValueError, "all weights are zero"),
    ([1.0, float("nan")], ValueError, r"weights\[1\] = nan is not finite"),
    ([float("inf"), 1.0], ValueError, r"weights\[0\] = inf is not finite"),
    ([1.0], ValueError, "1 weights for 2 sources"),
    ([1.0, 2.0, 3.0], ValueError, "3 weights for 2 sources"),
    ([1.0, "2"], TypeError, r"weights\[1\] = '2' is not a number"),
    ([1.0, 1e-9], ValueError, r"weights\[1\] = 1e-09 is below"),
    (0.5, TypeError, "sequence of numbers"),
])
def test_bad_weights_are_refused(weights, exc, match):
    with pytest.raises(exc, match=match):
        Mixture(["a.pageset", "b.pageset"], weights)


def test_bad_mixture_arguments():
    with pytest.raises(TypeError, match="list of paths"):
        Mixture("a.pageset", [1.0])
    with pytest.raises(ValueError, match="empty"):
        Mixture([], [])
    with pytest.raises(ValueError, match="samples_per_epoch"):
        Mixture(["a.pageset"], [1.0], samples_per_epoch=0)


# --- the loader ----------------------------------------------------------------------------------------------


def _write(path, n, source, payload_kind=Bytes):
    """n records: label = record id + 1000 * source, a payload of 1..50 bytes."""
    records = [(i + 1000 * source, bytes([source]) * (i % 50 + 1)) for i in range(n)]
    write_dataset(path, records, {"label": Int(), "payload": payload_kind()}, num_workers=0, page_size=4096,
                  progress=False)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mix")
    return [_write(d / "a.pageset", 300, 0), _write(d / "b.pageset", 10, 1), _write(d / "c.pageset", 120, 2)]


def _run(loader, steps=None):
    out = {"src": [], "idx": [], "label": []}
    for b in itertools.islice(loader, steps):
        assert b["_source"].dtype == torch.int16 and not b["_is_padding"].any()
        out["src"] += b["_source"].tolist()
        out["idx"] += b["_index"].tolist()
        out["label"] += np.asarray(b["label"]).tolist()
    return {k: np.array(v) for k, v in out.items()}


@pytest.mark.parametrize("order", ["random", "quasi_random", "sequential"])
def test_loader_follows_the_schedule_and_reads_the_right_records(files, order):
    mix = Mixture(files, [0.5, 0.3, 0.2])
    with Loader(mix, batch_size=16, order=order, seed=4, num_threads=2, window_pages=2) as ld:
        assert ld.n_records == 430 and len(ld) == 430 // 16
        run = _run(ld)
        run2 = _run(ld)  # the next epoch continues the stream
    np.testing.assert_array_equal(run["label"], run["idx"] + 1000 * run["src"])  # the sample's own data
    sched = MixtureSchedule(quotas([0.5, 0.3, 0.2]))
    np.testing.assert_array_equal(run["src"], sched.sources(0, run["src"].size))
    np.testing.assert_array_equal(run2["src"], sched.sources(run["src"].size, 2 * run["src"].size))
    c = _counts(run["src"].astype(np.int64), 3)
    for step in range(run["src"].size // 16):  # every global step within one sample of its target
        got = c[(step + 1) * 16] - c[step * 16]
        assert np.abs(got - 16 * np.array([0.5, 0.3, 0.2])).max() <= 1


def test_tiny_source_with_a_large_weight_wraps_cleanly(files):
    """10 records at weight 0.9: its own epochs follow one another, each a full permutation of its 10 ids, never
    past its end; the large source is read without repeats inside its epoch."""
    mix = Mixture([files[0], files[1]], [0.1, 0.9], samples_per_epoch=200)
    with Loader(mix, batch_size=20, order="random", seed=1, num_threads=2) as ld:
        runs = [_run(ld) for _ in range(2)]
        state = ld.state_dict()
    src = np.concatenate([r["src"] for r in runs])
    idx = np.concatenate([r["idx"] for r in runs])
    tiny, big = idx[src == 1], idx[src == 0]
    assert tiny.size == 360 and big.size == 40
    blocks = tiny.reshape(-1, 10)
    assert all(sorted(b.tolist()) == list(range(10)) for b in blocks)  # 36 complete epochs of the tiny source
    assert len({tuple(b) for b in blocks}) > 30  # its own epoch counter reshuffles it
    assert np.unique(big).size == big.size  # the big source is still in its first epoch
    assert state["mixture"]["sources"][1] == {"dataset_id": state["mixture"]["sources"][1]["dataset_id"],
                                              "epoch": 36, "cursor": 0}
    assert (state["mixture"]["sources"][0]["epoch"], state["mixture"]["sources"][0]["cursor"]) == (0, 40)


def test_zero_weight_source_is_never_read(files):
    with Loader(Mixture(files, [1, 0, 1]), batch_size=10, seed=0, num_threads=1) as ld:
        run = _run(ld)
    assert set(run["src"].tolist()) == {0, 2}


def test_state_round_trip_and_refusals(files):
    mix = Mixture(files, [0.5, 0.3, 0.2])
    with Loader(mix, batch_size=8, seed=3, num_threads=2) as ld:
        first = _run(ld, steps=5)
        state = json.loads(json.dumps(ld.state_dict()))
        rest = _run(ld)
    counts = _counts(first["src"].astype(np.int64), 3)[-1]
    sizes = [300, 10, 120]
    assert [(s["epoch"], s["cursor"]) for s in state["mixture"]["sources"]] == [divmod(int(c), n) for c, n in
                                                                                 zip(counts, sizes)]
    with Loader(mix, batch_size=4, rank=1, world_size=2, seed=3, num_threads=1) as other:
        other.load_state_dict(state)
        assert other.steps_remaining == len(rest["src"]) // 8 and len(other) == 430 // 8
    with Loader(Mixture(files, [0.4, 0.4, 0.2]), batch_size=8, seed=3, num_threads=1) as ld:
        ld.load_state_dict(state)  # other weights: they take over at the saved position (formats/mixture.md 3.3)
        edited = ld.state_dict()["mixture"]
        assert edited["quotas"] == [2, 2, 1] and edited["edits"] == [40]
        assert edited["base"] == {"position": 40, "counts": [int(c) for c in counts]}
    with Loader(Mixture([files[0], files[2], files[1]], [0.5, 0.3, 0.2]), batch_size=8, seed=3,
                num_threads=1) as ld:
        with pytest.raises(StateMismatchError, match=r"mixture.sources\[1\].dataset_id"):
            ld.load_state_dict(state)
    with Loader(Mixture(files, [0.5, 0.3, 0.2], samples_per_epoch=100), batch_size=8, seed=3,
                num_threads=1) as ld:
        with pytest.raises(StateMismatchError, match="samples_per_epoch"):
            ld.load_state_dict(state)
    with Loader(mix, batch_size=8, seed=4, num_threads=1) as ld:
        with pytest.raises(StateMismatchError, match="seed"):
            ld.load_state_dict(state)
        whole = Loader(files[0], batch_size=8, num_threads=1)
        with whole, pytest.raises(StateMismatchError, match="mixture"):
            ld.load_state_dict(whole.state_dict())
        bad = json.loads(json.dumps(state))
        bad["mixture"]["sources"][0]["cursor"] += 1
        with pytest.raises(StateError, match="disagree with the schedule"):
            ld.load_state_dict(bad)


def test_schedule_takes_up_to_32767_sources():
    # a batch's "_source" is int16: 32767 sources is the most (formats/mixture.md); zero quotas keep it cheap
    sched = MixtureSchedule([1] + [0] * 32766)
    assert sched.period == 1 and sched.slots.tolist() == [0] and sched.n_sources == 32767
    with pytest.raises(ValueError, match=r"quotas must be 1 to 32767 ints >= 0"):
        MixtureSchedule([1] + [0] * 32767)


def test_resume_refusals_give_the_field_the_saved_and_the_current_value(files):
    # formats/mixture.md section 2.4: each refusal names the state field and both values ("saved state has
    # F=<saved>, this loader has F=<current>. <fix>"); the values here are hand-derived from the saved state
    mix = Mixture(files, [0.5, 0.3, 0.2])
    with Loader(mix, batch_size=8, seed=3, num_threads=1) as ld:
        _run(ld, steps=2)
        state = json.loads(json.dumps(ld.state_dict()))
    ids = [s["dataset_id"] for s in state["mixture"]["sources"]]

    def refused(loader_mix, bad, exc, message):
        with Loader(loader_mix, batch_size=8, seed=3, num_threads=1) as other:
            with pytest.raises(exc) as ei:
                other.load_state_dict(bad)
        assert str(ei.value) == message

    def edited(**mixture):
        return dict(state, mixture=dict(state["mixture"], **mixture))

    refused(Mixture(files[:2], [0.5, 0.3]), state, StateMismatchError,
            "state field 'mixture.sources': saved state has mixture.sources=3, this loader has mixture.sources=2. "
            "The mixture has another number of files: construct it with the saved sources. Removed: source 2 "
            f"(dataset_id {ids[2]}).")
    refused(Mixture([files[0], files[2], files[1]], [0.5, 0.3, 0.2]), state, StateMismatchError,
            f"state field 'mixture.sources[1].dataset_id': saved state has mixture.sources[1].dataset_id={ids[1]!r}, "
            f"this loader has mixture.sources[1].dataset_id={ids[2]!r}. Source 1 is another file: pass the saved "
            "files in the saved order.")
    refused(Mixture(files, [0.5, 0.3, 0.2], samples_per_epoch=100), state, StateMismatchError,
            "state field 'mixture.samples_per_epoch': saved state has mixture.samples_per_epoch=430, this loader "
            "has mixture.samples_per_epoch=100. Construct the Mixture with the saved samples_per_epoch.")
    refused(mix, edited(mixture_algo=2), StateError,
            "state field 'mixture.mixture_algo': unsupported value 2: this pageset implements mixture_algo 1; "
            "resume with the version that wrote the state")
    refused(mix, edited(sources=[state["mixture"]["sources"][0], "b", state["mixture"]["sources"][2]]),
            StateMismatchError,
            f"state field 'mixture.sources[1].dataset_id': saved state has mixture.sources[1].dataset_id='b', "
            f"this loader has mixture.sources[1].dataset_id={ids[1]!r}. Source 1 is another file: pass the saved "
            "files in the saved order.")
    refused(mix, {k: v for k, v in state.items() if k != "mixture"}, StateMismatchError,
            "state field 'mixture': saved state has mixture=None, this loader has mixture='a Mixture'. The state "
            "was saved by a loader on one file: resume it with a Loader on that file.")


def test_samples_per_epoch_sets_the_epoch(files):
    with Loader(Mixture(files, [1, 1, 1], samples_per_epoch=95), batch_size=10, drop_last=False,
                num_threads=1) as ld:
        assert ld.steps_per_epoch == 10 and len(_run(ld)["src"]) == 100  # rounded up, no padding flags
    with Loader(Mixture(files, [1, 1, 1], samples_per_epoch=95), batch_size=10, num_threads=1) as ld:
        assert ld.steps_per_epoch == 9


def test_drop_last_false_rounds_up_with_the_next_samples_of_the_stream(files):
    """A Mixture's stream has no end to wrap to: drop_last=False rounds the epoch up to whole global batches
    with the stream's next samples (real ones, none flagged as padding), and the next epoch continues after
    them, so nothing is repeated: two epochs of samples_per_epoch=23 read what two of 24 read."""
    kw = dict(batch_size=4, order="quasi_random", seed=1, num_threads=1)

    def two_epochs(loader):
        with loader:
            runs = [_run(loader) for _ in range(2)]  # _run asserts that no sample is flagged as padding
            return [np.concatenate([r[k] for r in runs]).tolist() for k in ("src", "idx")]

    rounded = Loader(Mixture(files, [0.5, 0.3, 0.2], samples_per_epoch=23), drop_last=False, **kw)
    assert len(rounded) == 6
    whole = Loader(Mixture(files, [0.5, 0.3, 0.2], samples_per_epoch=24), **kw)
    got, want = two_epochs(rounded), two_epochs(whole)
    assert len(got[0]) == 48 and got == want


def test_files_whose_fields_differ_are_refused(files, tmp_path):
    other = tmp_path / "float.pageset"
    write_dataset(other, [(float(i), b"x") for i in range(20)], {"label": Float(), "payload": Bytes()},
                  num_workers=0, progress=False)
    with pytest.raises(ValueError, match=rf"{other}: field 'label' is Float.*but {files[0]} has Int"):
        Loader(Mixture([files[0], other], [1, 1]), batch_size=4)
    fewer = tmp_path / "fewer.pageset"
    write_dataset(fewer, [(i,) for i in range(20)], {"label": Int()}, num_workers=0, progress=False)
    with pytest.raises(ValueError, match=rf"{fewer}: loads fields \['label'\], but .* loads \['label', 'payload'\]"):
        Loader(Mixture([files[0], fewer], [1, 1]), batch_size=4)
    with Loader(Mixture([files[0], fewer], [1, 1]), batch_size=4, pipelines={"payload": None}) as ld:
        assert set(next(iter(ld))) == {"label", "_index", "_is_padding", "_source"}
    with pytest.raises(ValueError, match="cannot be combined with a Mixture"):
        Loader(Mixture(files, [1, 1, 1]), batch_size=4, indices=[0, 1])


def test_a_missing_file_is_named_and_nothing_stays_open(files, tmp_path):
    missing = tmp_path / "missing.pageset"
    res = Resources() if os.path.isdir("/proc/self/fd") else None
    with pytest.raises(FileNotFoundError, match="missing.pageset"):
        Loader(Mixture([files[0], missing], [1, 1]), batch_size=4)
    if res is not None:
        assert res.new_fds() == []  # the first file was closed again
    empty_weight = Mixture([files[0], files[1]], [1, 0])
    with Loader(empty_weight, batch_size=4, num_threads=1) as ld:
        assert set(_run(ld)["src"].tolist()) == {0}


def test_bytes_of_different_widths_are_mixed(files, tmp_path):
    wide = tmp_path / "wide.pageset"
    write_dataset(wide, [(5000 + i, bytes([7]) * (100 + i)) for i in range(30)], {"label": Int(), "payload": Bytes()},
                  num_workers=0, progress=False)
    with Loader(Mixture([files[1], wide], [1, 1]), batch_size=8, num_threads=2, seed=2) as ld:
        for b in ld:
            data, lengths = b["payload"]
            assert data.shape[1] == 129
            for j in range(8):
                fill = 7 if b["_source"][j] == 1 else 1
                assert (data[j, : lengths[j]] == fill).all() and (data[j, lengths[j] :] == 0).all()


def test_json_fields_are_mixed(tmp_path):
    paths = []
    for k, n in enumerate([13, 29]):
        paths.append(tmp_path / f"j{k}.pageset")
        write_dataset(paths[-1], [({"source": k, "id": i, "pad": "x" * (i % 7)},) for i in range(n)],
                      {"meta": JSON()}, num_workers=0, progress=False)
    with Loader(Mixture(paths, [0.4, 0.6]), batch_size=7, seed=5, num_threads=2) as ld:
        for b in ld:
            assert [(m["source"], m["id"]) for m in b["meta"]] == list(zip(b["_source"].tolist(),
                                                                            b["_index"].tolist()))


# --- resume: the shared contract on images and tokens ------------------------------------------------------


@pytest.fixture(scope="module")
def image_files(tmp_path_factory, imagenet_like):
    d = tmp_path_factory.mktemp("miximg")
    out = []
    for k, (size, page) in enumerate([(80, 1 << 14), (64, 1 << 13)]):
        path = d / f"img{k}.pageset"
        write_dataset(path, imagenet_like, {"image": RGBImage(max_resolution=size), "label": Int()},
                      num_workers=0, page_size=page, progress=False)
        out.append(path)
    return out


@pytest.mark.parametrize("order", ["random", "quasi_random"])
def test_image_mixture_resume_contract(image_files, order):
    mix = Mixture(image_files, [0.7, 0.3], samples_per_epoch=60)

    def make(rank, world, batch, threads):
        return Loader(mix, batch_size=batch, rank=rank, world_size=world, num_threads=threads, order=order,
                      seed=17, window_pages=2,
                      pipelines={"image": [RandomResizedCrop(24), RandomHorizontalFlip(), Normalize(), ToTensor()]})

    check_resume(make, global_batch=8, world_sizes=[1, 2, 4], cuts=[0, 3, 7, 11])


def test_in_place_and_scatter_fills_agree(image_files, monkeypatch):
    """Scattered rows of one file are filled in place run by run (large rows) or through scratch buffers
    (small rows): both give the same batches."""
    import pageset.load.source as source_mod

    def digests():
        with Loader(Mixture(image_files, [0.5, 0.5]), batch_size=8, seed=2, num_threads=2,
                    pipelines={"image": [RandomResizedCrop(20), RandomHorizontalFlip(), Normalize(), ToTensor()]}) as ld:
            return [batch_digest(b) for b in ld]

    monkeypatch.setattr(source_mod, "IN_PLACE_ROW_BYTES", 0)
    in_place = digests()
    monkeypatch.setattr(source_mod, "IN_PLACE_ROW_BYTES", 1 << 60)
    assert digests() == in_place and len(in_place) == 96 // 8



def test_image_rows_written_in_place_equal_the_copied_rows(image_files, monkeypatch):
    """A mixture's scattered image rows are written by the slice kernel at their rows (``image_slice``'s rows
    argument); the same batches come out of the scratch-and-copy path (ImageStage.fills_rows off), uint8 and
    float32, NHWC and NCHW."""
    from pageset.load.stages import ImageStage

    def digests(pipe):
        with Loader(Mixture(image_files, [0.5, 0.5]), batch_size=8, seed=3, num_threads=2,
                    pipelines={"image": pipe}) as ld:
            return [batch_digest(b) for b in ld]

    for pipe in ([RandomResizedCrop(20), RandomHorizontalFlip(), ToTensor()],
                 [RandomResizedCrop(20), RandomHorizontalFlip(), Normalize(), ToTorchImage(channels_last=False)]):
        direct = digests(pipe)
        monkeypatch.setattr(ImageStage, "fills_rows", False)
        copied = digests(pipe)
        monkeypatch.setattr(ImageStage, "fills_rows", True)
        assert direct == copied and len(direct) == 96 // 8

@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixtok")
    out = []
    for k, n_docs in enumerate([300, 40]):
        rng = np.random.default_rng(10 + k)
        docs = [rng.integers(0, 1000, size=int(rng.integers(1, 90))) for _ in range(n_docs)]
        path = d / f"tok{k}.pageset"
        write_tokens(path, docs, eos_id=1000, num_workers=0, page_size=4096, progress=False)
        stream = np.concatenate([np.append(x, 1000) for x in docs])
        out.append((path, stream))
    return out


def test_token_mixture_windows_and_resume_contract(token_files):
    paths = [p for p, _ in token_files]
    mix = Mixture(paths, [0.25, 0.75])

    def make(rank, world, batch, threads):
        return Loader(mix, batch_size=batch, rank=rank, world_size=world, num_threads=threads, order="quasi_random",
                      seed=3, window_pages=3,
                      pipelines={"tokens": [TokenWindows(32, document_outputs=True), ToTensor()]})

    with make(0, 1, 12, 2) as ld:
        b = next(iter(ld))
        for j in range(12):
            stream = token_files[int(b["_source"][j])][1]
            w = int(b["_index"][j])
            np.testing.assert_array_equal(b["input"][j].numpy(), stream[w * 32 : w * 32 + 32])
            np.testing.assert_array_equal(b["target"][j].numpy(), stream[w * 32 + 1 : w * 32 + 33])
    check_resume(make, global_batch=12, world_sizes=[1, 3, 2], cuts=[0, 5, 17])


def _token_rows(path_streams, mix, **kw):
    """Every row of one epoch of a token mixture, checked against its own file's stream; the batches' digests."""
    digests = []
    with Loader(mix, batch_size=10, order="quasi_random", seed=5, window_pages=2, **kw) as ld:
        for b in ld:
            for j in range(10):
                stream = path_streams[int(b["_source"][j])][1]
                w, L = int(b["_index"][j]), b["input"].shape[1]
                np.testing.assert_array_equal(b["input"][j], stream[w * L : w * L + L])
                np.testing.assert_array_equal(b["target"][j], stream[w * L + 1 : w * L + L + 1])
            digests.append(batch_digest(b))
    return digests


def test_token_mixture_reads_agree_whatever_the_page_source(token_files, tmp_path):
    """Windows read one pread each in row order ("os"), gathered per file through the page cache or with
    page checks, or filled file by file (files of different token dtypes): the same rows, each from its file."""
    mix = Mixture([p for p, _ in token_files], [0.5, 0.5])
    pipe = {"tokens": [TokenWindows(24, document_outputs=True)]}
    for threads in (1, 3):
        direct = _token_rows(token_files, mix, pipelines=pipe, num_threads=threads)
        assert len(direct) > 10  # a whole epoch (the windows of both files)
        assert _token_rows(token_files, mix, pipelines=pipe, num_threads=threads, page_cache="process") == direct
        assert _token_rows(token_files, mix, pipelines=pipe, num_threads=threads, verify_pages=True) == direct
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, 100_000, size=int(rng.integers(1, 90))) for _ in range(60)]
    wide = tmp_path / "wide.pageset"
    write_tokens(wide, docs, eos_id=1000, dtype="uint32", num_workers=0, page_size=4096, progress=False)
    streams = [token_files[0], (wide, np.concatenate([np.append(x, 1000) for x in docs]))]
    for threads in (1, 2):
        _token_rows(streams, Mixture([token_files[0][0], wide], [0.5, 0.5]), num_threads=threads,
                    pipelines={"tokens": [TokenWindows(24)]})


def test_token_mixture_file_truncated_under_the_loader_is_named(token_files, tmp_path):
    import shutil

    from pageset import Dataset, TruncatedFileError

    live = tmp_path / "live.pageset"
    shutil.copyfile(token_files[1][0], live)
    with Dataset(live) as ds:  # a token file
        cut = ds.data_offset + 100
    with Loader(Mixture([token_files[0][0], live], [0.5, 0.5]), batch_size=4, num_threads=2, order="sequential",
                pipelines={"tokens": [TokenWindows(16)]}) as ld:
        it = iter(ld)
        next(it)
        os.truncate(live, cut)
        with pytest.raises(TruncatedFileError) as ei:
            for _ in range(10_000):  # bounded: a few epochs of these small files
                next(it)
    assert ei.value.path == str(live) and f"shrank to {cut} bytes" in str(ei.value)


def test_mixture_state_given_to_one_file_names_the_mixture(files):
    with Loader(Mixture(files, [0.5, 0.3, 0.2]), batch_size=8, seed=3, num_threads=1) as mixed:
        _run(mixed, steps=2)
        state = json.loads(json.dumps(mixed.state_dict()))
    for kw in ({}, {"indices": list(range(0, 300, 2))}):
        with Loader(files[0], batch_size=8, seed=3, num_threads=1, **kw) as one:
            with pytest.raises(StateMismatchError, match=r"saved by a Loader reading a Mixture") as ei:
                one.load_state_dict(state)
            assert ei.value.field == "mixture" and "a Mixture of 3 files" in str(ei.value)
            assert str(files[0]) in str(ei.value)
            assert one.state_dict()["cursor"] == 0 and len(one) == one.steps_per_epoch  # unchanged


def _resident(pages):
    """Pages a page_cache="process" cache holds now."""
    n = getattr(pages, "resident_pages", None)
    return n if n is not None else len(pages._pages)


def test_process_cache_budget_is_shared_by_the_files_of_a_mixture(files):
    """cache_pages bounds the whole loader: the files of a Mixture share it (memory does not grow with the
    number of files); the default is per file; a budget below one page per file is refused."""
    mix = Mixture(files, [0.5, 0.3, 0.2])
    kw = dict(batch_size=8, seed=3, num_threads=2, order="quasi_random", window_pages=2)
    with Loader(mix, **kw) as ld:
        expected = _run(ld)
    with Loader(mix, page_cache="process", cache_pages=5, **kw) as ld:
        # the budget 5 split 2/2/1, each capped at the file's own page count (a cache never holds more)
        assert [s.pages.capacity for s in ld._sources] == [min(c, max(s.ds.page_count, 1))
                                                          for c, s in zip([2, 2, 1], ld._sources)]
        peak = [0, 0, 0]
        got = {"src": [], "idx": [], "label": []}
        for b in ld:
            peak = [max(p, _resident(s.pages)) for p, s in zip(peak, ld._sources)]
            got["src"] += b["_source"].tolist()
            got["idx"] += b["_index"].tolist()
            got["label"] += np.asarray(b["label"]).tolist()
        assert all(0 < p <= s.pages.capacity for p, s in zip(peak, ld._sources)) and sum(peak) <= 5
    for k in expected:
        np.testing.assert_array_equal(np.array(got[k]), expected[k])
    with Loader(mix, page_cache="process", **kw) as ld:
        # the default is each file's own (a function of its records and pages), not a share of a budget
        assert [s.pages.capacity for s in ld._sources] == [
            min(ld._default_cache_pages(s.n_records, s.ds.page_count), max(s.ds.page_count, 1)) for s in ld._sources]
    with Loader(files[0], page_cache="process", cache_pages=5, **kw) as ld:
        assert ld._pages.capacity == min(5, ld._ds.page_count)
    with pytest.raises(ValueError, match=r"cache_pages=2 for a Mixture of 3 files.*cache_pages >= 3"):
        Loader(mix, page_cache="process", cache_pages=2, **kw)


# --- a real run: ranks in processes, SIGKILL with prefetch in flight, resume on another world size ----------

RUN_SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys, time
    from pageset import Loader, Mixture, RandomResizedCrop, RandomHorizontalFlip, Normalize, ToTensor
    paths, rank, world, batch, threads, state_in, log, save_at = sys.argv[1:9]
    rank, world, batch, threads, save_at = int(rank), int(world), int(batch), int(threads), int(save_at)
    pipe = {"image": [RandomResizedCrop(32), RandomHorizontalFlip(), Normalize(), ToTensor()]}
    loader = Loader(Mixture(json.loads(paths), [0.6, 0.4], samples_per_epoch=64), batch_size=batch, pipelines=pipe,
                    order="quasi_random", seed=21, window_pages=2, rank=rank, world_size=world, num_threads=threads,
                    batches_ahead=4)
    if state_in != "-":
        loader.load_state_dict(json.load(open(state_in)))
    with open(log, "a") as f:
        for step, b in enumerate(loader):
            for j, (s, rid) in enumerate(zip(b["_source"].tolist(), b["_index"].tolist())):
                h = hashlib.sha256(b["image"][j].numpy().tobytes()).hexdigest()[:16]
                f.write(f"{s} {rid} {h}\\n")
            f.flush()
            if step == save_at:
                json.dump(loader.state_dict(), open(log + ".state", "w"))
                time.sleep(1.0)  # let the prefetch queue fill up, then wait to be killed
                open(log + ".ready", "w").close()
                time.sleep(600)
    """
)


def _env():
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _read_log(path):
    return [tuple(line.split()) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_sigkill_mixture_then_resume_on_another_world_size(tmp_path, image_files):
    paths = json.dumps([str(p) for p in image_files])
    control_log = tmp_path / "control.log"
    subprocess.run([sys.executable, "-c", RUN_SCRIPT, paths, "0", "1", "8", "2", "-", str(control_log), "-1"],
                   check=True, env=_env(), timeout=300)
    control = _read_log(control_log)
    assert len(control) == 64 and {s for s, _, _ in control} == {"0", "1"}
    logs = [tmp_path / f"r{r}.log" for r in range(4)]
    procs = [subprocess.Popen([sys.executable, "-c", RUN_SCRIPT, paths, str(r), "4", "2", "1", "-", str(logs[r]),
                               "2"], env=_env(), start_new_session=True) for r in range(4)]
    try:
        deadline = time.monotonic() + 300
        while not all(os.path.exists(str(lg) + ".ready") for lg in logs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    states = [json.loads(open(str(lg) + ".state").read()) for lg in logs]
    assert all(s == states[0] for s in states) and states[0]["cursor"] == 24
    before = [_read_log(lg) for lg in logs]
    assert [x for s in range(3) for r in range(4) for x in before[r][2 * s : 2 * s + 2]] == control[:24]
    resumed_log = tmp_path / "resumed.log"
    subprocess.run([sys.executable, "-c", RUN_SCRIPT, paths, "0", "2", "4", "2", str(logs[0]) + ".state",
                    str(resumed_log) + "0", "-1"], check=True, env=_env(), timeout=300)
    subprocess.run([sys.executable, "-c", RUN_SCRIPT, paths, "1", "2", "4", "1", str(logs[0]) + ".state",
                    str(resumed_log) + "1", "-1"], check=True, env=_env(), timeout=300)
    rest = [_read_log(tmp_path / f"resumed.log{r}") for r in range(2)]
    merged = [x for s in range(5) for r in range(2) for x in rest[r][4 * s : 4 * s + 4]]
    assert merged == control[24:]  # same sources, ids and augmented pixels


@pytest.mark.parametrize("heading", ["### Subsets and splits", "### Mixing datasets", "### Schedules"])
def test_readme_examples_run(tmp_path, heading):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme[readme.index(heading):], re.S).group(1)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


# --- weight_unit="tokens" (formats/mixture.md 2.6) against the reference model, in every configuration -----

PACK_L = 16


@pytest.fixture(scope="module")
def packed_files(tmp_path_factory):
    """Three token files read as packed rows of 16 columns: A's documents (16 ids + EOS) fill a row each, B's
    (9 ids + EOS) leave 7 columns of padding, C's are of random lengths (some cut into pieces)."""
    d = tmp_path_factory.mktemp("tokweights")
    rng = np.random.default_rng(28)
    docs = {"a": [np.arange(100 + 16 * k, 116 + 16 * k) for k in range(50)],
            "b": [np.arange(2000 + 9 * k, 2009 + 9 * k) for k in range(70)],
            "c": [rng.integers(2, 5000, size=int(rng.integers(1, 40))) for _ in range(60)]}
    out = []
    for name, ds in docs.items():
        path = d / f"{name}.pageset"
        write_tokens(path, ds, None, eos_id=1, dtype="uint16", num_workers=0, page_size=4096, progress=False,
                     lineage=False)
        out.append(path)
    return out


def _packed_reference(path):
    """(rows, page sizes, predictions, tokens, dataset id) of a file's packed rows: the reference reader and
    the reference packing (tests/reference/packing.py, formats/packing.md)."""
    from reference import format as ref_format
    from reference import packing as ref_packing

    ref = ref_format.read_file(path)
    h = ref.header
    rows = ref_packing.rows(ref.doc_offsets, PACK_L, 2, h["page_size"], 1)
    predictions = sum(m - 1 for row in rows for _, m in row)
    return rows, ref_packing.row_page_sizes(rows, 2, h["page_size"], h["page_count"]), predictions, ref.tokens, \
        ref.dataset_id


def _token_quotas(weights, refs):
    """formats/mixture.md 2.6: the token weights w_i become the sample weights w_i * N_i / T_i (exact
    rationals: the weights' own values), scaled by 1 / max, as floats, resolved to quotas by section 2.1."""
    from fractions import Fraction

    from reference import order as model

    v = [Fraction(w) * len(rows) / t for w, (rows, _, t, _, _) in zip(weights, refs)]
    return model.quotas([float(x / max(v)) for x in v])


TOKEN_WEIGHTS = {"equal": [1, 1, 1], "floats": [0.134364, 0.847434, 0.763775]}  # floats: quotas by rule 3


@pytest.mark.parametrize("weights", list(TOKEN_WEIGHTS))
@pytest.mark.parametrize("order,drop_last", [("sequential", True), ("random", False), ("quasi_random", True),
                                             ("quasi_random", False)])
def test_token_weights_follow_the_reference_model_on_ranks_and_after_resume(packed_files, order, drop_last,
                                                                             weights):
    """Packed rows weighted by tokens: the quotas are section 2.6's (computed here from the reference packing's
    rows and predictions), the (_source, _index) stream on two ranks is the reference mixture model's with those
    quotas, each row's tokens, labels and positions are the reference packing's, the state is the model's;
    resumed mid-epoch on one rank (another world size) the stream continues as the model says."""
    from reference import order as model
    from reference import packing as ref_packing

    refs = [_packed_reference(p) for p in packed_files]
    q = _token_quotas(TOKEN_WEIGHTS[weights], refs)
    G, spe, seed = 6, 100, 8
    mix_model = model.MixtureModel(q, [r[1] for r in refs], seed, order, 2, drop_last, G, samples_per_epoch=spe)
    mix = Mixture(packed_files, TOKEN_WEIGHTS[weights], weight_unit="tokens", samples_per_epoch=spe)
    pipes = {"tokens": [TokenWindows(PACK_L, packing="best_fit")]}

    def make(rank, world):
        return Loader(mix, batch_size=G // world, rank=rank, world_size=world, order=order, seed=seed,
                      window_pages=2, drop_last=drop_last, pipelines=pipes, array_type="numpy")

    def check(b, epoch, step, rank, world):
        src, ids = mix_model.batch(epoch, step, rank, world)
        assert b["_source"].tolist() == src and b["_index"].tolist() == ids, (epoch, step, rank)
        for j, (s, i) in enumerate(zip(src, ids)):
            rows, _, _, tokens, _ = refs[s]
            want = ref_packing.row_contents(tokens, rows[i], PACK_L, 1)
            for key in ("input", "target", "labels", "position_ids", "doc_ids"):
                assert np.asarray(b[key][j]).tolist() == want[key], (key, epoch, step, j)

    ids = [r[4] for r in refs]
    ranks = [make(r, 2) for r in range(2)]
    try:
        assert tuple(ranks[0].state_dict()["mixture"]["quotas"]) == tuple(q)
        assert len(ranks[0]) == mix_model.steps
        its = [iter(ld) for ld in ranks]
        for step in range(mix_model.steps):  # epoch 0 on two ranks
            for r, it in enumerate(its):
                check(next(it), 0, step, r, 2)
        cut = 3
        its = [iter(ld) for ld in ranks]
        for step in range(cut):  # into epoch 1
            for r, it in enumerate(its):
                check(next(it), 1, step, r, 2)
        state = ranks[0].state_dict()
        assert state == ranks[1].state_dict()
    finally:
        for ld in ranks:
            ld.close()
    want_state = mix_model.state_dict(ids, 1, cut * G, seq_len=PACK_L)
    assert {k: v for k, v in state.items() if k != "packing"} == want_state
    with make(0, 1) as ld:  # resumed on one rank: the rest of epoch 1, then epoch 2
        ld.load_state_dict(state)
        assert ld.steps_remaining == mix_model.steps - cut
        for step, b in enumerate(ld, start=cut):
            check(b, 1, step, 0, 1)
        it = iter(ld)
        for step in range(2):
            check(next(it), 2, step, 0, 1)


def test_token_weights_of_stride_windows_follow_the_reference_model(token_files, tmp_path):
    """Stride windows hold seq_len predictions per row, so token weights are the sample weights divided by one
    number: the quotas are section 2.6's of the weights as given (rule 3 here), the stream on two ranks the
    model's, each window its source's tokens; the second source is a many-file set (its rows and predictions
    counted over its members, windows cut per member)."""
    from fractions import Fraction

    from reference import manifest as ref_manifest
    from reference import order as model

    L, G, weights = 24, 8, [0.134364, 0.847434]
    rng = np.random.default_rng(12)
    docs = [rng.integers(0, 1000, size=int(rng.integers(1, 90))) for _ in range(80)]
    folder = tmp_path / "set"
    write_tokens(folder, docs, eos_id=1000, dtype="uint16", docs_per_member=20, num_workers=0, page_size=4096,
                 progress=False, lineage=False)
    ref_set = ref_manifest.read_set(folder)
    members = [m.tokens for m in ref_set.members]
    set_sizes = [s for m in ref_set.members for s in model.window_page_sizes(
        len(m.tokens), L, 2, m.header["page_size"], m.header["page_count"])]
    layouts = [model_layout(token_files[0][0], L)[0], set_sizes]
    streams = [(token_files[0][1],), members]  # the file's stream; the set's members' streams
    starts = np.cumsum([0] + [(len(t) - 1) // L for t in members])
    n = [sum(s) for s in layouts]
    v = [Fraction(w) * k / (k * L) for w, k in zip(weights, n)]
    q = model.quotas([float(x / max(v)) for x in v])
    ref = model.MixtureModel(q, layouts, 4, "random", 1, False, G, samples_per_epoch=90)
    mix = Mixture([token_files[0][0], folder], weights, weight_unit="tokens", samples_per_epoch=90)
    loaders = [Loader(mix, batch_size=G // 2, rank=r, world_size=2, order="random", seed=4, drop_last=False,
                      pipelines={"tokens": [TokenWindows(L)]}, array_type="numpy") for r in range(2)]
    try:
        assert tuple(loaders[0].state_dict()["mixture"]["quotas"]) == tuple(q)
        for step, batches in enumerate(zip(*loaders)):
            for rank, b in enumerate(batches):
                src, ids = ref.batch(0, step, rank, 2)
                assert b["_source"].tolist() == src and b["_index"].tolist() == ids
                for j, (s, w) in enumerate(zip(src, ids)):
                    k = int(np.searchsorted(starts, w, side="right")) - 1 if s else 0
                    stream, w = np.asarray(streams[s][k]), w - (int(starts[k]) if s else 0)
                    np.testing.assert_array_equal(b["input"][j], stream[w * L : w * L + L])
                    np.testing.assert_array_equal(b["target"][j], stream[w * L + 1 : w * L + L + 1])
        assert step + 1 == ref.steps and set(ref.slots) == {0, 1}
    finally:
        for ld in loaders:
            ld.close()
