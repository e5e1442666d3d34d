"""Image loading throughput: pageset vs a PyTorch DataLoader + Pillow, same files, same transforms, same cores.

    .venv/bin/python -m benchmarks.images [--images 1000] [--batch-size 64] [--json out/bench_images.json]
    .venv/bin/python -m benchmarks.images --breakdown-only [--data x.pageset] [--runs 3]   # stages + targets only

Data: an ImageNet-like set derived from the real photos on this machine (max side 512, JPEG q90).
Breakdown (always; alone with --breakdown-only): CPU ms per image of each stage of the fused uint8 path
(RandomResizedCrop(224) + flip) on one thread -- entropy decode, IDCT + upsampling + colour conversion of the
crop's region, resize weights, horizontal pass, vertical pass, store, Loader overhead -- next to a plain full
decode of the same bytes, libjpeg-turbo's fast-IDCT/fast-upsampling flags as a measured (unused) lever, FFCV's
uint8 pipeline on one worker when benchmarks/.envs/ffcv exists, and the Loader at 1 and 2 threads; the same
for ``resize_mode="fast"`` (its resize stages, fused kernel, difference from the exact outputs, Loader at 1
thread); the same images written with ``RGBImage(jpeg_restart=1)`` and ``(jpeg_restart=4)`` (restart intervals:
the Loader decodes only the intervals covering each crop), their Loader rows at 1 thread in both modes, in the
same interleaved rounds, and their bytes per image; the JSON gets "breakdown" and "targets" (fused vs full decode
per thread >= 1.0x exact and >= 1.3x fast, with and without restart intervals, vs FFCV >= 2.5x, 2/1 threads
>= 1.8x).
Pipeline: RandomResizedCrop(224) + RandomHorizontalFlip + Normalize -> float32 NCHW tensors, for both.
Rows: pageset at 1 and all threads (random and quasi_random order, os and process page cache); the baseline
DataLoader with 0 (in-process), 1 and all workers; decode-only rates of the same bytes (Pillow, and
libjpeg-turbo through pageset's kernel); time to first batch in a fresh process with a cold and a warm Numba
kernel cache. Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import io
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np
import torch

from benchmarks.peers.measure import pillow_transform
from pageset import (
    Int,
    Loader,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RGBImage,
    ToTensor,
    ToTorchImage,
    open_dataset,
    write_dataset,
)
from pageset.ops import image_batch, jpeg_kernels, jpeg_scale, resize, resize_fast
from pageset.sample_data import debian_photos, make_imagenet_like, wheel_photos


class PillowFolder(torch.utils.data.Dataset):
    """torchvision's ImageFolder + RandomResizedCrop + RandomHorizontalFlip + ToTensor + Normalize, in Pillow
    (torchvision cannot be installed beside the CPU torch here): ``peers.measure.pillow_transform``, the same
    transform the streaming peers run, with torchvision's box algorithm."""

    def __init__(self, files, size=224):
        self.files, self.size = files, size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from PIL import Image

        path, label = self.files[i]
        with Image.open(path) as img:
            return pillow_transform(img, self.size), label


def _time_iter(make, n_images, warmup=1):
    it = make()
    t0 = time.perf_counter()
    first = None
    count = 0
    for b in it:
        if first is None:
            first = time.perf_counter() - t0
        count += len(b[1] if isinstance(b, (list, tuple)) else b["_index"])
    dt = time.perf_counter() - t0
    return {"images_per_s": count / dt, "first_batch_s": first, "images": count}


def bench_pageset(path, n, bs, threads, order, cache):
    pipe = {"image": [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(), ToTorchImage(), ToTensor()],
            "label": None}
    with Loader(path, batch_size=bs, pipelines=pipe, order=order, num_threads=threads, page_cache=cache,
                seed=0) as loader:
        next(iter(loader))  # compile / warm; measure a full later epoch
        loader.set_epoch(1)
        return _time_iter(lambda: loader, n)


def bench_baseline(files, bs, workers):
    ds = PillowFolder(files)
    dl = torch.utils.data.DataLoader(ds, batch_size=bs, shuffle=True, num_workers=workers, drop_last=True,
                                     persistent_workers=False)
    return _time_iter(lambda: dl, len(files))


