"""Many-file token sets (formats/manyfile.md): the source cut into members, one member tokenized and written per
task (worker processes or an executor), the manifest written last; pre-tokenized ids with ``dtype="auto"`` get
the dtype of the whole input (one more pass, or a spill file for a one-shot iterator)."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
from tqdm.auto import tqdm

from ...format.checksum import ALGORITHM
from ...format.fields import Tokens
from ...format.schema import build_schema
from ..documents import _file_documents, _source_files, iter_documents
from ..disk import DiskFile
from ..output import is_url, local_path
from ..ranges import check_picklable, pickled_once, unpickled
from .encoding import _chunks, _encode_chunk, _init_worker
from .file import TokenFileWriter, TokenWriteResult
from .ids import UINT16_MAX, check_ids_fit, doc_offsets, id_limit


def _file_sizes(files: list[str], storage_options: dict | None) -> list[int]:
    if files and is_url(files[0]):
        from fsspec.core import url_to_fs

        fs, _ = url_to_fs(files[0], **dict(storage_options or {}))
        return [int(fs.size(url_to_fs(f, **dict(storage_options or {}))[1])) for f in files]
    return [os.path.getsize(local_path(f)) for f in files]


def member_cuts(source, files, sizes, member_bytes, docs_per_member, text_key, separator, storage_options):
    """Yield each member's input in order: a list of files (path sources) or of documents (in-memory ones). A
    pure function of the source and the settings (spec: formats/manyfile.md, section 6)."""
    if files is not None:
        if docs_per_member is not None:
            raise ValueError("docs_per_member needs an in-memory source (documents are counted as they are read); "
                             "for files use member_bytes= (input bytes per member)")
        group, total = [], 0
        for f, size in zip(files, sizes):
            group.append(f)
            total += size
            if total >= member_bytes:
                yield group
                group, total = [], 0
        if group:
            yield group
        return
    group, total = [], 0
    for d in iter_documents(source, text_key=text_key, separator=separator, storage_options=storage_options):
        group.append(d)
        total += len(d.encode("utf-8")) if isinstance(d, str) else 4 * len(d)
        if (docs_per_member is not None and len(group) >= docs_per_member) or (
                member_bytes is not None and total >= member_bytes):
            yield group
            group, total = [], 0
    if group:
        yield group


def write_token_member(folder: str, name: str, item: list, first_doc: int, spec, bos_id, eos_id, dtype: str,
                       text_key: str, separator, page_size: int, chunk_docs: int, chunk_chars: int, info: dict,
                       metadata, record_lineage: bool, storage_options, policy,
                       fix: str = "use dtype='uint32'") -> dict:
    """Task: tokenize one member's input (a list of files, or of documents numbered from ``first_doc``) into the
    complete token file ``folder/name`` (visible by rename or a completed upload). ``spec``: the tokenizer, a
    ``pickled_once`` reference to it, or None in a forked worker (the pool's). Returns the member's summary
    (:func:`pageset.write.members.summary`), or ``{"empty": True}`` when it holds no document. ``fix``: what
    the error for an id that does not fit ``dtype`` tells the user to do."""
    from .. import members as M

    if isinstance(spec, tuple):  # an executor's worker process (a forked pool's initializer sets it there)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        spec = unpickled(spec)
    files = not isinstance(item, _Docs)
    docs = (d for f in item for d in _file_documents(f, text_key, separator, storage_options)) if files else item
    limit = id_limit(dtype)
    url = M.join(folder, name)
    writer, lengths, max_id = None, [], -1
    try:
        for start, chunk in _chunks(docs, chunk_docs, chunk_chars):
            flat, lens, _, _ = _encode_chunk(first_doc + start, chunk, bos_id, eos_id, spec)
            max_id = max(max_id, check_ids_fit(flat, lens, first_doc + start, limit, dtype, fix, where=f"{url}: "))
            writer = writer or TokenFileWriter(url, dtype, page_size, storage_options, policy)
            writer.write(flat)
            lengths.append(lens)
        if writer is None:
            return {"empty": True, "name": name}
        lens = np.concatenate(lengths)
        offsets = doc_offsets(lens)
        r = writer.finish(offsets, dict(info, max_id=max_id), metadata, time.perf_counter(), record_lineage)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    pages = -(-r.tokens * np.dtype(dtype).itemsize // page_size)
    return M.summary(name, writer.schema, r.dataset_id, r.bytes, pages, tokens=r.tokens, documents=r.documents)


class _Docs(list):
    """A member's documents (a list that is never taken for a list of file names)."""


class _SpilledDocs:
    """Pre-tokenized documents of a one-shot iterator (a generator) kept as uint32 in a temp file (``TMPDIR``),
    so that they can be read twice: once for the largest id, once to write the members. Iterating yields each
    document again (a uint32 array); ``remove()`` deletes the file."""

    def __init__(self):
        fd, self.name = tempfile.mkstemp(prefix="pageset-spill-")
        try:
            self.f = DiskFile(fd, "wb", self.name, "the spill file of pre-tokenized documents (kept until the "
                              "largest id is known)", "another temp folder (TMPDIR)")
        except BaseException:
            os.close(fd)
            os.unlink(self.name)
            raise
        self.lengths: list[int] = []

    def add(self, arr: np.ndarray) -> None:
        self.f.write(np.ascontiguousarray(arr, dtype="<u4").tobytes())
        self.lengths.append(int(arr.size))

    def __iter__(self):
        self.f.flush()
        with open(self.name, "rb") as f:
            for n in self.lengths:
                yield np.frombuffer(f.read(4 * n), dtype="<u4")

    def remove(self) -> None:
        self.f.discard()
        try:
            os.unlink(self.name)
        except FileNotFoundError:
            pass


def _largest_pre_tokenized_id(source, bos_id, eos_id, chunk_docs: int, chunk_chars: int, text_key: str, separator,
                              storage_options):
    """``(largest id with BOS/EOS, source to read again, spill or None)`` for pre-tokenized documents: one pass
    over ``source``, each document checked as a member task checks it (errors name the document index). A source
    that can be iterated again (a list, an HF Dataset) is read again; a one-shot iterator is spilled to a temp
    file (the returned :class:`_SpilledDocs`, which the caller removes)."""
    spill = _SpilledDocs() if iter(source) is source else None
    try:
        largest = -1
        docs = iter_documents(source, text_key=text_key, separator=separator, storage_options=storage_options)
        for start, chunk in _chunks(docs, chunk_docs, chunk_chars):
            flat, _, _, _ = _encode_chunk(start, chunk, bos_id, eos_id, None)
            if flat.size:
                largest = max(largest, int(flat.max()))
            if spill is not None:
                for d in chunk:
                    spill.add(np.asarray(d))
    except BaseException:
        if spill is not None:
            spill.remove()
        raise
    return largest, (spill if spill is not None else source), spill


def _token_schema(info: dict, dtype: str, page_size: int) -> dict:
    schema = build_schema({"tokens": Tokens(dtype)}, {}, {"page_size": page_size, "checksum": ALGORITHM})
    schema["tokens"] = dict(info, dtype=dtype)
    return schema


def _write_token_members(folder, source, spec, info, dtype, page_size, progress, text_key, separator, chunk_docs,
                         chunk_chars, metadata, record_lineage, num_workers, executor, storage_options, policy,
                         member_bytes, docs_per_member, append, t0) -> TokenWriteResult:
    """``dtype`` None (pre-tokenized ids, ``dtype="auto"``): an append takes the set's; a new set the single
    file's rule over the whole input (uint16 iff its largest id fits), the same for every member."""
    from .. import members as M

    fix, spill = "use dtype='uint32'", None
    if dtype is None and append:
        current = M.read_manifest(folder, storage_options)
        if current is not None and current.kind == "tokens":
            dtype = current.schema["tokens"]["dtype"]
            fix = (f"the set stores {dtype} (an append keeps the set's dtype): rewrite the set with "
                   "dtype='uint32' to hold larger ids")
    schema = _token_schema(info, dtype or "uint32", page_size)  # dtype None: a new set, no schema to compare
    call = "write_tokens(path, source, tokenizer, member_bytes=...)"
    *prepared, lock = M.prepare_folder(folder, storage_options, "tokens", schema, append, call)
    with lock:  # the set's writer lock (formats/manyfile.md section 9), released however the write ends
        previous, generation, kept = prepared
        try:
            if dtype is None:  # after the folder's checks, before any member is written
                try:
                    largest, source, spill = _largest_pre_tokenized_id(source, info["bos_id"], info["eos_id"],
                                                                       chunk_docs, chunk_chars, text_key, separator,
                                                                       storage_options)
                except BaseException:
                    M.abandon(folder, storage_options, previous)
                    raise
                dtype = "uint16" if largest <= UINT16_MAX else "uint32"
                schema = _token_schema(info, dtype, page_size)
            return _write_members_of(folder, source, spec, info, dtype, schema, previous, generation, kept,
                                     page_size, progress, text_key, separator, chunk_docs, chunk_chars, metadata,
                                     record_lineage, num_workers, executor, storage_options, policy, member_bytes,
                                     docs_per_member, t0, fix)
        finally:
            if spill is not None:
                spill.remove()


def _write_members_of(folder, source, spec, info, dtype, schema, previous, generation, kept, page_size, progress,
                      text_key, separator, chunk_docs, chunk_chars, metadata, record_lineage, num_workers, executor,
                      storage_options, policy, member_bytes, docs_per_member, t0, fix) -> TokenWriteResult:
    """_write_token_members' work, under the set's writer lock, with the folder as prepare_folder found it."""
    from .. import members as M

    files = _source_files(source, storage_options)
    if files is not None and not files:
        raise ValueError(f"{os.fspath(source)}: no files: nothing to write")
    if files is not None and member_bytes is None:
        raise ValueError("docs_per_member needs an in-memory source (documents are counted as they are read); "
                         "for files use member_bytes= (input bytes per member)")
    sizes = _file_sizes(files, storage_options) if files is not None else None
    if executor is not None:
        check_picklable(spec, "the tokenizer", executor)
        spec_arg = pickled_once(spec, executor)
    else:
        spec_arg = spec if num_workers == 0 else None
    firsts = {"docs": 0}

    def tasks():
        for k, group in enumerate(member_cuts(source, files, sizes, member_bytes, docs_per_member, text_key,
                                              separator, storage_options)):
            item = group if files is not None else _Docs(group)
            first = firsts["docs"]
            if files is None:
                firsts["docs"] += len(group)
            yield (folder, M.member_name(generation, k), item, first, spec_arg, info["bos_id"], info["eos_id"],
                   dtype, text_key, separator, page_size, chunk_docs, chunk_chars, info, metadata, record_lineage,
                   storage_options, policy, fix)

    died = ("a tokenizer worker process died (killed or out of memory); no manifest was written. Retry with "
            "num_workers=0 to see the error in this process.")
    results = M.run_tasks(write_token_member, tasks(), num_workers, executor, _init_worker, (spec,), died)
    done = []
    bar = tqdm(disable=not progress, desc="pageset tokens", unit="member", leave=False)
    try:
        try:
            for s in results:
                if not s.get("empty"):
                    done.append(s)
                bar.update(1)
        finally:
            bar.close()
            results.close()
        manifest = M.finish(folder, "tokens", schema, page_size, previous, generation, kept, done, storage_options,
                            policy)
    except BaseException:
        M.abandon(folder, storage_options, previous)
        raise
    return TokenWriteResult(folder, manifest.documents, manifest.tokens, dtype, manifest.dataset_id,
                            sum(m.bytes for m in manifest.members), time.perf_counter() - t0,
                            tuple(s["name"] for s in done))
