"""Random mutations of one answer of a test server (tests/remote_servers.py applies one to
the answer it numbers `Behaviour.mutate_at`, as raw HTTP bytes), for the property test of
remote reads in tests/test_mutation_property.py: the status, a header dropped or set to a
hostile value, the body's bytes or length, or one value of its JSON or XML."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

STATUSES = [200, 201, 204, 206, 301, 302, 304, 307, 400, 401, 403, 404, 410, 412, 416, 429, 500]
HEADERS = [
    ("Content-Length", "0"),
    ("Content-Length", "-1"),
    ("Content-Length", "99999999999999999999"),
    ("Content-Length", "12abc"),
    ("Content-Range", "bytes 0-0/1"),
    ("Content-Range", "bytes */*"),
    ("Content-Range", "bytes 5-4/3"),
    ("Content-Range", "garbage"),
    ("Content-Encoding", "gzip"),
    ("Content-Encoding", "br"),
    ("Content-Type", "text/html"),
    ("Content-Type", "application/json"),
    ("ETag", '"another"'),
    ("ETag", 'W/"weak"'),
    ("Location", "file:///etc/passwd"),
    ("Location", "/"),
    ("Link", '<http://127.0.0.1:9/nothing>; rel="next"'),
    ("Transfer-Encoding", "chunked"),
    ("Last-Modified", "yesterday"),
    ("X-Repo-Commit", "not-a-commit"),
]
JSON_VALUES: list[Any] = [None, -1, 0, 2**64, 1.5, True, "", "../x", "%2e%2e/x", "x" * 300, [], {}]
XML_VALUES = ["", "-1", "99999999999999999999", "true", "../x", "%2e%2e/x", "&amp;", "x" * 300]
KINDS = ["status", "drop-header", "set-header", "byte", "truncate", "extend", "json", "xml"]


@dataclass(frozen=True)
class Mutation:
    """One change to one answer. `at` (which answer of the run), and `pick` (which header,
    byte or value of it), are taken modulo how many there are."""

    kind: str
    at: int
    pick: int
    value: int
    applied: list[tuple[int, bool]] = field(default_factory=list, compare=False)

    def __call__(self, answer: bytes) -> bytes:
        head, _, body = answer.partition(b"\r\n\r\n")
        status, *headers = head.decode("latin-1").split("\r\n")
        code = int(status.split(" ")[1])
        new_status, new_headers, new_body = self._change(status, headers, body)
        self.applied.append((code, new_body != body))
        lines = "\r\n".join([new_status, *new_headers]).encode("latin-1")
        return lines + b"\r\n\r\n" + new_body

    @property
    def changed_file_bytes(self) -> bool:
        """Whether the answer it changed was a ranged read's (a 206) and its body changed:
        bytes no reader can tell from the file's own."""
        return any(code == 206 and changed for code, changed in self.applied)

    def _change(self, status: str, headers: list[str], body: bytes) -> tuple[str, list[str], bytes]:
        if self.kind == "status":
            return f"HTTP/1.1 {STATUSES[self.value % len(STATUSES)]} Mutated", headers, body
        if self.kind == "drop-header" and headers:
            return status, [h for i, h in enumerate(headers) if i != self.pick % len(headers)], body
        if self.kind == "set-header":
            name, value = HEADERS[self.value % len(HEADERS)]
            kept = [h for h in headers if not h.lower().startswith(name.lower() + ":")]
            return status, [*kept, f"{name}: {value}"], body
        return status, *_body_change(self, headers, body)


def _body_change(mutation: Mutation, headers: list[str], body: bytes) -> tuple[list[str], bytes]:
    """A body mutation; the Content-Length header follows the new body, except for a
    truncated one (and an extended one, every other time)."""
    pick, value = mutation.pick, mutation.value
    if mutation.kind == "byte" and body:
        at = pick % len(body)
        return headers, body[:at] + bytes([value % 256]) + body[at + 1 :]
    if mutation.kind == "truncate":
        return headers, body[: pick % (len(body) + 1)]
    if mutation.kind == "extend":
        longer = body + bytes([value % 256]) * (1 + pick % 70_000)
        return (_with_length(headers, len(longer)) if value % 2 else headers), longer
    changed = _json_change(body, pick, value) if mutation.kind == "json" else None
    if mutation.kind == "xml":
        changed = _xml_change(body, pick, value)
    if changed is None:
        return headers, body
    return _with_length(headers, len(changed)), changed


def _with_length(headers: list[str], length: int) -> list[str]:
    return [
        f"Content-Length: {length}" if h.lower().startswith("content-length:") else h
        for h in headers
    ]


def _json_change(body: bytes, pick: int, value: int) -> bytes | None:
    """One leaf of a JSON document replaced (None when the body is not JSON)."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    leaves: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(child, dict | list) and child:
                walk(child)
            else:
                leaves.append((node, key))

    if not isinstance(document, dict | list) or not document:
        return None
    walk(document)
    parent, key = leaves[pick % len(leaves)]
    parent[key] = JSON_VALUES[value % len(JSON_VALUES)]
    return json.dumps(document).encode()


def _xml_change(body: bytes, pick: int, value: int) -> bytes | None:
    """One element's text in an XML document replaced (None when there is none)."""
    if not body.startswith(b"<?xml"):
        return None
    texts = list(re.finditer(rb">([^<]*)<", body))
    if not texts:
        return None
    found = texts[pick % len(texts)]
    new = XML_VALUES[value % len(XML_VALUES)].encode()
    return body[: found.start(1)] + new + body[found.end(1) :]


def replacing(old: bytes, new: bytes) -> Callable[[bytes], bytes]:
    """A mutation that replaces `old` by `new` in an answer's body (its length follows)."""

    def mutate(answer: bytes) -> bytes:
        head, _, body = answer.partition(b"\r\n\r\n")
        body = body.replace(old, new)
        headers = _with_length(head.decode("latin-1").split("\r\n"), len(body))
        return "\r\n".join(headers).encode("latin-1") + b"\r\n\r\n" + body

    return mutate


def mutations() -> st.SearchStrategy[Mutation]:
    return st.builds(
        Mutation,
        kind=st.sampled_from(KINDS),
        at=st.integers(0, 10**6),
        pick=st.integers(0, 10**6),
        value=st.integers(0, 10**6),
    )
