"""Training from object storage, end to end on this machine: a local S3 server, the demo dataset uploaded to it,
two epochs read from ``s3://`` with a mid-epoch resume, and what was fetched.

    .venv/bin/python tools/demo_remote.py [--images 300] [--latency-ms 10] [--out out/demo_remote]

Starts moto's S3 server on 127.0.0.1 (``moto[server]``, from the test extra) behind a small proxy that counts
requests (and adds ``--latency-ms`` per request), uploads the file with boto3, and trains from
``s3://pageset-demo/train.pageset`` through s3fs. Batches are compared with the same file read locally.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the servers the tests start, too

from remote_servers import FaultProxy, MotoS3, s3_options  # noqa: E402

from pageset import Int, Loader, RandomHorizontalFlip, RandomResizedCrop, RGBImage, write_dataset  # noqa: E402
from pageset.sample_data import debian_photos, make_imagenet_like, wheel_photos  # noqa: E402


def digests(loader, stop_after=None):
    out = []
    for b in loader:
        out.append((tuple(b["_index"].tolist()), hashlib.sha256(np.asarray(b["image"]).tobytes()).hexdigest()))
        if stop_after is not None and len(out) == stop_after:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=300)
    ap.add_argument("--latency-ms", type=float, default=10.0, help="added to every request by the proxy")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="out/demo_remote")
    args = ap.parse_args()

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    folder = make_imagenet_like(out / "train", args.images, long_side=(300, 400),
                                photos=wheel_photos() + debian_photos(), seed=0)
    path = out / "train.pageset"
    res = write_dataset(path, folder, {"image": RGBImage(max_resolution=256, jpeg_quality=90), "label": Int()},
                        page_size=1 << 18, progress=False)
    print(f"dataset: {res.records} real photos, {res.bytes / 1e6:.1f} MB in pages of 256 KiB -> {path}")

    t0 = time.perf_counter()
    s3 = MotoS3()
    proxy = FaultProxy(s3.url)
    try:
        client = s3.client()
        client.create_bucket(Bucket="pageset-demo")
        client.upload_file(str(path), "pageset-demo", "train.pageset")
        url, opts = "s3://pageset-demo/train.pageset", s3_options(proxy.url)
        print(f"local S3 (moto) at {s3.url}, proxy at {proxy.url} (+{args.latency_ms:.0f} ms per request); "
              f"uploaded {url} in {time.perf_counter() - t0:.1f} s")
        proxy.latency = args.latency_ms / 1e3

        kw = dict(batch_size=32, order="quasi_random", seed=0, num_threads=args.threads, window_pages=4,
                  pipelines={"image": [RandomResizedCrop(160), RandomHorizontalFlip()]})
        with Loader(path, **kw) as loader:
            local = [digests(loader) for _ in range(2)]
        cache = out / "page_cache"
        proxy.reset()
        proxy.latency = args.latency_ms / 1e3
        t0 = time.perf_counter()
        with Loader(url, storage_options=opts, cache_dir=cache, **kw) as loader:
            it = iter(loader)
            first = digests(it, stop_after=1)
            t_first = time.perf_counter() - t0
            epoch0 = first + digests(it)
            half = loader.steps_per_epoch // 2
            epoch1_head = digests(loader, stop_after=half)
            state = loader.state_dict()
            stats = loader.remote_stats()
        dt = time.perf_counter() - t0
        print(f"s3:// Loader: first batch after {t_first:.2f} s; 1.5 epochs in {dt:.2f} s; state_dict at step "
              f"{state['cursor'] // 32} of epoch {state['epoch']}")
        print(f"  fetched {stats['pages_fetched']} pages in {stats['requests']} range requests, "
              f"{stats['bytes_fetched'] / 1e6:.2f} MB for a {res.bytes / 1e6:.2f} MB file "
              f"(read amplification {stats['bytes_fetched'] / res.bytes:.2f} over 1.5 epochs); "
              f"{stats['memory_hits']} of {stats['pages_used']} page lookups served from memory; "
              f"disk cache: {stats['disk_misses']} pages written")
        with Loader(url, storage_options=opts, cache_dir=cache, **kw) as resumed:
            resumed.load_state_dict(state)
            epoch1_tail = digests(resumed)
            stats = resumed.remote_stats()
        print(f"resumed in a new Loader: {len(epoch1_tail)} more batches; pages from the disk cache: "
              f"{stats['disk_hits']}, downloaded again: {stats['disk_misses']}")
        same = [epoch0, epoch1_head + epoch1_tail] == local
        print(f"2 epochs from s3:// (with the resume) {'equal' if same else 'DIFFER FROM'} the local file's "
              f"batches, bit for bit")
        gets = proxy.range_gets("/train.pageset")
        print(f"the store saw {len(gets)} range GETs of the object in all (open: 2 per Loader)")
        if not same:
            sys.exit(1)
    finally:
        proxy.stop()
        s3.stop()


if __name__ == "__main__":
    main()
