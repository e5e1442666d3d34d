"""Conversion on Ray: a real local Ray cluster (``ray.init(num_cpus=2)``, worker processes), RayExecutor tasks.

Each case compares the file written through Ray with the one written in this process (``num_workers=0``) byte for
byte, and the records with what the reference reader (tests/reference/format.py, written from the spec alone)
finds in it against the source itself: labels and image sizes come from the source, not from another run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pageset import Int, RGBImage, SampleError, write_dataset, write_tokens

ray = pytest.importorskip("ray")
from pageset.write.ray_executor import RayExecutor  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from reference.format import read_file  # noqa: E402
from test_cluster import KillOnce  # noqa: E402  (a source that SIGKILLs its worker the first time)

pytestmark = pytest.mark.slow  # a Ray cluster takes ~5-10 s to start on 2 cores


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A local Ray instance with 2 worker CPUs, no dashboard, a small object store; shut down after the module."""
    tmp = tmp_path_factory.mktemp("ray")
    # the workers import what this process imports: the tests' own modules (the sources defined there) and the
    # pageset on this process's path (a checkout's src/ in development)
    path = os.pathsep.join([str(Path(__file__).parent)] + [p for p in sys.path if p])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 2**20,
             _temp_dir=str(tmp), configure_logging=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        yield
    finally:
        ray.shutdown()


def _expected_sizes(photos, max_side):
    """(height, width) the writer must store for each photo: long side resized to ``max_side`` when larger
    (RGBImage(max_resolution=...) as formats/v1.md and the README state it), computed here with Pillow."""
    out = []
    for p in photos:
        with Image.open(p) as im:
            w, h = im.size
        s = max_side / max(w, h)
        out.append((h, w) if s >= 1 else (round(h * s), round(w * s)))
    return out


def test_image_write_on_ray_is_byte_identical(tmp_path, photos, ray_cluster):
    photos = photos[:10]
    fields = {"image": RGBImage(max_resolution=96), "label": Int()}
    src = [(p, k % 3) for k, p in enumerate(photos)]
    kw = {"progress": False, "lineage": False, "page_size": 1 << 14}
    write_dataset(tmp_path / "ref.pageset", src, fields, num_workers=0, **kw)
    for chunk in (3, 10):
        out = tmp_path / f"ray{chunk}.pageset"
        write_dataset(out, src, fields, executor=RayExecutor(), chunk_size=chunk, **kw)
        assert out.read_bytes() == (tmp_path / "ref.pageset").read_bytes()
    ref = read_file(tmp_path / "ray3.pageset")
    assert [r["label"] for r in ref.records] == [k % 3 for k in range(len(photos))]
    sizes = [(r["image"]["height"], r["image"]["width"]) for r in ref.records]
    want = _expected_sizes(photos, 96)
    assert all(abs(a - c) <= 1 and abs(b - d) <= 1 for (a, b), (c, d) in zip(sizes, want)), (sizes, want)
    assert not [n for n in os.listdir(tmp_path) if ".shards-" in n or ".tmp-" in n]


def test_token_write_on_ray_is_byte_identical(tmp_path, ray_cluster):
    docs = [np.arange(k, k + 40 + 7 * k, dtype=np.int64) for k in range(25)]  # pre-tokenized ids
    kw = {"progress": False, "lineage": False, "page_size": 1 << 12}
    write_tokens(tmp_path / "ref.pageset", docs, None, eos_id=1, num_workers=0, **kw)
    write_tokens(tmp_path / "ray.pageset", docs, None, eos_id=1, executor=RayExecutor(), chunk_docs=4, **kw)
    assert (tmp_path / "ray.pageset").read_bytes() == (tmp_path / "ref.pageset").read_bytes()
    ref = read_file(tmp_path / "ray.pageset")
    want = [t for d in docs for t in [*d.tolist(), 1]]  # EOS after each document (formats/v1.md)
    assert ref.tokens == want


