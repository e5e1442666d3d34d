"""Conversion throughput: images/s of ``write_dataset`` on the real-photo ImageNet-like set, per num_workers.

    .venv/bin/python -m benchmarks.write [--images 600] [--workers 1 2] [--json out/bench_write.json]

Prints a markdown table and writes JSON (settings, machine, results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from pageset import Int, RGBImage, open_dataset, write_dataset
from pageset.sample_data import debian_photos, make_imagenet_like, wheel_photos


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=600)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--max-resolution", type=int, default=512)
    ap.add_argument("--json", default="out/bench_write.json")
    args = ap.parse_args()

    photos = wheel_photos() + debian_photos()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_imagenet_like(Path(tmp) / "train", args.images, long_side=(400, 500), photos=photos)
        src_mb = sum(p.stat().st_size for p in folder.rglob("*.jpg")) / 1e6
        for encoding in ("jpeg", "raw"):
            fields = {"image": RGBImage(max_resolution=args.max_resolution, encoding=encoding), "label": Int()}
            ids = set()
            for w in args.workers:
                out = Path(tmp) / f"{encoding}-{w}.pageset"
                t0 = time.perf_counter()
                res = write_dataset(out, folder, fields, num_workers=w, progress=False)
                dt = time.perf_counter() - t0
                ids.add(res.dataset_id)
                with open_dataset(out) as ds:
                    ds.verify()
                rows.append({"encoding": encoding, "num_workers": w, "images": res.records, "seconds": dt,
                             "images_per_s": res.records / dt, "file_mb": res.bytes / 1e6})
            assert len(ids) == 1, "output must not depend on num_workers"
    base = {r["encoding"]: r["images_per_s"] for r in rows if r["num_workers"] == args.workers[0]}
    print(f"\nwrite_dataset on {args.images} ImageNet-like JPEGs ({src_mb:.1f} MB, long side 400-500 px, "
          f"{len(photos)} source photos), max_resolution={args.max_resolution}, {os.cpu_count()} cores\n")
    print("| encoding | num_workers | images/s | speed-up | file MB |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['encoding']} | {r['num_workers']} | {r['images_per_s']:.0f} | "
              f"{r['images_per_s'] / base[r['encoding']]:.2f}x | {r['file_mb']:.1f} |")
    result = {"benchmark": "write", "settings": vars(args), "source_mb": src_mb, "source_photos": len(photos),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version()}, "results": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
