"""The kill-and-resume harness shared by the training examples (train_cnn, train_gpt).

A training script runs as ``python -m <module> --worker ...`` and appends one JSON line per step
(``{"epoch", "step", "loss", "index"}``) to its log, checkpoints (model + optimizer + ``loader.state_dict()``)
every ``--ckpt-every`` steps, stalls at ``--stall-at`` (so the parent can SIGKILL it mid-epoch, after a
checkpoint) and, with ``--resume``, truncates its log to the checkpoint and continues from it. The harness runs an
uninterrupted control, then a killed run and its resumption, and compares the logs: the same sample stream (every
batch's ``_index``) and, on CPU with deterministic kernels, bit-identical losses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_worker_args(ap, *data_args: str) -> None:
    """The hidden arguments of a training script's worker process (``--worker``, its data paths, log, ckpt)."""
    import argparse

    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in (*data_args, "--log", "--ckpt"):
        ap.add_argument(name, help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)


def restore(args, model, opt, loader) -> int:
    """Worker start: with ``--resume`` load model, optimizer and loader state from ``--ckpt`` and cut the log back
    to the checkpoint; otherwise start an empty log. Returns the steps already done."""
    import torch

    log_path = Path(args.log)
    if not args.resume:
        log_path.write_text("")
        return 0
    state = torch.load(args.ckpt, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    loader.load_state_dict(state["loader"])
    resume_log(log_path, state["steps"])
    return state["steps"]


def record_step(args, log, done: int, epoch: int, loss: float, batch, model, opt, loader) -> None:
    """After step ``done``: append its log line, checkpoint every ``--ckpt-every`` steps (``loader.state_dict()``
    counts batches handed out, so the state is "after step ``done``"), and stall at ``--stall-at`` so the parent
    can SIGKILL the process mid-epoch, past a checkpoint."""
    log.write(json.dumps({"epoch": epoch, "step": done, "loss": loss, "index": batch["_index"].tolist()}) + "\n")
    log.flush()
    if args.ckpt and done % args.ckpt_every == 0:
        atomic_save({"model": model.state_dict(), "optimizer": opt.state_dict(), "loader": loader.state_dict(),
                     "steps": done}, Path(args.ckpt))
    if args.stall_at and done == args.stall_at:
        os.fsync(log.fileno())
        time.sleep(3600)


def read_log(path) -> list[dict]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln]


def atomic_save(obj, path: Path) -> None:
    """torch.save to a temp file, fsync, rename: a SIGKILL never leaves a half-written checkpoint."""
    import torch

    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def resume_log(log_path: Path, steps: int) -> None:
    """Keep the first ``steps`` lines: steps run after the checkpoint died with the killed process."""
    lines = log_path.read_text().splitlines()[:steps]
    log_path.write_text("".join(ln + "\n" for ln in lines))


def _run(cmd) -> dict:
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"training failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def kill_and_resume(module: str, worker_args: list[str], out: Path, total_steps: int, steps_per_epoch: int,
                    ckpt_every: int, stall: int) -> dict:
    """Control run, SIGKILL at step ``stall`` (after a checkpoint), resume; returns the comparison."""
    base = [sys.executable, "-m", module, "--worker", *worker_args, "--ckpt-every", str(ckpt_every)]
    t = time.perf_counter()
    control = _run(base + ["--log", str(out / "control.log")])
    train_s = time.perf_counter() - t
    stall = min(stall, total_steps - 1)
    if stall <= ckpt_every:
        raise SystemExit(f"kill step {stall} comes before the first checkpoint (every {ckpt_every})")
    ckpt, log = out / "ckpt.pt", out / "resumed.log"
    ckpt.unlink(missing_ok=True)
    log.unlink(missing_ok=True)  # a previous run's log must not look like this run's progress
    t = time.perf_counter()
    proc = subprocess.Popen(base + ["--log", str(log), "--ckpt", str(ckpt), "--stall-at", str(stall)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the run to be killed exited early (rc={proc.returncode}): {proc.stderr.read()[-2000:]}")
        if log.exists() and len(read_log(log)) >= stall:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    import torch

    saved = torch.load(ckpt, weights_only=False)
    killed_at, ckpt_step = len(read_log(log)), saved["steps"]
    print(f"SIGKILL at step {killed_at} (epoch {killed_at // steps_per_epoch}, step {killed_at % steps_per_epoch} "
          f"of {steps_per_epoch}); last checkpoint after step {ckpt_step}, loader state {saved['loader']}")
    resumed = _run(base + ["--log", str(log), "--ckpt", str(ckpt), "--resume"])
    a, b = read_log(out / "control.log"), read_log(log)
    same_stream = [x["index"] for x in a] == [x["index"] for x in b]
    same_loss = [x["loss"] for x in a] == [x["loss"] for x in b]
    print(f"resumed from step {ckpt_step}: {len(b)} steps logged; same sample stream: {same_stream}; "
          f"identical losses: {same_loss}")
    return {"control": control, "resumed": resumed, "train_s": train_s, "killed_at_step": killed_at,
            "checkpoint_step": ckpt_step, "kill_and_resume_s": time.perf_counter() - t,
            "same_sample_stream": same_stream, "same_losses": same_loss,
            "first_difference": next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None),
            "steps_compared": len(a), "loss_first_last": [a[0]["loss"], a[-1]["loss"]]}
