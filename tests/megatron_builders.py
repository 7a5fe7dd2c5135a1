"""A tiny Megatron-Core `torch_dist` folder for the fast tests, the bad-input corpus and the
mutation tests: what megatron-core writes (metadata.json, common.pt with Megatron-LM's
`args`, `.metadata` with the save plans, one rank file), built without spawning ranks. The
tensors are a small Llama's, put into Megatron's layout by this module's own mapping (layers
stacked on a leading axis, q/k/v interleaved by query group, [gate; up], vocabulary padding).

The fast tests copy tests/data/megatron-tiny/, which `python -m tests.megatron_builders
tests/data/megatron-tiny` wrote (importing torch.distributed.checkpoint costs seconds per test
worker); a slow test checks that a fresh build reads the same. The real thing, written by
megatron-core itself, is tests/megatron_writer.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import shutil
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tests.optional import need

LAYERS, HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, VOCAB, PADDED = 2, 8, 4, 2, 2, 12, 10, 16
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": FFN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": GROUPS,
    "head_dim": HEAD_DIM,
    "vocab_size": VOCAB,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
}
SAVED = Path(__file__).resolve().parent / "data" / "megatron-tiny"


def hf_tensors() -> dict[str, np.ndarray]:
    """The Llama's tensors under Hugging Face names (float32, distinct values)."""
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN)}
    shapes["model.norm.weight"] = (HIDDEN,)
    for i in range(LAYERS):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (HIDDEN,),
            layer + "post_attention_layernorm.weight": (HIDDEN,),
            layer + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            layer + "self_attn.k_proj.weight": (GROUPS * HEAD_DIM, HIDDEN),
            layer + "self_attn.v_proj.weight": (GROUPS * HEAD_DIM, HIDDEN),
            layer + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            layer + "mlp.gate_proj.weight": (FFN, HIDDEN),
            layer + "mlp.up_proj.weight": (FFN, HIDDEN),
            layer + "mlp.down_proj.weight": (HIDDEN, FFN),
        }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _qkv(hf: dict[str, np.ndarray], layer: str) -> np.ndarray:
    q, k, v = (hf[f"{layer}self_attn.{p}_proj.weight"] for p in "qkv")
    per_group = HEADS // GROUPS
    blocks = [
        np.concatenate(
            [
                q[g * per_group * HEAD_DIM : (g + 1) * per_group * HEAD_DIM],
                k[g * HEAD_DIM : (g + 1) * HEAD_DIM],
                v[g * HEAD_DIM : (g + 1) * HEAD_DIM],
            ]
        )
        for g in range(GROUPS)
    ]
    return np.concatenate(blocks)


def megatron_tensors(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same weights as Megatron saves them: stacked by layer, fused, padded."""
    pad = np.full((PADDED - VOCAB, HIDDEN), 7.0, dtype=np.float32)
    layers = [f"model.layers.{i}." for i in range(LAYERS)]

    def stack(build: Any) -> np.ndarray:
        return np.stack([build(layer) for layer in layers])

    prefix = "decoder.layers."
    return {
        "embedding.word_embeddings.weight": np.concatenate([hf["model.embed_tokens.weight"], pad]),
        prefix + "self_attention.linear_qkv.layer_norm_weight": stack(
            lambda layer: hf[layer + "input_layernorm.weight"]
        ),
        prefix + "self_attention.linear_qkv.weight": stack(lambda layer: _qkv(hf, layer)),
        prefix + "self_attention.linear_proj.weight": stack(
            lambda layer: hf[layer + "self_attn.o_proj.weight"]
        ),
        prefix + "mlp.linear_fc1.layer_norm_weight": stack(
            lambda layer: hf[layer + "post_attention_layernorm.weight"]
        ),
        prefix + "mlp.linear_fc1.weight": stack(
            lambda layer: np.concatenate(
                [hf[layer + "mlp.gate_proj.weight"], hf[layer + "mlp.up_proj.weight"]]
            )
        ),
        prefix + "mlp.linear_fc2.weight": stack(lambda layer: hf[layer + "mlp.down_proj.weight"]),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": np.concatenate([hf["lm_head.weight"], pad]),
    }


class AttnBackend(enum.Enum):
    """Stands in for megatron.core.transformer.enums.AttnBackend when pickling."""

    auto = 5


@contextlib.contextmanager
def _as_megatron_class() -> Iterator[None]:
    """Pickle AttnBackend under Megatron's module name (pickle looks the class up there)."""
    name = "megatron.core.transformer.enums"
    module = types.ModuleType(name)
    module.AttnBackend = AttnBackend  # type: ignore[attr-defined]
    saved = (AttnBackend.__module__, sys.modules.get(name))
    AttnBackend.__module__ = name
    sys.modules[name] = module
    try:
        yield
    finally:
        AttnBackend.__module__ = saved[0]
        if saved[1] is None:
            del sys.modules[name]
        else:
            sys.modules[name] = saved[1]


def _args() -> argparse.Namespace:
    import torch

    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        group_query_attention=True, num_query_groups=GROUPS, kv_channels=HEAD_DIM,
        normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=True, position_embedding_type="rope",
        max_position_embeddings=32, vocab_size=VOCAB, padded_vocab_size=PADDED,
        params_dtype=torch.float32, attention_backend=AttnBackend.auto,
    )  # fmt: skip


