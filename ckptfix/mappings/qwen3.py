"""Qwen3 (`Qwen3ForCausalLM`): Llama's tensors with per-head RMSNorms on queries and keys
(`q_norm`, `k_norm`: Megatron's `q_layernorm`, `k_layernorm`), biases when
`attention_bias`."""

from ckptfix.mappings.rows import (
    ATTENTION,
    ATTENTION_BIAS,
    DENSE_CONFIG,
    DENSE_MLP,
    EMBEDDINGS,
    POST_ATTENTION_NORM,
    QK_NORM,
)
from ckptfix.mappings.table import Table

TABLE = Table(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    rows=EMBEDDINGS + ATTENTION + ATTENTION_BIAS + QK_NORM + POST_ATTENTION_NORM + DENSE_MLP,
    config_keys=(*DENSE_CONFIG, "attention_bias"),
)
