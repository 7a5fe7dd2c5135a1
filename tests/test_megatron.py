"""Megatron-Core `torch_dist` checkpoints written by megatron-core itself (2 gloo ranks on CPU,
tests/megatron_writer.py), read by ckptfix: under Megatron's names, bitwise equal to
megatron-core's own `dist_checkpointing.load`; with --to-hf, bitwise equal to the transformers
model each started from, and that model, reloaded, computes Megatron's logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ckptfix.ops.hash import hash_checkpoint
from ckptfix.plan.select import OutTensor
from tests import hash_oracle
from tests import megatron_builders as tiny
from tests import training_fixtures as fixtures
from tests.helpers import (
    MemorySource,
    assert_same_tensors,
    cli,
    load_safetensors_folder,
    torch_bytes,
)
from tests.megatron_writer import TOKENS
from tests.optional import need

if TYPE_CHECKING:
    import torch

pytestmark = pytest.mark.slow
megatron_saved = fixtures.megatron_saved
HF_CASES = ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"]
CONVERT_ARGS = {"qwen2": ["--dtype", "bf16"]}  # bf16 weights, fp32 norms (torch.nn.RMSNorm)


def _oracle(folder: Path) -> dict[str, torch.Tensor]:
    import torch

    loaded: dict[str, torch.Tensor] = torch.load(folder / "oracle.pt", weights_only=True)
    return loaded


@pytest.mark.parametrize("case", [*HF_CASES, "gpt"])
def test_megatron_names_are_megatrons_own_load(
    megatron_saved: Path, tmp_path: Path, case: str
) -> None:
    ckpt = megatron_saved / case / "ckpt"
    run = cli("convert", ckpt, "-o", tmp_path / "out")
    assert run.code == 0, run.stderr
    oracle = _oracle(megatron_saved / case)
    assert_same_tensors(load_safetensors_folder(tmp_path / "out"), oracle)
    assert hash_checkpoint(ckpt).digest == hash_oracle.digest(oracle)


def _logits(model_folder: Path) -> torch.Tensor:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_folder)
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor(TOKENS)).logits.float()
    return logits


def _same_logits(model_folder: Path, case_folder: Path) -> None:
    import torch

    bf16 = "qwen2" in case_folder.name
    tolerance = 2e-2 if bf16 else 1e-5  # bf16 kernels of two libraries differ in rounding
    expected = torch.load(case_folder / "logits.pt", weights_only=True)
    torch.testing.assert_close(_logits(model_folder), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("case", HF_CASES)
def test_to_hf_is_the_model_it_started_from(
    megatron_saved: Path, tmp_path: Path, case: str
) -> None:
    folder = megatron_saved / case
    config = folder / "hf" / "config.json"
    args = CONVERT_ARGS.get(case, [])
    run = cli("convert", folder / "ckpt", "-o", tmp_path / "hf", "--to-hf", config, *args)
    assert run.code == 0, run.stderr
    assert_same_tensors(
        load_safetensors_folder(tmp_path / "hf"), load_safetensors_folder(folder / "hf")
    )
    _same_logits(tmp_path / "hf", folder)
    same = cli("diff", folder / "ckpt", folder / "hf", "--to-hf", config, "--json")
    document = same.json()
    assert not (document["only_in_a"] or document["only_in_b"] or document["bytes_changed"])
    # torch.nn.RMSNorm keeps the norms in F32 in a BF16 Megatron model: only their dtype differs
    original = load_safetensors_folder(folder / "hf")
    norms = sorted(n for n in original if "norm" in n) if case == "qwen2" else []
    assert [change["name"] for change in document["layout_changed"]] == norms
    assert same.code == (1 if norms else 0), same.stderr


def test_to_hf_from_the_training_arguments(megatron_saved: Path, tmp_path: Path) -> None:
    folder = megatron_saved / "llama"
    run = cli("convert", folder / "ckpt", "-o", tmp_path / "hf", "--to-hf", "llama")
    assert run.code == 0, run.stderr
    assert_same_tensors(
        load_safetensors_folder(tmp_path / "hf"), load_safetensors_folder(folder / "hf")
    )
    _same_logits(tmp_path / "hf", folder)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    original = json.loads((folder / "hf" / "config.json").read_text())
    for key in ("hidden_size", "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps"):
        assert written[key] == original[key], key


def test_bf16_conversion_sets_the_config_dtype(megatron_saved: Path, tmp_path: Path) -> None:
    folder = megatron_saved / "qwen2"
    config = json.loads((folder / "hf" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    edited = tmp_path / "config.json"
    edited.write_text(json.dumps({**config, "dtype": "float32"}, indent=3))
    run = cli(
        "convert", folder / "ckpt", "-o", tmp_path / "hf", "--to-hf", edited, "--dtype", "bf16"
    )
    assert run.code == 0, run.stderr
    text = (tmp_path / "hf" / "config.json").read_text()
    assert json.loads(text) == config and text.startswith('{\n   "')  # edited where it stood


def test_inspect_shows_what_megatron_saved(megatron_saved: Path) -> None:
    run = cli("inspect", megatron_saved / "llama" / "ckpt", "--json")
    assert run.code == 0, run.stderr
    layout = run.json()["layout"]
    assert layout["framework"] == "megatron" and layout["world_size"] == 2
    assert (layout["sharded_backend"], layout["common_backend"]) == ("torch_dist", "torch")
    assert layout["iteration"] == layout["step"] == 3 and layout["stacked_tensors"] == 6
    assert layout["architecture"]["num_query_groups"] == 2
    assert layout["architecture"]["params_dtype"] == "F32"
    left = layout["left_out"]
    assert left["parts"] == ["optimizer"] and left["tensors"] == 18  # exp_avg, exp_avg_sq
    assert left["other_items"] == 8  # _extra_state of 4 layers' modules, on 2 ranks
    codes = [item["code"] for item in run.json()["findings"]]
    assert codes == ["training-state"]


def test_the_wrong_family_is_refused_naming_both_sides(
    megatron_saved: Path, tmp_path: Path
) -> None:
    llama = megatron_saved / "llama" / "hf" / "config.json"
    run = cli("convert", megatron_saved / "gpt" / "ckpt", "-o", tmp_path / "a", "--to-hf", llama)
    assert run.code == 1 and len(run.error_lines) == 1, run.stderr
    assert "(rule megatron-unmapped;" in run.stderr or "(rule megatron-shape;" in run.stderr
    qwen3 = megatron_saved / "qwen3" / "hf" / "config.json"
    run = cli(
        "convert", megatron_saved / "qwen3_moe" / "ckpt", "-o", tmp_path / "b", "--to-hf", qwen3
    )
    assert run.code == 1 and "(rule " in run.stderr
    mixtral = megatron_saved / "mixtral" / "hf" / "config.json"
    run = cli(
        "convert", megatron_saved / "qwen3_moe" / "ckpt", "-o", tmp_path / "c", "--to-hf", mixtral
    )
    assert run.code == 1 and "q_layernorm" in run.stderr, run.stderr
    assert not any((tmp_path / name).exists() for name in "abc")


def test_diff_finds_swapped_and_missing_experts(megatron_saved: Path, tmp_path: Path) -> None:
    """What verl #2319 needed: a merge with wrong expert keys is found, every name listed."""
    from safetensors.torch import load_file, save_file

    folder = megatron_saved / "mixtral"
    tensors = load_file(folder / "hf" / "model.safetensors")
    expert = "model.layers.1.block_sparse_moe.experts.{}.{}.weight"
    for w in ("w1", "w2", "w3"):
        first, second = expert.format(0, w), expert.format(1, w)
        tensors[first], tensors[second] = tensors[second], tensors[first]
    del tensors[expert.format(3, "w2")]
    (tmp_path / "merged").mkdir()
    save_file(tensors, tmp_path / "merged" / "model.safetensors", metadata={"format": "pt"})
    config = folder / "hf" / "config.json"
    run = cli("diff", folder / "ckpt", tmp_path / "merged", "--to-hf", config, "--json")
    assert run.code == 1, run.stderr
    document = run.json()
    assert document["only_in_a"] == [expert.format(3, "w2")]
    changed = sorted(change["name"] for change in document["bytes_changed"])
    assert changed == sorted(expert.format(e, w) for e in (0, 1) for w in ("w1", "w2", "w3"))


