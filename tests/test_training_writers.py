"""Checkpoints the frameworks write themselves (tests/training_writers.py), read as the model
they hold and compared bitwise with the frameworks' own consolidation or loader: torch's
per-rank HuggingFaceStorageWriter, accelerate's save_state and the Trainer under FSDP,
the Trainer's ZeRO-3 checkpoint-N/, Lightning's FSDP and DeepSpeed strategies."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests import training_fixtures as fixtures
from tests.helpers import assert_same_tensors as assert_same
from tests.helpers import cli
from tests.helpers import load_safetensors_folder as _safetensors

if TYPE_CHECKING:
    import torch

pytestmark = pytest.mark.slow
hf_writer_saved = fixtures.hf_writer_saved
accelerate_saved = fixtures.accelerate_saved
trainer_saved = fixtures.trainer_saved
lightning_saved = fixtures.lightning_saved
copy_of = fixtures.copy_of
Copy = Callable[[Path], Path]

# What a loader of the tiny Llama reads: the Trainer's save_pretrained and tokenizer files.
MODEL_FOLDER = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}


def _converted(source: Path, out: Path, *extra: str) -> dict[str, Any]:
    run = cli("convert", source, "-o", out, "--json", *extra)
    assert run.code == 0, run.stderr
    document: dict[str, Any] = run.json()
    return document


# --- torch's HuggingFaceStorageWriter, per rank -------------------------------------------


@pytest.mark.parametrize("name", ["per_rank", "two_files"])
def test_per_rank_files_convert_to_torchs_own_consolidation(
    hf_writer_saved: Path, tmp_path: Path, name: str
) -> None:
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    names = ["embed.weight", "wide.weight", "experts.weight", "norm.weight", "bias"]
    (tmp_path / "torch").mkdir()
    consolidate_safetensors_files(
        str(hf_writer_saved / name), str(tmp_path / "torch"), dict.fromkeys(names, 1)
    )
    oracle = _safetensors(tmp_path / "torch")
    assert oracle["embed.weight"].shape == (211, 48)
    # the writer's own consolidated output (enable_consolidation=True) is the same model
    assert_same(_safetensors(hf_writer_saved / "consolidated"), oracle)
    _converted(hf_writer_saved / name, tmp_path / "out")
    assert_same(_safetensors(tmp_path / "out"), oracle)


def test_per_rank_files_are_one_checkpoint(hf_writer_saved: Path) -> None:
    run = cli("inspect", hf_writer_saved / "two_files", "--json")
    assert run.code == 0, run.stdout
    report = run.json()
    assert report["tensor_count"] == 5
    assert report["layout"]["framework"] == "hf-storage"
    assert report["layout"]["world_size"] == 2
    codes = {item["code"] for item in report["findings"]}
    assert not codes & {"several-checkpoints", "tensor-piece", "mixed-formats"}, codes
    human = cli("inspect", hf_writer_saved / "per_rank").stdout
    assert "torch HuggingFaceStorageWriter, per rank · 2 rank(s)" in human


@pytest.mark.parametrize("rank", [1, 2])
def test_one_rank_file_says_it_holds_pieces(
    hf_writer_saved: Path, tmp_path: Path, rank: int
) -> None:
    """Alone, a rank's file is part of a model: an error naming the fix, and no conversion
    (it used to write half the embedding, `[106, 48]`, and call it verified)."""
    path = hf_writer_saved / "per_rank" / f"shard-0000{rank}-model-00001-of-00001.safetensors"
    run = cli("inspect", path, "--json")
    assert run.code == 1
    errors = [f for f in run.json()["findings"] if f["severity"] == "error"]
    assert [f["code"] for f in errors] == ["tensor-piece"]
    assert "pass the folder" in errors[0]["message"]
    converted = cli("convert", path, "-o", tmp_path / "out")
    assert converted.code == 1
    assert converted.error_lines[0].startswith(f"error: {path}: file is one rank's part")
    assert not (tmp_path / "out").exists()


# --- accelerate's save_state and the Trainer under FSDP -------------------------------------


def _merged(fsdp_folder: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """`accelerate merge-weights`, the library's own consolidation."""
    from accelerate.utils import merge_fsdp_weights

    out = tmp_path / "merged"
    merge_fsdp_weights(str(fsdp_folder), str(out), safe_serialization=True)
    return _safetensors(out)


