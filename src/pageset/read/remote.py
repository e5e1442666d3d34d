"""Reading a pageset file from object storage: range requests through fsspec, pinned to one object version.

A URL (``s3://bucket/key``, ``http(s)://host/path``, ``gs://``, ``az://``, any fsspec protocol) is opened by
:class:`RemoteFile`: one metadata request (size, ETag, version id) pins the object; every later range request
carries the pin (``If-Match`` on S3 and HTTP; the response's ETag is compared as well), so pages of two
different objects are never mixed: a replaced object raises :class:`~pageset.format.errors.ObjectChangedError`
naming the URL. Credentials and endpoints come from ``storage_options`` (passed to the fsspec filesystem, e.g.
``{"client_kwargs": {"endpoint_url": ...}}``) or the backend's standard environment (``AWS_*``); pageset has
no authentication code of its own.

Every request has a timeout and is retried with exponential backoff and jitter on what can succeed on retry
(timeouts, resets, refused connections, 5xx, 429/SlowDown, short bodies: :mod:`pageset.format.store_errors`),
at most ``RetryPolicy.attempts`` times; then :class:`~pageset.format.errors.RemoteReadError` names the URL, byte
range, attempts and the last failure. A store that refuses a request (any other 4xx: 400 InvalidArgument, 403,
404, 412) is answered at once with the store's code and message, never retried. Every range answer is checked
against the request (status 206, the Content-Range start and end, the body length): a server that answers
another range is named as the fault. HTTP requests ask for the stored bytes (``Accept-Encoding: identity``); an
answer in a content encoding (a server that gzips the whole body) is refused at once, naming the encoding.
pageset's own retries are the only ones: s3fs's are bypassed and botocore's are off unless ``storage_options``
set ``config_kwargs["retries"]``, so one ``request_timeout`` bounds one try.

A RemoteFile (and the Dataset holding it) belongs to the process that opened it: fsspec's event loop and
connections do not survive ``fork``, so a read from a forked child raises RuntimeError at once.
fsspec is imported here only, and only when a URL is opened: local paths never import it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import re
import threading
import time

import numpy as np

from ..format.checksum import crc32
from ..format.errors import ChecksumMismatchError, ObjectChangedError, RemoteReadError, plural
from ..format.retry import RetryPolicy
from ..format.store_errors import StoreFault, one_try_options, store_fault

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# Which package serves which scheme (fsspec's own registry names them too; this makes the message exact).
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
            "abfss": "adlfs", "http": "aiohttp", "https": "aiohttp"}


def url_scheme(path) -> str | None:
    """The scheme of a URL string (``"s3"``, ``"http"``, ...), or None for a local path (``file://`` too)."""
    if not isinstance(path, str):
        return None
    m = _URL.match(path)
    if m is None or m.group(1).lower() == "file":
        return None
    return m.group(1).lower()


def local_path(path):
    """``file://`` URLs as plain paths; anything else unchanged."""
    if isinstance(path, str) and path.lower().startswith("file://"):
        return path[len("file://"):]
    return path


class _Retry(Exception):
    """A transient failure worth another attempt (timeout, reset, refused connection, 5xx, 429, short body)."""

    def __init__(self, fault: StoreFault):
        super().__init__(fault.describe())
        self.fault = fault


def _refusal(url: str, what: str, fault: StoreFault) -> RemoteReadError:
    err = RemoteReadError(f"{url}: {what}: {fault.describe()}; {fault.advice()}")
    err.status, err.code = fault.status, fault.code
    return err


def _answered(url: str, asked: tuple[int, int], detail: str) -> RemoteReadError:
    """A range answer that is not the range asked: the server's (or a proxy's) fault, not the object's."""
    return RemoteReadError(f"{url}: GET bytes {asked[0]}-{asked[1] - 1}: the server answered {detail}: a fault of "
                           "the server or of a proxy in between (the object is not damaged); it must answer "
                           "exactly the range asked (HTTP 206 with that Content-Range): fix or bypass it")


IDENTITY = ("", "identity")


def _encoded(url: str, what: str, encoding: str, status) -> RemoteReadError:
    """An answer in a content encoding (gzip, br, ...) although identity was asked: the server's fault, named."""
    whole = ", the whole object: it ignored the Range header" if status == 200 and what != "HEAD" else ""
    err = RemoteReadError(f"{url}: {what}: the server answered HTTP {status} with Content-Encoding: {encoding} (a "
                          f"compressed body{whole}) although pageset asked for Accept-Encoding: identity; pageset "
                          "reads a file's stored bytes by range and cannot use a compressed answer (the object is "
                          "not damaged): turn compression off for these files on the server or the proxy in between "
                          "(e.g. nginx `gzip off;`, or leave application/octet-stream and .json out of its gzip "
                          "types), or serve them from an object store (s3://, gs://)")
    err.status, err.code = status, f"Content-Encoding: {encoding}"
    return err


def _content_range(value) -> tuple[int, int, int | None] | None:
    """``"bytes 0-99/1000"`` -> (0, 100, 1000) (end exclusive; total None for ``*``); None if unparseable."""
    m = re.fullmatch(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*", value or "")
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)) + 1, None if m.group(3) == "*" else int(m.group(3))


