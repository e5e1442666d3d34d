"""The process mode (``Loader(num_workers=1)``): the decode threads in one child process, batches in anonymous
shared memory. The same contracts as in process (tests/test_loader.py runs its error, exact-decode and
list(loader) tests in both modes): resume on another world size against the reference model, errors named as
in process, a dead child or parent never hangs anyone, and nothing outlives the loader (no child, no memfd; the
slots are anonymous memfds, never files in /dev/shm)."""

from __future__ import annotations

import gc
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from reference import order as model
from resources import Resources
from resume_contract import check_resume, file_expectation, model_layout

from pageset import (
    JSON,
    Bytes,
    Int,
    Loader,
    Mixture,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RGBImage,
    TokenWindows,
    ToTensor,
    write_dataset,
    write_tokens,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/fd and /dev/shm")

RRC = [RandomResizedCrop(24), RandomHorizontalFlip(), Normalize(), ToTensor()]
DEADLINE_S = 120  # a hang check, not a speed: a child's start (imports, kernels from the disk cache) on a busy VM


def _shared_maps(pid) -> list[str]:
    """The shared-memory files process ``pid`` maps: ``memfd:`` (anonymous) or under ``/dev/shm`` (named). Other
    processes on the machine may add files to /dev/shm meanwhile: what a process maps is attributable, a listing
    is not."""
    with open(f"/proc/{pid}/maps") as f:
        return sorted({line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6
                       and ("/dev/shm" in line or "memfd:" in line)})


def _only_memfds(pid) -> bool:
    """The slots are mapped, as anonymous files (``/memfd:pageset-slot``), and no named file of /dev/shm is (other
    memfds, e.g. libffi's, may be there too; in this test process also multiprocessing's semaphores, which are
    unlinked at once: ``/dev/shm/sem.* (deleted)``)."""
    maps = _shared_maps(pid)
    return (any(m.startswith("/memfd:pageset-slot") for m in maps)
            and not any("/dev/shm" in m and not m.endswith("(deleted)") for m in maps))


def _slot_maps(pid) -> list[str]:
    return [m for m in _shared_maps(pid) if "pageset-slot" in m]


def _memfds(res: Resources) -> list:
    return [(fd, target) for fd, target in res.new_fds() if "memfd:" in target or "pageset-slot" in target]


def _gone(pid: int) -> bool:
    """True when ``pid`` has exited (gone, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)  # polling another process's state: there is no event to wait on
    return _gone(pid)


@pytest.fixture(scope="module")
def images(tmp_path_factory, imagenet_like):
    path = tmp_path_factory.mktemp("proc") / "img.pageset"
    write_dataset(path, imagenet_like, {"image": RGBImage(max_resolution=80), "label": Int()}, num_workers=0,
                  page_size=1 << 14, progress=False)
    return path


@pytest.fixture(scope="module")
def token_mix(tmp_path_factory):
    d = tmp_path_factory.mktemp("proctok")
    out = []
    for k, n_docs in enumerate([300, 60]):
        rng = np.random.default_rng(40 + k)
        docs = [rng.integers(0, 1000, size=int(rng.integers(1, 90))) for _ in range(n_docs)]
        path = d / f"tok{k}.pageset"
        write_tokens(path, docs, eos_id=1000, num_workers=0, page_size=4096, progress=False)
        out.append((path, np.concatenate([np.append(x, 1000) for x in docs])))
    return out


def test_token_mixture_resumed_on_another_world_size_equals_the_reference_model(token_mix):
    """Two ranks in process mode for 5 steps, the state saved, then one rank in process mode to the middle of the
    next epoch: every batch's (_source, _index) is the reference model's (tests/reference/order.py), every
    window's tokens are the written stream's, the saved state is the model's."""
    L, G, seed, m, weights = 32, 12, 3, 3, [0.25, 0.75]
    paths = [p for p, _ in token_mix]
    layouts = [model_layout(p, L) for p in paths]
    ref = model.MixtureModel(weights, [s for s, _ in layouts], seed, "quasi_random", m, True, G)
    mix = Mixture(paths, weights)

    def make(rank, world):
        return Loader(mix, batch_size=G // world, rank=rank, world_size=world, num_threads=2, num_workers=1,
                      order="quasi_random", seed=seed, window_pages=m, pipelines={"tokens": [TokenWindows(L)]})

    def check(batch, epoch, step, rank, world):
        src, ids = ref.batch(epoch, step, rank, world)
        assert batch["_source"].tolist() == src and batch["_index"].tolist() == ids, (epoch, step, rank)
        for j, (s, w) in enumerate(zip(src, ids)):
            stream = token_mix[s][1]
            np.testing.assert_array_equal(batch["input"][j].numpy(), stream[w * L : w * L + L])
            np.testing.assert_array_equal(batch["target"][j].numpy(), stream[w * L + 1 : w * L + L + 1])

    cut = 5
    ranks = [make(r, 2) for r in range(2)]
    try:
        its = [iter(ld) for ld in ranks]
        for step in range(cut):
            for r, it in enumerate(its):
                check(next(it), 0, step, r, 2)
        states = [ld.state_dict() for ld in ranks]
    finally:
        for ld in ranks:
            ld.close()
    assert states[0] == states[1] == ref.state_dict([i for _, i in layouts], 0, cut * G, seq_len=L)
    with make(0, 1) as ld:
        ld.load_state_dict(states[0])
        assert ld.steps_remaining == ref.steps - cut
        for step, b in enumerate(ld, start=cut):
            check(b, 0, step, 0, 1)
        assert ld.epoch == 1
        it = iter(ld)
        for step in range(3):  # across the epoch boundary: the stream continues in epoch 1
            check(next(it), 1, step, 0, 1)


def test_records_bytes_and_json_and_what_close_leaves(tmp_path):
    """Int, Bytes and JSON fields (a JSON field's values travel back with the reply) equal what was written;
    stats() counts the child's threads and page cache; close() leaves no child process, thread, memfd or
    descriptor and nothing in /dev/shm."""
    n = 57
    records = [(i, bytes([i % 251]) * (i % 40 + 1), {"id": i, "pad": "x" * (i % 9)}) for i in range(n)]
    path = tmp_path / "rec.pageset"
    write_dataset(path, records, {"label": Int(), "payload": Bytes(), "meta": JSON()}, num_workers=0,
                  page_size=4096, progress=False)
    res = Resources()
    with Loader(path, batch_size=8, seed=2, num_threads=2, num_workers=1, page_cache="process",
                drop_last=False) as ld:
        pid = ld._pool.pid
        seen = []
        for b in ld:
            data, lengths = b["payload"]
            for j, i in enumerate(b["_index"].tolist()):
                seen.append((i, bool(b["_is_padding"][j])))
                assert int(b["label"][j]) == i and b["meta"][j] == {"id": i, "pad": "x" * (i % 9)}
                assert int(lengths[j]) == i % 40 + 1
                assert data[j, : i % 40 + 1].tolist() == [i % 251] * (i % 40 + 1) and not data[j, i % 40 + 1 :].any()
        assert sorted(i for i, pad in seen if not pad) == list(range(n)) and len(seen) == 64
        st = ld.stats()
        assert st["num_threads"] == 2 and st["rows"] == 64 and st["slices"] >= 8 and st["fill_s"] > 0
        assert all(t["cpu_s"] is not None for t in st["threads"][:2]) and st["threads"][2]["rows"] == 0
        assert st["page_cache"]["misses"] > 0 and st["bytes_read"] > 0
        assert ld.bottleneck()["verdict"] in ("loader-bound", "step-bound")
        assert len(res.new_py_threads()) == 1  # the receiver of the child's replies, nothing else here
        # the slots: anonymous files in both processes, nothing named in /dev/shm
        assert _only_memfds("self") and _only_memfds(pid), (_shared_maps("self"), _shared_maps(pid))
    del b, data, lengths
    gc.collect()
    with pytest.raises(ChildProcessError):  # reaped by close()
        os.waitpid(pid, os.WNOHANG)
    assert _gone(pid)
    assert res.new_fds() == [] and res.new_py_threads() == [] and _slot_maps("self") == []


def test_a_killed_child_fails_next_with_its_signal(images):
    """SIGKILL of the child mid-epoch: the waiting next() raises RuntimeError naming the signal within a bounded
    time (never hangs), so does every later iter(); close() then leaves nothing behind."""
    res = Resources()
    ld = Loader(images, batch_size=4, pipelines={"image": RRC}, num_threads=1, num_workers=1, batches_ahead=2)
    it = iter(ld)
    next(it)
    assert _only_memfds(ld._pool.pid) and not any("/dev/shm" in m for m in _shared_maps(ld._pool.pid))
    os.kill(ld._pool.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"child process \(pid \d+, num_workers=1\) was killed by signal SIGKILL"):
        for _ in range(len(ld)):  # the batches prepared before the kill may still come out first
            next(it)
    assert time.monotonic() - t0 < DEADLINE_S
    with pytest.raises(RuntimeError, match="SIGKILL"):
        next(iter(ld))
    ld.close()
    del it, ld
    gc.collect()
    assert _memfds(res) == [] and res.new_py_threads() == [] and _slot_maps("self") == []


def test_early_breaks_resume_where_they_left_and_del_reaps_the_child(images):
    """30 ``for ... break`` loops (each cancels the batches the child is preparing and waits for them), then the
    rest of the epoch: the ids are the reference model's stream; ``del loader`` (no close()) reaps the child."""
    res = Resources()
    expected = file_expectation(images, "random", 5, 2, True, 4)
    loader = Loader(images, batch_size=4, pipelines={"image": RRC}, seed=5, window_pages=2, num_threads=2,
                    num_workers=1)
    pid, ids = loader._pool.pid, []
    for _ in range(30):
        for b in loader:
            ids += [(0, i) for i in b["_index"].tolist()]
            break
    for b in loader:
        ids += [(0, i) for i in b["_index"].tolist()]
    assert ids == expected(len(ids)) and len(ids) == 3 * 48
    del loader, b
    gc.collect()
    assert _wait_gone(pid, 30) and res.new_py_threads() == [] and _memfds(res) == []


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the shared slots are copied into pinned buffers, then sent)")])])
def test_to_device_in_process_mode_equals_pillow(tmp_path, photo_arrays, device):
    """ToDevice in process mode (the child's pipelines have none; this process copies): the whole-image crop's
    output on the device equals Pillow's decode of the stored bytes, batch after batch (slots reused)."""
    import io

    from PIL import Image

    from pageset import ToDevice, open_dataset

    imgs = [np.ascontiguousarray(a[:64, :96]) for a in photo_arrays]
    path = tmp_path / "dev.pageset"
    write_dataset(path, [(x,) for x in imgs], {"image": RGBImage(jpeg_quality=92)}, num_workers=0, progress=False)
    whole = RandomResizedCrop((64, 96), scale=(1.0, 1.0), ratio=(96 / 64, 96 / 64))
    with open_dataset(path) as ds, Loader(path, batch_size=2, order="sequential", num_threads=1, num_workers=1,
                                           pipelines={"image": [whole, ToDevice(device)]}) as ld:
        for _ in range(2):
            for b in ld:
                assert b["image"].device.type == device
                for j, i in enumerate(b["_index"].tolist()):
                    ref = np.asarray(Image.open(io.BytesIO(ds[i]["image"].data)).convert("RGB"))
                    np.testing.assert_array_equal(b["image"][j].cpu().numpy(), ref)


