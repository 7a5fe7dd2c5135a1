"""s3:// through botocore's synchronous S3 client, imported only when an s3:// URL is read.

One client per process and configuration (`s3_client`): botocore clients are thread-safe,
so the threads of `RemoteFolder.map` share it and its pool of connections. Credentials,
region and endpoint come from botocore's usual chain (AWS_* variables incl.
`AWS_ENDPOINT_URL`, `~/.aws/`, then the container and instance providers, which are only
asked when nothing before them answered). botocore's own retries are off (one attempt per
call): `RemoteSession` retries, and counts every attempt.

Each call is one HTTP request, except `info` of a prefix (a HEAD that finds no object, then a
one-key listing) and listings longer than a page (ListObjectsV2, 1,000 keys a page). Reads are
`GetObject` with a `Range`, pinned to the object's `VersionId` where the info has one (a
HEAD in a versioned bucket) and to its ETag (`If-Match`) otherwise; a 200 instead of a 206
is refused before the body is read.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

from ckptfix.core.errors import RemoteError
from ckptfix.core.text import redact
from ckptfix.io.remote import Info, Settings
from ckptfix.io.remote_answers import Body, Listing, answer_seconds, new_body
from ckptfix.io.remote_errors import UnexpectedAnswer, boto_code, parsed, status_of

_CLIENTS: dict[tuple[object, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()
# A URL whose last part ends so is most likely an object: `info` asks HEAD first. Any other
# is most likely a folder: `info` lists first. Either way the other request follows if the
# first finds nothing, so this only saves a request.
_FILE_ENDINGS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".json", ".distcp", ".metadata")


def s3_client(settings: Settings) -> Any:
    """The process's S3 client for these settings and this AWS configuration (AWS_*
    variables): created on first use, then shared."""
    from botocore.config import Config  # first: without botocore, an ImportError every time
    from botocore.session import Session

    key = (settings, tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = _new_client(Session(), Config, settings)
        return client


def _bad_endpoint(why: str) -> RemoteError:
    """A one-line error for an endpoint botocore cannot use (AWS_ENDPOINT_URL_S3,
    AWS_ENDPOINT_URL or the profile's endpoint_url), for reads and writes alike."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return RemoteError(
        "AWS_ENDPOINT_URL",
        "remote-settings",
        f"the S3 endpoint {redact(endpoint or '(from the profile)')!r} cannot be used "
        f"({redact(why)})",
        "set AWS_ENDPOINT_URL (or the profile's endpoint_url) to a URL such as "
        "https://s3.example.com, or unset it",
    )


def _new_client(session: Any, config_class: Any, settings: Settings) -> Any:
    """A client of botocore's usual configuration chain, with ckptfix's limits."""
    # Timestamps (LastModified) stay strings: nothing reads them, and dateutil costs more
    # per response than the rest of the parsing.
    session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=str)
    config = config_class(
        connect_timeout=settings.timeout,
        read_timeout=settings.timeout,
        retries={"total_max_attempts": 1, "mode": "standard"},
        max_pool_connections=max(10, settings.concurrency),
        # Ranged reads carry no whole-object checksum to check, and nothing is uploaded.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        user_agent_extra="ckptfix",
    )
    try:
        client = session.create_client("s3", config=config)
    except ValueError as exc:  # botocore refuses the endpoint (no scheme, ...)
        raise _bad_endpoint(str(exc)) from exc
    if any(mark in str(client.meta.endpoint_url) for mark in "?#"):  # refused per request
        raise _bad_endpoint("it has a query or a fragment")
    endpoint = client._endpoint  # botocore reads every answer but GetObject's whole, inside
    endpoint.http_session = BoundedSession(endpoint.http_session, answer_seconds(settings.timeout))
    return client


