"""``open_tokens``: read a token file (format 1.1) as a zero-copy array of token ids plus document offsets.

A token file is an ordinary pageset file (same header, section table, CRCs, dataset id), so it is opened by
:class:`~pageset.read.reader.Dataset` and gets every check of ``formats/v1.md`` section 8. On top of those,
:func:`validate_token_sections` (called by the reader for any file with the ``tokens`` feature bit or field)
checks the token-specific invariants before any token is used:

- the schema has exactly one field, of kind ``tokens``, and a ``"tokens"`` object that agrees with it;
- ``record_count`` is 0 and ``data_length == count * itemsize``;
- the ``doc_offsets`` section holds ``documents + 1`` little-endian u64 values, starting at 0, non-decreasing,
  ending at ``count``.

Windows are not stored: for a load-time ``seq_len`` window ``w`` is ``tokens[w*seq_len : w*seq_len + seq_len
+ 1]`` (see :mod:`pageset.ops.tokens`), so one file serves every ``seq_len``.
"""

from __future__ import annotations

import numpy as np

from ..format.errors import FormatError, plural
from .reader import Dataset
from .token_sections import DOC_OFFSET, validate_token_sections  # noqa: F401 (public here too)


class TokenDataset:
    """A validated, read-only token file.

    Attributes:
        tokens: ``uint16[T]`` or ``uint32[T]``, a read-only view over a memory map of the file, made on first use
            (zero copy; valid until ``close()``). Documents are separated by ``eos_id`` (each text document ends
            with it). Like :attr:`Dataset.buffer` it is unguarded: a file truncated or rewritten in place under
            it can kill the process with SIGBUS. :meth:`read` and :meth:`document` use ``pread`` and raise
            TruncatedFileError / FileChangedError instead; so does the Loader.
        doc_offsets: ``uint64[D + 1]`` read-only, token offsets of document starts; document ``i`` is
            ``tokens[doc_offsets[i]:doc_offsets[i + 1]]`` (including its BOS, if any, and its EOS).
        loss_mask: ``uint8[T]`` of 0/1 (1: the token is trained on, e.g. an assistant's token of a chat file),
            unpacked from the file's ``loss_mask`` section on first use; ``None`` for a file without one (text
            corpora). :meth:`mask` reads a range of it.
        eos_id, bos_id (int or None), dtype (numpy dtype), documents (D), info (the schema's ``"tokens"``
        object: tokenizer name/kind/files_sha256, source), dataset_id (hex str), dataset (the underlying
        :class:`~pageset.read.reader.Dataset`: header, schema, metadata, ``verify()``).

    ``len(td)`` is the token count ``T``. Use as a context manager or call ``close()``.
    """

    def __init__(self, path, storage_options: dict | None = None, **remote):
        self.dataset = Dataset(path, storage_options, **remote)
        try:
            if self.dataset.tokens_info is None:
                raise self.dataset._err(FormatError, "header", 24,
                                        "not a token file (no 'tokens' feature bit); use open_dataset()")
        except BaseException:
            self.dataset.close()
            raise
        ds = self.dataset
        self.path = ds.path
        self.info = ds.tokens_info
        self.dtype = np.dtype(self.info["dtype"]).newbyteorder("<")
        self.eos_id = int(self.info["eos_id"])
        bos = self.info.get("bos_id")
        self.bos_id = None if bos is None else int(bos)
        self.documents = int(self.info["documents"])
        self.doc_offsets = ds.doc_offsets
        self.dataset_id = ds.dataset_id
        self._count = ds.data_length // self.dtype.itemsize
        self._tokens = None
        self._loss_mask = None

    @property
    def loss_mask(self) -> np.ndarray | None:
        bits = self.dataset.loss_mask_bits
        if bits is None:
            return None
        if self._loss_mask is None:
            self._loss_mask = np.unpackbits(bits, count=self._count, bitorder="little")
            self._loss_mask.flags.writeable = False
        return self._loss_mask

    def mask(self, start: int, stop: int) -> np.ndarray:
        """``uint8`` loss mask of tokens ``[start, stop)`` (clipped to ``[0, T]``), a new array; ValueError for a
        file without a loss mask."""
        bits = self.dataset.loss_mask_bits
        if bits is None:
            raise ValueError(f"{self.path}: the file has no loss mask (it was not written from conversations)")
        start, stop = max(0, int(start)), min(self._count, int(stop))
        if stop <= start:
            return np.empty(0, np.uint8)
        return np.unpackbits(bits[start // 8 : -(-stop // 8)], bitorder="little")[start % 8 : start % 8 + stop - start]

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None and self.dataset.remote is not None:
            self._tokens = RemoteTokens(self)
        if self._tokens is None:
            start = self.dataset.data_offset
            self._tokens = self.dataset.buffer[start : start + self.dataset.data_length].view(self.dtype)
        return self._tokens

    def __len__(self) -> int:
        return self._count

    def read(self, start: int, stop: int) -> np.ndarray:
        """Token ids ``[start, stop)`` (clipped to ``[0, T]``) as a new read-only array, read with ``pread``.

        Raises TruncatedFileError / FileChangedError if the file was truncated or modified in place since it
        was opened.
        """
        start, stop = max(0, int(start)), min(self._count, int(stop))
        if stop <= start:
            return np.empty(0, self.dtype)
        size = self.dtype.itemsize
        raw = self.dataset._read_checked(self.dataset.data_offset + start * size, (stop - start) * size)
        return np.frombuffer(raw, dtype=self.dtype)

    def document(self, i: int) -> np.ndarray:
        """Token ids of document ``i`` (a new read-only array, BOS/EOS included), read with ``pread``. Raises
        IndexError; TruncatedFileError / FileChangedError for a file changed in place since it was opened."""
        d = self.documents
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"document indices are ints, got {type(i).__name__}")
        if not -d <= i < d:
            raise IndexError(f"{self.path}: document {i} is out of range for {plural(d, 'document')}")
        i = int(i) % d
        return self.read(int(self.doc_offsets[i]), int(self.doc_offsets[i + 1]))

    def num_windows(self, seq_len: int) -> int:
        """Windows of ``seq_len + 1`` tokens at stride ``seq_len``: ``(T - 1) // seq_len``.

        Raises ValueError for ``seq_len < 1`` or a corpus shorter than ``seq_len + 1`` tokens (no window fits;
        a window is never padded with a real id).
        """
        if not isinstance(seq_len, (int, np.integer)) or isinstance(seq_len, bool) or seq_len < 1:
            raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
        if len(self) < seq_len + 1:
            raise ValueError(
                f"{self.path}: {plural(len(self), 'token')}, fewer than seq_len + 1 = {seq_len + 1}: no window fits "
                "(windows are never padded); use a smaller seq_len or more data"
            )
        return (len(self) - 1) // int(seq_len)

    def verify(self) -> None:
        """Recompute every page CRC-32 and the dataset id (the whole file, token stream and document index).

        Raises ChecksumMismatchError naming the first bad page, its byte offset and what it holds; FormatError for
        damage elsewhere; TruncatedFileError / FileChangedError for a file changed in place since it was opened.
        Same as ``td.dataset.verify()``.
        """
        self.dataset.verify()

    def close(self) -> None:
        """Release the mmap; ``tokens`` and ``doc_offsets`` must not be used afterwards."""
        self._tokens = np.empty(0, self.dtype)
        self.dataset.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        tok = self.info.get("tokenizer") or {}
        return (f"TokenDataset({self.path!r}, tokens={len(self)}, documents={self.documents}, "
                f"dtype={self.dtype.name}, eos_id={self.eos_id}, tokenizer={tok.get('name')!r}, "
                f"id={self.dataset_id[:12]})")


class RemoteTokens:
    """``TokenDataset.tokens`` of a file opened from a URL: ``len``, ``shape``, ``dtype``, ``tokens[i]`` and
    ``tokens[a:b:step]`` (a new array) fetch the pages they cover (CRC-checked); no whole-corpus download."""

    ndim = 1

    def __init__(self, td: TokenDataset):
        self._td, self.dtype, self.shape = td, td.dtype, (len(td),)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        n = self.shape[0]
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            if not -n <= key < n:
                raise IndexError(f"{self._td.path}: token {key} is out of range for {plural(n, 'token')}")
            key = int(key) % n
            return self._td.read(key, key + 1)[0]
        if not isinstance(key, slice):
            raise TypeError(f"remote token arrays take an int or a slice, got {type(key).__name__}")
        start, stop, step = key.indices(n)
        if step == 1:
            return self._td.read(start, stop)
        idx = np.arange(start, stop, step, dtype=np.int64)
        if not idx.size:
            return np.empty(0, self.dtype)
        lo = int(idx.min())
        return self._td.read(lo, int(idx.max()) + 1)[idx - lo]
