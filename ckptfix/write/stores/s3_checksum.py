"""The SHA-256 S3 reports for an object uploaded as s3.S3Store uploads it (see s3's module
docstring): the whole object's for one PutObject; for a multipart upload, the COMPOSITE
value (the SHA-256 of the parts' digests). The part size depends only on the object's size,
so --resume (and a copy cut where the source's parts were, s3_copy) knows the value an
object must have without sending anything."""

from __future__ import annotations

import base64
import hashlib

from ckptfix.write.stores.parts import part_size

MIN_PART = 5 * 2**20  # S3's smallest part but the last
MAX_PARTS = 10_000


def s3_part_size(size: int) -> int:
    return part_size(size, max_parts=MAX_PARTS, minimum=MIN_PART)


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


class CompositeSha256:
    """The checksum S3 reports for an object of `size` bytes uploaded as s3.S3Store does
    (see the module docstring)."""

    def __init__(self, size: int) -> None:
        self.part = s3_part_size(size)
        self.single = size <= self.part
        self.whole = hashlib.sha256()
        self.digests: list[bytes] = []
        self.filled = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self.single:
            self.whole.update(view)
            return
        while len(view):
            take = min(self.part - self.filled, len(view))
            self.whole.update(view[:take])
            view, self.filled = view[take:], self.filled + take
            if self.filled == self.part:
                self._close_part()

    def _close_part(self) -> None:
        self.digests.append(self.whole.digest())
        self.whole, self.filled = hashlib.sha256(), 0

    def value(self) -> tuple[str, str]:
        if self.single:
            return ("sha256", b64(self.whole.digest()))
        digests = self.digests + ([self.whole.digest()] if self.filled else [])
        return ("sha256", b64(hashlib.sha256(b"".join(digests)).digest()))