def test_a_run_folder_reads_its_latest_iteration(megatron_saved: Path, tmp_path: Path) -> None:
    run_folder = tmp_path / "run"
    shutil.copytree(megatron_saved / "llama" / "ckpt", run_folder / "iter_0000003")
    (run_folder / "latest_checkpointed_iteration.txt").write_text("3\n")
    want = hash_checkpoint(megatron_saved / "llama" / "ckpt").digest
    assert hash_checkpoint(run_folder).digest == want
    (run_folder / "latest_checkpointed_iteration.txt").write_text("4")
    missing = cli("inspect", run_folder)
    assert missing.code == 1 and "(rule megatron-tracker;" in missing.stderr
    assert "no iter_0000004/" in missing.stderr


def test_a_megatron_folder_over_http(megatron_saved: Path, tmp_path: Path) -> None:
    need("aiohttp")
    from tests.remote_servers import copy_tree, http_server

    folder = megatron_saved / "qwen3"
    copy_tree(folder / "ckpt", tmp_path / "served" / "iter_0000007")
    config = folder / "hf" / "config.json"
    with http_server(tmp_path / "served") as server:
        url = f"{server.url}/iter_0000007"
        assert hash_checkpoint(url).digest == hash_checkpoint(folder / "ckpt").digest
        run = cli("convert", url, "-o", tmp_path / "hf", "--to-hf", config)
        assert run.code == 0, run.stderr
        same = cli("diff", url, folder / "hf", "--to-hf", config)
        assert same.code == 0, same.stdout + same.stderr
    assert_same_tensors(
        load_safetensors_folder(tmp_path / "hf"), load_safetensors_folder(folder / "hf")
    )


