"""Reading a many-file dataset (``formats/manyfile.md``) as one dataset of records or tokens:
:class:`ManyFileDataset`, :class:`ManyFileTokens` (``pageset.open_dataset(folder)`` / ``open_tokens(folder)``).

Members are opened lazily, when a record of theirs is first read, checked against the manifest
(:class:`~pageset.read.set_manifest.CheckedMembers`), and at most ``max_open`` of them stay open (the set's
:class:`~pageset.read.member_cache.MemberCache`: least recently used closed first). Global record ids run through
the members in manifest order: member k holds ids ``[sum(records[:k]), sum(records[:k+1]))``.
"""

from __future__ import annotations

import numpy as np

from ..format.errors import FormatError, plural
from ..format.manifest import set_dataset_id
from .member_cache import MAX_OPEN_MEMBERS, MemberCache
from .remote import url_scheme
from .set_manifest import CheckedMembers, many_file_members


def _close_member(k: int, ds) -> None:
    ds.close()


def _check_max_open(max_open) -> int:
    from ..format import arguments as check

    return check.integer("max_open", max_open, minimum=1)


class _ManyFileBase:
    """What ManyFileDataset and ManyFileTokens share: the manifest, the member list and the bounded set of open
    members (opened by ``member_class``, a Dataset or a TokenDataset), context management."""

    kind = ""  # "records" or "tokens"
    other_opener = ""  # the function that opens the other kind, named in the error

    def _open_set(self, path, storage_options, request_timeout, request_attempts, max_open, member_class) -> None:
        self.info = many_file_members(path, storage_options)
        self.max_open = _check_max_open(max_open)
        if self.info.kind != self.kind:
            what = (f"token files ({plural(self.info.manifest.tokens, 'token')})" if self.info.kind == "tokens"
                    else "record files")
            raise ValueError(f"{self.info.folder} is a many-file set of {what}: open it with "
                             f"pageset.{self.other_opener}(folder)")
        self.path, self.manifest = self.info.folder, self.info.manifest
        self.dataset_id, self.page_size = self.info.dataset_id, self.info.page_size
        self.members, self.paths = self.manifest.members, self.info.paths
        remote = {"request_timeout": request_timeout, "request_attempts": request_attempts}

        def opener(p):
            return member_class(p, storage_options if url_scheme(p) else None, **remote)

        self._checked = CheckedMembers(self.info, opener, storage_options)
        self._members = MemberCache(len(self.paths), self._checked.open, _close_member, self.max_open, None)

    def member(self, k: int):
        """Member ``k``'s open, checked dataset (opened now if it is not); IndexError out of range."""
        if not 0 <= k < len(self.members):
            raise IndexError(f"{self.path}: member {k} is out of range for {plural(len(self.members), 'member')}")
        return self._members.get(int(k))

    def verify(self) -> None:
        """Check the manifest's set id, then open and verify every member (page CRCs, dataset id), one at a
        time. Raises what the member's ``verify()`` raises, naming the member, and the member errors of opening
        (missing, truncated, replaced)."""
        _verify(self)

    def close(self) -> None:
        """Close the open members and release the manifest's lease (a rewrite may then remove the members)."""
        self._members.close()
        self.info.lease.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ManyFileDataset(_ManyFileBase):
    """A many-file dataset of records, read as one (see the module docstring and ``formats/manyfile.md``).

    ``len(ds)`` records; ``ds[i]`` -> ``{field: value}`` and ``ds.read(i, field)`` as for
    :class:`~pageset.read.reader.Dataset` (global ids through the members in manifest order), iteration,
    ``verify()``; ``fields``, ``schema`` (the common schema), ``dataset_id`` (hex, the set's), ``page_size``,
    ``members`` (the manifest's :class:`~pageset.format.manifest.Member` entries), ``paths`` (member paths),
    ``info`` (:class:`ManyFileSet`), ``member(k)`` (member k's open :class:`Dataset`), ``member_of(i)`` ->
    ``(k, id within member k)``, ``records_per_page()``. At most ``max_open`` members are open at once.
    Use as a context manager or call ``close()``. Reading one record from several threads is safe as long as
    at most ``max_open`` members are in use at once.
    """

    kind, other_opener = "records", "open_tokens"

    def __init__(self, path, storage_options: dict | None = None, *, request_timeout: float = 30.0,
                 request_attempts: int = 5, max_open: int = MAX_OPEN_MEMBERS):
        from .reader import Dataset

        self._open_set(path, storage_options, request_timeout, request_attempts, max_open, Dataset)
        self.schema = self.manifest.schema
        self._starts = np.concatenate([[0], np.cumsum(self.info.records, dtype=np.int64)])

    @property
    def fields(self) -> dict:
        from ..format.schema import parse_schema

        return parse_schema(self.schema)[0]

    def member_of(self, i: int) -> tuple[int, int]:
        """``(member index, record index within it)`` of global record ``i``; IndexError / TypeError."""
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"record indices are ints, got {type(i).__name__}")
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{self.path}: record {i} is out of range for {n} records")
        i = int(i) % n
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        return k, i - int(self._starts[k])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> dict:
        k, j = self.member_of(i)
        return self.member(k)[j]

    def read(self, i: int, name: str):
        """Field ``name`` of global record ``i`` (see :meth:`Dataset.read`); KeyError / IndexError."""
        if name not in self.fields:
            raise KeyError(f"{self.path}: no field {name!r}; fields are {list(self.fields)}")
        k, j = self.member_of(i)
        return self.member(k).read(j, name)

    def __iter__(self):
        for k in range(len(self.members)):
            ds = self.member(k)
            for j in range(len(ds)):
                yield ds[j]

    def records_per_page(self) -> np.ndarray:
        """int64: the members' records-per-page arrays concatenated, in manifest order (from the manifest)."""
        return np.concatenate(self.info.records_per_page)

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}: {f.kind}" for n, f in self.fields.items())
        return (f"ManyFileDataset({self.path!r}, members={len(self.members)}, records={len(self)}, "
                f"fields={{{fields}}}, id={self.dataset_id[:12]})")


