"""Mixtral (`MixtralForCausalLM`): Mistral's attention, every layer a mixture of experts
under `block_sparse_moe` (router `gate`; experts `w1` gate, `w3` up, `w2` down, the names
`save_pretrained` writes). Megatron's expert size is config.json's `intermediate_size`."""

from ckptfix.mappings.rows import (
    ATTENTION,
    DENSE_CONFIG,
    EMBEDDINGS,
    HL,
    POST_ATTENTION_NORM,
    experts,
)
from ckptfix.mappings.table import Table

_MOE = HL + "block_sparse_moe."
TABLE = Table(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    rows=EMBEDDINGS
    + ATTENTION
    + POST_ATTENTION_NORM
    + experts(_MOE + "gate.weight", _MOE + "experts.{expert}.", ("w1", "w3", "w2")),
    config_keys=(*DENSE_CONFIG, "num_local_experts", "num_experts_per_tok", "sliding_window"),
    moe=True,
)
