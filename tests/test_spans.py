"""The loader's batch kernels: pread_spans / copy_spans (ops.spans), and split_windows, pread_windows,
pread_mixed_windows, pin_windows / copy_windows / unpin_pages (ops.tokens)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from pageset.ops.spans import (
    changed_files,
    copy_spans,
    fstat_into,
    fstat_layout_ok,
    pread_set_spans,
    pread_spans,
    pread_spans_fds,
)
from pageset.ops.tokens import (
    copy_windows,
    pin_windows,
    pread_mixed_windows,
    pread_set_windows,
    pread_windows,
    split_windows,
    unpin_pages,
)


def test_copy_spans_equals_slices_and_skips_negative_starts():
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    lens = rng.integers(0, 3000, 40).astype(np.int64)
    starts = rng.integers(0, src.size - 3000, 40).astype(np.int64)
    starts[[3, 17]] = -1
    dst_offs = np.cumsum(lens) - lens
    dst = np.full(int(lens.sum()), 7, dtype=np.uint8)
    copy_spans(src, starts, lens, dst, dst_offs)
    for j in range(40):
        got = dst[dst_offs[j] : dst_offs[j] + lens[j]]
        if starts[j] < 0:
            assert (got == 7).all()
        else:
            np.testing.assert_array_equal(got, src[starts[j] : starts[j] + lens[j]])


def test_pread_spans_reads_the_file_and_reports_the_first_short_span(tmp_path):
    data = np.random.default_rng(1).integers(0, 256, 100_000, dtype=np.uint8)
    path = tmp_path / "bytes.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        offs = np.array([5, 90_000, 0, 42_000], dtype=np.int64)
        lens = np.array([100, 9_000, 0, 30_000], dtype=np.int64)
        dst_offs = np.cumsum(lens) - lens
        dst = np.zeros(int(lens.sum()), dtype=np.uint8)
        assert pread_spans(fd, offs, lens, dst, dst_offs) == -1
        for o, n, d in zip(offs, lens, dst_offs):
            np.testing.assert_array_equal(dst[d : d + n], data[o : o + n])
        # span 1 runs past the end of the file: its index comes back, span 0 was read
        offs[1] = 95_000
        dst[:] = 0
        assert pread_spans(fd, offs, lens, dst, dst_offs) == 1
        np.testing.assert_array_equal(dst[:100], data[5:105])
    finally:
        os.close(fd)


@pytest.mark.parametrize("src_dtype", [np.uint16, np.uint32])
@pytest.mark.parametrize("input_dtype", [np.int64, np.int32])
def test_split_windows_widens_and_shifts(src_dtype, input_dtype):
    high = min(int(np.iinfo(src_dtype).max), 2**31 - 1)  # token ids fit int32 (vocabularies are < 2^31)
    rows = np.random.default_rng(2).integers(0, high, (5, 18)).astype(src_dtype)
    inp = np.empty((5, 17), dtype=input_dtype)
    tgt = np.empty((5, 17), dtype=np.int64)
    split_windows(rows, inp, tgt)
    np.testing.assert_array_equal(inp, rows[:, :-1].astype(input_dtype))
    np.testing.assert_array_equal(tgt, rows[:, 1:].astype(np.int64))


def _token_bytes(tmp_path, name, dtype, n, base, seed):
    """A file of ``base`` header bytes then ``n`` random tokens of ``dtype``: (path, tokens)."""
    high = min(int(np.iinfo(dtype).max), 2**31 - 1)
    tokens = np.random.default_rng(seed).integers(0, high, n).astype(dtype)
    path = tmp_path / name
    path.write_bytes(b"\x07" * base + tokens.tobytes())
    return path, tokens


@pytest.mark.parametrize("src_dtype", [np.uint16, np.uint32])
@pytest.mark.parametrize("input_dtype", [np.int64, np.int32])
def test_pread_windows_reads_widens_and_reports_the_first_short_window(tmp_path, src_dtype, input_dtype):
    L, base = 37, 100
    path, tokens = _token_bytes(tmp_path, "t.bin", src_dtype, 5000, base, 3)
    n_windows = (tokens.size - 1) // L
    ids = np.random.default_rng(4).integers(0, n_windows, 20).astype(np.int64)
    ids[:2] = [0, n_windows - 1]  # the first and the last window
    stride = L * np.dtype(src_dtype).itemsize
    inp, tgt = np.full((20, L), -1, dtype=input_dtype), np.full((20, L), -1, dtype=np.int64)
    row = np.empty(L + 1, dtype=src_dtype)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pread_windows(fd, base, stride, ids, row, inp, tgt) == -1
        for j, w in enumerate(ids):
            np.testing.assert_array_equal(inp[j], tokens[w * L : w * L + L].astype(input_dtype))
            np.testing.assert_array_equal(tgt[j], tokens[w * L + 1 : w * L + L + 1].astype(np.int64))
        # window 5 runs past the end of the file: its index comes back, rows before it are written, none after
        ids[5] = n_windows + 2
        inp[:], tgt[:] = -1, -1
        assert pread_windows(fd, base, stride, ids, row, inp, tgt) == 5
        np.testing.assert_array_equal(inp[4], tokens[ids[4] * L : ids[4] * L + L].astype(input_dtype))
        assert (inp[5:] == -1).all() and (tgt[5:] == -1).all()
    finally:
        os.close(fd)


def test_pread_mixed_windows_reads_each_row_from_its_own_file(tmp_path):
    L = 16
    (pa, ta), (pb, tb) = (_token_bytes(tmp_path, "a.bin", np.uint16, 900, 64, 5),
                          _token_bytes(tmp_path, "b.bin", np.uint16, 400, 3, 6))
    fds = np.array([os.open(pa, os.O_RDONLY), os.open(pb, os.O_RDONLY)], dtype=np.int64)
    try:
        sources = np.array([1, 0, 0, 1, 1, 0, 1], dtype=np.int16)
        ids = np.array([0, 55, 3, 23, 9, 0, 24], dtype=np.int64)  # 24 is past the end of b (24 windows: 0..23)
        inp, tgt = np.zeros((7, L), dtype=np.int64), np.zeros((7, L), dtype=np.int64)
        row = np.empty(L + 1, dtype=np.uint16)
        bases, strides = np.array([64, 3], dtype=np.int64), np.array([2 * L, 2 * L], dtype=np.int64)
        touched = np.zeros(3, dtype=np.uint8)
        assert pread_mixed_windows(fds[:1], bases, strides, sources[1:3], ids[1:3], row, inp, tgt, touched) == -1
        assert touched.tolist() == [1, 0, 0]
        assert pread_mixed_windows(fds, bases, strides, sources[:6], ids[:6], row, inp, tgt, touched) == -1
        assert touched.tolist() == [1, 1, 0]
        for j in range(6):
            t = (ta, tb)[sources[j]]
            np.testing.assert_array_equal(inp[j], t[ids[j] * L : ids[j] * L + L])
            np.testing.assert_array_equal(tgt[j], t[ids[j] * L + 1 : ids[j] * L + L + 1])
        assert pread_mixed_windows(fds, bases, strides, sources, ids, row, inp, tgt, touched) == 6
    finally:
        for fd in fds.tolist():
            os.close(fd)


@pytest.mark.parametrize("check", [True, False])
def test_pread_set_windows_reads_each_window_from_its_member_and_checks_them(tmp_path, check):
    """A set of three members (windows 0-4 in member 0, none in member 1, 5-8 in member 2): each global window read
    from its member at ``base + (g - start) * stride``; the members read are fstat-ed and their flags cleared
    (with ``check``); a member modified since gives ``-2 - member``; a window past its member's end gives its
    index, nothing checked."""
    L = 8
    (pa, ta), (pc, tc) = (_token_bytes(tmp_path, "a.bin", np.uint16, 5 * L + 1, 40, 1),
                          _token_bytes(tmp_path, "c.bin", np.uint16, 4 * L + 1, 7, 2))
    fds = np.array([os.open(pa, os.O_RDONLY), -1, os.open(pc, os.O_RDONLY)], dtype=np.int64)
    try:
        bases, starts = np.array([40, 0, 7], dtype=np.int64), np.array([0, 5, 5], dtype=np.int64)
        window_member = np.array([0] * 5 + [2] * 4, dtype=np.int16)
        sts = [os.fstat(int(fds[0])), None, os.fstat(int(fds[2]))]
        sizes = np.array([sts[0].st_size, 0, sts[2].st_size], dtype=np.int64)
        mtimes = np.array([sts[0].st_mtime_ns, 0, sts[2].st_mtime_ns], dtype=np.int64)
        ids = np.array([8, 0, 4, 5, 2, 6], dtype=np.int64)
        inp, tgt = np.zeros((6, L), dtype=np.int64), np.zeros((6, L), dtype=np.int64)
        row, touched, buf = np.empty(L + 1, dtype=np.uint16), np.zeros(3, dtype=np.uint8), np.zeros(18, np.int64)
        args = (fds, bases, starts, 2 * L, window_member)
        assert pread_set_windows(*args, ids, row, inp, tgt, touched, sizes, mtimes, buf, check) == -1
        for j, g in enumerate(ids.tolist()):
            t, local = (ta, g) if g < 5 else (tc, g - 5)
            np.testing.assert_array_equal(inp[j], t[local * L : local * L + L])
            np.testing.assert_array_equal(tgt[j], t[local * L + 1 : local * L + L + 1])
        assert touched.tolist() == ([0, 0, 0] if check else [1, 0, 1])
        touched[:] = 0
        os.utime(pc, ns=(sts[2].st_atime_ns, sts[2].st_mtime_ns + 10**9))  # member 2 modified in place
        got = pread_set_windows(*args, ids[1:3], row, inp, tgt, touched, sizes, mtimes, buf, check)
        assert got == -1 and touched.tolist() == ([0, 0, 0] if check else [1, 0, 0])  # only member 0 read
        touched[:] = 0
        got = pread_set_windows(*args, ids, row, inp, tgt, touched, sizes, mtimes, buf, check)
        assert got == (-2 - 2 if check else -1) and touched.tolist() == ([0, 0, 0] if check else [1, 0, 1])
        touched[:] = 0
        os.truncate(pa, 40 + 4 * 2 * L)  # member 0 loses its last window's bytes: window 4 comes up short
        got = pread_set_windows(*args, ids, row, inp, tgt, touched, sizes, mtimes, buf, check)
        assert got == 2 and touched.tolist() == [1, 0, 1]  # windows 8 and 0 read, then window 4 short
    finally:
        for fd in fds.tolist():
            if fd >= 0:
                os.close(fd)


@pytest.mark.parametrize("check", [True, False])
def test_pread_set_spans_reads_runs_of_virtual_offsets_and_checks_their_members(tmp_path, check):
    """Runs at virtual offsets ``(member << 8) | offset`` of three members (member 1 never read): each run's bytes
    from its member's file; its members fstat-ed and their flags cleared (with ``check``); a member modified since
    gives ``-2 - member``; a run past its member's end gives its index, nothing checked."""
    files = [tmp_path / f"m{k}.bin" for k in range(3)]
    blobs = [bytes(range(k * 50, k * 50 + 90)) for k in range(3)]
    for f, b in zip(files, blobs):
        f.write_bytes(b)
    fds = np.array([os.open(files[0], os.O_RDONLY), -1, os.open(files[2], os.O_RDONLY)], dtype=np.int64)
    try:
        sts = [os.fstat(int(fds[0])), None, os.fstat(int(fds[2]))]
        sizes = np.array([90, 0, 90], dtype=np.int64)
        mtimes = np.array([sts[0].st_mtime_ns, 0, sts[2].st_mtime_ns], dtype=np.int64)
        run_v = np.array([(2 << 8) | 5, 0 | 40, (2 << 8) | 80], dtype=np.int64)
        run_lens = np.array([30, 10, 10], dtype=np.int64)
        dst_offs = np.array([0, 30, 40], dtype=np.int64)
        want = blobs[2][5:35] + blobs[0][40:50] + blobs[2][80:90]
        dst, touched, buf = np.zeros(50, np.uint8), np.zeros(3, np.uint8), np.zeros(18, np.int64)
        got = pread_set_spans(fds, run_v, run_lens, dst, dst_offs, touched, sizes, mtimes, buf, check, 8)
        assert got == -1 and dst.tobytes() == want
        assert touched.tolist() == ([0, 0, 0] if check else [1, 0, 1])
        touched[:] = 0
        os.utime(files[0], ns=(sts[0].st_atime_ns, sts[0].st_mtime_ns + 10**9))  # member 0 modified in place
        got = pread_set_spans(fds, run_v, run_lens, dst, dst_offs, touched, sizes, mtimes, buf, check, 8)
        assert got == (-2 - 0 if check else -1) and touched.tolist() == ([0, 0, 0] if check else [1, 0, 1])
        touched[:] = 0
        run_lens[2] = 11  # one byte past member 2's end: run 2 comes up short
        got = pread_set_spans(fds, run_v, run_lens, np.zeros(51, np.uint8), dst_offs, touched, sizes, mtimes, buf,
                              check, 8)
        assert got == 2 and touched.tolist() == [1, 0, 1]
    finally:
        for fd in fds.tolist():
            if fd >= 0:
                os.close(fd)


