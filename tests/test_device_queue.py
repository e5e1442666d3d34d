"""The CUDA copy queue's control flow on a CPU-only machine: torch.cuda's stream and event objects are replaced by
recording fakes and the "device" is the CPU, so every line of CudaCopyQueue and the loader's prefetch/reclaim
path runs in CI; the real GPU behaviour is checked by tools/gpu_check.py on a device machine."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import pageset.device.cuda as cuda_mod
from pageset import Int, Loader, RandomResizedCrop, RGBImage, ToTensor, write_dataset

EVENTS: list = []


class FakeEvent:
    def __init__(self):
        self.recorded = self.synchronized = self.waited = False
        EVENTS.append(self)

    def record(self, stream):
        self.recorded = True

    def synchronize(self):
        assert self.recorded
        self.synchronized = True


class FakeStream:
    def __init__(self, device=None):
        self.waits = []

    def wait_event(self, event):
        assert event.recorded, "the consumer waited on an event that was never recorded"
        event.waited = True


@dataclass(frozen=True)
class FakeToDevice(cuda_mod.ToDevice):
    def make_queue(self):
        q = cuda_mod.CudaCopyQueue.__new__(cuda_mod.CudaCopyQueue)
        q.device, q.non_blocking, q.stream = torch.device("cpu"), True, FakeStream()
        q.empty = lambda shape, dt: np.empty(shape, dt)  # pinned memory needs CUDA
        return q


@pytest.fixture()
def fake_cuda(monkeypatch):
    EVENTS.clear()
    consumer = FakeStream()
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: consumer)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return consumer


def test_copy_queue_prefetches_waits_and_reclaims(tmp_path, photo_arrays, fake_cuda):
    path = tmp_path / "d.pageset"
    write_dataset(path, [(a[:64, :64], k) for k, a in enumerate(photo_arrays)] * 3,
                  {"image": RGBImage(), "label": Int()}, num_workers=0, progress=False)
    pipes = {"image": [RandomResizedCrop(16), FakeToDevice("cpu")], "label": [ToTensor()]}
    kw = dict(batch_size=3, seed=1, num_threads=2, batches_ahead=2)
    with Loader(path, pipelines={"image": [RandomResizedCrop(16), ToTensor()], "label": [ToTensor()]}, **kw) as ref:
        expected = [(b["image"].clone(), b["label"].clone()) for b in ref]
    with Loader(path, pipelines=pipes, **kw) as loader:
        got = [(b["image"], b["label"]) for b in loader]  # held: device batches must not alias the ring
        assert loader._slots and all(s.prefetched is None or s.prefetched["event"].recorded for s in loader._slots)
    assert len(got) == len(expected)
    for (gi, gl), (ei, el) in zip(got, expected):
        assert torch.equal(gi, ei) and torch.equal(gl, el)
    assert EVENTS and all(e.recorded for e in EVENTS)
    delivered = [e for e in EVENTS if e.waited]
    assert len(delivered) == len(got)  # the consumer waited on every handed-out batch's copy
    assert any(e.synchronized for e in EVENTS)  # slots were reclaimed only after their copy finished


def test_copy_queue_with_token_windows(tmp_path, fake_cuda):
    from pageset import TokenWindows, write_tokens

    rng = np.random.default_rng(0)
    path = tmp_path / "t.pageset"
    write_tokens(path, [rng.integers(0, 100, size=int(rng.integers(1, 40))) for _ in range(80)], eos_id=100,
                 num_workers=0, progress=False)
    kw = dict(batch_size=4, seed=2, num_threads=2)
    with Loader(path, pipelines={"tokens": [TokenWindows(16, document_outputs=True), ToTensor()]}, **kw) as ref:
        expected = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in ref]
    with Loader(path, pipelines={"tokens": [TokenWindows(16, document_outputs=True), FakeToDevice("cpu")]},
                **kw) as loader:
        got = list(loader)
    assert len(got) == len(expected) > 0  # zip alone would accept a device epoch that stops early
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        for key in ("input", "target", "position_ids", "doc_ids", "labels", "cu_seqlens"):
            assert torch.equal(g[key], e[key]), key
        assert g["max_seqlen"] == e["max_seqlen"] and (g["_index"] == e["_index"]).all()


def test_copy_queue_with_a_mixture(tmp_path, photo_arrays, fake_cuda):
    from pageset import Mixture

    paths = []
    for k, side in enumerate((64, 48)):
        paths.append(tmp_path / f"m{k}.pageset")
        write_dataset(paths[-1], [(a[:side, :side], j + 100 * k) for j, a in enumerate(photo_arrays)] * 2,
                      {"image": RGBImage(), "label": Int()}, num_workers=0, progress=False)
    mix = Mixture(paths, [0.6, 0.4])
    kw = dict(batch_size=4, seed=1, num_threads=2, batches_ahead=2)
    with Loader(mix, pipelines={"image": [RandomResizedCrop(16), ToTensor()], "label": [ToTensor()]}, **kw) as ref:
        expected = [(b["image"].clone(), b["_source"].clone(), b["_index"].clone()) for b in ref]
    with Loader(mix, pipelines={"image": [RandomResizedCrop(16), FakeToDevice("cpu")], "label": [ToTensor()]},
                **kw) as loader:
        got = list(loader)
    assert len(got) == len(expected)
    for g, (image, source, index) in zip(got, expected):
        assert torch.equal(g["image"], image)
        assert (g["_source"] == source).all() and (g["_index"] == index).all()
        assert (g["label"].numpy() == g["_index"] % len(photo_arrays) + 100 * g["_source"]).all()
