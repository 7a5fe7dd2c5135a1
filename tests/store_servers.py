"""The write side of the test servers of tests/remote_servers.py, on 127.0.0.1: Cloud
Storage's JSON API with uploads (multipart, with the CRC-32C of the metadata checked against
the bytes received), compose (sources pinned to their generations), deletes; and (below) the
Hub's commit path. Each keeps the bytes it receives (files under its root) and reports
checksums computed on them, so that a wrong byte is seen; `Behaviour`'s faults make it lie
(`wrong_checksum`), lose bytes it acknowledged (`drop_chunk`), receive changed bytes
(`corrupt`), fail (`fail_next`, `forced`, `forced_message`) or stall (`delay`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

from tests.remote_servers import (
    HttpServer,
    _GcsHandler,
    _serve,
    generation_of,
    object_resource,
)

_UPLOAD = re.compile(r"^/upload/storage/v1/b/([^/]+)/o$")
_OBJECT = re.compile(r"^/storage/v1/b/([^/]+)/o/([^/]+)(/compose)?$")
CHUNK = 256 * 2**10


def read_body(handler: _GcsHandler) -> bytes:
    """A request's body, by Content-Length or chunked."""
    length = handler.headers.get("Content-Length")
    if length is not None:
        return handler.rfile.read(int(length))
    data = bytearray()
    while True:
        size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            handler.rfile.readline()
            return bytes(data)
        data += handler.rfile.read(size)
        handler.rfile.readline()


def multipart(content_type: str, body: bytes) -> list[bytes]:
    """The contents of a multipart/related body's parts."""
    boundary = re.search(r'boundary="?([^";]+)"?', content_type)
    assert boundary is not None, content_type
    marker = b"--" + boundary.group(1).encode()
    found = []
    for chunk in body.split(marker)[1:]:
        if chunk.startswith(b"--"):
            break
        _, _, content = chunk.partition(b"\r\n\r\n")
        found.append(content[:-2] if content.endswith(b"\r\n") else content)
    return found


def _named(fault: str | None, name: str) -> bool:
    return fault is not None and fault in name


class _GcsWriteHandler(_GcsHandler):
    """`_GcsHandler` and the write routes (see the module docstring)."""

    def do_POST(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
        body = read_body(self)
        behaviour = self.server.behaviour  # each answer is logged by `_json`
        if behaviour.take_failure():
            self._gcs_error(behaviour.fail_status, "failing on purpose")
            return
        upload, other = _UPLOAD.match(path), _OBJECT.match(path)
        if upload is not None:
            self._upload(self.server.root / urllib.parse.unquote(upload.group(1)), query, body)
        elif other is not None and other.group(3):
            bucket = self.server.root / urllib.parse.unquote(other.group(1))
            self._compose(bucket, urllib.parse.unquote(other.group(2)), json.loads(body))
        else:
            self._gcs_error(404, "no such route")

    def do_DELETE(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        behaviour = self.server.behaviour
        route = _OBJECT.match(path)
        if behaviour.take_failure() or route is None:
            self._gcs_error(behaviour.fail_status if route else 404, "failing on purpose")
            return
        target = self.server.root / urllib.parse.unquote(route.group(1))
        target = target / urllib.parse.unquote(route.group(2))
        if not target.is_file():
            self._gcs_error(404, "no such object")
            return
        target.unlink()
        with behaviour.lock:  # errors are logged by `_json`
            behaviour.requests += 1
            behaviour.log.append(("DELETE", self.path, ""))
        self._status(204)

    def _refused(self, name: str) -> bool:
        behaviour = self.server.behaviour
        status = next((s for k, s in behaviour.forced.items() if name.endswith(k)), None)
        if status is not None:
            self._gcs_error(status, behaviour.forced_message)
        return status is not None

    def _upload(self, bucket: Path, query: dict[str, str], body: bytes) -> None:
        import google_crc32c

        if query.get("uploadType") != "multipart":
            self._gcs_error(400, "only multipart uploads here")
            return
        metadata_part, data = multipart(self.headers.get("Content-Type", ""), body)
        metadata = json.loads(metadata_part)
        name, behaviour = str(metadata["name"]), self.server.behaviour
        if self._refused(name):
            return
        if not bucket.is_dir():
            self._gcs_error(404, "The specified bucket does not exist.")
            return
        if _named(behaviour.corrupt, name) and data:
            data = bytes([data[0] ^ 1]) + data[1:]
        wanted = metadata.get("crc32c")
        got = base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()
        if wanted is not None and wanted != got:
            self._gcs_error(
                400, f'Provided CRC32C "{wanted}" doesn\'t match calculated CRC32C "{got}".'
            )
            return
        target = bucket / name
        if query.get("ifGenerationMatch") == "0" and target.exists():
            self._gcs_error(412, "conditionNotMet")
            return
        if _named(behaviour.drop_chunk, name):
            data = (
                data[: max(0, len(data) - CHUNK)] if len(data) > CHUNK else data[: len(data) // 2]
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        self._json(object_resource(bucket, name, behaviour), True)

    def _compose(self, bucket: Path, name: str, document: dict[str, object]) -> None:
        if self._refused(name):
            return
        sources = document.get("sourceObjects")
        assert isinstance(sources, list) and 0 < len(sources) <= 32, "at most 32 sources"
        paths = []
        for source in sources:
            path = bucket / source["name"]
            wanted = source.get("objectPreconditions", {}).get("ifGenerationMatch")
            if not path.is_file():
                self._gcs_error(404, "no such source object")
                return
            if wanted is not None and str(wanted) != generation_of(path):
                self._gcs_error(412, "conditionNotMet")
                return
            paths.append(path)
        target = bucket / name
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".composing")
        with open(partial, "wb") as out:
            for path in paths:
                with open(path, "rb") as source_file:
                    while chunk := source_file.read(8 << 20):
                        out.write(chunk)
        partial.replace(target)
        self._json(object_resource(bucket, name, self.server.behaviour), True)


@contextlib.contextmanager
def gcs_write_server(root: Path) -> Iterator[HttpServer]:
    """Cloud Storage's JSON API, reads and writes, for buckets that are the folders of
    `root` (point gcsfs at it with STORAGE_EMULATOR_HOST)."""
    with _serve(root, _GcsWriteHandler) as server:
        yield server


def stored(bucket: Path) -> dict[str, bytes]:
    """Every object of a bucket served by these servers: name -> bytes."""
    return {
        p.relative_to(bucket).as_posix(): p.read_bytes()
        for p in sorted(bucket.rglob("*"))
        if p.is_file()
    }