PARENT_SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time
    from pageset import Loader
    made = {}
    def make():  # not the main thread: no PR_SET_PDEATHSIG, the child must notice on its own
        made["loader"] = Loader(sys.argv[1], batch_size=4, pipelines={"image": None}, num_threads=1, num_workers=1)
    t = threading.Thread(target=make)
    t.start()
    t.join()
    ld = made["loader"]
    next(iter(ld))
    sibling = os.fork()  # holds a copy of the loader's socket: the child sees no EOF when this process dies
    if sibling == 0:
        time.sleep(60)
        os._exit(0)
    print(ld._pool.pid, sibling, flush=True)
    sys.stdin.read()  # until killed
    """
)


def test_the_child_exits_when_its_parent_is_killed(images, tmp_path):
    """The parent SIGKILLed while a forked sibling keeps the socket open (no EOF) and PDEATHSIG is off (the
    Loader was made on another thread): the child still exits, within a bounded time."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    parent = subprocess.Popen([sys.executable, str(script), str(images)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=env)
    sibling = None
    try:
        ready, _, _ = select.select([parent.stdout], [], [], DEADLINE_S)
        assert ready, "the parent did not start its loader"
        child, sibling = (int(x) for x in parent.stdout.readline().split())
        assert not _gone(child) and _only_memfds(child) and not any("/dev/shm" in m for m in _shared_maps(child))
        parent.kill()
        parent.wait(DEADLINE_S)
        assert _wait_gone(child, 30), "the loader's child outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(DEADLINE_S)
        if sibling is not None:
            try:
                os.kill(sibling, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_an_op_that_cannot_be_pickled_is_named_at_construction(images):
    class LocalCrop(RandomResizedCrop):  # a local class: another interpreter cannot import it
        pass

    with pytest.raises(TypeError, match=r"pipelines\['image'\]: .*LocalCrop\(.*cannot be pickled.*num_workers=0"):
        Loader(images, batch_size=4, pipelines={"image": [LocalCrop(24)]}, num_workers=1)
    with Loader(images, batch_size=4, pipelines={"image": [LocalCrop(24)]}, num_workers=0) as ld:
        assert next(iter(ld))["image"].shape == (4, 24, 24, 3)


def _refuse_in_child():
    raise LookupError("this op cannot be built in the child")


class BuiltOnlyHere(RandomResizedCrop):
    """Pickles fine here; unpickling it (in the child) raises."""

    def __reduce__(self):
        return _refuse_in_child, ()


def test_a_child_that_cannot_build_its_loader_fails_next_with_its_traceback(images):
    with Loader(images, batch_size=4, pipelines={"image": [BuiltOnlyHere(24)]}, num_workers=1, num_threads=1) as ld:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"child process \(pid \d+\) could not start: LookupError: this op "
                                               r"cannot be built in the child") as ei:
            next(iter(ld))
        assert time.monotonic() - t0 < DEADLINE_S and "_refuse_in_child" in str(ei.value)  # the child's traceback