def decode_only(path):
    from PIL import Image

    from pageset.ops.jpeg import JpegDecoder

    with open_dataset(path) as ds:
        blobs = [ds[i]["image"].data for i in range(len(ds))]
    t0 = time.perf_counter()
    for b in blobs:
        with Image.open(io.BytesIO(b)) as img:
            img.convert("RGB")
    pil = len(blobs) / (time.perf_counter() - t0)
    with JpegDecoder() as dec:
        dec.decode(blobs[0])
        t0 = time.perf_counter()
        for b in blobs:
            dec.decode(b)
        turbo = len(blobs) / (time.perf_counter() - t0)
    return pil, turbo



# ---------------------------------------------------------------------------------------------------------
# Per-stage cost breakdown of the fused path (issue 13): where the time of one image goes, per thread
# ---------------------------------------------------------------------------------------------------------

MODE_FULL, MODE_ENTROPY, MODE_REGION, MODE_RESIZE, MODE_RESIZE_FAST = 0, 1, 2, 3, 4
UINT8_PIPE = "RandomResizedCrop(224) + RandomHorizontalFlip, uint8 NHWC"


@numba.njit(nogil=True)
def _stage_loop(handle, buf, offs, lens, heights, widths, boxes, flips, table, out, decoded, jpeg_scratch,
                resize_scratch, mode, stages):
    """The fused per-image path of ``image_batch.image_slice`` cut after a stage (one nogil call, all images).

    mode MODE_FULL: a plain full decode (1/1, whole image) into a reused buffer; MODE_ENTROPY: decode only the
    crop region's last row (libjpeg entropy-decodes every row above it and runs the IDCT of one iMCU row);
    MODE_REGION: decode the crop's region at its DCT scale; MODE_RESIZE: that, then ``resize._resize`` with the
    ``stages`` bits (0: filter weights only); MODE_RESIZE_FAST: the same with ``resize_fast._resize_fast`` (the
    ``resize_mode="fast"`` kernel). Returns the number of failed decodes (0 expected)."""
    failed = 0
    for j in range(offs.shape[0]):
        h = heights[j]
        w = widths[j]
        data = buf[offs[j]:offs[j] + lens[j]]
        if mode == MODE_FULL:
            img = decoded[:h * w * 3].reshape((h, w, 3))
            failed += jpeg_kernels.jpeg_decode(handle, data, 1, 1, 0, 0, w, h, img, jpeg_scratch) < 0
            continue
        x, y, cw, ch, num, den = boxes[j, 0], boxes[j, 1], boxes[j, 2], boxes[j, 3], boxes[j, 4], boxes[j, 5]
        sx, sy, sw, sh = jpeg_scale.scale_region(w, h, x, y, cw, ch, num, den)
        if mode == MODE_ENTROPY:
            st = jpeg_kernels.jpeg_decode_window(handle, data, num, den, sx, sy + sh - 1, sw, 1, decoded,
                                                 jpeg_scratch)[0]
            failed += st < 0
            continue
        st, h0, w0, row, col = jpeg_kernels.jpeg_decode_window(handle, data, num, den, sx, sy, sw, sh, decoded,
                                                                jpeg_scratch)
        failed += st < 0
        if mode == MODE_REGION:
            continue
        region = jpeg_kernels.window_view(decoded, h0, w0, row, col, sh, sw)
        bx0, by0, bx1, by1 = jpeg_scale.box_in_region(x, y, cw, ch, num, den, sx, sy, sw, sh)
        if mode == MODE_RESIZE_FAST:
            resize_fast._resize_fast(region, bx0, by0, bx1, by1, flips[j], table, out[j], True, resize_scratch,
                                     stages)
        else:
            resize._resize(region, bx0, by0, bx1, by1, flips[j], table, out[j], True, resize_scratch, stages)
    return failed


def _median_range(values):
    v = sorted(values)
    return {"median": statistics.median(v), "min": v[0], "max": v[-1], "runs": len(v)}


