"""Giving an S3 object larger than one CopyObject takes (5 GiB) another name: a multipart
upload whose parts are UploadPartCopy requests, each a range of the source copied on the
server (nothing is sent again).

The parts are cut where the source's were (s3_part_size of its size: within S3's 10,000
parts, and never over its 5 GiB part), so each copied part holds the same bytes as the
source's part of that number and the copy's COMPOSITE checksum (of the source's algorithm:
CRC-32 as ckptfix uploads) is the source's, which was checked against the bytes streamed
when the source was completed (a source of one part, put whole, has the checksum of the bytes
streamed; its copy, the checksum of that checksum). The copy is compared with it as every
upload is compared with what was sent. The upload is recorded like any other
(s3_marker), and aborted if anything fails.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ckptfix.core.errors import VerificationError
from ckptfix.io.remote_errors import UnexpectedAnswer
from ckptfix.write.stores.base import StoredObject
from ckptfix.write.stores.s3_checksum import b64, crc32, s3_part_size

if TYPE_CHECKING:
    from ckptfix.write.stores.s3 import S3Store

MAX_PART = 5 * 2**30  # S3's largest part (of an upload or a copied range)


def copy_ranges(size: int, part: int) -> list[tuple[int, int, int]]:
    """(part number, first byte, end) of each part of an object of `size` bytes."""
    return [(n + 1, start, min(start + part, size)) for n, start in enumerate(range(0, size, part))]


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# a checksum as StoredObject names it -> (S3's name for it, the function)
_ALGORITHMS: dict[str, tuple[str, Callable[[bytes], bytes]]] = {
    "crc32": ("CRC32", crc32),
    "sha256": ("SHA256", _sha256),
}


def copy_multipart(store: S3Store, old: StoredObject, new: str) -> StoredObject:
    """`old` copied to `new` (see the module docstring)."""
    part = s3_part_size(old.size)
    assert part <= MAX_PART
    if old.checksum is None or old.checksum[0] not in _ALGORITHMS:
        raise VerificationError(
            store.url_of(old.name),
            "is reported without the checksum it was uploaded with: its copy cannot be checked",
            "check the endpoint keeps checksums (ChecksumMode), then run again",
        )
    algorithm, value = old.checksum
    s3_name, function = _ALGORITHMS[algorithm]
    expected = old.checksum
    if old.size <= part:  # one part: the copy's is the checksum of the source's
        expected = (algorithm, b64(function(base64.b64decode(value))))
    answer = store.call(
        new, "create_multipart_upload", Bucket=store.bucket, Key=store.key(new),
        ChecksumAlgorithm=s3_name, ChecksumType="COMPOSITE",
    )  # fmt: skip
    upload_id = answer.get("UploadId")
    if not isinstance(upload_id, str) or not upload_id:
        raise UnexpectedAnswer("CreateMultipartUpload without an UploadId")
    store.record(new, upload_id)
    try:
        parts = _copy_parts(store, old, (new, upload_id, s3_name), part)
        store.call(
            new, "complete_multipart_upload", Bucket=store.bucket, Key=store.key(new),
            UploadId=upload_id, MultipartUpload={"Parts": parts},
        )  # fmt: skip
    except BaseException:
        store.abort_upload(new, upload_id)
        store.forget(new, upload_id)
        raise
    store.forget(new, upload_id)
    return store.verify(new, old.size, expected)


def _copy_parts(
    store: S3Store, old: StoredObject, copy: tuple[str, str, str], part: int
) -> list[dict[str, Any]]:
    """Every range copied, up to the store's concurrency at once; the first failure stops
    the others (those not started are dropped)."""
    pool = ThreadPoolExecutor(store.options.concurrency, thread_name_prefix="ckptfix-copy")
    try:
        futures = [
            pool.submit(_copy_part, store, (old.name, *copy), number, start, end)
            for number, start, end in copy_ranges(old.size, part)
        ]
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _copy_part(
    store: S3Store, names: tuple[str, str, str, str], number: int, start: int, end: int
) -> dict[str, Any]:
    old, new, upload_id, algorithm = names
    answer = store.call(
        new, "upload_part_copy", Bucket=store.bucket, Key=store.key(new), UploadId=upload_id,
        PartNumber=number, CopySource={"Bucket": store.bucket, "Key": store.key(old)},
        CopySourceRange=f"bytes={start}-{end - 1}",
    )  # fmt: skip
    result = answer.get("CopyPartResult") or {}
    etag = result.get("ETag")
    if not isinstance(etag, str):
        raise UnexpectedAnswer(f"UploadPartCopy {number} without an ETag")
    done: dict[str, Any] = {"PartNumber": number, "ETag": etag}
    checksum = result.get(f"Checksum{algorithm}")  # S3 gives the part's when the upload has one
    if isinstance(checksum, str):
        done[f"Checksum{algorithm}"] = checksum
    return done
