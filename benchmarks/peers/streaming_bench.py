"""Mosaic Streaming (MDS) and litdata on the same ImageFolder (runs in benchmarks/.envs/streaming).

    benchmarks/.envs/streaming/bin/python benchmarks/peers/streaming_bench.py convert --peer mds|litdata \
        --folder F --out DIR
    benchmarks/.envs/streaming/bin/python benchmarks/peers/streaming_bench.py load --peer mds|litdata \
        --path DIR --workers 2 [--batch-size 64]
    benchmarks/.envs/streaming/bin/python benchmarks/peers/streaming_bench.py tokens --out DIR [--tokens N]
    S3_ENDPOINT_URL=http://... AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \
    benchmarks/.envs/streaming/bin/python benchmarks/peers/streaming_bench.py remote --peer mds|litdata \
        --path s3://bucket/prefix|DIR --compute-ms MS [--workers 2] [--size 160]   (benchmarks/remote.py runs it)

Both store the JPEG files' bytes unchanged (a `bytes` column), so they read the very bytes the DataLoader
baseline reads from the folder; samples are decoded and augmented in the DataLoader workers with Pillow:
the baseline's RandomResizedCrop(224) + flip + normalize, float32 NCHW (measure.pillow_transform). This is how
both projects' ImageNet examples work (they have no fused decode+crop kernels). Prints one JSON line.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import measure  # noqa: E402  (before the loader's imports: starts the time-to-first-batch clock)
import tv_stub  # noqa: E402


def _records(folder):
    for path, label in measure.image_folder(folder):
        with open(path, "rb") as f:
            yield f.read(), label


def _lit_item(item):
    path, label = item
    with open(path, "rb") as f:
        return {"image": f.read(), "label": int(label)}


def convert(args):
    t = time.perf_counter()
    n = 0
    if args.peer == "mds":
        tv_stub.import_streaming()
        from streaming import MDSWriter

        with MDSWriter(out=args.out, columns={"image": "bytes", "label": "int"}, size_limit=args.shard_size,
                       progress_bar=False) as w:
            for data, label in _records(args.folder):
                w.write({"image": data, "label": label})
                n += 1
    else:
        from litdata import optimize

        inputs = measure.image_folder(args.folder)
        n = len(inputs)
        optimize(fn=_lit_item, inputs=inputs, output_dir=args.out, chunk_bytes=args.shard_size.upper(), num_workers=1,
                 reorder_files=False, verbose=False)
    dt = time.perf_counter() - t
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(args.out) for f in fs)
    measure.emit({"convert_s": dt, "images": n, "file_mb": size / 1e6})


def _mds_dataset(path, bs, size=224):
    tv_stub.import_streaming()
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()

    class DS(StreamingDataset):
        def __getitem__(self, idx):
            obj = super().__getitem__(idx)
            return measure.pillow_transform(obj["image"], size), obj["label"]

    return DS(local=path, remote=None, shuffle=True, shuffle_seed=0, batch_size=bs)


def _lit_dataset(path, size=224):
    from litdata import StreamingDataset

    class DS(StreamingDataset):
        def __getitem__(self, index):
            obj = super().__getitem__(index)
            return measure.pillow_transform(obj["image"], size), obj["label"]

    return DS(path, shuffle=True, seed=0, drop_last=True)


def load(args):
    import torch

    ds = _mds_dataset(args.path, args.batch_size) if args.peer == "mds" else _lit_dataset(args.path)
    dl = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers,
                                     persistent_workers=args.workers > 0, drop_last=True)

    def make_iter(epoch):
        if hasattr(ds, "set_epoch"):
            ds.set_epoch(epoch)
        return iter(dl)

    def check(batch):
        assert tuple(batch[0].shape) == (args.batch_size, 3, 224, 224) and batch[0].dtype == torch.float32

    measure.emit(measure.measure(make_iter, check))


def _token_part(item):
    """One part of the synthetic stream (uniform GPT-2 ids, uint16), as benchmarks/tokens.py's load rows use."""
    import numpy as np

    i, n = item
    yield np.random.default_rng(i).integers(0, 50257, n).astype(np.uint16)


def tokens(args):
    """litdata's token-window reader (TokensLoader) next to benchmarks/tokens.py's rows: B=32 random windows of
    seq_len+1 uint16 tokens, widened to int64 input/target, tokens/s of one process."""
    import numpy as np
    import torch
    from litdata import StreamingDataset, TokensLoader, optimize

    parts = 8
    per = args.tokens // parts
    t = time.perf_counter()
    optimize(fn=_token_part, inputs=[(i, per) for i in range(parts)], output_dir=args.out, chunk_size=2**22, item_loader=TokensLoader(),
             num_workers=1, verbose=False)
    row = {"convert_s": time.perf_counter() - t, "tokens": per * parts}
    B = 32
    for seq_len in (1024, 2048):
        ds = StreamingDataset(args.out, item_loader=TokensLoader(block_size=seq_len + 1), shuffle=True)
        rng = np.random.default_rng(0)

        def get_batch(ds=ds, rng=rng):
            x = torch.from_numpy(np.stack([ds[int(i)] for i in rng.integers(0, len(ds), B)]).astype(np.int64))
            return x[:, :-1], x[:, 1:]

        get_batch()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            get_batch()
            n += 1
        row[str(seq_len)] = n * B * seq_len / (time.perf_counter() - t0)
    measure.emit(row)


