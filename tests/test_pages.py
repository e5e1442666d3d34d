"""Page access for the loader's threads (``load/pages.py``): the process page cache returns the file's bytes for
records inside one page, records larger than a page and token windows straddling pages; its LRU holds at most
``capacity`` pages; a short read is an error naming the byte. And the page verifier checks exactly the pages a
span touches."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pageset import Int, RGBImage, TruncatedFileError, open_dataset, write_dataset, write_tokens
from pageset.load.pages import PageVerifier, PreadPages, ProcessPageCache
from pageset.read import Dataset


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory, photo_arrays):
    """Full photos (each record owns several 4 KiB pages) between tiny crops (several per page)."""
    samples = []
    for k, a in enumerate(photo_arrays):
        samples += [(a, k), (np.ascontiguousarray(a[:8, :8]), 100 + k), (np.ascontiguousarray(a[8:16, :8]), 200 + k)]
    path = tmp_path_factory.mktemp("pages") / "mixed.pageset"
    write_dataset(path, samples, {"image": RGBImage(jpeg_quality=80), "label": Int()}, num_workers=0,
                  page_size=4096, progress=False)
    return path


def _layout(path):
    with open_dataset(path) as ds:
        return (ds.data_offset, ds.data_length, ds.page_size, ds.index["_offset"].astype(np.int64),
                ds.index["_length"].astype(np.int64))


@pytest.mark.parametrize("source", ["os", "process"])
def test_page_sources_return_the_file_bytes_for_every_record(mixed_file, source):
    data_offset, data_length, page_size, offs, lens = _layout(mixed_file)
    raw = np.frombuffer(mixed_file.read_bytes(), np.uint8)
    big = lens > page_size
    assert big.any() and (~big).sum() >= 2 * big.sum()  # both kinds, several small records per page
    with open_dataset(mixed_file) as ds:
        pages = PreadPages(ds) if source == "os" else ProcessPageCache(ds, capacity=3)
        staging: dict = {}
        rng = np.random.default_rng(0)
        for t in range(24):
            if t % 3 == 0:  # neighbours in file order: one read per run of adjacent records
                lo = int(rng.integers(0, offs.shape[0] - 6))
                ids = np.arange(lo, lo + int(rng.integers(1, 7)))
            else:
                ids = rng.choice(offs.shape[0], size=int(rng.integers(1, 9)), replace=False)
            for ordered in (True, False):
                buf, out_offs = pages.gather(offs[ids], lens[ids], staging, ordered=ordered)
                # back to back from 0: in batch order, or (ordered=False) pread packs them in file order (one read
                # per run of neighbours, even when the batch holds them out of order)
                in_file_order = source == "os" and not ordered
                packed = np.argsort(offs[ids], kind="stable") if in_file_order else np.arange(ids.shape[0])
                assert out_offs[packed[0]] == 0 and (np.diff(out_offs[packed]) == lens[ids][packed][:-1]).all()
                for j, rid in enumerate(ids):
                    got = buf[out_offs[j] : out_offs[j] + lens[rid]]
                    assert np.array_equal(got, raw[offs[rid] : offs[rid] + lens[rid]]), (t, rid)
        # the staging buffer grows to a batch of the largest records, and is reused when big enough
        order = np.argsort(lens)[::-1][:4]
        buf, _ = pages.gather(offs[order], lens[order], staging)
        assert buf is staging["bytes"] and buf.shape[0] >= lens[order].sum()
        assert pages.gather(offs[order[:1]], lens[order[:1]], staging)[0] is buf
        if source == "process":
            assert pages.resident_pages <= 3 and pages.peak_resident <= 3
        pages.close()
        pages.close()  # idempotent


def test_process_cache_lru_hits_misses_and_eviction(mixed_file):
    data_offset, data_length, page_size, _, _ = _layout(mixed_file)
    raw = np.frombuffer(mixed_file.read_bytes(), np.uint8)
    n_pages = -(-data_length // page_size)
    ds = open_dataset(mixed_file)
    cache = ProcessPageCache(ds, capacity=2)
    try:
        p0 = cache.page(0)
        assert (cache.hits, cache.misses) == (0, 1)
        assert np.array_equal(cache.page(0), p0) and (cache.hits, cache.misses) == (1, 1)  # a copy, from the cache
        cache.page(1)
        cache.page(0)  # page 0 is now the most recent: page 1 is evicted next
        cache.page(2)
        assert list(cache._lru) == [0, 2] and (cache.hits, cache.misses) == (2, 3)
        cache.page(1)
        assert list(cache._lru) == [2, 1] and cache.misses == 4
        last = cache.page(n_pages - 1)  # the short last page
        assert last.shape[0] == data_length - (n_pages - 1) * page_size
        assert np.array_equal(last, raw[data_offset + (n_pages - 1) * page_size : data_offset + data_length])
        assert np.array_equal(p0, raw[data_offset : data_offset + page_size])  # valid after eviction
    finally:
        cache.close()
    one = ProcessPageCache(ds, capacity=0)  # at least 1
    try:
        assert one.capacity == 1
        one.page(0)
        one.page(1)
        assert list(one._lru) == [1]
    finally:
        one.close()
        ds.close()


def test_process_cache_read_of_a_cut_file_names_the_byte_range(mixed_file, tmp_path):
    data_offset, data_length, page_size, offs, lens = _layout(mixed_file)
    big = int(np.flatnonzero(lens > page_size)[0])
    keep = int(offs[big]) + page_size + 100  # the file will end inside the second page of a large record
    path = tmp_path / "cut.pageset"
    path.write_bytes(mixed_file.read_bytes())
    k = (keep - data_offset) // page_size
    with open_dataset(path) as ds:
        cache = ProcessPageCache(ds, capacity=4)
        os.truncate(path, keep)  # cut under the reader
        assert cache.page(k - 1).shape == (page_size,)
        page_start = data_offset + k * page_size
        with pytest.raises(TruncatedFileError, match=rf"short read of bytes \[{page_start}, {page_start + page_size}\)"):
            cache.page(k)
        with pytest.raises(TruncatedFileError, match=rf"short read of bytes \[{offs[big]}, {offs[big] + lens[big]}\)"):
            cache.gather(offs[[big]], lens[[big]], {})  # a large record is read directly, not cached
        cache.close()


def test_page_verifier_checks_exactly_the_touched_pages(mixed_file):
    data_offset, _, page_size, offs, lens = _layout(mixed_file)
    with open_dataset(mixed_file) as ds:
        ver = PageVerifier(ds)
        big = int(np.flatnonzero(lens > page_size)[0])
        ver.check(offs[[big]], lens[[big]], np.array([big]))
        first, last = (offs[big] - data_offset) // page_size, (offs[big] + lens[big] - 1 - data_offset) // page_size
        assert np.flatnonzero(ver.done).tolist() == list(range(first, last + 1))
        small = int(np.flatnonzero((lens > 0) & (lens < page_size // 4))[-1])
        ver.check(offs[[small]], lens[[small]], np.array([small]))
        page = (offs[small] - data_offset) // page_size
        assert np.flatnonzero(ver.done).tolist() == sorted({*range(first, last + 1), page})


def test_process_cache_serves_records_inside_a_page_from_the_cache(mixed_file):
    """Records within one page come from cached pages (hits and misses count page lookups, one per distinct page
    of a gather); only records larger than a page bypass the cache (mutation survivors: a page test that sends
    every record to a direct read)."""
    _, _, page_size, offs, lens = _layout(mixed_file)
    small = np.flatnonzero((lens > 0) & (lens < page_size // 4))[:6]
    with open_dataset(mixed_file) as ds:
        cache = ProcessPageCache(ds, capacity=8)
        cache.gather(offs[small], lens[small], {})
        pages = {int((o - ds.data_offset) // page_size) for o in offs[small]}
        assert cache.misses == len(pages) and cache.hits == 0
        assert set(cache._lru) == pages
        cache.gather(offs[small], lens[small], {})
        assert cache.misses == len(pages) and cache.hits == len(pages)
        big = np.flatnonzero(lens > page_size)[:2]
        cache.gather(offs[big], lens[big], {})
        assert cache.misses == len(pages) and set(cache._lru) == pages  # large records are not cached
        cache.close()


def test_page_verifier_span_edges(mixed_file):
    """Spans ending one byte into a page, spans whose last page is already checked but not their first, and the
    file's last page: every page a span touches is checked (mutation survivors of PageVerifier.check)."""
    data_offset, data_length, page_size, _, _ = _layout(mixed_file)
    with open_dataset(mixed_file) as ds:
        n = ds.page_count
        ver = PageVerifier(ds)
        start = np.array([data_offset + 3 * page_size - 10])
        ver.check(start, np.array([11]), np.array([0]))  # the last byte is the first byte of page 3
        assert np.flatnonzero(ver.done).tolist() == [2, 3]
        ver = PageVerifier(ds)
        ver.check(np.array([data_offset + 6 * page_size]), np.array([10]), np.array([0]))  # page 6 only
        ver.check(np.array([data_offset + 5 * page_size + 5]), np.array([page_size + 10]), np.array([1]))
        assert np.flatnonzero(ver.done).tolist() == [5, 6]  # page 5 checked although page 6 was done
        ver = PageVerifier(ds)
        ver.check(np.array([data_offset + (n - 2) * page_size]), np.array([10]), np.array([0]))
        ver.check(np.array([data_offset + (n - 2) * page_size + 20]), np.array([data_length - (n - 2) * page_size - 20]),
                  np.array([1]))
        assert np.flatnonzero(ver.done).tolist() == [n - 2, n - 1]  # the file's last page too


def test_pread_pages_runs_and_a_cut_file(mixed_file, tmp_path):
    """PreadPages merges only records that follow each other in the file (not ones in reverse order); a read
    past the end of a file cut under the reader names the byte range that came up short."""
    data_offset, _, page_size, offs, lens = _layout(mixed_file)
    raw = np.frombuffer(mixed_file.read_bytes(), np.uint8)
    adjacent = np.flatnonzero(offs[1:] == offs[:-1] + lens[:-1])
    j = int(adjacent[0])
    with open_dataset(mixed_file) as ds:
        pages = PreadPages(ds)
        for ids in ([j + 1, j], [j, j + 1], [j + 1, j, j + 1]):
            ids = np.array(ids)
            buf, out = pages.gather(offs[ids], lens[ids], {})
            for k, rid in enumerate(ids):
                assert np.array_equal(buf[out[k] : out[k] + lens[rid]], raw[offs[rid] : offs[rid] + lens[rid]]), ids
    path = tmp_path / "cut.pageset"
    path.write_bytes(mixed_file.read_bytes())
    big = int(np.flatnonzero(lens > page_size)[-1])
    with open_dataset(path) as ds:
        pages = PreadPages(ds)
        os.truncate(path, int(offs[big]) + 10)
        with pytest.raises(TruncatedFileError, match=rf"short read of bytes \[{offs[big]}, {offs[big] + lens[big]}\): "
                                                     r"10 bytes read"):
            pages.gather(offs[[big]], lens[[big]], {})


