"""Rows the GPT-family tables share (data; see table.py for what a row says)."""

from __future__ import annotations

from ckptfix.mappings.table import Row, row

L = "decoder.layers.{layer}."
HL = "model.layers.{layer}."
ATTN = HL + "self_attn."
EXPERT = L + "mlp.experts.experts.{expert}."


def _qkv(kind: str, when: str | None = None) -> Row:
    targets = tuple(f"{ATTN}{p}_proj.{kind}" for p in "qkv")
    return row(
        L + f"self_attention.linear_qkv.{kind}",
        targets,
        "qkv",
        ("H",) if kind == "weight" else (),
        when,
    )


EMBEDDINGS = (
    row("embedding.word_embeddings.weight", "model.embed_tokens.weight", "vocab", ("V", "H")),
    row("output_layer.weight", "lm_head.weight", "vocab", ("V", "H"), when="untied"),
    row("decoder.final_layernorm.weight", "model.norm.weight", shape=("H",)),
)
# The input norm is fused into linear_qkv by Transformer Engine specs (and saved under that
# name by the local spec too); a spec with a separate norm saves `input_layernorm`.
ATTENTION = (
    row(
        (L + "self_attention.linear_qkv.layer_norm_weight", L + "input_layernorm.weight"),
        HL + "input_layernorm.weight",
        shape=("H",),
    ),
    _qkv("weight"),
    row(L + "self_attention.linear_proj.weight", ATTN + "o_proj.weight", shape=("H", "Q")),
)
QKV_BIAS = (_qkv("bias"),)
ATTENTION_BIAS = (
    _qkv("bias", when="attention_bias"),
    row(
        L + "self_attention.linear_proj.bias",
        ATTN + "o_proj.bias",
        shape=("H",),
        when="attention_bias",
    ),
)
QK_NORM = (
    row(L + "self_attention.q_layernorm.weight", ATTN + "q_norm.weight", shape=("D",)),
    row(L + "self_attention.k_layernorm.weight", ATTN + "k_norm.weight", shape=("D",)),
)
# Before the MLP: fused into linear_fc1 by dense TE specs, `pre_mlp_layernorm` in MoE layers.
POST_ATTENTION_NORM = (
    row(
        (L + "mlp.linear_fc1.layer_norm_weight", L + "pre_mlp_layernorm.weight"),
        HL + "post_attention_layernorm.weight",
        shape=("H",),
    ),
)
DENSE_MLP = (
    row(
        L + "mlp.linear_fc1.weight",
        (HL + "mlp.gate_proj.weight", HL + "mlp.up_proj.weight"),
        "swiglu",
        ("F", "H"),
    ),
    row(L + "mlp.linear_fc2.weight", HL + "mlp.down_proj.weight", shape=("H", "F")),
)
MLP_BIAS = (
    row(
        L + "mlp.linear_fc1.bias",
        (HL + "mlp.gate_proj.bias", HL + "mlp.up_proj.bias"),
        "swiglu",
        ("F",),
        when="mlp_bias",
    ),
    row(L + "mlp.linear_fc2.bias", HL + "mlp.down_proj.bias", shape=("H",), when="mlp_bias"),
)


def experts(router: str, expert: str, names: tuple[str, str, str]) -> tuple[Row, ...]:
    """A MoE layer: the router, and each expert's fused [gate; up] and down projections
    under the family's names (`expert` holds `{expert}`; names: gate, up, down)."""
    gate, up, down = (f"{expert}{name}.weight" for name in names)
    return (
        row(L + "mlp.router.weight", router, shape=("E", "H")),
        row(EXPERT + "linear_fc1.weight", (gate, up), "swiglu", ("M", "H")),
        row(EXPERT + "linear_fc2.weight", down, shape=("H", "M")),
    )


DENSE_CONFIG = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings", "rope_theta", "rope_parameters", "tie_word_embeddings",
    "hidden_act",
)  # fmt: skip
