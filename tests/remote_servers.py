"""Servers the remote tests read from, on 127.0.0.1 only: an HTTP file server with Range,
If-Match, ETags and directory listings that can be told to misbehave (ignore Range, answer
403/404/5xx, stall), counting the requests and body bytes it sends; and moto's S3 server.
"""

from __future__ import annotations

import base64
import contextlib
import html
import json
import re
import shutil
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


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
    requests: int = 0
    bytes_sent: int = 0
    log: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, Range)
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
            self.requests = 0
            self.bytes_sent = 0
            self.log = []

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
    server: _Server

    def log_message(self, *args: object) -> None:  # type: ignore[override]  # quiet
        pass

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
        if not self._authorised(behaviour):
            self._status(401)
            return
        failing = behaviour.take_failure()
        forced = next((s for k, s in behaviour.forced.items() if url_path.endswith(k)), None)
        if failing or forced is not None:
            self._status(behaviour.fail_status if failing else int(forced or 500))
            return
        target = self.server.root / url_path.lstrip("/")
        if target.is_dir():
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
        page = f"<html><body><ul>{''.join(links)}</ul></body></html>".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
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
            self.wfile.write(data)
            with self.server.behaviour.lock:
                self.server.behaviour.bytes_sent += len(data)

    def _send_file(self, path: Path, start: int, end: int) -> None:
        with open(path, "rb") as handle:
            handle.seek(start)
            while start < end:
                chunk = handle.read(min(end - start, 1 << 20))
                if not chunk:
                    break
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                    return
                with self.server.behaviour.lock:
                    self.server.behaviour.bytes_sent += len(chunk)
                start += len(chunk)


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
            self._serve("/" + relative, body=body)
        else:
            self._status(404)

    def end_headers(self) -> None:
        self.send_header("X-Repo-Commit", REVISION_SHA)  # huggingface_hub checks it is a Hub
        super().end_headers()

    def do_POST(self) -> None:  # paths-info: not needed by the reads ckptfix makes
        self._status(404)

    def _status(self, status: int) -> None:
        self.send_response(status)
        if status == 404:  # what the Hub says of a missing file (huggingface_hub reads it)
            self.send_header("X-Error-Code", "EntryNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _tree(self, relative: str, *, body: bool) -> None:
        folder = self.server.root / relative
        if not folder.is_dir():
            self._json({"error": "not found"}, body, status=404)
            return
        entries = []
        for entry in sorted(folder.iterdir()):
            path = entry.relative_to(self.server.root).as_posix()
            if entry.is_dir():
                entries.append({"type": "directory", "oid": "0" * 40, "path": path})
            else:
                size = entry.stat().st_size
                oid = etag_of(entry).strip('"').replace("-", "")[:40].ljust(40, "0")
                entries.append({"type": "file", "oid": oid, "size": size, "path": path})
        self._json(entries, body)


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
            self._gcs_error(status, "forced by the test")
        elif not bucket.is_dir():
            self._gcs_error(404, "no such bucket")
        elif not name:
            self._list(bucket, query, body=body)
        elif not _is_generation(bucket / name, query.get("generation")):
            self._gcs_error(404, "no such object")
        elif route.group(1) == "download/storage":
            self._serve(f"/{bucket.name}/{name}", body=body)
        else:
            self._json(_object_resource(bucket, name), body)

    def _portal_page(self, *, body: bool) -> None:
        page = b"<html><body>Sign in to the network</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        if body:
            self._send(page)

    def _list(self, bucket: Path, query: dict[str, str], *, body: bool) -> None:
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        items, prefixes = [], set()
        for path in sorted(p for p in bucket.rglob("*") if p.is_file()):
            name = path.relative_to(bucket).as_posix()
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix) :]
            if delimiter and delimiter in rest:
                prefixes.add(prefix + rest.split(delimiter, 1)[0] + delimiter)
            else:
                items.append(_object_resource(bucket, name))
        document: dict[str, object] = {
            "kind": "storage#objects",
            "items": items,
            "prefixes": sorted(prefixes),
        }
        if self.server.behaviour.endless:
            document["nextPageToken"] = f"page-{len(self.server.behaviour.log)}"
        self._json(document, body)

    def _gcs_error(self, status: int, message: str) -> None:
        self._json({"error": {"code": status, "message": message}}, True, status)


def generation_of(path: Path) -> str:
    return str(path.stat().st_mtime_ns)


def _is_generation(path: Path, wanted: str | None) -> bool:
    """The object exists, in the generation asked for if one was."""
    return path.is_file() and wanted in (None, generation_of(path))


def _object_resource(bucket: Path, name: str) -> dict[str, str]:
    path = bucket / name
    return {
        "kind": "storage#object",
        "bucket": bucket.name,
        "name": name,
        "size": str(path.stat().st_size),
        "generation": generation_of(path),
        "metageneration": "1",
        "etag": etag_of(path).strip('"'),
        "contentType": "application/octet-stream",
    }


@contextlib.contextmanager
def gcs_server(root: Path) -> Iterator[HttpServer]:
    """A Cloud Storage JSON API on 127.0.0.1 whose buckets are the folders of `root` (point
    gcsfs at it with STORAGE_EMULATOR_HOST)."""
    with _serve(root, _GcsHandler) as server:
        yield server
