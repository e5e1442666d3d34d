"""``write_tokens``: tokenize a text corpus once and pack it into a pageset token file (format 1.1).

The data area is one flat little-endian stream of token ids: uint16 iff the largest stored id is <= 65535, else
uint32. Every document is followed by ``eos_id``; ``bos_id``, when given, is put before each document unless
the tokenizer already emitted it. The ``doc_offsets`` section holds the u64 token offset of every document start
(0 ... T). Pages are filled back to back (a window may straddle pages; tokens need no record alignment).

Encoding runs in worker processes, chunk by chunk, results consumed in order, so the file's bytes depend on the
input only. ``TOKENIZERS_PARALLELISM=false`` is set in each worker before it encodes (HF tokenizers' own thread
pool would otherwise deadlock or oversubscribe after ``fork``), never in the calling process.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import tempfile
import time
import warnings
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from ..format import arguments as check
from ..format import constants as C
from ..format.checksum import ALGORITHM
from ..format.fields import Tokens
from ..format.schema import build_schema, canonical_json, parse_schema
from .assemble import PageWriter
from .filewriter import (
    MAX_WORKERS,
    Output,
    check_not_input,
    check_output_path,
    check_replaceable,
    DiskFile,
    executor_map,
    is_url,
    local_path,
    lineage,
    ordered_map,
    temp_file,
    write_tail,
)
from .ranges import (
    Shard,
    check_picklable,
    new_shard_folder,
    pickled_once,
    remove_shard_folder,
    shard_name,
    unpickled,
    write_shard,
)
from .chat import ChatEncoder, chat_encoder, check_train_on
from .documents import (  # noqa: F401 (public here too)
    Conversation,
    _file_documents,
    _source_files,
    iter_conversations,
    iter_documents,
)
from .tokenizers import (  # noqa: F401 (public here too: pageset.write.tokens.load_tokenizer, ...)
    CL100K_PAT,
    CL100K_SPECIAL,
    EOS_NAMES,
    TokenizerSpec,
    find_eos,
    load_tokenizer,
)
from .upload import WritePolicy
from .writer import _check_page_size

UINT16_MAX = 65535
UINT32_MAX = 2**32 - 1
SPILL_CHUNK = 1 << 22  # tokens per read when re-packing a uint32 spill file (16 MiB)


# ---- the token file: pages, sections, header (format 1.1) ---------------------------------------------------

@dataclass(frozen=True)
class TokenWriteResult:
    """What a token writer wrote: ``path``, ``documents``, ``tokens`` (count, BOS/EOS included), ``dtype``
    (``"uint16"``/``"uint32"``), ``dataset_id`` (hex SHA-256), ``bytes`` (file size), ``seconds`` (wall time); for
    a many-file set ``path`` is the folder, the counts, id and bytes are the whole set's and ``members`` names the
    member files this call wrote. ``skipped``: the conversations ``on_error="skip"`` left out, where each came from
    (``"chat.jsonl:12"``, ``"chat.parquet: row 3"``, ``"conversation 5"``), in source order."""

    path: str
    documents: int
    tokens: int
    dtype: str
    dataset_id: str
    bytes: int
    seconds: float
    members: tuple = ()
    skipped: tuple = ()


class TokenFileWriter:
    """Writes one token file: ``write(ids)`` appends ids (any integer array, values already checked to fit
    ``dtype``) to the data area; ``finish(doc_offsets, info, user, t0)`` writes schema, page checksums,
    metadata and doc_offsets sections, the section table and the header, fsyncs and renames the temp file over
    ``path`` (or uploads it, for an fsspec URL; see :class:`pageset.write.filewriter.Output`). ``abort()``
    removes the temp file. Nothing exists at ``path`` until ``finish`` succeeds. ``parts`` and ``min_size`` (bytes
    the file will hold at least) go to :class:`~pageset.write.filewriter.Output`."""

    def __init__(self, path: str, dtype: str, page_size: int = C.DEFAULT_PAGE_SIZE,
                 storage_options: dict | None = None, policy=None, parts=None, min_size: int = 0):
        _check_page_size(page_size)
        if dtype not in C.TOKEN_DTYPES:
            raise ValueError(f"dtype must be one of {C.TOKEN_DTYPES}, got {dtype!r}")
        self.path, self.dtype, self.page_size = os.fspath(path), dtype, page_size
        self._le = np.dtype(dtype).newbyteorder("<")
        self.out = Output(self.path, storage_options, policy=policy, parts=parts, min_size=min_size)
        self.path = self.out.path
        self.f = self.out.f
        self.f.seek(C.DATA_OFFSET)
        self.pages = PageWriter(self.f, page_size)
        self.count = 0

    def write(self, ids: np.ndarray) -> None:
        arr = np.ascontiguousarray(ids, dtype=self._le)
        self.pages.write(arr)
        self.count += arr.size

    def abort(self) -> None:
        self.out.abort()

    def finish(self, doc_offsets: np.ndarray, info: dict, user: dict | None, t0: float,
               record_lineage: bool = True, loss_mask: np.ndarray | None = None,
               skipped: list | None = None) -> TokenWriteResult:
        """Write the tail and commit; ``record_lineage=False`` keeps only ``info["source"]`` (and the skipped
        conversations) in the lineage, so the file's bytes depend on its content only. ``loss_mask``:
        ``uint8[count]`` of 0/1 (1 = trained on), stored bit-packed in the ``loss_mask`` section with the
        ``loss_mask`` feature bit; ``info["loss_mask"]`` then describes it (formats/v1.md section 10.1).
        ``skipped``: ``[(number in the source, where, error)]`` of the conversations left out, recorded in the
        lineage as ``skipped`` (the numbers) and ``skipped_errors`` (``{"index", "where", "error"}``)."""
        try:
            return self._finish(np.asarray(doc_offsets, dtype="<u8"), info, user or {}, t0, record_lineage,
                                loss_mask, skipped or [])
        except BaseException:
            self.abort()
            raise

    def _finish(self, offsets, info, user, t0, record_lineage, loss_mask, skipped) -> TokenWriteResult:
        if offsets.size < 2 or offsets[0] != 0 or offsets[-1] != self.count or np.any(offsets[1:] < offsets[:-1]):
            raise ValueError(f"doc_offsets must be non-decreasing from 0 to {self.count} tokens")
        mask_bytes = None
        if loss_mask is not None:
            loss_mask = np.asarray(loss_mask)
            if loss_mask.shape != (self.count,) or (loss_mask.size and loss_mask.max() > 1):
                raise ValueError(f"loss_mask must be {self.count} values of 0 or 1, got shape {loss_mask.shape}")
            if not isinstance(info.get("loss_mask"), dict):
                raise ValueError("a loss_mask needs info['loss_mask'] (train_on, rule, template_sha256)")
            mask_bytes = np.packbits(loss_mask.astype(np.uint8), bitorder="little").tobytes()
        canonical_json(user)  # fail on non-JSON metadata before writing sections
        skip_log = {} if not skipped else {
            "skipped": [k for k, _, _ in skipped],
            "skipped_errors": [{"index": k, "where": w, "error": e} for k, w, e in skipped]}
        f = self.f
        data_length = self.pages.pos
        crcs = self.pages.finish()
        tokens_obj = dict(info, dtype=self.dtype, count=self.count, documents=int(offsets.size - 1))
        schema = build_schema({"tokens": Tokens(self.dtype)}, {}, {"page_size": self.page_size,
                                                                   "checksum": ALGORITHM})
        schema["tokens"] = tokens_obj
        parse_schema(schema)
        self.schema = schema
        schema_bytes = canonical_json(schema)
        index_bytes = b""  # a token file has no records
        crc_bytes = crcs.tobytes()
        offsets_bytes = offsets.tobytes()
        # The dataset id covers the schema (counts, dtype, tokenizer), the page CRCs (every token), the document
        # offsets and the loss mask: the same corpus, tokenizer and settings always give the same id.
        dataset_id = hashlib.sha256(schema_bytes + index_bytes + crc_bytes + offsets_bytes
                                    + (mask_bytes or b"")).digest()
        sections = [
            (C.SECTION_SCHEMA, C.SECTION_FLAG_REQUIRED, schema_bytes),
            (C.SECTION_INDEX, C.SECTION_FLAG_REQUIRED, index_bytes),
            (C.SECTION_PAGE_CHECKSUMS, 0, crc_bytes),
            (C.SECTION_METADATA, 0, canonical_json({"lineage": dict(lineage() if record_lineage else {},
                                                                   source=info.get("source"), **skip_log),
                                                    "user": user})),
            (C.SECTION_DOC_OFFSETS, C.SECTION_FLAG_REQUIRED, offsets_bytes),
        ]
        features = C.REQUIRED_TOKENS
        if mask_bytes is not None:
            sections.append((C.SECTION_LOSS_MASK, C.SECTION_FLAG_REQUIRED, mask_bytes))
            features |= C.REQUIRED_LOSS_MASK
        file_size = write_tail(f, page_size=self.page_size, data_length=data_length, page_count=len(crcs),
                               record_count=0, required_features=features, dataset_id=dataset_id,
                               sections=sections)
        self.out.commit()
        return TokenWriteResult(self.path, int(offsets.size - 1), self.count, self.dtype, dataset_id.hex(),
                                file_size, time.perf_counter() - t0, skipped=tuple(w for _, w, _ in skipped))

# ---- encoding (workers) ------------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(spec) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # this process only; before the first encode
    _WORKER["spec"] = spec


def _encode_chunk(start: int, docs: list, bos_id, eos_id, spec=None, on_error: str = "raise"):
    """Encode ``docs`` (numbered from ``start``): ``(uint32 flat ids with BOS/EOS, int64 lengths, uint8 loss mask
    or None, skipped)``; the mask only for conversations (``spec`` a :class:`~pageset.write.chat.ChatEncoder`), and
    ``skipped`` (``[(document number, where, error)]``) only for conversations with ``on_error="skip"``."""
    spec = spec if spec is not None else _WORKER.get("spec")
    if isinstance(spec, ChatEncoder):
        return _encode_conversations(start, docs, bos_id, eos_id, spec, on_error)
    texts = [(k, d) for k, d in enumerate(docs) if isinstance(d, str)]
    encoded: list = [None] * len(docs)
    if texts:
        if spec is None:
            raise TypeError(f"document {start + texts[0][0]} is text but no tokenizer was given")
        for (k, _), ids in zip(texts, spec.encode_batch([t for _, t in texts]), strict=True):
            encoded[k] = ids
    parts, lengths = [], np.empty(len(docs), dtype=np.int64)
    for k, d in enumerate(docs):
        ids = encoded[k] if encoded[k] is not None else d
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iub"):
            raise TypeError(f"document {start + k}: expected text or a 1-D integer array, got {type(d).__name__} "
                            f"of dtype {arr.dtype} and shape {arr.shape}")
        arr = arr.astype(np.int64, copy=False)
        if arr.size and (arr.min() < 0 or arr.max() > UINT32_MAX):
            raise ValueError(f"document {start + k}: token ids must be in [0, 2^32), got [{arr.min()}, {arr.max()}]")
        head = [bos_id] if bos_id is not None and not (arr.size and arr[0] == bos_id) else []
        piece = np.concatenate([np.asarray(head, np.int64), arr, np.asarray([eos_id], np.int64)])
        parts.append(piece)
        lengths[k] = piece.size
    flat = np.concatenate(parts) if parts else np.empty(0, np.int64)
    return flat.astype(np.uint32), lengths, None, []


SKIP_HINT = ("To leave such conversations out instead, pass on_error='skip' (TokenWriteResult.skipped and the "
             "file's lineage list them).")


def _encode_conversations(start: int, docs: list, bos_id, eos_id, chat: ChatEncoder, on_error: str):
    """Conversations -> ``(uint32 ids, int64 lengths, uint8 mask, skipped)``. The EOS/BOS policy of text documents:
    ``bos_id`` put first unless the template already wrote it, ``eos_id`` appended unless the template already
    ended with it (never twice); both have mask 0 (a separator, not the assistant's). ``on_error="skip"``: a
    conversation that cannot be encoded (its ValueError / TypeError names it) is left out and listed in ``skipped``
    as ``(its number in the source, where, the error)``."""
    parts, masks, lengths, skipped = [], [], [], []
    for k, conv in enumerate(docs):
        if not isinstance(conv, Conversation):
            raise TypeError(f"a chat source yields conversations, got {type(conv).__name__} {conv!r:.40}")
        try:
            if conv.problem is not None:
                raise ValueError(f"{conv.where}: {conv.problem}")
            ids, mask = chat.encode(conv.messages, conv.where)
        except (ValueError, TypeError) as exc:
            if on_error != "skip":
                raise type(exc)(f"{exc}. {SKIP_HINT}") from None
            skipped.append((start + k, conv.where, str(exc)))
            continue
        head = 1 if bos_id is not None and not (ids.size and ids[0] == bos_id) else 0
        tail = 0 if ids.size and ids[-1] == eos_id else 1
        piece = np.empty(head + ids.size + tail, np.int64)
        piece[head : head + ids.size] = ids
        m = np.zeros(piece.size, np.uint8)
        m[head : head + ids.size] = mask
        if head:
            piece[0] = bos_id
        if tail:
            piece[-1] = eos_id
        parts.append(piece)
        masks.append(m)
        lengths.append(piece.size)
    flat = np.concatenate(parts) if parts else np.empty(0, np.int64)
    return (flat.astype(np.uint32), np.asarray(lengths, dtype=np.int64),
            np.concatenate(masks) if masks else np.empty(0, np.uint8), skipped)


def _chunks(docs_iter, chunk_docs: int, chunk_chars: int):
    start, cur, chars = 0, [], 0
    for d in docs_iter:
        if not isinstance(d, str) and (not hasattr(d, "__len__") or isinstance(d, (bytes, dict))):
            raise TypeError(f"document {start + len(cur)}: expected text (str) or a 1-D integer array / list of "
                            f"token ids, got {type(d).__name__} {d!r:.40}; a source is a sequence of documents, "
                            "e.g. [[1, 2, 3], [4, 5]] for pre-tokenized ids, not [1, 2, 3]")
        cur.append(d)
        chars += len(d) if isinstance(d, str) else 4 * len(d)
        if len(cur) >= chunk_docs or chars >= chunk_chars:
            yield start, cur
            start, cur, chars = start + len(cur), [], 0
    if cur:
        yield start, cur


def _encoded_in_order(docs_iter, spec, bos_id, eos_id, num_workers, chunk_docs, chunk_chars, on_error="raise"):
    chunks = _chunks(docs_iter, chunk_docs, chunk_chars)
    if num_workers == 0:
        for start, docs in chunks:
            yield start, len(docs), _encode_chunk(start, docs, bos_id, eos_id, spec, on_error)
        return
    died = ("a tokenizer worker process died (killed or out of memory); nothing was written. Retry with "
            "num_workers=0 to see the error in this process.")
    meta: list = []

    def tasks():
        for start, docs in chunks:
            meta.append((start, len(docs)))
            yield start, docs, bos_id, eos_id, None, on_error

    for k, result in enumerate(ordered_map(_encode_chunk, tasks(), num_workers, _init_worker, (spec,),
                                           2 * num_workers, died)):
        yield meta[k][0], meta[k][1], result


# ---- the writer --------------------------------------------------------------------------------------------

def _no_eos_message(spec) -> str:
    if spec is None:
        return "eos_id is required for pre-tokenized documents (no tokenizer given): pass eos_id=<int>"
    specials = spec.special_tokens or {}
    listed = ", ".join(f"{t!r}: {i}" for t, i in list(specials.items())[:20]) + (" ..." if len(specials) > 20 else "")
    return (f"eos_id is required: tokenizer {spec.name!r} has no end-of-text token under the usual names "
            f"{list(EOS_NAMES)} and no eos attribute; its special tokens are {{{listed}}}; pass eos_id= (and "
            "bos_id= if documents should start with one), e.g. eos_id=<the id of its end-of-text token>")


def _check_id(name: str, value, vocab_size: int | None, dtype: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    limit = vocab_size if vocab_size is not None else UINT32_MAX + 1
    if value >= limit:
        raise ValueError(f"{name}={value} is outside the tokenizer's vocabulary [0, {limit})")
    if dtype == "uint16" and value > UINT16_MAX:
        raise ValueError(f"{name}={value} does not fit dtype='uint16' (max {UINT16_MAX}); use 'uint32' or 'auto'")
    return int(value)


def write_tokens(
    path,
    source,
    tokenizer=None,
    *,
    eos_id: int | None = None,
    bos_id: int | None = None,
    dtype: str = "auto",
    num_workers: int | None = None,
    progress: bool = True,
    text_key: str = "text",
    separator: str | None = None,
    page_size: int = C.DEFAULT_PAGE_SIZE,
    metadata: dict | None = None,
    chunk_docs: int = 512,
    chunk_chars: int = 1 << 20,
    lineage: bool = True,
    executor=None,
    shard_dir: str | None = None,
    storage_options: dict | None = None,
    request_timeout: float = 30.0,
    request_attempts: int = 5,
    member_bytes: int | None = None,
    docs_per_member: int | None = None,
    append: bool = False,
    messages_key: str | None = None,
    chat_template: str | os.PathLike | None = None,
    train_on: tuple = ("assistant",),
    on_error: str = "raise",
) -> TokenWriteResult:
    """Tokenize ``source`` and write one token file at ``path`` (atomically: temp file, fsync, rename).

    With ``messages_key`` the source holds conversations (chat / SFT data): each is rendered with the chat template
    and tokenized as transformers' ``apply_chat_template(..., tokenize=True)`` does, and the file stores a per-token
    loss mask beside the tokens (1 = trained on: the tokens of the ``train_on`` roles; see
    :mod:`pageset.write.chat` for the rule, and formats/v1.md section 10.1).

    Args:
        path: output file (``.pageset`` is conventional), or an fsspec URL (``s3://bucket/corpus.pageset``:
            streamed into one multipart upload while it is written, no local copy, completed only at the end;
            stores other than S3: assembled in the local temp folder, then uploaded); see :func:`write_dataset`.
        source: see :func:`iter_documents`: a file or directory path (text, ``.jsonl``, ``.parquet``), an
            iterable of ``str`` documents, of ``pathlib.Path`` files, or of pre-tokenized integer arrays.
        tokenizer: see :func:`load_tokenizer` (HF Tokenizer / tokenizer.json, GPT-2 ``(encoder.json,
            vocab.bpe)``, tiktoken Encoding / cl100k ``.tiktoken`` file, a callable); ``None`` for pre-tokenized.
        eos_id: separator appended after every document. An explicit value always wins; by default the
            tokenizer's own EOS attribute (``eos_token_id`` of a callable), else the first of its tokens named
            ``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``, ``<eos>``; else ValueError listing its special
            tokens. Validated against the vocabulary before any work. Required without a tokenizer.
        bos_id: optional id put before each document, unless its first id already is ``bos_id`` (never guessed).
        dtype: ``"auto"`` (uint16 iff the largest emitted id <= 65535), ``"uint16"`` or ``"uint32"``.
        num_workers: encoding processes (``None``: ``os.cpu_count()``; 0: this process; at most 1024, ValueError
            beyond). Ignored when ``executor`` is given.
        progress: tqdm bar over documents.
        text_key: the JSONL key / Parquet column holding the text.
        separator: split text files at lines equal to this (``"%"`` for fortune files); ``None``: one
            document per file.
        page_size: bytes per page (power of two, 4 KiB .. 1 GiB).
        metadata: JSON-serialisable user metadata (outside the dataset id).
        chunk_docs, chunk_chars: documents / characters per worker task.
        lineage: record when, where and by which versions the file was written; ``False`` makes the whole file
            byte-identical across runs, worker counts and executors.
        executor: any ``concurrent.futures.Executor`` (e.g. Dask's ``Client(...).get_executor()``). A path
            source (file or folder) or a list of ``pathlib.Path`` files gives one task per file (workers read
            the files themselves); other sources are cut into chunks of documents sent with the tasks. Tasks
            write shard files (token ids of their range) to ``shard_dir``; the tokenizer must be picklable.
        shard_dir: folder or fsspec URL every worker can reach; default next to ``path``; removed at the end.
        storage_options: passed to fsspec for URLs: ``path``, ``shard_dir`` and a URL ``source`` (e.g.
            ``"s3://bucket/corpus/*.jsonl"``); with an ``executor`` they reach the workers too.
        request_timeout, request_attempts: URL ``path`` only: seconds per request to the store and attempts per
            request (as for reading); a store that never answers fails with TimeoutError naming the URL.
        member_bytes: write a many-file set (``formats/manyfile.md``) to the folder (or URL prefix) ``path``: each
            member holds whole input files in order (a path source), a new member starting once the current
            one's files reach this many bytes (their sizes on disk, read from the file system), or for an
            in-memory source whole documents up to this many bytes of UTF-8 text (4 bytes per pre-tokenized
            id). Each member is tokenized and written by its own task (``num_workers`` processes or
            ``executor`` tasks), then ``pageset.manifest.json`` is written last, atomically. The stored dtype
            is the same in every member: ``dtype="auto"`` with a tokenizer is decided from its vocabulary
            (uint16 when it has at most 65,536 ids, else uint32); for pre-tokenized ids (``tokenizer=None``) as
            for the single file, from the largest id of the whole input, so merging the members gives the
            single file (this costs one more pass over the source before the members are written, or, for a
            one-shot iterator such as a generator, a temp spill file of 4 bytes per id in ``TMPDIR``); an append
            keeps the set's dtype.
        docs_per_member: in-memory sources only: members of this many documents (with ``member_bytes`` too,
            whichever comes first).
        append: with ``member_bytes`` / ``docs_per_member``: add members after those of the set at ``path``
            (old members are not rewritten; the set's id changes); tokenizer, ids and dtype must match the set's.
        messages_key: ``None``: text documents. A key (``"messages"``): the source holds conversations, see
            :func:`~pageset.write.documents.iter_conversations` (``.jsonl`` lines / ``.parquet`` rows / dict rows
            such as an HF ``datasets.Dataset`` with a list of ``{"role", "content"}`` under this key, or message
            lists). Needs an HF tokenizer. ``bos_id`` / ``eos_id`` as for text (``eos_id`` defaulting to the
            ``eos_token`` of ``tokenizer_config.json``), never doubled, mask 0. Not with ``executor``.
        chat_template: the template text, a ``.jinja`` file or a ``tokenizer_config.json``; ``None``: the
            ``chat_template`` of the ``tokenizer_config.json`` beside a ``tokenizer.json`` path.
        train_on: the roles whose tokens have mask 1 (of ``system``, ``developer``, ``user``, ``assistant``,
            ``tool``); default the assistant's.
        on_error: conversations only: ``"raise"`` (the first conversation that cannot be encoded stops the write,
            nothing is written; its error names the file and line) or ``"skip"`` (such conversations are left
            out: a bad message, a template that refuses the conversation, a message the mask rule cannot follow;
            :attr:`TokenWriteResult.skipped` lists where they came from, the file's lineage metadata holds their
            errors, and a warning gives the count and the first lines). A damaged file (not UTF-8, invalid JSON)
            stops the write either way.

    Returns:
        :class:`TokenWriteResult` (``path, documents, tokens, dtype, dataset_id, bytes, seconds``).

    Raises:
        ValueError: bad ids or arguments, no EOS found, an empty corpus, or a token id > 65535 with
        ``dtype="uint16"`` (naming the document index); TypeError: an argument of the wrong kind, or a document
        that is neither text nor an integer array; FileNotFoundError: the output folder does not exist, or a
        source file; RuntimeError: a worker died. An ``s3://`` output goes up in parts of 64 MiB growing by
        64 MiB every 500 parts (:class:`~pageset.write.upload.PartPlan`), within S3's limits for any file up to
        5 TiB; a larger one raises ValueError naming the limit, before its bytes past 5 TiB are uploaded.
    """
    t0 = time.perf_counter()
    member_bytes = check.integer("member_bytes", member_bytes, minimum=1, optional=True)
    docs_per_member = check.integer("docs_per_member", docs_per_member, minimum=1, optional=True)
    append = check.boolean("append", append)
    many = member_bytes is not None or docs_per_member is not None
    if append and not many:
        raise ValueError("append=True adds members to a many-file set: give member_bytes= or docs_per_member= too")
    if many:
        from .writer import check_folder_path

        path = check_folder_path(path)
    else:
        path = check_output_path(path)
    dtype = check.choice("dtype", dtype, ("auto",) + C.TOKEN_DTYPES)
    num_workers = check.integer("num_workers", num_workers, minimum=0, maximum=MAX_WORKERS, optional=True)
    progress = check.boolean("progress", progress)
    text_key = check.text("text_key", text_key)
    separator = check.text("separator", separator, optional=True)
    _check_page_size(page_size)
    metadata = check.mapping("metadata", metadata, optional=True)
    check.json_metadata("metadata", metadata)
    chunk_docs = check.integer("chunk_docs", chunk_docs, minimum=1)
    chunk_chars = check.integer("chunk_chars", chunk_chars, minimum=1)
    eos_id = check.integer("eos_id", eos_id, minimum=0, optional=True)
    bos_id = check.integer("bos_id", bos_id, minimum=0, optional=True)
    lineage = check.boolean("lineage", lineage)
    if executor is not None and not callable(getattr(executor, "submit", None)):
        raise TypeError(f"executor must be a concurrent.futures.Executor (with .submit), got {type(executor).__name__}")
    shard_dir = check.text("shard_dir", shard_dir, optional=True)
    storage_options = check.mapping("storage_options", storage_options, optional=True)
    policy = WritePolicy(check.real("request_timeout", request_timeout, low=0, low_open=True),
                         check.integer("request_attempts", request_attempts, minimum=1))
    messages_key = check.text("messages_key", messages_key, optional=True)
    if chat_template is not None and not isinstance(chat_template, (str, os.PathLike)):
        raise TypeError(f"chat_template must be the template text or a path (.jinja, tokenizer_config.json), got "
                        f"{type(chat_template).__name__}")
    train_on = check_train_on(train_on)
    on_error = check.choice("on_error", on_error, ("raise", "skip"))
    if on_error == "skip" and messages_key is None:
        raise ValueError("on_error='skip' leaves out conversations that cannot be encoded: it needs messages_key= "
                         "(a chat source)")
    if chat_template is not None and messages_key is None:
        raise ValueError("chat_template is for conversations: also pass messages_key= (e.g. 'messages'), the key "
                         "holding each conversation's messages")
    if messages_key is not None and tokenizer is None:
        raise ValueError("conversations need a tokenizer (a tokenizer.json path with a chat template)")
    if messages_key is not None and executor is not None:
        raise ValueError("conversations are encoded in this machine's worker processes (num_workers=); "
                         "executor= is not supported for them")
    spec = load_tokenizer(tokenizer) if tokenizer is not None else None
    vocab = spec.vocab_size if spec is not None else None
    chat = chat_encoder(spec, tokenizer, chat_template, train_on) if messages_key is not None else None
    if eos_id is None and chat is not None and "eos_token" in chat.special_tokens:
        eos_id = spec.obj.token_to_id(chat.special_tokens["eos_token"])
    if eos_id is None:  # an explicit eos_id always wins; else the tokenizer's own end-of-text token
        eos_id = spec.default_eos if spec is not None else None
        if eos_id is None:
            raise ValueError(_no_eos_message(spec))
    eos_id = _check_id("eos_id", eos_id, vocab, dtype)
    bos_id = _check_id("bos_id", bos_id, vocab, dtype)
    if num_workers is None:
        num_workers = os.cpu_count() or 1
    # Decide the stored dtype up front when we can (explicit, or a vocabulary that fits uint16); otherwise stage
    # uint32 ids in a spill file next to the target and re-pack once the largest id is known.
    direct = dtype if dtype != "auto" else ("uint16" if vocab is not None and vocab <= UINT16_MAX + 1 else None)
    limit = UINT16_MAX if direct == "uint16" else UINT32_MAX
    path = os.fspath(path)
    check_not_input(path, [source] if isinstance(source, (str, os.PathLike)) else [])
    info = {
        "eos_id": eos_id,
        "bos_id": bos_id,
        "tokenizer": spec.describe() if spec is not None else None,
        "source": "text" if spec is not None else "pre-tokenized",
    }
    if chat is not None:
        info.update(source="chat", loss_mask=chat.describe())
    if many:
        if chat is not None:
            raise ValueError("messages_key= (chat/SFT data) writes one file; it cannot be combined with "
                             "member_bytes= / docs_per_member= yet: write the conversations to one file per part")
        # pre-tokenized ids with dtype="auto": decided from the whole input, as the single file decides (None here)
        member_dtype = direct or (None if spec is None else "uint32")
        return _write_token_members(path, source, spec, info, member_dtype, page_size, progress, text_key,
                                    separator, chunk_docs, chunk_chars, metadata, lineage, num_workers, executor,
                                    storage_options, policy, member_bytes, docs_per_member, append, t0)
    check_replaceable(path, "write_tokens(path, source, tokenizer)", storage_options, policy)
    if executor is not None:
        if not callable(getattr(executor, "submit", None)):
            raise TypeError(f"executor must be a concurrent.futures.Executor, got {type(executor).__name__}")
        return _write_tokens_on(executor, path, source, spec, info, direct, limit, page_size, progress, text_key,
                                separator, chunk_docs, chunk_chars, metadata, lineage, shard_dir,
                                storage_options, t0, policy)
    if chat is not None:
        docs_iter = iter_conversations(source, messages_key=messages_key, storage_options=storage_options)
    else:
        docs_iter = iter_documents(source, text_key=text_key, separator=separator, storage_options=storage_options)
    lengths_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    skipped: list = []
    max_id = -1
    spill, spill_name = None, None
    bar = tqdm(disable=not progress, desc="pageset tokens", unit="doc", leave=False)
    writer = TokenFileWriter(path, direct or "uint32", page_size, storage_options, policy) if direct else None
    try:
        if writer is None:
            fd, spill_name = tempfile.mkstemp(prefix="pageset-spill-") if is_url(path) else temp_file(path, "spill")
            try:
                spill = DiskFile(fd, "wb", spill_name, f"the spill file of the output {path} (token ids kept until "
                                 "the largest is known)", "another temp folder (TMPDIR)" if is_url(path) else
                                 "another output path")
            except BaseException:
                os.close(fd)
                raise
        for start, n, (flat, lengths, mask, skips) in _encoded_in_order(docs_iter, chat or spec, bos_id, eos_id,
                                                                        num_workers, chunk_docs, chunk_chars,
                                                                        on_error):
            if flat.size:
                chunk_max = int(flat.max())
                if chunk_max > limit:
                    first = int(np.argmax(flat > limit))
                    doc = start + int(np.searchsorted(np.cumsum(lengths), first, side="right"))
                    raise ValueError(
                        f"document {doc} has token id {int(flat[first])} > {limit}, which does not fit "
                        f"dtype={direct!r}; use dtype='uint32' or 'auto'"
                    )
                max_id = max(max_id, chunk_max)
            if writer is not None:
                writer.write(flat)
            else:
                spill.write(flat.astype("<u4", copy=False).tobytes())
            lengths_parts.append(lengths)
            if mask is not None:
                mask_parts.append(mask)
            skipped += skips
            bar.update(n)
        bar.close()
        lengths = np.concatenate(lengths_parts) if lengths_parts else np.empty(0, np.int64)
        if lengths.size == 0 and skipped:
            raise ValueError(f"every conversation was skipped ({len(skipped)}): nothing to write; the first: "
                             f"{skipped[0][2]}")
        if lengths.size == 0:
            raise ValueError("the source holds no documents: nothing to write")
        final = direct or ("uint16" if max_id <= UINT16_MAX else "uint32")
        if writer is None:
            spill.close()
            writer = TokenFileWriter(path, final, page_size, storage_options, policy)
            with open(spill_name, "rb") as f:
                for block in iter(lambda: f.read(SPILL_CHUNK * 4), b""):
                    writer.write(np.frombuffer(block, dtype="<u4"))
        offsets = np.zeros(lengths.size + 1, dtype=np.uint64)
        np.cumsum(lengths, out=offsets[1:])
        loss_mask = np.concatenate(mask_parts) if chat is not None else None
        result = writer.finish(offsets, dict(info, max_id=max_id), metadata, t0, lineage, loss_mask, skipped)
        if skipped:
            first = ", ".join(w for _, w, _ in skipped[:5]) + (", ..." if len(skipped) > 5 else "")
            warnings.warn(f"write_tokens({path!r}): skipped {len(skipped)} of {len(skipped) + result.documents} "
                          f"conversations that could not be encoded ({first}); TokenWriteResult.skipped lists them "
                          "and the file's lineage metadata holds their errors", stacklevel=2)
        return result
    except BaseException:
        bar.close()
        if writer is not None:
            writer.abort()
        raise
    finally:
        if spill is not None:
            spill.discard()
        if spill_name is not None:
            try:
                os.unlink(spill_name)
            except FileNotFoundError:
                pass

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
        offsets = np.zeros(lengths.size + 1, dtype=np.uint64)
        np.cumsum(lengths, out=offsets[1:])
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
    first = int(np.argmax(ids > limit))
    doc = first_doc + int(np.searchsorted(np.cumsum(lengths), first, side="right"))
    raise ValueError(f"document {doc} has token id {int(ids[first])} > {limit}, which does not fit dtype={direct!r}; "
                     "use dtype='uint32' or 'auto'")


# ---- many-file sets: one member per task ------------------------------------------------------------------

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
    from . import members as M

    if isinstance(spec, tuple):  # an executor's worker process (a forked pool's initializer sets it there)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        spec = unpickled(spec)
    files = not isinstance(item, _Docs)
    docs = (d for f in item for d in _file_documents(f, text_key, separator, storage_options)) if files else item
    limit = UINT16_MAX if dtype == "uint16" else UINT32_MAX
    url = M.join(folder, name)
    writer, lengths, max_id = None, [], -1
    try:
        for start, chunk in _chunks(docs, chunk_docs, chunk_chars):
            flat, lens, _, _ = _encode_chunk(first_doc + start, chunk, bos_id, eos_id, spec)
            if flat.size and int(flat.max()) > limit:
                first = int(np.argmax(flat > limit))
                doc = first_doc + start + int(np.searchsorted(np.cumsum(lens), first, side="right"))
                raise ValueError(f"{url}: document {doc} has token id {int(flat[first])} > {limit}, which does not "
                                 f"fit dtype={dtype!r}; {fix}")
            max_id = max(max_id, int(flat.max()) if flat.size else -1)
            writer = writer or TokenFileWriter(url, dtype, page_size, storage_options, policy)
            writer.write(flat)
            lengths.append(lens)
        if writer is None:
            return {"empty": True, "name": name}
        lens = np.concatenate(lengths)
        offsets = np.zeros(lens.size + 1, dtype=np.uint64)
        np.cumsum(lens, out=offsets[1:])
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
    from . import members as M

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
    from . import members as M

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


def tokenize_only(source, tokenizer, *, text_key: str = "text", separator: str | None = None,
                  limit: int | None = None) -> tuple[int, int]:
    """Tokenize in this process without writing: ``(documents, tokens)``. For throughput baselines."""
    spec = load_tokenizer(tokenizer)
    docs = itertools.islice(iter_documents(source, text_key=text_key, separator=separator), limit)
    n_docs = n_tok = 0
    for _, batch in _chunks(docs, 512, 1 << 20):
        for ids in spec.encode_batch(batch):
            n_tok += len(ids)
        n_docs += len(batch)
    return n_docs, n_tok
