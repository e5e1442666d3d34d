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

from pageset import Int, RGBImage, open_dataset, write_dataset
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
    demo_loader(path, args.num_workers)
    print(f"inspect it: .venv/bin/pageset inspect {path}")


def demo_loader(path, threads: int) -> None:
    """Two epochs of the training recipe, a state_dict mid-epoch, and a resumed loader that continues exactly."""
    from pageset import Loader, Normalize, RandomHorizontalFlip, RandomResizedCrop, ToTensor, ToTorchImage

    pipes = {"image": [RandomResizedCrop(224), RandomHorizontalFlip(), Normalize(), ToTorchImage(), ToTensor()]}
    kw = dict(batch_size=32, order="quasi_random", seed=0, num_threads=threads, pipelines=pipes)
    t0 = time.perf_counter()
    with Loader(path, **kw) as loader:
        first = next(iter(loader))
        t_first = time.perf_counter() - t0
        print(f"Loader: first batch {tuple(first['image'].shape)} {first['image'].dtype} after {t_first:.2f} s "
              f"(kernels load from the disk cache after the first run)")
        loader.set_epoch(0)
        t0 = time.perf_counter()
        n = sum(b["image"].shape[0] for b in loader) + sum(b["image"].shape[0] for b in loader)
        dt = time.perf_counter() - t0
        print(f"Loader: 2 epochs, {n} images in {dt:.2f} s ({n / dt:.0f} images/s with {threads} threads, "
              f"RandomResizedCrop(224) + flip + normalize -> float32 channels_last)")
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = loader.state_dict()
        expected = [b["_index"].tolist() for b in it]
    with Loader(path, **kw) as resumed:
        resumed.load_state_dict(state)
        got = [b["_index"].tolist() for b in resumed]
    print(f"resume: state after 3 batches of epoch {state['epoch']} -> the resumed loader's {len(got)} batches "
          f"{'equal' if got == expected else 'DIFFER FROM'} the uninterrupted run's")


if __name__ == "__main__":
    main()