def test_accelerate_save_state_is_read_as_its_model(accelerate_saved: Path, tmp_path: Path) -> None:
    folder = accelerate_saved / "state"
    oracle = _merged(folder / "pytorch_model_fsdp_0", tmp_path)
    report = cli("inspect", folder, "--json").json()
    assert report["tensor_count"] == len(oracle) == 21
    assert report["layout"]["saved_by"] == "accelerate"
    assert report["layout"]["model_folder"] == "pytorch_model_fsdp_0"
    document = _converted(folder, tmp_path / "out")
    assert_same(_safetensors(tmp_path / "out"), oracle)
    left = document["plan"]["left_out_reasons"]
    others = {p.name for p in folder.iterdir()} - {"pytorch_model_fsdp_0"}
    assert {"optimizer_0", "random_states_0.pkl"} <= others
    assert left == dict.fromkeys(others, "training state")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]


def test_several_accelerate_models_ask_which(accelerate_saved: Path, tmp_path: Path) -> None:
    folder = accelerate_saved / "two_models"
    report = cli("inspect", folder, "--json").json()
    codes = [item["code"] for item in report["findings"]]
    assert codes == ["several-checkpoints"]
    assert report["layout"]["separate"] == ["pytorch_model_fsdp_0", "pytorch_model_fsdp_1"]
    run = cli("convert", folder, "-o", tmp_path / "out")
    assert run.code == 2
    assert str(folder / "pytorch_model_fsdp_1") in run.error_lines[0]
    assert not (tmp_path / "out").exists()
    _converted(folder / "pytorch_model_fsdp_1", tmp_path / "one")
    assert_same(_safetensors(tmp_path / "one"), _merged(folder / "pytorch_model_fsdp_1", tmp_path))


@pytest.mark.parametrize(
    "case",
    [
        ("model.safetensors", ["pytorch_model_fsdp_0", "model.safetensors"]),
        ("rank-files", ["shard-*-model-*.safetensors", "pytorch_model_fsdp_0"]),
        ("dcp", [".metadata", "pytorch_model_fsdp_0"]),
    ],
)
def test_an_accelerate_folder_beside_another_checkpoint_asks_which(
    accelerate_saved: Path,
    hf_writer_saved: Path,
    lightning_saved: Path,
    copy_of: Copy,
    tmp_path: Path,
    case: tuple[str, list[str]],
) -> None:
    """save_state's model folder and another checkpoint in the same folder (a model file,
    a per-rank set, a DCP save): one was read and the other silently passed over (a
    model.safetensors was even 'left out: not read by a loader of the model'). Neither is
    chosen; convert asks which."""
    beside, separate = case
    folder = copy_of(accelerate_saved / "state")
    others = {
        "model.safetensors": [accelerate_saved / "plain_two" / "model.safetensors"],
        "rank-files": sorted((hf_writer_saved / "per_rank").iterdir()),
        "dcp": sorted((lightning_saved / "fsdp").iterdir()),
    }[beside]
    for path in others:
        shutil.copy(path, folder / path.name)
    report = cli("inspect", folder, "--json").json()
    assert [item["code"] for item in report["findings"]] == ["several-checkpoints"]
    assert report["layout"]["separate"] == separate
    run = cli("convert", folder, "-o", tmp_path / "out")
    assert run.code == 2 and len(run.error_lines) == 1, run.stderr
    assert f"pass the one to use, e.g. {folder / separate[-1]})" in run.error_lines[0]
    assert not (tmp_path / "out").exists()


def test_several_plain_accelerate_models_ask_which(accelerate_saved: Path, tmp_path: Path) -> None:
    """Without FSDP, save_state writes model.safetensors, model_1.safetensors, ...: separate
    models, not a model and a stray file (it used to take the first and call the other a
    second weight family to remove)."""
    from safetensors.torch import load_file

    folder = accelerate_saved / "plain_two"
    report = cli("inspect", folder, "--json").json()
    assert [item["code"] for item in report["findings"]] == ["several-checkpoints"]
    run = cli("convert", folder, "-o", tmp_path / "out")
    assert run.code == 2 and not (tmp_path / "out").exists()
    assert str(folder / "model.safetensors") in run.error_lines[0]
    _converted(folder / "model_1.safetensors", tmp_path / "one")
    assert_same(_safetensors(tmp_path / "one"), load_file(folder / "model_1.safetensors"))


