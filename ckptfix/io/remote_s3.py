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
from typing import Any

from ckptfix.io.remote import Info, Settings, no_range
from ckptfix.io.remote_errors import boto_code, status_of

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
    return session.create_client("s3", config=config)


def _split(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


class S3Backend:
    """S3 (and any S3-compatible service) for remote sources: see the module docstring."""

    scheme = "s3"

    def __init__(self, client: Any) -> None:
        self.client = client

    def to_path(self, url: str) -> str:
        return url.split("://", 1)[1].strip("/")

    def info(self, path: str) -> Info:
        bucket, key = _split(path)
        if not key:
            self.client.head_bucket(Bucket=bucket)
            return {"name": bucket, "type": "directory", "size": 0}
        if key.endswith(_FILE_ENDINGS):
            return self._object(path) or self._prefix(path) or self._missing(path)
        return self._prefix(path) or self._object(path) or self._missing(path)

    def _object(self, path: str) -> Info | None:
        """The object at `path` (HEAD), or None if there is none."""
        bucket, key = _split(path)
        try:
            head = self.client.head_object(Bucket=bucket, Key=key)
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
        found = self.client.list_objects_v2(
            Bucket=bucket, Prefix=key + "/", Delimiter="/", MaxKeys=1
        )
        if found.get("KeyCount", 0) or found.get("Contents") or found.get("CommonPrefixes"):
            return {"name": path, "type": "directory", "size": 0}
        return None

    def _missing(self, path: str) -> Info:
        bucket, key = _split(path)
        raise FileNotFoundError(f"no object s3://{bucket}/{key} and no key under it")

    def ls(self, path: str) -> list[Info]:
        """A folder's objects and sub-folders, every page of the listing."""
        bucket, key = _split(path)
        prefix = key + "/" if key else ""
        entries: list[Info] = []
        pages: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/"}
        while True:
            page = self.client.list_objects_v2(**pages)
            entries += [
                {
                    "name": f"{bucket}/{item['Key']}",
                    "type": "file",
                    "size": item.get("Size"),
                    "ETag": item.get("ETag"),
                }
                for item in page.get("Contents", [])
                if item["Key"] != prefix  # the empty "folder" object some tools make
            ]
            entries += [
                {"name": f"{bucket}/{item['Prefix'].rstrip('/')}", "type": "directory", "size": 0}
                for item in page.get("CommonPrefixes", [])
            ]
            if not page.get("IsTruncated") or not page.get("NextContinuationToken"):
                return entries
            pages["ContinuationToken"] = page["NextContinuationToken"]

    def read(self, path: str, start: int, end: int, info: Info) -> bytes:
        bucket, key = _split(path)
        pin: dict[str, str] = {}
        if info.get("VersionId"):
            pin["VersionId"] = str(info["VersionId"])
        elif info.get("ETag"):
            pin["IfMatch"] = str(info["ETag"])
        response = self.client.get_object(
            Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **pin
        )
        body = response["Body"]
        try:
            if response["ResponseMetadata"].get("HTTPStatusCode") != 206:
                raise no_range(f"s3://{path}", start, end)  # before reading the body
            return bytes(body.read())
        finally:
            body.close()

    def token(self, info: Info) -> tuple[object, ...]:
        return (info.get("size"), info.get("ETag"), info.get("VersionId"))
