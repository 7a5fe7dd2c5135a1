"""Qwen2 (`Qwen2ForCausalLM`): Llama's tensors, with q, k and v biases always (no o_proj
bias)."""

from ckptfix.mappings.rows import (
    ATTENTION,
    DENSE_CONFIG,
    DENSE_MLP,
    EMBEDDINGS,
    POST_ATTENTION_NORM,
    QKV_BIAS,
)
from ckptfix.mappings.table import Table

TABLE = Table(
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    rows=EMBEDDINGS + ATTENTION + QKV_BIAS + POST_ATTENTION_NORM + DENSE_MLP,
    config_keys=DENSE_CONFIG,
)
