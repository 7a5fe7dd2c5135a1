"""dtype casts for `convert --dtype`: floating tensors only, with torch (bf16 and fp8 have no
numpy dtype). torch is imported here and nowhere else on the convert path."""

from __future__ import annotations

from ckptfix.errors import UsageError

CAST_TARGETS = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
_TORCH_NAMES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}
TORCH_NAMES = {
    **_TORCH_NAMES,
    "I8": "int8",
    "U8": "uint8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "BOOL": "bool",
    "C64": "complex64",
}


def cast_bytes(data: bytes, source: str, target: str) -> bytes:
    """Cast raw little-endian elements from one floating dtype to another (round to nearest)."""
    try:
        import torch
    except ImportError as exc:
        raise UsageError("--dtype", "casting needs torch installed", "pip install torch") from exc
    if source not in _TORCH_NAMES or target not in _TORCH_NAMES:
        raise UsageError(
            "--dtype", f"cannot cast {source} to {target}", "cast floating dtypes only"
        )
    if not data:
        return b""
    values = torch.frombuffer(bytearray(data), dtype=getattr(torch, _TORCH_NAMES[source]))
    cast = values.to(getattr(torch, _TORCH_NAMES[target]))
    return bytes(cast.view(torch.uint8).numpy().tobytes())
