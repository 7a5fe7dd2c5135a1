"""s3://bucket/prefix as an output (`ObjectStore`), through botocore's S3 client.

The client is the remote reads' (io.remote_s3: AWS_* configuration, endpoint, bounded
answers) and every request goes through a `RemoteSession` (transient failures retried with
backoff, the others one-line errors naming the redacted URL, requests counted).

Objects larger than one part are multipart uploads with `ChecksumAlgorithm=CRC32` and the
COMPOSITE checksum type: each part is sent with its CRC-32, and the object's checksum, as S3
reports it (HeadObject with ChecksumMode), is the CRC-32 of the parts' CRC-32s (4 bytes each,
big-endian), base64, followed by `-N` (N parts; compared without it, which the value covers).
That value is computed here while the bytes pass and compared with the one S3 reports once
the upload is complete: the object then holds exactly the bytes that were sent (as far as a
CRC-32 per part can tell, which is what it is for: transfer errors; SHA-256 costs five times
the CPU on both ends, 2.2 GB took 5 s more against a server that checks it). Smaller objects
are one PutObject with the whole object's CRC-32, compared the same way. The part size depends only on the object's size (part_size), so --resume can
compute the checksum an existing object must have without sending anything.

A run puts a marker object (MARKER, see s3_marker) under the prefix before its first upload
and a small record object of each multipart upload it starts, and removes them once the
output is published: the next run aborts the uploads records vouch for (a killed run's;
taking over a marker needs --force or --resume, as its run may still be alive) and reports
and leaves any other.
"""

from __future__ import annotations

import base64
import dataclasses
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from ckptfix.core.errors import RemoteError, UsageError, VerificationError
from ckptfix.core.text import redact
from ckptfix.io.remote import RemoteSession, Settings
from ckptfix.io.remote_answers import Listing, answer_seconds
from ckptfix.io.remote_errors import UnexpectedAnswer, parsed
from ckptfix.write.stores.base import Dangling, StoredObject, StoreOptions, UploadStats
from ckptfix.write.stores.common import Pages
from ckptfix.write.stores.parts import PartPump, in_flight
from ckptfix.write.stores.s3_checksum import CompositeCrc32, composite, crc32, s3_part_size
from ckptfix.write.stores.s3_checksum import b64 as _b64
from ckptfix.write.stores.s3_marker import (
    MARKER,
    MARKER_MAX,
    RECORDS,
    RECORDS_MAX,
    RunMarker,
    is_marker,
    record_name,
    recorded,
)

_DELETE_BATCH = 1000  # DeleteObjects' limit
MAX_COPY = 5 * 2**30  # CopyObject's limit: larger objects are copied in parts


def split_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix ending in "/" or empty) of s3://bucket[/prefix]."""
    rest = url.split("://", 1)[1]
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not bucket or "@" in bucket or ":" in bucket:
        raise UsageError(redact(url), "names no bucket", "write -o s3://BUCKET/PREFIX")
    return bucket, prefix + "/" if prefix else ""