def test_pin_copy_unpin_windows_out_of_a_slot_arena():
    """Windows inside one resident page are pinned (once per distinct page), copied and widened; a window on a
    page not resident, or across a page boundary, gives -1 and pins nothing."""
    page_len, L = 64, 7
    tokens = np.random.default_rng(7).integers(0, 60000, 6 * page_len).astype(np.uint16)
    page_slot = np.full(6, -1, dtype=np.int64)
    arena = np.zeros(3 * page_len, dtype=np.uint16)
    for slot, page in enumerate([4, 2, 1]):
        page_slot[page] = slot
        arena[slot * page_len : (slot + 1) * page_len] = tokens[page * page_len : (page + 1) * page_len]
    starts = np.arange(0, tokens.size - L, L)
    inside = ((starts // page_len) == ((starts + L) // page_len)) & (page_slot[starts // page_len] >= 0)
    ids = np.flatnonzero(inside)[[0, 9, 3, 15, 4, -1]].astype(np.int64)
    pins = np.zeros(3, dtype=np.int64)
    offsets, pages = np.empty(len(ids), dtype=np.int64), np.empty(len(ids), dtype=np.int64)
    m = pin_windows(page_slot, pins, page_len, L, L + 1, ids, offsets, pages)
    touched = sorted({int(i * L // page_len) for i in ids})
    assert m == len(touched) < len(ids) and pages[:m].tolist() == touched  # several windows share a page
    assert pins.tolist() == [int(page in touched) for page in [4, 2, 1]]  # slots 0, 1, 2 hold pages 4, 2, 1
    inp, tgt = np.empty((len(ids), L), dtype=np.int64), np.empty((len(ids), L), dtype=np.int64)
    copy_windows(arena, offsets, inp, tgt)
    for j, w in enumerate(ids):
        np.testing.assert_array_equal(inp[j], tokens[w * L : w * L + L])
        np.testing.assert_array_equal(tgt[j], tokens[w * L + 1 : w * L + L + 1])
    unpin_pages(page_slot, pins, pages[:m])
    assert (pins == 0).all()
    across = int(np.flatnonzero((starts // page_len) != ((starts + L) // page_len))[0])
    missing = int(np.flatnonzero(page_slot[starts // page_len] < 0)[0])
    for bad in (across, missing):
        assert pin_windows(page_slot, pins, page_len, L, L + 1, np.array([ids[0], bad]), offsets, pages) == -1
        assert (pins == 0).all()


def test_pread_spans_fds_reads_each_span_from_its_own_file(tmp_path):
    rng = np.random.default_rng(2)
    datas = [rng.integers(0, 256, n, dtype=np.uint8) for n in (5_000, 70_000)]
    fds = []
    for k, d in enumerate(datas):
        (tmp_path / f"m{k}.bin").write_bytes(d.tobytes())
        fds.append(os.open(tmp_path / f"m{k}.bin", os.O_RDONLY))
    try:
        which = np.array([1, 0, 1, 0], dtype=np.int64)
        offs = np.array([60_000, 4_000, 10, 0], dtype=np.int64)
        lens = np.array([10_000, 1_000, 3, 0], dtype=np.int64)
        dst_offs = np.cumsum(lens) - lens
        dst = np.zeros(int(lens.sum()), dtype=np.uint8)
        span_fds = np.array(fds, dtype=np.int64)[which]
        assert pread_spans_fds(span_fds, offs, lens, dst, dst_offs) == -1
        for k, o, n, d in zip(which, offs, lens, dst_offs):
            np.testing.assert_array_equal(dst[d : d + n], datas[k][o : o + n])
        # span 1 asks member 0 for bytes past its end (they exist in member 1): reported, not read from member 1
        offs[1] = 4_500
        assert pread_spans_fds(span_fds, offs, lens, dst, dst_offs) == 1
    finally:
        for fd in fds:
            os.close(fd)


def test_changed_files_names_the_first_file_whose_size_or_mtime_differs(tmp_path):
    paths = [tmp_path / f"f{k}.bin" for k in range(3)]
    for k, p in enumerate(paths):
        p.write_bytes(bytes(100 + k))
    fds = np.array([os.open(p, os.O_RDWR) for p in paths], dtype=np.int64)
    try:
        sts = [os.fstat(int(fd)) for fd in fds]
        assert [int(x) for x in (sts[0].st_size, sts[2].st_size)] == [100, 102]
        sizes = np.array([st.st_size for st in sts], dtype=np.int64)
        mtimes = np.array([st.st_mtime_ns for st in sts], dtype=np.int64)
        buf = np.zeros(18, dtype=np.int64)
        assert fstat_into(int(fds[1]), buf) == 0
        assert fstat_layout_ok(int(fds[1])) == (sys.platform.startswith("linux") and int(buf[6]) == 101)
        touched = np.array([1, 0, 1], dtype=np.uint8)
        assert changed_files(fds, touched, sizes, mtimes, buf) == -1 and not touched.any()
        os.utime(paths[2], ns=(sts[2].st_atime_ns, sts[2].st_mtime_ns + 10**9))  # same size, new mtime
        os.truncate(paths[1], 50)  # not touched: not looked at
        touched[:] = [1, 1, 1]
        assert changed_files(fds, touched, sizes, mtimes, buf) == 1 and not touched.any()
        touched[:] = [1, 0, 1]
        assert changed_files(fds, touched, sizes, mtimes, buf) == 2
    finally:
        for fd in fds:
            os.close(int(fd))
