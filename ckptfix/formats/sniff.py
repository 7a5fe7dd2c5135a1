"""What each file format's first bytes look like: the registry tries these in order and
imports a format's module only for a file that is of it (inspect of a GGUF loads none of the
pickle readers)."""

from __future__ import annotations

import struct

GGUF_MAGIC = b"GGUF"
LFS_MAGIC = b"version https://git-lfs"
SAFETENSORS_MAX_HEADER = 100_000_000  # bytes of JSON header, as the reference reader allows


def gguf(head: bytes) -> bool:
    return head.startswith(GGUF_MAGIC)


def lfs_pointer(head: bytes) -> bool:
    return head.startswith(LFS_MAGIC)


def safetensors(head: bytes) -> bool:
    # Before pickle: a header length such as 128 starts with the byte 0x80, the pickle
    # protocol marker. The writer pads the header with spaces, and the reference reader
    # accepts leading JSON whitespace, so skip it before looking for the opening brace.
    if len(head) < 9:
        return False
    (header_len,) = struct.unpack("<Q", head[:8])
    return 0 < header_len <= SAFETENSORS_MAX_HEADER and head[8:].lstrip(b" \t\r\n")[:1] == b"{"


def tar(head: bytes) -> bool:
    return head[257:262] == b"ustar"  # POSIX tar's magic, after the first member's name


def torch_legacy(head: bytes) -> bool:
    return head[:1] == b"\x80"  # a pickle's protocol marker


def torch_zip(head: bytes) -> bool:
    return head.startswith(b"PK\x03\x04")


# (name, module, sniff) in the order they are tried: safetensors before the pickle.
FILE_FORMATS = (
    ("gguf", "ckptfix.formats.gguf", gguf),
    ("lfs-pointer", "ckptfix.formats.lfs", lfs_pointer),
    ("safetensors", "ckptfix.formats.safetensors", safetensors),
    ("tar", "ckptfix.formats.tar", tar),
    ("torch-legacy", "ckptfix.formats.torch_legacy", torch_legacy),
    ("torch-zip", "ckptfix.formats.torch_zip", torch_zip),
)
