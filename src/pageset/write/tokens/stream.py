"""``write_tokens``: argument checks, the dispatch (one file here, an executor, or a many-file set) and the
local stream (chunks encoded in order into one file, or a uint32 spill file re-packed once the largest id is
known); ``tokenize_only`` for throughput baselines."""

from __future__ import annotations

import itertools
import os
import tempfile
import time
import warnings

import numpy as np
from tqdm.auto import tqdm

from ...format import arguments as check
from ...format import constants as C
from ..chat import chat_encoder, check_train_on
from ..documents import iter_conversations, iter_documents
from ..disk import DiskFile
from ..output import check_not_input, check_output_path, check_replaceable, is_url, temp_file
from ..pool import MAX_WORKERS
from ..tokenizers import EOS_NAMES, load_tokenizer
from ..upload import WritePolicy
from ..writer import _check_page_size
from .encoding import _chunks, _encoded_in_order
from .executors import _write_tokens_on
from .file import TokenFileWriter, TokenWriteResult
from .ids import SPILL_CHUNK, UINT16_MAX, UINT32_MAX, check_ids_fit, doc_offsets, id_limit
from .set_members import _write_token_members


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
        from ..writer import check_folder_path

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
    limit = id_limit(direct)
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
    if executor is not None:  # checked to have .submit above
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
            max_id = max(max_id, check_ids_fit(flat, lengths, start, limit, direct))
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
        offsets = doc_offsets(lengths)
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
