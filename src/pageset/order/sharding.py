"""Epoch length, steps and rank slices (order v1): global batch -> the positions one rank loads.

Definitions (see the design note ``order.md``): N records, global batch G (samples per step over all
ranks), world size W with ``G % W == 0``, local batch ``B = G // W``, rank r.

- Epoch length L: ``drop_last=True`` -> ``floor(N / G) * G``; ``drop_last=False`` -> ``ceil(N / G) * G``.
  L depends on G, never on W, so the global stream is the same for every world size.
- Step s covers epoch positions ``[s*G, (s+1)*G)``; rank r takes ``s*G + r*B + j`` for ``j < B``: contiguous,
  so an all-gather in rank order reproduces the global batch exactly. Every rank yields ``L // G`` batches.
- Positions ``p >= N`` (only with ``drop_last=False``) are padding: they read the record at permutation
  position ``p % N`` (the start of the permutation again) and are flagged so evaluation can mask them. The
  position itself stays unique (``p``), so augmentation keys of padding samples differ from the originals.

Pure functions of plain integers: no torch, no file, no global state.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import numpy as np

from .shuffle import _as_int


def _plural(count: int, noun: str) -> str:
    """'1 record', '0 records' (format.errors.plural; the order stage imports nothing of the package)."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def local_batch(global_batch: int, world_size: int) -> int:
    """B = G // W, the samples per step on each rank. ValueError if G < 1, W < 1 or G % W != 0."""
    g, w = _as_int("global_batch", global_batch), _as_int("world_size", world_size)
    if g < 1:
        raise ValueError(f"global_batch must be >= 1, got {g}")
    if w < 1:
        raise ValueError(f"world_size must be >= 1, got {w}")
    if g % w:
        lower, upper = g - g % w, g + w - g % w
        raise ValueError(
            f"global_batch={g} is not divisible by world_size={w} (remainder {g % w}): every rank must "
            f"take the same number of samples per step. Use a global batch that is a multiple of {w} "
            f"(e.g. {lower or upper} or {upper}) or a world size that divides {g}."
        )
    return g // w


