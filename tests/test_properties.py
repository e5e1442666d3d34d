"""Hypothesis: page placement over record and page sizes, and every field dtype of the constants table."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pageset import Bytes, Float, Int, NDArray, open_dataset, write_dataset
from pageset.format.constants import FLOAT_DTYPES, INT_DTYPES, NDARRAY_DTYPES
from pageset.write.packing import place_record

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@given(st.lists(st.integers(0, 40_000), min_size=1, max_size=60), st.sampled_from([4096, 8192, 16384]))
def test_place_record_never_straddles(lengths, page_size):
    cursor, prev_end = 0, 0
    spans = []
    for n in lengths:
        start, nxt = place_record(cursor, n, page_size)
        assert start >= cursor >= prev_end
        if n > page_size:
            assert start % page_size == 0 and nxt % page_size == 0 and nxt >= start + n
        elif n:
            assert start // page_size == (start + n - 1) // page_size  # inside one page
            assert start - cursor < n  # moved only when it did not fit the current page
        spans.append((start, n))
        cursor, prev_end = nxt, start + n
    # no two records share bytes, and a large record shares its pages with nobody
    for (s1, n1), (s2, n2) in zip(spans, spans[1:]):
        assert s1 + n1 <= s2 or n1 == 0 or n2 == 0
        if n1 > page_size and n2:
            assert s2 >= -(-(s1 + n1) // page_size) * page_size


def test_place_record_table():
    """Exact placements at the edges (mutation survivors the random lists rarely hit): a record that fills the
    rest of its page stays there; a large record at a page start is not moved; zero-length records take no
    space; a record of exactly one page is a small record."""
    ps = 4096
    assert place_record(4000, 96, ps) == (4000, 4096)  # ends exactly at the page end: stays
    assert place_record(4000, 97, ps) == (4096, 4193)  # one byte too long: next page
    assert place_record(8192, 5000, ps) == (8192, 16384)  # large, aligned cursor: starts there, owns 2 pages
    assert place_record(8193, 5000, ps) == (12288, 20480)  # large, unaligned: next page start
    assert place_record(100, 0, ps) == (100, 100)
    assert place_record(0, ps, ps) == (0, ps) and place_record(1, ps, ps) == (ps, 2 * ps)


def _value_strategy(dtype: str, shape):
    dt = np.dtype(dtype)
    elements = None
    if dt.kind == "f":
        elements = st.floats(width=8 * dt.itemsize, allow_nan=False)
    return hnp.arrays(dt, shape, elements=elements)


@st.composite
def datasets(draw):
    arr_dtype = draw(st.sampled_from(NDARRAY_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
    int_dtype = draw(st.sampled_from(INT_DTYPES))
    float_dtype = draw(st.sampled_from(FLOAT_DTYPES))
    n = draw(st.integers(1, 12))
    rows = []
    for _ in range(n):
        arr = draw(_value_strategy(arr_dtype, shape))
        if int_dtype == "bool":
            i = draw(st.booleans())
        else:
            info = np.iinfo(int_dtype)
            i = draw(st.integers(int(info.min), int(info.max)))
        f = draw(st.floats(width=8 * np.dtype(float_dtype).itemsize, allow_nan=False))
        blob = draw(st.binary(max_size=draw(st.sampled_from([10, 5000, 20000]))))
        rows.append((arr, i, f, blob))
    fields = {"a": NDArray(arr_dtype, shape), "i": Int(int_dtype), "f": Float(float_dtype), "b": Bytes()}
    return rows, fields, draw(st.sampled_from([4096, 8192]))


@SETTINGS
@given(datasets())
def test_every_dtype_round_trips_and_pages_hold(tmp_path, data):
    rows, fields, page_size = data
    out = tmp_path / "p.pageset"
    write_dataset(out, rows, fields, num_workers=0, page_size=page_size, progress=False)
    with open_dataset(out) as ds:
        ds.verify()
        assert len(ds) == len(rows)
        for (arr, i, f, blob), rec in zip(rows, ds):
            np.testing.assert_array_equal(rec["a"], arr)
            assert rec["a"].dtype == np.dtype(fields["a"].dtype) and rec["a"].shape == arr.shape
            assert rec["i"] == i
            assert rec["f"] == np.dtype(fields["f"].dtype).type(f)
            assert rec["b"] == blob
        starts = ds.index["_offset"].astype(np.int64) - ds.data_offset
        lengths = ds.index["_length"].astype(np.int64)
        for s, n in zip(starts, lengths):
            if 0 < n <= page_size:
                assert s // page_size == (s + n - 1) // page_size
            elif n > page_size:
                assert s % page_size == 0
        # the last page is not padded
        assert ds.data_length == int((starts + lengths).max())
