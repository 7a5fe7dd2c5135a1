"""The checksum S3 reports for an object uploaded as s3.S3Store uploads it (see s3's module
docstring): the whole object's CRC-32 for one PutObject; for a multipart upload, the
COMPOSITE value (the CRC-32 of the parts' CRC-32s, 4 bytes each, big-endian). The part size
depends only on the object's size, so --resume (and a copy cut where the source's parts
were, s3_copy) knows the value an object must have without sending anything."""

from __future__ import annotations

import base64
import zlib
from collections.abc import Sequence

from ckptfix.write.stores.parts import part_size

MIN_PART = 5 * 2**20  # S3's smallest part but the last
MAX_PARTS = 10_000


def s3_part_size(size: int) -> int:
    return part_size(size, max_parts=MAX_PARTS, minimum=MIN_PART)


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def crc32(data: bytes | bytearray | memoryview) -> bytes:
    """The CRC-32 S3 reports for these bytes: 4 bytes, big-endian."""
    return zlib.crc32(data).to_bytes(4, "big")


def composite(crcs: Sequence[bytes]) -> tuple[str, str]:
    """The checksum S3 reports for a multipart upload of parts with these CRC-32s."""
    return ("crc32", b64(crc32(b"".join(crcs))))


class CompositeCrc32:
    """The checksum S3 reports for an object of `size` bytes uploaded as s3.S3Store does
    (see the module docstring)."""

    def __init__(self, size: int) -> None:
        self.part = s3_part_size(size)
        self.single = size <= self.part
        self.running = 0  # the CRC-32 of the part being filled
        self.crcs: list[bytes] = []
        self.filled = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self.single:
            self.running = zlib.crc32(view, self.running)
            return
        while len(view):
            take = min(self.part - self.filled, len(view))
            self.running = zlib.crc32(view[:take], self.running)
            view, self.filled = view[take:], self.filled + take
            if self.filled == self.part:
                self._close_part()

    def _close_part(self) -> None:
        self.crcs.append(self.running.to_bytes(4, "big"))
        self.running, self.filled = 0, 0

    def value(self) -> tuple[str, str]:
        if self.single:
            return ("crc32", b64(self.running.to_bytes(4, "big")))
        return composite(self.crcs + ([self.running.to_bytes(4, "big")] if self.filled else []))
