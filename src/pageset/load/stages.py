"""One stage per loaded field: its batch buffers (shape and dtype fixed at construction), how a thread fills
rows ``[lo, hi)`` of them for a slice of sample ids, and how a filled buffer is handed to the user."""

from __future__ import annotations

import json

import numpy as np
import torch

from ..format.errors import plural
from ..format.fields import NDArray
from ..ops import image as image_ops
from ..ops import image_batch, image_lists, jpeg, spans
from ..ops import token_ids as token_id_ops
from ..ops import tokens as token_ops
from ..ops.transforms import (
    BytesDecoder,
    CenterCrop,
    ExpandImageTokens,
    JSONDecoder,
    NDArrayDecoder,
    Normalize,
    PadTokens,
    RandomHorizontalFlip,
    RandomResizedCrop,
    TokenWindows,
    ToTensor,
    ToTorchImage,
)
from .parts import Stage, _to_torch


class PipelineError(ValueError):
    """A field's pipeline is not a valid sequence of ops (raised at Loader construction)."""


class DecodeError(ValueError):
    """A stored record could not be decoded while loading; names the file, sample index and field. ``sample``:
    the sample's id in what the message names (None where unknown)."""

    def __init__(self, message: str, sample: int | None = None):
        super().__init__(message)
        self.sample = sample

    def __reduce__(self):  # pickled with its sample (process mode forwards it)
        return type(self), (str(self), self.sample)


def _numpy_refuses(name, op) -> PipelineError:
    return PipelineError(f"field {name!r}: {type(op).__name__} hands out torch tensors, but the Loader was made "
                         "with array_type='numpy' (one array type per batch): remove it, or use the default "
                         "array_type='torch'")


def _split_common(name, ops, array_type):
    """(ops without ToTensor/ToDevice, to_tensor flag, ToDevice op or None). With ``array_type="torch"`` every
    field is handed out as torch tensors (``ToTensor`` is then implied); with ``"numpy"``, ToTensor/ToDevice
    are refused."""
    rest, to_tensor, to_device = [], array_type == "torch", None
    seen_tail = False
    for op in ops:
        if isinstance(op, ToTensor) or getattr(op, "is_to_device", False):
            if array_type == "numpy":
                raise _numpy_refuses(name, op)
            seen_tail = True
            if not isinstance(op, ToTensor):
                to_device = op
        else:
            if seen_tail:
                raise PipelineError(f"field {name!r}: {type(op).__name__} comes after ToTensor/ToDevice; "
                                    "put ToTensor and ToDevice last")
            rest.append(op)
    return rest, to_tensor, to_device