def test_process_mode_refuses_urls(images):
    with pytest.raises(ValueError, match="num_workers=1 reads local files only"):
        Loader("http://127.0.0.1:9/x.pageset", batch_size=4, num_workers=1)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["quasi_random"])  # (each loader starts a child: ~3 s on a busy 2-core VM)
def test_image_resume_contract_in_process_mode(images, order):
    """tests/resume_contract.py on images, every loader in process mode: the control is the reference model's."""
    def make(rank, world, batch, threads):
        return Loader(images, batch_size=batch, rank=rank, world_size=world, num_threads=threads, order=order,
                      seed=17, window_pages=2, drop_last=False, num_workers=1, pipelines={"image": RRC})

    check_resume(make, global_batch=8, world_sizes=[1, 2], cuts=[0, 7, 13],
                 expected=file_expectation(images, order, 17, 2, False, 8))



@pytest.mark.parametrize("damage", ["truncated", "replaced", "touched"])
def test_a_file_error_reaches_the_trainer_as_the_same_exception(tmp_path, damage):
    """pageset's format errors cross from the child with their class and attributes (they pickle as their
    constructor's arguments), so ``except TruncatedFileError`` works in both modes."""
    from pageset import Bytes, Int, write_dataset
    from pageset.format.errors import FileChangedError, MemberMismatchError, TruncatedFileError
    from pageset.read.set_manifest import many_file_members

    folder = tmp_path / "set"
    write_dataset(folder, [{"label": i, "blob": bytes([i % 251]) * (i % 90 + 1)} for i in range(60)],
                  {"label": Int(), "blob": Bytes()}, records_per_member=20, page_size=4096, num_workers=0,
                  progress=False, lineage=False)
    paths = many_file_members(folder).paths
    want = {"truncated": TruncatedFileError, "replaced": MemberMismatchError, "touched": FileChangedError}[damage]
    got = []
    for workers in (0, 1):
        # truncated / replaced: member 1 before its first read; touched: member 0, read, then modified in place
        with Loader(folder, batch_size=10, order="sequential", num_threads=1, array_type="numpy",
                    num_workers=workers) as ld:
            first = next(iter(ld))
            assert first["label"].tolist() == list(range(10))
            victim = paths[1] if damage != "touched" else paths[0]
            saved = open(victim, "rb").read()
            if damage == "truncated":
                os.truncate(victim, len(saved) // 2)
            elif damage == "replaced":
                tmp = victim + ".new"
                shutil.copyfile(paths[2], tmp)
                os.replace(tmp, victim)
            else:
                st = os.stat(victim)
                os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
            with pytest.raises(want) as info:
                for b in ld:
                    pass
            got.append((type(info.value), info.value.path, info.value.section))
        with open(victim, "wb") as f:  # restored for the other mode
            f.write(saved)
    assert got[0] == got[1] and got[0][1].endswith(os.path.basename(victim))


def test_every_pageset_exception_pickles_to_the_same_class_message_and_attributes():
    import pickle

    from pageset.format import errors
    from pageset.load.stages import DecodeError, PipelineError
    from pageset.ops.jpeg import JpegDecodeError
    from pageset.order.state import StateError, StateMismatchError
    from pageset.write.sources import SampleError

    made = [cls("a/b.pageset", "page 3", 8192, "page CRC-32 mismatch") for cls in vars(errors).values()
            if isinstance(cls, type) and issubclass(cls, errors.FormatError)]
    made += [StateError("seed", "must be an int"), StateMismatchError("order", "random", "sequential", "use ..."),
             SampleError("photos/", 7, "image", "not a JPEG", "skip it"), JpegDecodeError("bad JPEG", 3),
             DecodeError("a: sample 1, field 'x'", 1), PipelineError("field 'x': no")]
    assert len(made) >= 15
    for exc in made:
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc) and back.__dict__ == exc.__dict__, exc


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_close_from_another_thread_ends_a_waiting_next(images, workers):
    """A watchdog thread closing the Loader while next() waits (process mode: on a SIGSTOPped child; in process:
    on a page read that blocks): close() returns instead of raising "generator already executing", and the
    waiting next() raises RuntimeError (closed, or the child killed) within a bounded time."""
    import threading

    ld = Loader(images, batch_size=4, pipelines={"image": RRC}, num_threads=1, num_workers=workers,
                batches_ahead=1)
    it = iter(ld)
    next(it)
    if workers:
        os.kill(ld._pool.pid, signal.SIGSTOP)
    else:  # the decode thread blocks in its next read until released
        gate = threading.Event()
        src = ld._sources[0]
        real = src.pages.gather

        def blocked(*a, **k):
            gate.wait(60)
            return real(*a, **k)

        src.pages.gather = blocked
    errors = []

    def consume():
        try:
            for _ in range(len(ld)):
                next(it)
        except BaseException as exc:  # noqa: BLE001 - what the consumer sees
            errors.append(exc)

    t = threading.Thread(target=consume)
    t.start()
    t.join(1.0)  # the consumer waits on the batch
    assert t.is_alive()
    ld.close()  # from this thread: must not raise "generator already executing"
    if not workers:
        gate.set()
    t.join(DEADLINE_S)
    assert not t.is_alive() and len(errors) == 1
    assert isinstance(errors[0], RuntimeError) and re.search(r"closed|exited|killed", str(errors[0])), errors[0]


