"""Megatron-Core GPT checkpoints as Hugging Face models: one mapping table per family (data,
in the modules beside this one), applied by `mappings.apply`."""

from __future__ import annotations

from ckptfix.mappings import llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
from ckptfix.mappings.table import Table

FAMILIES: dict[str, Table] = {
    module.TABLE.model_type: module.TABLE
    for module in (llama, mistral, qwen2, qwen3, mixtral, qwen3_moe)
}
