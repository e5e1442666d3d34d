"""Concurrency (issue 6, part 5): two Loaders over one file in one process and in two processes; a file
replaced by ``write_dataset`` while a Loader reads the old one; two writers racing for one target path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from resume_contract import batch_digest

from pageset import (
    Int,
    Loader,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RGBImage,
    open_dataset,
    write_dataset,
)

PIPES = {"image": [RandomResizedCrop(32), RandomHorizontalFlip()]}


@pytest.fixture(scope="module")
def image_file(tmp_path_factory, imagenet_like):
    path = tmp_path_factory.mktemp("conc") / "train.pageset"
    write_dataset(path, imagenet_like, {"image": RGBImage(max_resolution=96, jpeg_quality=85), "label": Int()},
                  num_workers=0, page_size=1 << 14, progress=False)
    return path




def _epochs(path, seed, epochs=2, **kw) -> list[str]:
    with Loader(path, batch_size=8, pipelines=PIPES, seed=seed, num_threads=2, **kw) as loader:
        return [batch_digest(b) for _ in range(epochs) for b in loader]


def test_two_loaders_one_process_interleaved(image_file):
    control = {seed: _epochs(image_file, seed) for seed in (1, 2)}
    control_q = _epochs(image_file, 1, order="quasi_random", page_cache="process")
    results, errors = {}, []

    def run(name, seed, **kw):
        try:
            results[name] = _epochs(image_file, seed, **kw)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=("a", 1)), threading.Thread(target=run, args=("b", 2)),
               threading.Thread(target=run, args=("c", 1), kwargs={"order": "quasi_random", "page_cache": "process"}),
               threading.Thread(target=run, args=("d", 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert results["a"] == control[1] == results["d"] and results["b"] == control[2]
    assert results["c"] == control_q and control[1] != control[2]


def test_two_loaders_step_interleaved_in_one_thread(image_file):
    """Two Loaders over one file advanced alternately (batches held, not copied) equal each one alone."""
    control = _epochs(image_file, 4, epochs=1)
    with Loader(image_file, batch_size=8, pipelines=PIPES, seed=4, num_threads=2) as a, \
            Loader(image_file, batch_size=8, pipelines=PIPES, seed=4, num_threads=1) as b:
        kept_a, kept_b = [], []
        for ba, bb in zip(a, b):
            kept_a.append(ba)
            kept_b.append(bb)
        assert [batch_digest(x) for x in kept_a] == control == [batch_digest(x) for x in kept_b]


SCRIPT = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np
    from pageset import Loader, RandomHorizontalFlip, RandomResizedCrop
    pipes = {"image": [RandomResizedCrop(32), RandomHorizontalFlip()]}
    out = []
    with Loader(sys.argv[1], batch_size=8, pipelines=pipes, seed=int(sys.argv[2]), num_threads=2) as loader:
        for _ in range(2):
            for b in loader:
                h = hashlib.sha256()
                for k in sorted(b):
                    h.update(k.encode()); h.update(np.ascontiguousarray(np.asarray(b[k])).tobytes())
                out.append(h.hexdigest())
    print(json.dumps(out))
""")


def test_two_loaders_two_processes(image_file):
    import json

    control = {seed: _epochs(image_file, seed) for seed in (1, 2)}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(image_file), str(seed)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for seed in (1, 2, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    got = [json.loads(out) for out, _ in outs]
    assert got[0] == control[1] == got[2] and got[1] == control[2]


def _source(seed, n=24):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 256, size=(40 + k, 56, 3), dtype=np.uint8), k + 1000 * seed) for k in range(n)]


def test_replace_file_while_a_loader_reads_the_old_one(tmp_path):
    path = tmp_path / "live.pageset"
    fields = {"image": RGBImage(encoding="raw"), "label": Int()}
    old = write_dataset(path, _source(1), fields, num_workers=0, page_size=1 << 14, progress=False)
    control = _epochs(path, 3, epochs=3, order="quasi_random")
    with Loader(path, batch_size=8, pipelines=PIPES, seed=3, num_threads=2, order="quasi_random") as loader:
        assert loader.dataset_id == old.dataset_id
        got = []
        for epoch in range(3):
            for step, batch in enumerate(loader):
                got.append(batch_digest(batch))
                if step == 0:  # replace the file under the running loader, once per epoch
                    new = write_dataset(path, _source(10 + epoch, n=30), fields, num_workers=0,
                                        page_size=1 << 12, progress=False)
                    assert new.dataset_id != old.dataset_id
        assert got == control  # the reader keeps the old inode: a consistent view of the old file
    with open_dataset(path) as ds:  # the path now holds the last new file, complete and valid
        assert len(ds) == 30 and ds.dataset_id == new.dataset_id
        ds.verify()
    assert sorted(os.listdir(tmp_path)) == ["live.pageset"]


WRITER = textwrap.dedent("""
    import sys, numpy as np
    from pageset import Int, NDArray, write_dataset
    seed, path, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    rng = np.random.default_rng(seed)
    src = [(rng.standard_normal((64, 64)).astype(np.float32), seed * 100000 + k) for k in range(n)]
    r = write_dataset(path, src, {"x": NDArray("float32", (64, 64)), "y": Int()}, num_workers=int(sys.argv[4]),
                      progress=False, page_size=1 << 16)
    print(r.dataset_id)
""")


@pytest.mark.parametrize("workers", [0, 1])
def test_two_writers_one_target(tmp_path, workers):
    path = tmp_path / "target.pageset"
    ids = {}
    for seed in (1, 2):  # the reference content of each writer, written alone elsewhere
        out = subprocess.run([sys.executable, "-c", WRITER, str(seed), str(tmp_path / f"ref{seed}"), "400",
                              str(workers)], capture_output=True, text=True, timeout=300, check=True)
        ids[seed] = out.stdout.strip()
    for _ in range(2):
        procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(seed), str(path), "400", str(workers)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (_, err) in zip(procs, outs):
            assert p.returncode == 0, err
        with open_dataset(path) as ds:
            ds.verify()
            assert ds.dataset_id in ids.values()
            winner = 1 if ds.dataset_id == ids[1] else 2
            labels = ds.index["y"]
            assert (labels // 100000 == winner).all()  # no mixed file: every record from the winner
        with open_dataset(tmp_path / f"ref{winner}") as ref:
            a = path.read_bytes()
            b = (tmp_path / f"ref{winner}").read_bytes()
            # identical bytes from the end of the header (its table CRC covers the metadata entry) to the
            # lineage metadata section (creation time differs): pages, schema, index and page CRCs
            meta = next(e for e in _entries(a) if e[0] == 4)
            meta_b = next(e for e in _entries(b) if e[0] == 4)
            assert meta[1] == meta_b[1] and a[160 : meta[1]] == b[160 : meta_b[1]]
            assert ref.dataset_id == ids[winner]
    leftovers = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert leftovers == []


def _entries(data: bytes):
    from pageset.format.layout import HEADER, SECTION_ENTRY

    h = np.frombuffer(data[:160], dtype=HEADER)[0]
    off, count = int(h["section_table_offset"]), int(h["section_count"])
    table = np.frombuffer(data[off : off + count * 32], dtype=SECTION_ENTRY)
    return [(int(e["kind"]), int(e["offset"]), int(e["length"])) for e in table]
