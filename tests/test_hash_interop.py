"""Cross-format identity on real checkpoints: what transformers, torch.save, safetensors,
huggingface_hub and ckptfix itself write of one model hashes alike and diffs as identical."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ckptfix.ops.diff import diff
from ckptfix.ops.hash import hash_checkpoint
from tests import hash_oracle as oracle
from tests.builders import tiny_models
from tests.helpers import cli
from tests.optional import needs

if TYPE_CHECKING:
    import torch

pytestmark = [needs("huggingface_hub", "transformers"), pytest.mark.slow]


@pytest.fixture(scope="module")
def saved(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, Path]]]:
    import torch
    from huggingface_hub import save_torch_state_dict

    result = {}
    for name, model in tiny_models().items():
        root = tmp_path_factory.mktemp(name)
        state = model.state_dict()
        paths = {
            "torch.save": root / "pytorch_model.bin",
            "torch.save legacy": root / "legacy.bin",
            "save_pretrained": root / "pretrained",
            "save_pretrained bin": root / "pretrained-bin",
            "save_torch_state_dict": root / "hub",
            "ckptfix convert": root / "converted",
        }
        torch.save(state, paths["torch.save"])
        torch.save(state, paths["torch.save legacy"], _use_new_zipfile_serialization=False)
        model.save_pretrained(paths["save_pretrained"], max_shard_size="20KB")
        model.save_pretrained(paths["save_pretrained bin"], safe_serialization=False)
        paths["save_torch_state_dict"].mkdir()
        # a copy: save_torch_state_dict removes the tied names it drops from the dict it is given
        save_torch_state_dict(dict(state), paths["save_torch_state_dict"], max_shard_size="20KB")
        run = cli(
            "convert", paths["torch.save"], "-o", paths["ckptfix convert"], "--max-shard", "20KB"
        )
        assert run.code == 0, run.stderr
        result[name] = (state, paths)
    return result


def test_untied_model_is_identical_in_every_form(saved: dict) -> None:
    state, paths = saved["llama-untied"]
    expected = oracle.digest(state)
    for label, path in paths.items():
        assert hash_checkpoint(path).digest == expected, label
    assert diff(paths["torch.save"], paths["save_pretrained"]).identical
    run = cli("diff", paths["torch.save legacy"], paths["ckptfix convert"])
    assert run.code == 0
    assert run.stdout.startswith(f"identical: {len(state)} tensors")


def test_tied_model_and_its_deduplicated_forms(saved: dict) -> None:
    """torch.save keeps both tied names; ckptfix's record keeps the dropped name; the
    writers that drop a tied name without a record hash without it, and diff says so."""
    state, paths = saved["gpt2-tied"]
    expected = oracle.digest(state)
    for label in ("torch.save", "torch.save legacy", "ckptfix convert"):
        assert hash_checkpoint(paths[label]).digest == expected, label
    assert diff(paths["torch.save"], paths["ckptfix convert"]).identical
    tied = {"lm_head.weight", "transformer.wte.weight"}
    for label in ("save_pretrained", "save_torch_state_dict"):
        result = diff(paths["torch.save"], paths[label])
        assert len(result.only_in_a) == 1 and result.only_in_a[0] in tied, label
        assert not (result.only_in_b or result.layout_changed or result.bytes_changed), label
        stored = {k: v for k, v in state.items() if k != result.only_in_a[0]}
        assert hash_checkpoint(paths[label]).digest == oracle.digest(stored), label


def test_a_safetensors_copy_of_each_tensor(saved: dict, tmp_path: Path) -> None:
    """safetensors.save_file of clones: the reference writer's own layout and metadata."""
    from safetensors.torch import save_file

    state, paths = saved["llama-untied"]
    save_file(
        {k: v.contiguous().clone() for k, v in state.items()}, str(tmp_path / "m.safetensors")
    )
    assert cli("diff", tmp_path / "m.safetensors", paths["save_pretrained bin"]).code == 0