def stage_breakdown(path, size=224, reps=5, epoch=1, seed=0):
    """CPU ms per image of each stage of the fused path (uint8, RRC + flip), on one thread, plus references.

    Crops, scales and flips come from ``plan_slice`` with keys drawn as the Loader draws them (``sample_keys``
    of ``seed``, ``epoch``; positions in file order). Each
    variant runs over every image in one nogil call, timed with ``time.thread_time``; variants are interleaved
    ``reps`` times and a stage's cost is the difference of the medians of two variants that differ by it.
    """
    from pageset.ops.image import pixel_table
    from pageset.ops.jpeg import JpegDecoder
    from pageset.order.keys import sample_keys

    with open_dataset(path) as ds:
        ix = ds.index
        blobs = [np.frombuffer(ds[i]["image"].data, dtype=np.uint8) for i in range(len(ds))]
    n = len(blobs)
    heights = ix["image.height"].astype(np.int64)
    widths = ix["image.width"].astype(np.int64)
    encodings = ix["image.encoding"].astype(np.uint8)
    lens = np.array([b.size for b in blobs], dtype=np.int64)
    offs = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    buf = np.concatenate(blobs)
    keys = sample_keys(seed, epoch, np.arange(n, dtype=np.int64))
    boxes = np.zeros((n, 6), dtype=np.int64)
    flips = np.zeros(n, dtype=np.bool_)
    params = np.array([0.08, 1.0, 3 / 4, 4 / 3, 0.0])
    need_dec, need_jpeg, need_rs = image_batch.plan_slice(heights, widths, encodings, keys,
                                                          image_batch.CROP_RANDOM_RESIZED, params, 0.5, size,
                                                          size, boxes, flips)
    scales = {}
    for num, den in boxes[:, 4:6].tolist():
        scales[f"{num}/{den}"] = scales.get(f"{num}/{den}", 0) + 1
    table = pixel_table()
    out = np.empty((n, size, size, 3), dtype=np.uint8)
    decoded = np.empty(max(need_dec, int((heights * widths).max()) * 3), dtype=np.uint8)
    jpeg_scratch = np.empty(max(need_jpeg, int((heights * widths).max()) * 4), dtype=np.uint8)
    resize_scratch = np.empty(need_rs, dtype=np.int32)
    status = np.zeros(n, dtype=np.int64)
    rows = np.arange(n, dtype=np.int64)
    dec = JpegDecoder()
    h = dec.handle
    variants = {
        "full_decode": (MODE_FULL, 0),
        "entropy": (MODE_ENTROPY, 0),
        "region": (MODE_REGION, 0),
        "weights": (MODE_RESIZE, 0),
        "horizontal": (MODE_RESIZE, resize.STAGE_HORIZONTAL),
        "vertical": (MODE_RESIZE, resize.STAGE_HORIZONTAL | resize.STAGE_VERTICAL),
        "store": (MODE_RESIZE, resize.ALL_STAGES),
        # resize_mode="fast" (resize_fast: vertical pass first, then the horizontal one, then the store)
        "fast_weights": (MODE_RESIZE_FAST, 0),
        "fast_vertical": (MODE_RESIZE_FAST, resize.STAGE_VERTICAL),
        "fast_horizontal": (MODE_RESIZE_FAST, resize.STAGE_VERTICAL | resize.STAGE_HORIZONTAL),
        "fast_store": (MODE_RESIZE_FAST, resize.ALL_STAGES),
    }

    def run(name):
        if name in ("image_slice", "image_slice_fast"):
            t = time.thread_time()
            bad = image_batch.image_slice(h, buf, offs, lens, heights, widths, encodings, boxes, flips, table, out,
                                          rows, True, decoded, jpeg_scratch, resize_scratch, status,
                                          name == "image_slice_fast")
            dt = time.thread_time() - t
            assert bad < 0, f"sample {bad} failed to decode"
            return dt
        if name == "python_decode":  # libjpeg-turbo through the Python decoder: a new array per image
            t = time.thread_time()
            for b in blobs:
                dec.decode(b)
            return time.thread_time() - t
        mode, stages = variants[name]
        t = time.thread_time()
        failed = _stage_loop(h, buf, offs, lens, heights, widths, boxes, flips, table, out, decoded, jpeg_scratch,
                             resize_scratch, mode, stages)
        dt = time.thread_time() - t
        assert failed == 0, f"{failed} images failed to decode"
        return dt

    names = [*variants, "image_slice", "image_slice_fast", "python_decode"]
    for name in names:  # compile and warm
        run(name)
    run("image_slice")
    exact_px = out.copy()
    run("image_slice_fast")
    fast_diff = _difference(out, exact_px)
    times = {name: [] for name in names}
    for _ in range(reps):
        for name in names:
            times[name].append(run(name) / n * 1e3)
    fast = _fast_flags_lever(dec, run, out, reps)
    dec.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    stages = {
        "entropy decode (rows above and in the crop)": med["entropy"],
        "IDCT + upsampling + colour conversion of the region": med["region"] - med["entropy"],
        "resize weights": med["weights"] - med["region"],
        "horizontal pass (with the flip)": med["horizontal"] - med["weights"],
        "vertical pass": med["vertical"] - med["horizontal"],
        "store (round, value table, write)": med["store"] - med["vertical"],
    }
    fast_stages = {
        "resize weights": med["fast_weights"] - med["region"],
        "vertical pass (packed rows)": med["fast_vertical"] - med["fast_weights"],
        "horizontal pass (3 channels per int64, with the flip)": med["fast_horizontal"] - med["fast_vertical"],
        "store (value table, write)": med["fast_store"] - med["fast_horizontal"],
    }
    return {"images": n, "mean_width": float(widths.mean()), "mean_height": float(heights.mean()),
            "scales": scales, "stages_ms": stages, "variants_ms": {k: _median_range(v) for k, v in times.items()},
            "kernel_ms": med["image_slice"], "full_decode_kernel_ms": med["full_decode"],
            "full_decode_python_ms": med["python_decode"], "fast_flags_lever": fast,
            "fast_resize": {"stages_ms": fast_stages, "kernel_ms": med["image_slice_fast"],
                            "vs_exact": fast_diff}}


