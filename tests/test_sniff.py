from __future__ import annotations

import struct

import pytest

from ckptfix.sniff import FileFormat, sniff


@pytest.mark.parametrize("length", [8, 127, 128, 0x80 + 256, 0x8080, 99_999_999])
def test_safetensors_whose_length_starts_with_the_pickle_byte(length: int) -> None:
    assert sniff(struct.pack("<Q", length) + b"{}") is FileFormat.SAFETENSORS


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19.", FileFormat.TORCH_LEGACY),
        (b"\x80\x04\x95{\x00\x00\x00\x00\x00\x00\x00}", FileFormat.TORCH_LEGACY),
        (b"PK\x03\x04\x00\x00\x08\x08", FileFormat.TORCH_ZIP),
        (b"version https://git-lfs.github.com/spec/v1\n", FileFormat.LFS_POINTER),
        (struct.pack("<Q", 16) + b"   {", FileFormat.SAFETENSORS),
        (struct.pack("<Q", 0) + b"{", FileFormat.UNKNOWN),
        (b"hello world, not a checkpoint", FileFormat.UNKNOWN),
    ],
)
def test_sniff(head: bytes, expected: FileFormat) -> None:
    assert sniff(head) is expected
