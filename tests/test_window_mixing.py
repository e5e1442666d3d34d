"""Quasi-random windows sized in records (formats/order.md section 4.1): the rule by hand, the spec's mixing
table recomputed, and the Loader's defaults on a class-sorted file (issue 28, item 2).

A source written class by class (an ImageFolder) puts one or two classes on a page. With windows of a fixed 8
pages, ~60 records a page (ImageNet-sized JPEGs in 8 MiB pages) made a batch of 16 hold 9.7 distinct classes
where uniform draws give 15.9; a window sized in records holds ~R records whatever the record size.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from reference import order as model

from pageset import Int, Loader, Mixture, NDArray, write_dataset
from pageset.order import DEFAULT_WINDOW_RECORDS, epoch_permutation, window_pages_for

ROOT = Path(__file__).resolve().parents[1]
CLASSES, PER_CLASS, PER_PAGE = 1000, 50, 60  # the class-sorted 1,000 x 50 set, ~60 records a page


def _class_sorted_layout() -> np.ndarray:
    n = CLASSES * PER_CLASS
    sizes = np.full(-(-n // PER_PAGE), PER_PAGE, dtype=np.int64)
    sizes[-1] = n - PER_PAGE * (sizes.shape[0] - 1)
    return sizes


def _distinct_classes(ids: np.ndarray, batch: int) -> float:
    classes = ids[: ids.shape[0] // batch * batch] // PER_CLASS
    rows = np.sort(classes.reshape(-1, batch), axis=1)
    return float(np.mean(1 + np.count_nonzero(np.diff(rows, axis=1), axis=1)))


def test_window_size_by_hand():
    """M = min(K, max(1, ceil(R * K / N))), worked out by hand for the spec's cases."""
    sizes = _class_sorted_layout()
    assert sizes.shape[0] == 834 and sizes.sum() == 50_000
    # 16384 * 834 / 50000 = 273.29 -> 274 pages, 16,440 records of 60 a page
    assert window_pages_for(sizes) == 274 == model.window_pages_for(sizes.tolist())
    assert DEFAULT_WINDOW_RECORDS == 16384
    assert window_pages_for([10, 10, 10, 10], None, 20) == 2  # exactly R records: 2 pages
    assert window_pages_for([10, 10, 10, 10], None, 21) == 3  # one record more: ceil(84 / 40) = 3
    assert window_pages_for([10, 10, 10, 10], None, 1000) == 4  # never more than K: one window, the whole file
    assert window_pages_for([500, 0, 0, 1], None, 3) == 1  # at least one page
    assert window_pages_for([4, 0, 0, 4], None, 4) == 2  # empty pages count: 8 records on 4 pages, 2 a page
    assert window_pages_for([0, 0], None, 5) == 1  # no records
    assert window_pages_for([1, 2, 3], 7, 5) == 7  # given in pages: as given
    with pytest.raises(ValueError, match="window_records must be >= 1"):
        window_pages_for([1], None, 0)
    with pytest.raises(ValueError, match="window_pages must be >= 1"):
        window_pages_for([1], 0)


def _spec_table() -> dict[str, tuple[int, float]]:
    """Rows of formats/order.md section 4.1's table: first cell -> (M, distinct classes)."""
    text = (ROOT / "formats" / "order.md").read_text()
    section = text[text.index("### 4.1"): text.index("## 5.")]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"[\d.]+", cells[3]):
            rows[cells[0]] = (int(cells[1]) if cells[1].isdigit() else 0, float(cells[3]))
    return rows


def test_the_specs_mixing_table_is_what_the_order_gives():
    """The distinct classes per batch of 16 in formats/order.md (mean over epochs 0-2, seed 0) recomputed from
    the order itself on the class-sorted layout."""
    sizes = _class_sorted_layout()
    table = _spec_table()
    assert len(table) == 4, table
    for label, (m, want) in table.items():
        if label.startswith("`random`"):
            perms = [epoch_permutation(sizes, 0, e, "random") for e in range(3)]
        else:
            assert m == (window_pages_for(sizes) if "window_records" in label else int(re.search(r"= (\d+)", label)[1]))
            perms = [epoch_permutation(sizes, 0, e, "quasi_random", m) for e in range(3)]
        got = np.mean([_distinct_classes(p, 16) for p in perms])
        assert round(got, 2) == want, (label, got)


@pytest.fixture(scope="module")
def class_sorted_file(tmp_path_factory):
    """50,000 records written class by class: label = id // 50, 60 records on each 4 KiB page."""

    class Source:
        def __len__(self):
            return CLASSES * PER_CLASS

        def __getitem__(self, i):
            return i // PER_CLASS, np.full(68, i % 251, dtype=np.uint8)

    path = tmp_path_factory.mktemp("mix") / "sorted.pageset"
    write_dataset(path, Source(), {"label": Int(), "pixels": NDArray(np.uint8, (68,))}, page_size=4096,
                  num_workers=0, progress=False)
    return path