# ---- process-mode batches against the reference, byte for byte (issue 28, item 6: tests that only compared
# process mode with itself or checked ids let a reused shared slot through) -------------------------------------

PIXELS = [RandomResizedCrop(64), RandomHorizontalFlip()]  # uint8: every crop of these <= 80 px images at DCT 1/1


def _reference_images(path):
    """(records, page sizes) of an image file by the reference reader (tests/reference/format.py)."""
    from reference import format as ref_format

    ref = ref_format.read_file(path)
    h = ref.header
    return ref.records, model.record_page_sizes([r["_offset"] for r in ref.records], h["data_offset"],
                                                h["page_size"], h["page_count"])


def _pillow_crop(rec: dict, key: int) -> np.ndarray:
    """The sample's RandomResizedCrop(64) + flip by Pillow (see tests/test_image_set_mixture.py): the stored JPEG
    decoded, cropped to the box of ``key``, bilinear resize, flipped when ``uniform(key, 40) < 0.5``."""
    import io

    from PIL import Image

    from pageset.ops.crop import FLIP_COUNTER, random_resized_crop_box_py
    from pageset.ops.jpeg import choose_scale
    from pageset.order.keys import uniform_py

    img = rec["image"]
    x, y, w, h = random_resized_crop_box_py(img["height"], img["width"], key, 0.08, 1.0, 3 / 4, 4 / 3)
    assert choose_scale(img["width"], img["height"], w, h, 64, 64) == (1, 1)
    out = Image.open(io.BytesIO(img["data"])).convert("RGB").crop((x, y, x + w, y + h)).resize((64, 64),
                                                                                               Image.BILINEAR)
    if uniform_py(key, FLIP_COUNTER) < 0.5:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(out)


