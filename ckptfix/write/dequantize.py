"""Decoding ggml's block-quantized tensors (GGUF) to F32 for `convert --dequantize`, with the
`gguf` package's numpy dequantizers (the `gguf` extra), one chunk of whole blocks at a time.
The package is imported here and nowhere else at run time."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ckptfix.core.dtypes import DTYPES
from ckptfix.core.errors import PlanError, UsageError


def _quants() -> tuple[Any, Any]:
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
    except ImportError as exc:
        raise UsageError(
            "--dequantize",
            "decoding quantized tensors needs the gguf package",
            "pip install 'ckptfix[gguf]'",
        ) from exc
    return GGMLQuantizationType, dequantize


def dequantize_bytes(data: bytes | memoryview, dtype: str) -> bytes:
    """Whole blocks of `dtype` decoded to little-endian F32 values."""
    import numpy as np

    types, dequantize = _quants()
    blocks = np.frombuffer(data, dtype=np.uint8).reshape(-1, DTYPES[dtype].block_bytes)
    # A block whose scale is Inf or NaN decodes to NaN, as ggml decodes it; numpy would also
    # print a RuntimeWarning with its source line among ckptfix's output.
    with np.errstate(all="ignore"):
        values = dequantize(blocks, types[dtype])
    return bytes(np.ascontiguousarray(values, dtype="<f4").tobytes())


def check_dequantizable(dtypes: Iterable[str], label: str) -> None:
    """Refuse, before anything is written, a quantized dtype the gguf package cannot decode
    (tried on one block of zeros)."""
    missing = []
    for dtype in sorted(set(dtypes)):
        try:
            dequantize_bytes(bytes(DTYPES[dtype].block_bytes), dtype)
        except (NotImplementedError, KeyError):
            missing.append(dtype)
    if missing:
        raise PlanError(
            label,
            f"the gguf package cannot decode {', '.join(missing)} tensors",
            "keep the model as GGUF, or --exclude those tensors",
            rule="quantized-tensor",
        )
