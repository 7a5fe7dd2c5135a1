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
import hashlib
import json
import re
import shutil
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.remote_servers import (
    REPO,
    REVISION_SHA,
    HttpServer,
    _GcsHandler,
    _HubHandler,
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


def pattern(size: int, seed: int = 1) -> bytes:
    """`size` bytes that repeat only every 251 (a part moved or dropped changes them)."""
    cycle = bytes((i * 7 + seed) % 251 for i in range(251))
    return (cycle * (size // 251 + 1))[:size]


def upload_whole(store: Any, name: str, data: bytes, step: int = 100_003) -> Any:
    """`data` streamed into `store` as object `name`, in pieces of `step` bytes."""
    upload = store.begin(name, len(data))
    for start in range(0, len(data), step):
        upload.send(memoryview(data)[start : start + step])
    return upload.complete()


def stored(bucket: Path) -> dict[str, bytes]:
    """Every object of a bucket served by these servers: name -> bytes."""
    return {
        p.relative_to(bucket).as_posix(): p.read_bytes()
        for p in sorted(bucket.rglob("*"))
        if p.is_file()
    }


# --- the Hub's commit path ----------------------------------------------------------------

LFS_PART = 512 * 2**10  # the Hub's LFS multipart chunk size here: larger files have parts
_API = f"/api/models/{REPO}"


class _HubWriteHandler(_HubHandler):
    """The Hub's routes for `org/model` (root is its tree at the head of main), with what
    huggingface_hub's commit path calls: preupload (files named .json, .md or .txt are
    "regular", the rest LFS), the LFS batch API (upload: basic, or multipart with parts of
    LFS_PART for a larger file, and a verify action; download: whether an object of that
    SHA-256 and size is held), the LFS object PUTs, the multipart completion, and the commit
    (NDJSON; `create_pr=1` makes a pull request, whose files go to `kept["prs"]` and not to
    main). LFS objects are kept by the SHA-256 of the bytes received (so bytes changed or
    lost are held under another one), in `kept["lfs"]`; `kept["head"]` is main's commit and
    `kept["commits"]` every commit's (sha, header, operations, pr)."""

    def _state(self) -> dict[str, Any]:
        kept = self.server.behaviour.kept
        kept.setdefault("head", REVISION_SHA)
        for key in ("lfs", "paths", "uploads", "commits", "trees"):
            kept.setdefault(key, [] if key == "commits" else {})
        return kept

    def _answer(self, *, body: bool) -> None:
        """Main's head as it moves; a pull request's tree at its commit."""
        url_path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        if url_path.startswith(_API + "/revision/") and not self.server.behaviour.fail_next:
            with self.server.behaviour.lock:
                head = self._state()["head"]
            self._json({"id": REPO, "sha": head, "siblings": [], "private": False}, body)
            return
        at = re.match(rf"^(?:{_API}/tree|/{REPO}/resolve)/([0-9a-f]{{40}})/?(.*)$", url_path)
        tree = self._state()["trees"].get(at.group(1)) if at is not None else None
        if at is None or tree is None:
            super()._answer(body=body)
        elif url_path.startswith(_API):
            self._tree(at.group(2), body=body, root=tree)
        elif (tree / at.group(2)).is_file():
            self._file(tree / at.group(2), body=body)
        else:
            self._status(404)

    def _tree_entry(self, file: Path, entry: dict[str, Any]) -> None:
        """The git blob id of what the file holds (of its LFS pointer, for an LFS file),
        and `lfs` for an LFS file."""
        data = file.read_bytes()
        lfs = self._state()["paths"].get(str(file))
        if lfs is not None:
            entry["lfs"] = lfs
            if self.server.behaviour.wrong_checksum == "tree":  # the tree lies, not the store
                entry["lfs"] = {**lfs, "oid": lfs["oid"][::-1]}
            data = f"version https://git-lfs.github.com/spec/v1\noid sha256:{lfs['oid']}\nsize {lfs['size']}\n".encode()
        entry["oid"] = git_blob_id(data)

    def do_PUT(self) -> None:
        url_path = urllib.parse.urlsplit(self.path).path
        data = read_body(self)
        behaviour = self.server.behaviour
        with behaviour.lock:
            behaviour.requests += 1
            behaviour.log.append(("PUT", self.path, ""))
        if behaviour.take_failure():
            self._json({"error": "failing on purpose"}, True, behaviour.fail_status)
            return
        if url_path.startswith("/lfs-upload/"):
            self._keep(data)
        else:  # a part of a multipart upload, kept until its completion
            with behaviour.lock:
                self._state()["uploads"][url_path] = data
        self.send_response(200)
        self.send_header("ETag", f'"{hashlib.md5(data).hexdigest()}"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        parts = urllib.parse.urlsplit(self.path)
        url_path, query = (
            urllib.parse.unquote(parts.path),
            dict(urllib.parse.parse_qsl(parts.query)),
        )
        body = read_body(self)
        behaviour = self.server.behaviour
        if behaviour.take_failure():
            self._json({"error": "failing on purpose"}, True, behaviour.fail_status)
            return
        status = next((s for k, s in behaviour.forced.items() if url_path.endswith(k)), None)
        if status is not None:
            self._json({"error": behaviour.forced_message}, True, status)
        elif url_path.startswith(_API + "/preupload/"):
            self._preupload(json.loads(body))
        elif url_path == f"/{REPO}.git/info/lfs/objects/batch":
            self._batch(json.loads(body))
        elif url_path.startswith("/lfs-verify/"):
            self._json({"success": True}, True)
        elif url_path == "/api/validate-yaml":  # a commit holding README.md checks its card
            self._json({"errors": [], "warnings": []}, True)
        elif url_path.startswith("/lfs-complete/"):
            self._complete(url_path.rsplit("/", 1)[1], json.loads(body))
        elif url_path.startswith(_API + "/commit/"):
            self._commit(body, query.get("create_pr") == "1")
        else:
            self._json({"error": "no such route"}, True, 404)

    def _preupload(self, document: dict[str, Any]) -> None:
        files = [
            {
                "path": item["path"],
                "uploadMode": "regular"
                if item["path"].endswith((".json", ".md", ".txt"))
                else "lfs",
                "shouldIgnore": False,
            }
            for item in document["files"]
        ]
        self._json({"files": files, "commitOid": self._state()["head"]}, True)

    def _batch(self, document: dict[str, Any]) -> None:
        if self.server.behaviour.hostile == "malformed":  # `objects` that is no list
            self._json({"transfer": "basic", "objects": "none"}, True)
            return
        base, objects = self.server_url, []
        for item in document["objects"]:
            oid, size = item["oid"], item["size"]
            held = self._state()["lfs"].get(oid)
            entry: dict[str, Any] = {"oid": oid, "size": size}
            if document["operation"] == "download":
                if held is None or len(held) != size:
                    entry["error"] = {"code": 404, "message": "Object does not exist"}
                else:
                    entry["actions"] = {"download": {"href": f"{base}/lfs-object/{oid}"}}
            elif held is None:
                entry["actions"] = {"upload": self._upload_action(base, oid, size)}
                entry["actions"]["verify"] = {"href": f"{base}/lfs-verify/{oid}"}
            objects.append(entry)
        self._json({"transfer": "basic", "objects": objects}, True)

    @staticmethod
    def _upload_action(base: str, oid: str, size: int) -> dict[str, Any]:
        if size <= LFS_PART:
            return {"href": f"{base}/lfs-upload/{oid}"}
        count = -(-size // LFS_PART)
        header = {f"{n:05d}": f"{base}/lfs-part/{oid}/{n}" for n in range(1, count + 1)}
        return {
            "href": f"{base}/lfs-complete/{oid}",
            "header": {"chunk_size": str(LFS_PART), **header},
        }

    def _complete(self, oid: str, document: dict[str, Any]) -> None:
        """The parts of a multipart upload put together (`drop_chunk`: one is left out)."""
        state, behaviour = self._state(), self.server.behaviour
        numbers = [part["partNumber"] for part in document["parts"]]
        if _named(behaviour.drop_chunk, oid) and len(numbers) > 1:
            numbers = numbers[:1] + numbers[2:]
        with behaviour.lock:
            data = b"".join(state["uploads"].pop(f"/lfs-part/{oid}/{n}", b"") for n in numbers)
        self._keep(data)
        self._json({"success": True}, True)

    def _keep(self, data: bytes) -> None:
        """Bytes received for an LFS object, kept under their own SHA-256 (see the class)."""
        behaviour = self.server.behaviour
        if _named(behaviour.corrupt, "") and data:
            data = bytes([data[0] ^ 1]) + data[1:]
        sha = hashlib.sha256(data).hexdigest()
        if _named(behaviour.wrong_checksum, ""):
            sha = sha[:-1] + ("0" if sha[-1] != "0" else "1")
        with behaviour.lock:
            self._state()["lfs"][sha] = data

    def _commit(self, body: bytes, pr: bool) -> None:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header, operations = lines[0]["value"], lines[1:]
        state = self._state()
        parent = header.get("parentCommit")
        if parent is not None and parent != state["head"]:
            self._json(
                {"error": "A commit has happened since. Please refresh and try again."}, True, 412
            )
            return
        files: dict[str, bytes] = {}
        for operation in operations:
            key, value = operation["key"], operation["value"]
            if key == "lfsFile":
                held = state["lfs"].get(value["oid"])
                if held is None or len(held) != value["size"]:
                    self._json({"error": f"LFS file {value['path']} not found"}, True, 422)
                    return
                files[value["path"]] = held
            elif key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
        sha = hashlib.sha1(body).hexdigest()
        deleted = [op["value"]["path"] for op in operations if op["key"] == "deletedFile"]
        lfs = {op["value"]["path"] for op in operations if op["key"] == "lfsFile"}
        with self.server.behaviour.lock:
            state["commits"].append((sha, header, operations, pr))
            tree = self.server.root
            if pr:  # a branch from main's head, holding the commit
                tree = (
                    self.server.root.parent
                    / f"{self.server.root.name}-pr-{len(state['trees']) + 1}"
                )
                shutil.copytree(self.server.root, tree)
                state["trees"][sha] = tree
            else:
                state["head"] = sha
            self._apply(tree, files, deleted, lfs)
        document = {"commitUrl": f"{self.server_url}/{REPO}/commit/{sha}", "commitOid": sha}
        pr_url = f"{self.server_url}/{REPO}/discussions/{len(state['trees'])}"
        document["pullRequestUrl"] = pr_url if pr else None
        self._json(document, True)

    def _apply(
        self, tree: Path, files: dict[str, bytes], deleted: list[str], lfs: set[str]
    ) -> None:
        for path in deleted:
            (tree / path).unlink()
            self._state()["paths"].pop(str(tree / path), None)
        for path, data in files.items():
            target = tree / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            self._state()["paths"].pop(str(target), None)
            if path in lfs:
                info = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data)}
                self._state()["paths"][str(target)] = info


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@contextlib.contextmanager
def hub_write_server(root: Path) -> Iterator[HttpServer]:
    """The Hub with its commit path on 127.0.0.1, `root` the tree of `org/model` at main."""
    with _serve(root, _HubWriteHandler) as server:
        yield server
