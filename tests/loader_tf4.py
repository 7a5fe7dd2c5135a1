"""The transformers 4 side of the loader matrix, run by `.venv-tf4/bin/python` (transformers 4
and 5 cannot share one venv): it writes `.bin` inputs with `save_pretrained(
safe_serialization=False)` and loads checkpoints back with `from_pretrained`.

    python tests/loader_tf4.py build OUT      # OUT/<layout>/ and OUT/<layout>.<dtype>.pt
    python tests/loader_tf4.py load FOLDER RESULT.pt   # prints the loading info as JSON

Standalone on purpose: it imports only the standard library, torch and transformers (not
ckptfix, not the tests package), since the second venv holds nothing else that matters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TOKENS = [[2, 5, 7, 11, 13, 3]]


def _models() -> dict[str, Any]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    llama = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    gpt2 = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=32, bos_token_id=0)
    torch.manual_seed(0)
    return {
        "tf4-llama-bin": (LlamaForCausalLM(llama), None),
        "tf4-llama-bin-sharded": (LlamaForCausalLM(llama), "40KB"),
        "tf4-gpt2-tied-bin": (GPT2LMHeadModel(gpt2), None),
    }


def logits(folder: Path, dtype: Any) -> tuple[Any, dict[str, list[str]]]:
    """What transformers 4 computes from `folder` for TOKENS, and its loading info."""
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, output_loading_info=True
    )
    with torch.no_grad():
        result = model.eval()(torch.tensor(TOKENS)).logits
    keys = ("missing_keys", "unexpected_keys", "mismatched_keys")
    return result, {key: sorted(map(str, info.get(key, []))) for key in keys}


def build(out: Path) -> None:
    import torch

    for name, (model, max_shard) in _models().items():
        folder = out / name
        extra = {"max_shard_size": max_shard} if max_shard else {}
        model.save_pretrained(folder, safe_serialization=False, **extra)
        for label, dtype in (("keep", "auto"), ("bf16", torch.bfloat16)):
            result, info = logits(folder, dtype)
            assert not any(info.values()), info
            torch.save(result, out / f"{name}.{label}.pt")


def load(folder: Path, result_path: Path) -> None:
    import torch

    result, info = logits(folder, "auto")
    torch.save(result, result_path)
    print(json.dumps(info))


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")  # the caller judges results, not library chatter
    if sys.argv[1] == "build":
        build(Path(sys.argv[2]))
    else:
        load(Path(sys.argv[2]), Path(sys.argv[3]))