def _pixel_table(name, normalize, to_tensor):
    """``(table, torch_dtype)`` of an image pipeline: the [3, 256] value table of ``normalize`` (a Normalize op, or
    None: uint8 pixels) and the torch dtype to view its float16/bfloat16 buffer as (None: the buffer's own)."""
    if normalize is None:
        return image_ops.pixel_table(), None
    if normalize.dtype == "bfloat16" and not to_tensor:
        raise PipelineError(f"field {name!r}: numpy has no bfloat16; use the default array_type='torch'")
    return (image_ops.normalize_table(normalize.dtype, normalize.mean, normalize.std),
            {"float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16}[normalize.dtype])


def _decode_retried(ctx, encodings, heights, widths, n, need_dec, need_jpeg, kernel):
    """Run an image kernel over a slice of ``n`` images, ``kernel(handle, decoded, jpeg_scratch, status) -> bad``
    (the first image that failed, or -1), with the thread's JPEG decoder and scratch; a JPEG whose chroma sampling
    cannot be cropped (ERR_SCRATCH) is decoded once more whole. ``(-1, "")``, or the first image that failed and
    what to tell the user."""
    if "decoder" not in ctx and (encodings != 0).any():
        ctx["decoder"] = jpeg.JpegDecoder()
    handle = ctx["decoder"].handle if "decoder" in ctx else 0
    status = _scratch(ctx, "status", n, np.int64)[:n]
    for attempt in range(2):
        bad = kernel(handle, _scratch(ctx, "decoded", need_dec, np.uint8), _scratch(ctx, "jpeg_scratch", need_jpeg,
                                                                                    np.uint8), status)
        if bad < 0 or status[bad] != jpeg.ERR_SCRATCH or attempt:
            break
        # A JPEG whose chroma sampling cannot be cropped is decoded whole (at its scale, into both buffers).
        need_dec = need_jpeg = int(heights[bad] * widths[bad] * 4)
    if bad < 0:
        return -1, ""
    code = int(status[bad])
    detail = jpeg.error_string(handle) if code == jpeg.ERR_LIBJPEG else jpeg.STATUS_MESSAGES.get(code, "")
    return bad, (f"the stored JPEG could not be decoded (status {code}: {detail}); rewrite the file or verify it "
                 "with `pageset verify`")


def _image_of(counts, i) -> tuple[int, int]:
    """``(q, k)``: image ``i`` of a slice whose records hold ``counts`` images each is image k of record q."""
    ends = np.cumsum(counts)
    q = int(np.searchsorted(ends, i, side="right"))
    return q, int(i - (ends[q] - counts[q]))


_NO_TOKENS = np.empty(0, np.int64)  # a fixed number of tokens per image (ExpandImageTokens.tokens_per_image)


def _scratch(ctx, name, size, dtype):
    """The thread's scratch buffer ``name`` with at least ``size`` elements (grown, never shrunk)."""
    buf = ctx.get(name)
    if buf is None or buf.shape[0] < size:
        buf = ctx[name] = np.empty(max(int(size), 1), dtype=dtype)
    return buf


class ImageStage(Stage):
    """RGBImage -> [B, H, W, 3] / [B, 3, H, W] via the fused kernel ``ops.image_batch.image_slice``."""

    needs_keys = True  # crop boxes and flips

    def __init__(self, name, ops, ds, pages, array_type):
        self._pipeline(name, ops, ds, pages, array_type)
        shape = (self.out_h, self.out_w, 3) if self.channels_last else (3, self.out_h, self.out_w)
        self.outputs = {name: (shape, self.table.dtype, self.torch_dtype)}
        ix = ds.index
        self.offs = ix[f"{name}.offset"].astype(np.int64)
        self.lens = ix[f"{name}.length"].astype(np.int64)
        self.heights = ix[f"{name}.height"].astype(np.int64)
        self.widths = ix[f"{name}.width"].astype(np.int64)
        self.encodings = ix[f"{name}.encoding"].astype(np.uint8)

    def _pipeline(self, name, ops, ds, pages, array_type):
        """Read the pipeline [crop, RandomHorizontalFlip?, Normalize?, ToTorchImage?, ToTensor?, ToDevice?] and
        load libjpeg-turbo; sets the crop, flip, table, layout and ``torch_dtype``; PipelineError for another."""
        self.name, self.path, self.pages = name, ds.path, pages
        rest, self.to_tensor, self.to_device = _split_common(name, ops, array_type)
        if not rest or not isinstance(rest[0], (RandomResizedCrop, CenterCrop)):
            raise PipelineError(
                f"field {name!r} is an image: its pipeline must start with RandomResizedCrop(size) or "
                "CenterCrop(size) (images differ in size; the crop fixes the batch shape)"
            )
        crop, rest = rest[0], rest[1:]
        self.op = crop  # named when the batch buffers cannot be allocated
        self.flip_p, normalize, layout = 0.0, None, None
        for op in rest:
            if isinstance(op, RandomHorizontalFlip) and normalize is None and layout is None:
                self.flip_p = float(op.p)
            elif isinstance(op, Normalize) and normalize is None and layout is None:
                normalize = op
            elif isinstance(op, ToTorchImage) and layout is None:
                layout = op
            else:
                raise PipelineError(f"field {name!r}: unexpected {op!r}; image pipelines read [crop, "
                                    "RandomHorizontalFlip?, Normalize?, ToTorchImage?, ToTensor?, ToDevice?]")
        self.out_h, self.out_w = crop.size
        self.fast_resize = crop.resize_mode == "fast"
        if isinstance(crop, RandomResizedCrop):
            self.crop_mode = image_batch.CROP_RANDOM_RESIZED
            self.params = np.array([crop.scale[0], crop.scale[1], crop.ratio[0], crop.ratio[1], 0.0])
        else:
            self.crop_mode = image_batch.CROP_CENTER
            self.params = np.array([0.0, 0.0, 0.0, 0.0, crop.ratio])
        self.table, torch_dtype = _pixel_table(name, normalize, self.to_tensor)
        if layout is not None and not self.to_tensor:  # ToTorchImage hands out torch tensors (NCHW-shaped views)
            raise _numpy_refuses(name, layout)
        # NHWC buffer unless ToTorchImage(channels_last=False) asks for a contiguous NCHW one.
        self.channels_last = layout is None or layout.channels_last
        self.permute = layout is not None and layout.channels_last
        self.torch_dtype = torch_dtype
        # Loads libjpeg-turbo (the slice kernel links it even for raw-only files) and enables the kernels' disk
        # cache; a missing library fails here, at construction.
        image_batch.prepare()

    def handout(self, arrays, view):
        out = super().handout(arrays, view)
        if self.permute:
            out[self.name] = out[self.name].permute(0, 3, 1, 2)
        return out

    _buffer = staticmethod(_scratch)

    fills_rows = True  # the slice kernel writes out[rows[j]]: a mixture's scattered rows cost no copy

    def fill(self, arrays, lo, hi, ids, keys, ctx):
        rows = self._buffer(ctx, "rows", hi - lo, np.int64)[: hi - lo]
        rows[:] = np.arange(lo, hi)
        self.fill_rows(arrays, rows, ids, keys, ctx)

    def fill_rows(self, arrays, rows, ids, keys, ctx):
        """Write sample j (record ``ids[j]``, key ``keys[j]``) at row ``rows[j]`` of the slot's buffer."""
        buf, offs = self.pages.gather(self.offs[ids], self.lens[ids], ctx, ordered=False)
        bad, why = self._decode(arrays[self.name], rows, buf, offs, self.lens[ids], self.heights[ids],
                                self.widths[ids], self.encodings[ids], keys, ctx)
        if bad >= 0:
            raise DecodeError(f"{self.path}: sample {int(ids[bad])}, field {self.name!r}: {why}", int(ids[bad]))

    def _decode(self, out, rows, buf, offs, lens, heights, widths, encodings, keys, ctx):
        """Decode, crop, resize and normalize image j (at ``buf[offs[j]:][:lens[j]]``, key ``keys[j]``) into
        ``out[rows[j]]``; ``(-1, "")``, or the first j that failed and what to tell the user."""
        n = rows.shape[0]
        # per-thread buffers, reused across slices: boxes int64[n, 6], flips bool[n], status int64[n]
        boxes = self._buffer(ctx, "boxes", 6 * n, np.int64)[: 6 * n].reshape(n, 6)
        flips = self._buffer(ctx, "flips", n, np.bool_)[:n]
        need_dec, need_jpeg, need_rs = image_batch.plan_slice(heights, widths, encodings, keys, self.crop_mode,
                                                              self.params, self.flip_p, self.out_h, self.out_w,
                                                              boxes, flips)
        resize_scratch = self._buffer(ctx, "resize_scratch", need_rs, np.int32)
        return _decode_retried(ctx, encodings, heights, widths, n, need_dec, need_jpeg,
                               lambda handle, decoded, jpeg_scratch, status: image_batch.image_slice(
                                   handle, buf, offs, lens, heights, widths, encodings, boxes, flips, self.table, out,
                                   rows, self.channels_last, decoded, jpeg_scratch, resize_scratch, status,
                                   self.fast_resize))


class ImagesStage(ImageStage):
    """RGBImages -> ``[B, M, H, W, 3]`` / ``[B, M, 3, H, W]`` under the field's name, every image of a sample
    through the image pipeline (the fused kernel ``ops.image_batch.image_slice``), and ``<name>_counts``
    int64[B]: how many of the M slots (the file's most images in a record; in a mixture or set the widest
    file's) hold sample j's images, in stored order; the others are zero. Image k of a sample is cropped with
    the key ``ops.image_lists.image_keys`` derives from the sample's key (k = 0: the sample's own key)."""

    fills_rows = False
    reads_rows = True  # packed rows (read_rows): a row's slots hold the images of its records

    def __init__(self, name, ops, ds, pages, array_type):
        self._pipeline(name, ops, ds, pages, array_type)
        ix = ds.index
        self.offs = ix[f"{name}.offset"].astype(np.int64)
        self.lens = ix[f"{name}.length"].astype(np.int64)
        self.counts = ix[f"{name}.count"].astype(np.int64)
        self.max_len = int(self.counts.max()) if self.counts.size else 0
        self.variable_width = True
        shape = (self.out_h, self.out_w, 3) if self.channels_last else (3, self.out_h, self.out_w)
        self.counts_key = f"{name}_counts"
        self.rows = None  # packed rows (read_rows), or None: a record a row
        self.outputs = {name: ((self.max_len, *shape), self.table.dtype, self.torch_dtype),
                        self.counts_key: ((), np.dtype(np.int64), None)}
        image_lists.prepare()

    def handout(self, arrays, view):
        vals = {k: view(arrays[k]) for k in self.outputs}
        if self.to_tensor:
            vals = {k: _to_torch(v, self.outputs[k][2]) for k, v in vals.items()}
            if self.permute:
                vals[self.name] = vals[self.name].permute(0, 1, 4, 2, 3)
        return vals

    def read_rows(self, rows) -> None:
        """Hand out packed rows (``rows``: ops.packing.RecordRows): row j's M slots hold every image of its
        records, record after record, in stored order (the order of their image tokens in the row); M is the
        most images a row holds."""
        self.rows = rows
        per_record = self.counts[rows.records]
        row_of = np.repeat(np.arange(rows.n_rows, dtype=np.int64), np.diff(rows.row_ptr))
        self.row_counts = np.bincount(row_of, weights=per_record, minlength=rows.n_rows).astype(np.int64)
        self.max_len = int(self.row_counts.max()) if self.row_counts.size else 0
        shape, dtype, torch_dtype = self.outputs[self.name]
        self.outputs[self.name] = ((self.max_len, *shape[1:]), dtype, torch_dtype)
        self.segments_key = f"{self.name}_segments"  # int64[B, M]: each slot's conversation in its row, or -1
        self.outputs[self.segments_key] = ((self.max_len,), np.dtype(np.int64), None)

    def fill(self, arrays, lo, hi, ids, keys, ctx):
        out = arrays[self.name][lo:hi]
        width = out.shape[1]
        n = ids.shape[0]
        if self.rows is None:  # a record a row
            counts, records, per_row = self.counts[ids], ids, n
            first = _scratch(ctx, "images_first", n, np.int64)[:n]
            first[:] = np.arange(n, dtype=np.int64) * width
        else:  # packed rows: each row's records back to back in its slots
            per_row, records = self.rows.row_records(ids)
            counts = self.counts[records]
            ends = np.cumsum(counts)
            row_start = np.repeat(np.cumsum(per_row) - per_row, per_row)  # the first record of each one's row
            first = np.repeat(np.arange(n, dtype=np.int64) * width, per_row) + (ends - counts) - (ends - counts)[row_start]
        row_images = self.counts[ids] if self.rows is None else self.row_counts[ids]
        arrays[self.counts_key][lo:hi] = row_images
        for j in range(n):  # unused slots are zero, whatever the buffer held before
            out[j, row_images[j]:] = 0
        m = int(counts.sum())
        if self.rows is not None:  # which of its row's records (segments) each image belongs to; -1: no image
            segments = arrays[self.segments_key][lo:hi].reshape(-1)
            segments[:] = -1
            in_record = np.arange(m) - np.repeat(np.cumsum(counts) - counts, counts)
            segments[np.repeat(first, counts) + in_record] = np.repeat(np.arange(records.shape[0]) - row_start, counts)
        if m == 0:
            return
        buf, offs = self.pages.gather(self.offs[records], self.lens[records], ctx, ordered=False)
        img_offs, img_lens, heights, widths, slots = (_scratch(ctx, f"images_{k}", m, np.int64)[:m]
                                                      for k in ("offs", "lens", "heights", "widths", "rows"))
        encodings = _scratch(ctx, "images_encodings", m, np.uint8)[:m]
        bad = image_lists.entries(buf, offs, self.lens[records], counts, first, img_offs, img_lens, heights, widths,
                                  encodings, slots)
        if bad >= 0:
            raise DecodeError(f"{self.path}: sample {int(records[bad])}, field {self.name!r}: the stored image list "
                              "does not match its index entry (damaged page); check the file with `pageset verify`",
                              int(records[bad]))
        flat = out.reshape(out.shape[0] * width, *out.shape[2:])
        img_keys = None if keys is None else image_lists.image_keys(keys, row_images)
        bad, why = self._decode(flat, slots, buf, img_offs, img_lens, heights, widths, encodings, img_keys, ctx)
        if bad >= 0:
            q, k = _image_of(counts, bad)
            raise DecodeError(f"{self.path}: sample {int(records[q])}, field {self.name!r}, image {k}: {why}",
                              int(records[q]))


class ScalarStage(Stage):
    """Int / Float -> [B] of the decoder's dtype (a vectorised gather from the index column)."""

    def __init__(self, name, ops, ds, default, array_type):
        self.name = name
        rest, self.to_tensor, self.to_device = _split_common(name, ops, array_type)
        dec = rest[0] if rest else default
        if len(rest) > 1 or not isinstance(dec, type(default)):
            raise PipelineError(f"field {name!r}: expected [{type(default).__name__}(), ToTensor?, ToDevice?]")
        self.column = ds.index[name].astype(dec.dtype)
        self.outputs = {name: ((), np.dtype(dec.dtype), None)}

    def fill(self, arrays, lo, hi, ids, keys, ctx):
        np.take(self.column, ids, out=arrays[self.name][lo:hi])


class ArrayStage(Stage):
    """NDArray -> [B, *shape] (one vectorised byte gather per slice)."""

    def __init__(self, name, ops, ds, field: NDArray, pages, array_type):
        self.name, self.pages = name, pages
        rest, self.to_tensor, self.to_device = _split_common(name, ops, array_type)
        if rest and (len(rest) > 1 or not isinstance(rest[0], NDArrayDecoder)):
            raise PipelineError(f"field {name!r}: expected [NDArrayDecoder(), ToTensor?, ToDevice?]")
        self.dtype = np.dtype(field.dtype)
        self.shape = field.shape
        self.nbytes = field.nbytes
        self.offs = ds.index[f"{name}.offset"].astype(np.int64)
        self.outputs = {name: (self.shape, self.dtype, None)}
        # stored little-endian (formats/v1.md): copied as bytes where the output's byte order is the same
        self._copy = self.dtype.newbyteorder("<") == self.dtype and self.nbytes > 0
        spans.prepare()

    def fill(self, arrays, lo, hi, ids, keys, ctx):
        n = ids.shape[0]
        lens = np.full(n, self.nbytes, dtype=np.int64)
        buf, offs = self.pages.gather(self.offs[ids], lens, ctx, ordered=False)
        out = arrays[self.name][lo:hi]
        if self._copy and out.flags.c_contiguous:  # stored bytes = the array's bytes: one nogil copy per batch
            dst = out.reshape(-1).view(np.uint8)
            spans.copy_spans(buf, offs, lens, dst, np.arange(n, dtype=np.int64) * self.nbytes)
            return
        raw = buf[offs[:, None] + np.arange(self.nbytes)]  # [n, nbytes] gather
        out[...] = raw.view(self.dtype.newbyteorder("<")).reshape(out.shape)


class BytesStage(Stage):
    """Bytes -> (uint8[B, max_len] zero-padded, int64[B] lengths); max_len = the longest value in the file."""

    def __init__(self, name, ops, ds, pages, array_type):
        self.name, self.pages = name, pages
        rest, self.to_tensor, self.to_device = _split_common(name, ops, array_type)
        if rest and (len(rest) > 1 or not isinstance(rest[0], BytesDecoder)):
            raise PipelineError(f"field {name!r}: expected [BytesDecoder(), ToTensor?, ToDevice?]")
        self.offs = ds.index[f"{name}.offset"].astype(np.int64)
        self.lens = ds.index[f"{name}.length"].astype(np.int64)
        self.max_len = int(self.lens.max()) if self.lens.size else 0
        self.variable_width = True
        self.outputs = {name: ((self.max_len,), np.dtype(np.uint8), None),
                        f"{name}_lengths": ((), np.dtype(np.int64), None)}

    def fill(self, arrays, lo, hi, ids, keys, ctx):
        lens = self.lens[ids]
        buf, offs = self.pages.gather(self.offs[ids], lens, ctx, ordered=False)
        data = arrays[self.name][lo:hi]
        data[...] = 0
        for j in range(ids.shape[0]):
            data[j, : lens[j]] = buf[offs[j] : offs[j] + lens[j]]
        arrays[f"{self.name}_lengths"][lo:hi] = lens


class TokenIdsStage(Stage):
    """TokenIds -> ``input_ids`` int64[B, L] under the field's name and ``<name>_attention_mask`` int64[B, L]
    (ops.token_ids.pad_rows): L = ``PadTokens.max_length``, or the file's longest record without PadTokens
    (then padded with 0 and, in a mixture or set, widened to the widest file's). With a stored loss mask or
    :class:`ExpandImageTokens` first (ops.token_ids.expand_rows), also ``<name>_labels`` int64[B, L]."""

    def __init__(self, name, ops, ds, pages, array_type):
        self.name, self.pages, self.path = name, pages, ds.path
        rest, self.to_tensor, self.to_device = _split_common(name, ops, array_type)
        self.expand = rest[0] if rest and isinstance(rest[0], ExpandImageTokens) else None
        rest = rest[1:] if self.expand is not None else rest
        if len(rest) > 1 or (rest and not isinstance(rest[0], PadTokens)):
            raise PipelineError(f"field {name!r} is a TokenIds field: give pipelines={{{name!r}: "
                                "[ExpandImageTokens(...)?, PadTokens(max_length), ToTensor?, ToDevice?]}")
        self.op = rest[0] if rest else None
        field = ds.fields[name]
        self.itemsize = np.dtype(field.dtype).itemsize
        self.has_mask = field.loss_mask
        self.offs = ds.index[f"{name}.offset"].astype(np.int64)
        self.record_width = field.record_width  # bytes a stored id takes (its mask byte included)
        self.counts = ds.index[f"{name}.length"].astype(np.int64) // self.record_width
        self.labels = self.has_mask or self.expand is not None
        self.expected = None
        self.images_absent = False  # whether the file lacks the field ExpandImageTokens(images=...) names
        self.sizer = None  # the RGBImages stage giving each image's tokens (dynamic resolution), once linked
        # the field whose stage must give each image's tokens (ExpandImageTokens without tokens_per_image)
        self.image_tokens_from = (self.expand.images if self.expand is not None and
                                  self.expand.tokens_per_image is None else None)
        if self.expand is not None and self.expand.images is not None:
            other = ds.fields.get(self.expand.images)
            if other is None:  # a Mixture member without the image lists: its records hold no image
                self.expected = np.zeros(len(self.counts), dtype=np.int64)
                self.images_absent = True  # the FileSource checks that it loads the field as empty lists
            elif other.kind != "rgb_images":
                raise PipelineError(f"field {name!r}: ExpandImageTokens(images={self.expand.images!r}) names no "
                                    f"RGBImages field of {ds.path}; its fields are {list(ds.fields)}")
            else:
                self.expected = ds.index[f"{self.expand.images}.count"].astype(np.int64)
        self.max_len = int(self.counts.max()) if self.counts.size else 0
        if self.expand is not None and self.op is None:
            raise PipelineError(f"field {name!r}: ExpandImageTokens needs PadTokens(max_length) after it (rows of "
                                "expanded conversations have no stored width)")
        if self.labels and self.op is not None and self.op.keep_last_token:
            raise PipelineError(f"field {name!r}: PadTokens(keep_last_token=True) is for captions; a "
                                "conversation's rows (loss mask or image tokens) keep their first max_length tokens")
        self.variable_width = self.op is None  # no PadTokens: the longest record's width, padded with 0
        width = self.max_len if self.op is None else self.op.max_length
        self.pad_id, self.keep_last, self.truncate = ((0, False, True) if self.op is None else
                                                      (self.op.pad_id, self.op.keep_last_token, self.op.truncation))
        self.mask_key = f"{name}_attention_mask"
        self.labels_key = f"{name}_labels"
        self.outputs = {name: ((width,), np.dtype(np.int64), None),
                        self.mask_key: ((width,), np.dtype(np.int64), None)}
        if self.labels:
            self.outputs[self.labels_key] = ((width,), np.dtype(np.int64), None)
        token_id_ops.prepare()

    def _gather(self, recs, ctx):
        """``(buf, offs, counts)``: records ``recs``' stored ids (and loss masks) gathered by the page source."""
        counts = self.counts[recs]
        buf, offs = self.pages.gather(self.offs[recs], counts * self.record_width, ctx, ordered=False)
        return buf, offs, counts

    def link_image_tokens(self, stage) -> None:
        """Take each image's token count from ``stage`` (the RGBImages field ``image_tokens_from`` names, which
        declares ``sizes_images``: SmartResize); PipelineError when it does not size its images."""
        if not stage.sizes_images:
            raise PipelineError(f"field {self.name!r}: ExpandImageTokens without tokens_per_image takes each image's "
                                f"tokens from field {stage.name!r}'s SmartResize, but that field's pipeline has a "
                                "fixed size: give tokens_per_image, or load the images with SmartResize(...)")
        self.sizer = stage

    def _expand_args(self, recs, ctx):
        """``(image_id, per_image, image_tokens, starts, expected int64[n], status int64[2])`` for the expanding
        kernels (expand_rows, pack_rows): the placeholder id (-1: none), its tokens, each image's tokens
        (dynamic resolution; else empty) and each record's first image in them, each record's image count (-1:
        unchecked). Reads the images' heads first: call it before gathering the ids (one staging buffer)."""
        n = recs.shape[0]
        if self.expected is not None:
            expected = self.expected[recs]
        else:
            expected = _scratch(ctx, "token_ids_unchecked", n, np.int64)[:n]
            expected[:] = -1
        image_id, per_image = ((-1, 1) if self.expand is None else
                               (self.expand.image_token_id, self.expand.tokens_per_image or 1))
        if self.sizer is not None:
            image_tokens, starts = self.sizer.image_tokens(recs, ctx)
        else:
            image_tokens = _NO_TOKENS
            starts = _scratch(ctx, "token_ids_starts", n, np.int64)[:n]
            starts[:] = 0
        return (image_id, per_image, image_tokens, starts, expected,
                _scratch(ctx, "token_ids_status", 2, np.int64)[:2])

    def _image_error(self, sample, why, found, expected):
        """Raise the DecodeError of an expanding kernel's status IMAGE_COUNT or IMAGE_CUT for ``sample``."""
        where = f"{self.path}: sample {sample}, field {self.name!r}"
        if why == token_id_ops.IMAGE_COUNT:
            raise DecodeError(f"{where}: {found} image placeholders (id {self.expand.image_token_id}) but "
                              f"{expected} images in field {self.expand.images!r}; write one placeholder per image",
                              sample)
        per_image = "" if self.expand.tokens_per_image is None else f"{self.expand.tokens_per_image} "
        raise DecodeError(f"{where}: {found} tokens once its images are expanded; PadTokens(max_length="
                          f"{self.op.max_length}) would cut into an image's {per_image}tokens; raise max_length or "
                          "give the sample fewer images", sample)

    def fill(self, arrays, lo, hi, ids, keys, ctx):
        out_ids, out_mask = arrays[self.name][lo:hi], arrays[self.mask_key][lo:hi]
        if not self.labels:
            buf, offs, counts = self._gather(ids, ctx)
            bad = token_id_ops.pad_rows(buf, offs, counts, self.itemsize, out_ids, out_mask, self.pad_id,
                                        self.keep_last, self.truncate)
            if bad >= 0:
                self._too_long(ids, bad, int(counts[bad]))
            return
        image_id, per_image, image_tokens, starts, expected, status = self._expand_args(ids, ctx)
        buf, offs, counts = self._gather(ids, ctx)
        bad = token_id_ops.expand_rows(buf, offs, counts, self.itemsize, self.has_mask, image_id, per_image,
                                       image_tokens, starts, expected, out_ids, out_mask,
                                       arrays[self.labels_key][lo:hi], self.pad_id, self.truncate, status)
        if bad < 0:
            return
        if status[0] == token_id_ops.TOO_LONG:
            self._too_long(ids, bad, int(status[1]))
        self._image_error(int(ids[bad]), int(status[0]), int(status[1]), int(expected[bad]))

    def _too_long(self, ids, bad, length):
        sample = int(ids[bad])
        raise DecodeError(f"{self.path}: sample {sample}, field {self.name!r}: {length} token ids do "
                          f"not fit PadTokens(max_length={self.op.max_length}, truncation=False); raise "
                          "max_length, or allow truncation=True", sample)

    def handout(self, arrays, view):
        vals = {k: view(arrays[k]) for k in self.outputs}
        if self.to_tensor:
            vals = {k: _to_torch(v, None) for k, v in vals.items()}
        return vals


class JSONStage(Stage):
    """JSON -> a list of B decoded values (Python objects: never tensors, never sent to a device)."""

    def __init__(self, name, ops, ds, pages):
        self.name, self.pages, self.path = name, pages, ds.path
        if ops and (len(ops) > 1 or not isinstance(ops[0], JSONDecoder)):
            raise PipelineError(f"field {name!r}: JSON fields take [JSONDecoder()] (Python objects)")
        self.to_tensor, self.to_device = False, None
        self.offs = ds.index[f"{name}.offset"].astype(np.int64)
        self.lens = ds.index[f"{name}.length"].astype(np.int64)
        self.outputs = {}

    def alloc(self, batch_size, empty):
        return {self.name: [None] * batch_size}

    def fill(self, arrays, lo, hi, ids, keys, ctx):
        lens = self.lens[ids]
        buf, offs = self.pages.gather(self.offs[ids], lens, ctx, ordered=False)
        values = arrays[self.name]
        for j in range(ids.shape[0]):
            try:
                values[lo + j] = json.loads(buf[offs[j] : offs[j] + lens[j]].tobytes())
            except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError: damaged page bytes
                raise DecodeError(f"{self.path}: sample {int(ids[j])}, field {self.name!r}: stored JSON is not "
                                  f"valid ({exc}); the page is damaged: check it with `pageset verify`", int(ids[j])) from exc

    def handout(self, arrays, view):
        return {self.name: list(arrays[self.name])}


class TokenRows(Stage):
    """The set-up every token stage shares (stride windows: :class:`TokenStage`; packed rows: load/packed.py):
    the pipeline ``[TokenWindows(seq_len), ToTensor?, ToDevice?]``, the file's token dtype (little-endian),
    ``eos_id``, ``data_offset``/``page_size``, ``mask_bits`` (a chat file's loss mask: uint8[ceil(count / 8)],
    bit t % 8 of byte t // 8, formats/v1.md 10.1; None without one), ``min_slice_rows`` and the outputs
    ``input`` (``TokenWindows.input_dtype``), ``target`` (int64) [B, seq_len], with ``docs`` also
    ``position_ids`` (int64), ``doc_ids`` (int32), ``labels`` (int64) and the slot's ``cu_seqlens`` buffer
    (int32[B * seq_len + 1]); ``labels`` too when the file has a loss mask. PipelineError for another pipeline."""

    inline = True  # one kernel call reads and widens a slice (below ~64K tokens a slice: ~0.1 ms)
    windows = True  # records are token rows (n_records, records_per_page, token_count)

    def __init__(self, name, ops, ds, pages, array_type, docs: bool | None = None):
        self.name, self.pages, self.path = name, pages, ds.path
        rest, self.to_tensor, self.to_device = _split_common(name, ops, array_type)
        if len(rest) != 1 or not isinstance(rest[0], TokenWindows):
            raise PipelineError(f"{ds.path} is a token file: give pipelines={{{name!r}: [TokenWindows(seq_len), "
                                "ToTensor?, ToDevice?]}")
        op = self.op = rest[0]
        self.seq_len, self.docs = op.seq_len, op.document_outputs if docs is None else docs
        info = ds.tokens_info
        self.eos_id = int(info["eos_id"])
        self.itemsize = np.dtype(info["dtype"]).itemsize
        self.data_offset, self.page_size = ds.data_offset, ds.page_size
        self.dtype = np.dtype(info["dtype"]).newbyteorder("<")
        # rows per slice: ~256K tokens (~0.2-0.3 ms of reading and widening) pays for handing a slice to a thread
        # and waiting for it (a wake-up and a GIL hand-back: ~20-50 us on an idle core, ~140 us measured on a busy
        # one); smaller batches are one slice, filled inline by the thread calling next() (see ``inline``)
        self.min_slice_rows = max(1, (1 << 18) // self.seq_len)
        L = self.seq_len
        self.outputs = {"input": ((L,), np.dtype(op.input_dtype), None), "target": ((L,), np.dtype(np.int64), None)}
        if self.docs:
            self.outputs.update(position_ids=((L,), np.dtype(np.int64), None),
                                doc_ids=((L,), np.dtype(np.int32), None), labels=((L,), np.dtype(np.int64), None))
        self.mask_bits = ds.loss_mask_bits  # a chat file's loss mask: labels are -100 where it is 0
        if self.mask_bits is not None:
            self.outputs["labels"] = ((L,), np.dtype(np.int64), None)

    def buffer_shapes(self, batch_size):
        shapes = super().buffer_shapes(batch_size)
        if self.docs:
            shapes["cu_seqlens"] = ((batch_size * self.seq_len + 1,), np.dtype(np.int32))
        return shapes

    def alloc(self, batch_size, empty):
        arrays = super().alloc(batch_size, empty)
        if self.docs:
            arrays["cu_seqlens"] = empty((batch_size * self.seq_len + 1,), np.dtype(np.int32))
        return arrays


class TokenStage(TokenRows):
    """A token file's stream -> ``input``/``target`` windows (+ document outputs) via ``ops.tokens``.

    Records are windows: window ``w`` starts at token ``w * seq_len``; ``records_per_page()`` counts the
    windows starting in each page, so the quasi-random order shuffles windows page-locally.
    """

    strided = True  # records are stride windows (RowReader and SetWindows may read them themselves)

    def __init__(self, name, ops, ds, pages, array_type):
        super().__init__(name, ops, ds, pages, array_type)
        self.stride = self.seq_len * self.itemsize  # bytes between window starts
        count = ds.data_length // self.itemsize
        if count < self.seq_len + 1:
            raise ValueError(f"{ds.path}: {plural(count, 'token')}, fewer than seq_len + 1 = {self.seq_len + 1}:"
                             " no window fits (windows are never padded); use a smaller seq_len or more data")
        self.n_records = token_ops.num_windows(count, self.seq_len)
        token_ops.prepare()

    def spans(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Absolute byte spans (starts, lengths) of windows ``ids``."""
        n = (self.seq_len + 1) * self.itemsize
        return self.data_offset + ids * (self.seq_len * self.itemsize), np.full(ids.shape[0], n, dtype=np.int64)

    def reserve(self, ctx: dict, rows: int) -> None:
        """Size a thread's scratch (``ctx``) for slices of up to ``rows`` windows (at Loader construction)."""
        self.pages.reserve(ctx, rows * (self.seq_len + 1) * self.itemsize)

    def token_count(self) -> int:
        """Predictions of all windows: ``n_records * seq_len`` (every column of a window holds a target)."""
        return int(self.n_records) * int(self.seq_len)

    def records_per_page(self, page_count: int) -> np.ndarray:
        """int64[max(page_count, 1)]: windows whose first token lies in each page (O(pages), no per-window array)."""
        stride = self.seq_len * self.itemsize  # bytes between window starts
        bounds = np.arange(max(page_count, 1) + 1, dtype=np.int64) * self.page_size
        first = np.minimum(-(-bounds // stride), self.n_records)  # first window starting at or after each bound
        return np.diff(first)

    def fill(self, arrays, lo, hi, ids, keys, ctx):
        # Read, never mapped: a file truncated under the loader raises TruncatedFileError instead of SIGBUS.
        # Local files: one kernel call reads (pread, or copies out of the page cache) and widens every window.
        inp, tgt = arrays["input"][lo:hi], arrays["target"][lo:hi]
        if not self.pages.read_windows(self.data_offset, self.stride, ids, self.dtype, inp, tgt, ctx):
            # the windows' bytes land back to back in the thread's staging buffer (a URL, or pages not cached)
            starts, lens = self.spans(ids)
            buf, _ = self.pages.gather(starts, lens, ctx)
            rows = buf[: int(lens.sum())].view(self.dtype).reshape(ids.shape[0], self.seq_len + 1)
            token_ops.split_windows(rows, inp, tgt)
        if self.docs:
            self.fill_documents(arrays, lo, hi)
        self.fill_mask(arrays, lo, hi, ids)

    def fill_mask(self, arrays, lo, hi, ids):
        """``labels`` of rows ``[lo, hi)`` (windows ``ids``) of a file with a loss mask: the target, -100 where the
        target's mask is 0 (and, with document outputs, where the input is EOS). No-op without a mask."""
        if self.mask_bits is None:
            return
        labels = arrays["labels"][lo:hi]
        if not self.docs:
            np.copyto(labels, arrays["target"][lo:hi])
        token_ops.mask_labels(labels, self.mask_bits, ids, self.seq_len)

    def fill_windows(self, arrays, lo, hi, rows):
        """Fill rows ``[lo, hi)`` from ``rows`` (the windows' tokens, file dtype, ``[hi - lo, seq_len + 1]``)."""
        token_ops.split_windows(rows, arrays["input"][lo:hi], arrays["target"][lo:hi])  # one nogil pass
        if self.docs:
            self.fill_documents(arrays, lo, hi)

    def fill_documents(self, arrays, lo, hi):
        """position_ids, doc_ids and labels of rows ``[lo, hi)`` from their input and target."""
        inp = arrays["input"][lo:hi]
        token_ops.position_ids(inp, self.eos_id, out=arrays["position_ids"][lo:hi])
        token_ops.doc_ids(inp, self.eos_id, out=arrays["doc_ids"][lo:hi])
        token_ops.labels(inp, arrays["target"][lo:hi], self.eos_id, out=arrays["labels"][lo:hi])

    def handout(self, arrays, view):
        keys = list(self.outputs)
        vals = {k: view(arrays[k]) for k in keys}
        if self.docs:
            cu, max_len = token_ops.cu_seqlens(arrays["input"], self.eos_id)
            buf = arrays["cu_seqlens"][: cu.shape[0]]
            buf[...] = cu
            vals["cu_seqlens"] = view(buf)
        if self.to_tensor:
            vals = {k: _to_torch(v, None) for k, v in vals.items()}
        if self.docs:
            vals["max_seqlen"] = max_len
        return vals
