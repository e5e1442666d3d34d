"""Which object-store failures are worth another attempt, and how to word the others: one rule for reads
(:mod:`pageset.read.remote`) and writes (:mod:`pageset.write.upload`).

:func:`store_fault` sorts an exception raised by fsspec, s3fs/botocore or aiohttp (looked at by type name and
by the HTTP status and store error code anywhere in its ``__cause__`` / ``__context__`` chain, so no client
library is imported here) into a :class:`StoreFault`:

- retried (``retry=True``): ``timeout`` (no answer), ``connection_refused`` (nothing listens at the endpoint;
  retried, a restarting server may come back, but named as such), ``connection`` (reset, cut mid-body, DNS),
  ``throttled`` (429, 503 SlowDown), ``server`` (5xx, the store's own fault) and any failure of unknown kind;
- answered at once (``retry=False``): ``missing`` (404), ``denied`` (401, 403), ``credentials`` (none found),
  ``changed`` (412: the pinned ETag no longer matches), ``refused`` (any other 4xx: the store understood the
  request and said no; asking again gets the same answer), ``bug`` (TypeError and the like: ours, not the store's).
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

TIMEOUT_TYPES = {"TimeoutError", "ReadTimeoutError", "ConnectTimeoutError", "ServerTimeoutError", "FSTimeoutError",
                 "ReadTimeout", "ConnectTimeout"}
CONNECTION_TYPES = {"ConnectionError", "ClientConnectionError", "ClientPayloadError", "ServerDisconnectedError",
                    "EndpointConnectionError", "ConnectionClosedError", "HTTPClientError", "IncompleteRead",
                    "ResponseParserError", "ProtocolError", "ClientOSError"}
CREDENTIAL_TYPES = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
BUG_TYPES = (TypeError, AttributeError, NameError)
THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
                  "TooManyRequestsException", "RequestThrottled"}
SERVER_CODES = {"InternalError", "ServiceUnavailable", "RequestTimeout", "OperationAborted"}
MISSING_CODES = {"NoSuchKey", "NoSuchBucket", "NoSuchVersion", "NotFound", "404"}
DENIED_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                "AllAccessDisabled", "AccountProblem", "403", "401"}
RETRIED = ("timeout", "connection_refused", "connection", "throttled", "server", "other")


@dataclass(frozen=True)
class StoreFault:
    """One failed store request, sorted: ``kind`` (see the module doc), ``retry`` (worth another attempt),
    ``status`` (HTTP status or None), ``code`` (the store's error code, e.g. ``"InvalidArgument"``, or ""),
    ``message`` (the store's own message, or the exception's text)."""

    kind: str
    status: int | None = None
    code: str = ""
    message: str = ""

    @property
    def retry(self) -> bool:
        return self.kind in RETRIED

    def answer(self) -> str:
        """The store's answer in words: ``HTTP 400 InvalidArgument: Invalid argument.``"""
        head = " ".join(x for x in (f"HTTP {self.status}" if self.status else "", self.code
                                    if self.code and self.code != str(self.status) else "") if x)
        return f"{head}: {self.message}" if head and self.message else head or self.message

    def describe(self) -> str:
        """What happened, for an error message (no advice)."""
        if self.kind == "timeout":
            return f"no answer ({self.message})" if self.message else "no answer"
        if self.kind == "connection_refused":
            return f"connection refused ({self.message}): nothing accepts connections at the endpoint"
        if self.kind in ("throttled", "server", "refused", "missing", "denied", "changed"):
            return f"the store answered {self.answer()}"
        return self.message

    def advice(self, timeout: float | None = None) -> str:
        """What to do about it (after the retries, for a retried kind): only a silent store or a broken
        connection sends the user to the endpoint and the network."""
        if self.kind == "timeout":
            return ("the store or the network stopped answering: check the endpoint (storage_options "
                    "client_kwargs.endpoint_url) and the network, or raise request_timeout / request_attempts")
        if self.kind == "connection_refused":
            return ("check the endpoint URL and port (storage_options client_kwargs.endpoint_url) and that the "
                    "server runs")
        if self.kind == "throttled":
            return "the store throttles: lower max_requests (requests in flight) or raise request_attempts"
        if self.kind == "server":
            return "a fault of the store (server side), not of the request: retry later or ask its operator"
        if self.kind == "refused":
            return ("the store refused this request and would refuse it again (not retried): see its message; "
                    "check the URL, storage_options and the store's settings for this bucket")
        if self.kind == "connection":
            return "the connection failed: check the endpoint and the network, or raise request_attempts"
        return "raise request_attempts, or check the store"


def _chain(exc):
    """The exception, its causes / contexts, and the errors botocore and aiohttp keep aside (bounded walk)."""
    todo, seen = [exc], []
    while todo and len(seen) < 24:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        kw = getattr(e, "kwargs", None)
        todo += [e.__cause__, e.__context__, getattr(e, "os_error", None),
                 kw.get("error") if isinstance(kw, dict) and isinstance(kw.get("error"), BaseException) else None]
    return seen


def _names(e) -> set[str]:
    return {c.__name__ for c in type(e).__mro__}


def _response(chain) -> tuple[int | None, str, str]:
    """(HTTP status, error code, message) of the first store answer in the chain (botocore ClientError's
    ``response`` dict, aiohttp's ClientResponseError ``status`` / ``message``)."""
    for e in chain:
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            err = resp.get("Error", {}) or {}
            status = (resp.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode")
            code = str(err.get("Code", "") or "")
            if status is None and code.isdigit():
                status = int(code)
            return status, code, str(err.get("Message", "") or "")
        status = getattr(e, "status", None)
        if isinstance(status, int) and not isinstance(status, bool) and 100 <= status < 600:
            return status, "", str(getattr(e, "message", "") or "")
    return None, "", ""


def store_fault(exc: BaseException) -> StoreFault:
    """Sort a failed store request (see the module doc). Never raises."""
    chain = _chain(exc)
    names = set().union(*(_names(e) for e in chain))
    if names & CREDENTIAL_TYPES:
        return StoreFault("credentials", message=str(exc))
    status, code, message = _response(chain)
    message = message or str(exc)
    if status is not None or code:
        if status == 429 or code in THROTTLE_CODES:
            return StoreFault("throttled", status, code, message)
        if (status is not None and status >= 500) or code in SERVER_CODES or status == 408:
            return StoreFault("server", status, code, message)
        if status == 404 or code in MISSING_CODES:
            return StoreFault("missing", status, code, message)
        if status in (401, 403) or code in DENIED_CODES:
            return StoreFault("denied", status, code, message)
        if status == 412 or code == "PreconditionFailed":
            return StoreFault("changed", status, code, message)
        if status is not None and 400 <= status < 500:
            return StoreFault("refused", status, code, message)
    refused = next((e for e in chain if isinstance(e, ConnectionRefusedError)
                    or (isinstance(e, OSError) and e.errno == errno.ECONNREFUSED)), None)
    if refused is not None:
        return StoreFault("connection_refused", message=str(refused))
    if names & TIMEOUT_TYPES:
        return StoreFault("timeout", message=str(exc))
    if names & CONNECTION_TYPES:
        return StoreFault("connection", message=f"{type(exc).__name__}: {exc}")
    if isinstance(exc, BUG_TYPES):
        return StoreFault("bug", message=str(exc))
    return StoreFault("other", message=f"{type(exc).__name__}: {exc}")


def one_try_options(url: str, storage_options: dict | None) -> dict:
    """``storage_options`` for ``url`` with the S3 client's own retries off (``config_kwargs["retries"] =
    {"total_max_attempts": 1}``) unless the caller set ``config_kwargs["retries"]`` (their choice wins).

    pageset bounds and retries every request itself (``request_timeout`` x ``request_attempts``); botocore's
    retries (up to 5 by default) would run inside one ``request_timeout`` and turn a refused connection into
    "no answer". Other schemes: the options unchanged (a copy)."""
    options = dict(storage_options or {})
    if url.split("://", 1)[0].lower() in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1})
        options["config_kwargs"] = config
    return options