def test_worker_sigkilled_mid_task_is_rerun_same_bytes(tmp_path, photos, ray_cluster):
    photos = photos[:9]
    fields = {"image": RGBImage(max_resolution=64), "label": Int()}
    marker = tmp_path / "killed"
    src = KillOnce(photos, bad=4, marker=str(marker), driver_pid=os.getpid())
    kw = {"progress": False, "lineage": False, "page_size": 1 << 14}
    write_dataset(tmp_path / "ref.pageset", src, fields, num_workers=0, **kw)
    write_dataset(tmp_path / "out.pageset", src, fields, executor=RayExecutor(max_retries=2), chunk_size=3, **kw)
    assert marker.exists() and int(marker.read_text()) != os.getpid()  # a Ray worker really died
    assert (tmp_path / "out.pageset").read_bytes() == (tmp_path / "ref.pageset").read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["killed", "out.pageset", "ref.pageset"]


def test_worker_killed_without_retries_fails_and_writes_nothing(tmp_path, photos, ray_cluster):
    fields = {"image": RGBImage(max_resolution=64), "label": Int()}
    marker = tmp_path / "killed"
    src = KillOnce(photos[:6], bad=2, marker=str(marker), driver_pid=os.getpid())
    with pytest.raises(ray.exceptions.RayError):
        write_dataset(tmp_path / "out.pageset", src, fields, executor=RayExecutor(max_retries=0), chunk_size=3,
                      progress=False, lineage=False)
    assert sorted(os.listdir(tmp_path)) == ["killed"]  # no output, no shard folder left behind


def test_bad_sample_on_ray_names_index_and_is_not_retried(tmp_path, photos, ray_cluster):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8 not a jpeg")
    src = [(p, 0) for p in photos[:4]] + [(str(bad), 0)]
    with pytest.raises(SampleError, match=r"sample 4\b.*image"):
        write_dataset(tmp_path / "out.pageset", src, {"image": RGBImage(), "label": Int()},
                      executor=RayExecutor(), chunk_size=2, progress=False)
    assert not (tmp_path / "out.pageset").exists()


def test_submit_after_shutdown_is_refused():
    ex = RayExecutor()
    ex.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(print, 1)


