"""``Loader(page_options=PageOptions(...), remote_options=RemoteOptions(...))``: the flat arguments as objects.

The batches of a Loader given its options as objects equal, byte for byte, those of the Loader given the same
values flat, and both equal the written records (label i, payload a function of i); each group refuses an
argument given both ways, and each object's checks are the flat arguments' (messages naming the argument).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from remote_servers import StaticHTTP

from pageset import Bytes, Int, Loader, PageOptions, RemoteOptions, write_dataset


def _payload(i):
    return bytes([i % 251, (3 * i) % 256]) * (20 * (i % 17) + 1)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    path = tmp_path_factory.mktemp("options") / "r.pageset"
    write_dataset(path, [(i, _payload(i)) for i in range(120)], {"label": Int(), "payload": Bytes()},
                  num_workers=0, page_size=4096, progress=False)
    return path


def _rows(loader, n=None):
    out = []
    for b in itertools.islice(loader, n):
        data, lengths = b["payload"]
        for label, row, k in zip(b["label"].tolist(), data, lengths.tolist()):
            assert bytes(row[:k]) == _payload(label)
            out.append((label, bytes(row[:k])))
    return out, loader.state_dict()


def test_page_options_equal_the_flat_arguments(records):
    flat = Loader(records, batch_size=10, order="quasi_random", seed=4, page_cache="process", cache_pages=3,
                  verify_pages=True, window_pages=2, array_type="numpy")
    grouped = Loader(records, batch_size=10, order="quasi_random", seed=4, array_type="numpy",
                     page_options=PageOptions(page_cache="process", cache_pages=3, verify_pages=True, window_pages=2))
    with flat, grouped:
        a, b = _rows(flat), _rows(grouped)
        assert a == b and len(a[0]) == 120 and sorted(r[0] for r in a[0]) == list(range(120))
        assert grouped._sources[0].pages.capacity == 3 and grouped._verifier is not None
        assert grouped.window_pages == 2 and grouped.state_dict()["window_pages"] == 2


def test_remote_options_equal_the_flat_arguments(records, tmp_path):
    with StaticHTTP(records.parent) as http:
        url = f"{http.url}/{records.name}"
        flat = Loader(url, batch_size=12, order="random", seed=1, cache_dir=tmp_path / "a", prefetch_bytes=8192,
                      max_requests=2, request_timeout=20.0, request_attempts=3, array_type="numpy")
        grouped = Loader(url, batch_size=12, order="random", seed=1, array_type="numpy",
                         remote_options=RemoteOptions(cache_dir=tmp_path / "b", prefetch_bytes=8192, max_requests=2,
                                                      request_timeout=20.0, request_attempts=3))
        with flat, grouped:
            assert _rows(flat) == _rows(grouped)
            pages = grouped._sources[0].pages
            assert (pages.prefetch_bytes, pages.max_requests) == (8192, 2) and pages.disk is not None
        assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(p.name for p in (tmp_path / "a").iterdir())


def test_an_option_given_both_ways_or_of_another_type_is_refused(records):
    with pytest.raises(ValueError, match=r"page_cache, cache_pages given both as an argument and in page_options="):
        Loader(records, batch_size=4, page_cache="process", cache_pages=2, page_options=PageOptions(verify_pages=True))
    with pytest.raises(ValueError, match=r"max_requests given both as an argument and in remote_options="):
        Loader(records, batch_size=4, max_requests=3, remote_options=RemoteOptions())
    with pytest.raises(TypeError, match=r"page_options must be a pageset.PageOptions \(or None\), got \{"):
        Loader(records, batch_size=4, page_options={"page_cache": "process"})
    with pytest.raises(TypeError, match=r"remote_options must be a pageset.RemoteOptions"):
        Loader(records, batch_size=4, remote_options=PageOptions())
    # the objects' fields are checked as the flat arguments are
    with pytest.raises(ValueError, match="page_cache"):
        Loader(records, batch_size=4, page_options=PageOptions(page_cache="mmap"))
    with pytest.raises(ValueError, match="window_pages=2 and window_records=5 both size"):
        Loader(records, batch_size=4, page_options=PageOptions(window_pages=2, window_records=5))
    with pytest.raises(ValueError, match="cache_limit_bytes=1,000 bounds the on-disk page cache"):
        Loader(records, batch_size=4, remote_options=RemoteOptions(cache_limit_bytes=1000))
    with pytest.raises(ValueError, match="request_attempts"):
        Loader(records, batch_size=4, remote_options=RemoteOptions(request_attempts=0))


def test_process_mode_takes_the_grouped_options(records):
    with Loader(records, batch_size=10, order="random", seed=2, num_workers=1, num_threads=1, array_type="numpy",
                page_options=PageOptions(page_cache="process", window_pages=3)) as ld:
        got, state = _rows(ld, 5)
    with Loader(records, batch_size=10, order="random", seed=2, page_cache="process", window_pages=3,
                array_type="numpy") as ref:
        want, ref_state = _rows(ref, 5)
    assert got == want and state == ref_state and np.unique([g[0] for g in got]).size == 50


def test_process_mode_child_builds_from_a_picklable_description(records):
    """The child of num_workers=1 builds its Loader from ``LoaderDescription`` (load/options.py): the parent's
    resolved arguments (rank, world size, threads) without ToDevice ops; built again after a pickle round trip it
    reads rank 1's slice of order v1 (the reference model's permutation), and the process-mode Loader equals it."""
    import pickle

    from reference import order as model

    from pageset.load.options import LoaderDescription

    kw = dict(batch_size=6, order="random", seed=9, rank=1, world_size=2, num_threads=2, array_type="numpy",
              window_pages=2)
    with Loader(records, **kw) as ld:
        desc = pickle.loads(pickle.dumps(ld._describe()))
    assert isinstance(desc, LoaderDescription)
    assert (desc.rank, desc.world_size, desc.num_threads, desc.batches_ahead) == (1, 2, 2, 4)
    assert desc.page_options == PageOptions(window_pages=2) and desc.indices is None
    perm = model.permutation([120], 9, 0, "random")
    want = [[perm[p] for p in model.rank_positions(step, 1, 2, 12)] for step in range(10)]
    with desc.build(Loader) as rebuilt:
        got = [b["label"].tolist() for b in rebuilt]
        state = rebuilt.state_dict()
    assert got == want
    with Loader(records, num_workers=1, **kw) as child:
        assert [b["label"].tolist() for b in child] == want and child.state_dict() == state