def test_trainer_fsdp_sharded_checkpoint_is_its_model(trainer_saved: Path, tmp_path: Path) -> None:
    folder = trainer_saved / "fsdp_sharded" / "checkpoint-2"
    report = cli("inspect", folder, "--json").json()
    assert report["layout"]["saved_by"] == "transformers Trainer"
    assert report["layout"]["step"] == 2
    document = _converted(folder, tmp_path / "out")
    assert_same(_safetensors(tmp_path / "out"), _merged(folder / "pytorch_model_fsdp_0", tmp_path))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    assert set(document["plan"]["left_out"]) == {
        "optimizer_0",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "scheduler.pt",
        "trainer_state.json",
    }


def _loaded(out: Path) -> dict[str, torch.Tensor]:
    """The model transformers loads from a folder (config, weights) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("t5") == 5
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_trainer_fsdp_full_checkpoint_writes_a_model_folder(
    trainer_saved: Path, tmp_path: Path
) -> None:
    """model.safetensors is the model; accelerate's copy of it (pytorch_model_fsdp.bin),
    optimizer, scheduler, rng and trainer state stay behind, and are named."""
    from safetensors.torch import load_file

    folder = trainer_saved / "fsdp_full" / "checkpoint-2"
    report = cli("inspect", folder, "--json").json()
    assert not [f for f in report["findings"] if f["severity"] != "info"], report["findings"]
    run = cli("convert", folder, "-o", tmp_path / "out")
    assert run.code == 0, run.stderr
    assert "left out (training state): optimizer.bin, pytorch_model_fsdp.bin" in run.stdout
    assert {p.name for p in (tmp_path / "out").iterdir()} == MODEL_FOLDER | {"model.safetensors"}
    oracle = load_file(folder / "model.safetensors")
    assert_same(_safetensors(tmp_path / "out"), oracle)
    assert_same({k: v for k, v in _loaded(tmp_path / "out").items() if k in oracle}, oracle)


def test_trainer_zero3_checkpoint_writes_a_model_folder(
    trainer_saved: Path, tmp_path: Path
) -> None:
    """ZeRO-3 without gathered weights: the master weights as zero_to_fp32.py rebuilds them,
    with the config, generation config and tokenizer; no `global_step2/`, `latest` or rng."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = trainer_saved / "zero3" / "checkpoint-2"
    document = _converted(folder, tmp_path / "out")
    assert {p.name for p in (tmp_path / "out").iterdir()} == MODEL_FOLDER | {"model.safetensors"}
    assert set(document["plan"]["left_out"]) == {
        "latest",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "trainer_state.json",
        "zero_to_fp32.py",
        "zero_to_torch.py",
    }
    oracle = get_fp32_state_dict_from_zero_checkpoint(str(folder))
    assert_same(_safetensors(tmp_path / "out"), oracle)
    assert_same({k: v for k, v in _loaded(tmp_path / "out").items() if k in oracle}, oracle)


# --- Lightning's FSDP (sharded) and DeepSpeed strategies ------------------------------------


def _bare(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    assert all(name.startswith("model.") for name in state)
    return {name.removeprefix("model."): tensor for name, tensor in state.items()}


def test_lightning_fsdp_folder_loses_its_model_prefix(
    lightning_saved: Path, tmp_path: Path
) -> None:
    from lightning_fabric.utilities.load import _load_distributed_checkpoint

    folder = lightning_saved / "fsdp"
    report = cli("inspect", folder, "--json").json()
    assert report["layout"]["saved_by"] == "lightning"
    prefix = [f for f in report["findings"] if f["code"] == "wrapper-prefix"]
    assert len(prefix) == 1 and "'model.'" in prefix[0]["message"]
    _converted(folder, tmp_path / "out", "--strip-prefix", "auto")
    oracle = _load_distributed_checkpoint(folder)["model"]
    assert_same(_safetensors(tmp_path / "out"), _bare(oracle))


def test_lightning_deepspeed_folder_loses_its_model_prefix(
    lightning_saved: Path, tmp_path: Path
) -> None:
    import torch
    from pytorch_lightning.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    folder = lightning_saved / "deepspeed"
    report = cli("inspect", folder, "--json").json()
    assert report["layout"]["saved_by"] == "lightning"
    assert [f["code"] for f in report["findings"] if f["code"] == "wrapper-prefix"] == [
        "wrapper-prefix"
    ]
    _converted(folder, tmp_path / "out", "--strip-prefix", "auto")
    convert_zero_checkpoint_to_fp32_state_dict(str(folder), str(tmp_path / "lightning.pt"))
    oracle = torch.load(tmp_path / "lightning.pt", weights_only=False)["state_dict"]
    assert_same(_safetensors(tmp_path / "out"), _bare(oracle))
