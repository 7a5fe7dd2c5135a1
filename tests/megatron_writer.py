"""Megatron-Core `torch_dist` checkpoints written by megatron-core itself on CPU, for the
tests: each starts from a small `transformers` model whose weights are loaded into a Megatron
`GPTModel` through this module's own mapping (independent of ckptfix's tables), saved with
`dist_checkpointing.save` by 2 gloo ranks (TP 1 or 2, EP 2 for MoE), run forward for the
logits, and loaded back by `dist_checkpointing.load` into a TP 1, EP 1 model as the oracle of
the Megatron-named tensors.

Run as `python -m tests.megatron_writer OUT` (the session fixture does, once); ranks are
spawned with torch.multiprocessing and talk over the loopback interface only. Each case
folder holds `ckpt/` (the checkpoint), `hf/` (the transformers model it started from, when
there is one), `logits.pt` (Megatron's forward pass) and `oracle.pt` (canonical name ->
tensor, from Megatron's own load).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from tests.training_frameworks import env_for_rank, free_port

WORLD = 2  # as tests.training_frameworks.env_for_rank sets it
VOCAB, PADDED = 120, 128  # Megatron-LM pads the vocabulary; HF keeps the tokenizer's size
TOKENS = [[3, 17, 64, 5, 99, 118, 42, 7, 1, 30, 77, 12]]


@dataclass(frozen=True)
class Case:
    hf: str | None  # transformers model type, or None for a Megatron-only model
    tp: int = 1
    ep: int = 1
    dtype: str = "float32"
    hf_config: dict[str, Any] = field(default_factory=dict)
    megatron: dict[str, Any] = field(default_factory=dict)  # TransformerConfig extras
    tied: bool = False
    optimizer: bool = False  # also save optimizer state, as Megatron's optimizers do
    args: bool = False  # common.pt holds Megatron-LM's training arguments
    # Also saved as ckpt_<variant>/: "fully_parallel" (megatron-core's wrapper that spreads
    # the replicated tensors' saving over the data-parallel ranks), "singleton" (every layer
    # and expert under its own key, as non-homogeneous models are saved)
    variants: tuple[str, ...] = ()


_DENSE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2)
_HEADS = dict(num_attention_heads=4, num_key_value_heads=2)
_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
CASES = {
    "llama": Case("llama", tp=2, hf_config={**_DENSE, **_HEADS}, optimizer=True, args=True),
    "mistral": Case(  # four query heads per key-value head
        "mistral",
        hf_config={
            **_DENSE,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "sliding_window": None,
        },
    ),
    "qwen2": Case("qwen2", tp=2, dtype="bfloat16", hf_config={**_DENSE, **_HEADS}, tied=True),
    "qwen3": Case("qwen3", tp=2, hf_config={**_DENSE, **_HEADS, "head_dim": 24}),
    "mixtral": Case(
        "mixtral",
        ep=2,
        variants=("fully_parallel", "singleton"),
        hf_config={
            **_MOE,
            "intermediate_size": 80,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "qwen3_moe": Case(
        "qwen3_moe",
        ep=2,
        hf_config={
            **_MOE,
            "head_dim": 16,
            "moe_intermediate_size": 48,
            "num_experts": 4,
            "num_experts_per_tok": 1,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
    "gpt": Case(  # LayerNorm with biases, GELU, learned positions: no Hugging Face twin here
        None,
        tp=2,
        megatron=dict(normalization="LayerNorm", add_bias_linear=True, gated_linear_unit=False),
    ),
}


def _cpu_only() -> None:
    """megatron-core asks CUDA for things a CPU run does not need (TRAINING_FORMATS.md)."""
    import torch

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # only Transformer Engine defines it
    tracker = tp_random.get_cuda_rng_tracker()
    tracker.fork = _no_fork  # type: ignore[method-assign]


class _NoFork:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _no_fork(*args: object, **kwargs: object) -> _NoFork:
    return _NoFork()


def main() -> None:
    import torch.multiprocessing as mp

    out = sys.argv[1]
    names = sys.argv[2:] or list(CASES)
    mp.spawn(_run, args=(out, free_port(), names), nprocs=WORLD)


def _run(rank: int, out: str, port: int, names: list[str]) -> None:
    env_for_rank(rank, port)
    import torch.distributed as dist

    from tests import megatron_models

    _cpu_only()
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    for name in names:
        megatron_models.write_case(name, CASES[name], os.path.join(out, name), rank)
    dist.barrier()
    dist.destroy_process_group()


def training_args(config: Any, case: Case) -> argparse.Namespace:
    """What Megatron-LM keeps in common.pt as `args`: the architecture, among much else, with
    its enum and dtype values (pickled as their classes)."""
    import torch
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads,
        group_query_attention=config.num_query_groups != config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        kv_channels=config.kv_channels,
        normalization=config.normalization,
        norm_epsilon=config.layernorm_epsilon,
        swiglu=config.gated_linear_unit,
        add_bias_linear=config.add_bias_linear,
        add_qkv_bias=config.add_qkv_bias,
        qk_layernorm=config.qk_layernorm,
        untie_embeddings_and_output_weights=not case.tied,
        position_embedding_type="rope",
        rotary_base=10000,
        rotary_percent=1.0,
        max_position_embeddings=64,
        vocab_size=VOCAB,
        padded_vocab_size=PADDED,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=case.tp,
        num_experts=config.num_moe_experts,
        params_dtype=torch.float32,
        attention_backend=AttnBackend.auto,
        model_type=ModelType.encoder_or_decoder,
        iteration=3,
        consumed_train_samples=24,
        load=None,
        save="/checkpoints/run",
    )


if __name__ == "__main__":
    main()
