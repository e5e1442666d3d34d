"""Token id limits per stored dtype, the "id does not fit" check and document offsets from lengths: the rules
every token write path (the local stream, executor shards, many-file members) applies the same way."""

from __future__ import annotations

import numpy as np

UINT16_MAX = 65535
UINT32_MAX = 2**32 - 1
SPILL_CHUNK = 1 << 22  # tokens per read when re-packing a uint32 spill file (16 MiB)


def id_limit(dtype: str | None) -> int:
    """The largest id a file of ``dtype`` can store: 65535 for ``"uint16"``, else 2^32 - 1 (``"uint32"``, or
    ``None``: the dtype is not decided yet and any uint32 id is accepted)."""
    return UINT16_MAX if dtype == "uint16" else UINT32_MAX


def check_ids_fit(flat: np.ndarray, lengths: np.ndarray, first_doc: int, limit: int, dtype: str | None,
                  fix: str = "use dtype='uint32' or 'auto'", where: str = "") -> int:
    """The largest id of ``flat`` (the ids of consecutive documents numbered from ``first_doc``, ``lengths``
    their int64 lengths), -1 when it is empty. Raises ValueError naming the first document with an id above
    ``limit`` (the document, the id, ``dtype`` and what to do, ``fix``; prefixed by ``where``, e.g. the
    member's URL and ``": "``)."""
    if not flat.size:
        return -1
    largest = int(flat.max())
    if largest > limit:
        first = int(np.argmax(flat > limit))
        doc = first_doc + int(np.searchsorted(np.cumsum(lengths), first, side="right"))
        raise ValueError(f"{where}document {doc} has token id {int(flat[first])} > {limit}, which does not fit "
                         f"dtype={dtype!r}; {fix}")
    return largest


def doc_offsets(lengths: np.ndarray) -> np.ndarray:
    """``uint64[n + 1]``: the token offset of every document start, 0 first, the total last, from the ``n``
    document ``lengths`` (the ``doc_offsets`` section)."""
    offsets = np.zeros(lengths.size + 1, dtype=np.uint64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets
