"""DeepSpeed universal checkpoints, written by DeepSpeed's own ds_to_universal from the ZeRO 1-3
fixtures (fp32 and bf16, with a tied weight, a frozen layer and buffers): read as the fp32
weights DeepSpeed's universal loader restores, and compared bitwise with
get_fp32_state_dict_from_zero_checkpoint on the original ZeRO checkpoint and with what the
universal files hold (torch.load, weights_only=True)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ckptfix.ops.diff import diff
from ckptfix.ops.hash import hash_checkpoint
from tests import hash_oracle
from tests import training_fixtures as fixtures
from tests.helpers import cli, torch_bytes
from tests.training_fixtures import UNIVERSAL, converted, zero_to_fp32

if TYPE_CHECKING:
    import torch

pytestmark = pytest.mark.slow
zero_saved = fixtures.zero_saved  # fixtures shared by the training tests
universal_saved = fixtures.universal_saved
TAG = "global_step2_universal"


def _held(folder: Path, name: str) -> torch.Tensor | None:
    """The weight a universal parameter file holds, as torch reads it."""
    import torch

    path = folder / "zero" / name / "fp32.pt"
    if not path.exists():
        return None
    held = torch.load(path, weights_only=True)
    return held["param"] if isinstance(held, dict) else held


def _model_states(folder: Path) -> dict[str, Any]:
    import torch

    first = sorted(folder.glob("*model_states.pt"))[0]
    return dict(torch.load(first, weights_only=False))  # our own fixture


@pytest.mark.parametrize("name", UNIVERSAL)
def test_universal_weights_are_what_zero_to_fp32_reconstructs(
    universal_saved: Path, tmp_path: Path, name: str
) -> None:
    folder = universal_saved / name / TAG
    oracle = zero_to_fp32(universal_saved / name)  # of the ZeRO checkpoint it was made from
    written, dropped = converted(folder, tmp_path / "out")
    assert dropped == {"head.weight": "embed.weight"}
    for key, tensor in oracle.items():
        got = written[dropped.get(key, key)]
        assert (got.dtype, got.shape) == (tensor.dtype, tensor.shape), key
        assert torch_bytes(got) == torch_bytes(tensor), key
    states = _model_states(folder)
    # stage 1 records no frozen parameters: zero_to_fp32.py loses them, ckptfix keeps `module`'s
    frozen = {"frozen.weight", "frozen.bias"} if name.startswith("zero1") else set()
    assert set(written) - set(oracle) == frozen
    for key in frozen:
        assert torch_bytes(written[key]) == torch_bytes(states["module"][key])
    trained = {key: shape for group in states["param_shapes"] for key, shape in group.items()}
    assert set(trained) == {"embed.weight", "body.weight", "body.bias"}
    for key, tensor in written.items():
        held = _held(folder, key)
        if key in trained:  # the file's own bytes (ZeRO-3 keeps them flat)
            assert held is not None, key
            assert torch_bytes(held.reshape(trained[key])) == torch_bytes(tensor), key
        elif held is not None:  # a copy of `module` made in fp32: the same values
            assert torch_bytes(held) == torch_bytes(tensor.float()), key


@pytest.mark.parametrize("name", ["zero2_bf16", "zero3_fp32"])
def test_hash_and_diff_see_the_same_model_as_the_zero_checkpoint(
    universal_saved: Path, tmp_path: Path, name: str
) -> None:
    original, folder = universal_saved / name, universal_saved / name / TAG
    digest = hash_checkpoint(folder).digest
    assert digest == hash_checkpoint(original).digest
    assert digest == hash_oracle.digest(zero_to_fp32(original))
    assert diff(folder, original).identical


def _left_out(folder: Path, trained: list[str]) -> tuple[int, int]:
    """Bytes and moment files a universal checkpoint holds beside the weights."""
    zero = folder / "zero"
    kept = [zero / key / moment for key in trained for moment in ("exp_avg.pt", "exp_avg_sq.pt")]
    other = [zero / key / "step.pt" for key in trained if (zero / key / "step.pt").exists()]
    files = [*kept, *other, zero / "optimizer_state.pt"]
    return sum(path.stat().st_size for path in files), len(kept)


@pytest.mark.parametrize("name", ["zero1_bf16", "zero3_bf16"])
def test_a_folder_with_latest_universal_is_the_universal_checkpoint(
    universal_saved: Path, tmp_path: Path, name: str
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    shutil.copytree(universal_saved / name / TAG, root / TAG)
    shutil.copy(universal_saved / name / "latest_universal", root)
    report = cli("inspect", root, "--json").json()
    assert report["format"] == "deepspeed"
    assert report["tensor_count"] == 8
    layout = report["layout"]
    stage = int(name[4])
    assert (layout["tag"], layout["step"], layout["stage"]) == (TAG, 2, stage)
    assert (layout["weights"], layout["world_size"]) == ("universal", 2)
    nbytes, moments = _left_out(root / TAG, ["embed.weight", "body.weight", "body.bias"])
    assert layout["left_out"]["parts"] == ["optimizer states"]
    assert (layout["left_out"]["tensor_bytes"], layout["left_out"]["tensors"]) == (nbytes, moments)
    human = cli("inspect", root)
    assert f"DeepSpeed ZeRO-{stage} · 2 rank(s) · tag {TAG} · step 2 · universal weights" in (
        human.stdout
    )


def test_latest_comes_before_latest_universal(universal_saved: Path) -> None:
    """What DeepSpeed loads unless told to load the universal checkpoint."""
    layout = cli("inspect", universal_saved / "zero2_fp32", "--json").json()["layout"]
    assert (layout["tag"], layout["weights"]) == ("global_step2", "master")


def test_module_weights_of_a_universal_checkpoint(universal_saved: Path, tmp_path: Path) -> None:
    folder = universal_saved / "zero2_bf16" / TAG
    module = _model_states(folder)["module"]
    written, dropped = converted(folder, tmp_path / "out", "--zero-weights", "module")
    assert set(written) | set(dropped) == set(module)
    for key, tensor in module.items():
        got = written[dropped.get(key, key)]
        assert (got.dtype, torch_bytes(got)) == (tensor.dtype, torch_bytes(tensor)), key
    stage3 = cli(
        "convert", universal_saved / "zero3_fp32" / TAG, "-o", tmp_path / "o", "--zero-weights",
        "module",
    )  # fmt: skip
    assert stage3.code == 2 and "ZeRO-3 checkpoint keeps no full weights" in stage3.stderr


def test_deepspeed_is_never_imported(universal_saved: Path, tmp_path: Path) -> None:
    """Nor torch, to inspect (as for any checkpoint)."""
    probe = (
        "import sys, ckptfix\n"
        "def imported(*names):\n"
        "    return sorted(m for m in sys.modules if m.split('.')[0] in names)\n"
        f"folders = [(n, sys.argv[1] + '/' + n + '/{TAG}') for n in ('zero2_bf16', 'zero3_bf16')]\n"
        "assert [ckptfix.inspect(folder).tensor_count for _, folder in folders] == [8, 8]\n"
        "assert imported('deepspeed', 'torch') == []\n"
        "for name, folder in folders:\n"
        "    ckptfix.hash_checkpoint(folder)\n"
        "    ckptfix.convert(folder, sys.argv[2] + '/' + name)\n"
        "print(imported('deepspeed'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(universal_saved), str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "[]"
    assert (tmp_path / "zero3_bf16" / "model.safetensors").is_file()


_CLI = "import sys\nfrom ckptfix.cli.app import main\nsys.argv = ['ckptfix', *sys.argv[1:]]\nmain()"


def _limited(limit: tuple[int, int], *args: str | Path) -> subprocess.CompletedProcess[str]:
    """The CLI in a process whose open-file limit is (soft, hard)."""
    import resource

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, limit)

    return subprocess.run(
        [sys.executable, "-c", _CLI, *map(str, args)],
        capture_output=True,
        text=True,
        preexec_fn=cap,
        timeout=600,
        check=False,
    )


def test_a_parameter_per_file_past_the_open_file_limit(
    universal_saved: Path, tmp_path: Path
) -> None:
    """1,500 parameters are 1,500 files, more than a hard limit of 1,024 open files: they are
    read through the bounded descriptor pool (io.descriptors), so inspect and convert work,
    bitwise, not an internal error."""
    import torch

    folder = tmp_path / TAG
    shutil.copytree(universal_saved / "zero2_fp32" / TAG, folder)
    states = _model_states(folder)
    extra = {f"extra.{i}.weight": torch.Size([2]) for i in range(1500)}
    for index, name in enumerate(extra):
        (folder / "zero" / name).mkdir()
        torch.save({"param": torch.full((2,), float(index))}, folder / "zero" / name / "fp32.pt")
        states["module"][name] = torch.zeros(2)
    states["param_shapes"].append(extra)
    torch.save(states, folder / "mp_rank_00_model_states.pt")
    capped = _limited((1024, 1024), "inspect", folder)
    assert capped.returncode == 0, capped.stderr
    converted = _limited((1024, 1024), "convert", folder, "-o", tmp_path / "out")
    assert converted.returncode == 0, converted.stderr
    from safetensors.torch import load_file

    written = load_file(tmp_path / "out" / "model.safetensors")
    for index in (0, 777, 1499):
        expected = torch.full((2,), float(index))
        assert torch_bytes(written[f"extra.{index}.weight"]) == torch_bytes(expected)
