"""dtype casts for `convert --dtype`: floating tensors only, with torch (bf16 and fp8 have no
numpy dtype). torch is imported here and nowhere else on the convert path."""

from __future__ import annotations

from ckptfix.core.dtypes import DTYPES, TORCH_NAMES
from ckptfix.core.errors import UsageError

CAST_TARGETS = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}


def cast_bytes(data: bytes | memoryview, source: str, target: str) -> bytes:
    """Cast raw little-endian elements from one floating dtype to another (round to nearest);
    whole blocks of a block-quantized (GGUF) dtype are decoded to F32 first."""
    if DTYPES[source].quantized:
        from ckptfix.write.dequantize import dequantize_bytes

        data, source = dequantize_bytes(data, source), "F32"
        if target == source:
            return bytes(data)
    try:
        import torch
    except ImportError as exc:
        raise UsageError("--dtype", "casting needs torch installed", "pip install torch") from exc
    if not (DTYPES[source].is_floating and DTYPES[target].is_floating):
        raise UsageError(
            "--dtype", f"cannot cast {source} to {target}", "cast floating dtypes only"
        )
    if not len(data):
        return b""
    values = torch.frombuffer(bytearray(data), dtype=getattr(torch, TORCH_NAMES[source]))
    cast = values.to(getattr(torch, TORCH_NAMES[target]))
    return bytes(cast.view(torch.uint8).numpy().tobytes())