def test_cli_convert_on_ray(tmp_path, imagenet_like):
    """`pageset convert ... --ray local` (a new local Ray instance in the CLI's own process) writes the records of
    ``--num-workers 0`` (same dataset id); the records are the ImageFolder's (labels = class folder order, checked by the reference
    reader against the folder listing)."""
    import subprocess

    from pageset.cli import main

    base = ["--max-resolution", "64", "--page-size", "16384", "--no-progress"]
    assert main(["convert", str(tmp_path / "local.pageset"), str(imagenet_like), "--num-workers", "0"] + base) == 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    run = subprocess.run([sys.executable, "-m", "pageset.cli", "convert", str(tmp_path / "ray.pageset"),
                          str(imagenet_like), "--ray", "local", "--chunk-size", "16"] + base,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ref = read_file(tmp_path / "ray.pageset")  # lineage differs (times, hosts); the records do not
    assert ref.dataset_id == read_file(tmp_path / "local.pageset").dataset_id
    classes = sorted(p.name for p in Path(imagenet_like).iterdir() if p.is_dir())
    want = [k for k, c in enumerate(classes) for _ in sorted((Path(imagenet_like) / c).iterdir())]
    assert [r["label"] for r in ref.records] == want


# ---- Ray Data: PagesetDatasink --------------------------------------------------------------------------------

def _rows(photos, n):
    """n rows as Ray Data holds them: encoded JPEG bytes (the photos' own files) and an int label."""
    return [{"image": Path(photos[i % len(photos)]).read_bytes(), "label": 7 * i + 1, "extra": "ignored"}
            for i in range(n)]


def _ray_dataset(rows, blocks):
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    return ray.data.from_items(rows, override_num_blocks=blocks)


def test_datasink_writes_one_member_per_task_as_the_manifest_spec_says(tmp_path, photos, ray_cluster):
    from pageset import Int, RGBImage, open_dataset
    from pageset.write.ray_datasink import PagesetDatasink

    from reference.manifest import read_set

    rows = _rows(photos, 12)
    sink = PagesetDatasink(tmp_path / "set", {"image": RGBImage(max_resolution=64), "label": Int()},
                           page_size=1 << 13, lineage=False)
    _ray_dataset(rows, 3).write_datasink(sink)
    ref = read_set(tmp_path / "set")  # the reference reader: manifest checks, members, global order
    assert [r["label"] for r in ref.records] == [7 * i + 1 for i in range(12)]
    assert [len(m.records) for m in ref.members] == [4, 4, 4]  # one member per Ray block, in task order
    assert sink.manifest.dataset_id == ref.dataset_id
    # the same rows written by write_dataset(records_per_member=4) give members with the same content ids
    write_dataset(tmp_path / "direct", rows, {"image": RGBImage(max_resolution=64), "label": Int()},
                  records_per_member=4, page_size=1 << 13, lineage=False, num_workers=0, progress=False)
    assert read_set(tmp_path / "direct").dataset_id == ref.dataset_id
    with open_dataset(tmp_path / "set") as ds:
        assert len(ds) == 12 and ds.read(5, "label") == 36


def test_datasink_append_and_killed_write_task(tmp_path, photos, ray_cluster):
    from pageset import Int, RGBImage
    from pageset.write.ray_datasink import PagesetDatasink

    from reference.manifest import read_set

    fields = {"image": RGBImage(max_resolution=48), "label": Int()}
    _ray_dataset(_rows(photos, 6), 2).write_datasink(PagesetDatasink(tmp_path / "set", fields, lineage=False))
    first = read_set(tmp_path / "set")
    marker = tmp_path / "killed"

    class Killing(PagesetDatasink):
        def write(self, blocks, ctx):
            if ctx.task_idx == 1 and not marker.exists():
                marker.write_text(str(os.getpid()))
                os.kill(os.getpid(), 9)
            return super().write(blocks, ctx)

    more = [dict(r, label=100 + r["label"]) for r in _rows(photos, 6)]
    _ray_dataset(more, 3).write_datasink(Killing(tmp_path / "set", fields, append=True, lineage=False))
    assert marker.exists() and int(marker.read_text()) != os.getpid()  # a Ray worker really died
    ref = read_set(tmp_path / "set")
    assert [r["label"] for r in ref.records] == [7 * i + 1 for i in range(6)] + [101 + 7 * i for i in range(6)]
    assert ref.manifest["generation"] == 2 and ref.manifest["appended_to"]["dataset_id"] == first.dataset_id
    names = sorted(os.listdir(tmp_path / "set"))
    assert names == sorted(["pageset.manifest.json"] + [m["name"] for m in ref.manifest["members"]])


def test_datasink_bad_row_fails_and_leaves_the_previous_set(tmp_path, photos, ray_cluster):
    from pageset import Int, RGBImage
    from pageset.write.ray_datasink import PagesetDatasink

    fields = {"image": RGBImage(max_resolution=48), "label": Int()}
    _ray_dataset(_rows(photos, 4), 2).write_datasink(PagesetDatasink(tmp_path / "set", fields))
    before = sorted(os.listdir(tmp_path / "set"))
    bad = _rows(photos, 6)
    bad[4]["image"] = b"\xff\xd8 not a jpeg"
    with pytest.raises(Exception, match=r"sample 1\b.*image"):  # row 1 of the task holding rows 3-5
        _ray_dataset(bad, 2).write_datasink(PagesetDatasink(tmp_path / "set", fields, append=True))
    assert sorted(os.listdir(tmp_path / "set")) == before


def test_many_file_write_on_ray_is_byte_identical(tmp_path, photos, ray_cluster):
    """write_dataset(records_per_member=..., executor=RayExecutor()): every member and the manifest are the bytes
    of num_workers=0 (formats/manyfile.md section 6: cuts depend on the input and settings only), and the set read
    by the reference manifest reader holds the source's labels in order."""
    from reference.manifest import read_set

    src = [(p, 3 * k) for k, p in enumerate(photos[:9])]
    fields = {"image": RGBImage(max_resolution=48), "label": Int()}
    kw = {"progress": False, "lineage": False, "page_size": 1 << 13, "records_per_member": 4}
    write_dataset(tmp_path / "ref", src, fields, num_workers=0, **kw)
    write_dataset(tmp_path / "ray", src, fields, executor=RayExecutor(), **kw)
    names = sorted(os.listdir(tmp_path / "ref"))
    assert names == sorted(os.listdir(tmp_path / "ray")) and len(names) == 4  # 3 members + the manifest
    for name in names:
        assert (tmp_path / "ray" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name
    assert [r["label"] for r in read_set(tmp_path / "ray").records] == [3 * k for k in range(9)]