class RemoteFile:
    """One object in a store, opened and pinned (size, ETag, version id).

    ``read(start, end)`` -> bytes of ``[start, end)``; thread-safe. ``requests`` and ``bytes_read`` count what
    went over the network (retries included). Raises FileNotFoundError (no such object or bucket) and
    ImportError / ValueError (no backend for the scheme: the message names the package to install).
    """

    def __init__(self, url: str, storage_options: dict | None = None, retry: RetryPolicy | None = None):
        self.url = url
        self.retry = retry or RetryPolicy()
        self.scheme = url_scheme(url) or "file"
        try:
            import fsspec
        except ImportError:  # pragma: no cover - fsspec is in the remote and test extras
            raise ImportError(f"{url}: reading URLs needs fsspec and {PACKAGES.get(self.scheme, 'its backend')}: "
                              "pip install 'pageset[remote]'") from None
        pkg = PACKAGES.get(self.scheme)
        options = one_try_options(url, storage_options)  # one retry layer, ours (bounded)
        try:
            self.fs, self.path = fsspec.core.url_to_fs(url, **options)
        except ImportError as exc:
            hint = f"pip install {pkg}" if pkg else f"install the fsspec backend for {self.scheme}://"
            raise ImportError(f"{url}: reading {self.scheme}:// URLs needs the {pkg or 'fsspec backend'} "
                              f"package ({exc}); {hint}") from None
        except ValueError as exc:
            if "protocol" in str(exc).lower():
                raise ValueError(f"{url}: unknown URL scheme {self.scheme!r} ({exc}); pageset reads local paths "
                                 "and fsspec URLs such as s3://, gs://, az://, http(s)://") from None
            raise
        self._kind = ("s3" if type(self.fs).__name__ == "S3FileSystem" else
                      "http" if type(self.fs).__name__ == "HTTPFileSystem" else "generic")
        self._async = bool(getattr(self.fs, "async_impl", False))
        self.pid = os.getpid()  # the process whose event loop and connections this object uses
        self._lock = threading.Lock()
        self._rng = random.Random()
        self._sync_pool = None
        self.requests = 0
        self.bytes_read = 0
        self._cached: list[tuple[int, bytes]] = []  # (start, bytes) served to pread during validation at open
        info = self._with_retries(self._info, "metadata")
        if info.get("type") == "directory" or info.get("size") is None:
            raise FileNotFoundError(f"{url}: no such object (a directory or an object of unknown size)")
        self.size = int(info["size"])
        self.etag = info.get("ETag") or info.get("etag")
        self.version_id = info.get("VersionId") if self._kind == "s3" else None

    # ---- requests ---------------------------------------------------------------------------------------
    def check_process(self) -> None:
        """Raise RuntimeError (at once, nothing retried) when called in another process than the one that
        opened the object: after ``fork`` an async filesystem's event loop thread and connections are gone."""
        pid = os.getpid()
        if pid == self.pid:
            return
        if not self._async:  # a plain (sync) filesystem survives a fork; only our thread pool does not
            with self._lock:
                self._sync_pool, self.pid = None, pid
            return
        raise RuntimeError(f"{self.url}: opened in process {self.pid} and used in process {pid}, a forked child: "
                           f"fsspec's {type(self.fs).__name__} (its event loop and connections) does not survive a "
                           "fork. Open the dataset (or create the Loader) in the child, e.g. in the DataLoader "
                           "worker_init_fn or after the fork, or start workers with the 'spawn' or 'forkserver' "
                           "method (multiprocessing.set_start_method / DataLoader(multiprocessing_context=...))")

    def _run(self, make_coro, sync_call):
        """Run one request with the policy's timeout; a timed-out coroutine is cancelled."""
        t = self.retry.timeout
        with self._lock:
            self.requests += 1
        if self._async:
            fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(make_coro(), t), self.fs.loop)
            try:
                return fut.result(t + 5)
            except (asyncio.TimeoutError, concurrent.futures.TimeoutError):
                fut.cancel()
                raise _Retry(StoreFault("timeout", message=f"no answer within request_timeout {t:g} s")) from None
        if self._sync_pool is None:
            with self._lock:
                if self._sync_pool is None:
                    self._sync_pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="pageset-fs")
        fut = self._sync_pool.submit(sync_call)
        try:
            return fut.result(t)
        except concurrent.futures.TimeoutError:
            raise _Retry(StoreFault("timeout", message=f"no answer within request_timeout {t:g} s")) from None

    async def _s3(self, method: str, **kw):
        """One S3 call on the client, without s3fs's own retry loop (``_call_s3``): ours decides."""
        await self.fs.set_session()
        s3 = await self.fs.get_s3(kw.get("Bucket"))
        call = getattr(s3, method)
        extra = getattr(self.fs, "_get_s3_method_kwargs", None)  # requester pays, SSE-C keys, ...
        return await call(**(extra(call, **kw) if extra is not None else kw))

    def _s3_key(self) -> dict:
        bucket, key, version = self.fs.split_path(self.path)
        return {"Bucket": bucket, "Key": key, **({"VersionId": version} if version else {})}

    async def _info_s3(self) -> dict:
        head = await self._s3("head_object", **self._s3_key())
        return {"size": head.get("ContentLength"), "ETag": head.get("ETag"), "VersionId": head.get("VersionId"),
                "type": "file"}

    async def _info_http(self) -> dict:
        """fsspec's HTTP info (HEAD, then GET, with Accept-Encoding: identity); where it finds no size, one more
        HEAD says why when it is a compressed answer (fsspec drops the size of a Content-Encoding answer)."""
        info = await self.fs._info(self.path)
        if info.get("size") is None:
            kw = dict(self.fs.kwargs)
            headers = {**(kw.pop("headers", {}) or {}), "Accept-Encoding": "identity"}
            kw.pop("allow_redirects", None)
            session = await self.fs.set_session()
            async with session.head(self.fs.encode_url(self.path), headers=headers, allow_redirects=True, **kw) as r:
                encoding = (r.headers.get("Content-Encoding") or "").strip()
                if r.status < 400 and encoding.lower() not in IDENTITY:
                    raise _encoded(self.url, "HEAD", encoding, r.status)
        return info

    def _info(self):
        if self._kind == "s3":
            return self._run(self._info_s3, None)
        if self._kind == "http":
            return self._run(self._info_http, None)
        if self._async:
            return self._run(lambda: self.fs._info(self.path), None)
        return self._run(None, lambda: self.fs.info(self.path))

    def _classify(self, exc, what: str):
        """A failed request as the error to raise at once (FileNotFoundError, PermissionError,
        ObjectChangedError, RemoteReadError for a refusal, ``exc`` itself for a bug), or a _Retry."""
        if isinstance(exc, (_Retry, RemoteReadError)):
            return exc
        fault = store_fault(exc)
        if isinstance(exc, (FileNotFoundError, PermissionError)) and fault.kind in ("other", "bug"):
            # a backend's own translation (gcsfs, adlfs, ...) with no store answer underneath
            fault = StoreFault("missing" if isinstance(exc, FileNotFoundError) else "denied", message=str(exc))
        if type(exc).__name__ == "FileExpired":
            fault = StoreFault("changed", message=str(exc))
        if isinstance(exc, RuntimeError) and "fork" in str(exc):
            return exc  # fsspec's "not fork-safe": retrying cannot help
        if fault.kind == "missing":
            return FileNotFoundError(f"{self.url}: no such object or bucket ({fault.describe()})")
        if fault.kind == "denied":
            return PermissionError(f"{self.url}: access denied ({fault.describe()}); check credentials "
                                   "(storage_options or the AWS_* environment) and the bucket's permissions")
        if fault.kind == "credentials":
            return PermissionError(f"{self.url}: {exc}; give credentials in storage_options or the AWS_* "
                                   "environment (anon=True for public buckets)")
        if fault.kind == "changed":
            return self._changed(f"the store refused the pinned ETag {self.etag} ({what}: {fault.answer()})")
        if fault.kind == "refused":
            return _refusal(self.url, what, fault)
        if fault.kind == "bug":
            return exc  # a bug, not a transient failure
        return _Retry(fault)

    def _changed(self, detail: str) -> ObjectChangedError:
        return ObjectChangedError(f"{self.url}: the object changed after it was opened ({detail}); pages of two "
                                  "versions are never mixed: reopen the dataset (a new Loader) to read the new one")

    def _with_retries(self, call, what: str):
        self.check_process()
        last = None
        for attempt in range(self.retry.attempts):
            if attempt:
                time.sleep(self.retry.delay(attempt - 1, self._rng))
            try:
                return call()
            except Exception as exc:
                err = self._classify(exc, what)
                if not isinstance(err, _Retry):
                    if err is exc:
                        raise
                    raise err from exc
                last = err.fault
        err = RemoteReadError(f"{self.url}: {what} failed after {plural(self.retry.attempts, 'attempt')} "
                              f"(request_timeout {self.retry.timeout:g} s each); last error: {last.describe()}; "
                              f"{last.advice()}")
        err.status, err.code, err.kind = last.status, last.code, last.kind
        raise err

    async def _get_s3(self, start: int, end: int) -> bytes:
        kw = {**self._s3_key(), "Range": f"bytes={start}-{end - 1}"}
        if self.etag:
            kw["IfMatch"] = self.etag
        if self.version_id:
            kw["VersionId"] = self.version_id
        resp = await self._s3("get_object", **kw)
        try:
            if self.etag and resp.get("ETag") and resp["ETag"] != self.etag:
                raise self._changed(f"ETag {resp['ETag']} != pinned {self.etag}")
            status = (resp.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode")
            self._check_range(start, end, status, resp.get("ContentRange"))
            return await resp["Body"].read()
        finally:
            resp["Body"].close()

    def _check_range(self, start: int, end: int, status, content_range) -> None:
        """An answer to ``Range: bytes=start-(end-1)`` must be 206 with exactly that Content-Range (or 200 with
        the whole object, when that is what was asked); else RemoteReadError names the server's fault."""
        whole = start == 0 and end == self.size
        if status == 200 and whole:
            return
        if status == 200:
            raise _answered(self.url, (start, end), "HTTP 200, the whole object (it ignores Range requests)")
        got = _content_range(content_range)
        if got is None:
            raise _answered(self.url, (start, end), f"HTTP {status} with Content-Range {content_range!r}")
        if got[2] is not None and got[2] != self.size:  # servers without ETags: the size still pins
            raise self._changed(f"size {got[2]} != {self.size} bytes at open")
        if got[:2] != (start, end):
            raise _answered(self.url, (start, end), f"bytes {got[0]}-{got[1] - 1} (Content-Range "
                            f"{content_range!r}, {got[1] - got[0]} bytes for {end - start} asked)")

    async def _get_http(self, start: int, end: int) -> bytes:
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}  # the stored bytes
        if self.etag:
            headers["If-Match"] = self.etag
        kw = dict(self.fs.kwargs)
        headers.update(kw.pop("headers", {}) or {})
        session = await self.fs.set_session()
        async with session.get(self.fs.encode_url(self.path), headers=headers, **kw) as r:
            if r.status == 412:
                raise self._changed("HTTP 412 on If-Match")
            if r.status >= 400:  # the store's answer, with its own words (an S3-style XML body or plain text)
                body = (await r.content.read(2048)).decode("utf-8", "replace")
                code = re.search(r"<Code>([^<]*)</Code>", body)
                msg = re.search(r"<Message>([^<]*)</Message>", body)
                r.release()
                exc = OSError(f"HTTP {r.status} {r.reason}")
                exc.response = {"Error": {"Code": code.group(1) if code else "",
                                          "Message": msg.group(1) if msg else (body.strip()[:200] or r.reason)},
                                "ResponseMetadata": {"HTTPStatusCode": r.status}}
                raise exc
            encoding = (r.headers.get("Content-Encoding") or "").strip()
            if encoding.lower() not in IDENTITY:  # before the ETag: a compressed answer often carries another one
                r.release()
                raise _encoded(self.url, f"GET bytes {start}-{end - 1}", encoding, r.status)
            got = r.headers.get("ETag")
            if self.etag and got and got != self.etag:
                raise self._changed(f"ETag {got} != pinned {self.etag}")
            self._check_range(start, end, r.status, r.headers.get("Content-Range"))
            return await r.read()

    def _get_once(self, start: int, end: int) -> bytes:
        if self._kind == "s3":
            data = self._run(lambda: self._get_s3(start, end), None)
        elif self._kind == "http":
            data = self._run(lambda: self._get_http(start, end), None)
        elif self._async:
            data = self._run(lambda: self.fs._cat_file(self.path, start=start, end=end), None)
        else:
            data = self._run(None, lambda: self.fs.cat_file(self.path, start=start, end=end))
        with self._lock:
            self.bytes_read += len(data)
        if len(data) != end - start:  # the header said the right range, the body is cut: a transfer fault
            raise _Retry(StoreFault("connection", message=f"short body: {len(data)} of {end - start} bytes"))
        return data

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the pinned object (retried per the policy). Raises RemoteReadError
        (naming URL, range and attempts), ObjectChangedError, FileNotFoundError, PermissionError."""
        if not 0 <= start <= end <= self.size:
            raise ValueError(f"{self.url}: byte range [{start}, {end}) outside the object ({self.size} bytes)")
        if start == end:
            return b""
        return self._with_retries(lambda: self._get_once(start, end), f"GET bytes {start}-{end - 1}")

    # ---- validation at open -----------------------------------------------------------------------------
    def load_range(self, start: int, end: int) -> None:
        """Fetch ``[start, end)`` in one request; ``pread`` serves reads inside it from memory until
        ``drop_cached()`` (validation at open: the head, then the tail with the section table and sections)."""
        start, end = max(0, start), min(self.size, end)
        if start < end:
            self._cached.append((start, self.read(start, end)))

    def drop_cached(self) -> None:
        self._cached = []

    def pread(self, offset: int, length: int) -> bytes:
        """Like ``os.pread`` on the object: fewer bytes only at its end."""
        end = min(self.size, offset + length)
        if end <= offset:
            return b""
        for start, data in self._cached:
            if start <= offset and end <= start + len(data):
                return data[offset - start : end - start]
        return self.read(offset, end)

    def close(self) -> None:
        if self._sync_pool is not None:
            self._sync_pool.shutdown(wait=False)
            self._sync_pool = None

    def __repr__(self) -> str:
        return f"RemoteFile({self.url!r}, size={self.size}, etag={self.etag!r})"


class PageReader:
    """Whole pages of a remote pageset file, each CRC-32-checked on arrival.

    ``read_run(k0, k1)`` -> list of uint8 arrays, pages ``k0 .. k1 - 1`` fetched with ONE range request; a
    page whose CRC-32 differs is fetched again once (alone), then ChecksumMismatchError names the URL, page
    and byte offset. Files without page checksums are returned unchecked.
    """

    def __init__(self, remote: RemoteFile, data_offset: int, data_length: int, page_size: int,
                 page_crcs: np.ndarray | None):
        self.remote = remote
        self.data_offset, self.data_length, self.page_size = data_offset, data_length, page_size
        self.page_crcs = page_crcs
        self.page_count = -(-data_length // page_size) if page_size else 0

    def page_span(self, k: int) -> tuple[int, int]:
        """Absolute byte range ``[start, end)`` of page ``k`` (the last page may be short)."""
        start = self.data_offset + k * self.page_size
        return start, min(start + self.page_size, self.data_offset + self.data_length)

    def _ok(self, k: int, page) -> bool:
        return self.page_crcs is None or crc32(page) == int(self.page_crcs[k])

    def read_run(self, k0: int, k1: int) -> list[np.ndarray]:
        if not 0 <= k0 < k1 <= self.page_count:
            raise ValueError(f"{self.remote.url}: pages [{k0}, {k1}) outside [0, {self.page_count})")
        start, end = self.page_span(k0)[0], self.page_span(k1 - 1)[1]
        data = np.frombuffer(self.remote.read(start, end), dtype=np.uint8)
        pages = []
        for k in range(k0, k1):
            lo, hi = self.page_span(k)
            page = data[lo - start : hi - start]
            if not self._ok(k, page):  # a flipped bit on the wire: fetch this page once more
                page = np.frombuffer(self.remote.read(lo, hi), dtype=np.uint8)
                if not self._ok(k, page):
                    raise ChecksumMismatchError(
                        self.remote.url, f"page {k}", lo, "page CRC-32 mismatch after fetching it twice; the "
                        "object is damaged (or changed without a new ETag): rewrite or re-upload it")
            pages.append(page)
        return pages
