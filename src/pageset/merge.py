"""``merge_datasets``: concatenate finished pageset files with one schema into one file.

The same assembly as ``write_dataset``, fed with the records of existing files instead of encoded ranges: the
result has the bytes that writing the concatenated source would give (``lineage=False``), because pages are
assigned once, in record order. Token files concatenate their streams (document offsets shifted; stored as
uint32 if any input is). An input may be a many-file set (its folder, its manifest, or its URL prefix): it stands
for its members in manifest order, each checked against the manifest, so merging a set gives what merging its
member files gives (the single file of the whole source).

Inputs are opened one at a time (twice: once to check them all, once to copy each), so a set of any number of
members is merged within a few open files.
"""

from __future__ import annotations

import copy
import os
import time
import zlib

import numpy as np
from tqdm.auto import tqdm

from .format import arguments as check
from .format import constants as C
from .format.errors import ChecksumMismatchError, FileChangedError, MemberMismatchError
from .format.manifest import MANIFEST_NAME, schema_difference
from .format.schema import canonical_json
from .read import set_manifest
from .read.open import open_path
from .read.reader import Dataset
from .write.assemble import Assembly
from .write.output import Output, check_not_input, check_output_path, check_replaceable, is_url
from .write.tail import lineage
from .write.tokens import TokenFileWriter, TokenWriteResult
from .write.upload import WritePolicy
from .write.writer import WriteResult, _check_page_size


