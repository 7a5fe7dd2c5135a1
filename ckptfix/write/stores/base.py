"""What a rewrite asks of an object store it writes to: the protocol every store backend
(S3, GCS, the Hub) implements, and the records they return.

The writer above a store streams each output file into an `ObjectUpload` (S3 multipart, GCS
resumable or composed uploads, a Hub LFS upload) and never holds more than the parts in
flight; the store computes each object's checksum while the bytes pass and compares it with
what the store reports for the completed object. Nothing a loader would take as complete is
visible before `publish()`: shards are uploaded under their final names only where a missing
index (or the single file's own atomic completion) keeps them from being a checkpoint, and the
index, or the Hub's one commit, comes last.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class StoredObject:
    """An object under the output prefix: its name relative to the prefix, size in bytes and
    the checksum the store reports (algorithm as `sha256`, `crc32c`, `crc32`, or `md5`;
    base64 or hex as the store gives it, compared only with the same encoding), if any."""

    name: str
    size: int
    checksum: tuple[str, str] | None = None


@dataclass(frozen=True)
class UploadStats:
    """What a store sent: bytes of object data, requests made, bytes kept by --resume."""

    bytes_sent: int = 0
    requests: int = 0
    bytes_kept: int = 0


@dataclass(frozen=True)
class Dangling:
    """An upload started and never completed or aborted (a killed run): its object name and
    the store's id for it."""

    name: str
    upload_id: str
    started: str | None = None  # the store's timestamp, as text
    ours: bool = False  # started by a ckptfix run (the store's own marker says so)


class ObjectHash(Protocol):
    """The checksum a store reports for an object, computed over bytes fed in order: what
    --resume compares an existing object with, without sending anything."""

    def update(self, data: bytes | memoryview) -> None: ...

    def value(self) -> tuple[str, str]:
        """(algorithm, value) as `StoredObject.checksum` gives them for the same bytes."""


class ObjectUpload(Protocol):
    """One object being streamed. `send` takes the object's bytes in order (any chunk sizes;
    the upload cuts them into parts and sends up to its concurrency at once, blocking while
    that many are in flight). `complete` returns the object as the store reports it, after
    comparing its checksum with the one computed while streaming (a mismatch is a
    `VerificationError`). `abort` is safe to call at any time, more than once."""

    def send(self, data: bytes | memoryview) -> None: ...

    def flush(self) -> None:
        """Send what is left and wait until the store has every byte; the object is still
        not visible (a writer that completes it later, at publication, waits here first,
        where a signal may still stop it)."""

    def complete(self) -> StoredObject: ...

    def abort(self) -> None: ...


class ObjectStore(Protocol):
    """An output prefix in a store. Errors are one-line `CkptfixError`s (the remote reads'
    wording: credentials, 403, 404, quota, network, a missing bucket); URLs in messages are
    redacted."""

    @property
    def display(self) -> str:
        """The output URL as it may be printed (no credentials)."""

    def list(self) -> Sequence[StoredObject]:
        """Every object under the prefix (bounded as the remote reads bound listings)."""

    def dangling(self, *, own: bool = False) -> Sequence[Dangling]:
        """Uploads under the prefix started and never completed (none for stores without).
        `own`: the run's own marker is there (its Ray tasks put it), not another run's."""

    def abort_dangling(self, uploads: Iterable[Dangling]) -> None: ...

    def stat(self, name: str) -> StoredObject | None:
        """One object with the checksum the store holds for it (None if there is none)."""

    def hasher(self, size: int) -> ObjectHash:
        """A new ObjectHash for an object of `size` bytes (a composite checksum depends on
        the part size, which depends on the size)."""

    def delete(self, names: Sequence[str]) -> None:
        """Delete objects now, before `publish` (an earlier index that would otherwise point
        at shards being replaced). Stores that publish by one commit (the Hub) may make it
        part of that commit instead."""

    def begin(self, name: str, size: int) -> ObjectUpload:
        """Start streaming object `name` of exactly `size` bytes (the part size is chosen from
        it and the store's part-count limit)."""

    def publish(
        self, files: Mapping[str, bytes], delete: Sequence[str], *, message: str
    ) -> Sequence[StoredObject]:
        """Make the output visible: put the small `files` (the index last) and then delete
        `delete` (the earlier checkpoint's objects the new one does not hold). On the Hub,
        everything uploaded since `begin` plus `files` and `delete` is one commit (or pull
        request), `message` its title."""

    def rename(self, old: str, new: str, sha256: str) -> StoredObject:
        """Give a complete object that nothing lists yet its final name (`ckptfix.Writer`
        learns its shards' names last): a server-side copy (S3 CopyObject, or UploadPartCopy
        parts above 5 GiB; Cloud Storage compose of one source) checked against `sha256` (hex, of the object's bytes) or the
        store's checksum of `old`, then `old` deleted; on the Hub, the path the commit gives
        the uploaded file. Nothing is sent again."""

    def read(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a stored object (for --verify-readback)."""

    def stats(self) -> UploadStats: ...


@dataclass(frozen=True)
class StoreOptions:
    """How a rewrite writes to a store (the CLI's --upload-concurrency, --verify-readback,
    --hf-pr, --resume)."""

    concurrency: int = 8  # parts in flight per store
    max_in_flight: int = 256 * 2**20  # bytes of parts held at once
    verify_readback: bool = False
    resume: bool = False
    hf_pr: bool = False
    # --force: the prefix's objects may be replaced. --resume without it replaces nothing:
    # it keeps the objects that match the plan and refuses a prefix holding any other.
    force: bool = False
    extra: Mapping[str, str] = field(default_factory=dict)
