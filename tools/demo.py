"""The main job on an embedded default: real photos -> ImageNet-like folder -> pageset file -> read back.

    .venv/bin/python tools/demo.py [--images 400] [--out out/demo]

Uses the photos inside the scikit-image / scikit-learn wheels, plus Debian's wallpaper photos when installed
(see ../shared/design/data.md), and prints what happened and how fast.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from pageset import RGBImage, Int, open_dataset, write_dataset
from pageset.cli import describe
from pageset.sample_data import debian_photos, make_imagenet_like, wheel_photos


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--out", default="out/demo")
    ap.add_argument("--num-workers", type=int, default=os.cpu_count())
    args = ap.parse_args()

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    wheel, deb = wheel_photos(), debian_photos()
    print(f"real photos: {len(wheel)} from wheels, {len(deb)} Debian wallpapers"
          + ("" if deb else " (apt-get install mate-backgrounds plasma-workspace-wallpapers ... for more)"))
    t0 = time.perf_counter()
    folder = make_imagenet_like(out / "train", args.images, long_side=(400, 500), photos=wheel + deb, seed=0)
    t_make = time.perf_counter() - t0
    n_classes = len([p for p in folder.iterdir() if p.is_dir()])
    src_bytes = sum(p.stat().st_size for p in folder.rglob("*.jpg"))
    print(f"built an ImageNet-like folder: {args.images} JPEG crops, {n_classes} classes, "
          f"{src_bytes / 1e6:.1f} MB in {t_make:.1f} s -> {folder}")

    path = out / "train.pageset"
    fields = {"image": RGBImage(max_resolution=256, encoding="jpeg", jpeg_quality=90), "label": Int()}
    res = write_dataset(path, folder, fields, num_workers=args.num_workers)
    print(f"converted with {args.num_workers} workers: {res.records} records in {res.seconds:.2f} s "
          f"({res.records / res.seconds:.0f} images/s), {res.bytes / 1e6:.1f} MB, dataset id {res.dataset_id[:16]}")

    t0 = time.perf_counter()
    with open_dataset(path) as ds:
        t_open = time.perf_counter() - t0
        info = describe(ds)
        t0 = time.perf_counter()
        ds.verify()
        t_verify = time.perf_counter() - t0
        t0 = time.perf_counter()
        pixels = 0
        for i in range(len(ds)):
            pixels += ds[i]["image"].to_numpy().size
        t_read = time.perf_counter() - t0
    img = info["fields"]["image"]
    print(f"opened + validated in {t_open * 1e3:.1f} ms; verified {info['pages']} pages in {t_verify * 1e3:.1f} ms")
    print(f"images {img['width']['min']}-{img['width']['max']} x {img['height']['min']}-{img['height']['max']} px, "
          f"mean {img['bytes']['mean'] / 1e3:.1f} KB; read + Pillow-decoded all {len(ds)} in {t_read:.2f} s "
          f"({len(ds) / t_read:.0f} images/s, {pixels / 3 / 1e6:.1f} MPix)")
    print(f"inspect it: .venv/bin/pageset inspect {path}")


if __name__ == "__main__":
    main()
