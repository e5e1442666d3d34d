"""The Loader inside a trainer's own checkpointing (issue 33), for real: processes joined by gloo on 127.0.0.1.

torch.distributed.checkpoint (DCP, what torchtitan checkpoints with): the Loader is a ``Stateful`` as DCP defines it
(``state_dict()`` / ``load_state_dict()``), so ``dcp.save({"model": model, "loader": loader})`` saves its position
beside the model with no adapter. A tiny model is trained on packed token rows by 2 processes, the checkpoint is
taken after 3 steps and both processes are SIGKILLed; the run resumes from the checkpoint on 1 process (and on
2), and the global batches seen (row ids, rank slices concatenated) equal the uninterrupted 2-process run's, the
model's weights too. Expectations: the uninterrupted run, and a one-process loader of the global batch (whose
order tests/test_packing.py checks against the reference model); the resume goes through DCP's own save/load.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from pageset import Loader, TokenWindows, write_tokens

RUN = r"""
import json, os, signal, sys
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pageset import Loader, TokenWindows

path, ckpt, out, stop, mode = sys.argv[1:6]
dist.init_process_group("gloo")  # MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE from the parent, as torchrun sets
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
loader = Loader(path, batch_size=8 // world, order="random", seed=5, num_threads=1,  # global batch 8
                pipelines={"tokens": [TokenWindows(32, packing="best_fit")]})
model = torch.nn.Embedding(1000, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = {"model": model, "loader": loader}
if mode == "resume":
    dcp.load(state, checkpoint_id=ckpt)  # the loader's position is restored with the model: no adapter
seen = []
for step, batch in enumerate(loader):
    loss = model(batch["input"] % 1000).float().mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():  # data parallel by hand: average the gradients over the ranks
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    seen.append(batch["_index"].tolist())
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"ids": seen, "weight": model.weight.detach().flatten().tolist()}, f)
    if mode == "save" and step + 1 == int(stop):
        dcp.save(state, checkpoint_id=ckpt)
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)  # killed, not shut down: the checkpoint is all that survives
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp, path, world, mode, out, stop=0):
    """Run ``world`` processes; returns (the global batches they saw, rank slices concatenated, the weights)."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", RUN, str(path), str(tmp / "ckpt"), str(out), str(stop),
                                       mode], env=env))
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == ([-signal.SIGKILL] * world if mode == "save" else [0] * world), codes
    runs = [json.loads((tmp / f"{out.name}.{r}").read_text()) for r in range(world)]
    assert all(r["weight"] == runs[0]["weight"] for r in runs)  # the ranks agree on the model
    batches = [sum((runs[r]["ids"][k] for r in range(world)), []) for k in range(len(runs[0]["ids"]))]
    return batches, runs[0]["weight"]


@pytest.mark.parametrize("resume_world", [1, 2])
def test_dcp_checkpoint_resumes_on_another_world_size(tmp_path, resume_world):
    pytest.importorskip("torch.distributed.checkpoint")
    if not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed has no gloo backend")
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=int(n)) for n in rng.integers(5, 120, size=300)]
    path = tmp_path / "docs.pageset"
    write_tokens(path, docs, eos_id=999, num_workers=0, progress=False)
    with Loader(path, batch_size=8, order="random", seed=5,
                pipelines={"tokens": [TokenWindows(32, packing="best_fit")]}) as ld:
        steps = ld.steps_per_epoch
        reference = [b["_index"].tolist() for b in ld]  # one process, the global batch: what every run must see
    assert steps >= 6
    full, full_weight = _run(tmp_path, path, 2, "full", tmp_path / "full")
    assert full == reference
    first, _ = _run(tmp_path, path, 2, "save", tmp_path / "first", stop=3)
    rest, weight = _run(tmp_path, path, resume_world, "resume", tmp_path / "rest")
    assert first == full[:3] and rest == full[3:]  # nothing repeated, nothing skipped
    assert np.allclose(weight, full_weight, atol=1e-6)  # and the model trained on the same batches