def _difference(got, ref):
    """max abs. difference, mean abs. difference and PSNR (dB, peak 255) of two uint8 arrays."""
    diff = np.abs(ref.astype(np.int16) - got.astype(np.int16))
    mse = float((diff.astype(np.float64) ** 2).mean())
    return {"mean_abs_diff": float(diff.mean()), "max_abs_diff": int(diff.max()),
            "differing_values": float((diff > 0).mean()),
            "psnr_db": 10 * math.log10(255 ** 2 / mse) if mse else math.inf}


TJPARAM_FASTUPSAMPLE, TJPARAM_FASTDCT = 9, 10  # turbojpeg.h (TurboJPEG 3.0 enum TJPARAM)


def _fast_flags_lever(dec, run, out, reps):
    """A lever measured, not used: libjpeg-turbo's fast chroma upsampling + fast integer IDCT on the handle.

    Sets both on the benchmark's own handle (``tj3Set``), times the region decode and the fused kernel (which
    writes ``out``), compares its uint8 outputs with the exact ones ``out`` held before (equal to Pillow's at
    scale 1/1), then resets both flags to 0."""
    fn = dec._lib.cdll.tj3Set
    fn.restype, fn.argtypes = ctypes.c_int, (ctypes.c_void_p, ctypes.c_int, ctypes.c_int)
    run("image_slice")
    exact = out.copy()
    for param in (TJPARAM_FASTUPSAMPLE, TJPARAM_FASTDCT):
        assert fn(dec.handle, param, 1) == 0, "tj3Set failed"
    try:
        times = {"region": [], "image_slice": []}
        for _ in range(reps):
            for name in times:
                times[name].append(run(name) / out.shape[0] * 1e3)
        diff = _difference(out, exact)
    finally:
        for param in (TJPARAM_FASTUPSAMPLE, TJPARAM_FASTDCT):
            fn(dec.handle, param, 0)
    return {"region_ms": _median_range(times["region"]), "kernel_ms": _median_range(times["image_slice"]),
            **diff}


def loader_uint8(path, threads, batch_size, epochs=2, resize_mode="exact"):
    """Loader rate and CPU per image for the uint8 RRC + flip pipeline: ``epochs`` timed epochs after a warm one.

    Returns wall images/s (median over epochs) and CPU ms per image (``time.process_time``: every thread of
    this process, so with 1 thread it is the per-thread cost including Python and the handing out)."""
    pipe = {"image": [RandomResizedCrop(224, resize_mode=resize_mode), RandomHorizontalFlip(), ToTensor()],
            "label": None}
    rates, cpu = [], []
    with Loader(path, batch_size=batch_size, pipelines=pipe, num_threads=threads, seed=0) as loader:
        for _ in loader:  # epoch 0: compile, warm caches and pools
            pass
        for epoch in range(1, epochs + 1):
            loader.set_epoch(epoch)
            c, t, count = time.process_time(), time.perf_counter(), 0
            for b in loader:
                count += b["image"].shape[0]
            rates.append(count / (time.perf_counter() - t))
            cpu.append((time.process_time() - c) / count * 1e3)
    return {"images_per_s": statistics.median(rates), "cpu_ms_per_image": statistics.median(cpu),
            "rates": rates, "cpu_ms": cpu}