def test_the_tiny_test_data_is_what_its_builder_builds(tmp_path: Path) -> None:
    fresh = tiny.build(tmp_path / "fresh")
    assert hash_checkpoint(fresh).digest == hash_checkpoint(tiny.SAVED).digest
    layouts = [cli("inspect", folder, "--json").json()["layout"] for folder in (fresh, tiny.SAVED)]
    assert layouts[0] == layouts[1]


@pytest.mark.parametrize("variant", ["fully_parallel", "singleton"])
def test_megatron_cores_save_variants_read_the_same(
    megatron_saved: Path, tmp_path: Path, variant: str
) -> None:
    """The fully-parallel save wrapper (other rank files, the same tensors) and a save with
    every layer and expert under its own key: the same model, the same digest."""
    folder = megatron_saved / "mixtral"
    saved = folder / f"ckpt_{variant}"
    assert hash_checkpoint(saved).digest == hash_checkpoint(folder / "ckpt").digest
    layout = cli("inspect", saved, "--json").json()["layout"]
    assert (layout["stacked_tensors"] == 0) == (variant == "singleton"), layout
    config = folder / "hf" / "config.json"
    same = cli("diff", saved, folder / "hf", "--to-hf", config)
    assert same.code == 0, same.stdout + same.stderr


@pytest.mark.parametrize("case", [*HF_CASES, "gpt"])
def test_what_is_written_is_what_the_slow_path_gathers(
    megatron_saved: Path, tmp_path: Path, case: str
) -> None:
    """Every tensor converted (runs of the rank files read straight into place, in reused
    windows; fp32 and bf16, TP 1 and 2, EP 2, Megatron names for the GPT without a Hugging
    Face twin) equals the same mapping gathered the slow way: each rank file in memory, read
    once and copied into place (io.gather's path for a source that is not a local file)."""
    from ckptfix.io.gather import tensor_bytes
    from ckptfix.ops.tensorset import opened
    from ckptfix.ops.to_hf import hf_tensor_set

    folder = megatron_saved / case
    config = [] if case == "gpt" else ["--to-hf", folder / "hf" / "config.json"]
    run = cli("convert", folder / "ckpt", "-o", tmp_path / "out", *config)
    assert run.code == 0, run.stderr
    written = load_safetensors_folder(tmp_path / "out")
    with opened(folder / "ckpt") as tensors:
        mapped = hf_tensor_set(tensors, str(config[1])) if config else tensors
        labels = {piece.source for t in mapped.tensors.values() for piece in t.pieces}
        whole = {label: tensors.source(label) for label in labels}
        memory = {k: MemorySource(v.read_at(0, v.size), k) for k, v in whole.items()}
        slow = {name: tensor_bytes(memory.__getitem__, t) for name, t in mapped.tensors.items()}
    assert sorted(slow) == sorted(written)
    gathered = [t for t in mapped.tensors.values() if OutTensor.same(t).gathered_runs]
    assert gathered or case not in ("llama", "qwen2", "qwen3", "gpt")  # TP 2: column shards
    for name, tensor in written.items():
        assert torch_bytes(tensor) == slow[name], name
