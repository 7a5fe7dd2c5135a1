"""The fixed choices of options that the library and the CLI share, as Literal types: a
caller's type checker refuses a misspelt one before it runs (the code checks them too)."""

from __future__ import annotations

from typing import Literal

ZeroWeights = Literal["master", "module"]  # DeepSpeed: fp32 master weights, or the module copy
Target = Literal["safetensors", "torch"]  # what convert writes
CastDtype = Literal["keep", "bf16", "fp16", "fp32"]  # what convert casts floating tensors to
DecodeDtype = Literal["bf16", "fp16", "fp32"]  # what convert decodes GGUF quantized tensors to
