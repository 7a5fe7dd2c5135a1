"""A loopback HTTP proxy in front of moto's S3 server that can misbehave as a store or a
network does: alter an uploaded part's bytes, drop a part (answer as S3 would, without
storing it), report another checksum than the one it holds, refuse requests with a status,
slow parts down, and call a hook on each part (to signal a ckptfix process mid-upload). It
logs every request in order, so tests can check what was sent when.

Real failures on the wire: ckptfix's own code is never patched."""

from __future__ import annotations

import contextlib
import http.client
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}


@dataclass
class Faults:
    """What the proxy does; changed by tests while it runs."""

    corrupt_part: int | None = None  # the Nth UploadPart (1-based, whole run) gets a byte flipped
    drop_part: int | None = None  # the Nth UploadPart is answered 200 and never stored
    lie_checksum: bool = False  # HEAD answers carry another checksum (whichever algorithm)
    refuse: Callable[[str, str], int | None] = lambda method, path: None  # a status, or None
    part_delay: float = 0.0
    on_part: Callable[[int], None] | None = None  # called with the part count, before sending
    on_request: Callable[[str, str], None] | None = None  # (method, path) of every request
    listing: Callable[[bytes], bytes] | None = None  # rewrites ListObjectsV2 answers
    parts: int = 0
    log: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count_part(self) -> int:
        with self.lock:
            self.parts += 1
            return self.parts


def is_part(method: str, query: dict[str, list[str]]) -> bool:
    return method == "PUT" and "partNumber" in query and "uploadId" in query


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, fmt: str, *args: object) -> None:  # quiet
        pass

    def _relay(self) -> None:
        faults = self.server.faults
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        split = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(split.query, keep_blank_values=True)
        with faults.lock:
            faults.log.append((self.command, self.path))
        if faults.on_request is not None:
            faults.on_request(self.command, self.path)
        status = faults.refuse(self.command, self.path)
        if status is not None:
            self._answer(status, {"Content-Type": "application/xml"}, _error(status))
            return
        if is_part(self.command, query):
            number = faults.count_part()
            if faults.on_part is not None:
                faults.on_part(number)
            time.sleep(faults.part_delay)
            if number == faults.drop_part:
                self._answer(200, {"ETag": '"0123456789abcdef0123456789abcdef"'}, b"")
                return
            if number == faults.corrupt_part and body:
                body = bytes([body[0] ^ 0xFF]) + body[1:]
        self._forward(body)

    def _forward(self, body: bytes) -> None:
        connection = http.client.HTTPConnection(*self.server.upstream, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        headers["Content-Length"] = str(len(body))
        try:
            connection.request(self.command, self.path, body=body, headers=headers)
            answer = connection.getresponse()
            data = answer.read()
            reply = {k: v for k, v in answer.getheaders() if k.lower() not in _HOP}
            if self.command == "HEAD":  # the object's size, not this answer's
                reply["Content-Length"] = answer.getheader("Content-Length") or "0"
        finally:
            connection.close()
        listing = self.server.faults.listing
        if listing is not None and self.command == "GET" and "list-type=2" in self.path:
            data = listing(data)
        if self.command == "HEAD" and self.server.faults.lie_checksum:
            for name in [k for k in reply if k.lower().startswith("x-amz-checksum-")]:
                if name.lower() != "x-amz-checksum-type":
                    reply[name] = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="[: len(reply[name])]
        self._answer(answer.status, reply, data, head=self.command == "HEAD")

    def _answer(
        self, status: int, headers: dict[str, str], data: bytes, head: bool = False
    ) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        if not head or "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay


def _error(status: int) -> bytes:
    code = {403: "AccessDenied", 404: "NoSuchKey", 500: "InternalError"}.get(status, "Error")
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>refused by the test proxy</Message></Error>"
    ).encode()


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream: tuple[str, int], faults: Faults) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream = upstream
        self.faults = faults


@dataclass
class Proxy:
    url: str
    faults: Faults


@contextlib.contextmanager
def store_proxy(endpoint: str) -> Iterator[Proxy]:
    """A proxy on 127.0.0.1 (a free port) to the S3 server at `endpoint`."""
    parsed = urllib.parse.urlsplit(endpoint)
    faults = Faults()
    server = _ProxyServer((parsed.hostname or "127.0.0.1", parsed.port or 80), faults)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield Proxy(f"http://{host!s}:{port}", faults)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