def _remote_dataset(peer, url, cache, bs, size):
    """A peer's dataset streaming ``url`` (s3://) into the fresh folder ``cache``; the endpoint comes from the
    environment the parent sets (MDS: ``S3_ENDPOINT_URL``; litdata: ``storage_options``' ``endpoint_url``)."""
    if peer == "mds":
        tv_stub.import_streaming()
        from streaming import StreamingDataset

        class DS(StreamingDataset):
            def __getitem__(self, idx):
                obj = super().__getitem__(idx)
                return measure.pillow_transform(obj["image"], size), obj["label"]

        return DS(remote=url, local=cache, shuffle=True, shuffle_seed=0, batch_size=bs)
    from litdata import StreamingDataset
    from litdata.streaming import downloader

    # litdata 0.2.76 fetches chunks with obstore, whose HTTP client refuses a plain-http endpoint (reqwest
    # "BadScheme") unless allow_http is set; litdata passes no such option and reads no environment variable
    # for it, so it is set on litdata's own client-options dict (the local server has no TLS).
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True

    class LDS(StreamingDataset):
        def __getitem__(self, index):
            obj = super().__getitem__(index)
            return measure.pillow_transform(obj["image"], size), obj["label"]

    return LDS(url, cache_dir=cache, shuffle=True, seed=0, drop_last=True,
               storage_options={"endpoint_url": os.environ["S3_ENDPOINT_URL"]})


def remote(args):
    """Two epochs, each over a fresh dataset object with an empty local cache folder (so each downloads the
    shards again, as a dataset larger than the node's disk would): epoch A times images/s after the first batch
    and time to first batch (dataset construction to first batch); epoch B runs an emulated accelerator that
    sleeps ``--compute-ms`` per batch: AU = compute time / wall time of the epoch. ``--path`` is a local shard
    folder or an s3:// URL. Bytes downloaded: the cache folder's size after epoch A."""
    import shutil
    import tempfile

    import torch

    if args.peer == "mds":
        tv_stub.import_streaming()
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
    row = {}
    for phase in ("rate", "au"):
        cache = tempfile.mkdtemp(prefix=f"{args.peer}-cache-")
        try:
            t0 = time.perf_counter()
            if args.path.startswith("s3://"):
                ds = _remote_dataset(args.peer, args.path, cache, args.batch_size, args.size)
            elif args.peer == "mds":
                ds = _mds_dataset(args.path, args.batch_size, args.size)
            else:
                ds = _lit_dataset(args.path, args.size)
            dl = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers,
                                             drop_last=True)
            if phase == "rate":
                it = iter(dl)
                batch = next(it)
                assert tuple(batch[0].shape) == (args.batch_size, 3, args.size, args.size)
                row["first_batch_s"] = time.perf_counter() - t0
                t1 = time.perf_counter()
                n = sum(len(b[1]) for b in it)
                row["images_per_s"] = n / (time.perf_counter() - t1)
                row["images"] = n + args.batch_size
                row["bytes_downloaded"] = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(cache)
                                              for f in fs if not f.endswith(".lock"))
            else:
                compute = args.compute_ms / 1e3
                t1 = time.perf_counter()
                steps = 0
                for _ in dl:
                    time.sleep(compute)
                    steps += 1
                row["AU"] = steps * compute / (time.perf_counter() - t1)
            del dl, ds
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    measure.emit(row)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert")
    c.add_argument("--peer", choices=["mds", "litdata"], required=True)
    c.add_argument("--folder", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--shard-size", default="64mb", help="shard (MDS) / chunk (litdata) size, e.g. 4mb")
    lo = sub.add_parser("load")
    lo.add_argument("--peer", choices=["mds", "litdata"], required=True)
    lo.add_argument("--path", required=True)
    lo.add_argument("--workers", type=int, default=os.cpu_count())
    lo.add_argument("--batch-size", type=int, default=64)
    rm = sub.add_parser("remote", help="one epoch timed + one epoch with an emulated accelerator, fresh caches")
    rm.add_argument("--peer", choices=["mds", "litdata"], required=True)
    rm.add_argument("--path", required=True, help="local shard folder or s3:// URL")
    rm.add_argument("--workers", type=int, default=2)
    rm.add_argument("--batch-size", type=int, default=64)
    rm.add_argument("--size", type=int, default=160, help="RandomResizedCrop output side")
    rm.add_argument("--compute-ms", type=float, required=True, help="emulated accelerator step per batch")
    tk = sub.add_parser("tokens")
    tk.add_argument("--out", required=True)
    tk.add_argument("--tokens", type=int, default=20_000_000)
    args = ap.parse_args()
    {"convert": convert, "load": load, "tokens": tokens, "remote": remote}[args.cmd](args)


if __name__ == "__main__":
    main()