def mean_jpeg_bytes(path) -> float:
    with open_dataset(path) as ds:
        return float(np.mean(ds.index["image.length"]))


def breakdown(path, batch_size, reps=3, restart=None):
    """The breakdown, the Loader at 1 and 2 threads and at 1 thread with resize_mode="fast" (interleaved 1, 2,
    1 fast, 1, 2, 1 fast, ...) and the targets. ``restart``: {n: path of the same images written with
    ``RGBImage(jpeg_restart=n)``}, whose Loader rows (1 thread, exact and fast) join the same rounds."""
    bd = stage_breakdown(path, reps=max(reps, 3))
    restart = restart or {}
    runs = {1: [], 2: [], "fast": [], **{(n, m): [] for n in restart for m in ("exact", "fast")}}
    for _ in range(reps):
        for threads in (1, 2):
            runs[threads].append(loader_uint8(path, threads, batch_size, epochs=1))
        runs["fast"].append(loader_uint8(path, 1, batch_size, epochs=1, resize_mode="fast"))
        for n, rpath in restart.items():
            for mode in ("exact", "fast"):
                runs[(n, mode)].append(loader_uint8(rpath, 1, batch_size, epochs=1, resize_mode=mode))
    plain_bytes = mean_jpeg_bytes(path)
    bd["restart"] = {str(n): {"mean_bytes": mean_jpeg_bytes(rpath), "size_ratio": mean_jpeg_bytes(rpath) / plain_bytes,
                              **{mode: {"cpu_ms_per_image": _median_range([r["cpu_ms_per_image"]
                                                                           for r in runs[(n, mode)]]),
                                        "images_per_s": _median_range([r["images_per_s"] for r in runs[(n, mode)]])}
                                 for mode in ("exact", "fast")}}
                     for n, rpath in restart.items()}
    bd["plain_mean_bytes"] = plain_bytes
    one = {"images_per_s": _median_range([r["images_per_s"] for r in runs[1]]),
           "cpu_ms_per_image": _median_range([r["cpu_ms_per_image"] for r in runs[1]])}
    two = {"images_per_s": _median_range([r["images_per_s"] for r in runs[2]]),
           "cpu_ms_per_image": _median_range([r["cpu_ms_per_image"] for r in runs[2]])}
    loader_ms = one["cpu_ms_per_image"]["median"]
    bd["fast_resize"]["loader_1_thread"] = {
        "images_per_s": _median_range([r["images_per_s"] for r in runs["fast"]]),
        "cpu_ms_per_image": _median_range([r["cpu_ms_per_image"] for r in runs["fast"]])}
    bd["loader_1_thread"] = one
    bd["loader_2_threads"] = two
    bd["overhead_ms"] = loader_ms - bd["kernel_ms"]
    bd["load_average"] = os.getloadavg()
    return bd


FFCV_PYTHON = Path(__file__).resolve().parent / ".envs" / "ffcv" / "bin" / "python"
FFCV_BENCH = Path(__file__).resolve().parent / "peers" / "ffcv_bench.py"


def ffcv_uint8_per_thread(folder, tmp, batch_size, runs):
    """FFCV 1.0.2 (benchmarks/.envs/ffcv, if built) on the same folder: the uint8 RRC + flip pipeline, 1 worker.

    Returns None without the env; else CPU ms per image (process tree, median of ``runs`` fresh processes) and
    images/s. The .beton is written from the same JPEG folder (max side 512, q90)."""
    if not FFCV_PYTHON.exists():
        return None
    beton = Path(tmp) / "train.beton"
    subprocess.run([str(FFCV_PYTHON), str(FFCV_BENCH), "convert", "--folder", str(folder), "--out", str(beton),
                    "--max-res", "512"], check=True, capture_output=True, text=True, timeout=1800)
    rows = []
    for _ in range(runs):
        r = subprocess.run([str(FFCV_PYTHON), str(FFCV_BENCH), "load", "--path", str(beton), "--workers", "1",
                            "--batch-size", str(batch_size), "--uint8"], check=True, capture_output=True,
                           text=True, timeout=1800)
        rows.append(json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1]))
    return {"cpu_ms_per_image": _median_range([r["cpu_s_per_image"] * 1e3 for r in rows]),
            "images_per_s": _median_range([r["images_per_s"] for r in rows])}


