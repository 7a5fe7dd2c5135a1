"""DeepSpeed ZeRO checkpoints (stages 1-3, fp32 and bf16, with a tied weight, a frozen
layer and buffers) written by DeepSpeed on CPU with gloo, converted to safetensors and
compared bitwise with DeepSpeed's own get_fp32_state_dict_from_zero_checkpoint."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptfix.ops.diff import diff
from ckptfix.ops.hash import hash_checkpoint
from ckptfix.ops.load import load
from tests import hash_oracle
from tests import training_fixtures as fixtures
from tests.helpers import cli, torch_bytes
from tests.training_fixtures import converted, zero_to_fp32
from tests.training_frameworks import ZERO_CONFIGS

pytestmark = pytest.mark.slow
zero_saved = fixtures.zero_saved  # fixtures shared by the training tests
copy_of = fixtures.copy_of
NAMES = [f"zero{stage}_{dtype}" for stage, dtype in ZERO_CONFIGS if stage]  # zero_to_fp32's


@pytest.mark.parametrize("name", NAMES)
def test_master_weights_are_what_zero_to_fp32_reconstructs(
    zero_saved: Path,
    tmp_path: Path,
    name: str,
) -> None:
    import torch

    oracle = zero_to_fp32(zero_saved / name)
    written, dropped = converted(zero_saved / name, tmp_path / "out")
    # the tied head is written once and recorded as an alias of the embedding
    assert dropped == {"head.weight": "embed.weight"}
    assert oracle["head.weight"] is oracle["embed.weight"]
    for key, tensor in oracle.items():
        got = written[dropped.get(key, key)]
        assert got.dtype == tensor.dtype, key
        assert got.shape == tensor.shape, key
        assert torch_bytes(got) == torch_bytes(tensor), key
    extra = set(written) - set(oracle)
    if name.startswith("zero1"):
        # DeepSpeed stage 1 records no frozen_param_shapes, so zero_to_fp32.py loses the
        # frozen layer; ckptfix takes it from `module` as saved
        assert extra == {"frozen.weight", "frozen.bias"}
        module = torch.load(
            zero_saved / name / "global_step2" / "mp_rank_00_model_states.pt",
            weights_only=False,
        )["module"]
        for key in extra:
            assert torch_bytes(written[key]) == torch_bytes(module[key])
            assert written[key].dtype == module[key].dtype
    else:
        assert extra == set()


@pytest.mark.parametrize("name", ["zero1_bf16", "zero2_fp32", "zero2_bf16"])
def test_module_weights_are_the_training_dtype_copy(
    zero_saved: Path,
    tmp_path: Path,
    name: str,
) -> None:
    import torch

    module = torch.load(
        zero_saved / name / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False
    )["module"]
    written, dropped = converted(zero_saved / name, tmp_path / "out", "--zero-weights", "module")
    assert dropped == {"head.weight": "embed.weight"}
    assert set(written) | set(dropped) == set(module)
    for key, tensor in module.items():
        got = written[dropped.get(key, key)]
        assert (got.dtype, got.shape) == (tensor.dtype, tensor.shape), key
        assert torch_bytes(got) == torch_bytes(tensor), key
    if name.endswith("bf16"):
        assert written["body.weight"].dtype == torch.bfloat16


def test_stage0_weights_are_the_module(zero_saved: Path, tmp_path: Path) -> None:
    """Stage 0 keeps no partitions (zero_to_fp32.py cannot read it): `module` is the model."""
    import torch

    module = torch.load(
        zero_saved / "zero0_fp32" / "global_step2" / "mp_rank_00_model_states.pt",
        weights_only=False,
    )["module"]
    written, dropped = converted(zero_saved / "zero0_fp32", tmp_path / "out")
    assert dropped == {"head.weight": "embed.weight"}
    for key, tensor in module.items():
        got = written[dropped.get(key, key)]
        assert (got.dtype, got.shape, torch_bytes(got)) == (
            tensor.dtype,
            tensor.shape,
            torch_bytes(tensor),
        )
    layout = cli("inspect", zero_saved / "zero0_fp32", "--json").json()["layout"]
    assert (layout["stage"], layout["weights"]) == (0, "module")


def test_stage3_has_no_module_weights(zero_saved: Path, tmp_path: Path) -> None:
    run = cli(
        "convert", zero_saved / "zero3_fp32", "-o", tmp_path / "o", "--zero-weights", "module"
    )
    assert run.code == 2
    assert run.error_lines == [
        "error: --zero-weights: module: a ZeRO-3 checkpoint keeps no full weights in `module` "
        "(only placeholders) (rule usage; use --zero-weights master)"
    ]
    assert not (tmp_path / "o").exists()


def test_tag_folder_itself_is_accepted(zero_saved: Path, tmp_path: Path) -> None:
    tag = zero_saved / "zero2_bf16" / "global_step2"
    oracle = zero_to_fp32(zero_saved / "zero2_bf16")
    written, dropped = converted(tag, tmp_path / "out")
    for key, tensor in oracle.items():
        assert torch_bytes(written[dropped.get(key, key)]) == torch_bytes(tensor)


@pytest.mark.parametrize("name", ["zero2_bf16", "zero3_fp32"])
def test_inspect_reports_stage_tag_and_optimizer_bytes(zero_saved: Path, name: str) -> None:
    run = cli("inspect", zero_saved / name, "--json")
    assert run.code == 0, run.stderr
    report = run.json()
    assert report["format"] == "deepspeed"
    layout = report["layout"]
    stage = int(name[4])
    assert layout["stage"] == stage
    assert layout["world_size"] == 2
    assert layout["tag"] == "global_step2" and layout["step"] == 2
    assert layout["weights"] == "master"
    left = layout["left_out"]
    assert left["parts"] == ["optimizer states"]
    assert left["tensor_bytes"] > 0
    # 13*6 + 5*6 + 5 + 6*5 + 6 + 4 + 3 parameters and buffers, and the tied head again
    assert report["parameter_count"] == 156 + 78
    assert report["tensor_count"] == 8
    assert any(item["code"] == "training-state" for item in report["findings"])
    human = cli("inspect", zero_saved / name)
    assert f"DeepSpeed ZeRO-{stage} · 2 rank(s) · tag global_step2 · step 2" in human.stdout


@pytest.mark.parametrize("name", ["zero2_bf16", "zero3_bf16", "zero3_fp32"])
def test_hash_is_the_digest_of_what_zero_to_fp32_reconstructs(
    zero_saved: Path, tmp_path: Path, name: str
) -> None:
    """hash and diff see the model a conversion writes: master weights, frozen parameters,
    the tied alias, and the bf16 buffer as the F32 that zero_to_fp32.py and convert write."""
    folder = zero_saved / name
    assert hash_checkpoint(folder).digest == hash_oracle.digest(zero_to_fp32(folder))
    converted(folder, tmp_path / "out")
    result = diff(folder, tmp_path / "out")
    assert result.identical, result.to_dict()
    run = cli("diff", folder, tmp_path / "out", "--values")
    assert run.code == 0 and run.stdout.startswith("identical: 8 tensors"), run.stdout


def test_a_dynamic_loss_scaler_is_read_as_data(
    zero_saved: Path, copy_of: Callable[[Path], Path], tmp_path: Path
) -> None:
    """fp16 runs save a DynamicLossScaler (which holds a torch dtype); DeepSpeed cannot train
    fp16 on CPU, so a saved stage-2 checkpoint gets one put in by DeepSpeed's own class."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    folder = copy_of(zero_saved / "zero2_fp32")
    for path in (folder / "global_step2").glob("*optim_states.pt"):
        states = torch.load(path, weights_only=False)  # our own fixture
        optimizer = states["optimizer_state_dict"]
        optimizer["loss_scaler"] = DynamicLossScaler(
            init_scale=2.0**16,
            scale_window=1000,
            min_scale=1.0,
            delayed_shift=2,
            consecutive_hysteresis=False,
            dtype=torch.float16,
        )
        optimizer["dynamic_loss_scale"] = True
        torch.save(states, path)
    oracle = zero_to_fp32(folder)
    written, dropped = converted(folder, tmp_path / "out")
    for key, tensor in oracle.items():
        assert torch_bytes(written[dropped.get(key, key)]) == torch_bytes(tensor), key


