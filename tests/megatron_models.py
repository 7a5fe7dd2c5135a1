"""One case of tests/megatron_writer.py, run on every rank: a transformers model, its weights
in a Megatron GPTModel (this module's own mapping), the checkpoint, the logits and the oracle.

The mapping here is the test's, written from the two models' definitions: Megatron's fused
`linear_qkv` interleaves each query group's heads as [q heads, k, v]; its SwiGLU `linear_fc1`
is [gate; up], cut per tensor-parallel rank into [gate_r; up_r]; row-parallel layers are cut
on their input dimension; the vocabulary is padded and cut on rows.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.megatron_writer import PADDED, TOKENS, VOCAB, Case, training_args

PAD_VALUE = 7.0  # padding rows: a conversion that keeps them shows up at once


def write_case(name: str, case: Case, out: str, rank: int) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=case.tp, expert_model_parallel_size=case.ep
    )
    torch.manual_seed(0)
    hf = _hf_model(case, out, rank) if case.hf else None
    config = _config(case, hf.config if hf is not None else None, case.tp, case.ep)
    model = _gpt(case, config, _rope_base(hf.config) if hf is not None else 10000)
    if hf is not None:
        _load_hf(model, hf, config, case, os.path.join(out, "hf"))
    ckpt = os.path.join(out, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    state = model.sharded_state_dict()
    if case.optimizer:
        state["optimizer"] = _optimizer_state(model, state)
    if case.args:
        state.update(args=training_args(config, case), iteration=3, checkpoint_version=3.0)
    dist_checkpointing.save(state, ckpt)
    for variant in case.variants:
        _save_variant(model, variant, os.path.join(out, f"ckpt_{variant}"))
    logits = _forward(model)
    if rank == 0:
        torch.save(logits, os.path.join(out, "logits.pt"))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    _write_oracle(case, hf, ckpt, os.path.join(out, "oracle.pt"), rank)


def _save_variant(model: Any, variant: str, folder: str) -> None:
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    os.makedirs(folder, exist_ok=True)
    if variant == "singleton":
        state = model.sharded_state_dict(metadata={"singleton_local_shards": True})
        dist_checkpointing.save(state, folder, content_metadata={"singleton_local_shards": True})
        return
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group)
    dist_checkpointing.save(model.sharded_state_dict(), folder, strategy)


def _hf_model(case: Case, out: str, rank: int) -> Any:
    """The transformers model the case starts from, every weight random (norms too)."""
    import transformers

    config = transformers.AutoConfig.for_model(
        case.hf,
        vocab_size=VOCAB,
        tie_word_embeddings=case.tied,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        **case.hf_config,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to(getattr(torch, case.dtype))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            values = torch.randn(parameter.shape, generator=generator) * 0.2
            parameter.copy_(values.to(parameter.dtype))
    if rank == 0:
        model.save_pretrained(os.path.join(out, "hf"))
    import torch.distributed as dist

    dist.barrier()  # the file, not the model in memory: transformers fuses experts there
    return model


def _rope_base(hf_config: Any) -> float:
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta") or getattr(hf_config, "rope_theta", 10000.0))


def _config(case: Case, hf_config: Any, tp: int, ep: int) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = getattr(torch, case.dtype)
    common: dict[str, Any] = dict(
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.2,
    )
    if hf_config is None:
        base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96)
        return TransformerConfig(**base, **common, **case.megatron)
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    experts = getattr(hf_config, "num_local_experts", None) or getattr(
        hf_config, "num_experts", None
    )
    moe: dict[str, Any] = {}
    if experts:
        topk = hf_config.num_experts_per_tok
        moe = dict(
            num_moe_experts=experts,
            moe_router_topk=topk,
            moe_ffn_hidden_size=getattr(hf_config, "moe_intermediate_size", None)
            or hf_config.intermediate_size,
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
            moe_router_pre_softmax=topk == 1,  # softmax, then top-1: no renormalisation
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
        )
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim,
        ffn_hidden_size=getattr(hf_config, "intermediate_size", None) or 4 * hf_config.hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=case.hf == "qwen2",
        qk_layernorm=case.hf in ("qwen3", "qwen3_moe"),
        **moe,
        **common,
    )


def _gpt(case: Case, config: Any, rope_base: float) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm,
        normalization=config.normalization,
    )
    rope = case.hf is not None
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=PADDED,
        max_sequence_length=64,
        parallel_output=False,
        share_embeddings_and_output_weights=case.tied,
        position_embedding_type="rope" if rope else "learned_absolute",
        rotary_base=int(rope_base),
    )
    return model


def _full_megatron(hf: Any, config: Any, saved: str) -> dict[str, torch.Tensor]:
    """The HF weights as saved (`save_pretrained`'s names) under Megatron's TP 1 names
    (local spec), every expert global."""
    from safetensors.torch import load_file

    sd = load_file(os.path.join(saved, "model.safetensors"))
    heads, groups, dim = config.num_attention_heads, config.num_query_groups, config.kv_channels
    full: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": _padded(sd["model.embed_tokens.weight"]),
        "decoder.final_layernorm.weight": sd["model.norm.weight"],
    }
    if "lm_head.weight" in sd and not hf.config.tie_word_embeddings:
        full["output_layer.weight"] = _padded(sd["lm_head.weight"])
    for i in range(config.num_layers):
        hf_layer, layer = f"model.layers.{i}.", f"decoder.layers.{i}."
        attention = hf_layer + "self_attn."
        full[layer + "input_layernorm.weight"] = sd[hf_layer + "input_layernorm.weight"]
        full[layer + "pre_mlp_layernorm.weight"] = sd[hf_layer + "post_attention_layernorm.weight"]
        for kind in ("weight", "bias"):
            if attention + f"q_proj.{kind}" in sd:
                q, k, v = (sd[attention + f"{p}_proj.{kind}"] for p in "qkv")
                full[layer + f"self_attention.linear_qkv.{kind}"] = _interleave(
                    q, k, v, heads // groups, groups, dim
                )
        full[layer + "self_attention.linear_proj.weight"] = sd[attention + "o_proj.weight"]
        for norm in ("q", "k"):
            if attention + f"{norm}_norm.weight" in sd:
                full[layer + f"self_attention.{norm}_layernorm.weight"] = sd[
                    attention + f"{norm}_norm.weight"
                ]
        full.update(_mlp(sd, hf_layer, layer))
    return full


def _interleave(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, per_group: int, groups: int, dim: int
) -> torch.Tensor:
    rest = q.shape[1:]
    q = q.reshape(groups, per_group * dim, *rest)
    k = k.reshape(groups, dim, *rest)
    v = v.reshape(groups, dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _mlp(sd: dict[str, torch.Tensor], hf_layer: str, layer: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    dense = hf_layer + "mlp.gate_proj.weight"
    if dense in sd:
        out[layer + "mlp.linear_fc1.weight"] = torch.cat(
            [sd[dense], sd[hf_layer + "mlp.up_proj.weight"]]
        )
        out[layer + "mlp.linear_fc2.weight"] = sd[hf_layer + "mlp.down_proj.weight"]
        return out
    mixtral = hf_layer + "block_sparse_moe."
    if mixtral + "gate.weight" in sd:
        out[layer + "mlp.router.weight"] = sd[mixtral + "gate.weight"]
        names = [(f"{mixtral}experts.{{}}.{p}.weight") for p in ("w1", "w3", "w2")]
    else:
        out[layer + "mlp.router.weight"] = sd[hf_layer + "mlp.gate.weight"]
        names = [
            f"{hf_layer}mlp.experts.{{}}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
        ]
    expert = 0
    while names[0].format(expert) in sd:
        gate, up, down = (sd[n.format(expert)] for n in names)
        experts = layer + f"mlp.experts.local_experts.{expert}."
        out[experts + "linear_fc1.weight"] = torch.cat([gate, up])
        out[experts + "linear_fc2.weight"] = down
        expert += 1
    return out


def _padded(weight: torch.Tensor) -> torch.Tensor:
    pad = torch.full((PADDED - weight.shape[0], *weight.shape[1:]), PAD_VALUE, dtype=weight.dtype)
    return torch.cat([weight, pad])


def _local(name: str, full: torch.Tensor, rank: int, case: Case) -> torch.Tensor:
    """This rank's part of a TP 1 tensor (experts are not tensor-parallel here)."""
    tp = case.tp
    if tp == 1 or "local_experts" in name or (full.dim() == 1 and "linear_qkv" not in name):
        return full
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight")):
        return full.chunk(tp)[rank]
    if name.endswith("linear_qkv.bias"):
        return full.chunk(tp)[rank]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return full.chunk(tp, dim=1)[rank]
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return full


def _load_hf(model: Any, hf: Any, config: Any, case: Case, saved: str) -> None:
    from megatron.core import parallel_state

    full = _full_megatron(hf, config, saved)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    local_experts = (config.num_moe_experts or 0) // case.ep
    wanted = model.state_dict()
    loaded = {}
    for name in wanted:
        if "_extra_state" in name:
            continue
        source = name
        if "local_experts." in name:  # local expert j is global expert ep_rank * n + j
            head, tail = name.split("local_experts.")
            index, rest = tail.split(".", 1)
            source = f"{head}local_experts.{ep_rank * local_experts + int(index)}.{rest}"
        tensor = _local(name, full[source], tp_rank, case)
        assert tensor.shape == wanted[name].shape, (name, tensor.shape, wanted[name].shape)
        loaded[name] = tensor.to(wanted[name].dtype)
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    assert not unexpected and all("_extra_state" in k for k in missing), (missing, unexpected)


def _optimizer_state(model: Any, state: dict[str, Any]) -> dict[str, Any]:
    """An Adam step's state, sharded the way Megatron's non-distributed optimizers save it."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    parameters = [p for p in model.parameters() if p.requires_grad]
    weights = [p.detach().clone() for p in parameters]
    optimizer = torch.optim.Adam(parameters, lr=1e-3)
    for parameter in parameters:
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    with torch.no_grad():  # the weights saved are the model's, not the stepped ones
        for parameter, weight in zip(parameters, weights, strict=True):
            parameter.copy_(weight)
            parameter.grad = None
    optim = optimizer.state_dict()
    id_map = get_param_id_to_sharded_param_map(state, parameters)
    optim_state_to_sharding_state(optim, id_map, exclude_keys=("step",))
    return optim


def _forward(model: Any) -> torch.Tensor:
    model.eval()
    tokens = torch.tensor(TOKENS)
    length = tokens.shape[1]
    positions = torch.arange(length).unsqueeze(0)
    mask = torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        logits = model(tokens, positions, mask)
    return logits[..., :VOCAB].float()


def canonical_name(key: str, offsets: tuple[int, ...]) -> str:
    """A sharded key with its stacked axes written as indices: the layer after `layers.`,
    the expert after `experts.experts.` (how non-homogeneous checkpoints name them)."""
    for marker, index in zip(("layers.", "experts.experts."), offsets, strict=False):
        head, tail = key.split(marker, 1)
        key = f"{head}{marker}{index}.{tail}"
    return key


def _write_oracle(case: Case, hf: Any, ckpt: str, out: str, rank: int) -> None:
    """Megatron's own load into a TP 1, EP 1 model: canonical name -> tensor."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    parallel_state.initialize_model_parallel()
    config = _config(case, hf.config if hf is not None else None, 1, 1)
    model = _gpt(case, config, _rope_base(hf.config) if hf is not None else 10000)
    state = model.sharded_state_dict()
    names = {}
    for name, value in state.items():
        if isinstance(value, ShardedTensorFactory):
            built = value.build()
            value = (built if isinstance(built, list) else list(built.values()))[0]
        if isinstance(value, ShardedTensor):
            offsets = tuple(value.global_offset[: value.prepend_axis_num])
            names[name] = canonical_name(value.key, offsets)
    loaded = dist_checkpointing.load(state, ckpt)
    if rank == 0:
        torch.save({names[k]: loaded[k].clone() for k in names}, out)
    parallel_state.destroy_model_parallel()
