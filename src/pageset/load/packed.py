"""The stages of packed rows (formats/packing.md): a token file's documents (``TokenWindows(seq_len,
packing="best_fit")``, :class:`PackedTokenStage`) and a record file's TokenIds records packed whole
(``PadTokens(max_length, packing="best_fit")``, :class:`PackedIdsStage`).

The packing (``ops.packing.pack_documents``) is computed once, when the Loader is built, from the file's
document offsets; its rows are the records the plan orders (``records_per_page`` counts the rows whose first
token lies in each page). A slice of rows is read as the byte spans of its pieces through the file's page
source (``pread`` runs, the process page cache, or a URL's pages) and laid out by one Numba kernel.
"""

from __future__ import annotations

import numpy as np

from ..ops import packing as pack_ops
from ..ops import token_ids as token_id_ops
from .stages import DecodeError, PipelineError, TokenIdsStage, TokenRows, _to_torch


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
        lo, hi = _row_extent(counts, starts, starts + lens)
        return self.data_offset + lo * self.itemsize, (hi - lo) * self.itemsize

    def fill(self, arrays, lo, hi, ids, keys, ctx):
        counts, starts, lens = pack_ops.row_pieces(self.rows, ids)
        buf, _ = self.pages.gather(self.data_offset + starts * self.itemsize, lens * self.itemsize, ctx)
        tokens = buf[: int(lens.sum()) * self.itemsize].view(self.dtype)
        pack_ops.fill_packed(tokens, counts, lens, starts, self._kernel_mask, self.eos_id, arrays["input"][lo:hi],
                             arrays["target"][lo:hi], arrays["position_ids"][lo:hi], arrays["doc_ids"][lo:hi],
                             arrays["labels"][lo:hi])

    def handout(self, arrays, view):
        return _packed_handout(self, arrays, view, "position_ids", "cu_seqlens", "max_seqlen")