def _check_images(batch, records, plan, seed, epoch, step, B):
    ids, padding = plan.batch(epoch, step, 0, 1)
    assert batch["_index"].tolist() == ids and batch["_is_padding"].tolist() == padding, (epoch, step)
    for j, i in enumerate(ids):
        np.testing.assert_array_equal(np.asarray(batch["image"][j]),
                                      _pillow_crop(records[i], model.aug_key(seed, epoch, step * B + j)),
                                      err_msg=f"epoch {epoch} step {step} row {j} (record {i})")
        assert int(batch["label"][j]) == records[i]["label"]


@pytest.mark.parametrize("hold", ["every_batch", "the_last_batch"])
def test_batches_equal_pillow_and_stay_equal_while_held(images, hold):
    """Two epochs in process mode, batches_ahead=3: each batch's pixels equal Pillow's crop + flip of its own
    record and key (reference order and keys), checked when handed out and again at the end for every batch
    still held (``every_batch``: all of them, a list; ``the_last_batch``: the batch of the previous step, held
    while the child fills the next ones, as a training loop holds it): a slot refilled under a batch the user
    holds shows as a changed batch."""
    records, sizes = _reference_images(images)
    seed, B = 9, 4
    plan = model.FileOrder(sizes, seed, "random", 1, True, B)
    held = []
    with Loader(images, batch_size=B, order="random", seed=seed, num_threads=2, num_workers=1, batches_ahead=3,
                pipelines={"image": PIXELS}, array_type="numpy") as ld:
        for epoch in range(2):
            previous = None
            for step, b in enumerate(ld):
                _check_images(b, records, plan, seed, epoch, step, B)
                if previous is not None:  # the batch before, after the child filled this one and more ahead
                    _check_images(previous[0], records, plan, seed, epoch, previous[1], B)
                previous = (b, step)
                if hold == "every_batch":
                    held.append((b, epoch, step))
    for b, epoch, step in held:
        _check_images(b, records, plan, seed, epoch, step, B)
    assert len(held) == (2 * plan.steps if hold == "every_batch" else 0)


