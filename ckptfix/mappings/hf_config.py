"""The target of `--to-hf CONFIG`: the Hugging Face config.json given (a file, or a folder that
holds one), or a model type whose config the checkpoint's training arguments (common.pt)
fully determine; and the sizes a mapping table's shape symbols stand for."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ckptfix.core.errors import CorruptFileError, MappingError, UsageError
from ckptfix.formats.strict_json import strict_json
from ckptfix.mappings import FAMILIES
from ckptfix.mappings.table import Table

MAX_CONFIG_BYTES = 16 * 2**20
_TORCH_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_CONFIG_FIX = "pass the config.json of the model this checkpoint was trained as"
_ARGS_FIX = "pass the model's config.json as --to-hf instead of a model type"


@dataclass(frozen=True)
class Dims:
    """The sizes of the target model (shape symbols: see mappings.table) and its flags."""

    sizes: dict[str, int]
    layers: int
    groups: int  # key-value heads: the query groups of Megatron's linear_qkv
    flags: dict[str, bool]

    def shape(self, symbols: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(self.sizes[symbol] for symbol in symbols)


@dataclass(frozen=True)
class Target:
    """The model a conversion writes: its table, its config (and the bytes of config.json
    as written to OUT), where it came from, and its sizes."""

    table: Table
    config: dict[str, Any]
    text: bytes
    origin: str
    dims: Dims


def _families() -> str:
    return ", ".join(sorted(FAMILIES))


def read_target(spec: str, args: dict[str, object], checkpoint: str) -> Target:
    """`spec` names an existing file or folder (its config.json), else a model type."""
    if os.path.exists(spec):
        path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
        return _from_file(path)
    if spec not in FAMILIES:
        raise UsageError(
            "--to-hf",
            f"{spec!r} is neither a config.json, a folder holding one, nor a model type",
            f"model types: {_families()}",
        )
    config = config_from_args(FAMILIES[spec], args, os.path.join(checkpoint, "common.pt"))
    text = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    origin = f"the training arguments in {os.path.join(checkpoint, 'common.pt')}"
    return Target(FAMILIES[spec], config, text, origin, dims_of(FAMILIES[spec], config, origin))


def _from_file(path: str) -> Target:
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise UsageError("--to-hf", f"cannot read {path}: {exc.strerror}", _CONFIG_FIX) from exc
    if len(raw) > MAX_CONFIG_BYTES:
        raise UsageError("--to-hf", f"{path} is over {MAX_CONFIG_BYTES:,} bytes", _CONFIG_FIX)
    try:
        config = strict_json(raw, path)
    except CorruptFileError as exc:
        what = exc.what.replace("header", "the config", 1)
        raise CorruptFileError(path, "config-not-json", what, _CONFIG_FIX) from exc
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UsageError(
            "--to-hf",
            f"{path} is a {model_type!r} model; ckptfix maps Megatron GPT checkpoints to "
            f"{_families()}",
            "pass the config.json of one of those",
        )
    table = FAMILIES[str(model_type)]
    return Target(table, config, raw, path, dims_of(table, config, path))


def _size(config: dict[str, Any], key: str, origin: str, default: object = None) -> int:
    value = config.get(key)
    value = default if value is None else value
    if type(value) is not int or value <= 0:
        raise MappingError(
            origin, f"{key} is {value!r}, not a positive integer", _CONFIG_FIX, rule="hf-config"
        )
    return value


def dims_of(table: Table, config: dict[str, Any], origin: str) -> Dims:
    """The sizes and flags a config gives; a config this table cannot map is refused."""
    hidden = _size(config, "hidden_size", origin)
    heads = _size(config, "num_attention_heads", origin)
    groups = _size(config, "num_key_value_heads", origin, heads)
    head_dim = config.get("head_dim") or hidden // heads
    head_dim = _size({"head_dim": head_dim}, "head_dim", origin)
    if heads % groups:
        raise MappingError(
            origin,
            f"{heads} attention heads do not split into {groups} key-value groups",
            _CONFIG_FIX,
            rule="hf-config",
        )
    sizes = {"H": hidden, "Q": heads * head_dim, "KV": groups * head_dim, "D": head_dim}
    sizes["V"] = _size(config, "vocab_size", origin)
    if table.moe:
        sizes["M"] = _size(config, "moe_intermediate_size", origin, config.get("intermediate_size"))
        experts = config.get("num_local_experts") or config.get("num_experts")
        sizes["E"] = _size({"experts": experts}, "experts", origin)
        _all_sparse(config, origin)
    else:
        sizes["F"] = _size(config, "intermediate_size", origin)
    flags = {
        "untied": not config.get("tie_word_embeddings", False),
        "attention_bias": bool(config.get("attention_bias", False)),
        "mlp_bias": bool(config.get("mlp_bias", False)),
    }
    return Dims(sizes, _size(config, "num_hidden_layers", origin), groups, flags)


def _all_sparse(config: dict[str, Any], origin: str) -> None:
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) not in (None, 1):
        raise MappingError(
            origin,
            "the config mixes dense and MoE layers (mlp_only_layers, decoder_sparse_step); "
            "ckptfix maps models whose every layer is MoE",
            _CONFIG_FIX,
            rule="hf-config",
        )


def _need(args: dict[str, object], key: str, origin: str) -> Any:
    value = args.get(key)
    if value is None:
        raise MappingError(
            origin, f"the training arguments do not give {key}", _ARGS_FIX, rule="megatron-args"
        )
    return value


def _expect(args: dict[str, object], key: str, wanted: object, origin: str) -> None:
    value = args.get(key)
    if value != wanted:
        raise MappingError(
            origin,
            f"the training arguments say {key}={value!r}; the Hugging Face families ckptfix "
            f"maps need {wanted!r}",
            _ARGS_FIX,
            rule="megatron-args",
        )


def config_from_args(table: Table, args: dict[str, object], origin: str) -> dict[str, Any]:
    """config.json for `table` from Megatron-LM's training arguments; what they leave open
    (the tokenizer's vocab_size when only the padded one is kept, ...) is an error."""
    if not args:
        raise MappingError(origin, "holds no training arguments", _ARGS_FIX, rule="megatron-args")
    _expect(args, "normalization", "RMSNorm", origin)
    _expect(args, "swiglu", True, origin)
    _expect(args, "position_embedding_type", "rope", origin)
    heads = _need(args, "num_attention_heads", origin)
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    base = args.get("rotary_base") or 10000
    bias = bool(args.get("add_bias_linear"))
    derived: dict[str, Any] = {
        "vocab_size": _need(args, "vocab_size", origin),
        "hidden_size": _need(args, "hidden_size", origin),
        "intermediate_size": _need(args, "ffn_hidden_size", origin),
        "num_hidden_layers": _need(args, "num_layers", origin),
        "num_attention_heads": heads,
        "num_key_value_heads": groups or heads,
        "head_dim": args.get("kv_channels") or _need(args, "hidden_size", origin) // heads,
        "rms_norm_eps": args.get("norm_epsilon") or 1e-5,
        "max_position_embeddings": _need(args, "max_position_embeddings", origin),
        "rope_theta": base,
        "rope_parameters": {"rope_type": "default", "rope_theta": base},
        "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False),
        "hidden_act": "silu",
        "attention_bias": bias,
        "mlp_bias": bias,
        "sliding_window": None,
    }
    if table.moe:
        derived.update(_moe_config(table, args, origin))
    config: dict[str, Any] = {"architectures": [table.architecture], "model_type": table.model_type}
    config.update({key: derived[key] for key in table.config_keys})
    config["dtype"] = _TORCH_NAMES.get(str(args.get("params_dtype")), "float32")
    return config


def _moe_config(table: Table, args: dict[str, object], origin: str) -> dict[str, Any]:
    experts = _need(args, "num_experts", origin)
    expert_size = args.get("moe_ffn_hidden_size") or _need(args, "ffn_hidden_size", origin)
    if args.get("moe_layer_freq") not in (None, 1):
        _expect(args, "moe_layer_freq", 1, origin)
    pre_softmax = bool(args.get("moe_router_pre_softmax"))
    topk = args.get("moe_router_topk") or 2
    if table.model_type == "mixtral" and pre_softmax and topk != 1:
        _expect(args, "moe_router_pre_softmax", False, origin)  # Mixtral renormalises its top-k
    return {
        "num_local_experts": experts,
        "num_experts": experts,
        "num_experts_per_tok": topk,
        "moe_intermediate_size": expert_size,
        "norm_topk_prob": not pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        # Mixtral's experts are `intermediate_size` wide
        **({"intermediate_size": expert_size} if table.model_type == "mixtral" else {}),
    }
