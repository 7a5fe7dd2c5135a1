"""Findings that were false (or missed) on real checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import ckptfix
from tests.builders import Factory, Spec


def _codes(path: Path) -> set[str]:
    return {item.code for item in ckptfix.inspect(path).findings}


def test_tied_sharded_bin_total_counts_shared_storage_once(tmp_path: Path) -> None:
    """huggingface_hub.save_torch_state_dict counts a tied storage once in total_size."""
    import torch
    from huggingface_hub import save_torch_state_dict

    embed = torch.randn(64, 16)
    state = {"embed.weight": embed, "lm_head.weight": embed, "norm": torch.ones(16)}
    save_torch_state_dict(state, tmp_path, max_shard_size=3000, safe_serialization=False)
    assert (tmp_path / "pytorch_model.bin.index.json").exists()
    assert "index-total-size" not in _codes(tmp_path)


def test_llava_text_config_default_is_untied(factory: Factory) -> None:
    """Llava's text_config (llama) leaves tie_word_embeddings unset: llama's default is
    False, so a separate lm_head is expected, not a mismatch."""
    folder = factory.root / "llava"
    factory.safetensors(
        "llava/model.safetensors",
        [
            Spec("language_model.model.embed_tokens.weight", "F32", (8, 4)),
            Spec("language_model.lm_head.weight", "F32", (8, 4)),
        ],
    )
    (folder / "config.json").write_text(
        json.dumps({"model_type": "llava", "text_config": {"model_type": "llama"}})
    )
    assert "tied-config-mismatch" not in _codes(folder)


def test_llama_without_the_key_and_without_a_head_is_a_mismatch(factory: Factory) -> None:
    folder = factory.root / "m"
    factory.safetensors("m/model.safetensors", [Spec("model.embed_tokens.weight", "F32", (8, 4))])
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (item,) = [f for f in ckptfix.inspect(folder).findings if f.code == "tied-config-mismatch"]
    assert "transformers defaults to false for model_type llama" in item.message


def test_an_empty_tensor_is_contiguous(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "e.pt"
    torch.save({"e": torch.zeros(3, 0).t()}, path)  # a [0, 3] view with odd strides
    torch.save({"e": torch.zeros(3, 0)}, tmp_path / "f.pt")
    assert "non-contiguous" not in _codes(path)
    assert "non-contiguous" not in _codes(tmp_path / "f.pt")


def test_an_empty_name_in_a_pt_file(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "n.pt"
    torch.save({"": torch.ones(2), "w": torch.ones(2)}, path)
    assert "empty-name" in _codes(path)


def test_stale_total_size_is_seen_with_a_shard_missing(factory: Factory) -> None:
    """The bytes of the shards present are a lower bound of the true total."""
    folder = factory.sharded("m", [[Spec("a", "F32", (64,))], [Spec("b", "F32", (64,))]])
    index = folder / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    document["metadata"]["total_size"] = 100  # less than 'a' alone (256 bytes)
    index.write_text(json.dumps(document))
    (folder / "model-00002-of-00002.safetensors").unlink()
    report = ckptfix.inspect(folder)
    (item,) = [f for f in report.findings if f.code == "index-total-size"]
    assert "present already take 256 bytes, and a shard is missing" in item.message
