"""Exceptions raised for files that are not valid pageset files.

Every error names the file, the section and the byte offset where the problem was found, so a user with a
100 GB file knows where to look. All derive from :class:`FormatError` (itself a ``ValueError``), so one
``except pageset.FormatError`` catches every kind of damaged or foreign file.
"""

from __future__ import annotations

import os


class FormatError(ValueError):
    """A file is not a valid pageset file.

    Attributes: ``path`` (str), ``section`` (str, e.g. ``"header"``, ``"index"``), ``offset`` (int, byte
    offset in the file where the problem was found, or ``None``), ``detail`` (str).
    """

    def __init__(self, path: str | os.PathLike, section: str, offset: int | None, detail: str):
        self.path = os.fspath(path)
        self.section = section
        self.offset = offset
        self.detail = detail
        where = f"{section}" if offset is None else f"{section} at byte {offset}"
        super().__init__(f"{self.path}: {where}: {detail}")

    def __reduce__(self):
        # pickled as its constructor's arguments (a Loader's child process sends it to the trainer's process,
        # multiprocessing pools send it back): the same class and attributes on the other side
        return (type(self), (self.path, self.section, self.offset, self.detail), self.__dict__)


class BadMagicError(FormatError):
    """The first bytes are not the pageset magic (not a pageset file, or damaged by a text-mode copy)."""


class UnsupportedVersionError(FormatError):
    """The file's major version is newer than this reader (upgrade pageset) or unknown."""


class UnsupportedFeatureError(UnsupportedVersionError):
    """The file sets a required feature bit this reader does not implement (upgrade pageset)."""


class TruncatedFileError(FormatError):
    """The file is shorter than its header or section table says (an interrupted copy or download)."""


class FileChangedError(FormatError):
    """The file was modified in place (rewritten, overwritten or touched) after it was opened: bytes read from it
    may mix old and new content. Replace files by renaming a new one over them, as ``write_dataset`` does."""


class ChecksumMismatchError(FormatError):
    """Stored and computed CRC-32 differ: the bytes changed after writing (disk, copy or edit damage)."""


class SchemaError(FormatError):
    """The schema section is not valid canonical JSON of format v1, or disagrees with the index."""


class IndexBoundsError(FormatError):
    """An index row points outside the file or the page area, or breaks a required ordering."""


class MemberMismatchError(FormatError):
    """A member file of a many-file dataset is not the file its manifest lists (another dataset id, size, page
    or record count): it was replaced or rewritten after the manifest was written. Names the member and what
    differs."""


class RemoteReadError(OSError):
    """A range request to a URL failed after every retry (timeouts, resets, 5xx, 429/SlowDown, short bodies);
    the message names the URL, the byte range and the number of attempts."""


class ObjectChangedError(RemoteReadError):
    """The object behind a URL changed (another ETag or version) after it was opened: pages of two files are
    never mixed; reopen the dataset to read the new object."""


def plural(count: int, noun: str, many: str | None = None) -> str:
    """``'1 page'``, ``'0 pages'``, ``'2 pages'`` (``many``: the plural when it is not ``noun + 's'``), for the
    counts in messages."""
    return f"{count} {noun}" if count == 1 else f"{count} {many or noun + 's'}"
