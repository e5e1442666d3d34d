"""FFCV 1.0.2 on the same ImageFolder: convert to .beton, then one measured loader row (runs in benchmarks/.envs/ffcv).

    benchmarks/.envs/ffcv/bin/python benchmarks/peers/ffcv_bench.py convert --folder F --out x.beton --max-res 512
        [--workers 2] [--memory 1]  (times DatasetWriter + from_indexed_dataset: CPU of the process tree;
        with --memory 1, peak PSS of the tree, sampled, which slows the run)
    benchmarks/.envs/ffcv/bin/python benchmarks/peers/ffcv_bench.py load --path x.beton --workers 2 \
        [--order random|quasi_random] [--os-cache 1] [--batch-size 64] [--uint8]

Pipeline: RandomResizedCropRGBImageDecoder(224) + RandomHorizontalFlip + NormalizeImage(float32) + ToTensor +
ToTorchImage: float32 NCHW-shaped tensors in channels_last memory, like pageset's default ToTorchImage.
Prints one JSON line (see measure.py for what each number means).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import measure  # noqa: E402  (before the loader's imports: starts the time-to-first-batch clock)


def convert(args):
    import numpy as np  # noqa: F401
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter
    from PIL import Image

    files = measure.image_folder(args.folder)

    class Folder:
        def __len__(self):
            return len(files)

        def __getitem__(self, i):
            with Image.open(files[i][0]) as img:
                return img.convert("RGB"), files[i][1]

    # The PSS sampler reads /proc/<pid>/smaps of every process, which costs CPU and contends with the workers'
    # page faults: a timed run goes without it (peak RSS of this process only), a --memory run with it.
    sampler = measure.TreeSampler() if args.memory else measure.RusageSampler()
    c0, t = measure.cpu_with_children(), time.perf_counter()
    writer = DatasetWriter(args.out, {"image": RGBImageField(write_mode="jpg", max_resolution=args.max_res,
                                                             jpeg_quality=90),
                                      "label": IntField()}, num_workers=args.workers)
    writer.from_indexed_dataset(Folder())
    dt = time.perf_counter() - t
    sampler.stop()
    measure.emit({"convert_s": dt, "images": len(files), "file_mb": os.path.getsize(args.out) / 1e6,
                  "peak_rss_mb": sampler.peak_bytes / 2**20, "cpu_s": measure.cpu_with_children() - c0})


def load(args):
    import numpy as np
    import torch
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import NormalizeImage, RandomHorizontalFlip, ToTensor, ToTorchImage

    mean = np.array(measure.MEAN) * 255
    std = np.array(measure.STD) * 255
    image = [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip()]
    if args.uint8:  # FFCV's uint8 recipe (normalize on the GPU): uint8 [B, 224, 224, 3]
        image += [ToTensor()]
    else:
        image += [NormalizeImage(mean, std, np.float32), ToTensor(), ToTorchImage()]
    pipes = {"image": image, "label": [IntDecoder(), ToTensor()]}
    order = {"random": OrderOption.RANDOM, "quasi_random": OrderOption.QUASI_RANDOM}[args.order]
    loader = Loader(args.path, batch_size=args.batch_size, num_workers=args.workers, order=order,
                    os_cache=bool(args.os_cache), drop_last=True, pipelines=pipes)

    def check(batch):
        img = batch[0]
        want = ((args.batch_size, 224, 224, 3), torch.uint8) if args.uint8 else ((args.batch_size, 3, 224, 224),
                                                                                  torch.float32)
        assert (tuple(img.shape), img.dtype) == want, (img.shape, img.dtype)

    row = measure.measure(lambda epoch: iter(loader), check)
    row.update({"torch_threads": torch.get_num_threads()})
    measure.emit(row)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert")
    c.add_argument("--folder", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--max-res", type=int, default=512)
    c.add_argument("--workers", type=int, default=os.cpu_count())
    c.add_argument("--memory", type=int, default=0, help="1: sample the process tree's PSS (slows the run)")
    lo = sub.add_parser("load")
    lo.add_argument("--path", required=True)
    lo.add_argument("--workers", type=int, default=os.cpu_count())
    lo.add_argument("--order", default="random")
    lo.add_argument("--os-cache", type=int, default=1)
    lo.add_argument("--batch-size", type=int, default=64)
    lo.add_argument("--uint8", action="store_true", help="RRC + flip only: uint8 NHWC, no NormalizeImage")
    args = ap.parse_args()
    convert(args) if args.cmd == "convert" else load(args)


if __name__ == "__main__":
    main()
