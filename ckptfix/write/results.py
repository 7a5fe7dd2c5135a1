"""What a write produced: files, sizes, verification, what it replaced."""

from __future__ import annotations

# Called with (bytes copied so far, bytes to copy in all) as the copy advances.
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class WrittenFile:
    path: str
    bytes: int

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "bytes": self.bytes}


@dataclass(frozen=True)
class ByteAccount:
    """How a safetensors write placed its tensor bytes and how it verified them.

    `block` is the clone block of the output's filesystem, None where the sources do not
    clone into it (no reflinks, another filesystem): then nothing is cloned or padded.
    `verified_by` counts tensor bytes by the way they were proven equal to their source:
    `extents` (the output maps them to the same physical blocks as the source: they are the
    source's bytes), `compared` (read back and compared byte for byte), `digest` (cast or
    gathered tensors: read back and compared with the digest of what was produced)."""

    block: int | None
    cloned: int  # tensor bytes shared with the source, not copied
    copied: int  # tensor bytes written
    padding: int  # spaces added after the headers to line the data up with the source's blocks
    verified_by: Mapping[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {
            "block": self.block,
            "cloned": self.cloned,
            "copied": self.copied,
            "padding": self.padding,
        }


@dataclass(frozen=True)
class UploadReport:
    """What a write to an object store sent and did under the prefix (write.store_output)."""

    bytes_sent: int  # object bytes sent, parts sent again after a failure included
    requests: int  # every request made to the store, listings and checks included
    bytes_kept: int = 0  # --resume: bytes of objects already there, not sent again
    kept: tuple[str, ...] = ()  # --resume: those objects
    removed_first: tuple[str, ...] = ()  # an earlier index, deleted before its shards
    aborted: tuple[str, ...] = ()  # uploads a killed ckptfix run left, aborted
    left: tuple[str, ...] = ()  # uploads under the prefix that are not ckptfix's, left alone
    read_back: bool = False  # --verify-readback: every object read back and hashed again

    def to_dict(self) -> dict[str, object]:
        return {
            "bytes_sent": self.bytes_sent,
            "requests": self.requests,
            "bytes_kept": self.bytes_kept,
            "kept": list(self.kept),
            "removed_first": list(self.removed_first),
            "aborted_uploads": list(self.aborted),
            "other_uploads": list(self.left),
            "read_back": self.read_back,
        }


@dataclass(frozen=True)
class WriteResult:
    """What a write command produced: the final paths and sizes, and what it replaced."""

    path: str
    files: tuple[WrittenFile, ...]
    verified: bool
    # What the write deleted: the old OUT's top-level entries (--force), or the old files of
    # the folder that were not carried over (--in-place).
    replaced: tuple[str, ...] = ()
    # safetensors output only (None for torch output): cloned and copied bytes, and how
    # every tensor byte was verified
    account: ByteAccount | None = None
    upload: UploadReport | None = None  # an object-store output only

    @property
    def bytes(self) -> int:
        return sum(item.bytes for item in self.files)

    def to_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "files": [item.to_dict() for item in self.files],
            "bytes": self.bytes,
            "verified": self.verified,
            "replaced": list(self.replaced),
            "verified_by": dict(self.account.verified_by) if self.account else None,
            "zero_copy": self.account.to_dict() if self.account else None,
            "upload": self.upload.to_dict() if self.upload else None,
        }