class BoundedSession:
    """botocore's HTTP session (urllib3), whose answers are read against remote_answers'
    bounds: botocore reads every body but a GetObject's whole, in the session's `send`,
    before any hook of its own can see it; here `send` asks for the body unread, checks
    the answer's status and headers, and reads it (or lets GetObject stream it) through
    `BoundedRaw`."""

    def __init__(self, inner: Any, answer_seconds: float) -> None:
        self._inner = inner
        self.answer_seconds = answer_seconds

    def send(self, request: Any) -> Any:
        buffered = not request.stream_output
        request.stream_output = True
        response = self._inner.send(request)
        try:
            asked = request.headers.get("Range")  # bytes once botocore has signed it
            if isinstance(asked, bytes):
                asked = asked.decode("latin-1")
            body = new_body(asked, response.status_code, response.headers, self.answer_seconds)
            response.raw = BoundedRaw(response.raw, body)
            if buffered:
                response.content  # noqa: B018  (read now, as botocore's session would)
        except BaseException:
            response.raw.close()
            raise
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class BoundedRaw:
    """urllib3's response as botocore reads it (`stream`, `read`), stopping at its bound."""

    def __init__(self, raw: Any, body: Body) -> None:
        self._raw = raw
        self._body = body

    def read(self, amt: int | None = None) -> bytes:
        """Up to `amt` bytes (all, if None), each piece taken as it arrives, so the bound and
        the deadline are checked while a body trickles in (urllib3's `read(amt)` waits for
        all `amt`)."""
        read = getattr(self._raw, "read1", self._raw.read)  # read1: urllib3 2
        pieces, wanted = [], 2**63 if amt is None else amt
        while wanted > 0 and (piece := bytes(read(self._body.room(min(wanted, 2**16))))):
            self._body.add(piece)
            pieces.append(piece)
            wanted -= len(piece)
        return b"".join(pieces)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def stream(self, amt: int = 2**16, decode_content: bool | None = None) -> Iterator[bytes]:
        """The whole body (a listing page, an error page), in pieces of up to `amt` bytes."""
        while chunk := self.read(amt):
            yield chunk

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _split(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


class S3Backend:
    """S3 (and any S3-compatible service) for remote sources: see the module docstring."""

    scheme = "s3"

    def __init__(self, client: Any, timeout: float) -> None:
        self.client = client
        self.listing_seconds = answer_seconds(timeout)

    def to_path(self, url: str) -> str:
        return url.split("://", 1)[1].strip("/")

    def _call(self, operation: str, **parameters: Any) -> Any:
        """One call of the client; botocore parses the answer itself, and its parser's
        errors on one that is not S3's (a value out of form, not XML) are an unexpected
        answer."""
        from botocore.parsers import ResponseParserError

        method = getattr(self.client, operation)
        return parsed(lambda: method(**parameters), "S3's XML", (ResponseParserError,))

    def info(self, path: str) -> Info:
        bucket, key = _split(path)
        if not key:
            self._call("head_bucket", Bucket=bucket)
            return {"name": bucket, "type": "directory", "size": 0}
        if key.endswith(_FILE_ENDINGS):
            return self._object(path) or self._prefix(path) or self._missing(path)
        return self._prefix(path) or self._object(path) or self._missing(path)

    def _object(self, path: str) -> Info | None:
        """The object at `path` (HEAD), or None if there is none."""
        bucket, key = _split(path)
        try:
            head = self._call("head_object", Bucket=bucket, Key=key)
        except Exception as exc:
            if status_of(exc) == 404 and boto_code(exc) != "NoSuchBucket":
                return None
            raise
        return {
            "name": path,
            "type": "file",
            "size": head.get("ContentLength"),
            "ETag": head.get("ETag"),
            "VersionId": head.get("VersionId"),
        }

    def _prefix(self, path: str) -> Info | None:
        """A folder if any key lies under `path/`, else None."""
        bucket, key = _split(path)
        found = self._call(
            "list_objects_v2", Bucket=bucket, Prefix=key + "/", Delimiter="/", MaxKeys=1
        )
        if found.get("KeyCount", 0) or found.get("Contents") or found.get("CommonPrefixes"):
            return {"name": path, "type": "directory", "size": 0}
        return None

    def _missing(self, path: str) -> Info:
        bucket, key = _split(path)
        raise FileNotFoundError(f"no object s3://{bucket}/{key} and no key under it")

    def ls(self, path: str) -> list[Info]:
        """A folder's objects and sub-folders, every page of the listing (within
        remote_answers' bounds for a listing)."""
        bucket, key = _split(path)
        prefix = key + "/" if key else ""
        entries: list[Info] = []
        pages: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/"}
        bounds = Listing(self.listing_seconds)
        with bounds.pages_of_this_thread():
            while True:
                page = self._call("list_objects_v2", **pages)
                found = _page_entries(bucket, prefix, page)
                entries += found
                token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
                bounds.page(len(found), more=bool(token))
                if not token:
                    return entries
                pages["ContinuationToken"] = token

    def read(self, path: str, start: int, end: int, info: Info) -> bytes:
        bucket, key = _split(path)
        pin: dict[str, str] = {}
        if info.get("VersionId"):
            pin["VersionId"] = str(info["VersionId"])
        elif info.get("ETag"):
            pin["IfMatch"] = str(info["ETag"])
        response = self._call(
            "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **pin
        )
        body = response["Body"]
        try:  # a 206 for exactly this range (BoundedSession): one byte more is refused
            return bytes(body.read(end - start + 1))
        finally:
            body.close()

    def token(self, info: Info) -> tuple[object, ...]:
        return (info.get("size"), info.get("ETag"), info.get("VersionId"))


def _page_entries(bucket: str, prefix: str, page: dict[str, Any]) -> list[Info]:
    """The objects and sub-folders of one ListObjectsV2 page (the folder's own empty
    "folder" object, which some tools make, left out)."""
    objects, folders = page.get("Contents", []), page.get("CommonPrefixes", [])
    keys = [item.get("Key") for item in objects] + [item.get("Prefix") for item in folders]
    if not all(isinstance(name, str) for name in keys):
        raise UnexpectedAnswer("a listing entry without a key")
    return [
        {
            "name": f"{bucket}/{item['Key']}",
            "type": "file",
            "size": item.get("Size"),
            "ETag": item.get("ETag"),
        }
        for item in objects
        if item["Key"] != prefix
    ] + [
        {"name": f"{bucket}/{item['Prefix'].rstrip('/')}", "type": "directory", "size": 0}
        for item in folders
    ]