def test_early_breaks_give_the_reference_pixels(images):
    """``for ... break`` loops cancel what the child is filling and wait for it: the batches after each break
    (slots the child may still have been writing to) hold the reference pixels of their own record and key,
    the stream goes on without a gap, and the held first batch of each loop is unchanged at the end."""
    records, sizes = _reference_images(images)
    seed, B = 5, 4
    plan = model.FileOrder(sizes, seed, "quasi_random", 2, True, B)
    firsts = []
    with Loader(images, batch_size=B, order="quasi_random", seed=seed, window_pages=2, num_threads=2,
                num_workers=1, batches_ahead=3, pipelines={"image": PIXELS}, array_type="numpy") as ld:
        step = 0
        for _ in range(8):  # 8 loops of one batch each: each leaves up to 3 fills in flight
            for b in ld:
                _check_images(b, records, plan, seed, 0, step, B)
                firsts.append((b, step))
                step += 1
                break
        for b in ld:  # the rest of the epoch
            _check_images(b, records, plan, seed, 0, step, B)
            step += 1
        assert step == plan.steps and ld.epoch == 1
    for b, s in firsts:
        _check_images(b, records, plan, seed, 0, s, B)


def test_a_many_file_set_in_process_mode_equals_the_reference_records(tmp_path):
    """A record set (Int, Bytes, JSON; 6 members) read in the child, all batches of two epochs held: each row's
    values are the reference manifest reader's, in the reference order over the members' pages."""
    from reference import manifest as ref_manifest

    folder = tmp_path / "set"
    rows = [{"label": i, "blob": bytes([i % 251, 7]) * (i % 50 + 1), "meta": {"i": i, "s": "x" * (i % 13)}}
            for i in range(90)]
    write_dataset(folder, rows, {"label": Int(), "blob": Bytes(), "meta": JSON()}, records_per_member=16,
                  page_size=4096, num_workers=0, progress=False, lineage=False)
    ref = ref_manifest.read_set(folder)
    plan = model.FileOrder([s for p in ref.records_per_page for s in p], 4, "random", 1, False, 8)
    with Loader(folder, batch_size=8, order="random", seed=4, drop_last=False, num_threads=2, num_workers=1,
                batches_ahead=2, array_type="numpy") as ld:
        held = [(epoch, step, b) for epoch in range(2) for step, b in enumerate(ld)]
        assert ld.dataset_id == ref.dataset_id
    assert len(held) == 2 * plan.steps
    for epoch, step, b in held:
        ids, padding = plan.batch(epoch, step, 0, 1)
        assert b["_index"].tolist() == ids and b["_is_padding"].tolist() == padding
        data, lengths = b["blob"]
        for j, i in enumerate(ids):
            rec = ref.records[i]
            assert int(b["label"][j]) == rec["label"] and b["meta"][j] == rec["meta"]
            assert bytes(data[j, : lengths[j]]) == rec["blob"] and not data[j, lengths[j]:].any()


