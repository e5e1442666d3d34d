"""The shared resume contract every stateful loader configuration must pass (images and tokens alike).

``check_resume(make_loader, global_batch, world_sizes, cuts)``: ``make_loader(rank, world_size, batch_size,
num_threads)`` builds a Loader. The control is one uninterrupted process-local run over two epochs on world size
1. For each cut (a number of global steps, possibly at an epoch end) and each world size W dividing G, the run
is interrupted after ``cut`` steps on W ranks, its state is saved, and it resumes on the next world size of the
list with another thread count: the concatenated global stream (ids and a digest of every sample's outputs)
must equal the control's from the cut on. With ``expected``, the control itself is anchored to an independent
expectation: its ``(_source, _index)`` stream must equal ``expected(n_samples)`` (the reference model's,
``tests/reference/order.py``), so a bug that changes every run alike cannot pass as "resume equals control".
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def batch_digest(batch) -> str:
    """One SHA-256 over every entry of a batch (keys sorted; tensors and arrays by their bytes)."""
    h = hashlib.sha256()
    for key in sorted(batch):
        v = batch[key]
        arr = v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
        h.update(key.encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def sample_digests(batch) -> list[str]:
    """One digest per sample of a batch over every per-sample output (ids included)."""
    keys = sorted(k for k, v in batch.items() if hasattr(v, "shape") and len(v.shape) >= 1 and k != "cu_seqlens")
    n = len(batch["_index"])
    out = []
    for j in range(n):
        h = hashlib.sha256()
        for k in keys:
            v = batch[k]
            if v.shape[0] != n:
                continue
            arr = v[j].numpy() if isinstance(v, torch.Tensor) else np.asarray(v[j])
            h.update(k.encode() + np.ascontiguousarray(arr).tobytes())
        out.append(h.hexdigest()[:20])
    return out


def global_stream(loaders, steps, ids=None):
    """Run ``steps`` global steps over per-rank loaders; the all-gather (rank order) of each step. ``ids``: a list
    that gets each sample's ``(_source or 0, _index)`` appended."""
    its = [iter(ld) for ld in loaders]
    stream = []
    for _ in range(steps):
        for it in its:
            b = next(it)
            stream.extend(sample_digests(b))
            if ids is not None:
                src = b["_source"].tolist() if "_source" in b else [0] * len(b["_index"])
                ids.extend(zip(src, b["_index"].tolist()))
    return stream


def run_epochs(make_loader, world_size, batch_size, threads, epochs, ids=None):
    loaders = [make_loader(r, world_size, batch_size, threads) for r in range(world_size)]
    try:
        stream = []
        for _ in range(epochs):
            stream += global_stream(loaders, loaders[0].steps_remaining, ids)
        return stream
    finally:
        for ld in loaders:
            ld.close()


def check_resume(make_loader, global_batch, world_sizes, cuts, epochs=2, expected=None):
    control_ids: list = []
    control = run_epochs(make_loader, 1, global_batch, 2, epochs, control_ids)
    if expected is not None:
        assert control_ids == expected(len(control_ids)), "the control run differs from the reference model"
    with make_loader(0, 1, global_batch, 1) as probe:
        steps_per_epoch = probe.steps_per_epoch
    total = steps_per_epoch * epochs
    assert len(control) == total * global_batch
    for w in world_sizes:
        for cut in cuts:
            cut = min(cut, total)
            loaders = [make_loader(r, w, global_batch // w, 1) for r in range(w)]
            done = []
            remaining = cut
            while remaining:
                k = min(remaining, loaders[0].steps_remaining)
                done += global_stream(loaders, k)
                remaining -= k
            states = [ld.state_dict() for ld in loaders]
            assert all(s == states[0] for s in states), "the state must be the same on every rank"
            for ld in loaders:
                ld.close()
            assert done == control[: cut * global_batch]
            w2 = world_sizes[(world_sizes.index(w) + 1) % len(world_sizes)]
            resumed = [make_loader(r, w2, global_batch // w2, 2) for r in range(w2)]
            for ld in resumed:
                ld.load_state_dict(states[0])
            rest = []
            left = total - cut
            while left:
                k = resumed[0].steps_remaining
                rest += global_stream(resumed, k)
                left -= k
            for ld in resumed:
                ld.close()
            assert rest == control[cut * global_batch :], (w, w2, cut)


def model_layout(path, seq_len=None):
    """``(page_sizes, dataset_id)`` of a file for the reference model: records (or seq_len token windows) per page
    computed by ``tests/reference/order.py`` from the index offsets (formats/order.md sections 6 and 7)."""
    from reference import order as model

    from pageset.read import Dataset

    with Dataset(path) as ds:
        if seq_len is None:
            sizes = model.record_page_sizes(ds.index["_offset"].tolist(), ds.data_offset, ds.page_size,
                                            ds.page_count)
        else:
            info = ds.tokens_info
            sizes = model.window_page_sizes(int(info["count"]), seq_len, np.dtype(info["dtype"]).itemsize,
                                            ds.page_size, ds.page_count)
        return sizes, ds.dataset_id


def file_expectation(path, order, seed, window_pages, drop_last, global_batch, seq_len=None, indices=None):
    """``expected`` for :func:`check_resume` on one file (or a subset of it): the model's ``(0, id)`` stream."""
    from reference import order as model

    ref = model.FileOrder(model_layout(path, seq_len)[0], seed, order, window_pages, drop_last, global_batch,
                          subset=indices)
    return lambda n: [(0, i) for i, _ in ref.global_stream(0, 0, n // global_batch)]
