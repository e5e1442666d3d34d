"""The Loader over token files: windows, coverage, document outputs, devices."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from resources import Resources

from pageset import Loader, PipelineError, ToDevice, TokenWindows, ToTensor, open_tokens, write_tokens
from pageset.load import stages
from pageset.ops.tokens import document_outputs


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 60000, size=int(rng.integers(1, 200))) for _ in range(300)]
    path = tmp_path_factory.mktemp("tokload") / "t.pageset"
    write_tokens(path, docs, eos_id=60001, num_workers=0, page_size=4096, progress=False)
    return path


@pytest.mark.parametrize("page_cache", ["os", "process"])
@pytest.mark.parametrize("order", ["sequential", "random", "quasi_random"])
@pytest.mark.parametrize("seq_len", [16, 100])
def test_windows_cover_every_target_once(token_file, order, seq_len, page_cache):
    with open_tokens(token_file) as td:
        tokens = np.asarray(td.tokens, dtype=np.int64)
        n = td.num_windows(seq_len)
    G = next(g for g in range(8, 1, -1) if n % g == 0) if any(n % g == 0 for g in range(2, 9)) else 1
    with Loader(token_file, batch_size=G, order=order, seed=2, num_threads=2, page_cache=page_cache,
                pipelines={"tokens": [TokenWindows(seq_len)]}) as loader:
        hits = np.zeros(tokens.shape[0], dtype=np.int64)
        for batch in loader:
            assert batch["input"].shape == batch["target"].shape == (len(batch["_index"]), seq_len)
            for w, inp, tgt in zip(batch["_index"], batch["input"], batch["target"]):
                start = int(w) * seq_len
                np.testing.assert_array_equal(inp, tokens[start : start + seq_len])
                np.testing.assert_array_equal(tgt, tokens[start + 1 : start + seq_len + 1])
                hits[start + 1 : start + seq_len + 1] += 1
    covered = n * seq_len
    assert (hits[1 : covered + 1] == 1).all() and hits[0] == 0 and (hits[covered + 1 :] == 0).all()


def test_document_outputs_match_ops_and_torch(token_file):
    with Loader(token_file, batch_size=6, seed=4, num_threads=2, order="random",
                pipelines={"tokens": [TokenWindows(64, document_outputs=True, input_dtype="int32"),
                                      ToTensor(), ToDevice("cpu")]}) as loader:
        for k, batch in enumerate(loader):
            assert batch["input"].dtype == torch.int32 and batch["target"].dtype == torch.int64
            assert batch["position_ids"].dtype == batch["labels"].dtype == torch.int64
            assert batch["doc_ids"].dtype == batch["cu_seqlens"].dtype == torch.int32
            ref = document_outputs(batch["input"].numpy(), batch["target"].numpy(), 60001)
            np.testing.assert_array_equal(batch["position_ids"].numpy(), ref.position_ids)
            np.testing.assert_array_equal(batch["doc_ids"].numpy(), ref.doc_ids)
            np.testing.assert_array_equal(batch["labels"].numpy(), ref.labels)
            np.testing.assert_array_equal(batch["cu_seqlens"].numpy(), ref.cu_seqlens)
            assert batch["max_seqlen"] == ref.max_seqlen and isinstance(batch["max_seqlen"], int)
            assert (batch["labels"][batch["input"] == 60001] == -100).all()
            if k == 5:
                break


def test_short_corpus_and_bad_pipelines(tmp_path, token_file):
    path = tmp_path / "short.pageset"
    write_tokens(path, [np.arange(10)], eos_id=99, num_workers=0, progress=False)
    with pytest.raises(ValueError) as ei:
        Loader(path, batch_size=1, pipelines={"tokens": [TokenWindows(11)]})
    assert str(ei.value) == (f"{path}: 11 tokens, fewer than seq_len + 1 = 12: no window fits (windows are never "
                             "padded); use a smaller seq_len or more data")
    with pytest.raises(ValueError, match=r"11 tokens, fewer than seq_len \+ 1 = 13"):
        Loader(path, batch_size=1, pipelines={"tokens": [TokenWindows(12)]})
    with Loader(path, batch_size=1, pipelines={"tokens": [TokenWindows(10)]}) as loader:
        (batch,) = list(loader)  # 11 tokens: exactly one window
        np.testing.assert_array_equal(batch["target"][0], np.r_[np.arange(1, 10), 99])
    with pytest.raises(PipelineError, match="TokenWindows"):
        Loader(token_file, batch_size=2)
    with pytest.raises(ValueError, match="seq_len"):
        TokenWindows(0)


def test_to_device_cuda_without_cuda_is_a_clear_error(token_file):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        Loader(token_file, batch_size=2, pipelines={"tokens": [TokenWindows(8), ToDevice("cuda")]})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_equal_cpu_batches(token_file):
    kw = dict(batch_size=4, seed=1, order="random", num_threads=2)
    with Loader(token_file, pipelines={"tokens": [TokenWindows(32), ToTensor()]}, **kw) as cpu:
        ref = [b["input"].clone() for b in cpu]
    with Loader(token_file, pipelines={"tokens": [TokenWindows(32), ToDevice("cuda")]}, **kw) as gpu:
        got = []
        for b in gpu:
            assert b["input"].is_cuda
            torch.cuda._sleep(1_000_000)  # keep the consumer stream busy while later copies are queued
            got.append(b["input"])
        torch.cuda.synchronize()
    assert len(got) == len(ref) > 0  # zip alone would accept a GPU epoch that stops early
    for k, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b.cpu()), k


def _process_cache_epoch(path, seq_len, switch_to_threads=False):
    """Run one quasi-random epoch with page_cache="process"; return the cache's counters and the peak bytes
    allocated during the epoch (numpy reports its allocations to tracemalloc). ``switch_to_threads``: the
    measured epoch's inline fills count as slow, so the loader hands over to its threads in the middle of it
    (what a loaded machine does by itself, whenever the median fill exceeds Loader._INLINE_SLOW_S)."""
    import tracemalloc

    with Loader(path, batch_size=64, order="quasi_random", seed=5, num_threads=2, window_pages=2,
                page_cache="process", pipelines={"tokens": [TokenWindows(seq_len)]}) as loader:
        with open_tokens(path) as td:
            tokens = np.asarray(td.tokens)
        for batch in loader:  # epoch 0 compiles (or loads) the kernels and grows each thread's staging buffer
            del batch  # (a batch still held when its slot comes round again gets fresh buffers)
        it = iter(loader)  # epoch 1 is measured: it reads every page again (the file is 3x the cache)
        misses = loader._pages.misses
        if switch_to_threads:
            loader._INLINE_SLOW_S = 0.0
            assert loader._inline or loader._pool.alive()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for batch in it:  # every window equals the file's tokens: the cache never serves stale bytes
                for w, inp in zip(batch["_index"].tolist(), batch["input"]):
                    np.testing.assert_array_equal(inp, tokens[w * seq_len : w * seq_len + seq_len])
                assert loader._pages.resident_pages <= loader._pages.capacity
            peak = tracemalloc.get_traced_memory()[1] - base
            if switch_to_threads:
                assert not loader._inline and loader._pool.alive() == 2
        finally:
            tracemalloc.stop()
        cache = loader._pages
        return {"capacity": cache.capacity, "peak_resident": cache.peak_resident, "misses": cache.misses - misses,
                "arena_bytes": cache._arena.nbytes, "peak": peak}


def test_process_cache_memory_is_bounded_whatever_the_file_size(tmp_path):
    """The page cache holds at most ``capacity`` pages (one arena, allocated once), reads each page once per
    quasi-random epoch, and allocates no page while loading, for a file 4x larger too; also when the inline
    fills hand over to the threads during the epoch (the ring of batch buffers exists before it: on a loaded
    machine the hand-over happens by itself, and used to allocate the missing slots mid-epoch)."""
    rng = np.random.default_rng(3)
    page = 1 << 18
    stats = {}
    for n_pages in (24, 96):  # 256 KiB pages of uint16 tokens
        path = tmp_path / f"t{n_pages}.pageset"
        write_tokens(path, [rng.integers(0, 60000, n_pages * page // 2).astype(np.uint16)], None, eos_id=60001,
                     num_workers=0, page_size=page, progress=False)
        stats[n_pages] = _process_cache_epoch(path, 2048, switch_to_threads=n_pages == 96)
    small, big = stats[24], stats[96]
    # window_pages * ceil(positions in flight / windows per quasi-random window) + 2, whatever the file size:
    # 2 * ceil((4 batches ahead + 1) * 64 / (2 pages * 64 windows)) + 2
    assert small["capacity"] == big["capacity"] == 2 * 3 + 2
    assert small["arena_bytes"] == big["arena_bytes"] == big["capacity"] * page
    assert small["peak_resident"] <= small["capacity"] and big["peak_resident"] <= big["capacity"]
    # each page read once per epoch (the windows straddling two pages are read directly, never cached)
    assert small["misses"] <= 24 + 2 and big["misses"] <= 96 + 2
    # no page-sized allocation during the epoch (the arena exists before it), whatever the file size
    assert big["peak"] < page and small["peak"] < page, (small, big)


@pytest.mark.parametrize("seq_len", [16, 100, 1000, 5000])
def test_windows_per_page_count_window_starts(token_file, seq_len):
    """The quasi-random order groups windows by the page holding their FIRST token: records_per_page must count
    exactly the window starts w * seq_len in each page (a window straddling a boundary belongs to the page it
    starts in), and the epoch's ids are the order-v1 permutation of those counts."""
    from pageset.order import epoch_permutation

    with open_tokens(token_file) as td:
        n = td.num_windows(seq_len)
        itemsize, page_size, pages = td.tokens.dtype.itemsize, td.dataset.page_size, td.dataset.page_count
    starts = np.arange(n, dtype=np.int64) * seq_len * itemsize
    expected = np.bincount(starts // page_size, minlength=max(pages, 1))
    with Loader(token_file, batch_size=1, order="quasi_random", seed=5, window_pages=2, num_threads=1,
                pipelines={"tokens": [TokenWindows(seq_len)]}) as loader:
        np.testing.assert_array_equal(loader._page_sizes, expected)
        ids = [int(b["_index"][0]) for b in loader]
    assert ids == epoch_permutation(expected, 5, 0, "quasi_random", 2).tolist()


def test_one_page_file_and_a_batch_of_only_eos(tmp_path):
    """A token file of one page has one page of windows; a batch whose inputs are all EOS has B * L one-token
    segments: cu_seqlens holds all B * L + 1 boundaries (its buffer's full size)."""
    path = tmp_path / "eos.pageset"
    write_tokens(path, [np.array([], np.int64)] * 60, eos_id=7, num_workers=0, progress=False)
    with open_tokens(path) as td:
        assert td.dataset.page_count == 1 and len(td) == 60 and (np.asarray(td.tokens) == 7).all()
    with Loader(path, batch_size=3, order="quasi_random", num_threads=1,
                pipelines={"tokens": [TokenWindows(4, document_outputs=True)]}) as loader:
        assert loader._page_sizes.tolist() == [(60 - 1) // 4]
        batch = next(iter(loader))
    np.testing.assert_array_equal(np.asarray(batch["cu_seqlens"]), np.arange(3 * 4 + 1))
    assert batch["max_seqlen"] == 1 and (np.asarray(batch["labels"]) == -100).all()


def test_resume_refuses_another_seq_len(token_file):
    # Windows are the records of a token file: a cursor counted in windows of 16 tokens means nothing for 32.
    from pageset.order import StateMismatchError

    def make(seq_len):
        return Loader(token_file, batch_size=4, order="random", seed=3, num_threads=1,
                      pipelines={"tokens": [TokenWindows(seq_len)]})

    with make(16) as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = loader.state_dict()
        rest = [b["_index"].clone() for b in it]
    assert state["seq_len"] == 16 and state["cursor"] == 12
    with make(32) as other, pytest.raises(StateMismatchError, match="seq_len") as err:
        other.load_state_dict(state)
    assert err.value.saved == 16 and err.value.current == 32 and "TokenWindows" in str(err.value)
    with make(16) as same:
        same.load_state_dict(state)
        resumed = [b["_index"].clone() for b in same]
    assert len(resumed) == len(rest) > 0 and all(torch.equal(a, b) for a, b in zip(resumed, rest))
    # A state saved before seq_len was recorded (no key) still resumes on the same file.
    legacy = {k: v for k, v in state.items() if k != "seq_len"}
    with make(16) as old:
        old.load_state_dict(legacy)
        assert old.steps_remaining == len(old) - 3


def test_too_few_windows_names_the_file_and_seq_len(token_file):
    with open_tokens(token_file) as td:
        seq_len = len(td) // 3  # 2 or 3 windows
        n = td.num_windows(seq_len)
    with pytest.raises(ValueError, match=rf"^{token_file}: drop_last=True with N={n} records.*windows: {n} of "
                                          rf"seq_len={seq_len}"):
        Loader(token_file, batch_size=n + 1, pipelines={"tokens": [TokenWindows(seq_len)]})
    with Loader(token_file, batch_size=n + 1, drop_last=False, pipelines={"tokens": [TokenWindows(seq_len)]}) as ok:
        assert len(ok) == 1


@pytest.mark.parametrize("page_cache", ["os", "process"])
def test_small_token_batches_are_filled_inline_and_equal_the_thread_pool(token_file, page_cache, monkeypatch):
    """A token batch below a slice (~256K tokens) is filled by the thread calling next(): no thread is started,
    and the batches (outputs, ids, padding, document outputs) are those the thread pool makes."""
    kw = dict(batch_size=5, order="quasi_random", seed=3, drop_last=False, page_cache=page_cache,
              pipelines={"tokens": [TokenWindows(40, document_outputs=True)]})

    def as_bytes(batch):
        return {k: v.numpy().tobytes() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def epochs(loader, n=2):
        return [as_bytes(batch) for _ in range(n) for batch in loader]

    res = Resources()
    with Loader(token_file, num_threads=3, **kw) as loader:
        assert res.new_py_threads() == []
        inline = epochs(loader)
        assert res.new_py_threads() == []
    assert any(b["_is_padding"] != bytes(5) for b in inline)  # drop_last=False: the wrap-around batch
    # fills that turn out slow (here: any) hand over to the threads mid-epoch, batches unchanged
    monkeypatch.setattr(Loader, "_INLINE_CHECK", 3)
    monkeypatch.setattr(Loader, "_INLINE_SLOW_S", 0.0)
    with Loader(token_file, num_threads=2, **kw) as loader:
        it = iter(loader)
        head = [as_bytes(next(it)) for _ in range(2)]
        assert res.new_py_threads() == [] and loader._inline
        head.append(as_bytes(next(it)))  # the third fill: their median is over the limit
        assert len(res.new_py_threads()) == 2 and not loader._inline
        state = loader.state_dict()
        rest = [as_bytes(b) for b in it] + epochs(loader, 1)  # the same iterator goes on, then the next epoch
    assert head + rest == inline
    with Loader(token_file, num_threads=1, **kw) as loader:  # resume from the state saved at the switch
        loader.load_state_dict(state)
        assert epochs(loader, 1) == inline[3 : len(inline) // 2]
    monkeypatch.setattr(stages.TokenStage, "inline", False)
    with Loader(token_file, num_threads=2, **kw) as loader:
        assert len(res.new_py_threads()) == 2
        assert epochs(loader) == inline


@pytest.mark.skipif(__import__("numba").config.DISABLE_JIT, reason="nothing is compiled under NUMBA_DISABLE_JIT")
def test_one_line_while_kernels_compile_none_from_the_cache(token_file, tmp_path):
    """A process that compiles the kernels (an empty Numba cache) says so once on stderr; the next process loads
    them from the cache and prints nothing. Each in a fresh interpreter, with its own NUMBA_CACHE_DIR."""
    import os
    import subprocess
    import sys

    script = ("import sys; from pageset import Loader, TokenWindows\n"
              "with Loader(sys.argv[1], batch_size=2, num_threads=1, pipelines={'tokens': [TokenWindows(16)]}) as l:\n"
              "    n = sum(1 for _ in l)\n"
              "print(n)\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    runs = [subprocess.run([sys.executable, "-c", script, str(token_file)], env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0 and int(r.stdout) > 0, r.stderr
    first, second = (r.stderr.splitlines() for r in runs)
    notice = [line for line in first if line.startswith("pageset: compiling the Numba kernels (once after an install")]
    assert len(notice) == 1 and len(first) == 1, first
    assert second == [], second
