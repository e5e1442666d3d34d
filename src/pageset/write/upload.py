"""Streaming a pageset file into one S3 multipart upload while it is assembled, with no local copy.

The header at offset 0 is written last (it holds the counts, the section table offset and the dataset id), so
part 1 (the file's first bytes) stays in memory and goes up last, while the bytes after it are uploaded as parts
2, 3, ... as soon as each is full. S3 concatenates parts by number, whatever the upload order, and makes the object
visible only when ``complete_multipart_upload`` succeeds; :meth:`S3PartsFile.abort` drops every uploaded part.

Part sizes follow :class:`PartPlan`, a pure function of the part number (the final size is not known while the
file streams): 64 MiB for parts 1-500, 128 MiB for 501-1000, ... 1,280 MiB for 9,501-10,000, so that every part
but the last is within S3's 5 MiB .. 5 GiB and any output up to 5 TiB (S3's largest object) fits in 10,000 parts.
A larger output is refused before its bytes past the limit are uploaded (before any upload where a lower bound of
its size is known), naming the limit. Memory: part 1 plus the part being filled (at most 64 MiB + 1,280 MiB).

Every request to the store is bounded like the reader's (:class:`~pageset.format.retry.RetryPolicy`: ``request_timeout`` seconds per
request, ``request_attempts`` attempts, backoff with jitter between them), so an endpoint that never answers
fails within about ``attempts x (timeout + backoff)`` with an error naming the URL instead of hanging; failures
that retrying cannot fix (no bucket, no credentials, access denied) are raised at once, naming the URL and the fix.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import random
import time
import warnings
from dataclasses import dataclass

from ..format.errors import plural
from ..format.retry import RetryPolicy
from ..format.store_errors import one_try_options, store_fault

MIN_PART = 5 << 20  # S3's smallest part but the last
MAX_PART = 5 << 30  # S3's largest part
MAX_PARTS = 10_000  # part numbers 1 .. 10,000
MAX_OBJECT = 5 << 40  # S3's largest object (the "5 TB" of its documentation is 5 TiB)


def _iec(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} bytes"


@dataclass(frozen=True)
class PartPlan:
    """The size of each part of a multipart upload whose final size is not known in advance: part ``number``
    (1-based) holds ``first * (1 + (number - 1) // parts_per_step)`` bytes, at most 5 GiB (the last part of an
    upload holds what is left). The default (``first`` 64 MiB, ``parts_per_step`` 500) reaches 6.4 TiB in 10,000
    parts, so :meth:`limit` is S3's 5 TiB; ``first`` must be in [5 MiB, 5 GiB] (S3's part sizes) and
    ``parts_per_step`` an int >= 1. Deterministic: the same bytes always give the same parts."""

    first: int = 64 << 20
    parts_per_step: int = 500

    def __post_init__(self):
        if isinstance(self.first, bool) or not isinstance(self.first, int) or not MIN_PART <= self.first <= MAX_PART:
            raise ValueError(f"first (bytes of part 1) must be an int in [{MIN_PART}, {MAX_PART}] (S3's part "
                             f"sizes), got {self.first!r}")
        if isinstance(self.parts_per_step, bool) or not isinstance(self.parts_per_step, int) \
                or self.parts_per_step < 1:
            raise ValueError(f"parts_per_step must be an int >= 1, got {self.parts_per_step!r}")

    def size(self, number: int) -> int:
        """Bytes of part ``number`` (1 .. 10,000) when it is not the last part; ValueError outside that range."""
        if not 1 <= number <= MAX_PARTS:
            raise ValueError(f"S3 part numbers are 1 .. {MAX_PARTS}, got {number}")
        return min(self.first * (1 + (number - 1) // self.parts_per_step), MAX_PART)

    def limit(self) -> int:
        """The largest upload this plan allows, in bytes: its 10,000 parts together, at most S3's 5 TiB."""
        return _plan_total(self.first, self.parts_per_step, MAX_OBJECT)

    def sizes(self, total: int) -> list[int]:
        """The parts an upload of ``total`` bytes is cut into: ``[size(1), size(2), ..., rest]`` (sum ``total``;
        ``[0]``, one empty part, for 0 bytes). ValueError above :meth:`limit`, naming it."""
        self.check(total)
        out, left, number = [], total, 1
        while left > 0 or not out:
            out.append(min(self.size(number), left))
            left -= out[-1]
            number += 1
        return out

    def check(self, total: int, url: str = "S3 upload") -> None:
        """ValueError when an output of ``total`` bytes is larger than :meth:`limit`, naming the limit and the fix."""
        limit = self.limit()
        if total > limit:
            what = ("S3's largest object" if limit == MAX_OBJECT else
                    f"what {MAX_PARTS:,} parts of this part plan ({self!r}) hold")
            raise ValueError(f"{url}: the output needs more than {limit:,} bytes ({_iec(limit)}, {what}), at least "
                             f"{total:,}: nothing is kept; write it as several files (e.g. one per part of the "
                             "source) and read them together, or write to a local path")


