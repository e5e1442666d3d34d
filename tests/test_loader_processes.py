"""Real processes: 4 ranks on one file, and a SIGKILL mid-epoch resumed on another world size."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from pageset import Int, Loader, RGBImage, write_dataset

pytestmark = pytest.mark.slow

RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pageset import Loader
    path, rank, world, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    result = {}
    for order in ("random", "quasi_random", "sequential"):
        with Loader(path, batch_size=5, pipelines={"image": None}, order=order, seed=3, window_pages=2,
                    rank=rank, world_size=world, num_threads=1, drop_last=True) as loader:
            result[order] = [b["_index"].tolist() for b in loader]
    json.dump(result, open(out, "w"))
    """
)

RUN_SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys, time
    from pageset import Loader, RandomResizedCrop, RandomHorizontalFlip, Normalize, ToTensor
    path, rank, world, batch, threads, state_in, log, save_at = sys.argv[1:9]
    rank, world, batch, threads, save_at = int(rank), int(world), int(batch), int(threads), int(save_at)
    workers = int(sys.argv[9]) if len(sys.argv) > 9 else 0
    pipe = {"image": [RandomResizedCrop(32), RandomHorizontalFlip(), Normalize(), ToTensor()]}
    loader = Loader(path, batch_size=batch, pipelines=pipe, order="quasi_random", seed=21, window_pages=2,
                    rank=rank, world_size=world, num_threads=threads, batches_ahead=4, num_workers=workers)
    if state_in != "-":
        loader.load_state_dict(json.load(open(state_in)))
    with open(log, "a") as f:
        for step, b in enumerate(loader):
            for j, rid in enumerate(b["_index"].tolist()):
                h = hashlib.sha256(b["image"][j].numpy().tobytes()).hexdigest()[:16]
                f.write(f"{rid} {h}\\n")
            f.flush()
            if step == save_at:
                json.dump(loader.state_dict(), open(log + ".state", "w"))
                # wait (bounded) until the prefetch queue is full: the next batches_ahead - 1 steps are loaded
                ahead = [s for s in loader._slots if s.step > step]
                assert sorted(s.step for s in ahead) == [step + 1, step + 2, step + 3], [s.step for s in ahead]
                deadline = time.monotonic() + 120
                while not all(s.done.is_set() for s in ahead):
                    assert time.monotonic() < deadline, "the prefetch queue did not fill in 120 s"
                    time.sleep(0.01)
                open(log + ".ready", "w").close()
                time.sleep(600)
    """
)


@pytest.fixture(scope="module")
def small_file(tmp_path_factory, imagenet_like):
    path = tmp_path_factory.mktemp("proc") / "d.pageset"
    write_dataset(path, imagenet_like, {"image": RGBImage(max_resolution=96), "label": Int()}, num_workers=0,
                  page_size=1 << 14, progress=False)
    return path


def _env():
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def test_four_processes_disjoint_complete_equal_steps(tmp_path, small_file):
    procs, outs = [], []
    for rank in range(4):
        out = tmp_path / f"rank{rank}.json"
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(small_file), str(rank), "4",
                                       str(out)], env=_env()))
    for p in procs:
        assert p.wait(timeout=300) == 0
    results = [json.loads(o.read_text()) for o in outs]
    n, G = 48, 20
    for order in ("random", "quasi_random", "sequential"):
        per_rank = [r[order] for r in results]
        assert len({len(r) for r in per_rank}) == 1 and len(per_rank[0]) == n // G  # equal step counts
        flat = [i for r in per_rank for b in r for i in b]
        assert len(flat) == len(set(flat)) == (n // G) * G  # disjoint, complete up to drop_last
        # an all-gather in rank order reproduces the single-process global batch, step by step
        global_steps = [sum((r[s] for r in per_rank), []) for s in range(n // G)]
        with Loader(small_file, batch_size=G, pipelines={"image": None}, order=order, seed=3, window_pages=2,
                    num_threads=2, drop_last=True) as one:
            control = [b["_index"].tolist() for b in one]
        assert len(control) == n // G and all(len(g) == G for g in control)
        assert global_steps == control, order


def _read_log(path):
    return [tuple(line.split()) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("num_workers", [0, 1])  # 1: process mode, the whole process group (trainer + child) killed
def test_sigkill_mid_epoch_then_resume_on_another_world_size(tmp_path, small_file, num_workers):
    w = str(num_workers)
    # control: one process, global batch 8, uninterrupted, threads in process (both modes must equal it)
    control_log = tmp_path / "control.log"
    subprocess.run([sys.executable, "-c", RUN_SCRIPT, str(small_file), "0", "1", "8", "2", "-",
                    str(control_log), "-1", "0"], check=True, env=_env(), timeout=300)
    control = _read_log(control_log)
    assert len(control) == 48
    # run: two ranks of batch 4 (global batch 8), killed after step 2 with prefetch in flight
    logs = [tmp_path / f"r{r}.log" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", RUN_SCRIPT, str(small_file), str(r), "2", "4", "2", "-",
                               str(logs[r]), "2", w], env=_env(), start_new_session=True) for r in range(2)]
    deadline = time.monotonic() + 300
    while not all(os.path.exists(str(lg) + ".ready") for lg in logs):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.1)
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    states = [json.loads(open(str(lg) + ".state").read()) for lg in logs]
    assert states[0] == states[1] and states[0]["cursor"] == 24  # same state on every rank, 3 steps of 8
    before = [_read_log(lg) for lg in logs]
    merged = [x for s in range(3) for r in range(2) for x in before[r][4 * s : 4 * s + 4]]
    assert merged == control[:24]
    # resume: one process (world size 1, batch 8) with one thread
    resumed_log = tmp_path / "resumed.log"
    subprocess.run([sys.executable, "-c", RUN_SCRIPT, str(small_file), "0", "1", "8", "1", str(logs[0]) + ".state",
                    str(resumed_log), "-1", w], check=True, env=_env(), timeout=300)
    assert _read_log(resumed_log) == control[24:]  # same ids and the same augmented pixels
    assert np.unique([rid for rid, _ in control]).size == 48
