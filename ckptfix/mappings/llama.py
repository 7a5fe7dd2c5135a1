"""Llama (`LlamaForCausalLM`): RMSNorm, SwiGLU, grouped-query attention, biases only when
config.json says `attention_bias` / `mlp_bias`."""

from ckptfix.mappings.rows import (
    ATTENTION,
    ATTENTION_BIAS,
    DENSE_CONFIG,
    DENSE_MLP,
    EMBEDDINGS,
    MLP_BIAS,
    POST_ATTENTION_NORM,
)
from ckptfix.mappings.table import Table

TABLE = Table(
    model_type="llama",
    architecture="LlamaForCausalLM",
    rows=EMBEDDINGS + ATTENTION + ATTENTION_BIAS + POST_ATTENTION_NORM + DENSE_MLP + MLP_BIAS,
    config_keys=(*DENSE_CONFIG, "attention_bias", "mlp_bias"),
)
