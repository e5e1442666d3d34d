"""Document sources for the token writers: files (UTF-8 text, JSON Lines, Parquet), folders, globs and fsspec URLs of
them, in-memory iterables of text or of pre-tokenized ids, read in a stated order (:func:`iter_documents`)."""

from __future__ import annotations

import glob
import io
import json
import os

from .output import is_url, local_path

# ---- sources -----------------------------------------------------------------------------------------------

def _split_separator(text: str, separator: str) -> list[str]:
    docs, cur = [], []
    for line in text.splitlines(keepends=True):
        if line.rstrip("\r\n") == separator:
            docs.append("".join(cur))
            cur = []
        else:
            cur.append(line)
    if cur and "".join(cur).strip():
        docs.append("".join(cur))
    return docs


def _open_binary(path: str, storage_options: dict | None = None):
    """A binary file object for a local path or an fsspec URL (``storage_options`` go to its filesystem);
    FileNotFoundError naming the path."""
    if not is_url(path):
        return open(local_path(path), "rb")
    import fsspec

    try:
        return fsspec.open(path, "rb", **dict(storage_options or {})).open()
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{path}: no such object ({exc}); check the URL and storage_options") from None


class Conversation:
    """One conversation of a chat source: ``messages`` (a list of ``{"role", "content"}`` dicts, checked when it is
    encoded) and ``where`` it came from (``"file.jsonl:12"``, ``"file.parquet: row 3"``, ``"conversation 5"``) for
    error messages; ``problem``: why a row holds no conversation (no ``messages_key`` in it), raised when it is
    encoded (so ``on_error="skip"`` can leave it out). ``len()`` is its characters (for chunking work)."""

    __slots__ = ("where", "messages", "problem")

    def __init__(self, where: str, messages, problem: str | None = None):
        self.where, self.messages, self.problem = where, messages, problem

    def __len__(self) -> int:
        if not isinstance(self.messages, (list, tuple)):
            return 1
        return sum(len(m["content"]) if isinstance(m, dict) and isinstance(m.get("content"), str) else 1
                   for m in self.messages)

    def __reduce__(self):
        return (Conversation, (self.where, self.messages, self.problem))


def _jsonl_documents(path: str, text_key: str, storage_options: dict | None = None, chat: bool = False):
    """The ``text_key`` string of each line of a JSON Lines file (``.gz`` too); ValueError naming file, line and
    byte for a line that is not UTF-8, not valid JSON, or without a string under ``text_key``. ``chat``: the
    list of messages under ``text_key`` instead, as a :class:`Conversation`."""
    offset = 0  # byte offset of the line's start (in the decompressed stream for .gz)
    raw_file = _open_binary(path, storage_options)
    with (__import__("gzip").open(raw_file, "rb") if path.endswith(".gz") else raw_file) as f, raw_file:
        for lineno, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text: byte 0x{raw[exc.start]:02x} at byte "
                                 f"{start + exc.start} of the file (column {exc.start + 1} of the line): "
                                 f"{exc.reason}; re-encode the file as UTF-8 or leave the line out") from None
            if not line.strip():
                continue
            line = line.rstrip("\r\n")  # the column of an error is then on this line, never "line 2 column 1"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                ends = (" (the line ends there: one whole JSON object per line; is the object split over lines, or "
                        "the file cut?)" if exc.pos >= len(line.rstrip()) else "")
                raise ValueError(f"{path}:{lineno}: invalid JSON at column {exc.pos + 1}{ends}: {exc.msg}; fix the "
                                 "line or leave it out") from None
            if not isinstance(obj, dict) or text_key not in obj:
                keys = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
                if chat:
                    yield Conversation(f"{path}:{lineno}", None, f"no {text_key!r} key in the JSON line (it has "
                                       f"{keys}); set messages_key= to the key holding the messages")
                    continue
                raise ValueError(f"{path}:{lineno}: no {text_key!r} key in the JSON line (it has {keys}); "
                                 "set text_key= (--text-key) to the key holding the text")
            text = obj[text_key]
            if chat:
                if not isinstance(text, list):
                    yield Conversation(f"{path}:{lineno}", None, f"{text_key!r} holds {type(text).__name__} "
                                       f"{text!r:.40}, not a list of messages "
                                       "[{\"role\": ..., \"content\": ...}, ...]")
                    continue
                yield Conversation(f"{path}:{lineno}", text)
                continue
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: {text_key!r} holds {type(text).__name__} {text!r:.40}, "
                                 "not a string")
            yield text


