"""Servers the remote tests read from, on 127.0.0.1 only: an HTTP file server with Range,
If-Match, ETags and directory listings, a Hub, a Cloud Storage JSON API and an S3 API over
the same files, each of which can be told to misbehave (ignore Range, answer 403/404/5xx,
stall, or any of the hostile answers of tests/hostile_answers.py), counting the requests and
body bytes it sends; and moto's S3 server.
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import json
import re
import shutil
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from tests.hostile_answers import (
    PAGE_SIZES,
    RANGE_KINDS,
    REDIRECT_KINDS,
    SERVER_CAP,
    endless,
    gzip_bomb,
    redirect_target,
    trickle,
    zeros,
)

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
Entry = Callable[[int], bytes]  # the i-th made-up entry of a listing that never ends


@dataclass
class Behaviour:
    """What the server does; tests change it between runs."""

    ignore_range: bool = False
    short: int = 0  # answer a range with this many bytes fewer than asked (a valid 206)
    forced: dict[str, int] = field(default_factory=dict)  # path suffix -> status to answer
    fail_next: int = 0  # answer this many requests with `fail_status` first
    fail_status: int = 503
    delay: float = 0.0  # seconds to wait before answering
    portal: bool = False  # GCS: answer every request with an HTML page, as a captive portal
    endless: bool = False  # GCS: every listing page says another follows
    auth: str | None = None  # "user:password": answer 401 to a request without them (Basic)
    hostile: str = ""  # one of tests.hostile_answers.KINDS: how to misbehave
    cdn: str = ""  # answer each file's request with a redirect to this server (same path)
    mutation: Callable[[bytes], bytes] | None = None  # applied to answer number `mutate_at`
    mutate_at: int = -1
    mutate_on: bool = False  # every answer from `mutate_at` on, not only that one
    answers: int = 0  # answers sent while a mutation is set (from 0)
    authorized: list[str] = field(default_factory=list)  # paths asked with Authorization
    encodings: set[str] = field(default_factory=set)  # Accept-Encoding of every request
    requests: int = 0
    bytes_sent: int = 0
    log: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, Range)
    # the stores' faults (tests/store_servers.py), each for the object names containing it
    wrong_checksum: str | None = None  # report another checksum than the bytes stored have
    drop_chunk: str | None = None  # keep the upload without its last 256 KiB (or half)
    corrupt: str | None = None  # change a byte on receipt, before the checksum is checked
    forced_message: str = "forced by the test"  # the message of a `forced` status
    kept: dict[str, Any] = field(default_factory=dict)  # a write server's state besides files
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        """Well-behaved again, counts at zero."""
        with self.lock:
            self.ignore_range = False
            self.short = 0
            self.forced = {}
            self.fail_next = 0
            self.fail_status = 503
            self.delay = 0.0
            self.portal = False
            self.endless = False
            self.auth = None
            self.hostile = ""
            self.cdn = ""
            self.mutation = None
            self.mutate_at = -1
            self.mutate_on = False
            self.answers = 0
            self.authorized = []
            self.encodings = set()
            self.requests = 0
            self.bytes_sent = 0
            self.log = []
            self.wrong_checksum = self.drop_chunk = self.corrupt = None
            self.forced_message = "forced by the test"

    def take_failure(self, applies: bool = True) -> bool:
        """After `delay`: whether this request fails as one of the next `fail_next` (counted
        down only for requests it `applies` to)."""
        with self.lock:
            failing = applies and self.fail_next > 0
            self.fail_next -= int(failing)
        time.sleep(self.delay)
        return failing

    def gets(self, suffix: str = "") -> list[str]:
        """The Range of each GET of a path ending in `suffix`."""
        with self.lock:
            return [r for m, p, r in self.log if m == "GET" and p.endswith(suffix)]


def etag_of(path: Path) -> str:
    info = path.stat()
    return f'"{info.st_ino:x}-{info.st_size:x}-{info.st_mtime_ns:x}"'


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # headers and body go out in separate writes: without TCP_NODELAY the client's
    # delayed ACK holds each answer of a kept-alive connection for 40 ms
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, *args: object) -> None:  # type: ignore[override]  # quiet
        pass

    def handle_one_request(self) -> None:
        """One request. While the behaviour has a mutation (as the answer starts: a
        connection kept alive waits for its next request from before), the answer is made
        whole in memory, and the `mutate_at`-th such (from 0) goes out as the mutation makes
        it, on a connection closed after it."""
        behaviour = self.server.behaviour
        real = self.wfile
        self.wfile = answer = _Answer(real, behaviour)  # type: ignore[assignment]
        try:
            super().handle_one_request()
        finally:
            self.wfile = real
        if answer.held is None or not answer.held:
            return
        with behaviour.lock:
            index, behaviour.answers = behaviour.answers, behaviour.answers + 1
            at = behaviour.mutate_at
            mutated = index == at or (behaviour.mutate_on and at >= 0 and index > at)
            mutation = behaviour.mutation if mutated else None
        data = bytes(answer.held) if mutation is None else mutation(bytes(answer.held))
        self.close_connection = self.close_connection or mutation is not None
        with contextlib.suppress(OSError):
            real.write(data)

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        if parsed:
            with self.server.behaviour.lock:
                self.server.behaviour.encodings.add(self.headers.get("Accept-Encoding", ""))
        return parsed

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, *, body: bool) -> None:
        self._serve(urllib.parse.unquote(urllib.parse.urlsplit(self.path).path), body=body)

    def _serve(self, url_path: str, *, body: bool) -> None:
        """Answer for the file or folder at `url_path` under root (logged as requested)."""
        behaviour = self.server.behaviour
        with behaviour.lock:
            behaviour.requests += 1
            behaviour.log.append((self.command, self.path, self.headers.get("Range", "")))
            if "Authorization" in self.headers:
                behaviour.authorized.append(self.path)
        if not self._authorised(behaviour):
            self._status(401)
            return
        failing = behaviour.take_failure()
        forced = next((s for k, s in behaviour.forced.items() if url_path.endswith(k)), None)
        if failing or forced is not None:
            self._status(behaviour.fail_status if failing else int(forced or 500))
            return
        if behaviour.hostile in REDIRECT_KINDS:
            self._redirect(behaviour.hostile)
            return
        target = self.server.root / url_path.lstrip("/")
        if behaviour.cdn and target.is_file():
            self._moved(behaviour.cdn + urllib.parse.urlsplit(self.path).path)
        elif target.is_dir():
            self._listing(target, url_path, body=body)
        elif target.is_file():
            self._file(target, body=body)
        else:
            self._status(404)

    def _authorised(self, behaviour: Behaviour) -> bool:
        if behaviour.auth is None:
            return True
        wanted = "Basic " + base64.b64encode(behaviour.auth.encode()).decode()
        return self.headers.get("Authorization") == wanted

    def _status(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _moved(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _redirect(self, kind: str) -> None:
        hop = int(
            urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query).get("hop", ["0"])[0]
        )
        self._moved(redirect_target(kind, self.path, hop))

    def _stream(self, chunks: Iterable[bytes], headers: dict[str, str], status: int = 200) -> None:
        """An answer whose body is `chunks`, sent chunked (no Content-Length) unless the
        headers say a length; the connection is closed after it."""
        self.close_connection = True
        self.send_response(status)
        chunked = "Content-Length" not in headers
        for name, value in {
            **headers,
            **({"Transfer-Encoding": "chunked"} if chunked else {}),
        }.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command == "HEAD":
            return
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for chunk in chunks:
                self._counted(len(chunk))
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            if chunked:
                self.wfile.write(b"0\r\n\r\n")

    def _hostile_listing(self, kind: str, document: bytes, opening: int, entry: Entry) -> bool:
        """Answer a listing as `kind` says, if it is a listing kind: `document` is the real
        answer, `opening` where its entries start, `entry(i)` a made-up entry (with its
        separator). False if the answer is to be the real one."""
        head = document[:opening]
        if kind == "huge-listing":
            self._stream(endless(head, entry), {"Content-Type": self._listing_type})
        elif kind == "gzip-listing":
            headers = {"Content-Type": self._listing_type, "Content-Encoding": "gzip"}
            self._stream(gzip_bomb(head, ord(" ")), headers)
        elif kind == "slow-listing":
            self._stream(trickle(endless(head, entry), 0.05), {"Content-Type": self._listing_type})
        else:
            return False
        return True

    _listing_type = "text/html; charset=utf-8"

    def _listing(self, folder: Path, url_path: str, *, body: bool) -> None:
        if not url_path.endswith("/"):
            self.send_response(301)
            self.send_header("Location", url_path + "/")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        links = []
        for entry in sorted(folder.iterdir()):
            name = entry.name + ("/" if entry.is_dir() else "")
            links.append(f'<li><a href="{urllib.parse.quote(name)}">{html.escape(name)}</a></li>')
        if self.server.behaviour.hostile == "many-entries":  # one page: 200,000 links on it
            links += [f'<li><a href="f{i}.bin">f{i}.bin</a></li>' for i in range(200_000)]
        page = f"<html><body><ul>{''.join(links)}</ul></body></html>".encode()
        made_up = lambda i: f'<li><a href="pad-{i}.bin">pad-{i}.bin</a></li>'.encode()  # noqa: E731
        if self._hostile_listing(
            self.server.behaviour.hostile, page, len(b"<html><body><ul>"), made_up
        ):
            return
        self.send_response(200)
        self.send_header("Content-Type", self._listing_type)
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        if body:
            self._send(page)

    def _file(self, path: Path, *, body: bool) -> None:
        etag = etag_of(path)
        size = path.stat().st_size
        wanted = self.headers.get("If-Match")
        if wanted is not None and wanted != etag:
            self._status(412)
            return
        start, end = 0, size
        match = _RANGE.match(self.headers.get("Range", ""))
        partial = match is not None and not self.server.behaviour.ignore_range
        if partial and match is not None:
            start = int(match.group(1))
            end = min(int(match.group(2)) + 1, size) if match.group(2) else size
            end = max(start + 1, end - self.server.behaviour.short)
            if start >= size:
                self._status(416)
                return
        if partial and self.server.behaviour.hostile in (*RANGE_KINDS, "slow-range"):
            self._hostile_range(self.server.behaviour.hostile, path, start, end)
            return
        self.send_response(206 if partial else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header("ETag", etag)
        self.send_header("Accept-Ranges", "bytes")
        if partial:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if body:
            self._send_file(path, start, end)

    def _hostile_range(self, kind: str, path: Path, start: int, end: int) -> None:
        """A 206 for bytes [start, end) of `path` whose body is not those bytes (RANGE_KINDS),
        or is, trickling in ("slow-range")."""
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Range": f"bytes {start}-{end - 1}/{path.stat().st_size}",
        }
        if kind == "slow-range":
            data = path.read_bytes()[start:end]
            length = {"Content-Length": str(len(data))}
            self._stream(trickle(iter([data]), 0.05, size=1), {**headers, **length}, 206)
        elif kind == "gzip-range":
            self._stream(gzip_bomb(), {**headers, "Content-Encoding": "gzip"}, 206)
        elif kind == "endless-range":
            self._stream(zeros(SERVER_CAP), headers, 206)
        else:
            length = end - start + SERVER_CAP
            self._stream(zeros(length), {**headers, "Content-Length": str(length)}, 206)

    def _json(self, document: object, body: bool, status: int = 200) -> None:
        data = json.dumps(document).encode()
        with self.server.behaviour.lock:
            self.server.behaviour.requests += 1
            self.server.behaviour.log.append((self.command, self.path, ""))
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self._send(data)

    def _send(self, data: bytes) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._counted(len(data))
            self.wfile.write(data)

    def _counted(self, size: int) -> None:
        # Counted before the write: once written, the client may have read the bytes and the
        # test asked for the count before this thread ran again (a full run saw 56 KB missing).
        with self.server.behaviour.lock:
            self.server.behaviour.bytes_sent += size

    def _send_file(self, path: Path, start: int, end: int) -> None:
        with open(path, "rb") as handle:
            handle.seek(start)
            while start < end:
                chunk = handle.read(min(end - start, 1 << 20))
                if not chunk:
                    break
                self._counted(len(chunk))
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                    return
                start += len(chunk)


class _Answer(io.RawIOBase):
    """Where a handler writes its answer: straight to the connection, or, if the behaviour
    has a mutation when the answer starts, into `held` (see `_Handler.handle_one_request`)."""

    def __init__(self, real: Any, behaviour: Behaviour) -> None:
        super().__init__()
        self.real = real
        self.behaviour = behaviour
        self.held: bytearray | None = None
        self.started = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if not self.started:
            self.started = True
            self.held = bytearray() if self.behaviour.mutation is not None else None
        if self.held is not None:
            self.held += data
            return len(data)
        return int(self.real.write(data))

    def flush(self) -> None:
        if self.held is None:
            self.real.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    root: Path
    behaviour: Behaviour

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gives up (a timeout, a refused answer) resets its connection: that is
        # the client's right, not a server fault. Printed, it would land in the stderr of the
        # command under test, which CliRunner captures in this process.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


@dataclass
class HttpServer:
    root: Path
    behaviour: Behaviour
    url: str  # http://127.0.0.1:PORT


@contextlib.contextmanager
def _serve(root: Path, handler: type[_Handler]) -> Iterator[HttpServer]:
    server = _Server(("127.0.0.1", 0), handler)
    server.root = root
    server.behaviour = Behaviour()
    # a short poll: shutdown() at the end of each test waits for it
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
    )
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield HttpServer(root, server.behaviour, f"http://{host!s}:{port}")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@contextlib.contextmanager
def http_server(root: Path) -> Iterator[HttpServer]:
    """An HTTP server for `root` on 127.0.0.1 (a free port), stopped at the end."""
    with _serve(root, _Handler) as server:
        yield server


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 (a free port); yields its endpoint URL."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def upload_tree(client: object, bucket: str, local: Path, prefix: str) -> None:
    """Every file under `local` to s3://bucket/prefix/..."""
    for path in sorted(local.rglob("*")):
        if path.is_file():
            key = f"{prefix}/{path.relative_to(local).as_posix()}".lstrip("/")
            client.upload_file(str(path), bucket, key)  # type: ignore[attr-defined]


