"""Streaming a pageset file into one S3 multipart upload while it is assembled, with no local copy.

The header at offset 0 is written last (it holds the counts, the section table offset and the dataset id), so the
first ``part_size`` bytes stay in memory and go up last as part 1, while the bytes after them are uploaded as parts
2, 3, ... as soon as ``part_size`` of them are ready. S3 concatenates parts by number, whatever the upload order,
and makes the object visible only when ``complete_multipart_upload`` succeeds; :meth:`S3PartsFile.abort` drops
every uploaded part. Memory: at most two parts (2 x 64 MiB by default).
"""

from __future__ import annotations

MIN_PART = 5 << 20  # S3's smallest part but the last


class S3PartsFile:
    """A write-only file over one S3 multipart upload, for the writers' access pattern: sequential writes,
    forward seeks (the gap reads as zeros), and rewrites inside the first ``part_size`` bytes (the header).

    ``fs`` is an ``s3fs.S3FileSystem``; ``path`` is ``bucket/key``. Raises ValueError for a write that would
    go back before the bytes already uploaded.
    """

    def __init__(self, fs, path: str, part_size: int):
        if part_size < MIN_PART:
            raise ValueError(f"part_size must be >= {MIN_PART} bytes (S3's minimum), got {part_size}")
        self.fs, self.part_size = fs, part_size
        self.bucket, self.key, _ = fs.split_path(path)
        self.head = bytearray()  # bytes [0, part_size): uploaded last, as part 1
        self.tail = bytearray()  # bytes [sent, end) not yet uploaded
        self.sent = part_size  # file offset where ``tail`` starts
        self.end = 0  # bytes in the file so far
        self.pos = 0
        self.parts: list[dict] = []
        self.closed = False
        self.upload_id = fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)["UploadId"]

    # -- file protocol used by the writers ------------------------------------------------------------------
    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else self.end + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        n = len(mv)
        if self.pos > self.end:
            self._append(bytes(self.pos - self.end))
        if self.pos < self.end:  # a rewrite: only inside the head, which is still in memory
            stop = self.pos + n
            if stop > self.part_size:
                raise ValueError(f"S3 upload: cannot rewrite bytes [{self.pos}, {stop}): the part holding them "
                                 "was uploaded already")
            over = min(stop, self.end) - self.pos
            self.head[self.pos:self.pos + over] = mv[:over]
            self.pos += over
            mv = mv[over:]
        if len(mv):
            self._append(mv)
        return n

    def truncate(self, size: int | None = None) -> int:
        size = self.pos if size is None else size
        if size > self.end:
            self.pos, keep = self.end, self.pos
            self._append(bytes(size - self.end))
            self.pos = keep
        elif size < self.end:
            raise ValueError(f"S3 upload: cannot truncate to {size} bytes below {self.end} written")
        return size

    def flush(self) -> None:
        pass

    def _append(self, mv) -> None:
        mv = memoryview(mv).cast("B")
        room = self.part_size - len(self.head)
        if room > 0:
            self.head += mv[:room]
            mv = mv[room:]
        self.tail += mv
        self.end = len(self.head) + (self.sent - self.part_size) + len(self.tail)
        self.pos = self.end
        while len(self.tail) >= 2 * self.part_size:  # keep one part back: the last one may be short
            self._upload(bytes(self.tail[:self.part_size]))
            del self.tail[:self.part_size]
            self.sent += self.part_size

    def _upload(self, body: bytes, number: int | None = None) -> None:
        number = number if number is not None else len(self.parts) + 2
        out = self.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                              PartNumber=number, Body=body)
        self.parts.append({"PartNumber": number, "ETag": out["ETag"]})

    # -- ending ----------------------------------------------------------------------------------------------
    def complete(self) -> None:
        """Upload what is left and part 1, then complete: the object appears, whole, at once."""
        if self.tail:
            self._upload(bytes(self.tail))
            self.tail = bytearray()
        self._upload(bytes(self.head), number=1)
        parts = sorted(self.parts, key=lambda p: p["PartNumber"])
        self.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                        MultipartUpload={"Parts": parts})
        self.fs.invalidate_cache(f"{self.bucket}/{self.key}")
        self.closed = True

    def abort(self) -> None:
        """Drop the upload and every part sent (the previous object, if any, is untouched)."""
        if not self.closed:
            self.closed = True
            self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)

    def close(self) -> None:
        self.abort()
