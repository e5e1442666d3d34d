"""Real servers on 127.0.0.1 for the remote-read tests, the demo and the benchmark: moto's S3 server, aiohttp's
static file server (Range, ETag, If-Match), an aiohttp server that gzips whole bodies, and a fault-injecting
HTTP proxy in front of either.

Each class starts in its constructor and stops in ``stop()`` (or as a context manager); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

S3_CREDENTIALS = {"key": "testing", "secret": "testing"}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class MotoS3:
    """moto's S3 server (``moto.server.ThreadedMotoServer``) on a free port; ``url`` is its endpoint."""

    def __init__(self):
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.url = f"http://{host}:{port}"

    def client(self, endpoint: str | None = None):
        import boto3

        return boto3.client("s3", endpoint_url=endpoint or self.url, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def stop(self):
        self.server.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def s3_options(endpoint: str, **client_config) -> dict:
    """s3fs storage_options for a local endpoint (path-style, fixed test credentials)."""
    return {**S3_CREDENTIALS, "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            "config_kwargs": {"retries": {"total_max_attempts": 1}, **client_config}}  # one try per request


class StaticHTTP:
    """aiohttp's static file handler serving ``root`` (Range requests, ETag, If-Match) on a free port."""

    def __init__(self, root):
        from aiohttp import web

        app = web.Application()
        app.router.add_static("/", str(root))
        _serve(self, app, "static-http")

    def stop(self):
        _stop(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _serve(server, app, name: str) -> None:
    """Run aiohttp ``app`` on 127.0.0.1 (a free port) in a loop thread of its own: ``server.url``, ``.loop``,
    ``.thread``, ``.runner``."""
    from aiohttp import web

    server.loop = asyncio.new_event_loop()
    server.thread = threading.Thread(target=server.loop.run_forever, name=name, daemon=True)
    server.thread.start()
    server.runner = web.AppRunner(app)

    async def start():
        await server.runner.setup()
        site = web.TCPSite(server.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    port = asyncio.run_coroutine_threadsafe(start(), server.loop).result(30)
    server.url = f"http://127.0.0.1:{port}"


def _stop(server) -> None:
    asyncio.run_coroutine_threadsafe(server.runner.cleanup(), server.loop).result(30)
    server.loop.call_soon_threadsafe(server.loop.stop)
    server.thread.join(30)
    server.loop.close()


class GzipHTTP:
    """An aiohttp server of the files under ``root`` that compresses whole bodies, as a web server with gzip on does.

    ``mode``: ``"accepted"`` answers a request whose Accept-Encoding names gzip with the gzip of the whole file
    (HTTP 200, ``Content-Encoding: gzip``, its Range ignored), any other request as aiohttp's static files do
    (Range, 206); ``"always"`` does the former whatever the request asks (HEAD too: the compressed length);
    ``"get"`` answers HEAD as the static files do (the stored size) and every GET with the gzip of the file;
    ``"stripped"`` sends the gzip of the whole file without the ``Content-Encoding`` header (a proxy that drops
    it). Every answer has the file's ETag. ``seen`` lists ``(method, path, Accept-Encoding)`` of every request.
    """

    def __init__(self, root, mode: str = "accepted"):
        import gzip
        from pathlib import Path

        from aiohttp import web

        assert mode in ("accepted", "always", "get", "stripped"), mode
        self.root, self.mode = Path(root), mode
        self.seen: list[tuple[str, str, str]] = []

        async def handle(request):
            accept = request.headers.get("Accept-Encoding", "")
            self.seen.append((request.method, request.path, accept))
            path = (self.root / request.match_info["tail"]).resolve()
            if not path.is_relative_to(self.root.resolve()) or not path.is_file():
                return web.Response(status=404, text="Not Found")
            if ((self.mode == "accepted" and "gzip" not in accept.lower())
                    or (self.mode == "get" and request.method == "HEAD")):
                return web.FileResponse(path)
            st = path.stat()
            body = gzip.compress(path.read_bytes(), mtime=0)
            headers = {"ETag": f'"{st.st_mtime_ns:x}-{st.st_size:x}"', "Content-Type": "application/octet-stream"}
            if self.mode != "stripped":
                headers["Content-Encoding"] = "gzip"
            if request.method == "HEAD":
                return web.Response(status=200, headers={**headers, "Content-Length": str(len(body))})
            return web.Response(status=200, body=body, headers=headers)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        _serve(self, app, "gzip-http")

    def stop(self):
        _stop(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class FaultProxy:
    """An HTTP reverse proxy to ``upstream`` (``http://host:port``) that injects faults into range GETs.

    Settings (change them any time): ``latency`` (seconds before each request is forwarded), ``fail_every``
    (every k-th range GET answers 503 SlowDown), ``drop_every`` (every k-th range GET is cut off mid-body and the
    connection closed), ``truncate_every`` (every k-th range GET answers a complete-looking response with half
    the body), ``corrupt_every`` (every k-th range GET has one byte of its body flipped), ``hang`` (requests are
    read and never answered, until ``stop()`` or ``hang = False``: then their connections are closed unanswered),
    ``shift_every`` (every k-th range GET is forwarded for the range
    ``shift`` bytes later: the answer is that range, honestly labelled in its Content-Range), ``short_range_every``
    (every k-th range GET is forwarded for the first half of its range only: a complete, consistent 206 of fewer
    bytes than asked), ``ignore_range_every`` (every k-th range GET is forwarded without its Range header: the
    server answers 200 with the whole object). ``error = (status, code, message)`` answers an S3-style XML error instead of forwarding,
    to every ``error_every``-th request whose method is in ``error_methods`` (``"GET"``: range GETs only) and whose
    path contains ``error_path`` (default ``""``: any).
    ``counts`` maps ``(method, path)`` to requests seen; ``ranges`` lists ``(path, Range header)`` of every range
    GET.
    """

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.latency = 0.0
        self.fail_every = self.drop_every = self.truncate_every = self.corrupt_every = 0
        self.shift_every = self.short_range_every = self.ignore_range_every = 0
        self.shift = 1
        self.error: tuple[int, str, str] | None = None
        self.error_every, self.error_methods, self.error_path = 1, ("GET",), ""
        self._m = 0
        self.hang = False
        self.counts: collections.Counter = collections.Counter()
        self.ranges: list[tuple[str, str]] = []
        self.faults: collections.Counter = collections.Counter()
        self._n = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                proxy._serve(self)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="fault-proxy", daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def reset(self):
        with self._lock:
            self.latency = 0.0
            self.fail_every = self.drop_every = self.truncate_every = self.corrupt_every = 0
            self.shift_every = self.short_range_every = self.ignore_range_every = 0
            self.shift = 1
            self.error, self.error_every, self.error_methods, self._m = None, 1, ("GET",), 0
            self.error_path = ""
            self.hang = False
            self.counts.clear()
            self.ranges.clear()
            self.faults.clear()
            self._n = 0

    def range_gets(self, path_suffix: str = "") -> list[str]:
        with self._lock:
            return [r for p, r in self.ranges if p.endswith(path_suffix)]

    def _serve(self, h: BaseHTTPRequestHandler):
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else None
        path = h.path.split("?")[0]
        rng = h.headers.get("Range")
        with self._lock:
            self.counts[(h.command, path)] += 1
            is_range = h.command == "GET" and rng is not None
            if is_range:
                self.ranges.append((path, rng))
                self._n += 1
            n, hang, latency = self._n, self.hang, self.latency
            fault = None
            if (self.error is not None and h.command in self.error_methods and (h.command != "GET" or is_range)
                    and self.error_path in path):
                self._m += 1
                if self._m % self.error_every == 0:
                    fault = "error"
                    self.faults["error"] += 1
            if is_range and fault is None:
                for name, every in (("fail", self.fail_every), ("drop", self.drop_every),
                                    ("truncate", self.truncate_every), ("corrupt", self.corrupt_every),
                                    ("shift", self.shift_every), ("short_range", self.short_range_every),
                                    ("ignore_range", self.ignore_range_every)):
                    if every and n % every == 0:
                        fault = name
                        self.faults[name] += 1
                        break
            error, shift = self.error, self.shift
        if hang:
            for _ in range(2400):  # bounded: 120 s, or until stop() or ``hang`` is set False
                if self._stop.wait(0.05) or not self.hang:
                    break
            h.close_connection = True
            return
        if latency:
            time.sleep(latency)
        if fault in ("fail", "error"):
            status, code, message = (503, "SlowDown", "Please reduce your request rate.") if fault == "fail" else error
            msg = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
                   "</Error>").encode()
            h.send_response(status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(msg)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(msg)
            return
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in HOP_BY_HOP}
            if fault in ("shift", "short_range"):  # ask the server for another range than the client did
                a, b = map(int, rng.removeprefix("bytes=").split("-"))
                a, b = (a + shift, b + shift) if fault == "shift" else (a, a + max(0, (b - a + 1) // 2 - 1))
                headers = {k: (f"bytes={a}-{b}" if k.lower() == "range" else v) for k, v in headers.items()}
            if fault == "ignore_range":
                headers = {k: v for k, v in headers.items() if k.lower() != "range"}
            conn.request(h.command, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read() if h.command != "HEAD" else b""
            out_headers = [(k, v) for k, v in resp.getheaders()
                           if k.lower() not in HOP_BY_HOP and k.lower() != "content-length"]
            status, reason = resp.status, resp.reason
            head_length = resp.getheader("Content-Length")
        finally:
            conn.close()
        send = data
        declared = len(data) if h.command != "HEAD" else int(head_length or 0)
        if fault == "corrupt" and status == 206 and data:
            mid = len(data) // 2
            send = data[:mid] + bytes([data[mid] ^ 0x40]) + data[mid + 1 :]
        if fault == "truncate" and status == 206 and len(data) > 1:
            send = data[: len(data) // 2]
            declared = len(send)
        h.send_response(status, reason)
        for k, v in out_headers:
            h.send_header(k, v)
        h.send_header("Content-Length", str(declared))
        h.end_headers()
        if fault == "drop" and status == 206 and len(data) > 1:
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            try:
                h.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if send:
            h.wfile.write(send)

    def stop(self):
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def main(argv=None) -> None:
    """Serve one file in a separate process (benchmarks: the servers' Python threads then do not share the
    loader's GIL). ``python tests/remote_servers.py FILE... [--latency-ms X]`` uploads the FILEs (one folder) to
    a fresh moto S3 server and serves their folder over HTTP, each behind a proxy adding X ms per request; prints
    one JSON line (``s3_prefix``, ``s3_endpoint``, ``http_prefix``: append a file name) and serves until stdin is
    closed."""
    import argparse
    import json
    import sys
    from pathlib import Path

    ap = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--latency-ms", type=float, default=0.0)
    ap.add_argument("--bucket", default="pageset-bench")
    args = ap.parse_args(argv)
    paths = [Path(f).resolve() for f in args.files]
    s3, http = MotoS3(), StaticHTTP(paths[0].parent)
    proxies = [FaultProxy(s3.url), FaultProxy(http.url)]
    try:
        client = s3.client()
        client.create_bucket(Bucket=args.bucket)
        for path in paths:
            client.upload_file(str(path), args.bucket, path.name)
        for p in proxies:
            p.latency = args.latency_ms / 1e3
        print(json.dumps({"s3_prefix": f"s3://{args.bucket}/", "s3_endpoint": proxies[0].url,
                          "http_prefix": f"{proxies[1].url}/"}), flush=True)
        sys.stdin.read()  # until the parent closes our stdin (or exits)
    finally:
        for p in proxies:
            p.stop()
        http.stop()
        s3.stop()


if __name__ == "__main__":
    main()