def copy_tree(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, dirs_exist_ok=True)
    return target


# --- a Hugging Face Hub: the API routes ckptfix reads through, and resolve downloads ------------

REPO = "org/model"
REVISION_SHA = "0123456789abcdef0123456789abcdef01234567"


class _HubHandler(_Handler):
    """The Hub's routes for one model repo `org/model` whose files are `root`: repo info and
    revisions, tree listings and `resolve` downloads (with Range). `Behaviour.fail_next`
    and `delay` apply to the API routes too (the downloads go through `_serve`)."""

    def _answer(self, *, body: bool) -> None:
        url_path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        api = f"/api/models/{REPO}/"
        behaviour = self.server.behaviour
        if url_path.startswith("/api/") and behaviour.take_failure():
            self._json({"error": "failing on purpose"}, body, behaviour.fail_status)
            return
        if url_path.startswith(api + "revision/") or url_path == api.rstrip("/"):
            self._json({"id": REPO, "sha": REVISION_SHA, "siblings": [], "private": False}, body)
        elif url_path.startswith(api + "tree/"):
            relative = url_path[len(api + "tree/") :].partition("/")[2]
            self._tree(relative, body=body)
        elif url_path.startswith(f"/{REPO}/resolve/"):
            relative = url_path[len(f"/{REPO}/resolve/") :].partition("/")[2]
            if behaviour.cdn:
                with behaviour.lock:
                    behaviour.authorized += ["resolve"] if "Authorization" in self.headers else []
                self._moved(f"{behaviour.cdn}/{relative}")
                return
            self._serve("/" + relative, body=body)
        else:
            self._status(404)

    def end_headers(self) -> None:
        self.send_header("X-Repo-Commit", REVISION_SHA)  # huggingface_hub checks it is a Hub
        if self._link:
            self.send_header("Link", self._link)
            self._link = ""
        super().end_headers()

    def do_POST(self) -> None:  # paths-info: not needed by the reads ckptfix makes
        self._status(404)

    def _status(self, status: int) -> None:
        self.send_response(status)
        if status == 404:  # what the Hub says of a missing file (huggingface_hub reads it)
            self.send_header("X-Error-Code", "EntryNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    _listing_type = "application/json"

    def _tree(self, relative: str, *, body: bool, root: Path | None = None) -> None:
        """The entries of the folder `relative` of `root` (the server's root)."""
        root = root or self.server.root
        folder = root / relative
        if not folder.is_dir():
            self._json({"error": "not found"}, body, status=404)
            return
        entries = []
        for entry in sorted(folder.iterdir()):
            path = entry.relative_to(root).as_posix()
            if entry.is_dir():
                entries.append({"type": "directory", "oid": "0" * 40, "path": path})
            else:
                size = entry.stat().st_size
                oid = etag_of(entry).strip('"').replace("-", "")[:40].ljust(40, "0")
                entries.append({"type": "file", "oid": oid, "size": size, "path": path})
                self._tree_entry(entry, entries[-1])
        base = f"{relative}/".lstrip("/")

        def made_up(index: int) -> bytes:
            item = {"type": "file", "oid": "0" * 40, "size": 1, "path": f"{base}f{index}.bin"}
            return json.dumps(item).encode() + b","

        hostile = self.server.behaviour.hostile
        if self._hostile_listing(hostile, json.dumps(entries).encode(), 1, made_up):
            return
        size = PAGE_SIZES.get(hostile)
        if size is not None:  # pages of `size` new entries, and always a next one
            query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
            page = int(query.get("cursor", "0"))
            document = [json.loads(made_up(page * size + i)[:-1]) for i in range(size)]
            cursor = urllib.parse.urlsplit(self.path)._replace(query=f"cursor={page + 1}")
            self._link = f'<{self.server_url}{cursor.geturl()}>; rel="next"'
            self._json(document, body)
            return
        self._json(entries, body)

    _link = ""

    def _tree_entry(self, file: Path, entry: dict[str, Any]) -> None:
        """A file's tree entry, as a write server completes it (its git blob id, `lfs`)."""

    @property
    def server_url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"


@contextlib.contextmanager
def hub_server(root: Path) -> Iterator[HttpServer]:
    """A Hub on 127.0.0.1 serving `root` as the model repo `org/model`."""
    with _serve(root, _HubHandler) as server:
        yield server


class _GcsHandler(_Handler):
    """The routes of Google Cloud Storage's JSON API that gcsfs reads through, for buckets
    that are the folders of `root`: object metadata, listings by prefix and delimiter, and
    media downloads with Range (`Behaviour.fail_next` fails the next downloads, `forced` the
    objects named, `delay` every answer). An object's generation is its file's mtime in ns,
    so a file replaced on disk is a new generation, and a read pinned to the old one gets
    404, as from a bucket without versioning."""

    def _answer(self, *, body: bool) -> None:
        behaviour = self.server.behaviour
        parts = urllib.parse.urlsplit(self.path)
        if behaviour.take_failure(applies=parts.path.startswith("/download/")):
            self._gcs_error(behaviour.fail_status, "failing on purpose")
            return
        if behaviour.portal:
            self._portal_page(body=body)
            return
        query = dict(urllib.parse.parse_qsl(parts.query))
        route = re.match(r"^/(storage|download/storage)/v1/b/([^/]+)/o(?:/(.+))?$", parts.path)
        if route is None:
            self._gcs_error(404, "no such route")
            return
        bucket = self.server.root / urllib.parse.unquote(route.group(2))
        name = urllib.parse.unquote(route.group(3) or "")
        forced = self.server.behaviour.forced
        status = next((s for k, s in forced.items() if name and name.endswith(k)), None)
        if status is not None:
            self._gcs_error(status, behaviour.forced_message)
        elif not bucket.is_dir():
            self._gcs_error(404, "no such bucket")
        elif not name:
            self._list(bucket, query, body=body)
        elif not _is_generation(bucket / name, query.get("generation")):
            self._gcs_error(404, "no such object")
        elif route.group(1) == "download/storage":
            self._serve(f"/{bucket.name}/{name}", body=body)
        else:
            self._json(object_resource(bucket, name, behaviour), body)

    def _portal_page(self, *, body: bool) -> None:
        page = b"<html><body>Sign in to the network</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        if body:
            self._send(page)

    _listing_type = "application/json"

    def _list(self, bucket: Path, query: dict[str, str], *, body: bool) -> None:
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        items, prefixes = [], set()
        for name in bucket_keys(bucket, prefix):
            rest = name[len(prefix) :]
            if delimiter and delimiter in rest:
                prefixes.add(prefix + rest.split(delimiter, 1)[0] + delimiter)
            else:
                items.append(object_resource(bucket, name, self.server.behaviour))

        def made_up(index: int) -> bytes:
            item = {
                "kind": "storage#object",
                "bucket": bucket.name,
                "name": f"{prefix}f{index}.bin",
            }
            return json.dumps({**item, "size": "1", "generation": "1"}).encode() + b","

        head = b'{"kind": "storage#objects", "items": ['
        if self._hostile_listing(self.server.behaviour.hostile, head, len(head), made_up):
            return
        document: dict[str, object] = {
            "kind": "storage#objects",
            "items": items,
            "prefixes": sorted(prefixes),
        }
        size = PAGE_SIZES.get(self.server.behaviour.hostile)
        if size is not None:
            page = int(query.get("pageToken", "0"))
            document["items"] = [json.loads(made_up(page * size + i)[:-1]) for i in range(size)]
            document["nextPageToken"] = str(page + 1)
        self._json(document, body)

    def _gcs_error(self, status: int, message: str) -> None:
        self._json({"error": {"code": status, "message": message}}, True, status)


def bucket_keys(bucket: Path, prefix: str) -> list[str]:
    """The names of the files under `bucket` that start with `prefix`, sorted."""
    names = (p.relative_to(bucket).as_posix() for p in bucket.rglob("*") if p.is_file())
    return sorted(name for name in names if name.startswith(prefix))


def generation_of(path: Path) -> str:
    return str(path.stat().st_mtime_ns)


def _is_generation(path: Path, wanted: str | None) -> bool:
    """The object exists, in the generation asked for if one was."""
    return path.is_file() and wanted in (None, generation_of(path))


def file_crc32c(path: Path) -> int:
    import google_crc32c

    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            crc = google_crc32c.extend(crc, chunk)
    return int(crc)


def object_resource(bucket: Path, name: str, behaviour: Behaviour) -> dict[str, str]:
    """An object's resource, its CRC-32C computed on the bytes stored (another one where
    `behaviour.wrong_checksum` names the object)."""
    path = bucket / name
    crc = file_crc32c(path)
    if behaviour.wrong_checksum is not None and behaviour.wrong_checksum in name:
        crc ^= 1
    return {
        "kind": "storage#object",
        "bucket": bucket.name,
        "name": name,
        "size": str(path.stat().st_size),
        "generation": generation_of(path),
        "metageneration": "1",
        "etag": etag_of(path).strip('"'),
        "contentType": "application/octet-stream",
        "crc32c": base64.b64encode(crc.to_bytes(4, "big")).decode(),
        "timeCreated": "2026-01-01T00:00:00.000Z",
    }


@contextlib.contextmanager
def gcs_server(root: Path) -> Iterator[HttpServer]:
    """A Cloud Storage JSON API on 127.0.0.1 whose buckets are the folders of `root` (point
    gcsfs at it with STORAGE_EMULATOR_HOST)."""
    with _serve(root, _GcsHandler) as server:
        yield server


# --- an S3 API: enough of it for botocore's HeadBucket, ListObjectsV2, HeadObject, GetObject ---

_S3_LIST = (
    '<?xml version="1.0" encoding="UTF-8"?>'
    '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
    "<Name>{bucket}</Name><Prefix>{prefix}</Prefix><KeyCount>{count}</KeyCount>"
    "<MaxKeys>1000</MaxKeys><Delimiter>/</Delimiter><IsTruncated>{truncated}</IsTruncated>{next}"
)
_S3_OBJECT = (
    "<Contents><Key>{key}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
    "<ETag>{etag}</ETag><Size>{size}</Size><StorageClass>STANDARD</StorageClass></Contents>"
)


class _S3Handler(_Handler):
    """S3's REST API, path-style (`/bucket/key`), for buckets that are the folders of `root`:
    what botocore's S3 client asks to read a checkpoint (no signatures checked). Objects are
    answered by `_serve` (Range, If-Match, ETags and every Behaviour), listings as
    ListObjectsV2 XML (hostile listings too)."""

    _listing_type = "application/xml"

    def _answer(self, *, body: bool) -> None:
        parts = urllib.parse.urlsplit(self.path)
        bucket, _, key = urllib.parse.unquote(parts.path).lstrip("/").partition("/")
        query = dict(urllib.parse.parse_qsl(parts.query))
        if key and (self.server.root / bucket / key).is_dir():
            self._status(404)  # no object: a "folder" is keys under a prefix
        elif key:
            self._serve(f"/{bucket}/{key}", body=body)
        elif not (self.server.root / bucket).is_dir():
            self._status(404)
        elif "list-type" in query:
            self._s3_list(self.server.root / bucket, query)
        else:
            self._status(200)  # HeadBucket

    def _s3_list(self, bucket: Path, query: dict[str, str]) -> None:
        with self.server.behaviour.lock:
            self.server.behaviour.requests += 1
            self.server.behaviour.log.append((self.command, self.path, ""))
        time.sleep(self.server.behaviour.delay)
        prefix, page = query.get("prefix", ""), int(query.get("continuation-token", "0"))
        objects, folders = [], set()
        for name in bucket_keys(bucket, prefix):
            rest = name[len(prefix) :]
            if "/" in rest:
                folders.add(prefix + rest.split("/", 1)[0] + "/")
            else:
                objects.append(_s3_object(name, bucket / name))

        def made_up(index: int) -> bytes:
            return _S3_OBJECT.format(key=f"{prefix}f{index}.bin", etag='"e"', size=1).encode()

        # the one-key probe of what a URL names is answered as S3 would; listings are not
        hostile = "" if "max-keys" in query else self.server.behaviour.hostile
        size = PAGE_SIZES.get(hostile)
        endless_pages = size is not None
        if size is not None:
            objects, folders = [made_up(page * size + i).decode() for i in range(size)], set()
        head = _S3_LIST.format(
            bucket=bucket.name,
            prefix=escape(prefix),
            count=len(objects) + len(folders),
            truncated="true" if endless_pages else "false",
            next=f"<NextContinuationToken>{page + 1}</NextContinuationToken>"
            if endless_pages
            else "",
        ).encode()
        if self._hostile_listing(hostile, head, len(head), made_up):
            return
        prefixes = "".join(
            f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>"
            for p in sorted(folders)
        )
        document = head + "".join(objects).encode() + prefixes.encode() + b"</ListBucketResult>"
        self.send_response(200)
        self.send_header("Content-Type", self._listing_type)
        self.send_header("Content-Length", str(len(document)))
        self.end_headers()
        self._send(document)


def _s3_object(key: str, path: Path) -> str:
    return _S3_OBJECT.format(key=escape(key), etag=escape(etag_of(path)), size=path.stat().st_size)


@contextlib.contextmanager
def s3_server(root: Path) -> Iterator[HttpServer]:
    """An S3 API on 127.0.0.1 whose buckets are the folders of `root` (point botocore at it
    with AWS_ENDPOINT_URL; any keys are accepted)."""
    with _serve(root, _S3Handler) as server:
        yield server


# --- one model folder served by each backend's test server ----------------------------------

BACKENDS = ("http", "hf", "gs", "s3")


@dataclass
class Served:
    """A model folder (`local`) served by one backend's test server, read at `url`."""

    backend: str
    server: HttpServer
    url: str
    local: Path


def served_model(root: Path) -> Path:
    """Two shards, an index and a config under root/bucket/m: what `serving` serves in the
    tests of hostile and mutated answers."""
    from tests.builders import Factory, Spec

    f = Factory(root / "bucket")
    folder = f.sharded("m", [[Spec("a"), Spec("b")], [Spec("c", "F32", (64, 64))]])
    f.config("m")
    return folder


def serve_env(backend: str, server: HttpServer, root: Path) -> dict[str, str]:
    """What points ckptfix at `server` for `backend`, as a fresh process reads it."""
    if backend == "hf":
        return {"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1"}
    if backend == "gs":
        return {
            "STORAGE_EMULATOR_HOST": server.url,
            "GOOGLE_APPLICATION_CREDENTIALS": str(root / "no-credentials.json"),
            "NO_GCE_CHECK": "true",
        }
    if backend == "s3":
        return {**S3_ENV, "AWS_ENDPOINT_URL": server.url, "AWS_EC2_METADATA_DISABLED": "true"}
    return {}


@contextlib.contextmanager
def serving(backend: str, root: Path, model: Path, env: Any) -> Iterator[Served]:
    """`model` (a folder under `root/bucket/`) served by `backend`'s test server: the HTTP
    server, the Hub (the folder is the repo `org/model`), the GCS JSON API or the S3 API.
    `env` (a pytest MonkeyPatch) gets the variables that point ckptfix at it, and this
    process's huggingface_hub its endpoint."""
    servers = {"http": http_server, "hf": hub_server, "gs": gcs_server, "s3": s3_server}
    with servers[backend](model if backend == "hf" else root) as server:
        for name, value in serve_env(backend, server, root).items():
            env.setenv(name, value)
        if backend == "hf":
            from huggingface_hub import constants

            env.delenv("HF_TOKEN", raising=False)
            env.setattr(constants, "ENDPOINT", server.url)  # read once, at its import
            env.setattr(constants, "HF_HUB_OFFLINE", False)
        relative = model.relative_to(root).as_posix()
        url = {
            "http": f"{server.url}/{relative}",
            "hf": f"hf://{REPO}",
            "gs": f"gs://{relative}",
            "s3": f"s3://{relative}",
        }[backend]
        yield Served(backend, server, url, model)
