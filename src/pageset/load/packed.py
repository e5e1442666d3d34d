"""The token stage of packed rows: ``TokenWindows(seq_len, packing="best_fit")`` (formats/packing.md).

The packing (``ops.packing.pack_documents``) is computed once, when the Loader is built, from the file's
document offsets; its rows are the records the plan orders (``records_per_page`` counts the rows whose first
token lies in each page). A slice of rows is read as the byte spans of its pieces through the file's page
source (``pread`` runs, the process page cache, or a URL's pages) and laid out by one Numba kernel.
"""

from __future__ import annotations

import numpy as np

from ..ops import packing as pack_ops
from .stages import TokenRows, _to_torch


class PackedTokenStage(TokenRows):
    """A token file's documents -> packed rows: ``input``, ``target`` ([B, seq_len]), ``position_ids``,
    ``doc_ids``, ``labels`` ([B, seq_len]), ``cu_seqlens`` (int32[S + 1] over the flattened batch) and
    ``max_seqlen`` (int). ValueError naming the file when ``split_documents=False`` and a document does not fit
    a row, or when the file has no document of two or more tokens."""

    def __init__(self, name, ops, ds, pages, array_type):
        super().__init__(name, ops, ds, pages, array_type, docs=True)  # a slice: a few reads and one kernel call
        op = self.op
        self.packing = f"best_fit:pages={op.pack_pages if op.pack_pages else 'all'}"
        group = op.pack_pages * ds.page_size // self.itemsize if op.pack_pages else None
        pack_ops.prepare()
        self.rows = pack_ops.pack_documents(ds.doc_offsets, self.seq_len, group, op.split_documents, ds.path)
        self.n_records = self.rows.n_rows
        if not self.n_records:
            raise ValueError(f"{ds.path}: no document has two or more tokens: nothing to pack (a one-token document "
                             "holds no prediction)")
        # the kernel's form of the loss mask (formats/packing.md section 5): labels are -100 where the target
        # token's bit is 0; an empty array when the file has none
        self._kernel_mask = (np.zeros(0, np.uint8) if self.mask_bits is None
                             else np.asarray(self.mask_bits, dtype=np.uint8))

    def token_count(self) -> int:
        """Predictions of all rows: the columns that hold a target (a piece of m tokens fills m - 1), padding not
        counted; a Mixture weighted by tokens (``weight_unit="tokens"``) weighs the file by it."""
        return int((self.rows.piece_len - 1).sum())

    def records_per_page(self, page_count: int) -> np.ndarray:
        """int64[max(page_count, 1)]: rows whose first token lies in each page (formats/packing.md section 4)."""
        k = max(page_count, 1)
        pages = np.minimum(self.rows.first_tokens * self.itemsize // self.page_size, k - 1)
        return np.bincount(pages, minlength=k).astype(np.int64)

    def spans(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One absolute byte span per row, from its lowest to its highest piece byte (page checks, prefetch)."""
        counts, starts, lens = pack_ops.row_pieces(self.rows, np.asarray(ids, dtype=np.int64))
        if not counts.size:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])
        lo = np.minimum.reduceat(starts, first)
        hi = np.maximum.reduceat(starts + lens, first)
        return self.data_offset + lo * self.itemsize, (hi - lo) * self.itemsize

    def fill(self, arrays, lo, hi, ids, keys, ctx):
        counts, starts, lens = pack_ops.row_pieces(self.rows, ids)
        buf, _ = self.pages.gather(self.data_offset + starts * self.itemsize, lens * self.itemsize, ctx)
        tokens = buf[: int(lens.sum()) * self.itemsize].view(self.dtype)
        pack_ops.fill_packed(tokens, counts, lens, starts, self._kernel_mask, self.eos_id, arrays["input"][lo:hi],
                             arrays["target"][lo:hi], arrays["position_ids"][lo:hi], arrays["doc_ids"][lo:hi],
                             arrays["labels"][lo:hi])

    def handout(self, arrays, view):
        vals = {k: view(arrays[k]) for k in self.outputs}
        cu, max_len = pack_ops.packed_cu_seqlens(arrays["position_ids"])
        buf = arrays["cu_seqlens"][: cu.shape[0]]
        buf[...] = cu
        vals["cu_seqlens"] = view(buf)
        if self.to_tensor:
            vals = {k: _to_torch(v, None) for k, v in vals.items()}
        vals["max_seqlen"] = max_len
        return vals
