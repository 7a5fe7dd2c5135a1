"""Decide a file's format from its first bytes, never from its extension alone."""

from __future__ import annotations

import struct
from enum import Enum


class FileFormat(str, Enum):
    SAFETENSORS = "safetensors"
    TORCH_ZIP = "torch-zip"
    TORCH_LEGACY = "torch-legacy"
    LFS_POINTER = "lfs-pointer"
    INDEX = "index"
    UNKNOWN = "unknown"


LFS_MAGIC = b"version https://git-lfs"
ZIP_MAGIC = b"PK\x03\x04"
PICKLE_PROTO = 0x80
SNIFF_BYTES = 64
MAX_HEADER_SIZE = 100_000_000  # as in formats.safetensors (kept here to stay import-free)


def sniff(head: bytes) -> FileFormat:
    """Classify a file by its first bytes (pass at least SNIFF_BYTES of them when available)."""
    if head.startswith(LFS_MAGIC):
        return FileFormat.LFS_POINTER
    if head.startswith(ZIP_MAGIC):
        return FileFormat.TORCH_ZIP
    # safetensors before pickle: a header length such as 128 starts with the byte 0x80, the
    # pickle protocol marker. A pickle's first 8 bytes, read as a length, are far too large.
    if len(head) >= 9:
        (header_len,) = struct.unpack("<Q", head[:8])
        # The writer pads the header with spaces, and the reference reader accepts
        # leading JSON whitespace, so skip it before looking for the opening brace.
        body = head[8:].lstrip(b" \t\r\n")
        if 0 < header_len <= MAX_HEADER_SIZE and body[:1] == b"{":
            return FileFormat.SAFETENSORS
    if head[:1] == bytes([PICKLE_PROTO]):
        return FileFormat.TORCH_LEGACY
    return FileFormat.UNKNOWN


def describe(fmt: FileFormat) -> str:
    return {
        FileFormat.SAFETENSORS: "a safetensors file",
        FileFormat.TORCH_ZIP: "a zip archive (PyTorch checkpoint)",
        FileFormat.TORCH_LEGACY: "a pickle (legacy PyTorch checkpoint)",
        FileFormat.LFS_POINTER: "a Git LFS pointer",
        FileFormat.INDEX: "a shard index",
        FileFormat.UNKNOWN: "not a recognised checkpoint format",
    }[fmt]


def sniff_path(path: str) -> FileFormat:
    """sniff() on a file's first bytes; UNKNOWN when it cannot be read."""
    try:
        with open(path, "rb") as handle:
            return sniff(handle.read(SNIFF_BYTES))
    except OSError:
        return FileFormat.UNKNOWN
