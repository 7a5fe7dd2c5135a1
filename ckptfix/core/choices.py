"""The fixed choices of options that the library and the CLI share, as Literal types: a
caller's type checker refuses a misspelt one before it runs (the code checks them too)."""

from __future__ import annotations

from typing import Literal

# DeepSpeed: the fp32 master weights of the optimizer partitions, the module copy, or the fp32
# weights of a universal checkpoint
ZeroWeights = Literal["master", "module", "universal"]
Target = Literal["safetensors", "torch"]  # what convert writes
CastDtype = Literal["keep", "bf16", "fp16", "fp32"]  # what convert casts floating tensors to
DecodeDtype = Literal["bf16", "fp16", "fp32"]  # what convert decodes GGUF quantized tensors to