def breakdown_table(bd) -> str:
    lines = [f"\nPer-stage cost, one thread, CPU ms per image ({bd['images']} JPEGs, mean {bd['mean_width']:.0f}x"
             f"{bd['mean_height']:.0f}, q90; {UINT8_PIPE}; DCT scales {bd['scales']}):\n",
             "| stage | ms/image |", "|---|---|"]
    for name, ms in bd["stages_ms"].items():
        lines.append(f"| {name} | {ms:.3f} |")
    lines.append(f"| = fused kernel (image_slice) | {bd['kernel_ms']:.3f} |")
    lines.append(f"| Loader overhead (page reads, planning, Python, threads) | {bd['overhead_ms']:.3f} |")
    lines.append(f"| = Loader, 1 thread | {bd['loader_1_thread']['cpu_ms_per_image']['median']:.3f} |")
    lines.append(f"| reference: full decode, nogil kernel loop, reused buffer | {bd['full_decode_kernel_ms']:.3f} |")
    lines.append(f"| reference: full decode, JpegDecoder.decode (new array per image) | "
                 f"{bd['full_decode_python_ms']:.3f} |")
    f = bd["fast_flags_lever"]
    lines.append(f"| lever, not used: fast upsampling + fast IDCT: region decode | {f['region_ms']['median']:.3f} |")
    lines.append(f"| lever, not used: fast upsampling + fast IDCT: fused kernel | {f['kernel_ms']['median']:.3f} "
                 f"(vs exact: mean abs. difference {f['mean_abs_diff']:.2f}, max {f['max_abs_diff']}, PSNR "
                 f"{f['psnr_db']:.1f} dB) |")
    fr = bd["fast_resize"]
    for name, ms in fr["stages_ms"].items():
        lines.append(f"| resize_mode=\"fast\": {name} | {ms:.3f} |")
    lines.append(f"| resize_mode=\"fast\": = fused kernel (image_slice) | {fr['kernel_ms']:.3f} (vs exact: mean abs. "
                 f"difference {fr['vs_exact']['mean_abs_diff']:.2f}, max {fr['vs_exact']['max_abs_diff']}, "
                 f"{100 * fr['vs_exact']['differing_values']:.0f}% of values differ, PSNR "
                 f"{fr['vs_exact']['psnr_db']:.1f} dB) |")
    lines.append(f"| resize_mode=\"fast\": = Loader, 1 thread | "
                 f"{fr['loader_1_thread']['cpu_ms_per_image']['median']:.3f} |")
    one, two = bd["loader_1_thread"]["images_per_s"], bd["loader_2_threads"]["images_per_s"]
    if bd.get("ffcv_1_worker"):
        f = bd["ffcv_1_worker"]["cpu_ms_per_image"]
        lines.append(f"| FFCV 1.0.2, same pipeline, 1 worker (process CPU) | {f['median']:.3f} |")
    fo = fr["loader_1_thread"]["images_per_s"]
    for n, r in bd.get("restart", {}).items():
        lines.append(f"| RGBImage(jpeg_restart={n}) (crop-only decode): = Loader, 1 thread, exact / fast | "
                     f"{r['exact']['cpu_ms_per_image']['median']:.3f} / {r['fast']['cpu_ms_per_image']['median']:.3f} "
                     f"({r['mean_bytes']:,.0f} bytes per image, {100 * (r['size_ratio'] - 1):+.2f}% vs "
                     f"{bd['plain_mean_bytes']:,.0f}) |")
    lines.append(f"\nLoader uint8 wall rate: 1 thread {one['median']:.0f} img/s ({one['min']:.0f}-{one['max']:.0f}), "
                 f"2 threads {two['median']:.0f} ({two['min']:.0f}-{two['max']:.0f}), 1 thread with "
                 f"resize_mode=\"fast\" {fo['median']:.0f} ({fo['min']:.0f}-{fo['max']:.0f}); load average "
                 f"{', '.join(f'{v:.2f}' for v in bd['load_average'])}")
    return "\n".join(lines)