def test_deepspeed_is_never_imported(zero_saved: Path, tmp_path: Path) -> None:
    probe = (
        "import sys, ckptfix\n"
        "for name in ('zero2_bf16', 'zero3_bf16'):\n"
        "    folder = sys.argv[1] + '/' + name\n"
        "    assert ckptfix.inspect(folder).tensor_count == 8\n"
        "    ckptfix.convert(folder, sys.argv[2] + '/' + name)\n"
        "    ckptfix.hash_checkpoint(folder)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(zero_saved), str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "[]"
    assert (tmp_path / "zero3_bf16" / "model.safetensors").is_file()


def test_buffers_are_written_in_fp32_like_zero_to_fp32(zero_saved: Path) -> None:
    with load(zero_saved / "zero2_bf16") as checkpoint:
        assert checkpoint.training is not None
        tensors = {t.name: t for t in checkpoint.tensors}
        assert tensors["half_scale"].dtype == "BF16"  # as stored
        assert checkpoint.training.dtypes == {"half_scale": "F32"}  # as written
        # master weights are byte ranges of the optimizer partitions
        embed = tensors["embed.weight"]
        assert all("optim_states" in piece.source for piece in embed.pieces)
        assert sum(piece.nbytes for piece in embed.pieces) == 13 * 6 * 4


def test_a_trainer_folder_with_weights_stays_a_hugging_face_folder(
    zero_saved: Path, tmp_path: Path
) -> None:
    import shutil

    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "checkpoint-2"
    shutil.copytree(zero_saved / "zero2_fp32", folder)
    save_file({"w": torch.zeros(2)}, folder / "model.safetensors", {"format": "pt"})
    assert cli("inspect", folder, "--json").json()["format"] == "folder"
    assert cli("inspect", folder / "global_step2", "--json").json()["format"] == "deepspeed"
