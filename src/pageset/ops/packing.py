"""Packing a token file's documents into rows of ``seq_len`` columns by best-fit decreasing (formats/packing.md).

A document of n tokens is cut into *pieces* of at most ``seq_len + 1`` tokens that overlap by one token
(:func:`document_pieces`); a piece of m tokens fills m - 1 columns of a row (input = its first m - 1 tokens,
target = its last m - 1), so every next-token prediction of a document lies in exactly one piece. The pieces of
each group of consecutive pages are packed into rows of ``seq_len`` columns by best-fit decreasing
(:func:`best_fit_decreasing`, a Numba kernel: O(P log seq_len) with a segment tree over the bins' remaining
capacities), as in "Fewer Truncations Improve Language Modeling" (Ding et al. 2024, arXiv 2404.10830) and
OLMo-core's packing; :func:`pack_documents` gives the rows (:class:`PackedRows`, CSR lists of pieces, sorted by
their first token). :func:`fill_packed` writes rows into a batch (input, target, position_ids, doc_ids, labels).

Pure: arrays in, arrays out; nothing here opens a file.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numba
import numpy as np

from .tokens import IGNORE_INDEX


@dataclass(frozen=True)
class PackedRows:
    """Rows of a packing, sorted by their first token (formats/packing.md section 4).

    ``row_ptr`` int64[R + 1]: row r holds pieces ``row_ptr[r] : row_ptr[r + 1]`` (in row order);
    ``piece_start`` int64[P]: each piece's first token (an offset into the token stream); ``piece_len`` int64[P]:
    its tokens (2 .. seq_len + 1; it fills ``piece_len - 1`` columns); ``seq_len``: columns per row;
    ``documents``: documents with at least one piece; ``cut``: documents split into two or more pieces.
    """

    row_ptr: np.ndarray
    piece_start: np.ndarray
    piece_len: np.ndarray
    seq_len: int
    documents: int
    cut: int

    @property
    def n_rows(self) -> int:
        return int(self.row_ptr.shape[0] - 1)

    @property
    def first_tokens(self) -> np.ndarray:
        """int64[R]: the first token of each row (its first piece's start): ascending."""
        return self.piece_start[self.row_ptr[:-1]]

    def padding_fraction(self) -> float:
        """Padding columns over all columns, ``1 - sum(piece_len - 1) / (R * seq_len)`` (0.0 for no rows)."""
        total = self.n_rows * self.seq_len
        return 1.0 - float((self.piece_len - 1).sum()) / total if total else 0.0


def document_pieces(doc_offsets, seq_len: int, split: bool = True, path: str = "") -> tuple[np.ndarray, np.ndarray]:
    """The pieces of every document (formats/packing.md section 1), in document order.

    doc_offsets: int[D + 1] token offsets (``formats/v1.md`` section 10); seq_len >= 1. Document i (n tokens)
    gives no piece when n < 2, else pieces j = 0 .. ceil((n - 1) / seq_len) - 1: tokens
    ``[o_i + j * seq_len, o_i + min(j * seq_len + seq_len + 1, n))``. Returns ``(starts, lengths)`` int64[P].

    ``split=False``: ValueError naming ``path``, the first document longer than ``seq_len + 1`` tokens and the
    fix, instead of cutting it.
    """
    off = np.asarray(doc_offsets, dtype=np.int64)
    n = np.diff(off)
    k = np.where(n >= 2, -(-(n - 1) // seq_len), 0)  # pieces per document
    if not split and (k > 1).any():
        i = int(np.flatnonzero(k > 1)[0])
        raise ValueError(f"{path}: document {i} has {int(n[i])} tokens, more than seq_len + 1 = {seq_len + 1}, and "
                         "TokenWindows(split_documents=False) never cuts a document: use a larger seq_len, or "
                         "split_documents=True (pieces of seq_len + 1 tokens, overlapping by one)")
    total = int(k.sum())
    doc = np.repeat(np.arange(n.shape[0], dtype=np.int64), k)
    j = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(k) - k, k)  # piece number within its document
    starts = off[:-1][doc] + j * seq_len
    lengths = np.minimum(seq_len + 1, n[doc] - j * seq_len)
    return starts, lengths


@numba.njit(nogil=True)
def _tree_add(tree, size, c, delta):
    i = size + c
    while i >= 1:
        tree[i] += delta
        i >>= 1


@numba.njit(nogil=True)
def _tree_first(tree, size, w):
    """The smallest capacity c >= w with a bin (tree[size + c] > 0), or -1."""
    i = size + w
    if tree[i] > 0:
        return w
    while i > 1:
        if i & 1 == 0 and tree[i + 1] > 0:
            i += 1
            break
        i >>= 1
    else:
        return -1
    while i < size:
        i = 2 * i if tree[2 * i] > 0 else 2 * i + 1
    return i - size


@numba.njit(nogil=True)
def best_fit_decreasing(weights, group_ptr, capacity, bin_of):
    """Best fit of the items ``weights`` (int64[n], each in ``[1, capacity]``, already in placement order: each
    group's items by weight descending) into bins of ``capacity``; items ``group_ptr[g] : group_ptr[g + 1]``
    (int64[groups + 1]) are one group, packed into bins of their own.

    Each item goes to the bin with the smallest remaining capacity >= its weight, among those the bin placed into
    most recently; to a new bin when none fits. Writes ``bin_of[i]`` (int64[n]): bins numbered in the order they
    were opened, over all groups. Returns the number of bins. O(n log capacity).
    """
    n = weights.shape[0]
    size = 1
    while size < capacity + 1:
        size *= 2
    tree = np.zeros(2 * size, dtype=np.int64)  # leaf size + c: bins with remaining capacity c; nodes: sums
    head = np.full(capacity + 1, -1, dtype=np.int64)  # the bin placed into last among those with capacity c
    nxt = np.empty(n, dtype=np.int64)  # the previous one (a stack per capacity)
    remaining = np.empty(n, dtype=np.int64)
    n_bins = 0
    for g in range(group_ptr.shape[0] - 1):
        first_bin = n_bins
        for i in range(group_ptr[g], group_ptr[g + 1]):
            w = weights[i]
            c = _tree_first(tree, size, w)
            if c < 0:
                b = n_bins
                n_bins += 1
                r = capacity - w
            else:
                b = head[c]
                head[c] = nxt[b]
                _tree_add(tree, size, c, -1)
                r = c - w
            remaining[b] = r
            nxt[b] = head[r]
            head[r] = b
            _tree_add(tree, size, r, 1)
            bin_of[i] = b
        for b in range(first_bin, n_bins):  # the next group starts with no bins
            _tree_add(tree, size, remaining[b], -1)
            head[remaining[b]] = -1
    return n_bins


def pack_documents(doc_offsets, seq_len: int, group_tokens: int | None = None, split: bool = True,
                   path: str = "") -> PackedRows:
    """The packing of a token file (formats/packing.md): pieces, groups, best-fit decreasing, rows.

    doc_offsets: int[D + 1]; seq_len >= 1: columns per row; group_tokens: tokens per group (pieces whose first
    token t has the same ``t // group_tokens`` share rows; None: one group, the whole file); split: see
    :func:`document_pieces`. A pure function of these: the same rows in every process and epoch.
    """
    starts, lengths = document_pieces(doc_offsets, seq_len, split, path)
    weights = lengths - 1
    groups = (starts // group_tokens) if group_tokens else np.zeros(starts.shape[0], dtype=np.int64)
    perm = np.lexsort((starts, -weights, groups))  # placement order: group, weight descending, first token
    g = groups[perm]
    group_ptr = np.flatnonzero(np.concatenate([[True], g[1:] != g[:-1], [True]])) if g.size else np.zeros(1, np.int64)
    bin_of = np.empty(perm.shape[0], dtype=np.int64)
    n_bins = best_fit_decreasing(weights[perm], group_ptr.astype(np.int64), int(seq_len), bin_of)
    by_bin = np.argsort(bin_of, kind="stable")  # the pieces bin by bin, each bin's in placement order
    pieces = perm[by_bin]
    counts = np.bincount(bin_of, minlength=n_bins)
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rows = np.argsort(starts[pieces[ptr[:-1]]], kind="stable")  # rows by their first piece's first token
    counts = counts[rows]
    row_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    take = pieces[np.arange(row_ptr[-1], dtype=np.int64) + np.repeat(ptr[:-1][rows] - row_ptr[:-1], counts)]
    off = np.asarray(doc_offsets, dtype=np.int64)
    n = np.diff(off)
    return PackedRows(row_ptr, starts[take], lengths[take], int(seq_len), int((n >= 2).sum()),
                      int((n - 1 > seq_len).sum()))


@dataclass(frozen=True)
class RecordRows:
    """Records packed whole into rows (formats/packing.md section 8): row r holds records
    ``records[row_ptr[r] : row_ptr[r + 1]]`` (int64, ascending ids), rows sorted by their first record;
    ``weights`` int64[n_records]: each record's columns (its tokens, at most ``capacity``); ``capacity``: columns
    per row."""

    row_ptr: np.ndarray
    records: np.ndarray
    weights: np.ndarray
    capacity: int

    @property
    def n_rows(self) -> int:
        return int(self.row_ptr.shape[0] - 1)

    @property
    def first_records(self) -> np.ndarray:
        """int64[R]: each row's first (lowest) record id: ascending."""
        return self.records[self.row_ptr[:-1]]

    def row_records(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(counts int64[n], records int64[sum(counts)])``: the records of rows ``ids``, row after row."""
        first = self.row_ptr[ids]
        counts = self.row_ptr[ids + 1] - first
        ends = np.cumsum(counts)
        idx = np.arange(int(ends[-1]) if ends.size else 0, dtype=np.int64) + np.repeat(first - (ends - counts), counts)
        return counts, self.records[idx]

    def padding_fraction(self) -> float:
        """Padding columns over all columns, ``1 - sum(weights of packed records) / (R * capacity)``."""
        total = self.n_rows * self.capacity
        return 1.0 - float(self.weights[self.records].sum()) / total if total else 0.0


def pack_records(weights, record_pages, capacity: int, pack_pages: int | None) -> RecordRows:
    """Records of ``weights`` columns (int[n], each in ``[0, capacity]``; 0: the record takes no row) packed
    whole into rows of ``capacity`` columns by best-fit decreasing (formats/packing.md section 8): records whose
    page (``record_pages`` int[n]) has the same ``page // pack_pages`` share rows (None: one group); within a
    group by weight descending, ties by record id. A pure function of its arguments."""
    w = np.asarray(weights, dtype=np.int64)
    keep = np.flatnonzero(w > 0)
    pages = np.asarray(record_pages, dtype=np.int64)[keep]
    groups = pages // pack_pages if pack_pages else np.zeros(keep.shape[0], dtype=np.int64)
    o = np.lexsort((keep, -w[keep], groups))  # placement order: group, weight descending, id
    perm, g = keep[o], groups[o]
    group_ptr = (np.flatnonzero(np.concatenate([[True], g[1:] != g[:-1], [True]])) if g.size
                 else np.zeros(1, np.int64))
    bin_of = np.empty(perm.shape[0], dtype=np.int64)
    n_bins = best_fit_decreasing(w[perm], group_ptr.astype(np.int64), int(capacity), bin_of)
    by_row = np.lexsort((perm, bin_of))  # each bin's records by id
    recs, bins = perm[by_row], bin_of[by_row]
    counts = np.bincount(bins, minlength=n_bins)
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rows = np.argsort(recs[ptr[:-1]], kind="stable") if n_bins else np.zeros(0, np.int64)  # by first record
    counts = counts[rows]
    row_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    take = np.arange(row_ptr[-1], dtype=np.int64) + np.repeat(ptr[:-1][rows] - row_ptr[:-1], counts)
    return RecordRows(row_ptr, recs[take].astype(np.int64), w, int(capacity))


def row_pieces(rows: PackedRows, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(counts int64[n], starts int64[P'], lengths int64[P'])``: the pieces of rows ``ids``, row after row."""
    first = rows.row_ptr[ids]
    counts = rows.row_ptr[ids + 1] - first
    ends = np.cumsum(counts)
    idx = np.arange(int(ends[-1]) if ends.size else 0, dtype=np.int64) + np.repeat(first - (ends - counts), counts)
    return counts, rows.piece_start[idx], rows.piece_len[idx]


@numba.njit(nogil=True)
def fill_packed(tokens, counts, lengths, starts, mask, eos_id, inp, tgt, pos, doc, lab):
    """Write packed rows (formats/packing.md section 5) into ``inp`` (int64|int32[n, L]), ``tgt``, ``pos``,
    ``lab`` (int64[n, L]) and ``doc`` (int32[n, L]).

    tokens: the pieces' tokens back to back (file dtype), rows in order, each row's pieces in order; counts
    int64[n] pieces per row; lengths, starts int64[P']: each piece's tokens and first token; mask: a loss mask
    (uint8[ceil(count / 8)], token t is bit t % 8 of byte t // 8, 1 = trained on) or an empty array (none).
    Padding columns: input ``eos_id``, target and label -100, position_ids counting from 0, doc_ids -1.
    """
    L = inp.shape[1]
    t = 0
    p = 0
    has_mask = mask.shape[0] > 0
    for r in range(counts.shape[0]):
        c = 0
        for k in range(counts[r]):
            m = lengths[p]
            s = starts[p]
            for j in range(m - 1):
                v = tokens[t + j + 1]
                inp[r, c] = tokens[t + j]
                tgt[r, c] = v
                pos[r, c] = j
                doc[r, c] = k
                if has_mask:
                    a = s + j + 1
                    lab[r, c] = v if (mask[a >> 3] >> (a & 7)) & 1 else IGNORE_INDEX
                else:
                    lab[r, c] = v
                c += 1
            t += m
            p += 1
        for j in range(L - c):
            inp[r, c + j] = eos_id
            tgt[r, c + j] = IGNORE_INDEX
            pos[r, c + j] = j
            doc[r, c + j] = -1
            lab[r, c + j] = IGNORE_INDEX


def packed_cu_seqlens(position_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """``(cu_seqlens int32[S + 1], max_seqlen)`` over the flattened batch ``[B, L]``: a segment starts at every
    column whose position id is 0 (each piece, and each row's padding); the last entry is ``B * L``."""
    b, length = position_ids.shape
    if b * length >= 2**31:
        raise ValueError(f"B * L = {b * length} does not fit int32 cu_seqlens")
    starts = np.flatnonzero(position_ids.ravel() == 0)
    cu = np.empty(starts.size + 1, dtype=np.int32)
    cu[:-1] = starts
    cu[-1] = b * length
    return cu, int(np.diff(cu).max()) if cu.size > 1 else 0


@functools.cache
def prepare() -> None:
    """Enable the on-disk cache of this module's kernels (run time, never at import; idempotent)."""
    if not numba.config.DISABLE_JIT:
        try:
            for kernel in (best_fit_decreasing, fill_packed, _tree_add, _tree_first):
                kernel.enable_caching()
        except RuntimeError:
            pass
