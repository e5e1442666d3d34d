"""A second implementation of formats/packing.md, written from its text alone: plain Python, slow, obvious.

``rows(doc_offsets, seq_len, itemsize, page_size, pack_pages)`` -> list of rows, each a list of pieces
``(start, length)``; ``row_contents(tokens, row, seq_len, eos_id, mask)`` -> the row's outputs as lists.
"""

from __future__ import annotations


def pieces(doc_offsets, seq_len: int) -> list[tuple[int, int]]:
    """Section 1: (first token, tokens) of every piece, in document order."""
    out = []
    for i in range(len(doc_offsets) - 1):
        n = doc_offsets[i + 1] - doc_offsets[i]
        if n < 2:
            continue
        k = -(-(n - 1) // seq_len)
        for j in range(k):
            out.append((doc_offsets[i] + j * seq_len, min(j * seq_len + seq_len + 1, n) - j * seq_len))
    return out


def long_documents(doc_offsets, seq_len: int) -> list[int]:
    return [i for i in range(len(doc_offsets) - 1) if doc_offsets[i + 1] - doc_offsets[i] > seq_len + 1]


def rows(doc_offsets, seq_len: int, itemsize: int, page_size: int, pack_pages) -> list[list[tuple[int, int]]]:
    """Sections 2-4: the rows, sorted by their first piece's first token."""
    groups: dict[int, list] = {}
    for s, m in pieces([int(x) for x in doc_offsets], seq_len):
        g = (s * itemsize) // (page_size * pack_pages) if pack_pages else 0
        groups.setdefault(g, []).append((s, m))
    bins = []  # every bin: [remaining, last_placed_time, pieces]
    clock = 0
    for g in sorted(groups):
        open_bins = []  # this group's bins with room left (a full bin takes no more pieces: weights are >= 1)
        for s, m in sorted(groups[g], key=lambda p: (-(p[1] - 1), p[0])):
            w = m - 1
            fits = [b for b in open_bins if b[0] >= w]
            if fits:
                best = min(fits, key=lambda b: (b[0], -b[1]))
            else:
                best = [seq_len, 0, []]
                open_bins.append(best)
                bins.append(best)
            best[0] -= w
            clock += 1
            best[1] = clock
            best[2].append((s, m))
            if best[0] == 0:
                open_bins.remove(best)
    return sorted((b[2] for b in bins), key=lambda ps: ps[0][0])


def row_page_sizes(row_list, itemsize: int, page_size: int, page_count: int) -> list[int]:
    """Section 4: rows per page, by the page of their first token."""
    sizes = [0] * max(page_count, 1)
    for ps in row_list:
        sizes[min((ps[0][0] * itemsize) // page_size, max(page_count, 1) - 1)] += 1
    return sizes


def row_contents(tokens, row, seq_len: int, eos_id: int, mask=None) -> dict[str, list[int]]:
    """Section 5: input, target, position_ids, doc_ids, labels of one row (``mask``: per-token 0/1 list or None)."""
    out = {k: [] for k in ("input", "target", "position_ids", "doc_ids", "labels")}
    for k, (s, m) in enumerate(row):
        for j in range(m - 1):
            out["input"].append(int(tokens[s + j]))
            out["target"].append(int(tokens[s + j + 1]))
            out["position_ids"].append(j)
            out["doc_ids"].append(k)
            keep = mask is None or mask[s + j + 1] == 1
            out["labels"].append(int(tokens[s + j + 1]) if keep else -100)
    pad = seq_len - len(out["input"])
    assert pad >= 0
    out["input"] += [eos_id] * pad
    out["target"] += [-100] * pad
    out["position_ids"] += list(range(pad))
    out["doc_ids"] += [-1] * pad
    out["labels"] += [-100] * pad
    return out


def cu_seqlens(position_rows) -> list[int]:
    """Section 5: segment starts over the flattened batch, then B * S."""
    flat = [p for row in position_rows for p in row]
    return [i for i, p in enumerate(flat) if p == 0] + [len(flat)]


def record_rows(weights, record_pages, capacity: int, pack_pages) -> list[list[int]]:
    """Section 8: rows of record ids (each ascending), sorted by their first record."""
    groups: dict[int, list] = {}
    for i, (w, page) in enumerate(zip(weights, record_pages)):
        if w > 0:
            groups.setdefault(page // pack_pages if pack_pages else 0, []).append(i)
    bins, clock = [], 0  # every bin: [remaining, last_placed_time, records]
    for g in sorted(groups):
        open_bins = []
        for i in sorted(groups[g], key=lambda i: (-weights[i], i)):
            fits = [b for b in open_bins if b[0] >= weights[i]]
            if fits:
                best = min(fits, key=lambda b: (b[0], -b[1]))
            else:
                best = [capacity, 0, []]
                open_bins.append(best)
                bins.append(best)
            best[0] -= weights[i]
            clock += 1
            best[1] = clock
            best[2].append(i)
            if best[0] == 0:
                open_bins.remove(best)
    return sorted((sorted(b[2]) for b in bins), key=lambda r: r[0])