def test_token_windows_straight_from_the_page_sources(tmp_path):
    """read_windows: PreadPages reads any windows; the process cache serves windows inside cached pages (a hit per
    distinct page, those pages moved to the LRU's end) and declines, changing nothing, when a window's page is not
    cached or a window crosses pages (the stage then gathers)."""
    tokens = np.random.default_rng(3).integers(0, 60000, 20_000).astype(np.uint16)
    path = tmp_path / "t.pageset"
    write_tokens(path, [tokens], None, eos_id=60001, num_workers=0, page_size=4096, progress=False)
    stream = np.append(tokens, 60001)
    L = 50
    stride, per_page = 2 * L, 4096 // 2

    def check(ids, inp, tgt):
        for j, w in enumerate(ids):
            np.testing.assert_array_equal(inp[j], stream[w * L : w * L + L])
            np.testing.assert_array_equal(tgt[j], stream[w * L + 1 : w * L + L + 1])

    with Dataset(path) as ds:
        inp, tgt = np.empty((6, L), dtype=np.int64), np.empty((6, L), dtype=np.int64)
        ids = np.array([0, 399, 17, 250, 41, 3], dtype=np.int64)  # 399: the last window
        assert PreadPages(ds).read_windows(ds.data_offset, stride, ids, np.uint16, inp, tgt, {})
        check(ids, inp, tgt)
        cache = ProcessPageCache(ds, capacity=5)
        first_page = ids * L // per_page
        inside = ids[(ids * L + L) // per_page == first_page]  # windows within one page
        assert not cache.read_windows(ds.data_offset, stride, inside, np.uint16, inp, tgt, {})  # nothing cached
        assert (cache.hits, cache.misses) == (0, 0) and (cache._pins == 0).all()
        for k in sorted(set((inside * L // per_page).tolist())):
            cache.page(k)
        cache.page(3)  # the most recently used page, until the windows' pages are used again
        assert list(cache._lru)[0] != 3 and list(cache._lru)[-1] == 3
        hits = cache.hits
        inp[:] = -1
        assert cache.read_windows(ds.data_offset, stride, inside, np.uint16, inp[: inside.size], tgt[: inside.size],
                                  {})
        check(inside, inp, tgt)
        pages = sorted(set((inside * L // per_page).tolist()))
        assert len(pages) >= 3 and cache.hits == hits + len(pages) and list(cache._lru) == [3, *pages]
        assert (cache._pins == 0).all()
        starts = np.arange(400) * L
        across = np.flatnonzero((starts + L) // per_page != starts // per_page)[:1]
        assert not cache.read_windows(ds.data_offset, stride, across, np.uint16, inp[:1], tgt[:1], {})
        cache.close()


@pytest.mark.parametrize("kind", ["records", "tokens"])
def test_default_process_cache_checks_each_page_once_as_it_enters(tmp_path, kind):
    """page_cache="process" reads whole pages anyway: with default settings each page's CRC-32 is checked when
    it first enters the cache, so a flipped byte raises ChecksumMismatchError naming the page, not a wrong batch.
    page_cache="os" (per-record preads) checks nothing by default: the README says which calls check."""
    from pageset import Bytes, ChecksumMismatchError, Loader, TokenWindows

    path = tmp_path / f"{kind}.pageset"
    rng = np.random.default_rng(7)
    if kind == "records":
        write_dataset(path, [(rng.integers(0, 256, 300, dtype=np.uint8).tobytes(),) for _ in range(64)],
                      {"b": Bytes()}, num_workers=0, page_size=4096, progress=False)
        pipelines = None
    else:
        write_tokens(path, [rng.integers(0, 1000, 9000).astype(np.uint16)], None, eos_id=1001, num_workers=0,
                     page_size=4096, progress=False)
        pipelines = {"tokens": [TokenWindows(32)]}
    with Dataset(path) as ds:
        offset, pages = ds.data_offset + 2 * ds.page_size + 100, ds.page_count  # a byte of page 2
        assert pages > 3
    kw = dict(batch_size=4, order="sequential", num_threads=1, pipelines=pipelines)
    with Loader(path, page_cache="process", **kw) as loader:  # intact: every page checked, nothing raised
        assert sum(1 for _ in loader) == loader.steps_per_epoch
        assert loader._pages._checked[:pages].all()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    with Loader(path, page_cache="process", **kw) as loader:
        with pytest.raises(ChecksumMismatchError, match=r"page 2 .*page CRC-32 mismatch"):
            for _ in loader:
                pass
    with Loader(path, page_cache="os", **kw) as loader:  # documented: per-record reads are not checked
        assert sum(1 for _ in loader) == loader.steps_per_epoch


def test_contiguous_runs_pack_records_in_file_order_one_read_per_run_of_neighbours():
    """Hand-counted: records at 30, 0, 10, 50 (lengths 10, 10, 10, 5), in batch order: 3 reads (0 and 10 touch);
    with ordered=False they pack as 0-10 | 10-20 | 30-40 | 50-55 in file
    order; 0 and 10 touch (one read of 20 bytes), 30 and 50 do not; each record is found at its packed offset.
    The same offset twice is read twice (a repeated id), in batch order."""
    from pageset.load.pages import contiguous_runs

    offs, lens = np.array([30, 0, 10, 50]), np.array([10, 10, 10, 5])
    out_offs, total, run_offs, run_dst, run_lens = contiguous_runs(offs, lens)  # ordered: batch order, 3 reads
    assert out_offs.tolist() == [0, 10, 20, 30] and total == 35 and run_offs.tolist() == [30, 0, 50]
    out_offs, total, run_offs, run_dst, run_lens = contiguous_runs(offs, lens, ordered=False)
    assert out_offs.tolist() == [20, 0, 10, 30] and total == 35
    assert run_offs.tolist() == [0, 30, 50] and run_dst.tolist() == [0, 20, 30] and run_lens.tolist() == [20, 10, 5]
    out_offs, total, run_offs, run_dst, run_lens = contiguous_runs(np.array([7, 2, 7]), np.array([3, 5, 3]), False)
    assert out_offs.tolist() == [5, 0, 8] and total == 11  # 2-7 and 7-10 touch; the second 7 is a new read
    assert run_offs.tolist() == [2, 7] and run_dst.tolist() == [0, 8] and run_lens.tolist() == [8, 3]
    out_offs, total, run_offs, run_dst, run_lens = contiguous_runs(np.array([4, 9]), np.array([5, 1]), False)
    assert out_offs.tolist() == [0, 5] and total == 6 and run_offs.tolist() == [4] and run_lens.tolist() == [6]
