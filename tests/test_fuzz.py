"""A short run of the file fuzzer (``tools/fuzz.py``; the long run is ``tools/fuzz.py --files 10000``).

Mutated image and token files (bit flips, truncation, edited header / section table / index / doc_offsets /
schema fields with their CRCs recomputed, swapped sections) must open, verify, read and load to the original
data, or raise a ``pageset.FormatError`` subclass: no other exception, no MemoryError, no silently different
data, no crash or hang of the child process that runs them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture(scope="module")
def fuzz():
    spec = importlib.util.spec_from_file_location("pageset_tools_fuzz", TOOLS / "fuzz.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def seed_dir(tmp_path_factory, fuzz):
    folder = tmp_path_factory.mktemp("fuzzseeds")
    fuzz.build_seeds(str(folder))
    return folder


def test_seed_files_are_valid_and_load(fuzz, seed_dir):
    """The fuzzer's baseline snapshots hold what was written (not just the same thing twice)."""
    import io

    import numpy as np
    from PIL import Image

    samples, _, docs = fuzz.seed_samples()
    records = fuzz.read_image_file(str(seed_dir / "image.pageset"))
    assert len(records) == len(samples) == 6
    for k, (rec, (small, tiny, label, arr, blob, meta)) in enumerate(zip(records, samples)):
        assert rec["label"] == label == k and rec["blob"] == blob and rec["meta"] == meta
        assert rec["arr"] == fuzz._norm(arr)
        assert rec["raw"][:4] == ("img", tiny.shape[0], tiny.shape[1], "raw")
        assert rec["raw"][5] == tiny.tobytes()  # raw pixels are lossless
        assert rec["image"][:4] == ("img", small.shape[0], small.shape[1], "jpeg")
        decoded = np.frombuffer(rec["image"][5], np.uint8).reshape(small.shape)
        with Image.open(io.BytesIO(rec["image"][4])) as im:  # the stored JPEG, decoded by Pillow
            assert np.array_equal(decoded, np.asarray(im.convert("RGB")))
        assert np.abs(decoded.astype(int) - small).mean() < 16  # JPEG q80 of a tiny, busy photo
    tokens, offsets, eos_id, dtype, got_docs, n16 = fuzz.read_token_file(str(seed_dir / "tokens.pageset"))
    assert eos_id == 0 and len(got_docs) == len(docs) == 8
    stream = np.concatenate([np.r_[d, 0] for d in docs])  # each document followed by eos_id
    assert np.array_equal(np.frombuffer(tokens, np.dtype(dtype)), stream)
    for got, doc in zip(got_docs, docs):
        assert np.array_equal(np.frombuffer(got, np.dtype(dtype))[: doc.size], doc)
    assert n16 == (stream.size - 1) // 16
    for kind, (_, load) in fuzz.READERS.items():
        assert len(load(str(seed_dir / f"{kind}.pageset"))) >= 2


def test_mutations_are_deterministic_and_varied(fuzz, seed_dir):
    orig = (seed_dir / "image.pageset").read_bytes()
    a = [fuzz.mutate(orig, "image", 0, i) for i in range(60)]
    b = [fuzz.mutate(orig, "image", 0, i) for i in range(60)]
    assert a == b
    kinds = {desc.split(" ")[0] for _, desc in a}
    assert {"flip", "flip_fixed", "header", "entry", "index", "schema"} <= kinds


def test_fixed_crcs_reach_semantic_checks(fuzz, seed_dir):
    """An index edit with every CRC recomputed passes the checksums and is caught by the index bounds check."""
    import numpy as np

    from pageset import IndexBoundsError, open_dataset
    from pageset.format import constants as C

    path = seed_dir / "image.pageset"
    data = bytearray(path.read_bytes())
    with open_dataset(path) as ds:
        index = ds.index.copy()
    off, length = fuzz._section(data, C.SECTION_INDEX)
    index[2]["blob.length"] = np.uint64(1 << 40)
    data[off : off + length] = index.tobytes()
    fuzz.fix_crcs(data)
    bad = seed_dir / "bad.pageset"
    bad.write_bytes(bytes(data))
    with pytest.raises(IndexBoundsError, match="record 2: field 'blob'"):
        open_dataset(bad)


def test_fuzz_short_run(fuzz, seed_dir):
    summary = fuzz.run(300, seed=11, jobs=2, timeout=300, seed_dir=str(seed_dir), log=lambda *a: None)
    print(summary["outcomes"], summary["crash_test_errors"], summary["seconds"])
    assert summary["files"] == 300
    assert summary["failure_count"] == 0, summary["failures"][:5]
    detected = sum(v for k, v in summary["outcomes"].items() if k.startswith("detected:"))
    assert detected > 150 and summary["outcomes"].get("same", 0) > 0
