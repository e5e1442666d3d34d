"""Encoding token documents, in this process or in worker processes: text (through the tokenizer) or
pre-tokenized ids become one flat uint32 array with BOS/EOS and the documents' lengths; conversations also a
loss mask. Chunks of documents are encoded in order, so the bytes written depend on the input only."""

from __future__ import annotations

import os

import numpy as np

from ..chat import ChatEncoder
from ..documents import Conversation
from ..pool import ordered_map
from .ids import UINT32_MAX

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
