"""Build small sample model folders with real, typical problems for `make demo`.

Usage: python scripts/make_demo.py OUT_FOLDER

OUT_FOLDER/sample-model is broken beyond a rewrite, on purpose:
- the index is stale: a wrong total_size, a tensor mapped to the wrong shard;
- shard 2 was written by plain `save_file` (no "format" metadata) and holds a tensor the
  index forgot;
- shard 3 holds an lm_head of more than 2^31 elements (a sparse file: no real disk used);
- a stale single-file `model.safetensors` from an older export sits beside the shards;
- `pytorch_model.bin` is a Git LFS pointer that was never pulled.

OUT_FOLDER/fixable-model only has warnings, which `ckptfix reshard` repairs: three shards
of very different sizes written without "format" metadata, and a stale total_size.

OUT_FOLDER/torch-model/pytorch_model.bin is what `torch.save(model.state_dict())` gives for a
small model with tied embeddings, q/k/v as views of one fused buffer and a transposed
weight: safetensors refuses to save it as it is; `ckptfix convert` fixes all three.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

from ckptfix.formats.safetensors import HeaderEntry, encode_header

HIDDEN, VOCAB, BIG_VOCAB = 64, 256, 131_072


def write(
    path: Path,
    tensors: list[tuple[str, str, tuple[int, ...]]],
    metadata: dict[str, str] | None,
    sparse_tail: int = 0,
) -> int:
    """Write a safetensors file with random bytes; the last `sparse_tail` bytes are a hole."""
    rng = random.Random(path.name)
    entries, offset = [], 0
    for name, dtype, shape in tensors:
        size = 2 if dtype == "BF16" else 4
        for dim in shape:
            size *= dim
        entries.append(HeaderEntry(name, dtype, shape, offset, offset + size))
        offset += size
    header = encode_header(entries, metadata)
    with open(path, "wb") as handle:
        handle.write(header)
        handle.write(rng.randbytes(offset - sparse_tail))
        handle.truncate(len(header) + offset)
    return offset


def layer(index: int) -> list[tuple[str, str, tuple[int, ...]]]:
    prefix = f"model.layers.{index}"
    return [
        (f"{prefix}.self_attn.q_proj.weight", "BF16", (HIDDEN, HIDDEN)),
        (f"{prefix}.self_attn.k_proj.weight", "BF16", (HIDDEN, HIDDEN)),
        (f"{prefix}.self_attn.v_proj.weight", "BF16", (HIDDEN, HIDDEN)),
        (f"{prefix}.self_attn.o_proj.weight", "BF16", (HIDDEN, HIDDEN)),
        (f"{prefix}.mlp.down_proj.weight", "BF16", (HIDDEN, 4 * HIDDEN)),
        (f"{prefix}.input_layernorm.weight", "BF16", (HIDDEN,)),
    ]


def broken_model(out: Path) -> None:
    out.mkdir(parents=True)
    meta = {"format": "pt"}
    shard1 = [("model.embed_tokens.weight", "BF16", (VOCAB, HIDDEN)), *layer(0)]
    shard2 = [*layer(1), ("model.layers.1.self_attn.rotary_emb.inv_freq", "F32", (HIDDEN // 2,))]
    head = ("lm_head.weight", "BF16", (BIG_VOCAB, 16_385))  # 2,147,614,720 elements
    names = [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    write(out / names[0], shard1, meta)
    write(out / names[1], shard2, None)
    write(
        out / names[2],
        [head, ("model.norm.weight", "BF16", (HIDDEN,))],
        meta,
        sparse_tail=BIG_VOCAB * 16_385 * 2,
    )
    weight_map = {name: names[0] for name, _, _ in shard1}
    weight_map.update({name: names[1] for name, _, _ in layer(1)})
    weight_map["model.layers.1.mlp.down_proj.weight"] = names[0]  # stale entry
    weight_map.update({"lm_head.weight": names[2], "model.norm.weight": names[2]})
    index = {
        "metadata": {"total_size": 123_456_789},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    write(out / "model.safetensors", shard1, meta)  # stale single-file export
    (out / "pytorch_model.bin").write_text(
        "version https://git-lfs.github.com/spec/v1\n"
        "oid sha256:4f1d0c2be6a1e2f35a8a4c0e7d9d1b2c3a4f5e6d7c8b9a0f1e2d3c4b5a697887\n"
        "size 4294967296\n"
    )
    write_config(out, tie=False)


def fixable_model(out: Path) -> None:
    out.mkdir(parents=True)
    tensors = [("model.embed_tokens.weight", "BF16", (VOCAB, HIDDEN))]
    for index in range(6):
        tensors += layer(index)
    tensors += [
        ("model.norm.weight", "BF16", (HIDDEN,)),
        ("lm_head.weight", "BF16", (VOCAB, HIDDEN)),
    ]
    cuts = [(0, 3), (3, 30), (30, len(tensors))]  # 3 shards of very different sizes
    weight_map = {}
    for number, (begin, end) in enumerate(cuts, start=1):
        name = f"model-{number:05d}-of-{len(cuts):05d}.safetensors"
        write(out / name, tensors[begin:end], None)
        weight_map.update({tensor: name for tensor, _, _ in tensors[begin:end]})
    index = {"metadata": {"total_size": 1}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text("{}\n")
    write_config(out, tie=False)


def write_config(out: Path, *, tie: bool) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "vocab_size": VOCAB,
        "tie_word_embeddings": tie,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text("{}\n")


def torch_model(out: Path) -> None:
    import torch  # installed by `make demo`; the other samples need nothing but ckptfix

    out.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=generator))
    state: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for index in range(2):
        prefix = f"model.layers.{index}"
        qkv = torch.randn(3 * HIDDEN, HIDDEN, generator=generator)  # one fused buffer
        state[f"{prefix}.self_attn.q_proj.weight"] = qkv[:HIDDEN]
        state[f"{prefix}.self_attn.k_proj.weight"] = qkv[HIDDEN : 2 * HIDDEN]
        state[f"{prefix}.self_attn.v_proj.weight"] = qkv[2 * HIDDEN :]
        # stored transposed, as some training code keeps it
        state[f"{prefix}.self_attn.o_proj.weight"] = torch.randn(
            HIDDEN, HIDDEN, generator=generator
        ).t()
        state[f"{prefix}.input_layernorm.weight"] = torch.ones(HIDDEN)
    state["model.norm.weight"] = torch.ones(HIDDEN)
    state["lm_head.weight"] = embed  # tied to the embeddings
    torch.save(state, out / "pytorch_model.bin")
    write_config(out, tie=True)


def main(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    broken_model(out / "sample-model")
    fixable_model(out / "fixable-model")
    torch_model(out / "torch-model")
    print(f"wrote sample model folders sample-model, fixable-model and torch-model in {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_demo.py OUT_FOLDER")
    main(Path(sys.argv[1]))
