from __future__ import annotations

import struct

import pytest

from ckptfix.formats import FORMATS


def name(head: bytes) -> str:
    fmt = FORMATS.sniff(head)
    return fmt.name if fmt is not None else "unknown"


@pytest.mark.parametrize("length", [8, 127, 128, 0x80 + 256, 0x8080, 99_999_999])
def test_safetensors_whose_length_starts_with_the_pickle_byte(length: int) -> None:
    assert name(struct.pack("<Q", length) + b"{}") == "safetensors"


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19.", "torch-legacy"),
        (b"\x80\x04\x95{\x00\x00\x00\x00\x00\x00\x00}", "torch-legacy"),
        (b"PK\x03\x04\x00\x00\x08\x08", "torch-zip"),
        (b"version https://git-lfs.github.com/spec/v1\n", "lfs-pointer"),
        (struct.pack("<Q", 16) + b"   {", "safetensors"),
        (struct.pack("<Q", 0) + b"{", "unknown"),
        (b"hello world, not a checkpoint", "unknown"),
    ],
)
def test_sniff(head: bytes, expected: str) -> None:
    assert name(head) == expected
