"""What `ckptfix.save` and `ckptfix.Writer` write, loaded by transformers' from_pretrained:
the same logits as the model saved, tied and untied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ckptfix
from tests.builders import tiny_gpt2, tiny_llama

pytestmark = pytest.mark.slow

MODELS = {
    "llama-untied": lambda: tiny_llama(bos_token_id=0, eos_token_id=1),
    "llama-tied": lambda: tiny_llama(bos_token_id=0, eos_token_id=1, tie_word_embeddings=True),
    "gpt2-tied": tiny_gpt2,
}


def _logits(model: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(torch.arange(12).reshape(2, 6)).logits


def _loaded(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_from_pretrained_loads_what_save_writes(tmp_path: Path, name: str) -> None:
    import torch

    model = MODELS[name]()
    result = ckptfix.save(
        model.state_dict(), tmp_path / "out", max_shard=20_000, config=model.config.to_dict()
    )
    assert result.index is not None  # sharded, so the index is read too
    if name.endswith("-tied") and name.startswith("llama"):
        assert result.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert torch.equal(_logits(_loaded(tmp_path / "out")), _logits(model))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_from_pretrained_loads_what_a_writer_writes(tmp_path: Path, name: str) -> None:
    import torch

    model = MODELS[name]()
    with ckptfix.Writer(
        tmp_path / "out", max_shard=20_000, config=model.config.to_dict()
    ) as writer:
        for key, tensor in model.state_dict().items():
            writer.add(key, tensor.clone())  # a tensor made, written, dropped
    assert torch.equal(_logits(_loaded(tmp_path / "out")), _logits(model))