DEFAULT_PARTS = PartPlan()


@functools.lru_cache(maxsize=64)
def _plan_total(first: int, parts_per_step: int, max_object: int) -> int:
    plan = PartPlan(first, parts_per_step)
    return min(sum(plan.size(n) for n in range(1, MAX_PARTS + 1)), max_object)


# the writers' request bounds: the reader's policy type (format/retry.py), one type for reads and writes
WritePolicy = RetryPolicy


def _chain(exc):
    for _ in range(16):  # bounded walk of __cause__ / __context__
        if exc is None:
            return
        yield exc
        exc = exc.__cause__ or exc.__context__


def _status(exc) -> tuple[int | None, str]:
    for e in _chain(exc):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            err = resp.get("Error", {}) or {}
            return (resp.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode"), str(err.get("Code", ""))
    return None, ""


CREDENTIALS_FIX = ("give credentials in storage_options (e.g. {'key': ..., 'secret': ...}, or 'profile'; "
                   "--storage-options on the command line) or in the AWS_* environment; with an executor (Dask) "
                   "the workers need them too: storage_options reach the workers, the driver's environment does not")


def classify(exc: BaseException, url: str, what: str):
    """A failed store request as the error to raise (FileNotFoundError / PermissionError naming ``url`` and the
    fix; OSError with the store's status, code and message for any other refusal (4xx); ``exc`` itself for a bug
    or bad argument), or None when it is worth another attempt (timeouts, resets, refused connections, 5xx,
    throttling: :func:`pageset.format.store_errors.store_fault`)."""
    fault = store_fault(exc)
    if fault.kind == "credentials":
        return PermissionError(f"{url}: no credentials for {what} ({exc}); {CREDENTIALS_FIX}")
    status, code = _status(exc)
    if code == "NoSuchBucket" or "bucket does not exist" in str(exc).lower():
        return FileNotFoundError(f"{url}: {what}: the bucket does not exist; create it first (e.g. "
                                 "s3fs.S3FileSystem(**storage_options).mkdir('BUCKET')) or write to an existing "
                                 "bucket")
    if isinstance(exc, FileNotFoundError) or status == 404:
        return FileNotFoundError(f"{url}: {what}: not found ({exc}); check the bucket and the path")
    if isinstance(exc, PermissionError) or status in (401, 403) or code in (
            "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return PermissionError(f"{url}: {what}: access denied ({exc}); check the credentials and the bucket's "
                               f"permissions: {CREDENTIALS_FIX}")
    if isinstance(exc, (TypeError, AttributeError, NameError, ValueError)) and status is None:
        return exc  # a bug or a bad argument, not a transient failure
    if not fault.retry:  # any other 4xx: asking again gets the same answer
        err = OSError(f"{url}: {what}: {fault.describe()}; {fault.advice()}")
        err.status, err.code = fault.status, fault.code
        return err
    return None


def bounded(fs, make_coro, url: str, what: str, policy: WritePolicy | None):
    """Run ``make_coro()`` (a coroutine of the async filesystem ``fs``, e.g. s3fs's ``_call_s3``) on ``fs.loop``,
    each attempt cut at ``policy.timeout`` s and cancelled, at most ``policy.attempts`` times. Raises the
    :func:`classify`-ed error, or TimeoutError / ConnectionError naming ``url``, ``what`` and the knobs."""
    policy = policy or WritePolicy()
    rng = random.Random()
    last, timed_out, fault = "?", True, None
    for attempt in range(policy.attempts):
        if attempt:
            time.sleep(policy.delay(attempt - 1, rng))
        fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(make_coro(), policy.timeout), fs.loop)
        try:
            return fut.result(policy.timeout + 5)
        except (asyncio.TimeoutError, concurrent.futures.TimeoutError):
            fut.cancel()
            last, timed_out = f"no answer within {policy.timeout} s", True
        except Exception as exc:
            err = classify(exc, url, what)
            if err is exc:
                raise
            if err is not None:
                err.pageset_store_error = True  # worded already: callers re-raise it as is
                raise err from exc
            fault = store_fault(exc)
            last, timed_out = fault.describe(), fault.kind == "timeout"
    kind = TimeoutError if timed_out else ConnectionError
    advice = fault.advice() if fault is not None and not timed_out else (
        "Check the endpoint in storage_options (client_kwargs.endpoint_url) and the network, or raise "
        "request_timeout / request_attempts")
    err = kind(f"{url}: {what} failed after {plural(policy.attempts, 'attempt')} (request_timeout {policy.timeout} s "
               f"each); last error: {last}. {advice[0].upper() + advice[1:]}")
    err.pageset_store_error = True
    raise err


