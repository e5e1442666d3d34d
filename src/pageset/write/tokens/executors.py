"""Token writes on an executor (processes, Dask, Ray: any ``concurrent.futures.Executor``): tasks tokenize files
or chunks of documents into shards; the assembly streams the shards in order into one token file."""

from __future__ import annotations

import os

import numpy as np
from tqdm.auto import tqdm

from ..documents import _file_documents, _source_files, iter_documents
from ..pool import executor_map
from ..ranges import Shard, check_picklable, new_shard_folder, pickled_once, remove_shard_folder, shard_name, \
    unpickled, write_shard
from .encoding import _chunks, _encode_chunk
from .file import TokenFileWriter
from .ids import SPILL_CHUNK, UINT16_MAX, check_ids_fit, doc_offsets


def tokenize_to_shard(url: str, docs_or_file, start: int, spec_ref, bos_id, eos_id, text_key: str,
                      separator: str | None, storage_options: dict | None) -> dict:
    """Executor task: tokenize one file (a path) or a chunk of documents (numbered from ``start``) into a shard
    at ``url``: arrays ``lengths`` (int64 per document) and ``ids`` (uint32). Returns ``{"url", "bytes",
    "documents", "tokens", "max_id"}``. ``spec_ref``: the tokenizer from ``ranges.pickled_once``, unpickled
    once per worker process. A pure function of its arguments: a retry rewrites the same bytes."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # this worker process only
    spec = unpickled(spec_ref)
    if isinstance(docs_or_file, str):
        try:
            docs = list(_file_documents(docs_or_file, text_key, separator, storage_options))
            flat, lengths, _, _ = _encode_chunk(0, docs, bos_id, eos_id, spec)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{docs_or_file}: {exc}") from exc
    else:
        flat, lengths, _, _ = _encode_chunk(start, docs_or_file, bos_id, eos_id, spec)
    size = write_shard(url, {"kind": "tokens", "documents": int(lengths.size), "tokens": int(flat.size)},
                       [("lengths", lengths.astype("<i8")), ("ids", flat.astype("<u4"))], storage_options)
    return {"url": url, "bytes": size, "documents": int(lengths.size), "tokens": int(flat.size),
            "max_id": int(flat.max()) if flat.size else -1}


def _write_tokens_on(executor, path, source, spec, info, direct, limit, page_size, progress, text_key, separator,
                     chunk_docs, chunk_chars, metadata, record_lineage, shard_dir, storage_options, t0,
                     policy=None):
    """write_tokens on an executor: tasks write shards; the assembly streams them in order into one file."""
    files = _source_files(source, storage_options)
    if files is not None:
        if not files:
            raise ValueError(f"{os.fspath(source)}: no files: nothing to write")
        items = [(k, k + 1, f) for k, f in enumerate(files)]
    else:
        items = ((start, start + len(docs), docs) for start, docs in
                 _chunks(iter_documents(source, text_key=text_key, separator=separator,
                                        storage_options=storage_options), chunk_docs, chunk_chars))
    check_picklable(spec, "the tokenizer", executor)
    spec_ref = pickled_once(spec, executor)
    folder = new_shard_folder(path, shard_dir, storage_options)
    tasks = ((shard_name(folder, a, b), item, a, spec_ref, info["bos_id"], info["eos_id"], text_key, separator,
              storage_options) for a, b, item in items)
    results = executor_map(executor, tokenize_to_shard, tasks, ahead=64)
    bar = tqdm(total=len(files) if files is not None else None, disable=not progress, desc="pageset tokens",
               unit="file" if files is not None else "doc", leave=False)
    writer = None
    try:
        done: list[dict] = []
        docs_before = 0
        for summary in results:
            if summary["max_id"] > limit:
                _raise_too_large(summary, docs_before, limit, direct, storage_options)
            summary["first_doc"] = docs_before
            docs_before += summary["documents"]
            done.append(summary)
            if direct:  # the dtype is known: stream this shard now
                writer = writer or TokenFileWriter(path, direct, page_size, storage_options, policy)
                summary["lengths"] = _copy_shard(summary, writer, storage_options)
            bar.update(1 if files is not None else summary["documents"])
        bar.close()
        if docs_before == 0:
            raise ValueError("the source holds no documents: nothing to write")
        max_id = max(s["max_id"] for s in done)
        if writer is None:
            writer = TokenFileWriter(path, "uint16" if max_id <= UINT16_MAX else "uint32", page_size,
                                     storage_options, policy)
            for summary in done:
                summary["lengths"] = _copy_shard(summary, writer, storage_options)
        lengths = np.concatenate([s["lengths"] for s in done])
        offsets = doc_offsets(lengths)
        return writer.finish(offsets, dict(info, max_id=max_id), metadata, t0, record_lineage)
    except BaseException:
        bar.close()
        if writer is not None:
            writer.abort()
        raise
    finally:
        results.close()  # cancels and waits for tasks in flight before their folder goes
        remove_shard_folder(folder, storage_options)


def _copy_shard(summary: dict, writer: TokenFileWriter, storage_options) -> np.ndarray:
    """Stream one shard's ids into ``writer``; returns its document lengths (int64)."""
    shard = Shard(summary["url"], storage_options, summary["bytes"])
    try:
        lengths = np.frombuffer(shard.read("lengths"), dtype="<i8")
        left = shard.begin("ids")
        while left:
            n = min(left, SPILL_CHUNK * 4)
            writer.write(np.frombuffer(shard.take(n), dtype="<u4"))
            left -= n
    except BaseException:
        shard.close(check=False)
        raise
    shard.close()
    return lengths


def _raise_too_large(summary, first_doc, limit, direct, storage_options):
    shard = Shard(summary["url"], storage_options)
    try:
        lengths = np.frombuffer(shard.read("lengths"), dtype="<i8")
        ids = np.frombuffer(shard.read("ids"), dtype="<u4")
    finally:
        shard.close(check=False)
    check_ids_fit(ids, lengths, first_doc, limit, direct)  # raises: the shard's max_id is above limit
    raise AssertionError(f"{summary['url']}: max_id {summary['max_id']} > {limit}, but no id is")
