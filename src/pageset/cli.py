"""The pageset command line: convert, convert-text, merge, inspect, verify, clean, warmup.

    pageset convert train.pageset PHOTOS/ --max-resolution 512 --encoding jpeg --num-workers 8
    pageset convert train.pageset files.txt          # one image path per line, optionally "<path>\\t<label>"
    pageset convert-text train.pageset corpus/ --tokenizer encoder.json --merges vocab.bpe --separator %
    pageset convert s3://bucket/train.pageset PHOTOS/ --scheduler tcp://HOST:8786   # on a Dask cluster
    pageset convert s3://bucket/train.pageset PHOTOS/ --ray auto                    # on a Ray cluster
    pageset merge all.pageset part1.pageset part2.pageset
    pageset merge all.pageset train/                 # a many-file dataset's members -> one file
    pageset inspect train.pageset [--json]
    pageset verify train.pageset
    pageset verify s3://bucket/train.pageset --storage-options '{"client_kwargs": {"endpoint_url": "..."}}'
    pageset clean train.pageset                      # temp files and shards of killed writes
    pageset verify train/                            # a many-file dataset: its folder (or URL prefix)
    pageset clean train/                             # members a killed many-file write left (not in the manifest)
    pageset warmup                                   # compile the Loader's kernels into the cache (Dockerfile RUN)

The output comes first in every command that writes a file (as in every Python writer: write_dataset(path,
source, ...)); the old ``pageset convert SOURCE OUTPUT`` order still works, with a deprecation message.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import numpy as np

from .format import FormatError
from .format.constants import (
    DEFAULT_PAGE_SIZE,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    MAGIC,
    MAX_PAGE_SIZE,
    MIN_PAGE_SIZE,
)
from .format.errors import plural
from .format.fields import Int, RGBImage
from .write import ImageList, SampleError, write_dataset
from .write.output import check_not_input, check_replaceable, is_url, local_path
from .write.pool import MAX_WORKERS

SCHEDULER_TIMEOUT_S = 60  # --scheduler: seconds to reach the Dask scheduler


class _RaySession:
    """``--ray ADDRESS``: the connection ``ray.init(address=...)`` made, closed like a Dask client."""

    def close(self) -> None:
        import ray

        ray.shutdown()


def _ray_executor(args):
    try:
        import ray

        from .write.ray_executor import RayExecutor
    except ImportError:
        raise SystemExit(f"pageset {args.command}: --ray needs Ray: pip install 'pageset[ray]'") from None
    try:
        ray.init(address=args.ray, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise SystemExit(f"pageset {args.command}: --ray {args.ray}: cannot connect to the Ray cluster ({exc}); "
                         "check the address ('auto' on a cluster node, ray://HOST:10001 from outside, 'local' "
                         "for a new local instance)") from None
    return RayExecutor(), _RaySession()


def _executor(args):
    """The executor for ``--scheduler tcp://HOST:8786`` (a Dask client's) or ``--ray ADDRESS`` (Ray tasks), None
    without either; and the client/session to close."""
    if getattr(args, "scheduler", None) and getattr(args, "ray", None):
        raise SystemExit(f"pageset {args.command}: give --scheduler (Dask) or --ray (Ray), not both")
    if getattr(args, "ray", None):
        return _ray_executor(args)
    if not getattr(args, "scheduler", None):
        return None, None
    try:
        from dask.distributed import Client
    except ImportError:
        raise SystemExit(f"pageset {args.command}: --scheduler needs Dask: pip install 'pageset[dask]'") from None
    try:
        client = Client(args.scheduler, timeout=SCHEDULER_TIMEOUT_S)
    except OSError as exc:  # refused, unknown host, timed out (distributed raises OSError subclasses)
        raise SystemExit(f"pageset {args.command}: --scheduler {args.scheduler}: cannot reach the Dask scheduler "
                         f"({exc}); check the address (tcp://HOST:8786) and that the scheduler runs") from None
    return client.get_executor(), client


def _storage_options(args) -> dict | None:
    if not getattr(args, "storage_options", None):
        return None
    try:
        opts = json.loads(args.storage_options)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"pageset {args.command}: --storage-options must be a JSON object, e.g. "
                         f"'{{\"endpoint_url\": \"http://...\"}}' ({exc})") from None
    if not isinstance(opts, dict):
        raise SystemExit(f"pageset {args.command}: --storage-options must be a JSON object")
    return opts


def _is_pageset_file(path: str) -> bool:
    """A local file that starts with the pageset magic bytes."""
    if is_url(path):
        return False
    try:
        with open(local_path(path), "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def _is_source(path: str) -> bool:
    """An existing local folder or non-empty file that is not a pageset file: something to convert, never an
    output a writer may replace."""
    if is_url(path):
        return False
    local = local_path(path)
    return os.path.isdir(local) or (os.path.isfile(local) and os.path.getsize(local) > 0
                                    and not _is_pageset_file(local))


def _argument_order(args, usage: str) -> str | None:
    """Put ``args.output`` / ``args.source`` in their places; an error message, or None.

    The order is OUTPUT SOURCE. The deprecated SOURCE OUTPUT order is recognised when the first argument is a
    source (an existing folder or a file that is not a pageset file) and the second is not (a missing path, a
    pageset file, a URL): it is swapped back, with a message on stderr. A SOURCE that is a pageset file means
    swapped arguments (or a file that should be merged): refused before any work.
    """
    if _is_source(args.output) and not _is_source(args.source):
        args.output, args.source = args.source, args.output
        print(f"pageset {args.command}: deprecated argument order SOURCE OUTPUT, read as `pageset {args.command} "
              f"{args.output} {args.source}`: the output comes first (`{usage}`, as in `pageset merge` and "
              "every Python writer); the old order will be removed", file=sys.stderr)
    if _is_pageset_file(args.source):
        return (f"the SOURCE {args.source} is a pageset file: the arguments look swapped; the order is `{usage}` "
                "(to concatenate pageset files: pageset merge OUTPUT INPUTS...)")
    return None


def cmd_convert(args) -> int:
    error = _argument_order(args, "pageset convert OUTPUT SOURCE")
    if error is not None:
        print(f"pageset convert: {error}", file=sys.stderr)
        return 1
    image = RGBImage(max_resolution=args.max_resolution, encoding=args.encoding, jpeg_quality=args.jpeg_quality,
                     jpeg_subsampling=args.jpeg_subsampling, jpeg_passthrough=args.jpeg_passthrough,
                     jpeg_draft=args.jpeg_draft, jpeg_restart=args.jpeg_restart)
    try:  # before any work
        check_not_input(args.output, [args.source])
        check_replaceable(args.output, "pageset convert OUTPUT SOURCE", _storage_options(args))
    except ValueError as exc:
        print(f"pageset convert: {exc}", file=sys.stderr)
        return 1
    executor, client = _executor(args)
    try:
        if os.path.isdir(args.source):
            source, fields = args.source, {"image": image, "label": Int()}
        elif os.path.isfile(args.source):
            source = ImageList(args.source)  # relative paths: relative to the list file's folder
            fields = {"image": image, "label": Int()} if source.labelled else {"image": image}
        else:
            print(f"pageset convert: {args.source}: no such directory or file list", file=sys.stderr)
            return 2
        result = write_dataset(args.output, source, fields, num_workers=args.num_workers, page_size=args.page_size,
                               progress=not args.no_progress, on_error=args.on_error, executor=executor,
                               chunk_size=args.chunk_size, shard_dir=args.shard_dir,
                               storage_options=_storage_options(args))
    except SampleError as exc:  # the message once; the worker's traceback is for the Python API, not the CLI
        print(f"pageset convert: {exc.brief}", file=sys.stderr)
        if args.on_error == "raise":
            print("pageset convert: to leave bad samples out instead, rerun with --on-error skip (their indices "
                  "and errors are recorded in the file; `pageset inspect` lists them)", file=sys.stderr)
        return 1
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"pageset convert: {exc}", file=sys.stderr)
        return 1
    finally:
        if client is not None:
            client.close()
    rate = result.records / result.seconds if result.seconds else float("inf")
    print(f"wrote {result.path}: {_n(result.records, 'record')}, {len(result.skipped)} skipped, "
          f"{result.bytes / 1e6:.1f} MB in {result.seconds:.1f} s ({rate:.0f} samples/s), id {result.dataset_id[:16]}")
    if result.skipped:
        print(f"skipped sample indices: {list(result.skipped)[:50]}")
    return 0


def cmd_convert_text(args) -> int:
    from .write.tokens import write_tokens

    error = _argument_order(args, "pageset convert-text OUTPUT SOURCE --tokenizer TOKENIZER")
    if error is not None:
        print(f"pageset convert-text: {error}", file=sys.stderr)
        return 1
    tokenizer = (args.tokenizer, args.merges) if args.merges else args.tokenizer
    try:
        check_not_input(args.output, [args.source])
        check_replaceable(args.output, "pageset convert-text OUTPUT SOURCE --tokenizer TOKENIZER",
                          _storage_options(args))
    except ValueError as exc:
        print(f"pageset convert-text: {exc}", file=sys.stderr)
        return 1
    executor, client = _executor(args)
    try:
        r = write_tokens(args.output, args.source, tokenizer, eos_id=args.eos_id, bos_id=args.bos_id,
                         dtype=args.dtype, num_workers=args.num_workers, progress=not args.no_progress,
                         text_key=args.text_key, separator=args.separator, page_size=args.page_size,
                         executor=executor, shard_dir=args.shard_dir, storage_options=_storage_options(args))
    except (ValueError, TypeError, RuntimeError, ImportError, OSError) as exc:
        print(f"pageset convert-text: {exc}", file=sys.stderr)
        return 1
    finally:
        if client is not None:
            client.close()
    print(f"wrote {r.path}: {_n(r.documents, 'document')}, {_n(r.tokens, 'token')} ({r.dtype}), {r.bytes / 1e6:.1f} MB in "
          f"{r.seconds:.1f} s ({r.tokens / max(r.seconds, 1e-9) / 1e6:.2f} M tokens/s), id {r.dataset_id[:16]}")
    return 0


def cmd_merge(args) -> int:
    from .merge import merge_datasets

    missing = [p for p in args.inputs if not is_url(p) and not os.path.exists(local_path(p))]
    if missing:
        swapped = (missing == args.inputs[-1:] and _is_pageset_file(args.output))
        hint = (": the arguments look swapped; the output comes first: pageset merge OUTPUT INPUTS..." if swapped
                else "")
        print(f"pageset merge: input {missing[0]}: no such file{hint}", file=sys.stderr)
        return 1
    try:
        r = merge_datasets(args.output, args.inputs, progress=not args.no_progress,
                           storage_options=_storage_options(args))
    except ValueError as exc:
        print(f"pageset merge: {exc}", file=sys.stderr)
        return 1
    count = (f"{_n(r.documents, 'document')}, {_n(r.tokens, 'token')}" if hasattr(r, "tokens")
             else _n(r.records, "record"))
    print(f"wrote {r.path}: {count} from {_inputs(args.inputs, _storage_options(args))}, {r.bytes / 1e6:.1f} MB in "
          f"{r.seconds:.1f} s, id {r.dataset_id[:16]}")
    return 0


def _inputs(inputs, storage_options) -> str:
    """``"2 files"``, ``"1 file and 1 many-file set (3 members)"``: what merge read."""
    from .read.set_manifest import many_file_members

    members = [len(many_file_members(p if not is_url(p) or p.endswith("/") else p + "/", storage_options).paths)
               for p in inputs if _many(p, storage_options)]
    files = len(inputs) - len(members)
    parts = [_n(files, "file")] if files else []
    if members:
        parts.append(f"{_n(len(members), 'many-file set')} ({_n(sum(members), 'member')})")
    return " and ".join(parts)


def _many(path: str, storage_options=None) -> bool:
    from .read.set_manifest import is_many_file, manifest_exists

    return is_many_file(path) or (is_url(path) and manifest_exists(path, storage_options))


def cmd_clean(args) -> int:
    from .write.output import remove_stale_temps

    if os.path.isdir(local_path(args.path)) or (is_url(args.path) and _many(args.path, _storage_options(args))):
        from .write.members import clean_set
        from .write.setlock import SetBusyError

        try:
            report = clean_set(args.path.rstrip("/"), _storage_options(args), every_host=args.all_hosts)
        except SetBusyError as exc:  # a write holds the set's lock: its members and temp files are its own
            print(f"{exc}: nothing removed (run `pageset clean` again once it has finished)")
            return 0
        for name in report.removed:
            print(f"removed {name}")
        for path in report.retired:
            print(f"removed {path} (a replaced manifest no reader holds any more)")
        for generation, members in report.kept:
            print(f"{args.path}: generation {generation} ({_n(members, 'member')}) kept: a reader still has it open "
                  "(a Loader or open_dataset of the set before it was replaced); clean again once it is closed")
        removed = report.removed
        print(f"{args.path}: {_n(len(removed), 'stray member or temp file', 'stray members and temp files')} "
              "removed (files the current manifest does not list)")
        return 0
    removed = remove_stale_temps(args.path, every_host=args.all_hosts)
    for name in removed:
        print(f"removed {name}")
    what = _n(len(removed), "left-over temp file or shard folder", "left-over temp files and shard folders")
    print(f"{args.path}: {what} removed")
    return 0


_n = plural  # '1 document', '2 documents'


def cmd_inspect(args) -> int:
    from .report import inspect

    opts = _storage_options(args)
    return inspect(args.path, opts, args.json, many=_many(args.path, opts))


def cmd_verify(args) -> int:
    from .report import verify

    opts = _storage_options(args)
    return verify(args.path, opts, many=_many(args.path, opts))


def version() -> str:
    """``pageset.__version__``: the installed version (package metadata), "0+unknown" from a source tree."""
    import pageset

    return pageset.__version__


class _Int:
    """An argparse ``type=``: an int in ``[minimum, maximum]`` (``power_of_two``: also a power of two), else an
    ``ArgumentTypeError`` that argparse prints as ``argument --OPTION: must be ..., got 'VALUE'`` (exit status 2),
    before any work. ``valid`` is that range in words."""

    def __init__(self, minimum: int, maximum: int | None = None, power_of_two: bool = False):
        self.minimum, self.maximum, self.power_of_two = minimum, maximum, power_of_two
        bounds = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        self.valid = f"a power of two {bounds}" if power_of_two else f"an int {bounds}"
        self.__name__ = "int"  # argparse's name for the type, in its own messages

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if (value is None or value < self.minimum or (self.maximum is not None and value > self.maximum)
                or (self.power_of_two and value & (value - 1))):
            raise argparse.ArgumentTypeError(f"must be {self.valid}, got {text!r}")
        return value


_at_least_one = _Int(1)
_workers = _Int(0, MAX_WORKERS)  # 0: in this process
_warmup_workers = _Int(1, MAX_WORKERS)
_page_size = _Int(MIN_PAGE_SIZE, MAX_PAGE_SIZE, power_of_two=True)  # formats/v1.md
_token_id = _Int(0, int(np.iinfo(np.uint32).max))  # the tokenizer's vocabulary and the dtype are checked later


def cmd_warmup(args) -> int:
    from .warmup import cache_dirs, warmup  # torch and numba: loaded only for this command

    if args.print_cache_dir:
        print("\n".join(cache_dirs()) or "none (no writable cache location: kernels compile in each process)")
        return 0
    where = " and ".join(cache_dirs()) or "no cache"
    print(f"pageset warmup: compiling the Loader's Numba kernels into {where} ...", flush=True)
    res = warmup(args.num_workers, log=None if args.quiet else print)
    if not res.cache_dirs:
        print("pageset warmup: numba found no writable cache location, so nothing was kept; set NUMBA_CACHE_DIR "
              "to a writable folder (the same one for training)", file=sys.stderr)
        return 1
    print(f"pageset warmup: done in {res.seconds:.1f} s; kernels cached in {' and '.join(res.cache_dirs)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    head, _, examples = __doc__.partition("\n")
    p = argparse.ArgumentParser(prog="pageset", description=head, epilog="examples:\n" + examples.strip("\n"),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"pageset {version()} (file format "
                   f"{FORMAT_MAJOR}.{FORMAT_MINOR})")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="ImageFolder directory or image-path list -> pageset file")
    c.add_argument("output", help="output file or URL, e.g. train.pageset")
    c.add_argument("source", help="ImageFolder directory (root/<class>/<image>) or a text file of image paths")
    c.add_argument("--max-resolution", type=_at_least_one, default=None, help="shrink so the longer side is at most this")
    c.add_argument("--encoding", choices=["jpeg", "raw", "auto"], default="jpeg")
    c.add_argument("--jpeg-quality", type=_Int(1, 100), default=90, help="JPEG quality, 1-100")
    c.add_argument("--jpeg-subsampling", choices=["4:4:4", "4:2:2", "4:2:0"], default="4:2:0")
    c.add_argument("--jpeg-passthrough", action="store_true",
                   help="store JPEG inputs as they are when no conversion is needed (no re-encoding)")
    c.add_argument("--no-jpeg-draft", dest="jpeg_draft", action="store_false",
                   help="decode every JPEG in full before shrinking (default: a large JPEG is decoded at a reduced "
                        "DCT scale that keeps >= 2x max_resolution)")
    c.add_argument("--jpeg-restart", type=_Int(0, 64), default=0, metavar="N",
                   help="restart intervals per MCU row (0: none): the loader then decodes only a crop's intervals")
    c.add_argument("--num-workers", type=_workers, default=None,
                   help="encoding processes (default: all cores; 0: in this process)")
    c.add_argument("--page-size", type=_page_size, default=DEFAULT_PAGE_SIZE,
                   help=f"bytes per page (a power of two in [{MIN_PAGE_SIZE}, {MAX_PAGE_SIZE}])")
    c.add_argument("--on-error", choices=["raise", "skip"], default="raise")
    c.add_argument("--no-progress", action="store_true")
    _cluster_args(c)
    c.add_argument("--chunk-size", type=_at_least_one, default=None,
                   help="samples per task (default 8 locally, 1024 per shard with --scheduler)")
    c.set_defaults(func=cmd_convert)
    t = sub.add_parser("convert-text", help="text corpus -> token file (tokenize + pack)")
    t.add_argument("output", help="output file or URL, e.g. corpus.pageset")
    t.add_argument("source", help="text file, directory, .jsonl or .parquet")
    t.add_argument("--tokenizer", required=True,
                   help="tokenizer.json, a cl100k_base .tiktoken file, or GPT-2 encoder.json/vocab.json with --merges")
    t.add_argument("--merges", default=None, help="vocab.bpe / merges.txt for a GPT-2-style BPE")
    t.add_argument("--eos-id", type=_token_id, default=None)
    t.add_argument("--bos-id", type=_token_id, default=None)
    t.add_argument("--dtype", choices=["auto", "uint16", "uint32"], default="auto")
    t.add_argument("--text-key", default="text", help="JSONL key / Parquet column")
    t.add_argument("--separator", default=None, help="split text files at lines equal to this, e.g. %%")
    t.add_argument("--num-workers", type=_workers, default=None)
    t.add_argument("--page-size", type=_page_size, default=DEFAULT_PAGE_SIZE)
    t.add_argument("--no-progress", action="store_true")
    _cluster_args(t)
    t.set_defaults(func=cmd_convert_text)
    m = sub.add_parser("merge", help="concatenate pageset files with one schema into one file")
    m.add_argument("output", help="output file or URL, e.g. all.pageset")
    m.add_argument("inputs", nargs="+", help="pageset files (or URLs) with one schema, in this order; a many-file "
                   "set's folder (or URL prefix) stands for its members, in manifest order")
    m.add_argument("--storage-options", default=None,
                   help="JSON fsspec options for every URL: the output and URL inputs")
    m.add_argument("--no-progress", action="store_true")
    m.set_defaults(func=cmd_merge)
    k = sub.add_parser("clean", help="remove temp files and shard folders left by killed writes of PATH (a "
                       "many-file dataset's folder: the members its manifest does not list)")
    k.add_argument("path")
    k.add_argument("--storage-options", default=None, help="JSON object for a URL's fsspec filesystem")
    k.add_argument("--all-hosts", action="store_true",
                   help="also those of writers on other hosts (make sure none is still running); a many-file set's "
                        "folder is locked by its writer wherever the file system has locks")
    k.set_defaults(func=cmd_clean)
    i = sub.add_parser("inspect", help="print header, schema, counts, sizes, dataset id and lineage")
    i.add_argument("path", help="a pageset file or URL (s3://bucket/key, https://...), or a many-file dataset's folder")
    i.add_argument("--storage-options", default=None, help="JSON object for the URL's fsspec filesystem")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(func=cmd_inspect)
    v = sub.add_parser("verify", help="check every checksum, page by page")
    v.add_argument("path", help="a pageset file or URL (s3://bucket/key, https://...), or a many-file dataset's folder")
    v.add_argument("--storage-options", default=None, help="JSON object for the URL's fsspec filesystem")
    v.set_defaults(func=cmd_verify)
    w = sub.add_parser("warmup", help="compile the Loader's Numba kernels into the on-disk cache, then exit",
                       description="Compile every Numba kernel the Loader uses into numba's on-disk cache, so that "
                       "later processes start without compiling (run it after pip install, e.g. in a Dockerfile). "
                       "The cache is NUMBA_CACHE_DIR when set, else __pycache__ next to pageset's modules "
                       "(two folders: pageset/ops/__pycache__ and pageset/order/__pycache__, when writable), else "
                       "a user cache folder (again one per package).")
    w.add_argument("--num-workers", type=_warmup_workers, default=None,
                   help="processes compiling at once (default: min(2, cores); 1: in this process)")
    w.add_argument("--print-cache-dir", action="store_true",
                   help="print the folders the kernels are cached in (one a line: NUMBA_CACHE_DIR when set, else "
                        "the ops and the order kernels' folders) and exit")
    w.add_argument("--quiet", action="store_true", help="no per-family progress lines")
    w.set_defaults(func=cmd_warmup)
    return p


def _cluster_args(p) -> None:
    p.add_argument("--scheduler", default=None,
                   help="Dask scheduler address (tcp://HOST:8786): encode on that cluster's workers")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="Ray cluster address ('auto' on a node of the cluster, ray://HOST:10001, or 'local' for a "
                        "new local instance): encode as Ray tasks")
    p.add_argument("--shard-dir", default=None,
                   help="folder or URL every worker can reach, for the encoded shards (default: next to OUTPUT)")
    p.add_argument("--storage-options", default=None,
                   help='JSON fsspec options for URLs, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'')


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: temp files are removed, workers joined


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # The command line is an application, so it may own the process's signals: SIGTERM / SIGHUP (what Slurm,
    # Kubernetes and a closed terminal send) unwind like Ctrl-C instead of killing us with a temp file left behind.
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, _terminate)
    try:
        rc = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return rc
    except BrokenPipeError:  # `pageset inspect ... | head`: the reader has what it wanted
        # Python would flush stdout again at exit and print "Exception ignored ... BrokenPipeError": point the
        # descriptor at /dev/null first. Exit status 128 + SIGPIPE, as a Unix tool killed by SIGPIPE, silently.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    except (FormatError, OSError, ImportError) as exc:
        print(f"pageset {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"pageset {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
