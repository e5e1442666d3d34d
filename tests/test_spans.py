"""The loader's batch kernels: pread_spans / copy_spans (ops.spans) and split_windows (ops.tokens)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pageset.ops.spans import copy_spans, pread_spans
from pageset.ops.tokens import split_windows


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