def _parquet_documents(path: str, text_key: str, storage_options: dict | None = None, chat: bool = False):
    """The ``text_key`` column of a Parquet file, batch by batch; ValueError naming the file and the key (and the
    columns it has) for a missing column, and the file for a damaged one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _open_binary(path, storage_options) as raw:
        try:
            pf = pq.ParquetFile(raw)
            names = pf.schema_arrow.names
            if text_key not in names:
                raise ValueError(f"{path}: no column {text_key!r} in the Parquet file (it has {names}); set "
                                 "text_key= (--text-key) to the column holding the text")
            row = 0
            for batch in pf.iter_batches(columns=[text_key], batch_size=1024):
                values = batch.column(0).to_pylist()
                if chat:  # a list<struct<role, content>> column: each row one conversation
                    yield from (Conversation(f"{path}: row {row + k}", v) for k, v in enumerate(values))
                else:
                    yield from values
                row += len(values)
        except (pa.ArrowException, OSError) as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise ValueError(f"{path}: cannot read it as Parquet ({type(exc).__name__}: {exc}); the file is damaged "
                             "or not Parquet (rewrite it, or leave it out of the source)") from None


def _file_documents(path: str, text_key: str, separator: str | None, storage_options: dict | None = None,
                    chat: bool = False):
    if path.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
        yield from _jsonl_documents(path, text_key, storage_options, chat)
        return
    if path.endswith(".parquet"):
        yield from _parquet_documents(path, text_key, storage_options, chat)
        return
    if chat:
        raise ValueError(f"{path}: a chat source is JSON Lines (.jsonl, .jsonl.gz, .ndjson) or Parquet, one "
                         "conversation per line / row; this file is neither")
    try:
        with io.TextIOWrapper(_open_binary(path, storage_options), encoding="utf-8", errors="strict") as f:
            text = f.read()  # universal newlines, as open(path, encoding="utf-8") reads
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); convert it or leave it out "
                         "of the source") from None
    if separator is None:
        yield text
    else:
        yield from _split_separator(text, separator)


def iter_documents(source, *, text_key: str = "text", separator: str | None = None,
                   storage_options: dict | None = None):
    """Yield documents (``str`` or integer arrays) from ``source`` in order.

    ``source``: a path (a file, or a directory whose regular files are read in sorted order, recursively), or a
    glob pattern (``"corpus/*.jsonl"``, ``"**"`` recursive; matches in sorted order), local or an fsspec URL
    (``s3://bucket/corpus/*.txt``; ``storage_options`` go to its filesystem); an iterable of ``str``
    documents, of ``os.PathLike`` files, or of integer arrays/lists (pre-tokenized).
    Files: ``.jsonl``/``.ndjson`` (``text_key`` of each line), ``.parquet`` (column ``text_key``, needs
    pyarrow), anything else UTF-8 text: one document per file, or split at lines equal to ``separator``
    (``"%"`` for fortune files).
    """
    if isinstance(source, (str, os.PathLike)):
        for p in _source_files(source, storage_options):
            yield from _file_documents(p, text_key, separator, storage_options)
        return
    for item in source:
        if isinstance(item, os.PathLike):
            yield from _file_documents(os.fspath(item), text_key, separator)
        else:
            yield item


def iter_conversations(source, *, messages_key: str = "messages", storage_options: dict | None = None):
    """Yield :class:`Conversation` objects from a chat ``source`` in order.

    ``source``: paths as for :func:`iter_documents` of ``.jsonl`` files (``messages_key`` of each line: a list of
    ``{"role", "content"}``) or ``.parquet`` files (column ``messages_key`` of list<struct<role, content>>); or an
    iterable (a list, an HF ``datasets.Dataset``) of rows ``{messages_key: [...], ...}``, of message lists, or of
    ``os.PathLike`` files. ValueError / TypeError naming the file and line / row, or the item's index, for a file
    that cannot be read; a row without ``messages_key`` (or, in JSON Lines, with a value that is not a list) is
    yielded with its ``problem``, raised when it is encoded (so ``on_error="skip"`` can leave it out).
    """
    if isinstance(source, (str, os.PathLike)):
        for p in _source_files(source, storage_options):
            yield from _file_documents(p, messages_key, None, storage_options, chat=True)
        return
    for k, item in enumerate(source):
        if isinstance(item, os.PathLike):
            yield from _file_documents(os.fspath(item), messages_key, None, chat=True)
        elif isinstance(item, Conversation):
            yield item
        elif isinstance(item, dict):
            if messages_key not in item:
                yield Conversation(f"conversation {k}", None, f"no {messages_key!r} key in the row (it has "
                                   f"{sorted(map(str, item))}); set messages_key= to the key holding the messages")
            else:
                yield Conversation(f"conversation {k}", item[messages_key])
        elif isinstance(item, (list, tuple)):
            yield Conversation(f"conversation {k}", item)
        else:
            raise TypeError(f"conversation {k}: expected a list of messages or a row {{{messages_key!r}: [...]}}, "
                            f"got {type(item).__name__} {item!r:.40}")


def _url_files(url: str, storage_options: dict | None) -> list[str]:
    """The objects under an fsspec URL (one object, a folder / prefix, recursively, or a glob), sorted, as URLs."""
    from fsspec.core import url_to_fs

    fs, target = url_to_fs(url, **dict(storage_options or {}))
    protocol = url.split("://", 1)[0]
    if any(c in target for c in "*?["):
        found = [p for p, info in fs.glob(target, detail=True).items() if info.get("type") != "directory"]
        if not found:
            raise FileNotFoundError(f"{url}: the pattern matches no object (check the URL and storage_options)")
    elif fs.isdir(target):
        found = fs.find(target)
        if not found:
            raise FileNotFoundError(f"{url}: the folder holds no object")
    elif fs.isfile(target):
        return [url]
    else:
        raise FileNotFoundError(f"{url}: no such object or folder (check the URL and storage_options)")
    return [f"{protocol}://{p}" for p in sorted(found)]


def _source_files(source, storage_options: dict | None = None) -> list[str] | None:
    """The files of a path source (in :func:`iter_documents` order), or None for an in-memory source."""
    if isinstance(source, str) and is_url(source):
        return _url_files(source, storage_options)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            return sorted(os.path.join(r, n) for r, _, names in os.walk(path) for n in names)
        if os.path.isfile(path):
            return [path]
        if any(c in path for c in "*?["):
            files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
            if not files:
                raise FileNotFoundError(f"{path}: the pattern matches no file")
            return files
        raise FileNotFoundError(f"{path}: no such file or directory")
    if isinstance(source, (list, tuple)) and source and all(isinstance(p, os.PathLike) for p in source):
        return [os.fspath(p) for p in source]
    return None