def epoch_length(n_records: int, global_batch: int, drop_last: bool) -> int:
    """L, the positions in one epoch (a multiple of G): int.

    ValueError when no full step exists: N == 0, or ``drop_last=True`` with ``N < G`` (L would be 0; the
    message names N, G and the fixes). With ``drop_last=False`` and ``N < G`` the epoch is one padded batch.
    """
    n, g = _as_int("n_records", n_records), _as_int("global_batch", global_batch)
    if not isinstance(drop_last, (bool, np.bool_)):
        raise TypeError(f"drop_last must be a bool, got {type(drop_last).__name__} ({drop_last!r})")
    if n < 0:
        raise ValueError(f"n_records must be >= 0, got {n}")
    if g < 1:
        raise ValueError(f"global_batch must be >= 1, got {g}")
    if n == 0:
        raise ValueError("the dataset has no records (N=0): an epoch needs at least one record")
    if drop_last:
        if n < g:
            raise ValueError(
                f"drop_last=True with N={_plural(n, 'record')} and global_batch={g} leaves no full batch (epoch "
                f"length 0). Use drop_last=False (one padded batch per epoch) or a global batch <= {n}."
            )
        return (n // g) * g
    return -(-n // g) * g


def epoch_end(n_records: int, global_batch: int, drop_last: bool, cursor: int = 0) -> int:
    """The epoch position at which an epoch ends whose next step starts at ``cursor``: int.

    The steps cover ``[cursor + k*G, cursor + (k+1)*G)``, ``k = 0, 1, ...``, for as long as positions remain:
    ``drop_last=True``: while a whole step fits in ``[0, N)`` (the tail of fewer than G positions is dropped);
    ``drop_last=False``: until the positions reach N (the last step padded, positions >= N). So the end is
    ``cursor + floor((N - cursor) / G) * G`` or ``cursor + ceil((N - cursor) / G) * G``, never below ``cursor``.
    ``cursor = 0`` gives :func:`epoch_length` (and its errors); a cursor that is not a multiple of G comes from a
    resume with another global batch (formats/order.md section 8). ValueError on a negative cursor.
    """
    c = _as_int("cursor", cursor)
    if c == 0:
        return epoch_length(n_records, global_batch, drop_last)
    if c < 0:
        raise ValueError(f"cursor must be >= 0, got {c}")
    n, g = _as_int("n_records", n_records), _as_int("global_batch", global_batch)
    if g < 1:
        raise ValueError(f"global_batch must be >= 1, got {g}")
    steps = (n - c) // g if drop_last else -(-(n - c) // g)
    return c + max(steps, 0) * g


def steps_per_epoch(n_records: int, global_batch: int, drop_last: bool) -> int:
    """L // G, the steps (batches per rank) in one epoch; errors as :func:`epoch_length`."""
    return epoch_length(n_records, global_batch, drop_last) // _as_int("global_batch", global_batch)


def rank_span(step: int, rank: int, world_size: int, global_batch: int) -> tuple[int, int]:
    """Epoch positions ``[start, stop)`` of rank ``rank`` at step ``step``: ``start = step*G + rank*B``,
    ``stop = start + B``. ValueError on a bad step, rank or world size (the step is not checked against L:
    :func:`rank_positions` does that)."""
    b = local_batch(global_batch, world_size)
    s, r = _as_int("step", step), _as_int("rank", rank)
    _check_rank(r, world_size)
    if s < 0:
        raise ValueError(f"step must be >= 0, got {s}")
    start = s * global_batch + r * b
    return start, start + b


def rank_positions(
    step: int, rank: int, world_size: int, global_batch: int, n_records: int, drop_last: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The positions rank ``rank`` loads at step ``step`` and which are padding.

    Returns ``(positions, padding)``: positions int64[B], epoch positions in ``[0, L)`` (look ids up at
    ``positions % N``); padding bool[B], True where ``position >= N``. ValueError if ``step`` is not in
    ``[0, L // G)``, on a bad rank/world size, or as :func:`epoch_length`.
    """
    steps = steps_per_epoch(n_records, global_batch, drop_last)
    start, stop = rank_span(step, rank, world_size, global_batch)
    if step >= steps:
        raise ValueError(
            f"step={step} is past the epoch: N={n_records}, global_batch={global_batch}, "
            f"drop_last={drop_last} give {_plural(steps, 'step')} (0..{steps - 1})"
        )
    positions = np.arange(start, stop, dtype=np.int64)
    return positions, positions >= n_records


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got rank={rank}")


def resolve_rank(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    probe: Callable[[], tuple[int, int] | None] | None = None,
) -> tuple[int, int]:
    """Decide ``(rank, world_size)``; the first source that answers wins:

    1. explicit ``rank`` and ``world_size`` (give both or neither: ValueError otherwise);
    2. ``probe()``, if given and it returns a pair: the loader passes a callable that reads an initialised
       ``torch.distributed`` (``get_rank(), get_world_size()``), so this module never imports torch;
    3. ``RANK`` and ``WORLD_SIZE`` from ``environ`` (default: ``os.environ`` read at call time, as set by
       torchrun), both or neither, decimal integers;
    4. ``(0, 1)``: a single process.

    ValueError names the source and the bad value: ``world_size < 1``, ``rank`` outside ``[0, world_size)``,
    a non-integer environment value, or one of a pair missing.
    """
    if (rank is None) != (world_size is None):
        raise ValueError(
            f"pass both rank and world_size, or neither (got rank={rank}, world_size={world_size})"
        )
    if rank is not None:
        return _validated(_as_int("rank", rank), _as_int("world_size", world_size), "arguments")
    if probe is not None:
        found = probe()
        if found is not None:
            r, w = found
            return _validated(_as_int("rank", r), _as_int("world_size", w), "probe (torch.distributed)")
    env = os.environ if environ is None else environ
    has_rank, has_world = "RANK" in env, "WORLD_SIZE" in env
    if has_rank != has_world:
        missing = "WORLD_SIZE" if has_rank else "RANK"
        raise ValueError(
            f"environment sets only one of RANK / WORLD_SIZE ({missing} is missing): set both or neither"
        )
    if not has_rank:
        return 0, 1
    values = []
    for name in ("RANK", "WORLD_SIZE"):
        text = env[name]
        try:
            values.append(int(text.strip(), 10))
        except ValueError:
            raise ValueError(f"environment variable {name}={text!r} is not a decimal integer") from None
    return _validated(values[0], values[1], "environment RANK/WORLD_SIZE")


def _validated(rank: int, world_size: int, source: str) -> tuple[int, int]:
    try:
        _check_rank(rank, world_size)
    except ValueError as exc:
        raise ValueError(f"{exc} (from {source})") from None
    return rank, world_size
