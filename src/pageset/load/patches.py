"""An RGBImages field loaded at dynamic resolution (``SmartResize``: Qwen2-VL's image input): every image of a
row resized to its own patch grid and handed out as flattened patches with its grid size, through one nogil kernel
call per slice (``ops.patches.patch_slice``)."""

from __future__ import annotations

import numpy as np

from ..ops import image_lists
from ..ops import patches as patch_ops
from ..ops.image_lists import ENTRY_BYTES
from ..ops.transforms import Normalize, SmartResize
from .parts import Stage, _to_torch
from .stages import DecodeError, PipelineError, _decode_retried, _image_of, _pixel_table, _scratch, _split_common


class PatchImagesStage(Stage):
    """RGBImages + ``[SmartResize(...), Normalize?, ToTensor?, ToDevice?]`` -> ``<name>`` ``[B, P, D]`` (row j's
    images' patches back to back from patch 0, zero after them; D = ``3 * temporal_patch_size * patch_size**2``;
    P = ``max_pixels_per_row / patch_size**2``, default M * max_pixels / patch_size**2), ``<name>_grid_thw``
    int64[B, M, 3] (``(1, grid_h, grid_w)`` per image, zero past the row's images) and ``<name>_counts`` int64[B];
    M: the file's most images in a record (a mixture's or set's widest file's). Declares ``sizes_images``: a
    TokenIds field's ``ExpandImageTokens`` without ``tokens_per_image`` takes each image's token count from
    :meth:`image_tokens`."""

    sizes_images = True
    variable_width = True  # M: the file's most images in a record (in a mixture or set the widest file's)
    reads_rows = True  # packed rows (read_rows): a row's patches are its records' images', in token order

    def __init__(self, name, ops, ds, pages, array_type):
        self.name, self.path, self.pages = name, ds.path, pages
        rest, self.to_tensor, self.to_device = _split_common(name, ops, array_type)
        op = self.op = rest[0]
        normalize = None
        for o in rest[1:]:
            if not isinstance(o, Normalize) or normalize is not None:
                raise PipelineError(f"field {name!r}: unexpected {o!r}; a SmartResize pipeline reads [SmartResize(...), "
                                    "Normalize?, ToTensor?, ToDevice?] (no crop or flip: the whole image is resized)")
            normalize = o
        self.table, self.torch_dtype = _pixel_table(name, normalize, self.to_tensor)
        self.fast = op.resize_mode == "fast"
        self.patch, self.merge, self.temporal = op.patch_size, op.merge_size, op.temporal_patch_size
        self.dim = 3 * self.temporal * self.patch * self.patch
        ix = ds.index
        self.offs = ix[f"{name}.offset"].astype(np.int64)
        self.lens = ix[f"{name}.length"].astype(np.int64)
        self.counts = ix[f"{name}.count"].astype(np.int64)
        self.max_len = int(self.counts.max()) if self.counts.size else 0
        budget = op.max_pixels_per_row if op.max_pixels_per_row is not None else max(self.max_len, 1) * op.max_pixels
        self.max_patches = budget // (self.patch * self.patch)
        self.grid_key, self.counts_key = f"{name}_grid_thw", f"{name}_counts"
        self.rows = None  # packed rows (read_rows), or None: a record a row
        self._scan = None  # (grid_h, grid_w, tokens, first image of each record) of every image, once read
        # what a packing's state names: the rule giving each image's tokens (formats/packing.md section 8)
        self.image_tokens_rule = f"smart_resize({op.min_pixels},{op.max_pixels},{op.patch_size},{op.merge_size})"
        self.outputs = {name: ((self.max_patches, self.dim), self.table.dtype, self.torch_dtype),
                        self.grid_key: ((self.max_len, 3), np.dtype(np.int64), None),
                        self.counts_key: ((), np.dtype(np.int64), None)}
        image_lists.prepare()
        patch_ops.prepare()

    def alloc(self, batch_size, empty):
        """The slot's buffers, zeroed once where they are writable (a shared-memory slot is a new, zero file):
        from then on :meth:`fill` keeps every patch past a row's images zero by clearing only what the row's
        previous images held (read from the slot's own grids), not the whole budget (tens of MB a row)."""
        arrays = super().alloc(batch_size, empty)
        for arr in arrays.values():
            if arr.flags.writeable:
                arr.fill(0)
        return arrays

    def _grids(self, records, heights, widths, counts, ctx):
        """(grid_h, grid_w, tokens) int64[m] of the images of ``records``; DecodeError for an aspect Qwen2-VL
        refuses."""
        m = heights.shape[0]
        gh, gw, tokens = (_scratch(ctx, f"patch_{k}", m, np.int64)[:m] for k in ("grid_h", "grid_w", "tokens"))
        op = self.op
        bad = patch_ops.image_grids(heights, widths, self.patch, self.merge, op.min_pixels, op.max_pixels, gh, gw,
                                    tokens)
        if bad >= 0:
            q, k = _image_of(counts, bad)
            raise DecodeError(f"{self.path}: sample {int(records[q])}, field {self.name!r}, image {k}: "
                              f"{int(heights[bad])} x {int(widths[bad])} pixels, an aspect ratio over "
                              f"{patch_ops.MAX_ASPECT} that SmartResize (as Qwen2-VL) refuses; crop or drop the image "
                              "when writing", int(records[q]))
        return gh, gw, tokens

    def image_tokens(self, records, ctx):
        """``(tokens int64[m], starts int64[n])``: each image's token count (``grid_h * grid_w / merge_size**2``
        after SmartResize) of ``records``, record after record, from the image lists' heads only (count and
        entries: ``4 + 16 * count`` bytes a record; or from the whole file's, read once for a packing), and where
        each record's images start."""
        counts = self.counts[records]
        starts = np.cumsum(counts) - counts
        if self._scan is not None:
            _, _, tokens, first = self._scan
            return tokens[np.repeat(first[records] - starts, counts) + np.arange(int(counts.sum()))], starts
        return self._head_grids(records, ctx)[2], starts

    def _head_grids(self, records, ctx):
        """``(grid_h, grid_w, tokens)`` int64[m] of the images of ``records`` from their image lists' heads (count
        and entries: ``4 + 16 * count`` bytes a record); nothing is read when they hold no image."""
        counts = self.counts[records]
        m = int(counts.sum())
        if m == 0:  # text-only records (or a Mixture member without images)
            return (np.zeros(0, dtype=np.int64),) * 3
        buf, offs = self.pages.gather(self.offs[records], 4 + ENTRY_BYTES * counts, ctx, ordered=False)
        heights, widths = (_scratch(ctx, f"patch_head_{k}", m, np.int64)[:m] for k in ("heights", "widths"))
        bad = image_lists.sizes(buf, offs, counts, heights, widths)
        if bad >= 0:
            raise self._damaged(records, bad)
        return self._grids(records, heights, widths, counts, ctx)

    def _scan_all(self):
        """``(grid_h, grid_w, tokens, first)`` of every image of the file (int64; ``first[i]``: record i's first
        image), from every record's image-list head, read once (a packing needs every record's weight)."""
        if self._scan is None:
            grids = self._head_grids(np.arange(self.counts.shape[0], dtype=np.int64), {})
            self._scan = (*(g.copy() for g in grids), np.cumsum(self.counts) - self.counts)
        return self._scan

    def record_image_tokens(self) -> np.ndarray:
        """int64[n]: each record's image tokens in all (the sum over its images), for a packing's weights."""
        _, _, tokens, _ = self._scan_all()
        owner = np.repeat(np.arange(self.counts.shape[0], dtype=np.int64), self.counts)
        return np.bincount(owner, weights=tokens, minlength=self.counts.shape[0]).astype(np.int64)

    def read_rows(self, rows) -> None:
        """Hand out packed rows (``rows``: ops.packing.RecordRows): row j's patches are every image of its records,
        record after record (their image tokens' order); its grids likewise. M and P are the most images and the
        most patches a row holds (P: ``max_pixels_per_row / patch_size**2`` when given, a ValueError naming the
        row's records when a row needs more)."""
        gh, gw, _, _ = self._scan_all()
        self.rows = rows
        owner = np.repeat(np.arange(self.counts.shape[0], dtype=np.int64), self.counts)
        per_record = np.bincount(owner, weights=gh * gw, minlength=self.counts.shape[0]).astype(np.int64)
        row_of = np.repeat(np.arange(rows.n_rows, dtype=np.int64), np.diff(rows.row_ptr))
        row_images = np.bincount(row_of, weights=self.counts[rows.records], minlength=rows.n_rows).astype(np.int64)
        row_patches = np.bincount(row_of, weights=per_record[rows.records], minlength=rows.n_rows).astype(np.int64)
        self.max_len = int(row_images.max(initial=0))
        most = int(row_patches.max(initial=0))
        if self.op.max_pixels_per_row is not None:
            if most > self.max_patches:
                r = int(np.argmax(row_patches))
                recs = rows.records[rows.row_ptr[r] : rows.row_ptr[r + 1]].tolist()
                raise ValueError(f"{self.path}: field {self.name!r}: packed row {r} (samples {recs}) takes "
                                 f"{most * self.patch ** 2} pixels after SmartResize, more than max_pixels_per_row="
                                 f"{self.op.max_pixels_per_row}; raise it, leave it None (the most a row takes) or "
                                 "lower max_length")
        else:
            self.max_patches = max(most, 1)
        shape, dtype, torch_dtype = self.outputs[self.name]
        self.outputs[self.name] = ((self.max_patches, self.dim), dtype, torch_dtype)
        self.outputs[self.grid_key] = ((self.max_len, 3), np.dtype(np.int64), None)
        self.segments_key = f"{self.name}_segments"  # int64[B, M]: each image's conversation in its row, or -1
        self.outputs[self.segments_key] = ((self.max_len,), np.dtype(np.int64), None)

    def _damaged(self, records, bad):
        return DecodeError(f"{self.path}: sample {int(records[bad])}, field {self.name!r}: the stored image list does "
                           "not match its index entry (damaged page); check the file with `pageset verify`",
                           int(records[bad]))

    def fill(self, arrays, lo, hi, ids, keys, ctx):
        out, grid = arrays[self.name][lo:hi], arrays[self.grid_key][lo:hi]
        n, room = ids.shape[0], out.shape[1]
        if self.rows is None:  # a record a row
            records, row_of_record = ids, np.arange(n, dtype=np.int64)
        else:  # packed rows: each row's records back to back
            per_row, records = self.rows.row_records(ids)
            row_of_record = np.repeat(np.arange(n, dtype=np.int64), per_row)
        counts = self.counts[records]
        rows = np.repeat(row_of_record, counts)  # each image's output row
        row_counts = np.bincount(rows, minlength=n).astype(np.int64)
        arrays[self.counts_key][lo:hi] = row_counts
        if self.rows is not None:  # which of its row's records (segments) each image belongs to; -1: no image
            segments = arrays[self.segments_key][lo:hi]
            segments[:] = -1
            position = np.arange(records.shape[0]) - np.repeat(np.cumsum(per_row) - per_row, per_row)
            segments[rows, np.arange(rows.shape[0]) - np.repeat(np.cumsum(row_counts) - row_counts, row_counts)] = (
                np.repeat(position, counts))
        held = grid.prod(-1).sum(-1)  # patches each row held before (its grids; 0 in a new, zeroed buffer)
        m = int(counts.sum())
        if m == 0:
            for j in range(n):
                out[j, : held[j]] = 0
            grid[:] = 0
            return
        buf, offs = self.pages.gather(self.offs[records], self.lens[records], ctx, ordered=False)
        img_offs, img_lens, heights, widths, slots = (_scratch(ctx, f"images_{k}", m, np.int64)[:m]
                                                      for k in ("offs", "lens", "heights", "widths", "rows"))
        encodings = _scratch(ctx, "images_encodings", m, np.uint8)[:m]
        first = _scratch(ctx, "images_first", n, np.int64)[:n]
        first[:] = 0
        bad = image_lists.entries(buf, offs, self.lens[records], counts, first, img_offs, img_lens, heights, widths,
                                  encodings, slots)
        if bad >= 0:
            raise self._damaged(records, bad)
        gh, gw, _ = self._grids(records, heights, widths, counts, ctx)
        per_image = gh * gw
        row_start = np.cumsum(row_counts) - row_counts  # each row's first image in the slice
        slot = np.arange(m) - row_start[rows]  # each image's place among its row's images
        image_start = np.cumsum(per_image) - per_image  # patches before each image in the slice
        firsts = image_start - image_start[row_start[rows]]  # where each image starts in its row
        totals = np.bincount(rows, weights=per_image, minlength=n).astype(np.int64)
        over = np.flatnonzero(totals > room)
        if over.size:  # a record a row (a packed row's patches were counted when it was made)
            j = int(over[0])
            need = int(totals[j]) * self.patch * self.patch
            raise DecodeError(f"{self.path}: sample {int(ids[j])}, field {self.name!r}: its {int(row_counts[j])} "
                              f"images take {need} pixels after SmartResize, more than max_pixels_per_row="
                              f"{room * self.patch ** 2}; raise max_pixels_per_row (or lower max_pixels)", int(ids[j]))
        for j in range(n):  # patches past a row's images are zero: clear what its previous images left there
            if held[j] > totals[j]:
                out[j, totals[j] : held[j]] = 0
        grid[:] = 0
        grid[rows, slot, 0] = 1
        grid[rows, slot, 1] = gh
        grid[rows, slot, 2] = gw
        scales = _scratch(ctx, "patch_scales", 2 * m, np.int64)[: 2 * m].reshape(m, 2)
        need_dec, need_jpeg, need_rs, need_img = patch_ops.plan_patches(heights, widths, encodings, gh, gw, self.patch,
                                                                        scales)
        resize_scratch = _scratch(ctx, "resize_scratch", need_rs, np.int32)
        image = _scratch(ctx, "patch_image", need_img, self.table.dtype)
        bad, why = _decode_retried(ctx, encodings, heights, widths, m, need_dec, need_jpeg,
                                   lambda handle, decoded, jpeg_scratch, status: patch_ops.patch_slice(
                                       handle, buf, img_offs, img_lens, heights, widths, encodings, gh, gw, scales,
                                       rows, firsts, self.table, out, self.patch, self.merge, self.temporal, decoded,
                                       jpeg_scratch, resize_scratch, image, status, self.fast))
        if bad >= 0:
            q, k = _image_of(counts, bad)
            raise DecodeError(f"{self.path}: sample {int(records[q])}, field {self.name!r}, image {k}: {why}",
                              int(records[q]))

    def handout(self, arrays, view):
        vals = {k: view(arrays[k]) for k in self.outputs}
        if self.to_tensor:
            vals = {k: _to_torch(v, self.outputs[k][2]) for k, v in vals.items()}
        return vals


def is_patch_pipeline(ops) -> bool:
    """Whether an RGBImages field's pipeline starts with SmartResize (dynamic resolution)."""
    return bool(ops) and isinstance(ops[0], SmartResize)