def pipe_bounded(fs, path: str, data: bytes, url: str, what: str, policy: WritePolicy | None = None) -> None:
    """``fs.pipe_file(path, data)``, each attempt bounded by ``policy`` (default 30 s x 5) on an async
    filesystem (S3, GCS, Azure); a plain call on others (memory://, local)."""
    if getattr(fs, "async_impl", False) and callable(getattr(fs, "_pipe_file", None)):
        bounded(fs, lambda: fs._pipe_file(path, data), url, what, policy)
    else:
        fs.pipe_file(path, data)


class S3PartsFile:
    """A write-only file over one S3 multipart upload, for the writers' access pattern: sequential writes,
    forward seeks (the gap reads as zeros), and rewrites inside part 1 (the header), which is uploaded last.

    ``fs`` is an ``s3fs.S3FileSystem``; ``path`` is ``bucket/key``; ``parts`` (a :class:`PartPlan`, default
    64 MiB growing by 64 MiB every 500 parts) sizes the parts; ``url`` names the object in errors; ``policy``
    bounds every request (:func:`bounded`); ``min_size`` is a lower bound of the final size in bytes, when the
    caller knows one: above ``parts.limit()`` (5 TiB) it is refused before the upload starts. Raises ValueError
    for a write that would go back before the bytes already uploaded, or take the file past ``parts.limit()``
    (before those bytes are uploaded; the caller aborts); FileNotFoundError / PermissionError / TimeoutError /
    ConnectionError naming the URL when the store fails.
    """

    def __init__(self, fs, path: str, parts: PartPlan | None = None, url: str | None = None,
                 policy: WritePolicy | None = None, min_size: int = 0):
        self.fs, self.plan = fs, parts or DEFAULT_PARTS
        self.url, self.policy = url or f"s3://{path}", policy or WritePolicy()
        self.limit = self.plan.limit()
        self.plan.check(min_size, self.url)  # a known size: refused before anything is sent
        self.bucket, self.key, _ = fs.split_path(path)
        self.head_size = self.plan.size(1)
        self.head = bytearray()  # bytes [0, head_size): uploaded last, as part 1
        self.tail = bytearray()  # bytes [sent, end) not yet uploaded: the part being filled
        self.sent = self.head_size  # file offset where ``tail`` starts
        self.number = 2  # the part ``tail`` fills
        self.end = 0  # bytes in the file so far
        self.pos = 0
        self.parts: list[dict] = []
        self.closed = False
        self.upload_id = None
        self.upload_id = self._call("create_multipart_upload", "starting the upload", Bucket=self.bucket,
                                    Key=self.key)["UploadId"]

    def _call(self, method: str, what: str, **kwargs):
        return bounded(self.fs, lambda: self.fs._call_s3(method, **kwargs), self.url, what, self.policy)

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
            if stop > self.head_size:
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
        if self.end + len(mv) > self.limit:
            self.plan.check(self.end + len(mv), self.url)
        room = self.head_size - len(self.head)
        if room > 0:
            self.head += mv[:room]
            mv = mv[room:]
        while len(mv):
            size = self.plan.size(self.number)
            take = mv[:size - len(self.tail)]
            self.tail += take
            mv = mv[len(take):]
            if len(self.tail) == size:  # full: up it goes (a full part is valid as the last one too)
                self._upload(bytes(self.tail), self.number)
                self.sent += size
                self.number += 1
                self.tail = bytearray()
        self.end = len(self.head) + (self.sent - self.head_size) + len(self.tail)
        self.pos = self.end

    def _upload(self, body: bytes, number: int) -> None:
        out = self._call("upload_part", f"uploading part {number} ({len(body):,} bytes)", Bucket=self.bucket,
                         Key=self.key, UploadId=self.upload_id, PartNumber=number, Body=body)
        self.parts.append({"PartNumber": number, "ETag": out["ETag"]})

    # -- ending ----------------------------------------------------------------------------------------------
    def complete(self) -> None:
        """Upload what is left and part 1, then complete: the object appears, whole, at once."""
        if self.tail:
            self._upload(bytes(self.tail), self.number)
            self.tail = bytearray()
        self._upload(bytes(self.head), number=1)
        parts = sorted(self.parts, key=lambda p: p["PartNumber"])
        self._call("complete_multipart_upload", "completing the upload", Bucket=self.bucket, Key=self.key,
                   UploadId=self.upload_id, MultipartUpload={"Parts": parts})
        self.fs.invalidate_cache(f"{self.bucket}/{self.key}")
        self.closed = True

    def abort(self) -> None:
        """Drop the upload and every part sent (the previous object, if any, is untouched)."""
        if not self.closed:
            self.closed = True
            if self.upload_id is not None:  # one bounded attempt: this runs while another error is raised
                try:
                    bounded(self.fs, lambda: self.fs._call_s3("abort_multipart_upload", Bucket=self.bucket,
                                                              Key=self.key, UploadId=self.upload_id),
                            self.url, "aborting the upload", WritePolicy(self.policy.timeout, 1))
                except Exception as exc:
                    warnings.warn(f"{self.url}: could not abort multipart upload {self.upload_id} ({exc}); its "
                                  "parts stay billed until aborted (list_multipart_uploads / a lifecycle rule)",
                                  RuntimeWarning, stacklevel=2)

    def close(self) -> None:
        self.abort()


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def check_url_output(url: str, storage_options: dict | None, call: str, policy: WritePolicy | None = None,
                     inputs=()) -> None:
    """Refuse to write the URL ``url`` where a writer would destroy data, before any work: ``url`` is one of
    ``inputs`` (ValueError), or an existing, non-empty object whose first bytes are not the pageset magic
    (ValueError, like a local file; ``call`` shows the argument order). Reads at most the magic's bytes, each
    request bounded by ``policy``. Also raises FileNotFoundError (the bucket does not exist), PermissionError
    (no credentials), TimeoutError / ConnectionError (the store does not answer), naming ``url`` and the fix.
    An object the credentials may not read (HTTP 403) passes: write-only credentials are valid for writing."""
    from ..format import constants as C

    for src in inputs:
        if isinstance(src, str) and _same_url(src, url):
            raise ValueError(f"the output {url!r} is the input {src!r}: writing would destroy the source; choose "
                             "another output path")
    try:
        from fsspec.core import url_to_fs

        fs, target = url_to_fs(url, **one_try_options(url, storage_options))
    except ImportError as exc:
        raise ImportError(f"cannot write {url}: {exc}; install the fsspec backend for its scheme (s3fs for "
                          "s3://, gcsfs for gs://, adlfs for az://)") from None
    n = len(C.MAGIC)
    if callable(getattr(fs, "_call_s3", None)):
        bucket, key, _ = fs.split_path(target)

        async def first_bytes():
            try:
                head = await fs._call_s3("head_object", Bucket=bucket, Key=key)
            except FileNotFoundError:
                return None
            if not int(head.get("ContentLength", 0)):
                return b""
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{n - 1}")
            try:
                return await resp["Body"].read()
            finally:
                resp["Body"].close()

        try:
            data = bounded(fs, first_bytes, url, "checking the existing output", policy)
        except PermissionError as exc:
            if ": no credentials for " in str(exc):
                raise
            return
        if data is None:  # no object: the bucket must exist, or the whole write would be lost at its end
            try:
                bounded(fs, lambda: fs._call_s3("head_bucket", Bucket=bucket), url, "checking the bucket", policy)
            except FileNotFoundError as exc:
                raise FileNotFoundError(f"cannot write {url}: the bucket {bucket!r} does not exist; create it "
                                        "first (e.g. s3fs.S3FileSystem(**storage_options).mkdir("
                                        f"{bucket!r})) or write to an existing bucket") from exc
            except PermissionError as exc:
                if ": no credentials for " in str(exc):
                    raise
            return
    else:
        try:
            with fs.open(target, "rb") as f:
                data = f.read(n)
        except FileNotFoundError:
            return
        except IsADirectoryError:
            raise IsADirectoryError(f"cannot write {url}: it is a folder; give a file name") from None
    if data and data != C.MAGIC:
        raise ValueError(f"the output {url} exists and is not a pageset file: refusing to replace it (are the "
                         f"arguments swapped? the order is {call}); remove it or choose another output path")
