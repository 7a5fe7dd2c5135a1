"""The digest as docs/hash.md defines it, computed here with hashlib over bytes torch produces:
the oracle the hash and diff tests compare ckptfix against (no ckptfix code involved)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch dtype (its name, so importing the oracle does not import torch) -> safetensors name,
# written out here rather than taken from ckptfix's table.
NAMES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "complex64": "C64",
}


def u64(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}Q", *values)


def fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A row-major copy with standard strides (.contiguous() keeps the odd stride of a size-1
    dimension, which dtype views refuse)."""
    import torch

    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.detach())


def row_major(tensor: torch.Tensor) -> bytes:
    """The tensor's logical bytes, row-major, as torch lays them out contiguously."""
    import torch

    return fresh(tensor).reshape(-1).view(torch.uint8).numpy().tobytes()


def content(dtype: str, shape: tuple[int, ...], data: bytes) -> bytes:
    header = u64(len(dtype)) + dtype.encode() + u64(len(shape), *shape)
    return hashlib.sha256(header + data).digest()


def named(name: str, content_digest: bytes) -> bytes:
    encoded = name.encode("utf-8", "surrogatepass")
    return hashlib.sha256(u64(len(encoded)) + encoded + content_digest).digest()


def tensor_digests(state: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    return {
        name: named(
            name, content(NAMES[str(t.dtype).removeprefix("torch.")], tuple(t.shape), row_major(t))
        )
        for name, t in state.items()
    }


def model(digests: Mapping[str, bytes]) -> str:
    ordered = sorted(digests, key=lambda name: name.encode("utf-8", "surrogatepass"))
    return hashlib.sha256(b"".join(digests[name] for name in ordered)).hexdigest()


def digest(state: Mapping[str, torch.Tensor]) -> str:
    """The model digest of a state dict."""
    return model(tensor_digests(state))


def hash_json(document: Any) -> dict[str, str]:
    """name -> digest of a `hash --json` document."""
    return {name: entry["digest"] for name, entry in document["tensors"].items()}
