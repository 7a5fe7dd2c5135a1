"""What ckptfix writes loads unchanged in the real consumers, values compared bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from safetensors import safe_open

from tests.builders import tiny_models
from tests.helpers import cli, torch_bytes

if TYPE_CHECKING:
    import torch

# Every test here loads real transformers, huggingface_hub or accelerate models.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """Each model saved with torch.save(state_dict()), then `ckptfix convert`ed (sharded)."""
    import torch

    result = {}
    for name, model in tiny_models().items():
        root = tmp_path_factory.mktemp(name)
        source = root / "src"
        source.mkdir()
        model.config.save_pretrained(source)
        torch.save(model.state_dict(), source / "pytorch_model.bin")
        out = root / "out"
        run = cli("convert", source, "-o", out, "--max-shard", "30KB")
        assert run.code == 0, run.stderr
        result[name] = (model, out)
    return result


@pytest.mark.parametrize("name", ["llama-untied", "gpt2-tied"])
def test_safetensors_load_file_and_safe_open(converted: dict, name: str) -> None:
    from safetensors.torch import load_file

    model, out = converted[name]
    state = model.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        loaded.update(load_file(shard))
        with safe_open(str(shard), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                assert torch_bytes(handle.get_tensor(key)) == torch_bytes(state[key])
    for key, tensor in loaded.items():
        assert torch_bytes(tensor) == torch_bytes(state[key])


@pytest.mark.parametrize("name", ["llama-untied", "gpt2-tied"])
def test_transformers_from_pretrained(converted: dict, name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model, out = converted[name]
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for key, tensor in loaded.state_dict().items():
        assert torch_bytes(tensor) == torch_bytes(model.state_dict()[key]), key
    tokens = torch.tensor([[2, 5, 7, 11]])
    with torch.no_grad():
        assert torch.equal(loaded.eval()(tokens).logits, model(tokens).logits)


@pytest.mark.parametrize("name", ["llama-untied", "gpt2-tied"])
def test_huggingface_hub_load_torch_model(converted: dict, name: str) -> None:
    from huggingface_hub import load_torch_model

    model, out = converted[name]
    fresh = type(model)(model.config)
    load_torch_model(fresh, out, strict=False)
    if name == "gpt2-tied":
        fresh.tie_weights()  # the dropped alias is restored by tying, as transformers does
    for key, tensor in fresh.state_dict().items():
        assert torch_bytes(tensor) == torch_bytes(model.state_dict()[key]), key


@pytest.mark.parametrize("name", ["llama-untied", "gpt2-tied"])
def test_accelerate_load_checkpoint_in_model(converted: dict, name: str) -> None:
    from accelerate.utils import load_checkpoint_in_model

    model, out = converted[name]
    fresh = type(model)(model.config)
    load_checkpoint_in_model(fresh, str(out))
    if name == "gpt2-tied":
        fresh.tie_weights()
    for key, tensor in fresh.state_dict().items():
        assert torch_bytes(tensor) == torch_bytes(model.state_dict()[key]), key


def test_torch_output_loads_weights_only(converted: dict, tmp_path: Path) -> None:
    import torch

    model, out = converted["llama-untied"]
    torch_out = tmp_path / "torch"
    assert cli("convert", out, "-o", torch_out, "--to", "torch", "--max-shard", "30KB").code == 0
    loaded: dict[str, torch.Tensor] = {}
    for shard in sorted(torch_out.glob("pytorch_model*.bin")):
        loaded.update(torch.load(shard, weights_only=True))
    assert loaded.keys() == model.state_dict().keys()
    for key, tensor in loaded.items():
        assert torch_bytes(tensor) == torch_bytes(model.state_dict()[key])