class _Pages:
    """An input's data area read page by page (``pread``), each page's CRC-32 checked before its bytes are
    copied, so that a damaged input is refused instead of laundered into a file with fresh checksums."""

    def __init__(self, ds: Dataset):
        self.ds, self.ps = ds, ds.page_size
        self.crcs = ds.page_checksums
        self.cache: dict[int, bytes] = {}

    def page(self, k: int) -> bytes:
        data = self.cache.get(k)
        if data is None:
            start = k * self.ps
            data = self.ds._pread(self.ds.data_offset + start, min(self.ps, self.ds.data_length - start))
            if self.crcs is not None and zlib.crc32(data) != int(self.crcs[k]):
                raise self.ds._err(ChecksumMismatchError, "page", self.ds.data_offset + start,
                                   f"page {k} CRC-32 {zlib.crc32(data):08x} != stored {int(self.crcs[k]):08x}; "
                                   "the input is damaged: nothing was merged")
            self.cache = {k: data}  # records come in file order: older pages are not needed again
        return data

    def read(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of the file, inside the data area."""
        rel = offset - self.ds.data_offset
        if length == 0:
            return b""
        first, last = rel // self.ps, (rel + length - 1) // self.ps
        if first == last:
            p = self.page(first)
            return p[rel - first * self.ps:rel - first * self.ps + length]
        parts = [self.page(k) for k in range(first, last + 1)]
        joined = b"".join(parts)
        return joined[rel - first * self.ps:rel - first * self.ps + length]


class _FilePart:
    """The records of one input file as an assembly part: index rows and their payload bytes in order."""

    def __init__(self, ds: Dataset, base: int):
        self.ds = ds
        self.rows = ds.index
        self.start, self.stop = 0, len(ds.index)
        lin = ds.metadata.get("lineage", {})
        self.skipped = [dict(e, index=int(e["index"]) + base) for e in lin.get("skipped_errors", [])]
        logged = {e["index"] for e in self.skipped}
        self.skipped += [{"index": int(i) + base, "field": None, "error": "skipped when the input was written"}
                         for i in lin.get("skipped", []) if int(i) + base not in logged]
        self.skipped.sort(key=lambda e: e["index"])
        self.error = None

    def payloads(self):
        pages = _Pages(self.ds)
        for off, length in zip(self.rows["_offset"].tolist(), self.rows["_length"].tolist()):
            yield pages.read(off, length)


def merge_datasets(path, inputs, *, progress: bool = True, page_size: int | None = None, metadata: dict | None = None,
                   lineage: bool = True, storage_options: dict | None = None, request_timeout: float = 30.0,
                   request_attempts: int = 5):
    """Concatenate the pageset files ``inputs`` (in order) into one file at ``path`` (the output first, like every
    pageset writer).

    Record files must have the same fields (names, kinds, parameters, in order) and the same class list; token
    files the same tokenizer, ``eos_id`` and ``bos_id``. Records keep their order; the merged
    lineage names the inputs' source (once when they agree), sums their source sample counts and shifts the
    skipped indices, so merging the parts of one source gives the file writing the whole source gives
    (byte-identical with ``lineage=False``).

    Args:
        path: output path or fsspec URL (written like ``write_dataset``: temp file + rename, or upload).
        inputs: paths of pageset files (all record files or all token files); a many-file set (its folder, its
            ``pageset.manifest.json``, or its URL prefix) stands for its members in manifest order.
        progress: tqdm bar over records / tokens.
        page_size: output page size; default the first input's.
        metadata: user metadata; default the inputs' when they all carry the same, else none.
        lineage: record when and where the merge ran (``False``: content-only bytes).
        storage_options: fsspec options for every URL: a URL ``path`` and URL ``inputs`` (local paths ignore
            them).
        request_timeout, request_attempts: seconds per request and attempts per request, for URL inputs (as
            :func:`~pageset.open_dataset`) and a URL output (as :func:`~pageset.write_dataset`).

    Returns:
        :class:`~pageset.write.WriteResult` for record files, :class:`~pageset.write.tokens.TokenWriteResult` for
        token files.

    Raises:
        ValueError: fewer than one input, ``path`` among the inputs, an existing ``path`` that is not a pageset
        file, an http(s) ``path`` (read-only), or inputs that differ (names the input and
        the first differing field, class or token setting); TypeError / ValueError for arguments of the wrong
        kind or range (naming the argument); FormatError subclasses for damaged inputs (MemberMismatchError: a
        set's member that is not the file its manifest lists; FileChangedError: an input changed while merged);
        FileNotFoundError for a folder without ``pageset.manifest.json``.
    """
    t0 = time.perf_counter()
    out = check_output_path(path)
    if isinstance(inputs, (str, bytes, os.PathLike)) or not isinstance(inputs, (list, tuple)):
        raise TypeError(f"inputs must be a list of pageset file paths, got {inputs!r}")
    for p in inputs:
        if isinstance(p, bytes) or not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"inputs must hold paths (str or os.PathLike), got {p!r}")
    progress = check.boolean("progress", progress)
    if page_size is not None:
        _check_page_size(page_size)
    metadata = check.mapping("metadata", metadata, optional=True)
    lineage = check.boolean("lineage", lineage)
    storage_options = check.mapping("storage_options", storage_options, optional=True)
    check.json_metadata("metadata", metadata)
    policy = WritePolicy(check.real("request_timeout", request_timeout, low=0, low_open=True),
                         check.integer("request_attempts", request_attempts, minimum=1))
    paths = [os.fspath(p) for p in inputs]
    if not paths:
        raise ValueError("merge_datasets needs at least one input file")
    check_not_input(out, paths)
    check_replaceable(out, "merge_datasets(path, [a, b, ...])", storage_options, policy)
    opened = _open_inputs(out, paths, storage_options, request_timeout, request_attempts)  # closed once checked
    paths = [ds.path for ds in opened]  # a set's members in its place
    kinds = {ds.tokens_info is not None for ds in opened}
    if len(kinds) > 1:
        first_tok = next(p for p, ds in zip(paths, opened) if ds.tokens_info is not None)
        raise ValueError(f"cannot merge token files with record files ({first_tok} is a token file, "
                         f"{paths[0] if opened[0].tokens_info is None else paths[1]} is not)")
    page_size = page_size if page_size is not None else opened[0].page_size
    _check_page_size(page_size)
    if metadata is None:
        users = [ds.metadata.get("user", {}) for ds in opened]
        metadata = users[0] if all(u == users[0] for u in users) else {}
    canonical_json(metadata)
    if opened[0].tokens_info is not None:
        return _merge_tokens(out, paths, opened, page_size, metadata, lineage, storage_options, progress, t0,
                              policy)
    return _merge_records(out, paths, opened, page_size, metadata, lineage, storage_options, progress, t0,
                          policy)


def _open(path: str, storage_options, request_timeout, request_attempts) -> Dataset:
    return Dataset(path, storage_options if is_url(path) else None, request_timeout=request_timeout,
                   request_attempts=request_attempts)


def _open_inputs(out, paths, storage_options, request_timeout, request_attempts) -> list[Dataset]:
    """Each input opened, checked and closed, in order (a closed Dataset keeps its parsed header, schema, index
    and token sections; :func:`_reopen` reads its bytes). A many-file set stands for its members in manifest
    order, each checked against the manifest; a URL that is no object but a set's prefix is that set. A local
    folder without a manifest is refused (FileNotFoundError naming it and the fix), as is an output ``out`` among
    a set's members (ValueError, before they are read)."""
    opened = []
    for p in paths:
        def open_set(p):
            if not is_url(p) and os.path.isdir(p) and not os.path.isfile(os.path.join(p, MANIFEST_NAME)):
                raise FileNotFoundError(
                    f"{p} is a folder without {MANIFEST_NAME}: not a many-file pageset set (or its write has not "
                    f"finished: the manifest is written last); give the pageset files in it as the inputs, e.g. "
                    f"{os.path.join(p, '*.pageset')}")
            return set_manifest.many_file_members(p, storage_options if is_url(p) else None)

        got = open_path(p, storage_options, lambda q: _open(q, storage_options, request_timeout, request_attempts),
                        open_set)
        if not isinstance(got, set_manifest.ManyFileSet):
            got.close()
            opened.append(got)
            continue
        info = got
        check_not_input(out, list(info.paths))
        for k, member in enumerate(info.paths):
            ds = _open(member, storage_options, request_timeout, request_attempts)
            try:
                _check_member(ds, info, k)
            finally:
                ds.close()
            opened.append(ds)
    return opened


def _check_member(ds: Dataset, info, k: int) -> None:
    """MemberMismatchError unless ``ds`` is member ``k`` of the set ``info`` as its manifest lists it."""
    m = info.manifest.members[k]
    where = (f"member {k} of the many-file set {info.folder} (its manifest lists {m.name} with dataset id "
             f"{m.dataset_id[:16]}...)")
    diff = schema_difference(info.manifest.schema, ds.schema)
    if diff is not None:
        raise MemberMismatchError(ds.path, "schema", None, f"the member's schema differs from the set's: {diff}; "
                                  f"{where}; nothing was merged")
    for what, found, want in (("dataset id", ds.dataset_id, m.dataset_id), ("size in bytes", ds.file_size, m.bytes),
                              ("page count", ds.page_count, m.pages)):
        if found != want:
            raise MemberMismatchError(ds.path, "header", None, f"its {what} is {found}, the manifest lists {want}: "
                                      f"the file was replaced or rewritten after the manifest was written; {where}; "
                                      "nothing was merged: restore the member or rewrite the set")


def _reopen(ds: Dataset, storage_options, policy) -> Dataset:
    """``ds`` (checked, then closed) opened again to copy its bytes; FileChangedError when it is no longer the
    file that was checked."""
    policy = policy or WritePolicy()
    again = _open(ds.path, storage_options, policy.timeout, policy.attempts)
    if (again.dataset_id, again.file_size) != (ds.dataset_id, ds.file_size):
        again.close()
        raise FileChangedError(ds.path, "header", None, "the input changed while it was merged (another dataset id "
                               "or size than when it was checked): nothing was merged; merge it again")
    return again


def _describe_field(f: dict) -> str:
    return f"{f['name']!r} ({f['kind']} {f['params']})"


def _check_same_records(paths, opened) -> None:
    first = opened[0].schema
    for p, ds in zip(paths[1:], opened[1:]):
        a, b = first.get("fields", []), ds.schema.get("fields", [])
        for k in range(max(len(a), len(b))):
            fa = a[k] if k < len(a) else None
            fb = b[k] if k < len(b) else None
            if fa != fb:
                raise ValueError(
                    f"{p}: field {k} is {_describe_field(fb) if fb else 'missing'}, but {paths[0]} has "
                    f"{_describe_field(fa) if fa else 'no field there'}; merge needs the same fields in the same "
                    "order (convert both with the same fields=)")
        ca, cb = first.get("attributes", {}).get("class_names"), ds.schema.get("attributes", {}).get("class_names")
        if ca != cb:
            if ca is None or cb is None:
                raise ValueError(f"{p}: class list {cb!r:.80} differs from {paths[0]}'s {ca!r:.80}")
            k = next((i for i, (x, y) in enumerate(zip(ca, cb)) if x != y), min(len(ca), len(cb)))
            left = repr(ca[k]) if k < len(ca) else "nothing"
            right = repr(cb[k]) if k < len(cb) else "nothing"
            raise ValueError(f"{p}: class list differs from {paths[0]}'s at label {k}: {right} vs {left} "
                             f"({len(cb)} vs {len(ca)} classes); labels would mean different classes")
        rest_a = {k: v for k, v in first.get("attributes", {}).items() if k not in ("class_names", "ignored_files")}
        rest_b = {k: v for k, v in ds.schema.get("attributes", {}).items() if k not in ("class_names", "ignored_files")}
        if rest_a != rest_b:
            key = sorted(set(rest_a) ^ set(rest_b) | {k for k in rest_a.keys() & rest_b.keys() if rest_a[k] != rest_b[k]})[0]
            raise ValueError(f"{p}: dataset attribute {key!r} differs from {paths[0]}'s")


def _merged_source(opened) -> tuple[str, list[int]]:
    lins = [ds.metadata.get("lineage", {}) for ds in opened]
    names = [lin.get("source", "unknown source") for lin in lins]
    source = names[0] if all(n == names[0] for n in names) else " + ".join(names)
    return source, [int(lin.get("samples_in_source", len(ds))) for lin, ds in zip(lins, opened)]


def _merge_records(out, paths, opened, page_size, metadata, record_lineage, storage_options, progress, t0,
                   policy=None):
    _check_same_records(paths, opened)
    schema = copy.deepcopy(opened[0].schema)
    schema.setdefault("writer", {})["page_size"] = page_size
    attrs = schema.get("attributes", {})
    if "ignored_files" in attrs:
        attrs["ignored_files"] = sum(int(ds.schema["attributes"].get("ignored_files", 0)) for ds in opened)
    source, counts = _merged_source(opened)
    row_dtype = opened[0].index.dtype
    span_names = [name for name, f in opened[0].fields.items() if not f.inline]
    # a lower bound of the output's size (its header and every record's bytes), known before any work: an S3
    # output above 5 TiB is refused before the upload starts
    least = C.DATA_OFFSET + sum(int(ds.index["_length"].sum(dtype=np.int64)) for ds in opened)
    output = Output(out, storage_options, policy=policy, min_size=least)
    try:
        asm = Assembly(output.f, schema, row_dtype, span_names, page_size, source)
        bar = tqdm(total=sum(len(ds) for ds in opened), disable=not progress, desc="pageset merge", unit="record",
                   leave=False)
        try:
            base = 0
            for ds, n in zip(opened, counts):
                with _reopen(ds, storage_options, policy) as live:
                    asm.add(_FilePart(live, base))
                base += n
                bar.update(len(ds))
        finally:
            bar.close()
        stats = asm.finish(sum(counts), lineage() if record_lineage else {}, metadata)
        output.commit()
    except BaseException:
        output.abort()
        raise
    return WriteResult(output.path, stats["records"], tuple(stats["skipped"]), stats["dataset_id"], stats["bytes"],
                       time.perf_counter() - t0)


def _merge_tokens(out, paths, opened, page_size, metadata, record_lineage, storage_options, progress, t0,
                  policy=None):
    infos = [ds.tokens_info for ds in opened]
    for p, ds in zip(paths, opened):
        if ds.loss_mask_bits is not None:  # merging would drop the mask: refuse rather than train on every token
            raise ValueError(f"{p}: a token file with a loss mask (chat data); merge does not carry masks yet: "
                             "write the conversations into one file with write_tokens(messages_key=...)")
    for p, info in zip(paths[1:], infos[1:]):
        for key in ("eos_id", "bos_id", "tokenizer"):
            if info.get(key) != infos[0].get(key):
                raise ValueError(f"{p}: token setting {key!r} is {info.get(key)!r}, but {paths[0]} has "
                                 f"{infos[0].get(key)!r}; merge needs token files written the same way")
    dtype = "uint32" if any(i["dtype"] == "uint32" for i in infos) else "uint16"
    least = C.DATA_OFFSET + sum(int(i["count"]) for i in infos) * np.dtype(dtype).itemsize  # a lower bound
    writer = TokenFileWriter(out, dtype, page_size, storage_options, policy, min_size=least)
    try:
        lengths = []
        bar = tqdm(total=sum(int(i["count"]) for i in infos), disable=not progress, desc="pageset merge",
                   unit="token", leave=False)
        try:
            for ds, info in zip(opened, infos):
                dt = np.dtype(info["dtype"]).newbyteorder("<")
                with _reopen(ds, storage_options, policy) as live:
                    pages = _Pages(live)
                    for k in range(ds.page_count):  # a page holds whole tokens: page sizes are powers of two
                        block = np.frombuffer(pages.page(k), dtype=dt)
                        writer.write(block)  # widened to uint32 where needed
                        bar.update(block.size)
                lengths.append(np.diff(ds.doc_offsets.astype(np.int64)))
        finally:
            bar.close()
        all_lengths = np.concatenate(lengths)
        offsets = np.zeros(all_lengths.size + 1, dtype=np.uint64)
        np.cumsum(all_lengths, out=offsets[1:])
        info = {k: infos[0].get(k) for k in ("eos_id", "bos_id", "tokenizer")}
        sources = [i.get("source") for i in infos]
        info["source"] = sources[0] if all(s == sources[0] for s in sources) else " + ".join(map(str, sources))
        info["max_id"] = max(int(i.get("max_id", -1)) for i in infos)
    except BaseException:
        writer.abort()
        raise
    result: TokenWriteResult = writer.finish(offsets, info, metadata, t0, record_lineage)
    return result


__all__ = ["merge_datasets"]