class S3Store:
    """See the module docstring."""

    def __init__(self, url: str, options: StoreOptions, settings: Settings | None = None) -> None:
        from ckptfix.io.remote_s3 import S3Backend, s3_client

        self.bucket, self.prefix = split_url(url)
        self.options = options
        settings = settings or Settings.from_env()
        # a connection per part in flight, beside the reads' (urllib3 warns past its pool)
        wanted = options.concurrency + settings.concurrency
        settings = dataclasses.replace(settings, concurrency=max(settings.concurrency, wanted))
        self.client = s3_client(settings)
        self.session = RemoteSession(S3Backend(self.client, settings.timeout), settings)
        self.listing_seconds = answer_seconds(settings.timeout)
        self._display = redact(url.rstrip("/"))
        self._marked = False  # this run's marker is there
        self.marker = RunMarker(uuid.uuid4().hex)
        self._lock = threading.Lock()
        self.bytes_sent = 0

    @property
    def display(self) -> str:
        return self._display

    def url_of(self, name: str) -> str:
        return f"{self._display}/{name}"

    def key(self, name: str) -> str:
        return self.prefix + name

    def call(self, name: str, operation: str, **parameters: Any) -> Any:
        """One request (retried when transient); errors name the object's URL."""
        from botocore.parsers import ResponseParserError

        method = getattr(self.client, operation)
        request: Callable[[], Any] = lambda: parsed(  # noqa: E731
            lambda: method(**parameters), "S3's XML", (ResponseParserError,)
        )
        url = self.url_of(name) if name else self._display
        try:
            return self.session.call(url, request)
        except RemoteError as exc:
            if exc.rule == "remote-forbidden":
                raise RemoteError(
                    url,
                    "remote-forbidden",
                    "access denied (HTTP 403)",
                    "check that the credentials in use may list, write and delete objects "
                    "under this prefix",
                ) from exc
            raise

    def add_sent(self, count: int) -> None:
        with self._lock:  # the pump's workers add from their threads
            self.bytes_sent += count

    def list(self) -> Sequence[StoredObject]:
        """Every object under the prefix, sub-folders' included (our marker left out)."""
        found: list[StoredObject] = []
        for items in self._pages(""):
            found += [item for item in map(self._listed, items) if item is not None]
        return found

    def _pages(self, under: str) -> Iterator[Sequence[Mapping[str, Any]]]:
        """The entries of each page of a listing of the prefix's `under`, within the remote
        reads' listing bounds."""
        params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.key(under)}
        bounds, pages = Listing(self.listing_seconds), Pages(self._display)
        with bounds.pages_of_this_thread():
            while True:
                page = self.call("", "list_objects_v2", **params)
                items = page.get("Contents", [])
                yield items
                token = page.get("NextContinuationToken")
                more = pages.more(bool(page.get("IsTruncated")), token)
                bounds.page(len(items), more=more)
                if not more:
                    return
                params["ContinuationToken"] = token

    def _listed(self, item: Mapping[str, Any]) -> StoredObject | None:
        key, size = item.get("Key"), item.get("Size")
        if not isinstance(key, str) or not key.startswith(self.prefix):
            raise UnexpectedAnswer("a listing entry outside the prefix asked for")
        if not isinstance(size, int) or size < 0:
            raise UnexpectedAnswer(f"a listing entry without a size ({key[:80]!r})")
        name = key[len(self.prefix) :]
        if is_marker(name):  # a run's, not an object of the output
            return None
        return StoredObject(name, size) if name else None

    def dangling(self, *, own: bool = False) -> Sequence[Dangling]:
        """Multipart uploads under the prefix never completed: ours if a record vouches for
        them (with `own`, the marker is this run's: no take-over to check)."""
        ours = set(self._records()) if own else self._taken_over()
        uploads: list[Dangling] = []
        params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix}
        pages = Pages(self._display)
        while True:
            page = self.call("", "list_multipart_uploads", **params)
            for item in page.get("Uploads", []):
                key, upload_id = item.get("Key"), item.get("UploadId")
                if not isinstance(key, str) or not isinstance(upload_id, str):
                    raise UnexpectedAnswer("a multipart upload without a key or an id")
                started = str(item["Initiated"]) if item.get("Initiated") else None
                name = key[len(self.prefix) :]
                mine = record_name(name, upload_id) in ours
                uploads.append(Dangling(name, upload_id, started, mine))
            markers = (page.get("NextKeyMarker"), page.get("NextUploadIdMarker"))
            if not pages.more(bool(page.get("IsTruncated")), markers):
                return uploads
            params["KeyMarker"], params["UploadIdMarker"] = markers

    def _taken_over(self) -> set[str]:
        """The records of an earlier run (record_name of each upload it started); a usage
        error for a marker without --force or --resume (its run may still be writing)."""
        stored = self.stat(MARKER)
        if stored is None:
            return set()
        if not (self.options.force or self.options.resume):
            raise UsageError(
                self.url_of(MARKER),
                "another ckptfix run is writing to this prefix, or was killed while it did "
                "(its marker is there)",
                "wait for it to end; or pass --force (or --resume) to take over: the uploads "
                "it recorded are aborted",
            )
        records = set(self._records())
        if 0 < stored.size <= MARKER_MAX:  # an older ckptfix kept its records in the marker
            legacy = recorded(self.read(MARKER, 0, stored.size))
            records |= {record_name(name, upload_id) for name, upload_id in legacy}
        return records

    def _records(self) -> Sequence[str]:
        """The records under the prefix (names relative to it), at most RECORDS_MAX."""
        found: list[str] = []
        for items in self._pages(RECORDS):
            found += [item.name for item in map(self._listed_record, items)]
            if len(found) > RECORDS_MAX:
                raise RemoteError(
                    self.url_of(RECORDS),
                    "remote-error",
                    f"holds more than {RECORDS_MAX:,} upload records, which no ckptfix run writes",
                    "delete that sub-prefix when no ckptfix run is writing, then run again",
                )
        return found

    def _listed_record(self, item: Mapping[str, Any]) -> StoredObject:
        key = item.get("Key")
        if not isinstance(key, str) or not key.startswith(self.key(RECORDS)):
            raise UnexpectedAnswer("a listing entry outside the prefix asked for")
        return StoredObject(key[len(self.prefix) :], 0)

    def abort_dangling(self, uploads: Iterable[Dangling]) -> None:
        """Abort the uploads, then delete their records."""
        uploads = list(uploads)
        for upload in uploads:
            self.abort_upload(upload.name, upload.upload_id)
        self.delete([record_name(upload.name, upload.upload_id) for upload in uploads])

    def abort_upload(self, name: str, upload_id: str) -> None:
        try:
            self.call(
                name, "abort_multipart_upload", Bucket=self.bucket, Key=self.key(name),
                UploadId=upload_id,
            )  # fmt: skip
        except RemoteError as exc:
            if exc.rule != "remote-not-found":  # already gone (NoSuchUpload)
                raise

    def stat(self, name: str) -> StoredObject | None:
        try:
            head = self.call(
                name, "head_object", Bucket=self.bucket, Key=self.key(name), ChecksumMode="ENABLED"
            )
        except RemoteError as exc:
            if exc.rule == "remote-not-found":
                return None
            raise
        size = head.get("ContentLength")
        if not isinstance(size, int) or size < 0:
            raise UnexpectedAnswer(f"HEAD of {name[:80]!r} without a size")
        # An object copied by `rename` has a SHA-256 (S3 computes it), the others a CRC-32.
        for algorithm in ("crc32", "sha256"):
            checksum = head.get(f"Checksum{algorithm.upper()}")
            if checksum:
                # A COMPOSITE checksum comes as "<base64>-<parts>" (S3) or without the count
                # (moto); the value covers the parts' checksums, so their number is in it.
                return StoredObject(name, size, (algorithm, str(checksum).partition("-")[0]))
        return StoredObject(name, size)

    def hasher(self, size: int) -> CompositeCrc32:
        return CompositeCrc32(size)

    def delete(self, names: Sequence[str]) -> None:
        for start in range(0, len(names), _DELETE_BATCH):
            batch = names[start : start + _DELETE_BATCH]
            answer = self.call(
                "",
                "delete_objects",
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": self.key(name)} for name in batch], "Quiet": True},
            )
            errors = answer.get("Errors") or []
            if errors:
                first = errors[0]
                raise RemoteError(
                    self.url_of(str(first.get("Key", ""))[len(self.prefix) :]),
                    "remote-error",
                    f"could not be deleted ({first.get('Code')}); {len(errors)} failed",
                    "check the credentials may delete objects, then run again",
                )

    def mark(self) -> None:
        """Put the marker (once per run) before anything else is uploaded."""
        if not self._marked:
            self._put_marker(self.marker.data())
            self._marked = True

    def record(self, name: str, upload_id: str) -> None:
        """An upload this run started, recorded before any part is sent: an object of its
        own (one small request, whatever the number of uploads before it)."""
        self._put_object(record_name(name, upload_id), self.marker.record(name, upload_id))

    def forget(self, name: str, upload_id: str) -> None:
        """The record of an upload this run completed or aborted: only uploads under way
        keep theirs."""
        self.delete([record_name(name, upload_id)])

    def _put_marker(self, data: bytes) -> None:
        """The marker is put but not read back: the tasks of one `--executor ray` run share
        the prefix and each puts its own, so what S3 then reports may be another task's."""
        self._put_object(MARKER, data)

    def begin(self, name: str, size: int) -> SingleUpload | MultipartUpload:
        self.mark()
        if size <= s3_part_size(size):
            return SingleUpload(self, name, size)
        return MultipartUpload(self, name, size)

    def put(self, name: str, data: bytes) -> StoredObject:
        """One PutObject with the object's CRC-32, compared with what S3 then reports."""
        digest = self._put_object(name, data)
        self.add_sent(len(data))
        return self.verify(name, len(data), ("crc32", digest))

    def _put_object(self, name: str, data: bytes) -> str:
        digest = _b64(crc32(data))
        self.call(
            name, "put_object", Bucket=self.bucket, Key=self.key(name), Body=data,
            ChecksumCRC32=digest, ChecksumAlgorithm="CRC32",
        )  # fmt: skip
        return digest

    def verify(self, name: str, size: int, checksum: tuple[str, str]) -> StoredObject:
        """The object as S3 reports it must have this size and checksum; one that does not
        is deleted (it was just written by this run) and the run fails."""
        stored = self.stat(name)
        if stored is not None and stored.size == size and stored.checksum == checksum:
            return stored
        what = (
            "is missing after its upload"
            if stored is None
            else f"is reported as {stored.size:,} bytes with {stored.checksum} where "
            f"{size:,} bytes with {checksum} were sent"
        )
        if stored is not None:
            self.delete([name])
        raise VerificationError(
            self.url_of(name),
            what,
            "check the endpoint (a proxy that alters uploads?), then run again",
        )

    def publish(
        self, files: Mapping[str, bytes], delete: Sequence[str], *, message: str
    ) -> Sequence[StoredObject]:
        """Put `files` in order (the caller puts the index last), delete `delete`, then the
        records (every process's of the run) and the marker: from the index on the output
        is complete."""
        stored = [self.put(name, data) for name, data in files.items()]
        self.delete([*delete, *self._records(), MARKER])
        self._marked = False
        return stored

    def rename(self, old: str, new: str, sha256: str) -> StoredObject:
        """CopyObject with the copy's SHA-256 computed by S3, compared with `sha256`; an
        object over MAX_COPY (what one CopyObject copies) is copied in parts (s3_copy);
        then `old` deleted."""
        stored = self.stat(old)
        if stored is None:
            raise VerificationError(self.url_of(old), "is missing after its upload", "run again")
        if stored.size > MAX_COPY:
            from ckptfix.write.stores.s3_copy import copy_multipart

            copied = copy_multipart(self, stored, new)
        else:
            self.call(
                new, "copy_object", Bucket=self.bucket, Key=self.key(new),
                CopySource={"Bucket": self.bucket, "Key": self.key(old)},
                ChecksumAlgorithm="SHA256",
            )  # fmt: skip
            copied = self.verify(new, stored.size, ("sha256", _b64(bytes.fromhex(sha256))))
        self.delete([old])
        return copied

    def read(self, name: str, start: int, end: int) -> bytes:
        answer = self.call(
            name, "get_object", Bucket=self.bucket, Key=self.key(name),
            Range=f"bytes={start}-{end - 1}",
        )  # fmt: skip
        body = answer["Body"]
        try:
            return bytes(body.read(end - start + 1))
        finally:
            body.close()

    def stats(self) -> UploadStats:
        return UploadStats(self.bytes_sent, self.session.stats()["requests"])


