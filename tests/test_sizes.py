"""64-bit sizes: a sparse > 4 GiB record file and a > 2^31-token file read correctly; order and window arithmetic
past 2^31 positions (issue 6, part 4).

The big files are assembled with the format's own building blocks (``packing.place_record``,
``schema.build_schema`` / ``parse_schema``, ``tail.write_tail``) as SPARSE files: the data area is mostly
a hole (zeros), so a 4.5 GiB file costs a few MiB of disk and a few seconds. Page CRCs of all-zero pages are
computed once; pages holding real bytes are assembled in memory and checksummed. The result is a valid file
per ``formats/v1.md`` (the dataset id and the CRCs of the pages that hold data are checked in the test;
``verify()`` over the whole file is skipped only because it would read 4.5 GiB of holes).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import zlib

import numpy as np
import pytest

from pageset import Bytes, Loader, NDArray, Tokens, open_dataset, open_tokens
from pageset.format import constants as C
from pageset.format.checksum import ALGORITHM
from pageset.format.layout import PAGE_CHECKSUM
from pageset.format.schema import build_schema, canonical_json, parse_schema
from pageset.ops.tokens import gather_windows, num_windows
from pageset.order import (
    EpochOrder,
    epoch_length,
    quasi_random_range,
    rank_positions,
    steps_per_epoch,
    window_layout,
)
from pageset.write.tail import write_tail
from pageset.write.packing import page_count, place_record

GiB = 1 << 30
PAGE = 1 << 22  # 4 MiB pages: ~1,100 pages over 4.5 GiB, every all-zero one with the same CRC


def _free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _zero_crc(n: int) -> int:
    crc, chunk = 0, bytes(min(n, 1 << 20))
    while n:
        k = min(n, len(chunk))
        crc = zlib.crc32(chunk[:k], crc)
        n -= k
    return crc


def _write_sparse(path, *, data_length, chunks, schema, index_bytes, record_count, required_features=0,
                  doc_offsets: bytes | None = None) -> None:
    """A valid pageset file whose data area is zero except ``chunks`` ([(offset in the data area, bytes)])."""
    n_pages = page_count(data_length, PAGE)
    full_zero = _zero_crc(PAGE)
    crcs = np.empty(n_pages, dtype=PAGE_CHECKSUM)
    touched = {}
    for rel, blob in chunks:
        for k in range(rel // PAGE, (rel + len(blob) - 1) // PAGE + 1):
            touched.setdefault(k, []).append((rel, blob))
    for k in range(n_pages):
        start = k * PAGE
        length = min(PAGE, data_length - start)
        if k not in touched:
            crcs[k] = full_zero if length == PAGE else _zero_crc(length)
            continue
        page = bytearray(length)
        for rel, blob in touched[k]:
            lo, hi = max(rel, start), min(rel + len(blob), start + length)
            page[lo - start : hi - start] = blob[lo - rel : hi - rel]
        crcs[k] = zlib.crc32(page)
    schema_bytes = canonical_json(schema)
    extra = doc_offsets or b""
    dataset_id = hashlib.sha256(schema_bytes + index_bytes + crcs.tobytes() + extra).digest()
    sections = [(C.SECTION_SCHEMA, C.SECTION_FLAG_REQUIRED, schema_bytes),
                (C.SECTION_INDEX, C.SECTION_FLAG_REQUIRED, index_bytes),
                (C.SECTION_PAGE_CHECKSUMS, 0, crcs.tobytes()),
                (C.SECTION_METADATA, 0, canonical_json({"lineage": {"test": "sparse"}, "user": {}}))]
    if doc_offsets is not None:
        sections.append((C.SECTION_DOC_OFFSETS, C.SECTION_FLAG_REQUIRED, doc_offsets))
    with open(path, "wb") as f:
        f.truncate(C.DATA_OFFSET + data_length)  # a hole: no disk blocks
        for rel, blob in chunks:
            f.seek(C.DATA_OFFSET + rel)
            f.write(blob)
        write_tail(f, page_size=PAGE, data_length=data_length, page_count=n_pages, record_count=record_count,
                   required_features=required_features, dataset_id=dataset_id, sections=sections)


@pytest.fixture(scope="module")
def big_records(tmp_path_factory):
    """4 records; record 0 holds a 4.5 GiB zero Bytes value, so every NDArray value lies past 4 GiB."""
    folder = tmp_path_factory.mktemp("sizes")
    if _free_bytes(folder) < (1 << 30):
        pytest.skip("needs about 100 MiB of real disk (1 GiB free to be safe) for a sparse 4.5 GiB file")
    fields = {"big": Bytes(), "small": NDArray("int64", (4,))}
    schema = build_schema(fields, {}, {"page_size": PAGE, "checksum": ALGORITHM})
    _, row = parse_schema(schema)
    smalls = [np.array([k, k << 33, -k, 7 * k + 1], dtype="<i8") for k in range(4)]
    bigs = [None] + [f"beyond 4 GiB, record {k}".encode() * k for k in range(1, 4)]
    big_len0 = 4 * GiB + GiB // 2 + 12345
    index = np.zeros(4, dtype=row)
    chunks, cursor = [], 0
    for k in range(4):
        blen = big_len0 if k == 0 else len(bigs[k])
        start, cursor = place_record(cursor, blen + 32, PAGE)
        off = C.DATA_OFFSET + start
        index[k]["_offset"], index[k]["_length"] = off, blen + 32
        index[k]["big.offset"], index[k]["big.length"] = off, blen
        index[k]["small.offset"], index[k]["small.length"] = off + blen, 32
        if k:
            chunks.append((start, bigs[k]))
        chunks.append((start + blen, smalls[k].tobytes()))
    data_length = int(index[-1]["_offset"] + index[-1]["_length"]) - C.DATA_OFFSET
    path = folder / "big.pageset"
    _write_sparse(path, data_length=data_length, chunks=chunks, schema=schema, index_bytes=index.tobytes(),
                  record_count=4)
    yield path, smalls, bigs
    path.unlink()


def test_sparse_file_past_4gib_reads_records(big_records):
    path, smalls, bigs = big_records
    assert os.path.getsize(path) > 4 * GiB + GiB // 2
    assert os.stat(path).st_blocks * 512 < 64 << 20  # sparse: a few MiB on disk
    with open_dataset(path) as ds:
        offs = ds.index["small.offset"].astype(np.int64)
        assert (offs > 4 * GiB).all() and (ds.index["_offset"][1:] > (1 << 32)).all()
        for k in range(4):
            np.testing.assert_array_equal(ds.read(k, "small"), smalls[k])
            if k:
                assert ds.read(k, "big") == bigs[k]
        assert ds.read(0, "small")[1] == 0 and ds.index[0]["big.length"] > 1 << 32
        # the pages holding data checksum correctly (whole-file verify() would read 4.5 GiB of holes)
        crcs = ds._page_crcs
        for k in sorted({int((o - ds.data_offset) // PAGE) for o in offs}):
            start = ds.data_offset + k * PAGE
            stop = min(start + PAGE, ds.data_offset + ds.data_length)
            assert zlib.crc32(ds.buffer[start:stop]) == int(crcs[k])
        assert ds.page_count > 1024 and ds.records_per_page().sum() == 4
        assert ds.record_pages()[-1] == (int(ds.index[-1]["_offset"]) - ds.data_offset) // PAGE


@pytest.mark.parametrize("page_cache", ["os", "process"])
def test_loader_reads_records_past_4gib(big_records, page_cache):
    path, smalls, _ = big_records
    for order in ("sequential", "quasi_random", "random"):
        with Loader(path, batch_size=2, pipelines={"big": None}, order=order, num_threads=2,
                    page_cache=page_cache) as loader:
            seen = {}
            for batch in loader:
                for i, row in zip(batch["_index"].tolist(), batch["small"]):
                    seen[i] = np.asarray(row)
        assert sorted(seen) == [0, 1, 2, 3]
        for k in range(4):
            np.testing.assert_array_equal(seen[k], smalls[k])


def test_token_file_past_2_31_tokens(tmp_path):
    """A 2^31 + 2^20 token (4.3 GB, sparse) uint16 file: counts, windows w > 2^31 / seq_len, the Loader."""
    if _free_bytes(tmp_path) < (1 << 30):
        pytest.skip("needs some real disk for a sparse 4.3 GB file")
    count = (1 << 31) + (1 << 20)
    seq_len = 1024
    w_far = ((1 << 31) + 4096) // seq_len + 3  # a window starting past token 2^31 (byte offset past 4 GiB)
    start_tok = w_far * seq_len
    pattern = (np.arange(3 * seq_len, dtype=np.int64) * 7 % 50000 + 1).astype("<u2")
    schema = build_schema({"tokens": Tokens("uint16")}, {}, {"page_size": PAGE, "checksum": ALGORITHM})
    schema["tokens"] = {"bos_id": None, "count": count, "documents": 1, "dtype": "uint16", "eos_id": 0,
                        "max_id": 50000, "source": "synthetic", "tokenizer": None}
    offsets = np.array([0, count], dtype="<u8")
    path = tmp_path / "tokens.pageset"
    _write_sparse(path, data_length=count * 2, chunks=[(start_tok * 2, pattern.tobytes())], schema=schema,
                  index_bytes=b"", record_count=0, required_features=C.REQUIRED_TOKENS,
                  doc_offsets=offsets.tobytes())
    try:
        with open_tokens(path) as td:
            assert len(td) == count > 2**31 and td.documents == 1
            n = td.num_windows(seq_len)
            assert n == num_windows(count, seq_len) == (count - 1) // seq_len and n > w_far
            ids = np.array([w_far, w_far + 1, w_far - 5], dtype=np.int64)
            inp = np.empty((3, seq_len), np.int64)
            tgt = np.empty((3, seq_len), np.int64)
            gather_windows(td.tokens, ids, seq_len, inp, tgt)
            np.testing.assert_array_equal(inp[0], pattern[:seq_len])
            np.testing.assert_array_equal(tgt[0], pattern[1 : seq_len + 1])
            np.testing.assert_array_equal(inp[1], pattern[seq_len : 2 * seq_len])
            assert (inp[2] == 0).all()
            assert int(td.tokens[start_tok]) == int(pattern[0])
        # the Loader, resumed at the step holding window w_far (sequential order: position == window id)
        from pageset import TokenWindows

        for page_cache in ("os", "process"):
            with Loader(path, batch_size=4, pipelines={"tokens": [TokenWindows(seq_len)]}, order="sequential",
                        num_threads=1, page_cache=page_cache) as loader:
                assert loader.n_records == n
                state = loader.state_dict()
                state["cursor"] = (w_far // 4) * 4
                loader.load_state_dict(state)
                batch = next(iter(loader))
            row = list(batch["_index"]).index(w_far)
            np.testing.assert_array_equal(np.asarray(batch["input"])[row], pattern[:seq_len])
            np.testing.assert_array_equal(np.asarray(batch["target"])[row], pattern[1 : seq_len + 1])
    finally:
        path.unlink()


# ---- pure arithmetic past 2^31 (no file) ------------------------------------------------------------------

N_PAGES = 600_000
PER_PAGE = 4000  # N = 2.4e9 > 2^31 records (or windows)


def test_rank_positions_past_2_31():
    n = N_PAGES * PER_PAGE
    g = 1024
    assert n > 2**31 and epoch_length(n, g, True) == (n // g) * g
    steps = steps_per_epoch(n, g, True)
    last = steps - 1
    pos, pad = rank_positions(last, 3, 4, g, n, True)
    assert pos.dtype == np.int64 and int(pos[0]) == last * g + 3 * 256 and int(pos[-1]) == last * g + 4 * 256 - 1
    assert int(pos[0]) > 2**31 and not pad.any()
    pos, pad = rank_positions(steps_per_epoch(n + 5, g, False) - 1, 0, 1, g, n + 5, False)
    assert int(pos[-1]) == epoch_length(n + 5, g, False) - 1 and pad.sum() == epoch_length(n + 5, g, False) - n - 5


@pytest.mark.parametrize("order", ["sequential", "quasi_random"])
def test_epoch_order_ids_past_2_31(order):
    sizes = np.full(N_PAGES, PER_PAGE, dtype=np.int64)
    n = int(sizes.sum())
    eo = EpochOrder(sizes, seed=5, epoch=2, order=order, window_pages=8)
    assert eo.n_records == n > 2**31
    start = n - 10_000  # the last positions, well past 2^31
    ids = eo.ids(start, n)
    assert ids.dtype == np.int64 and ids.shape == (10_000,)
    assert ids.min() >= 0 and ids.max() < n and np.unique(ids).size == ids.size
    # padding positions past N wrap to the start of the permutation
    np.testing.assert_array_equal(eo.ids(n, n + 3), eo.ids(0, 3))
    if order == "sequential":
        np.testing.assert_array_equal(ids, np.arange(start, n, dtype=np.int64))
    else:
        # the same ids as the stateless range function, and whole pages past 2^31 stay together in a window
        np.testing.assert_array_equal(ids, quasi_random_range(sizes, 5, 2, 8, start, n))
        w = eo.window_of(start)
        pages = eo.window_page_ids(w)
        win = eo.window_ids(w)
        expect = np.concatenate([np.arange(p * PER_PAGE, (p + 1) * PER_PAGE, dtype=np.int64) for p in pages])
        np.testing.assert_array_equal(np.sort(win), np.sort(expect))
        # the window holding the last page: its ids (up to N - 1 > 2^31) are exact int64 page arithmetic
        page_order, _ = window_layout(sizes, 5, 2, order, 8)
        w_last = int(np.flatnonzero(page_order == N_PAGES - 1)[0]) // 8
        last = eo.window_ids(w_last)
        expect = np.concatenate([np.arange(p * PER_PAGE, (p + 1) * PER_PAGE, dtype=np.int64)
                                 for p in eo.window_page_ids(w_last)])
        assert N_PAGES - 1 in eo.window_page_ids(w_last) and expect.max() == n - 1 > 2**31
        np.testing.assert_array_equal(np.sort(last), np.sort(expect))
        assert last.dtype == np.int64 and np.unique(last).size == last.size
        far = eo.window_starts[eo.window_starts > 2**31][0]
        w2 = eo.window_of(int(far))
        assert int(eo.window_starts[w2]) == int(far)


def test_token_window_arithmetic_past_2_31():
    """Window ids past 2^31 / seq_len: start offsets w * seq_len (tokens) and bytes past 2^32 stay exact."""
    seq_len = 2048
    count = 3 * 2**31 + 17
    n = num_windows(count, seq_len)
    assert n == (count - 1) // seq_len
    ids = np.array([2**31 // seq_len + 1, n - 1, 2**21 + 12345], dtype=np.int64)
    starts = ids * seq_len
    assert starts.dtype == np.int64 and (starts > 2**31).all()
    assert int(starts[1]) + seq_len + 1 <= count
    assert [int(s) for s in starts] == [int(i) * seq_len for i in ids.tolist()]
    byte_offs = C.DATA_OFFSET + ids * (seq_len * 4)  # the loader's process-cache offsets for uint32 tokens
    assert (byte_offs > 2**33).all() and int(byte_offs[1]) == C.DATA_OFFSET + (n - 1) * seq_len * 4


def _stream_value(pos: np.ndarray) -> np.ndarray:
    """A token value that differs between neighbouring positions and between windows (uint16)."""
    return ((pos.astype(np.uint64) * np.uint64(2654435761)) >> np.uint64(9)).astype(np.uint16)


def test_gather_windows_in_a_virtual_stream_past_2_31_tokens():
    """gather_windows on a 2^31 + 2^21 token uint16 stream (4.3 GB of address space, a few KiB touched): an
    anonymous MAP_NORESERVE mapping reads as zeros except where a window's tokens are written, so every window
    gets distinct values and a window read from the wrong start (ids * (seq_len + 1), an int32 overflow...)
    differs. Needs no disk and no RAM beyond the touched pages."""
    seq_len = 2048
    count = (1 << 31) + (1 << 21) + 17
    n = num_windows(count, seq_len)
    mm = mmap.mmap(-1, count * 2, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
    try:
        stream = np.frombuffer(mm, dtype=np.uint16)
        ids = np.array([2**31 // seq_len + 1, 2**31 // seq_len + 2, n - 1, 12345], dtype=np.int64)
        for w in ids.tolist():
            pos = np.arange(w * seq_len, w * seq_len + seq_len + 1, dtype=np.int64)
            stream[pos[0] : pos[-1] + 1] = _stream_value(pos)
        inp = np.empty((ids.shape[0], seq_len), np.int64)
        tgt = np.empty((ids.shape[0], seq_len), np.int64)
        gather_windows(stream, ids, seq_len, inp, tgt)
        for j, w in enumerate(ids.tolist()):
            pos = np.arange(w * seq_len, w * seq_len + seq_len + 1, dtype=np.int64)
            np.testing.assert_array_equal(inp[j], _stream_value(pos[:-1]), err_msg=f"window {w}")
            np.testing.assert_array_equal(tgt[j], _stream_value(pos[1:]), err_msg=f"window {w}")
        assert np.unique(inp[:, :4], axis=0).shape[0] == ids.shape[0]  # the windows really differ
        del stream
    finally:
        mm.close()


@pytest.fixture()
def two_images(tmp_path):
    from pageset import RGBImage, write_dataset

    path = tmp_path / "img.pageset"
    write_dataset(path, [(np.full((8, 8, 3), k, np.uint8),) for k in range(2)], {"image": RGBImage(encoding="raw")},
                  num_workers=0, progress=False)
    return path


def test_batch_buffers_larger_than_memory_are_refused_at_construction(two_images):
    """A crop size within the op's bound (65535, JPEG's limit) whose batch buffers exceed the machine's memory is
    refused when the Loader is made, naming the field, the op, the shape and the bytes (it was a raw numpy
    MemoryError at the first batch)."""
    from pageset import RandomResizedCrop

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    per_image = 65535 * 65535 * 3
    batch = ram // per_image + 1  # one batch alone is more than the memory
    gib = batch * per_image / 2**30
    with pytest.raises(MemoryError, match=(
            rf"^{two_images}: the batch buffers need more than this machine's memory \({ram / 2**30:.3g} GiB\): "
            rf"4 slots \(batches_ahead \+ 2\) x {gib:.3g} GiB = {4 * gib:.3g} GiB; the largest: field 'image' "
            rf"\(RandomResizedCrop\(size=\(65535, 65535\).*\)\), 'image' of shape \({batch}, 65535, 65535, 3\) uint8, "
            rf"{gib:.3g} GiB per batch\. Use a smaller output size, batch_size or batches_ahead$")):
        Loader(two_images, batch_size=batch, drop_last=False, batches_ahead=2, num_threads=1,
               pipelines={"image": [RandomResizedCrop(65535)]})


def test_batch_buffers_that_cannot_be_allocated_name_the_field(two_images, monkeypatch):
    """When the memory check passes (here: told the machine has 2**60 pages) and the allocation fails anyway
    (2**58 bytes: past any address space), the MemoryError still names the field, the op and the shape."""
    from pageset import CenterCrop

    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: 1 << 60 if name == "SC_PHYS_PAGES" else real(name))
    batch = (1 << 58) // (65535 * 65535 * 3)
    with pytest.raises(MemoryError, match=rf"^{two_images}: the batch buffers could not be allocated: 3 slots .* field "
                                          rf"'image' \(CenterCrop\(size=\(65535, 65535\).*\)\), 'image' of shape "
                                          rf"\({batch}, 65535, 65535, 3\) uint8"):
        Loader(two_images, batch_size=batch, drop_last=False, batches_ahead=1, num_threads=1, array_type="numpy",
               pipelines={"image": [CenterCrop(65535)]})