@pytest.mark.parametrize("page_cache", ["os", "process"])
def test_a_token_set_in_process_mode_gives_the_reference_windows(tmp_path, page_cache):
    """A token set in the child (flat with "os", member by member with "process"), document outputs on, every
    batch of two epochs held: input, target and document outputs against the reference readers
    (tests/test_token_sets.py's expectation)."""
    from test_token_sets import _docs, check_rows, ref_set

    folder = tmp_path / "tokens"
    write_tokens(folder, _docs("uint16", 120, 21), eos_id=60001, dtype="uint16", docs_per_member=30,
                 num_workers=0, page_size=4096, progress=False, lineage=False)
    ref = ref_set(folder, 16)
    plan = model.FileOrder(ref.page_sizes, 6, "quasi_random", 2, True, 6)
    with Loader(folder, batch_size=6, order="quasi_random", seed=6, window_pages=2, page_cache=page_cache,
                num_threads=2, num_workers=1, batches_ahead=2, array_type="numpy",
                pipelines={"tokens": [TokenWindows(16, document_outputs=True)]}) as ld:
        held = [(epoch, step, b) for epoch in range(2) for step, b in enumerate(ld)]
    assert len(held) == 2 * plan.steps
    for epoch, step, b in held:
        ids, _ = plan.batch(epoch, step, 0, 1)
        assert b["_index"].tolist() == ids
        check_rows(b, [ref], [0] * 6, ids, docs=True)