def _verify(ds) -> None:
    want = set_dataset_id([m.dataset_id for m in ds.members])
    if want != ds.dataset_id:  # parse_manifest checks it too; this is the end-to-end check
        raise FormatError(ds.info.manifest_path, "manifest", None, "the set's dataset id is not the digest of its "
                          "members' ids")
    for k in range(len(ds.members)):
        member = ds.member(k)
        try:
            member.verify()
        except FormatError as exc:
            raise type(exc)(exc.path, exc.section, exc.offset,
                            f"{exc.detail}; {ds._checked.context(k)}") from exc


class ManyFileTokens(_ManyFileBase):
    """A many-file dataset of token files, read as one stream of documents (``formats/manyfile.md`` section 7).

    ``len(td)`` tokens (all members); ``documents``; ``document(i)`` (global document ids through the members in
    manifest order); ``read(start, stop)`` (global token positions: the members' streams concatenated);
    ``num_windows(seq_len)`` (windows never cross members: the sum of each member's ``(T_k - 1) // seq_len``);
    ``window(w, seq_len)`` -> int array of ``seq_len + 1`` ids; ``eos_id``, ``bos_id``, ``dtype``, ``dataset_id``,
    ``members``, ``paths``, ``info``, ``member(k)`` (an open :class:`~pageset.read.tokens.TokenDataset`),
    ``verify()``, ``close()``. At most ``max_open`` members open at once."""

    kind, other_opener = "tokens", "open_dataset"

    def __init__(self, path, storage_options: dict | None = None, *, request_timeout: float = 30.0,
                 request_attempts: int = 5, max_open: int = MAX_OPEN_MEMBERS):
        from .tokens import TokenDataset

        self._open_set(path, storage_options, request_timeout, request_attempts, max_open, TokenDataset)
        tok = self.manifest.schema.get("tokens", {})
        self.dtype = np.dtype(tok.get("dtype", "uint16")).newbyteorder("<")
        self.eos_id, self.bos_id = tok.get("eos_id"), tok.get("bos_id")
        self.documents = self.manifest.documents
        self._tok = np.concatenate([[0], np.cumsum(self.info.tokens, dtype=np.int64)])
        self._docs = np.concatenate([[0], np.cumsum(self.info.documents, dtype=np.int64)])

    def __len__(self) -> int:
        return int(self._tok[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Token ids ``[start, stop)`` of the concatenated stream (clipped to ``[0, T]``), a new array."""
        start, stop = max(0, int(start)), min(len(self), int(stop))
        if stop <= start:
            return np.empty(0, self.dtype)
        parts = []
        k = int(np.searchsorted(self._tok, start, side="right")) - 1
        while start < stop:
            a, b = int(self._tok[k]), int(self._tok[k + 1])
            take = min(stop, b)
            if take > start:
                parts.append(self.member(k).read(start - a, take - a))
            start = max(start, take)
            k += 1
        return np.concatenate(parts)

    def document(self, i: int) -> np.ndarray:
        """Token ids of global document ``i`` (BOS/EOS included); IndexError / TypeError."""
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"document indices are ints, got {type(i).__name__}")
        d = self.documents
        if not -d <= i < d:
            raise IndexError(f"{self.path}: document {i} is out of range for {plural(d, 'document')}")
        i = int(i) % d
        k = int(np.searchsorted(self._docs, i, side="right")) - 1
        return self.member(k).document(i - int(self._docs[k]))

    def _windows(self, seq_len: int) -> np.ndarray:
        if not isinstance(seq_len, (int, np.integer)) or isinstance(seq_len, bool) or seq_len < 1:
            raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
        return np.maximum(np.asarray(self.info.tokens, np.int64) - 1, 0) // int(seq_len)

    def num_windows(self, seq_len: int) -> int:
        """Windows of ``seq_len + 1`` tokens at stride ``seq_len`` within each member, summed over members."""
        n = int(self._windows(seq_len).sum())
        if n == 0:
            raise ValueError(f"{self.path}: no member holds seq_len + 1 = {seq_len + 1} tokens: no window fits")
        return n

    def window(self, w: int, seq_len: int) -> np.ndarray:
        """Global window ``w``: ``seq_len + 1`` ids of the member holding it (windows run through the members
        in manifest order, member k's windows ``(T_k - 1) // seq_len`` of them)."""
        per = self._windows(seq_len)
        starts = np.concatenate([[0], np.cumsum(per)])
        if not 0 <= w < int(starts[-1]):
            raise IndexError(f"{self.path}: window {w} is out of range for {int(starts[-1])} windows")
        k = int(np.searchsorted(starts, w, side="right")) - 1
        local = int(w) - int(starts[k])
        return self.member(k).read(local * seq_len, local * seq_len + seq_len + 1)

    def __repr__(self) -> str:
        return (f"ManyFileTokens({self.path!r}, members={len(self.members)}, tokens={len(self)}, "
                f"documents={self.documents}, dtype={self.dtype.name}, id={self.dataset_id[:12]})")


__all__ = ["ManyFileDataset", "ManyFileTokens"]