class SingleUpload:
    """An object of at most one part: held in memory, then one PutObject."""

    def __init__(self, store: S3Store, name: str, size: int) -> None:
        self.store, self.name, self.size = store, name, size
        self.data = bytearray()

    def send(self, data: bytes | memoryview) -> None:
        self.data += data
        _check_size(self.store, self.name, len(self.data), self.size, final=False)

    def flush(self) -> None:
        """Nothing is sent before `complete`: one PutObject is the whole upload."""

    def complete(self) -> StoredObject:
        _check_size(self.store, self.name, len(self.data), self.size, final=True)
        return self.store.put(self.name, bytes(self.data))

    def abort(self) -> None:
        self.data = bytearray()


class MultipartUpload:
    """A multipart upload: parts sent by a PartPump, each with its CRC-32."""

    def __init__(self, store: S3Store, name: str, size: int) -> None:
        self.store, self.name, self.size = store, name, size
        self.part = s3_part_size(size)
        answer = store.call(
            name, "create_multipart_upload", Bucket=store.bucket, Key=store.key(name),
            ChecksumAlgorithm="CRC32", ChecksumType="COMPOSITE",
        )  # fmt: skip
        self.upload_id = answer.get("UploadId")
        if not isinstance(self.upload_id, str) or not self.upload_id:
            raise UnexpectedAnswer("CreateMultipartUpload without an UploadId")
        store.record(name, self.upload_id)
        concurrency = in_flight(self.part, store.options.concurrency, store.options.max_in_flight)
        self.pump: PartPump[dict[str, Any]] = PartPump(self._part, self.part, concurrency)
        self.fed = 0
        self.done = False

    def send(self, data: bytes | memoryview) -> None:
        self.fed += len(data)
        _check_size(self.store, self.name, self.fed, self.size, final=False)
        self.pump.feed(data)

    def _part(self, number: int, data: bytearray) -> dict[str, Any]:
        digest = _b64(crc32(data))
        answer = self.store.call(
            self.name, "upload_part", Bucket=self.store.bucket, Key=self.store.key(self.name),
            UploadId=self.upload_id, PartNumber=number, Body=data, ChecksumCRC32=digest,
        )  # fmt: skip
        etag = answer.get("ETag")
        if not isinstance(etag, str):
            raise UnexpectedAnswer(f"UploadPart {number} without an ETag")
        self.store.add_sent(len(data))
        return {"PartNumber": number, "ETag": etag, "ChecksumCRC32": digest}

    def flush(self) -> None:
        _check_size(self.store, self.name, self.fed, self.size, final=True)
        self.pump.finish()

    def complete(self) -> StoredObject:
        _check_size(self.store, self.name, self.fed, self.size, final=True)
        parts = self.pump.finish()
        checksum = composite([base64.b64decode(part["ChecksumCRC32"]) for part in parts])
        self.store.call(
            self.name, "complete_multipart_upload", Bucket=self.store.bucket,
            Key=self.store.key(self.name), UploadId=self.upload_id,
            MultipartUpload={"Parts": parts},
        )  # fmt: skip
        self.done = True
        self.store.forget(self.name, self.upload_id)  # nothing left to abort
        return self.store.verify(self.name, self.size, checksum)

    def abort(self) -> None:
        self.pump.close()
        if not self.done:
            self.done = True
            self.store.abort_upload(self.name, str(self.upload_id))
            self.store.forget(self.name, str(self.upload_id))


def _check_size(store: S3Store, name: str, fed: int, size: int, *, final: bool) -> None:
    if fed > size or (final and fed != size):
        raise VerificationError(
            store.url_of(name),
            f"{fed:,} bytes were produced for an object planned as {size:,}",
            "this is a bug; please report it",
        )