def _megatron_metadata(folder: Path) -> None:
    """`.metadata` as megatron-core writes it: each layer saved as its own item `key@L` of
    shape (1, ...) becomes chunk L of the stacked tensor `key` (one chunk per layer), the
    planner data is gone, and each rank's save plan is kept (all_local_plans)."""
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    path = folder / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # our own file, written moments ago by torch
    entries: dict[str, Any] = {}
    storage = {}
    for index, info in metadata.storage_data.items():
        key, stacked, layer = index.fqn.partition("@")
        entry = metadata.state_dict_metadata[index.fqn]
        if not stacked:
            entries[key], storage[index] = entry, info
            continue
        size = (LAYERS, *entry.size[1:])
        whole = entries.setdefault(
            key, TensorStorageMetadata(entry.properties, torch.Size(size), [])
        )
        offsets = torch.Size((int(layer), *[0] * (len(size) - 1)))
        whole.chunks.append(ChunkStorageMetadata(offsets, entry.size))
        storage[MetadataIndex(key, offsets)] = info
    metadata.state_dict_metadata, metadata.storage_data = entries, storage
    metadata.planner_data = None
    plan = [WriteItem(index, WriteItemType.SHARD) for index in storage]
    metadata.all_local_plans = [SavePlan(plan)]
    path.write_bytes(pickle.dumps(metadata, protocol=4))


def build(folder: Path) -> Path:
    """Write the tiny checkpoint into `folder` (created)."""
    need("megatron.core")  # the arguments in common.pt hold megatron-core's own enums
    import torch
    import torch.distributed.checkpoint as dcp

    folder.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {}
    for name, array in megatron_tensors(hf_tensors()).items():
        if "layers." not in name:
            state[name] = torch.from_numpy(array)
            continue
        for layer in range(LAYERS):  # one chunk per layer, as Megatron saves them
            state[f"{name}@{layer}"] = torch.from_numpy(array[layer : layer + 1].copy())
    state["optimizer.state.exp_avg.output_layer.weight"] = torch.zeros(PADDED, HIDDEN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    _megatron_metadata(folder)
    with _as_megatron_class():
        torch.save(
            {"args": _args(), "iteration": 7, "checkpoint_version": 3.0}, folder / "common.pt"
        )
    backends = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    backends |= {"common_backend": "torch", "common_backend_version": 1}
    (folder / "metadata.json").write_text(json.dumps(backends))
    return folder


def tiny_megatron(folder: Path) -> Path:
    """A copy of tests/data/megatron-tiny in `folder`."""
    shutil.copytree(SAVED, folder)
    return folder


def config_file(folder: Path, **override: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({**CONFIG, **override}))
    return path


if __name__ == "__main__":
    build(Path(sys.argv[1]))
