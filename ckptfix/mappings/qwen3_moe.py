"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention, every layer a mixture of experts
(router `mlp.gate`; experts `mlp.experts.E.gate_proj/up_proj/down_proj`, the names
`save_pretrained` writes). Configs with dense layers (`mlp_only_layers`,
`decoder_sparse_step` > 1) are refused."""

from ckptfix.mappings.rows import (
    ATTENTION,
    ATTENTION_BIAS,
    DENSE_CONFIG,
    EMBEDDINGS,
    HL,
    POST_ATTENTION_NORM,
    QK_NORM,
    experts,
)
from ckptfix.mappings.table import Table

TABLE = Table(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    rows=EMBEDDINGS
    + ATTENTION
    + ATTENTION_BIAS
    + QK_NORM
    + POST_ATTENTION_NORM
    + experts(
        HL + "mlp.gate.weight", HL + "mlp.experts.{expert}.", ("gate_proj", "up_proj", "down_proj")
    ),
    config_keys=(
        *DENSE_CONFIG,
        "attention_bias",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
    ),
    moe=True,
)
