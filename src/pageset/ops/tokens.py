"""Token window ops: slice (input, target) windows out of a flat token stream, and document-aware outputs.

Windows are a pure function of ``seq_len`` (chosen at load time, never stored): window ``w`` is
``tokens[w*seq_len : w*seq_len + seq_len + 1]``, ``input = window[:-1]`` and ``target = window[1:]``. With stride
``seq_len`` consecutive windows share one token, so over all ``(T - 1) // seq_len`` windows every token but the
first is a target exactly once (the < seq_len trailing tokens that do not fill a window are the only ones left
out), whatever order the windows are visited in.

The loader's kernels (:func:`split_windows`, :func:`pread_windows`, :func:`pread_mixed_windows`,
:func:`pread_set_windows`, and :func:`pin_windows` + :func:`copy_windows` for a page cache) are Numba: a batch of
windows read and widened uint16/uint32 -> int64 in one nogil call. Everything else is vectorised numpy (a
2048-token uint16 window is 4 KiB; nanoGPT's per-row ``torch.from_numpy(...).astype`` + ``torch.stack`` costs
several times more than one gather).

Document outputs (``position_ids``, ``doc_ids``, ``cu_seqlens``, ``labels``) are computed from the POSITIONS of
``eos_id`` in the input rows, never by comparing with a pad id. Segments:

- every row starts a new segment at column 0, even when the row begins mid-document (FlashAttention's varlen
  kernels need each row start to be a segment start once the batch is flattened, and a window cannot see the
  tokens before it anyway), so ``position_ids[:, 0] == 0`` and ``doc_ids[:, 0] == 0``;
- an EOS belongs to the document it ends; the next segment starts at the column after it. An EOS in the last
  column starts nothing in this row. Two EOS in a row give a one-token segment holding the second EOS.
- ``labels`` is ``target`` with -100 at columns whose INPUT is EOS: predicting the next document's first token
  from the previous document's EOS is the only cross-document prediction, and it is masked.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import numba
import numpy as np

from ..format.errors import plural
from . import kernel_cache, spans
from .spans import file_changed, pread_full

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index


def num_windows(num_tokens: int, seq_len: int) -> int:
    """``(num_tokens - 1) // seq_len`` windows of ``seq_len + 1`` tokens at stride ``seq_len``.

    Raises ValueError for ``seq_len < 1`` or ``num_tokens < seq_len + 1`` (naming both numbers).
    """
    if not isinstance(seq_len, (int, np.integer)) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    if num_tokens < seq_len + 1:
        raise ValueError(
            f"the corpus has {plural(num_tokens, 'token')}, fewer than seq_len + 1 = {seq_len + 1}: no window fits "
            "(windows are never padded); use a smaller seq_len or more data"
        )
    return (int(num_tokens) - 1) // int(seq_len)


def window_view(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """A zero-copy view ``[num_windows, seq_len + 1]`` of ``tokens`` (1-D), row ``w`` = window ``w``.

    Raises ValueError when no window fits (see :func:`num_windows`).
    """
    n = num_windows(tokens.shape[0], seq_len)
    full = np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)
    return full[: n * seq_len : seq_len]


def gather_windows(tokens: np.ndarray, window_ids: np.ndarray, seq_len: int, out_input: np.ndarray,
                   out_target: np.ndarray, scratch: np.ndarray | None = None) -> None:
    """Gather windows ``window_ids`` into ``out_input`` and ``out_target`` in place.

    Args:
        tokens: ``uint16[T]`` or ``uint32[T]`` (or any integer dtype), e.g. ``TokenDataset.tokens`` (a memory map:
            zero-copy, but a file truncated in place under it can kill the process with SIGBUS).
        window_ids: ``int[B]``, each in ``[0, num_windows(T, seq_len))``.
        seq_len: tokens per row.
        out_input: ``int64[B, seq_len]`` or ``int32[B, seq_len]``, written in place: ``window[:-1]``.
        out_target: ``int64[B, seq_len]``, written in place: ``window[1:]``.
        scratch: optional ``tokens.dtype[B, seq_len + 1]`` buffer reused for the raw gather (saves one small
            allocation per batch).

    Raises:
        ValueError: no window fits, or output shapes differ from ``[B, seq_len]``; IndexError: a window id is
        out of range (names the first bad id and the window count).
    """
    view = window_view(tokens, seq_len)
    ids = np.asarray(window_ids)
    b = ids.shape[0]
    if out_input.shape != (b, seq_len) or out_target.shape != (b, seq_len):
        raise ValueError(f"outputs must be [{b}, {seq_len}], got {out_input.shape} and {out_target.shape}")
    if b and (ids.min() < 0 or ids.max() >= view.shape[0]):
        bad = ids[(ids < 0) | (ids >= view.shape[0])][0]
        raise IndexError(f"window id {int(bad)} is out of range: {plural(view.shape[0], 'window')} of seq_len {seq_len}")
    if scratch is None or scratch.shape != (b, seq_len + 1) or scratch.dtype != tokens.dtype:
        scratch = np.empty((b, seq_len + 1), dtype=tokens.dtype)
    # The one gather: B contiguous runs of seq_len + 1 tokens. (np.take(view, ids, axis=0) would first copy the
    # whole strided view, i.e. the corpus: ~10x slower than nanoGPT on a 20M-token file.)
    np.copyto(scratch, view[ids])
    np.copyto(out_input, scratch[:, :-1], casting="unsafe")  # widen in numpy (ids < 2^32 fit int64/int32)
    np.copyto(out_target, scratch[:, 1:], casting="unsafe")


@numba.njit(nogil=True)
def _widen(src, a, b):
    """``a[:] = src[:-1]``, ``b[:] = src[1:]`` (widened); unsigned indices: no wrap-around branch, the loops
    vectorise."""
    length = np.uint64(a.shape[0])
    for i in range(length):
        a[i] = src[i]
    for i in range(length):
        b[i] = src[i + np.uint64(1)]


@numba.njit(nogil=True)
def split_windows(rows, out_input, out_target):
    """``out_input[:] = rows[:, :-1]`` and ``out_target[:] = rows[:, 1:]``, widened, in one nogil pass.

    rows: ``uint16[n, L + 1]`` or ``uint32[n, L + 1]`` (C-contiguous); out_input: ``int64[n, L]`` or
    ``int32[n, L]``; out_target: ``int64[n, L]`` (rows of a batch buffer: C-contiguous). Shapes are the
    caller's contract. The loader's token stage uses it instead of two numpy casting copies.
    """
    for r in range(rows.shape[0]):
        _widen(rows[r], out_input[r], out_target[r])


@numba.njit(nogil=True)
def pread_windows(fd, base, stride, ids, row, out_input, out_target):
    """Read windows ``ids`` of a token file with ``pread`` and widen them into the outputs: one nogil call per
    batch (the GIL released once), each window read into ``row`` and split while it is in L1.

    fd: the file's descriptor; base: byte offset of token 0 in the file; stride: bytes between window starts
    (``seq_len * itemsize``); ids: int64[n] window ids; row: ``uint16[L + 1]`` or ``uint32[L + 1]`` scratch (the
    file's dtype); out_input ``int64|int32[n, L]``, out_target ``int64[n, L]``. Returns -1 when every window
    was read in full, else the first ``j`` whose read came up short or failed (rows before it are written;
    the caller reads that window with ``Dataset.read_into``, which finishes it or raises TruncatedFileError).
    """
    for j in range(ids.shape[0]):
        if not pread_full(fd, row, base + ids[j] * stride):
            return j
        _widen(row, out_input[j], out_target[j])
    return -1


@numba.njit(nogil=True)
def pread_mixed_windows(fds, bases, strides, sources, ids, row, out_input, out_target, touched):
    """:func:`pread_windows` over several token files of one dtype (a Mixture): window ``j`` is window
    ``ids[j]`` of file ``sources[j]``, whose descriptor, token-0 offset and window stride (bytes) are
    ``fds[i]``, ``bases[i]``, ``strides[i]`` (int64[files]); ``touched[i]`` (uint8[files]) is set to 1 for each
    file read from (the caller checks those files and clears it). Returns -1, or the first ``j`` not read in
    full."""
    for j in range(ids.shape[0]):
        i = sources[j]
        touched[i] = 1
        if not pread_full(fds[i], row, bases[i] + ids[j] * strides[i]):
            return j
        _widen(row, out_input[j], out_target[j])
    return -1


@numba.njit(nogil=True)
def pread_set_windows(fds, bases, starts, stride, window_member, ids, row, out_input, out_target, touched, sizes,
                      mtimes, buf, check):
    """:func:`pread_windows` over the member files of a token set, then the members read checked unchanged, in
    one nogil call: window ``j`` is the set's window ``g = ids[j]``, i.e. window ``g - starts[i]`` of member
    ``i = window_member[g]``, read from ``fds[i]`` at byte ``bases[i] + (g - starts[i]) * stride``.

    fds, bases (token-0 offsets), starts (the members' first global windows), sizes (bytes), mtimes (ns): int64
    [members]; stride: bytes between window starts; window_member: int16|int32[windows]; ids: int64[n]; row, out_*
    as in :func:`pread_windows`; touched: uint8[members] (set for each member read; with ``check``, cleared again
    for the members of these windows, each ``fstat``-ed once through :func:`~pageset.ops.spans.file_changed`,
    ``buf`` int64[18] its scratch). Returns -1 when every window was read (and, with ``check``, no member read
    changed); ``j >= 0``, the first window not read in full (nothing checked: the caller finishes it, reads the rest
    and checks the members still flagged); ``-2 - i`` for the first member ``i`` that changed (size or mtime
    differ) or whose ``fstat`` failed.
    """
    for j in range(ids.shape[0]):
        g = ids[j]
        i = window_member[g]
        touched[i] = 1
        if not pread_full(fds[i], row, bases[i] + (g - starts[i]) * stride):
            return j
        _widen(row, out_input[j], out_target[j])
    if not check:
        return -1
    bad = -1
    for j in range(ids.shape[0]):
        i = window_member[ids[j]]
        if touched[i] == 0:
            continue
        touched[i] = 0
        if bad < 0 and file_changed(fds[i], sizes[i], mtimes[i], buf):
            bad = i
    return -1 if bad < 0 else -2 - bad


@numba.njit(nogil=True)
def pin_windows(page_slot, pins, page_len, stride, span, ids, offsets, pages):
    """Pin the cached pages of windows ``ids`` if every window lies in one resident page (a page cache's lookup,
    called under its lock).

    page_slot: int64[K], the slot holding page ``k`` (fully read) or -1; pins: int64[slots], incremented once
    per distinct page; page_len: tokens per page; stride: tokens between window starts (``seq_len``); span:
    tokens per window (``seq_len + 1``); ids: int64[n]. Writes offsets[j] (int64[>= n]: window ``j``'s first
    token in the arena) and the distinct pages, ascending, to ``pages[:m]`` (int64[>= n]). Returns ``m``, or
    -1 (nothing pinned) when a window's page is not resident or a window crosses a page boundary.
    """
    n = ids.shape[0]
    for j in range(n):
        s = ids[j] * stride
        k = s // page_len
        if (s + span - 1) // page_len != k or page_slot[k] < 0:
            return -1
        pages[j] = k
        offsets[j] = page_slot[k] * page_len + s - k * page_len
    touched = pages[:n]
    touched.sort()
    m = 0
    for j in range(n):
        if j == 0 or touched[j] != touched[j - 1]:
            pages[m] = touched[j]
            pins[page_slot[touched[j]]] += 1
            m += 1
    return m


@numba.njit(nogil=True)
def copy_windows(arena, offsets, out_input, out_target):
    """Widen window ``j`` = ``arena[offsets[j] : offsets[j] + L + 1]`` into ``out_input[j]``, ``out_target[j]``
    for every row ``j`` of the outputs (arena: ``uint16|uint32[:]``, offsets: int64[>= n])."""
    span = out_input.shape[1] + 1
    for j in range(out_input.shape[0]):
        o = offsets[j]
        _widen(arena[o : o + span], out_input[j], out_target[j])


@numba.njit(nogil=True)
def unpin_pages(page_slot, pins, pages):
    """Drop the pins :func:`pin_windows` took on ``pages`` (int64[m], resident: their slots cannot change)."""
    for k in pages:
        pins[page_slot[k]] -= 1


@functools.cache
def prepare() -> None:
    """Enable the on-disk cache of this module's kernels and the span kernels they call (run time, never at
    import; idempotent)."""
    kernel_cache.enable(sys.modules[__name__], spans)


def segment_starts(inputs: np.ndarray, eos_id: int) -> np.ndarray:
    """``bool[B, L]``: True where a segment starts (column 0, and every column right after an EOS input)."""
    starts = np.empty(inputs.shape, dtype=bool)
    starts[:, 0] = True
    np.equal(inputs[:, :-1], eos_id, out=starts[:, 1:])
    return starts


def position_ids(inputs: np.ndarray, eos_id: int, out: np.ndarray | None = None) -> np.ndarray:
    """``int64[B, L]``: position within the segment, 0 at each row start and after each EOS (written to ``out``)."""
    starts = segment_starts(inputs, eos_id)
    cols = np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int64), inputs.shape)
    last_start = np.maximum.accumulate(np.where(starts, cols, 0), axis=1)
    if out is None:
        out = np.empty(inputs.shape, dtype=np.int64)
    np.subtract(cols, last_start, out=out)
    return out


def doc_ids(inputs: np.ndarray, eos_id: int, out: np.ndarray | None = None) -> np.ndarray:
    """``int32[B, L]``: segment number within the row (0 at column 0, +1 after each EOS); written to ``out``."""
    if out is None:
        out = np.empty(inputs.shape, dtype=np.int32)
    np.cumsum(segment_starts(inputs, eos_id), axis=1, dtype=np.int32, out=out)
    out -= 1
    return out


def labels(inputs: np.ndarray, targets: np.ndarray, eos_id: int, out: np.ndarray | None = None) -> np.ndarray:
    """``int64[B, L]``: ``targets`` with -100 where the INPUT is EOS (the cross-document prediction)."""
    if out is None:
        out = np.empty(targets.shape, dtype=np.int64)
    np.copyto(out, targets, casting="unsafe")
    out[inputs == eos_id] = IGNORE_INDEX
    return out


def mask_labels(labels: np.ndarray, mask_bits: np.ndarray, ids: np.ndarray, seq_len: int) -> np.ndarray:
    """Set ``labels`` (``int64[B, seq_len]``, the targets of windows ``ids``) to -100 where the target token's loss
    mask is 0. ``mask_bits``: a token file's packed ``loss_mask`` section (``uint8``, bit ``t % 8`` of byte
    ``t // 8`` is token ``t``); the target of column ``j`` of window ``w`` is token ``w * seq_len + 1 + j``."""
    pos = np.asarray(ids, dtype=np.int64)[:, None] * seq_len + 1 + np.arange(seq_len, dtype=np.int64)
    labels[((mask_bits[pos >> 3] >> (pos & 7).astype(np.uint8)) & 1) == 0] = IGNORE_INDEX
    return labels


def cu_seqlens(inputs: np.ndarray, eos_id: int) -> tuple[np.ndarray, int]:
    """Cumulative segment lengths over the flattened batch, FlashAttention varlen style.

    Returns ``(cu_seqlens, max_seqlen)``: ``int32[S + 1]`` from 0 to ``B * L`` (every row start is a boundary)
    and the longest segment as a Python int.
    """
    b, length = inputs.shape
    if b * length >= 2**31:
        raise ValueError(f"B * L = {b * length} does not fit int32 cu_seqlens")
    flat_starts = np.flatnonzero(segment_starts(inputs, eos_id).ravel())
    cu = np.empty(flat_starts.size + 1, dtype=np.int32)
    cu[:-1] = flat_starts
    cu[-1] = b * length
    return cu, int(np.diff(cu).max()) if cu.size > 1 else 0


@dataclass(frozen=True)
class DocumentOutputs:
    """Document-aware outputs of one batch. ``position_ids`` int64[B, L], ``doc_ids`` int32[B, L], ``cu_seqlens``
    int32[S + 1], ``max_seqlen`` int, ``labels`` int64[B, L] (-100 where the input is EOS)."""

    position_ids: np.ndarray
    doc_ids: np.ndarray
    cu_seqlens: np.ndarray
    max_seqlen: int
    labels: np.ndarray


def document_outputs(inputs: np.ndarray, targets: np.ndarray, eos_id: int) -> DocumentOutputs:
    """All document-aware outputs for a batch of windows (``inputs``/``targets`` [B, L], e.g. from
    :func:`gather_windows`)."""
    cu, max_len = cu_seqlens(inputs, eos_id)
    return DocumentOutputs(position_ids(inputs, eos_id), doc_ids(inputs, eos_id), cu, max_len,
                           labels(inputs, targets, eos_id))
