"""How object-store uploads cut a stream into parts (write.stores.parts), the checksum S3
reports for them (write.stores.s3_checksum.CompositeCrc32), and the parts a copy over S3's
5 GiB CopyObject is cut into (write.stores.s3_copy), without a server."""

from __future__ import annotations

import base64
import binascii
import hashlib
import threading
from typing import Any

import pytest

from ckptfix.write.stores.parts import MIB, PartPump, in_flight, part_size
from ckptfix.write.stores.s3_checksum import MAX_PARTS, MIN_PART, CompositeCrc32, s3_part_size
from tests.optional import needs
from tests.remote_servers import S3_ENV

GIB = 2**30


@pytest.mark.parametrize("size", [0, 1, 5 * MIB, 16 * MIB + 1, 160 * 2**30, 5 * 2**40])
def test_parts_stay_within_the_part_count_limit(size: int) -> None:
    part = s3_part_size(size)
    assert part >= MIN_PART and part % MIB == 0
    assert -(-size // part) <= MAX_PARTS
    assert part_size(size, max_parts=MAX_PARTS, minimum=MIN_PART, preferred=MIB) <= max(
        part, MIN_PART
    )


def test_parts_in_flight_keep_within_the_byte_bound() -> None:
    assert in_flight(16 * MIB, 8, 256 * MIB) == 8
    assert in_flight(64 * MIB, 8, 256 * MIB) == 3  # and one being filled: 256 MiB
    assert in_flight(512 * MIB, 8, 256 * MIB) == 1  # alone, over the bound


def test_the_pump_sends_every_byte_in_order_from_a_fixed_set_of_buffers() -> None:
    data = bytes(range(256)) * 4099  # not a multiple of the part size
    sent: dict[int, bytes] = {}
    buffers: set[int] = set()
    lock = threading.Lock()

    def send(number: int, chunk: bytearray) -> int:
        with lock:
            sent[number] = bytes(chunk)
            buffers.add(id(chunk))
        return number

    pump = PartPump(send, part=10_000, concurrency=3)
    for start in range(0, len(data), 7_777):
        pump.feed(memoryview(data)[start : start + 7_777])
    assert pump.finish() == list(range(1, len(sent) + 1))
    assert b"".join(sent[n] for n in sorted(sent)) == data
    assert all(len(sent[n]) == 10_000 for n in sorted(sent)[:-1])
    assert len(buffers) <= 4 + 1  # 4 buffers, and the short last part's own copy


def test_a_failed_part_stops_the_stream() -> None:
    def send(number: int, chunk: bytearray) -> int:
        if number == 2:
            raise OSError("refused")
        return number

    pump = PartPump(send, part=10, concurrency=1)
    with pytest.raises(OSError, match="refused"):
        for _ in range(100):
            pump.feed(b"x" * 10)
        pump.finish()
    pump.close()


@pytest.mark.parametrize("size", [1000, 16 * MIB, 16 * MIB + 1, 40 * MIB + 3])
def test_the_composite_checksum_is_the_one_s3_computes(size: int) -> None:
    data = hashlib.sha256(b"seed").digest() * (size // 32) + b"z" * (size % 32)
    hasher = CompositeCrc32(size)
    for start in range(0, size, 3 * MIB + 5):
        hasher.update(data[start : start + 3 * MIB + 5])
    part = s3_part_size(size)

    def crc(chunk: bytes) -> bytes:
        return binascii.crc32(chunk).to_bytes(4, "big")

    if size <= part:  # one PutObject: the whole object's CRC-32
        want = base64.b64encode(crc(data)).decode()
    else:  # S3's COMPOSITE: the CRC-32 of the parts' CRC-32s, 4 bytes each, big-endian
        crcs = [crc(data[i : i + part]) for i in range(0, size, part)]
        want = base64.b64encode(crc(b"".join(crcs))).decode()
    assert hasher.value() == ("crc32", want)


def _renamed(size: int, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """The requests S3Store.rename makes for a provisional shard of `size` bytes (S3's
    answers stood in for: nothing of that size is sent anywhere)."""
    from ckptfix.write.stores.base import StoredObject, StoreOptions
    from ckptfix.write.stores.s3 import S3Store
    from ckptfix.write.stores.s3_checksum import b64

    for name, value in {**S3_ENV, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}.items():
        monkeypatch.setenv(name, value)
    store = S3Store("s3://bucket/out", StoreOptions())
    digest = hashlib.sha256(b"the shard").digest()
    calls: list[tuple[str, dict[str, Any]]] = []
    lock = threading.Lock()

    def call(name: str, operation: str, **parameters: Any) -> Any:
        with lock:
            calls.append((operation, parameters))
        if operation == "create_multipart_upload":
            return {"UploadId": "the-upload"}
        return {"CopyPartResult": {"ETag": '"etag"'}} if operation == "upload_part_copy" else {}

    monkeypatch.setattr(store, "call", call)
    monkeypatch.setattr(
        store, "stat", lambda name: StoredObject(name, size, ("sha256", b64(digest)))
    )
    store.rename(".ckptfix-shard-00001.safetensors", "model.safetensors", digest.hex())
    return calls


@needs("botocore")
def test_a_shard_of_5_gib_is_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _renamed(5 * GIB, monkeypatch)
    assert [operation for operation, _ in calls] == ["copy_object", "delete_objects"]


@needs("botocore")
@pytest.mark.parametrize(
    "size", [5 * GIB + 1, pytest.param(5 * 2**40, marks=pytest.mark.slow)], ids=["5GiB+1", "5TiB"]
)
def test_a_shard_over_5_gib_is_copied_in_parts_within_s3s_limits(
    size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _renamed(size, monkeypatch)
    operations = [operation for operation, _ in calls]
    assert operations[0] == "create_multipart_upload" and "copy_object" not in operations
    ranges = sorted(
        (parameters["PartNumber"], parameters["CopySourceRange"])
        for operation, parameters in calls
        if operation == "upload_part_copy"
    )
    assert 1 < len(ranges) <= 10_000 and [n for n, _ in ranges] == list(range(1, len(ranges) + 1))
    spans = [tuple(map(int, text.removeprefix("bytes=").split("-"))) for _, text in ranges]
    assert spans[0][0] == 0 and spans[-1][1] == size - 1
    assert all(spans[i][1] + 1 == spans[i + 1][0] for i in range(len(spans) - 1))
    assert all(end - start + 1 <= 5 * GIB for start, end in spans)
    completed = [p for operation, p in calls if operation == "complete_multipart_upload"]
    assert len(completed[0]["MultipartUpload"]["Parts"]) == len(ranges)
    assert operations[-1] == "delete_objects"  # the provisional name, once the copy is checked
