"""dtype casts for `convert --dtype`: floating tensors only, with torch (bf16 and fp8 have no
numpy dtype). torch is imported here and nowhere else on the convert path."""

from __future__ import annotations

from ckptfix.dtypes import DTYPES
from ckptfix.errors import UsageError
from ckptfix.formats.torch_pickle import TORCH_DTYPES

CAST_TARGETS = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}


def _torch_names() -> dict[str, str]:
    """safetensors dtype -> torch attribute, the first (canonical) name of each."""
    names: dict[str, str] = {}
    for attribute, dtype in TORCH_DTYPES.items():
        names.setdefault(dtype, attribute)
    return names


TORCH_NAMES = _torch_names()


def cast_bytes(data: bytes, source: str, target: str) -> bytes:
    """Cast raw little-endian elements from one floating dtype to another (round to nearest)."""
    try:
        import torch
    except ImportError as exc:
        raise UsageError("--dtype", "casting needs torch installed", "pip install torch") from exc
    if not (DTYPES[source].is_floating and DTYPES[target].is_floating):
        raise UsageError(
            "--dtype", f"cannot cast {source} to {target}", "cast floating dtypes only"
        )
    if not data:
        return b""
    values = torch.frombuffer(bytearray(data), dtype=getattr(torch, TORCH_NAMES[source]))
    cast = values.to(getattr(torch, TORCH_NAMES[target]))
    return bytes(cast.view(torch.uint8).numpy().tobytes())
