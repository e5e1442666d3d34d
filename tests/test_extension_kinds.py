"""A stage kind and a storage kind defined here, outside pageset, run through the Loader with no edit to it.

The read side's parts are declared (``pageset.load.parts``): a new stage kind is a ``Stage`` subclass built by a
``StageOp`` at the head of a field's pipeline; a new storage kind is a ``PageSource`` subclass given as
``page_cache``. Each kind below is one short class; the batches are checked against values known from how the
files were written (a record's label and payload are functions of its number; a token window is a slice of the
token stream at ``_index * seq_len``), for a file, a Mixture, a many-file set and resume, as test_plans.py does
for a fifth kind of plan.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from remote_servers import StaticHTTP

from pageset import Bytes, Int, Loader, Mixture, TokenWindows, open_tokens, write_dataset, write_tokens
from pageset.load.parts import PageSource, Stage, StageOp
from pageset.load.stages import PipelineError


def _payload(i: int) -> bytes:
    return bytes([(7 * i) % 256, i % 256]) * (i % 23 + 1)


def _write_records(path, n, tag, **kw):
    write_dataset(path, [(tag * 1000 + i, _payload(i)) for i in range(n)], {"label": Int(), "payload": Bytes()},
                  num_workers=0, page_size=4096, progress=False, **kw)
    return path


# --- a stage kind: a Bytes field loaded as (byte sum, length, first byte) ------------------------------------


class ByteStats(StageOp):
    """Loads a Bytes field as int64[B, 3]: the sum of its bytes, its length and its first byte (-1 when empty)."""

    def build_stage(self, name, field, ops, ds, pages, array_type):
        if not isinstance(field, Bytes) or len(ops) != 1:
            raise PipelineError(f"{ds.path}: field {name!r}: ByteStats loads one Bytes field, alone")
        return _ByteStatsStage(name, ds, pages)


class _ByteStatsStage(Stage):
    def __init__(self, name, ds, pages):
        self.name, self.pages, self.path, self.to_tensor = name, pages, ds.path, False
        self.offs = ds.index[f"{name}.offset"].astype(np.int64)
        self.lens = ds.index[f"{name}.length"].astype(np.int64)
        self.outputs = {name: ((3,), np.dtype(np.int64), None)}

    def fill(self, arrays, lo, hi, ids, keys, ctx):
        lens = self.lens[ids]
        buf, offs = self.pages.gather(self.offs[ids], lens, ctx, ordered=False)
        out = arrays[self.name][lo:hi]
        for j in range(ids.shape[0]):
            rec = buf[offs[j] : offs[j] + lens[j]]
            out[j] = (int(rec.sum(dtype=np.int64)), int(lens[j]), int(rec[0]) if lens[j] else -1)


def _stats_of(i: int) -> list[int]:
    p = _payload(i)
    return [sum(p), len(p), p[0] if p else -1]


# --- a storage kind: the whole file read into memory once, every gather a copy out of it, calls counted -------


class MemoryPages(PageSource):
    """A local file read into memory at open; ``gather`` copies the spans out of that copy."""

    opened: list = []  # the paths opened, in order (the test's own record)

    def __init__(self, ds):
        with open(ds.path, "rb") as f:
            self._data = np.frombuffer(f.read(), dtype=np.uint8)
        self.gathers = 0
        MemoryPages.opened.append(str(ds.path))

    def gather(self, offs, lens, staging, ordered=True):
        self.gathers += 1
        offs, lens = np.asarray(offs, np.int64), np.asarray(lens, np.int64)
        starts = np.zeros(lens.shape[0], np.int64)
        np.cumsum(lens[:-1], out=starts[1:])
        buf = np.empty(int(lens.sum()), np.uint8)
        for o, n, s in zip(offs.tolist(), lens.tolist(), starts.tolist()):
            buf[s : s + n] = self._data[o : o + n]
        return buf, starts


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("kinds")
    a, b = _write_records(d / "a.pageset", 130, 1), _write_records(d / "b.pageset", 57, 2)
    set_dir = d / "set"
    write_dataset(set_dir, [(3000 + i, _payload(i)) for i in range(90)], {"label": Int(), "payload": Bytes()},
                  num_workers=0, page_size=4096, progress=False, records_per_member=25)
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 50000, size=int(rng.integers(1, 120))) for _ in range(80)]
    tok = d / "t.pageset"
    write_tokens(tok, docs, eos_id=50001, num_workers=0, page_size=4096, progress=False)
    return {"a": a, "b": b, "set": set_dir, "tokens": tok}


def _check_rows(batch, seen):
    for label, got in zip(np.asarray(batch["label"]).tolist(), np.asarray(batch["payload"]).tolist()):
        assert got == _stats_of(label % 1000), label
        seen.append(label)


@pytest.mark.parametrize("page_cache", ["os", "process", MemoryPages])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_a_new_stage_kind_loads_every_record(files, page_cache, num_threads):
    seen: list = []
    with Loader(files["a"], batch_size=10, order="random", seed=3, num_threads=num_threads, page_cache=page_cache,
                drop_last=False, array_type="numpy", pipelines={"payload": [ByteStats()]}) as ld:
        for batch in ld:
            assert batch["payload"].shape[1:] == (3,) and batch["payload"].dtype == np.int64
            _check_rows(batch, seen)
    assert sorted(seen) == [1000 + i for i in range(130)]


def test_a_new_stage_kind_in_a_mixture_a_set_and_on_resume(files):
    seen: list = []
    mix = Mixture([files["a"], files["b"]], weights=[2, 1])
    with Loader(mix, batch_size=6, order="quasi_random", seed=9, num_threads=2, array_type="numpy",
                pipelines={"payload": [ByteStats()]}) as ld:
        for batch in itertools.islice(ld, 12):
            _check_rows(batch, seen)
    assert {s // 1000 for s in seen} == {1, 2}
    seen = []
    with Loader(files["set"], batch_size=9, order="random", seed=1, array_type="numpy",
                pipelines={"payload": [ByteStats()]}) as ld:
        first = list(itertools.islice(ld, 3))
        state = ld.state_dict()
        rest = list(ld)
    for batch in first + rest:
        _check_rows(batch, seen)
    assert sorted(seen) == [3000 + i for i in range(90)]
    with Loader(files["set"], batch_size=9, order="random", seed=1, array_type="numpy",
                pipelines={"payload": [ByteStats()]}) as ld:
        ld.load_state_dict(state)
        again = list(ld)
    assert [b["label"].tolist() for b in again] == [b["label"].tolist() for b in rest]
    assert [b["payload"].tolist() for b in again] == [b["payload"].tolist() for b in rest]


def test_a_stage_op_that_refuses_a_field_names_it(files):
    with pytest.raises(PipelineError, match=r"a\.pageset: field 'label': ByteStats loads one Bytes field"):
        Loader(files["a"], batch_size=4, pipelines={"label": [ByteStats()]})


@pytest.mark.parametrize("order", ["sequential", "quasi_random"])
def test_a_new_storage_kind_reads_records_sets_and_token_windows(files, order):
    MemoryPages.opened.clear()
    seen: list = []
    with Loader(files["a"], batch_size=13, order=order, seed=2, num_threads=2, page_cache=MemoryPages,
                drop_last=False, array_type="numpy") as ld:
        for batch in ld:
            data, lengths = batch["payload"]
            for label, row, n in zip(batch["label"].tolist(), data, lengths.tolist()):
                assert bytes(row[:n]) == _payload(label - 1000) and not row[n:].any()
                seen.append(label)
        assert ld._sources[0].pages.gathers >= len(ld)  # every batch's payload bytes came through it
    assert sorted(seen) == [1000 + i for i in range(130)] and MemoryPages.opened == [str(files["a"])]
    # a many-file set: every member read through the storage kind (never flat: that reads with pread itself)
    MemoryPages.opened.clear()
    seen = []
    with Loader(files["set"], batch_size=10, order=order, seed=2, page_cache=MemoryPages, drop_last=False,
                array_type="numpy") as ld:
        for batch in ld:
            data, lengths = batch["payload"]
            for label, row, n in zip(batch["label"].tolist(), data, lengths.tolist()):
                assert bytes(row[:n]) == _payload(label - 3000)
                seen.append(label)
    assert sorted(seen) == [3000 + i for i in range(90)] and len(MemoryPages.opened) == 4
    # token windows: each one the stream's slice at _index * seq_len
    with open_tokens(files["tokens"]) as td:
        tokens = np.asarray(td.tokens, dtype=np.int64)
    seq = 32
    with Loader(files["tokens"], batch_size=4, order=order, seed=2, page_cache=MemoryPages, array_type="numpy",
                pipelines={"tokens": [TokenWindows(seq)]}) as ld:
        n = 0
        for batch in ld:
            for w, inp, tgt in zip(batch["_index"].tolist(), batch["input"], batch["target"]):
                np.testing.assert_array_equal(inp, tokens[w * seq : w * seq + seq])
                np.testing.assert_array_equal(tgt, tokens[w * seq + 1 : w * seq + seq + 1])
                n += 1
        assert n == len(ld) * 4


def test_a_storage_kind_is_refused_for_a_url_and_a_non_page_source(files):
    for bad in (dict, "memory", MemoryPages.__new__(MemoryPages)):  # a class that is no PageSource, an instance
        with pytest.raises(ValueError, match="page_cache"):
            Loader(files["a"], batch_size=4, page_cache=bad)
    with StaticHTTP(files["a"].parent) as http:
        with pytest.raises(ValueError, match=r"a\.pageset: page_cache=MemoryPages reads local files; a URL is read"):
            Loader(f"{http.url}/a.pageset", batch_size=4, page_cache=MemoryPages)
