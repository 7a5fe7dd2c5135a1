"""What a write produced: files, sizes, verification, what it replaced."""

from __future__ import annotations

# Called with (bytes copied so far, bytes to copy in all) as the copy advances.
from collections.abc import Callable
from dataclasses import dataclass

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class WrittenFile:
    path: str
    bytes: int

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "bytes": self.bytes}


@dataclass(frozen=True)
class WriteResult:
    """What a write command produced: the final paths and sizes, and what it replaced."""

    path: str
    files: tuple[WrittenFile, ...]
    verified: bool
    # What the write deleted: the old OUT's top-level entries (--force), or the old files of
    # the folder that were not carried over (--in-place).
    replaced: tuple[str, ...] = ()

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
        }