def breakdown_targets(bd) -> list[dict]:
    loader_ms = bd["loader_1_thread"]["cpu_ms_per_image"]["median"]
    one, two = bd["loader_1_thread"]["images_per_s"]["median"], bd["loader_2_threads"]["images_per_s"]["median"]
    fast_ms = bd["fast_resize"]["loader_1_thread"]["cpu_ms_per_image"]["median"]

    def target(name, measured, goal, detail):
        return {"name": name, "measured": measured, "target": goal, "unit": "x", "met": measured >= goal,
                "detail": detail}

    return [
        target("images: fused Loader vs full decode, per thread", bd["full_decode_python_ms"] / loader_ms, 1.0,
               f"Loader {UINT8_PIPE}, 1 thread, {loader_ms:.3f} CPU ms/image vs libjpeg-turbo full decode of the "
               f"same bytes through JpegDecoder.decode {bd['full_decode_python_ms']:.3f} ms (the issue's reference)"),
        target("images: fused Loader, resize_mode=\"fast\", vs full decode, per thread",
               bd["full_decode_python_ms"] / fast_ms, 1.3,
               f"Loader {UINT8_PIPE} with RandomResizedCrop(224, resize_mode=\"fast\"), 1 thread, {fast_ms:.3f} CPU "
               f"ms/image vs {bd['full_decode_python_ms']:.3f} ms; the region decode alone (entropy + IDCT of the "
               f"crop at its DCT scale) is {bd['variants_ms']['region']['median']:.3f} ms"),
        target("images: fused Loader vs full decode in a kernel loop, per thread",
               bd["full_decode_kernel_ms"] / loader_ms, 1.0,
               f"strict reference: tj3Decompress8 in a nogil loop into a reused buffer, "
               f"{bd['full_decode_kernel_ms']:.3f} ms/image; the region decode alone is "
               f"{bd['variants_ms']['region']['median']:.3f} ms"),
        *([target("images: fused Loader vs FFCV, per thread",
                  bd["ffcv_1_worker"]["cpu_ms_per_image"]["median"] / loader_ms, 2.5,
                  f"CPU ms per image, same uint8 RRC + flip pipeline, 1 thread vs FFCV 1 worker: "
                  f"{loader_ms:.3f} vs {bd['ffcv_1_worker']['cpu_ms_per_image']['median']:.3f}")]
          if bd.get("ffcv_1_worker") else []),
        *[target(f"images: fused Loader, jpeg_restart={n}, {mode}, vs full decode, per thread",
                 bd["full_decode_python_ms"] / r[mode]["cpu_ms_per_image"]["median"], goal,
                 f"the same images written with RGBImage(jpeg_restart={n}) ({100 * (r['size_ratio'] - 1):+.2f}% "
                 f"bytes), crop-only decode of their restart intervals, 1 thread, "
                 f"{r[mode]['cpu_ms_per_image']['median']:.3f} CPU ms/image vs {bd['full_decode_python_ms']:.3f} "
                 "ms (the full decode of the file without restart intervals)")
          for n, r in bd.get("restart", {}).items() for mode, goal in (("exact", 1.0), ("fast", 1.3))],
        target("images: Loader 2 threads / 1 thread", two / one, 1.8,
               f"wall images/s, {one:.0f} -> {two:.0f}, interleaved runs; load average "
               f"{bd['load_average'][0]:.2f} on {os.cpu_count()} cores. CPU ms per image (all threads) "
               f"{bd['loader_1_thread']['cpu_ms_per_image']['median']:.3f} with 1 thread, "
               f"{bd['loader_2_threads']['cpu_ms_per_image']['median']:.3f} with 2: the wall ratio needs two idle "
               "cores"),
    ]


FIRST_BATCH = """
import time, sys
t0 = time.perf_counter()
from pageset import Loader, RandomResizedCrop, RandomHorizontalFlip, Normalize, ToTensor
loader = Loader(sys.argv[1], batch_size=64, num_threads=2, pipelines={"image": [RandomResizedCrop(224),
    RandomHorizontalFlip(), Normalize(), ToTensor()], "label": None})
next(iter(loader))
print(time.perf_counter() - t0)
"""


def first_batch_times(path):
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)  # this subprocess only: a fresh, empty kernel cache
        out = []
        for _ in range(2):
            r = subprocess.run([sys.executable, "-c", FIRST_BATCH, str(path)], env=env, capture_output=True,
                               text=True, check=True)
            out.append(float(r.stdout.strip().splitlines()[-1]))
    return out  # [cold, warm]