def test_class_sorted_batches_mix_at_the_default_window(class_sorted_file):
    """The Loader's defaults: ~15.6 distinct classes per batch of 16 (uniform draws: 15.88); the old default of
    8 pages a window gave 9.7. The labels are read from the file; the stream equals the model's."""
    with Loader(class_sorted_file, batch_size=16, order="quasi_random", seed=0, num_threads=1,
                pipelines={"pixels": None}) as ld:
        batches = [b for b in ld]
        state = ld.state_dict()
    labels = np.concatenate([b["label"].numpy() for b in batches])
    ids = np.concatenate([b["_index"].numpy() for b in batches])
    assert np.array_equal(labels, ids // PER_CLASS)
    ref = model.FileOrder(_class_sorted_layout().tolist(), 0, "quasi_random", None, True, 16)
    assert ids.tolist() == ref.perm(0)[: ids.shape[0]]
    assert state["window_pages"] == 0 and state["window_records"] == DEFAULT_WINDOW_RECORDS
    assert _distinct_classes(ids, 16) >= 15.5
    with Loader(class_sorted_file, batch_size=16, order="quasi_random", seed=0, num_threads=1, window_pages=8,
                pipelines={"pixels": None}) as ld:  # the window the default used to be
        old = np.concatenate([b["_index"].numpy() for b in ld])
    assert _distinct_classes(old, 16) < 10.5


def test_each_source_of_a_mixture_gets_its_own_window(class_sorted_file, tmp_path):
    """A Mixture of a small file (5 pages) and the class-sorted file: the large source's window is R records of
    its own (274 pages), not the small one's; the stream equals the model's, sources, ids and labels."""

    class Small:
        def __len__(self):
            return 300

        def __getitem__(self, i):
            return i // 10, np.zeros(68, dtype=np.uint8)

    small = tmp_path / "small.pageset"
    write_dataset(small, Small(), {"label": Int(), "pixels": NDArray(np.uint8, (68,))}, page_size=4096,
                  num_workers=0, progress=False)
    mix = Mixture([small, class_sorted_file], [0.1, 0.9], samples_per_epoch=4000)  # the small file first
    with Loader(mix, batch_size=16, order="quasi_random", seed=5, num_threads=1, pipelines={"pixels": None}) as ld:
        got = [(b["_source"].numpy(), b["_index"].numpy(), b["label"].numpy()) for b in ld]
    sizes = [[60] * 5, _class_sorted_layout().tolist()]
    ref = model.MixtureModel([0.1, 0.9], sizes, 5, "quasi_random", None, True, 16, 4000)
    assert ref.m == [5, 274]
    for step, (src, ids, labels) in enumerate(got):
        want_src, want_ids = ref.batch(0, step, 0, 1)
        assert src.tolist() == want_src and ids.tolist() == want_ids
        assert labels.tolist() == [i // (10 if s == 0 else PER_CLASS) for s, i in zip(want_src, want_ids)]


def test_a_url_holds_its_windows_in_memory(class_sorted_file):
    """Over http:// a window sized in records spans 274 pages (1.1 MB) while prefetch_bytes=64 KiB would leave
    128 KiB of memory: the in-memory pages follow the windows in flight, as the process cache does, so every
    page is fetched once in the epoch (the file's 834 pages), not once per batch that reads it."""
    from remote_servers import StaticHTTP

    with StaticHTTP(class_sorted_file.parent) as http:
        with Loader(f"{http.url}/{class_sorted_file.name}", batch_size=64, order="quasi_random", seed=2,
                    num_threads=2, prefetch_bytes=64 << 10, pipelines={"label": None}) as ld:
            batches = []
            for b in ld:
                assert np.array_equal(b["pixels"].numpy()[:, 0], b["_index"].numpy() % 251)  # the records' bytes
                batches.append(b["_index"].numpy().copy())
                if len(batches) == len(ld):  # the epoch's last batch: its counters, before the next plan
                    stats = ld.remote_stats()
            ids = np.concatenate(batches)
    ref = model.FileOrder(_class_sorted_layout().tolist(), 2, "quasi_random", None, True, 64)
    assert ids.tolist() == ref.perm(0)[: ids.shape[0]]
    assert stats["pages_fetched"] == 834, stats


@pytest.mark.parametrize("page_cache", ["os", "process"])
def test_a_window_larger_than_the_file_is_one_window(class_sorted_file, page_cache):
    """window_pages >= K is one window of every page (formats/order.md section 4), however large: 2**40 and 2**64
    give the model's order with M = K, nothing sized by M is allocated."""
    ref = model.FileOrder(_class_sorted_layout().tolist(), 3, "quasi_random", 834, True, 500)
    for m in (834, 2**40, 2**64):
        with Loader(class_sorted_file, batch_size=500, order="quasi_random", seed=3, num_threads=1, window_pages=m,
                    page_cache=page_cache, pipelines={"pixels": None}) as ld:
            it = iter(ld)
            got = np.concatenate([next(it)["_index"].numpy() for _ in range(3)])
            assert ld.state_dict()["window_pages"] == m
        assert got.tolist() == ref.perm(0)[:1500], m


def test_both_window_sizes_are_refused(class_sorted_file):
    with pytest.raises(ValueError, match=r"window_pages=8 and window_records=100 both size the quasi-random window"):
        Loader(class_sorted_file, batch_size=4, order="quasi_random", window_pages=8, window_records=100)
