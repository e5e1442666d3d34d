"""Page assignment: where each record's bytes go. Pure functions of (cursor, length, page_size).

Records are placed in sample order, so the file's bytes depend on the input only, never on worker timing.
A record never straddles a page boundary unless it is larger than a page; then it starts on a boundary and
owns whole pages (the next record starts on the following boundary), so a huge image is stored, not rejected.
"""

from __future__ import annotations


def place_record(cursor: int, length: int, page_size: int) -> tuple[int, int]:
    """Place a record of ``length`` bytes at or after ``cursor`` (bytes from the start of the data area).

    Returns ``(start, next_cursor)``: the record occupies ``[start, start + length)``; ``next_cursor`` is
    where the following record may start. Zero-length records take no space and stay at ``cursor``.
    """
    if length == 0:
        return cursor, cursor
    offset_in_page = cursor % page_size
    page_end = cursor - offset_in_page + page_size
    if length > page_size:
        start = cursor if offset_in_page == 0 else page_end
        end = start + length
        return start, -(-end // page_size) * page_size  # round up: the record owns its last page too
    start = cursor if cursor + length <= page_end else page_end
    return start, start + length


def page_count(data_length: int, page_size: int) -> int:
    """Pages covering ``data_length`` bytes; the last one may be short (it is never padded on disk)."""
    return -(-data_length // page_size)
