"""Mistral (`MistralForCausalLM`): Llama's tensors without biases."""

from ckptfix.mappings.rows import (
    ATTENTION,
    DENSE_CONFIG,
    DENSE_MLP,
    EMBEDDINGS,
    POST_ATTENTION_NORM,
)
from ckptfix.mappings.table import Table

TABLE = Table(
    model_type="mistral",
    architecture="MistralForCausalLM",
    rows=EMBEDDINGS + ATTENTION + POST_ATTENTION_NORM + DENSE_MLP,
    config_keys=(*DENSE_CONFIG, "sliding_window"),
)