def build_data(tmp, n_images):
    folder = make_imagenet_like(Path(tmp) / "train", n_images, long_side=(400, 512),
                                photos=wheel_photos() + debian_photos(), quality=(90, 90))
    path = Path(tmp) / "train.pageset"
    write_dataset(path, folder, {"image": RGBImage(max_resolution=512, jpeg_quality=90), "label": Int()},
                  progress=False)
    restart = {}
    for n in RESTART_PER_ROW:  # the same images with restart intervals (the same pixels: lossless entropy coding)
        restart[n] = Path(tmp) / f"train_restart{n}.pageset"
        write_dataset(restart[n], folder, {"image": RGBImage(max_resolution=512, jpeg_quality=90, jpeg_restart=n),
                                           "label": Int()}, progress=False)
    return folder, path, restart


RESTART_PER_ROW = (1, 4)  # RGBImage(jpeg_restart=n) rows: one interval per MCU row, and up to 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--json", default="out/bench_images.json")
    ap.add_argument("--breakdown-only", action="store_true",
                    help="only the per-stage breakdown, the uint8 Loader rows and their targets (~2 min)")
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs of each breakdown row (median, min-max)")
    ap.add_argument("--data", default=None, help="an existing image .pageset for --breakdown-only (field 'image')")
    args = ap.parse_args()
    if args.data and not args.breakdown_only:
        ap.error("--data needs --breakdown-only (the other rows also read the JPEG folder)")
    cores = os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder, path, restart = (None, Path(args.data), {}) if args.data else build_data(tmp, args.images)
        bd = breakdown(path, args.batch_size, reps=args.runs, restart=restart)
        bd["ffcv_1_worker"] = None if folder is None else ffcv_uint8_per_thread(folder, tmp, args.batch_size,
                                                                                 args.runs)
        if not args.breakdown_only:
            files = sorted((str(p), 0) for p in folder.rglob("*.jpg"))
            for threads in sorted({1, cores}):
                for order, cache in (("random", "os"), ("quasi_random", "os"), ("quasi_random", "process")):
                    r = bench_pageset(path, args.images, args.batch_size, threads, order, cache)
                    rows.append({"loader": f"pageset {order}, page_cache={cache}", "workers": threads, **r})
            for workers in sorted({0, 1, cores}):
                r = bench_baseline(files, args.batch_size, workers)
                rows.append({"loader": "DataLoader + Pillow (JPEG files)", "workers": workers, **r})
            pil, turbo = decode_only(path)
            cold, warm = first_batch_times(path)
    result = {"benchmark": "images", "settings": vars(args), "machine": {"cpus": cores,
              "platform": platform.platform(), "torch": torch.__version__}, "breakdown": bd,
              "targets": breakdown_targets(bd)}
    if rows:
        base = {r["workers"]: r["images_per_s"] for r in rows if r["loader"].startswith("DataLoader")}
        print(f"\nRandomResizedCrop(224) + flip + normalize, float32, batch {args.batch_size}, {args.images} "
              f"ImageNet-like JPEGs (max side 512, q90), {cores} cores\n")
        print("| loader | threads/workers | images/s | vs DataLoader (same workers) | first batch s |")
        print("|---|---|---|---|---|")
        for r in rows:
            ref = base.get(r["workers"]) or base.get(max(r["workers"], 1))
            print(f"| {r['loader']} | {r['workers']} | {r['images_per_s']:.0f} | {r['images_per_s'] / ref:.2f}x | "
                  f"{r['first_batch_s']:.3f} |")
        print(f"\ndecode only, one core: Pillow {pil:.0f} images/s, libjpeg-turbo via pageset kernel {turbo:.0f} "
              "images/s")
        print(f"time to first batch in a new process: cold kernel cache {cold:.1f} s, warm {warm:.1f} s")
        result.update({"results": rows, "decode_only_per_core": {"pillow": pil, "pageset_turbo": turbo},
                       "first_batch_s": {"cold_cache": cold, "warm_cache": warm}})
    print(breakdown_table(bd))
    print("\n| target | measured | goal | met |\n|---|---|---|---|")
    for tg in result["targets"]:
        print(f"| {tg['name']} | {tg['measured']:.2f}{tg['unit']} | >= {tg['target']}{tg['unit']} | "
              f"{'yes' if tg['met'] else 'no'} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