def _row_extent(counts: np.ndarray, lo_each: np.ndarray, hi_each: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)`` int64[n]: the lowest start and highest end of each row's parts, row j holding the next
    ``counts[j]`` (>= 1) entries of ``lo_each``/``hi_each`` (the parts' [start, end) in one unit)."""
    if not counts.size:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return np.minimum.reduceat(lo_each, first), np.maximum.reduceat(hi_each, first)


def _packed_handout(stage, arrays, view, pos_key: str, cu_key: str, max_key: str) -> dict:
    """A packed stage's batch: its outputs, ``cu_seqlens`` over the flattened position ids (in the slot's own
    buffer ``arrays[cu_key]``) and ``max_seqlen``; torch tensors when the stage hands them out."""
    vals = {k: view(arrays[k]) for k in stage.outputs}
    cu, max_len = pack_ops.packed_cu_seqlens(arrays[pos_key])
    buf = arrays[cu_key][: cu.shape[0]]
    buf[...] = cu
    vals[cu_key] = view(buf)
    if stage.to_tensor:
        vals = {k: _to_torch(v, None) for k, v in vals.items()}
    vals[max_key] = max_len
    return vals


class PackedIdsStage(TokenIdsStage):
    """A TokenIds field's records packed whole into rows of ``PadTokens.max_length`` columns (formats/packing.md
    section 8): the field's key holds the ids (int64[B, L]), ``<name>_attention_mask`` (1 on tokens),
    ``<name>_labels``, ``<name>_position_ids`` (int64[B, L]), ``<name>_cu_seqlens`` (int32[S + 1] over the
    flattened batch) and ``<name>_max_seqlen`` (int). The packing is computed once, when the Loader is built,
    from the index (record lengths, and image counts with ``ExpandImageTokens(images=...)``; without its
    ``tokens_per_image``, each image's tokens from its SmartResize size, every record's image-list head read once
    when the images' stage is linked: :meth:`link_image_tokens`); its rows are the
    records the plan orders, each read as its records' spans. PipelineError for a pipeline packing cannot run;
    ValueError naming the file, sample and field for a record longer than a row with ``truncation=False``."""

    windows = True  # the records the order counts are rows (n_records, records_per_page, spans, token_count)

    def __init__(self, name, ops, ds, pages, array_type):
        super().__init__(name, ops, ds, pages, array_type)
        op = self.op
        if op.keep_last_token:
            raise PipelineError(f"field {name!r}: PadTokens(packing='best_fit') packs records whole; "
                                "keep_last_token is for single captions")
        if self.expand is not None and self.expand.images is None:
            raise PipelineError(f"field {name!r}: packing counts each record's image tokens from its images' count: "
                                "give ExpandImageTokens(..., images='<the RGBImages field>')")
        L = self.seq_len = op.max_length
        self.packing = f"best_fit:pages={op.pack_pages if op.pack_pages else 'all'}:records"
        self._page_of = ds.record_pages()
        if self.image_tokens_from is None:  # weights from the index alone
            weights = self.counts.copy()
            if self.expand is not None:  # each placeholder becomes tokens_per_image tokens
                weights += self.expected * (self.expand.tokens_per_image - 1)
                self.packing += f":image_tokens={self.expand.tokens_per_image}"
            self._pack(weights)
        # else packed once the images' stage is linked (link_image_tokens): weights need each image's size
        self._rec_off = ds.index["_offset"].astype(np.int64)
        self._rec_len = ds.index["_length"].astype(np.int64)
        self.labels = True
        self.pos_key, self.cu_key, self.max_key = (f"{name}_position_ids", f"{name}_cu_seqlens",
                                                   f"{name}_max_seqlen")
        self.outputs[self.labels_key] = ((L,), np.dtype(np.int64), None)
        self.outputs[self.pos_key] = ((L,), np.dtype(np.int64), None)
        pack_ops.prepare()

    def _pack(self, weights) -> None:
        """Pack the records of ``weights`` (int64[n]: expanded lengths) into ``record_rows``."""
        L, op = self.seq_len, self.op
        long = np.flatnonzero(weights > L)
        if long.size and not op.truncation:
            i = int(long[0])
            raise ValueError(f"{self.path}: sample {i}, field {self.name!r}: {int(weights[i])} tokens, more than a "
                             f"row of PadTokens(max_length={L}) holds, and packing never splits a record (truncation="
                             "False): raise max_length, or allow truncation=True (it then fills a row alone, cut)")
        self.record_rows = pack_ops.pack_records(np.minimum(weights, L), self._page_of, L, op.pack_pages)
        self.n_records = self.record_rows.n_rows
        if not self.n_records:
            raise ValueError(f"{self.path}: field {self.name!r} has no record with a token: nothing to pack")

    def link_image_tokens(self, stage) -> None:
        """Take each image's tokens from ``stage`` (SmartResize), then pack: a record's weight is its ids plus
        each image's tokens less its placeholder (formats/packing.md section 8), from every record's image-list
        head, read once here."""
        super().link_image_tokens(stage)
        self.packing += f":image_tokens={stage.image_tokens_rule}"
        self._pack(self.counts + stage.record_image_tokens() - self.expected)

    def token_count(self) -> int:
        """Tokens of all rows (padding not counted); a Mixture weighted by tokens weighs the file by it."""
        return int(self.record_rows.weights[self.record_rows.records].sum())

    def records_per_page(self, page_count: int) -> np.ndarray:
        """int64[max(page_count, 1)]: rows whose first record lies in each page."""
        k = max(page_count, 1)
        pages = np.minimum(self._page_of[self.record_rows.first_records], k - 1)
        return np.bincount(pages, minlength=k).astype(np.int64)

    def spans(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One absolute byte span per row, from its lowest to its highest record byte (page checks, prefetch)."""
        counts, recs = self.record_rows.row_records(np.asarray(ids, dtype=np.int64))
        lo, hi = _row_extent(counts, self._rec_off[recs], self._rec_off[recs] + self._rec_len[recs])
        return lo, hi - lo

    def buffer_shapes(self, batch_size):
        shapes = super().buffer_shapes(batch_size)
        shapes[self.cu_key] = ((batch_size * self.seq_len + 1,), np.dtype(np.int32))
        return shapes

    def alloc(self, batch_size, empty):
        arrays = super().alloc(batch_size, empty)
        arrays[self.cu_key] = empty((batch_size * self.seq_len + 1,), np.dtype(np.int32))
        return arrays

    def fill(self, arrays, lo, hi, ids, keys, ctx):
        per_row, recs = self.record_rows.row_records(ids)
        image_id, per_image, image_tokens, starts, expected, status = self._expand_args(recs, ctx)
        buf, offs, counts = self._gather(recs, ctx)
        bad = token_id_ops.pack_rows(buf, offs, counts, self.itemsize, self.has_mask, image_id, per_image,
                                     image_tokens, starts, expected, per_row, arrays[self.name][lo:hi], arrays[self.mask_key][lo:hi],
                                     arrays[self.labels_key][lo:hi], arrays[self.pos_key][lo:hi], self.pad_id,
                                     self.truncate, status)
        if bad < 0:
            return
        sample, why, found = int(recs[bad]), int(status[0]), int(status[1])
        if why == token_id_ops.TOO_LONG:
            raise DecodeError(f"{self.path}: sample {sample}, field {self.name!r}: {found} tokens, more than its "
                              "packed row holds (the stored ids disagree with the index: a damaged page); check the "
                              "file with `pageset verify`", sample)
        self._image_error(sample, why, found, int(expected[bad]))

    def handout(self, arrays, view):
        return _packed_handout(self, arrays, view, self.pos_key, self.cu_key, self.max_key)
