"""``open_dataset``: open and validate a pageset file, then read records (:class:`Dataset`).

Validation at open follows ``formats/v1.md`` (:mod:`pageset.read.validate`): magic -> version and feature bits ->
header checksum -> file size vs sections -> section checksums -> zero padding -> schema -> index bounds. Each
step raises its own :class:`~pageset.format.FormatError` subclass naming the path, section and byte offset. Page
checksums are checked by :meth:`Dataset.verify` (``pageset verify``), not at open: that would read the whole
file. The zero padding (bytes ``[160, data_offset)`` and the alignment gaps around the sections) is checked at
open and again by ``verify()``: it is a few KiB, and no CRC covers it.

The bytes come from a :class:`~pageset.read.file_access.LocalFile` or a
:class:`~pageset.read.file_access.URLFile` (the same methods): ``pread`` (``os.preadv``) or range requests,
never a memory map, so a file truncated or rewritten in place under an open Dataset raises
:class:`TruncatedFileError` (naming the byte range that could not be read) or :class:`FileChangedError` instead
of killing the process with SIGBUS. Only :attr:`Dataset.buffer` (and ``TokenDataset.tokens``) map the file, on
first use, for callers that want zero-copy views and own the file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import numpy as np

from ..format import arguments as check
from ..format import constants as C
from ..format.errors import ChecksumMismatchError, FormatError
from ..format.fields import JSON, Bytes, Field, Float, Int, NDArray, RGBImage, RGBImages, TokenIds
from ..format.layout import IMAGES_ENTRY
from .file_access import READ_CHUNK, REMOTE_HEAD, LocalFile, URLFile
from .remote import local_path, url_scheme
from .validate import check_padding, read_metadata

@dataclass(frozen=True)
class EncodedImage:
    """An image as stored: ``data`` (bytes: a JPEG, or ``height*width*3`` raw HWC RGB uint8 bytes), ``height``
    and ``width`` (pixels), ``encoding`` (``"jpeg"`` or ``"raw"``)."""

    data: bytes = dataclass_field(repr=False)
    height: int
    width: int
    encoding: str

    def to_numpy(self) -> np.ndarray:
        """Decode to uint8[height, width, 3] RGB (Pillow for JPEG; a reshape for raw)."""
        if self.encoding == "raw":
            return np.frombuffer(self.data, dtype=np.uint8).reshape(self.height, self.width, 3).copy()
        from PIL import Image

        with Image.open(io.BytesIO(self.data)) as img:
            return np.asarray(img.convert("RGB"))


class Dataset:
    """A validated, read-only pageset file.

    ``len(ds)`` records; ``ds[i]`` -> ``{field: value}``; ``ds.read(i, field)``; ``ds.schema`` (dict),
    ``ds.fields`` (name -> Field), ``ds.dataset_id`` (hex str), ``ds.header`` (dict), ``ds.metadata`` (dict with
    ``lineage`` and ``user``), ``ds.index`` (read-only structured array, one row per record),
    ``ds.page_size``, ``ds.page_count``, ``ds.data_offset``. Use as a context manager or call ``close()``.

    Reads use ``pread``: if the file is truncated or modified in place while it is open, reads raise
    TruncatedFileError / FileChangedError (never SIGBUS); a file replaced by a rename keeps being read whole.
    Page sources build on ``ds.read_into(offset, out)`` and ``ds.check_unchanged()``.

    ``path`` may be a URL (``s3://bucket/key``, ``http(s)://...``, any fsspec protocol; see
    :mod:`pageset.read.remote`): the header, section table and sections are fetched at open (three requests)
    and validated exactly like a local file's; records and pages are then read by range requests, each page's
    CRC-32 checked on arrival, every request pinned to the object's ETag (ObjectChangedError otherwise).
    ``storage_options`` go to the fsspec filesystem (endpoint, credentials); ``request_timeout`` (seconds) and
    ``request_attempts`` bound every request. ``ds.remote`` is the pinned
    :class:`~pageset.read.remote.RemoteFile` (None for a local file).
    """

    def __init__(self, path, storage_options: dict | None = None, *, request_timeout: float = 30.0,
                 request_attempts: int = 5):
        path = local_path(path)
        if url_scheme(path) is not None:
            from .remote import RetryPolicy

            self._io = URLFile(path, storage_options, RetryPolicy(request_timeout, request_attempts))
        else:
            self._io = LocalFile(path, storage_options)
        self.path, self.remote = self._io.path, self._io.remote
        try:
            try:
                read_metadata(self)
            except ChecksumMismatchError:
                if not self._io.reread_on_checksum_error:
                    raise
                self._io.drop_cached()
                read_metadata(self)  # a flipped bit on the wire: read the metadata once more before calling it damaged
        except BaseException:
            self._io.close()
            raise
        finally:
            self._io.drop_cached()

    # ---- validation ------------------------------------------------------------------------------------
    def _err(self, cls, section, offset, detail):
        return cls(self.path, section, offset, detail)

    @property
    def page_reader(self):
        """A URL's :class:`~pageset.read.remote.PageReader` (pages CRC-checked on arrival), None locally."""
        return self._io.page_reader

    # ---- access ----------------------------------------------------------------------------------------
    def _pread(self, offset: int, length: int) -> bytes:
        return self._io.pread(offset, length)

    def read_into(self, offset: int, out) -> None:
        """Fill ``out`` (a writable contiguous buffer: bytearray, uint8 numpy array) with the file's bytes
        ``[offset, offset + len(out))`` using ``pread``; thread-safe, releases the GIL.

        Raises TruncatedFileError naming the file and the byte range when the file ends first (it was truncated
        or rewritten in place after it was opened).
        """
        self._io.read_into(offset, out)

    def check_unchanged(self) -> None:
        """Raise if the file changed in place since it was opened (one ``fstat``, ~1 us).

        Call it after reading: bytes read before a call that passes are the file as opened (a write updates
        the file's mtime before its data). Raises TruncatedFileError (the file shrank) or FileChangedError
        (another size, or a new modification time: rewritten, overwritten or touched). A URL: nothing to do (every
        request carries the pinned ETag: ObjectChangedError).
        """
        self._io.check_unchanged()

    def _read_checked(self, offset: int, length: int) -> bytes:
        return self._io.read_checked(offset, length)

    def __len__(self) -> int:
        return self.record_count

    def _row(self, i: int):
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"record indices are ints, got {type(i).__name__}")
        n = self.record_count
        if not -n <= i < n:
            raise IndexError(f"{self.path}: record {i} is out of range for {n} records")
        return self.index[int(i) % n]

    def read(self, i: int, name: str):
        """The decoded value of field ``name`` of record ``i``.

        Int/Float -> Python int/float (bool for a bool Int); NDArray -> a new array of the field's dtype and
        shape; Bytes -> bytes; JSON -> the value; RGBImage -> :class:`EncodedImage`; RGBImages -> a list of
        EncodedImage; TokenIds -> a new 1-D array of the field's dtype (with ``loss_mask``: ``{"input_ids": that
        array, "loss_mask": uint8[n]}``).
        Raises IndexError (out-of-range i) or KeyError (unknown field).
        """
        if name not in self.fields:
            raise KeyError(f"{self.path}: no field {name!r}; fields are {list(self.fields)}")
        return self._decode(self._row(i), name, self.fields[name])

    def _bytes(self, off: int, length: int) -> bytes:
        return self._read_checked(off, length)

    def _decode(self, row, name: str, field: Field):
        if isinstance(field, (Int, Float)):
            return row[name].item()
        off, length = int(row[f"{name}.offset"]), int(row[f"{name}.length"])
        if isinstance(field, RGBImage):
            enc = C.ENCODING_NAMES[int(row[f"{name}.encoding"])]
            return EncodedImage(self._bytes(off, length), int(row[f"{name}.height"]), int(row[f"{name}.width"]), enc)
        if isinstance(field, NDArray):
            dt = np.dtype(field.dtype).newbyteorder("<")
            return np.frombuffer(self._bytes(off, length), dtype=dt).reshape(field.shape).astype(field.dtype)
        if isinstance(field, Bytes):
            return self._bytes(off, length)
        if isinstance(field, TokenIds):
            data = self._bytes(off, length)
            n = length // field.record_width
            ids = np.frombuffer(data, dtype=np.dtype(field.dtype).newbyteorder("<"), count=n).astype(field.dtype)
            if not field.loss_mask:
                return ids
            return {"input_ids": ids, "loss_mask": np.frombuffer(data, np.uint8, offset=length - n).copy()}
        if isinstance(field, RGBImages):
            return self._images(self._bytes(off, length), int(row[f"{name}.count"]), name, off)
        if isinstance(field, JSON):
            return json.loads(self._bytes(off, length).decode("utf-8"))
        raise TypeError(f"unknown field type {type(field).__name__}")

    def _images(self, data: bytes, count: int, name: str, off: int) -> list:
        """The EncodedImages of an image-list value stored at byte ``off`` (formats/v1.md section 5); FormatError
        (naming the field and the value's offset) for a damaged one."""
        n = int(np.frombuffer(data, "<u4", count=1)[0]) if len(data) >= 4 else -1
        entries = np.frombuffer(data, IMAGES_ENTRY, count=n, offset=4) if 0 <= n == count and (
            len(data) >= 4 + n * IMAGES_ENTRY.itemsize) else None
        at = 4 + count * IMAGES_ENTRY.itemsize
        if entries is None or at + int(entries["length"].astype(np.int64).sum()) != len(data):
            raise self._err(FormatError, "data", off, f"field {name!r}: the image list's entries do not match its "
                            f"bytes (count {count}); the file is damaged: check it with `pageset verify`")
        out = []
        for e in entries:
            end = at + int(e["length"])
            enc = C.ENCODING_NAMES.get(int(e["encoding"]))
            if enc is None:
                raise self._err(FormatError, "data", off, f"field {name!r}: unknown image encoding "
                                f"{int(e['encoding'])}; the file is damaged: check it with `pageset verify`")
            out.append(EncodedImage(data[at:end], int(e["height"]), int(e["width"]), enc))
            at = end
        return out

    def __getitem__(self, i: int) -> dict:
        row = self._row(i)
        return {name: self._decode(row, name, field) for name, field in self.fields.items()}

    def __iter__(self):
        for i in range(self.record_count):
            yield self[i]

    @property
    def buffer(self) -> np.ndarray:
        """The whole file as a read-only uint8 array over a memory map, made on first use (valid until
        ``close()``). Zero-copy, but unguarded: if the file is truncated or rewritten in place while the map is
        in use, touching a page past its new end kills the process with SIGBUS (like SQLite with
        ``mmap_size``). Only use it on files nobody modifies in place; ``ds[i]``, ``read``, ``verify`` and the
        Loader never use it. Raises ValueError for a URL (no whole-file buffer)."""
        return self._io.buffer()

    def fileno(self) -> int:
        """The open file's descriptor (valid until ``close()``). Raises ValueError for a URL."""
        return self._io.fileno()

    @property
    def page_checksums(self) -> np.ndarray | None:
        """uint32[page_count] stored CRC-32 of each page, or None when the file has none."""
        return self._page_crcs

    def check_page(self, k: int, sample: int | None = None) -> None:
        """Recompute page ``k``'s CRC-32; raise ChecksumMismatchError naming the page, its byte offset and
        ``sample`` (the sample index that needed it) on a mismatch."""
        start = self.data_offset + k * self.page_size
        if self._page_crc(k) != int(self._page_crcs[k]):
            self.check_unchanged()  # a change under the reader, not damage at rest
            who = f" (needed by sample {sample})" if sample is not None else ""
            raise self._err(ChecksumMismatchError, f"page {k}", start, f"page CRC-32 mismatch{who}; the file is "
                            "damaged: rewrite it or restore a copy")

    def _page_crc(self, k: int, scratch: np.ndarray | None = None) -> int:
        """CRC-32 of page ``k``'s stored bytes."""
        start = self.data_offset + k * self.page_size
        return self._io.page_crc(start, min(self.page_size, self.data_offset + self.data_length - start), scratch)

    def record_pages(self) -> np.ndarray:
        """int64[N]: the page holding each record's first byte (zero-length records: the page of their offset,
        clamped to the last page). With no pages at all (only scalar fields), every record is on page 0."""
        if self.page_count == 0:
            return np.zeros(self.record_count, dtype=np.int64)
        pages = (self.index["_offset"].astype(np.int64) - self.data_offset) // self.page_size
        return np.minimum(pages, self.page_count - 1)

    def records_per_page(self) -> np.ndarray:
        """int64[max(page_count, 1)]: records whose first byte lies in each page (records are in page order)."""
        return np.bincount(self.record_pages(), minlength=max(self.page_count, 1)).astype(np.int64)

    def verify(self) -> None:
        """Recompute every page CRC-32 and the dataset id, and re-check the zero padding.

        Raises ChecksumMismatchError naming the first bad page, its byte offset and the sample indices stored
        in it; FormatError for a non-zero padding byte or a file without page checksums; TruncatedFileError /
        FileChangedError for a file changed in place since it was opened.
        """
        if self._page_crcs is None:
            raise self._err(FormatError, "page_checksums", None, "this file has no page checksums to verify")
        try:  # (a URL: the padding lies in the head and the tail, two requests as at open)
            self._io.load_range(0, min(self.file_size, REMOTE_HEAD))
            self._io.load_range(self.data_offset + self.data_length, self.file_size)
            check_padding(self)
        finally:
            self._io.drop_cached()
        ps = self.page_size
        scratch = np.empty(min(ps, READ_CHUNK), dtype=np.uint8)
        for k, crc in self._io.stored_page_crcs(self.data_offset, self.data_length, ps, self.page_count, scratch):
            start = self.data_offset + k * ps
            if crc != int(self._page_crcs[k]):
                self.check_unchanged()  # a change under the reader, not damage at rest
                if self.tokens_info is not None:  # a token file: no records; say which tokens and documents
                    size = np.dtype(self.tokens_info["dtype"]).itemsize
                    t0 = k * ps // size
                    t1 = min((k + 1) * ps, self.data_length) // size
                    offs = self.doc_offsets.astype(np.int64)
                    d0 = max(0, int(np.searchsorted(offs, t0, side="right")) - 1)
                    d1 = max(d0, int(np.searchsorted(offs, t1, side="left")) - 1)
                    raise self._err(
                        ChecksumMismatchError, f"page {k}", start,
                        f"page CRC-32 mismatch; this page holds tokens [{t0}, {t1}) (documents {d0}..{d1})",
                    )
                pages = self.record_pages()
                ends = (self.index["_offset"] + self.index["_length"]).astype(np.int64)
                hit = np.flatnonzero((self.index["_offset"].astype(np.int64) < start + ps) & (ends > start))
                hit = np.union1d(hit, np.flatnonzero(pages == k))
                shown = ", ".join(map(str, hit[:20])) + (" ..." if hit.size > 20 else "")
                raise self._err(
                    ChecksumMismatchError, f"page {k}", start,
                    f"page CRC-32 mismatch; samples stored in this page: [{shown}]",
                )
        schema_bytes = _canonical(self.schema)
        extra = self.doc_offsets.tobytes() if self.tokens_info is not None else b""  # token files (1.1)
        if self.tokens_info is not None and self.loss_mask_bits is not None:
            extra += self.loss_mask_bits.tobytes()  # token files with a loss mask (1.1, section 10.1)
        digest = hashlib.sha256(schema_bytes + self.index.tobytes() + self._page_crcs.tobytes() + extra).hexdigest()
        self.check_unchanged()
        if digest != self.dataset_id:
            raise self._err(ChecksumMismatchError, "header", 96, "dataset id does not match the file's content")

    def close(self) -> None:
        """Release the mmap and the file. Arrays obtained from ``buffer`` must not be used afterwards."""
        self._io.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}: {f.kind}" for n, f in self.fields.items())
        return f"Dataset({self.path!r}, records={self.record_count}, fields={{{fields}}}, id={self.dataset_id[:12]})"


def _canonical(doc) -> bytes:
    from ..format.schema import canonical_json

    return canonical_json(doc)


def check_path(path) -> None:
    """TypeError unless ``path`` is a str or os.PathLike (an int would be taken as an open file descriptor)."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be the pageset file's path or URL (str or os.PathLike), got {path!r} "
                        f"({type(path).__name__})")


def check_open_arguments(path, storage_options, request_timeout, request_attempts) -> None:
    """The checks shared by open_dataset and open_tokens: TypeError / ValueError naming the argument."""
    check_path(path)
    check.mapping("storage_options", storage_options, optional=True)
    check.real("request_timeout", request_timeout, low=0, low_open=True)
    check.integer("request_attempts", request_attempts, minimum=1)
