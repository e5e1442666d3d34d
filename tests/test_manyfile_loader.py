"""``Loader(folder)`` on a many-file dataset (formats/manyfile.md; the Loader side: load/set_source.py).

The set reads as one file whose records are the members' records in manifest order and whose page list is the
members' page lists concatenated (formats/order.md section 6). Expectations are independent of the Loader: the
order is the reference model's (``tests/reference/order.py``) over the members' page layouts computed by the
reference code from each member's index (``model_layout``), the set id the reference manifest reader's, and each
record's bytes the ones the test wrote (label i, a payload made from i), also checked against ``merge_datasets``
of the members (same ids and bytes; another page layout, so not the same order).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from reference import manifest as ref_manifest
from reference import order as model
from resume_contract import model_layout

from pageset import JSON, Bytes, Int, Loader, Mixture, TokenWindows, merge_datasets, open_dataset, write_dataset, write_tokens
from pageset.format.errors import FileChangedError, MemberMismatchError, TruncatedFileError
from pageset.format.manifest import Member, build_manifest, common_schema, schema_digest
from pageset.read import member_cache
from pageset.load.stages import DecodeError
from pageset.ops import spans
from pageset.order import StateMismatchError
from pageset.read import Dataset
from pageset.read.set_manifest import many_file_members
from pageset.write.members import commit_manifest

FIELDS = {"label": Int(), "payload": Bytes()}
ORDERS = ["sequential", "random", "quasi_random"]


def payload(i: int) -> bytes:
    """Record i's payload: 1..300 bytes (records of varying size: members of varying page layouts)."""
    return bytes([i % 251, (i // 251) % 251]) * (i * 37 % 150 + 1)


def samples(a: int, b: int):
    return [{"label": i, "payload": payload(i)} for i in range(a, b)]


def write_set(folder, n, per_member, append=False, start=0):
    return write_dataset(folder, samples(start, start + n), FIELDS, records_per_member=per_member, append=append,
                         num_workers=0, page_size=4096, progress=False, lineage=False)


@pytest.fixture(scope="module")
def record_set(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rset") / "train"
    write_set(folder, 700, 90)  # 8 members: 7 of 90 records, one of 70
    return folder


def set_layout(folder, seq_len=None):
    """The reference model's page list of the set (each member's from its own index, concatenated) and the
    reference manifest reader's set id."""
    ref = ref_manifest.read_set(folder)
    paths = [os.path.join(folder, m["name"]) for m in ref.manifest["members"]]
    return [s for p in paths for s in model_layout(p, seq_len)[0]], ref.dataset_id, paths


def rows(batch):
    data, lengths = np.asarray(batch["payload"][0]), np.asarray(batch["payload"][1])
    return [(int(lab), bytes(data[j, : lengths[j]])) for j, lab in enumerate(np.asarray(batch["label"]))]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("order", ORDERS)
def test_a_set_loads_its_records_in_the_order_of_the_concatenated_pages(record_set, tmp_path, order, drop_last):
    sizes, set_id, paths = set_layout(record_set)
    ref = model.FileOrder(sizes, 7, order, 2, drop_last, 16)
    merged = tmp_path / "merged.pageset"
    merge_datasets(merged, paths, progress=False, lineage=False)
    with open_dataset(merged) as ds:  # merge's records: the same ids and bytes as the set
        assert [(int(ds[i]["label"]), bytes(ds[i]["payload"])) for i in range(len(ds))] == \
            [(i, payload(i)) for i in range(700)]
    assert model_layout(merged)[0] != sizes  # ... but re-packed pages: another quasi_random order
    loaders = [Loader(record_set, batch_size=8, rank=r, world_size=2, order=order, seed=7, window_pages=2,
                      drop_last=drop_last, num_threads=2, array_type="numpy") for r in range(2)]
    try:
        # lazy: one member open at construction (the one with the longest Bytes value: it sizes the buffers)
        assert [len(ld._sources[0].open_members()) for ld in loaders] == [1, 1]
        assert loaders[0].dataset_id == set_id and loaders[0].epoch_length == ref.length and len(paths) == 8
        for epoch in range(2):
            got, index, padding = [], [], []
            for b0, b1 in zip(*loaders):
                for b in (b0, b1):  # the all-gather, in rank order
                    got += rows(b)
                    index += b["_index"].tolist()
                    padding += b["_is_padding"].tolist()
            want = ref.global_stream(epoch, 0, ref.steps)
            assert index == [i for i, _ in want] and padding == [p for _, p in want], epoch
            assert got == [(i, payload(i)) for i, _ in want], epoch  # global id i is record i of the source
        assert loaders[0].state_dict() == model.state_dict(set_id, 7, 2, 0, 16, order, 2, drop_last)
    finally:
        for ld in loaders:
            ld.close()


def test_members_open_lazily_and_a_bounded_number_stay_open(record_set, monkeypatch):
    monkeypatch.setattr(member_cache, "MAX_OPEN_MEMBERS", 2)
    monkeypatch.setattr(member_cache, "MAX_OPEN_FILES", 2)
    sizes, set_id, _ = set_layout(record_set)
    ref = model.FileOrder(sizes, 1, "quasi_random", 1, True, 10)
    with Loader(record_set, batch_size=10, order="quasi_random", seed=1, window_pages=1, num_threads=2,
                batches_ahead=2, array_type="numpy") as ld:
        src = ld._sources[0]
        peak = 0
        index = []
        for b in ld:
            index += b["_index"].tolist()
            assert [(i, payload(i)) for i in b["_index"].tolist()] == rows(b)
            peak = max(peak, len(src.open_members()))
        assert index == [i for i, _ in ref.global_stream(0, 0, ref.steps)]
        # batches in flight may hold more than the bound; once they are done it holds again
        assert len(src.open_members()) <= 2 and peak <= 2 + 3  # (3 batches in flight, one member each)
        assert src.opened_count > 8  # closed members were opened again


def _token_members(folder, lengths):
    """A hand-made token set: one member per length (one document of ``arange`` tokens, EOS 60001) + a manifest
    (formats/manyfile.md). Returns each member's token stream (its document and EOS)."""
    folder.mkdir()
    docs = [np.arange(k * 1000, k * 1000 + n, dtype=np.uint16) for k, n in enumerate(lengths)]
    entries = []
    for k, doc in enumerate(docs):
        name = f"m0001-{k:06d}.pageset"
        write_tokens(folder / name, [doc], eos_id=60001, num_workers=0, page_size=4096, progress=False)
        with Dataset(folder / name) as ds:
            entries.append((name, ds.dataset_id, ds.file_size, ds.page_count, ds.schema,
                            int(ds.tokens_info["count"]), int(ds.tokens_info["documents"])))
    members = [Member(n, i, b, p, schema_digest(s), tokens=t, documents=d) for n, i, b, p, s, t, d in entries]
    assert {m.schema_digest for m in members} == {schema_digest(common_schema(entries[0][4]))}
    commit_manifest(str(folder), build_manifest("tokens", 1, entries[0][4], 4096, members), None)
    return [np.append(doc, np.uint16(60001)) for doc in docs]


def test_a_token_set_reads_each_members_windows(tmp_path):
    folder = tmp_path / "tokens"
    # member 2 holds 1600 tokens with its EOS: 100 * seq_len, so (T - 1) // seq_len = 99 windows, not 100
    streams = _token_members(folder, [3000, 10, 1599, 2110])
    seq = 16
    counts = [(len(s) - 1) // seq for s in streams]  # member 1 (11 tokens) holds no window
    starts = np.cumsum([0] + counts)
    sizes, set_id, _ = set_layout(folder, seq_len=seq)
    ref = model.FileOrder(sizes, 1, "quasi_random", 2, False, 8)
    with Loader(folder, batch_size=8, order="quasi_random", seed=1, window_pages=2, drop_last=False,
                pipelines={"tokens": [TokenWindows(seq)]}, array_type="numpy") as ld:
        batches = list(ld)
        assert ld.state_dict() == model.state_dict(set_id, 1, 1, 0, 8, "quasi_random", 2, False, seq_len=seq)
        assert 1 not in ld._sources[0].open_members()  # a member without windows is never opened
    got = np.concatenate([b["input"] for b in batches])
    want = []
    for gid, _ in ref.global_stream(0, 0, ref.steps):
        k = int(np.searchsorted(starts, gid, side="right")) - 1
        local = gid - starts[k]
        want.append(streams[k][local * seq : local * seq + seq])
    np.testing.assert_array_equal(got, np.array(want))
    np.testing.assert_array_equal(np.concatenate([b["_index"] for b in batches]),
                                  [i for i, _ in ref.global_stream(0, 0, ref.steps)])


@pytest.mark.parametrize("change", ["touched", "truncated", "replaced"])
@pytest.mark.parametrize("max_open,kernel", [(1, True), (8, True), (8, False)])
def test_a_token_member_changed_after_it_was_read_is_named_before_its_windows(tmp_path, monkeypatch, change,
                                                                              max_open, kernel):
    """The flat token reader checks each member it read in the same kernel call (ops.tokens.pread_set_windows;
    ``kernel=False``: where libc's fstat layout is not the one expected, an ``os.fstat`` each): a member modified
    in place or truncated while open, or replaced while closed (max_open 1), raises naming the member, and no
    batch with its windows comes out; every batch before holds the member's tokens."""
    monkeypatch.setattr(member_cache, "MAX_OPEN_FILES", max_open)
    if not kernel:
        monkeypatch.setattr(spans, "fstat_layout_ok", lambda fd: False)
    folder, seq = tmp_path / "tokens", 16
    streams = _token_members(folder, [16 * 5] * 3)  # 81 tokens with the EOS: 5 windows each ((T - 1) // seq_len)
    victim = many_file_members(folder).paths[1]

    def want(g):
        k, w = divmod(g, 5)
        return streams[k][w * seq : w * seq + seq]

    with Loader(folder, batch_size=5, order="sequential", pipelines={"tokens": [TokenWindows(seq)]}, num_threads=1,
                array_type="numpy") as ld:
        assert ld._sources[0]._flat is not None
        for b in ld:  # one epoch: every member read once
            np.testing.assert_array_equal(b["input"], [want(g) for g in b["_index"].tolist()])
        if change == "touched":
            st = os.stat(victim)
            os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
            error = FileChangedError
        elif change == "truncated":
            os.truncate(victim, os.path.getsize(victim) - 7)
            error = (TruncatedFileError, FileChangedError)
        else:
            shutil.copyfile(victim, victim + ".new")
            os.replace(victim + ".new", victim)
            error = FileChangedError
        seen = []
        if change == "replaced" and max_open > 1:  # still open: read as opened, as one file's reader reads it
            for b in ld:
                np.testing.assert_array_equal(b["input"], [want(g) for g in b["_index"].tolist()])
                seen += b["_index"].tolist()
            assert seen == list(range(15))
            return
        with pytest.raises(error, match=r"m0001-000001\.pageset.*member 1"):
            for b in ld:
                np.testing.assert_array_equal(b["input"], [want(g) for g in b["_index"].tolist()])
                seen += b["_index"].tolist()
        assert seen == list(range(5))  # member 0's windows, none of member 1's


def test_a_record_that_cannot_be_decoded_names_its_member(tmp_path):
    """A flat set's DecodeError names the set's sample id, and the member file and the id within it (a stored
    JSON value damaged on disk: sample 23 is sample 3 of member 2, 10 records per member)."""
    folder = tmp_path / "set"
    write_dataset(folder, [{"meta": {"name": f"MARK{i:04d}"}} for i in range(40)], {"meta": JSON()},
                  records_per_member=10, num_workers=0, page_size=4096, progress=False, lineage=False)
    victim = many_file_members(folder).paths[2]
    data = Path(victim).read_bytes()
    assert data.count(b'"MARK0023"') == 1
    Path(victim).write_bytes(data.replace(b'"MARK0023"', b'xMARK0023"'))  # not JSON any more; same length
    seen = []
    with Loader(folder, batch_size=4, order="sequential", num_threads=1, array_type="numpy") as ld:
        assert ld._sources[0]._flat is not None
        match = (rf"{re.escape(str(folder))}: sample 23 \(sample 3 of member 2, {re.escape(victim)}\), "
                 r"field 'meta': stored JSON is not valid")
        with pytest.raises(DecodeError, match=match) as err:
            for b in ld:
                seen += b["_index"].tolist()
                assert [m["name"] for m in b["meta"]] == [f"MARK{i:04d}" for i in b["_index"].tolist()]
    assert err.value.sample == 23 and seen == list(range(20))


def test_a_mixture_member_may_be_a_set(record_set, tmp_path):
    other = tmp_path / "other.pageset"
    write_dataset(other, samples(5000, 5100), FIELDS, num_workers=0, page_size=4096, progress=False)
    sizes, set_id, _ = set_layout(record_set)
    other_sizes, other_id = model_layout(other)
    mix = model.MixtureModel([3, 1], [sizes, other_sizes], 4, "quasi_random", 2, True, 8, samples_per_epoch=400)
    with Loader(Mixture([record_set, other], weights=[3, 1], samples_per_epoch=400), batch_size=8,
                order="quasi_random", seed=4, window_pages=2, num_threads=2, array_type="numpy") as ld:
        got = [(int(s), int(i), r) for b in ld for s, i, r in zip(b["_source"].tolist(), b["_index"].tolist(),
                                                                   rows(b))]
        state = ld.state_dict()
    want = [x for step in range(mix.steps) for x in zip(*mix.batch(0, step, 0, 1))]
    assert [(s, i) for s, i, _ in got] == want
    assert [r for _, _, r in got] == [(i if s == 0 else 5000 + i, payload(i if s == 0 else 5000 + i))
                                      for s, i, _ in got]
    assert [src["dataset_id"] for src in state["mixture"]["sources"]] == [set_id, other_id]


def test_a_state_saved_before_an_append_is_refused(tmp_path):
    folder = tmp_path / "grow"
    write_set(folder, 100, 40)
    with Loader(folder, batch_size=10, order="quasi_random", seed=2, array_type="numpy") as ld:
        next(iter(ld))
        state = ld.state_dict()
    write_set(folder, 30, 40, append=True, start=100)
    with Loader(folder, batch_size=10, order="quasi_random", seed=2, array_type="numpy") as ld:
        assert ld.n_records == 130 and ld.dataset_id == ref_manifest.read_set(folder).dataset_id != state["dataset_id"]
        with pytest.raises(StateMismatchError, match=r"dataset_id.*many-file set gets a new dataset id whenever its "
                                                     r"members change, an append included"):
            ld.load_state_dict(state)


@pytest.mark.parametrize("damage", ["missing", "replaced"])
def test_a_member_missing_or_replaced_while_loading_is_named_before_any_batch_from_it(tmp_path, damage):
    folder = tmp_path / "set"
    write_set(folder, 100, 20)  # 5 members of 20 records
    info = many_file_members(folder)
    with Loader(folder, batch_size=10, order="sequential", num_threads=2, pipelines={"payload": None},
                array_type="numpy") as ld:
        assert ld._sources[0].open_members() == [0]
        victim = info.paths[3]
        if damage == "missing":
            os.unlink(victim)
            error, match = FileNotFoundError, r"m0001-000003\.pageset: missing: member 3 of the many-file dataset"
        else:
            shutil.copyfile(info.paths[2], victim + ".new")  # another member's file under its name
            os.replace(victim + ".new", victim)
            error, match = MemberMismatchError, r"m0001-000003\.pageset: header: its dataset id is"
        seen = []
        with pytest.raises(error, match=match):
            for b in ld:
                seen += b["_index"].tolist()
        # sequential, batch 10: members 0, 1 and 2 came out whole, nothing of member 3
        assert seen == list(range(60))


def test_s3_set_through_the_loader_with_cache_dir(tmp_path, moto_s3):  # noqa: F811
    url = "s3://pageset-test/sets/loader"
    write_dataset(url, samples(0, 300), FIELDS, records_per_member=70, num_workers=0, page_size=4096,
                  storage_options=moto_s3, progress=False, lineage=False)
    local = tmp_path / "local"
    write_set(local, 300, 70)  # the same members, byte for byte (lineage off)
    sizes, set_id, _ = set_layout(local)
    ref = model.FileOrder(sizes, 9, "quasi_random", 2, True, 16)
    cache = tmp_path / "cache"
    runs = []
    for _ in range(2):
        with Loader(url, batch_size=16, order="quasi_random", seed=9, window_pages=2, storage_options=moto_s3,
                    cache_dir=cache, num_threads=2, array_type="numpy") as ld:
            assert ld.dataset_id == set_id
            got = [r for b in ld for r in zip(b["_index"].tolist(), rows(b))]
            runs.append(ld.remote_stats())
        assert [i for i, _ in got] == [i for i, _ in ref.global_stream(0, 0, ref.steps)]
        assert [r for _, r in got] == [(i, payload(i)) for i, _ in got]
    assert runs[0]["requests"] > 0 and runs[0]["members_opened"] >= 5
    assert runs[1]["requests"] == 0 and runs[1]["disk_hits"] > 0  # the second run read every page from cache_dir


RUN_SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys, time
    from pageset import Loader
    path, rank, world, batch, state_in, log, save_at = sys.argv[1:8]
    rank, world, batch, save_at = int(rank), int(world), int(batch), int(save_at)
    loader = Loader(path, batch_size=batch, order="quasi_random", seed=21, window_pages=2, rank=rank,
                    world_size=world, num_threads=2, batches_ahead=3, array_type="numpy")
    if state_in != "-":
        loader.load_state_dict(json.load(open(state_in)))
    with open(log, "a") as f:
        for step, b in enumerate(loader):
            data, lengths = b["payload"]
            for j, rid in enumerate(b["_index"].tolist()):
                h = hashlib.sha256(bytes(data[j, : lengths[j]]) + bytes([int(b["label"][j]) % 256])).hexdigest()
                f.write(f"{rid} {h[:16]}\\n")
            f.flush()
            if step == save_at:
                json.dump(loader.state_dict(), open(log + ".state", "w"))
                open(log + ".ready", "w").close()
                time.sleep(600)
    """
)


def _log(path):
    return [tuple(line.split()) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_on_another_world_size(record_set, tmp_path):
    import hashlib

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    sizes, _, _ = set_layout(record_set)
    ref = model.FileOrder(sizes, 21, "quasi_random", 2, True, 12)
    expected = [(str(i), hashlib.sha256(payload(i) + bytes([i % 256])).hexdigest()[:16])
                for i, _ in ref.global_stream(0, 0, ref.steps)]
    logs = [tmp_path / f"r{r}.log" for r in range(3)]  # three ranks of batch 4 (global batch 12)
    procs = [subprocess.Popen([sys.executable, "-c", RUN_SCRIPT, str(record_set), str(r), "3", "4", "-",
                               str(logs[r]), "5"], env=env, start_new_session=True) for r in range(3)]
    try:
        deadline = time.monotonic() + 300
        while not all(os.path.exists(str(lg) + ".ready") for lg in logs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.1)
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    states = [json.loads(open(str(lg) + ".state").read()) for lg in logs]
    assert states[0] == states[1] == states[2] and states[0]["cursor"] == 72  # 6 steps of 12
    before = [_log(lg) for lg in logs]
    assert [x for s in range(6) for r in range(3) for x in before[r][4 * s : 4 * s + 4]] == expected[:72]
    # resume on two ranks of batch 6, each its own process
    resumed = [tmp_path / f"resumed{r}.log" for r in range(2)]
    for r in range(2):
        subprocess.run([sys.executable, "-c", RUN_SCRIPT, str(record_set), str(r), "2", "6", str(logs[0]) + ".state",
                        str(resumed[r]), "-1"], check=True, env=env, timeout=300)
    after = [_log(lg) for lg in resumed]
    steps = ref.steps - 6
    assert [x for s in range(steps) for r in range(2) for x in after[r][6 * s : 6 * s + 6]] == expected[72:]


from test_object_store import moto_s3  # noqa: E402,F401  (the S3 server fixture, shared)


@pytest.mark.parametrize("change", ["replaced", "touched", "truncated"])
@pytest.mark.parametrize("max_open,kernel", [(1, True), (8, True), (8, False)])
def test_a_member_changed_after_it_was_read_is_named_when_read_again(tmp_path, monkeypatch, change, max_open,
                                                                     kernel):
    """A flat set (load/set_records.py) keeps only descriptors of members it read: a member re-opened (max_open 1:
    every member is closed between its reads) that is no longer the file first read, or one still open (8) that
    changed in place, raises naming the member before any batch with its records; a member replaced by a rename
    while open is read as opened (the old file), as one file is. ``kernel=False``: the members checked with
    ``os.fstat`` (where libc's fstat layout is not the one expected), not in the read kernel."""
    monkeypatch.setattr(member_cache, "MAX_OPEN_FILES", max_open)
    if not kernel:
        monkeypatch.setattr(spans, "fstat_layout_ok", lambda fd: False)
    folder = tmp_path / "set"
    write_set(folder, 80, 20)  # 4 members of 20 records
    victim = many_file_members(folder).paths[1]
    with Loader(folder, batch_size=10, order="sequential", num_threads=1, array_type="numpy") as ld:
        assert ld._sources[0]._flat is not None
        first = [i for b in ld for i in b["_index"].tolist()]
        assert first == list(range(80)) and len(ld._sources[0].open_members()) == min(max_open, 4)
        if change == "replaced":  # the same bytes in a new file renamed over it: another inode
            shutil.copyfile(victim, victim + ".new")
            os.replace(victim + ".new", victim)
            error, match = FileChangedError, r"m0001-000001\.pageset.*member 1 was replaced or modified"
        elif change == "touched":  # modified in place (a new modification time, same size)
            st = os.stat(victim)
            os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
            error, match = FileChangedError, r"m0001-000001\.pageset.*member 1 was (replaced or )?modified"
        else:
            os.truncate(victim, os.path.getsize(victim) // 2)
            error, match = (TruncatedFileError, FileChangedError), r"m0001-000001\.pageset.*member 1"
        seen = []
        if change == "replaced" and max_open > 1:  # still open: it reads the file it opened, as one file's reader
            seen = [i for b in ld for i in b["_index"].tolist() if rows(b) == [(i, payload(i)) for i in b["_index"]]]
            assert seen == list(range(80))
            return
        with pytest.raises(error, match=match):
            for b in ld:
                seen += b["_index"].tolist()
                assert rows(b) == [(i, payload(i)) for i in b["_index"].tolist()]
        assert seen == list(range(20))  # member 0's batches, none of member 1's
    assert ld._sources[0].open_members() == []  # closed: no descriptor left


# ---- issue 28: a set of more members than the open-file limit allows (``ulimit -n 100``) ---------------------------

LIMITED = textwrap.dedent("""
    import json, os, resource, sys
    import numpy as np
    from pageset import Loader, Mixture

    folder, soft, others, kw, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
    mix = kw.pop("mixture_with", None)  # a Mixture of the set (weight 3) and this file (weight 1)
    source = Mixture([folder, mix], weights=[3, 1], samples_per_epoch=3000) if mix else folder
    if others:  # the kernels loaded first (a warm process), then files this process holds for other reasons
        with Loader(folder, array_type="numpy", batch_size=2, page_cache=kw.get("page_cache", "os")) as ld:
            next(iter(ld))
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(others)]

    def open_fds():  # without opening one (listing /proc/self/fd takes a descriptor)
        n = 0
        for fd in range(soft):
            try:
                os.fstat(fd)
                n += 1
            except OSError:
                pass
        return n

    rows, most = [], 0
    try:
        with Loader(source, array_type="numpy", **kw) as ld:
            for b in ld:
                data, lengths = np.asarray(b["payload"][0]), np.asarray(b["payload"][1])
                rows += [(int(lab), bytes(data[j, : lengths[j]]).hex()) for j, lab in enumerate(np.asarray(b["label"]))]
                most = max(most, open_fds())
        result = {"rows": rows, "most_fds": most}
    except OSError as exc:
        result = {"error": str(exc), "errno": exc.errno, "type": type(exc).__name__}
    json.dump(result, open(out, "w"))
""")


def _under_limit(folder, soft: int, tmp_path, others: int = 0, **kw) -> dict:
    """One epoch of ``Loader(folder, **kw)`` in a fresh process whose soft RLIMIT_NOFILE is ``soft`` and which
    holds ``others`` more descriptors (then its kernels are loaded first); ``{"rows": [(label, payload hex)],
    "most_fds"}`` or ``{"error", "errno", "type"}`` of an OSError."""
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-c", LIMITED, str(folder), str(soft), str(others), json.dumps(kw),
                           str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def set_of_300(tmp_path_factory):
    folder = tmp_path_factory.mktemp("set300") / "train"
    write_set(folder, 3000, 10)  # 300 members of 10 records
    assert len(ref_manifest.read_set(folder).manifest["members"]) == 300
    return folder


@pytest.mark.parametrize("batch_size", [30, 300])
@pytest.mark.parametrize("kw", [{"page_cache": "process"}, {"verify_pages": True}, {},
                                {"page_cache": "process", "num_workers": 1}],
                         ids=["page_cache=process", "verify_pages", "default", "process-mode"])
def test_a_300_member_set_reads_under_an_open_file_limit_of_100(set_of_300, tmp_path, kw, batch_size):
    """``ulimit -n 100`` and 300 members: every path keeps at most a quarter of the limit of members open, plus
    one per thread (the member-by-member path kept 128, and page_cache="process" died on a bare EMFILE); a slice
    of 150 random rows touches ~120 members, more than may be open at once: it is read a member at a time. The
    epoch holds every record once with the bytes written for it. num_workers=1: the child inherits the limit."""
    got = _under_limit(set_of_300, 100, tmp_path, batch_size=batch_size, order="random", seed=3, num_threads=2,
                       **kw)
    assert "error" not in got, got
    assert sorted(lab for lab, _ in got["rows"]) == list(range(3000))
    assert all(bytes.fromhex(h) == payload(lab) for lab, h in got["rows"])
    assert 0 < got["most_fds"] < 100


@pytest.mark.parametrize("kw", [{}, {"page_cache": "process"}], ids=["default", "page_cache=process"])
def test_a_mixture_with_a_300_member_set_reads_under_an_open_file_limit_of_100(set_of_300, tmp_path, kw):
    """The set's rows of a Mixture batch (scattered rows) under ``ulimit -n 100``, random batches of 300: read a
    few members at a time too; each row holds the bytes written for its label (the file's labels 5000..)."""
    other = tmp_path / "other.pageset"
    write_dataset(other, samples(5000, 5100), FIELDS, num_workers=0, page_size=4096, progress=False)
    got = _under_limit(set_of_300, 100, tmp_path, batch_size=300, order="random", seed=3, num_threads=2,
                       mixture_with=str(other), **kw)
    assert "error" not in got, got
    labels = [lab for lab, _ in got["rows"]]
    assert len(labels) == 3000 and sum(lab < 3000 for lab in labels) > 2000
    assert all(bytes.fromhex(h) == payload(lab) for lab, h in got["rows"])
    assert 0 < got["most_fds"] < 100


def test_members_past_the_open_file_limit_are_a_clear_error(set_of_300, tmp_path):
    """A process that holds 75 other descriptors under a limit of 100: a member cannot be opened (the quarter
    of the limit the set may keep open is not free): the error names the member, the limit and the fixes, not
    a bare ``[Errno 24] Too many open files``."""
    got = _under_limit(set_of_300, 100, tmp_path, others=75, batch_size=30, order="random", seed=3, num_threads=2,
                       page_cache="process")
    assert got.get("errno") == 24, got
    msg = got["error"]
    assert "open-file limit (RLIMIT_NOFILE) is 100" in msg and "ulimit -n" in msg, msg
    assert re.search(r"m\d{4}-\d{6}\.pageset", msg) and "many-file dataset" in msg, msg
    assert "quasi_random" in msg and "num_threads" in msg, msg
