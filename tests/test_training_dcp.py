"""torch.distributed.checkpoint folders written by 2 gloo ranks (FSDP2 and hand-placed
DTensors), converted to safetensors and compared bitwise with torch's own reading of them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ckptfix.ops.diff import diff
from ckptfix.ops.hash import hash_checkpoint
from ckptfix.ops.load import load
from tests import hash_oracle
from tests import training_fixtures as fixtures
from tests.helpers import assert_same_tensors, cli, torch_bytes

if TYPE_CHECKING:
    import torch

pytestmark = pytest.mark.slow
dcp_saved = fixtures.dcp_saved  # fixtures shared by the training tests
copy_of = fixtures.copy_of


def _written(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def _torch_reading(folder: Path, tmp_path: Path) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp_path / "torch.pt"
    dcp_to_torch_save(folder, target)
    loaded: dict[str, Any] = torch.load(target, weights_only=True)
    return loaded


def test_torch_save_format_converts_to_what_dcp_to_torch_save_reads(
    dcp_saved: Path,
    tmp_path: Path,
) -> None:
    import torch

    oracle = _torch_reading(dcp_saved / "torch_save", tmp_path)["model"]
    run = cli("convert", dcp_saved / "torch_save", "-o", tmp_path / "out")
    assert run.code == 0, run.stderr
    assert_same_tensors(_written(tmp_path / "out"), oracle)
    # the gathered tensors the ranks saved are what torch reads back too
    assert_same_tensors(oracle, torch.load(dcp_saved / "reference.pt", weights_only=True))


def test_safetensors_format_converts_to_the_gathered_tensors(
    dcp_saved: Path,
    tmp_path: Path,
) -> None:
    # torch 2.13's own FileSystemReader cannot read this format back (it torch.loads the
    # safetensors bytes); the oracle is the full tensors the ranks gathered when saving.
    import torch

    reference = torch.load(dcp_saved / "reference.pt", weights_only=True)
    run = cli("convert", dcp_saved / "safetensors", "-o", tmp_path / "out")
    assert run.code == 0, run.stderr
    assert_same_tensors(_written(tmp_path / "out"), reference)


def test_older_metadata_without_version_or_transforms(
    dcp_saved: Path, copy_of: Any, tmp_path: Path
) -> None:
    """`.metadata` as older torch wrote it: no `version`, no `storage_meta`, no
    `transform_descriptors` in any _StorageInfo."""
    import torch

    folder = copy_of(dcp_saved / "torch_save")

    def age(metadata: Any) -> None:
        for attribute in ("version", "storage_meta"):
            vars(metadata).pop(attribute, None)
        for info in metadata.storage_data.values():
            vars(info).pop("transform_descriptors", None)

    fixtures.edit_metadata(folder, age)
    raw = (folder / ".metadata").read_bytes()
    assert b"version" not in raw and b"transform_descriptors" not in raw
    run = cli("convert", folder, "-o", tmp_path / "out")
    assert run.code == 0, run.stderr
    assert_same_tensors(
        _written(tmp_path / "out"), torch.load(dcp_saved / "reference.pt", weights_only=True)
    )
    layouts = [
        cli("inspect", f, "--json").json()["layout"] for f in (folder, dcp_saved / "torch_save")
    ]
    assert layouts[0] == layouts[1]


def test_hash_is_the_gathered_model_in_both_formats(dcp_saved: Path, tmp_path: Path) -> None:
    import torch

    expected = hash_oracle.digest(torch.load(dcp_saved / "reference.pt", weights_only=True))
    for serialization in ("torch_save", "safetensors"):
        assert hash_checkpoint(dcp_saved / serialization).digest == expected, serialization
    assert diff(dcp_saved / "torch_save", dcp_saved / "safetensors").identical
    assert cli("convert", dcp_saved / "safetensors", "-o", tmp_path / "out").code == 0
    assert diff(dcp_saved / "torch_save", tmp_path / "out").identical


def test_flat_app_state_takes_the_top_level_tensors(
    dcp_saved: Path,
    tmp_path: Path,
) -> None:
    import torch

    oracle = _torch_reading(dcp_saved / "flat", tmp_path)
    model = {k: v for k, v in oracle.items() if isinstance(v, torch.Tensor)}
    run = cli("convert", dcp_saved / "flat", "-o", tmp_path / "out")
    assert run.code == 0, run.stderr
    assert_same_tensors(_written(tmp_path / "out"), model)


def test_inspect_reports_the_layout_and_what_is_left_out(dcp_saved: Path) -> None:
    for serialization in ("torch_save", "safetensors"):
        run = cli("inspect", dcp_saved / serialization, "--json")
        assert run.code == 0, run.stderr
        report = run.json()
        assert report["format"] == "dcp"
        assert report["tensor_count"] == 11
        assert report["parameter_count"] == 35 + 7 + 21 + 3 + 24 + 15 + 30 + 3 + 7 + 1 + 4
        layout = report["layout"]
        assert layout["framework"] == "dcp"
        assert layout["world_size"] == 2
        assert layout["serialization"] == serialization
        assert layout["model_key"] == "model"
        left = layout["left_out"]
        assert left["parts"] == ["optim", "train_state"]
        assert left["tensors"] == 12  # exp_avg, exp_avg_sq, step of 4 parameters
        assert left["tensor_bytes"] == 2 * (35 + 7 + 21 + 3) * 4 + 4 * 4
        assert left["other_items"] >= 2
        codes = {item["code"] for item in report["findings"]}
        assert "training-state" in codes
        assert not [f for f in report["findings"] if f["severity"] == "error"]


def test_human_report_names_the_layout(dcp_saved: Path) -> None:
    run = cli("inspect", dcp_saved / "torch_save")
    assert run.code == 0
    assert "torch.distributed.checkpoint · 2 rank(s) · torch_save chunks" in run.stdout
    assert "training-state" in run.stdout


def test_chunks_become_ranges_or_row_pieces(dcp_saved: Path) -> None:
    with load(dcp_saved / "torch_save") as checkpoint:
        tensors = {t.name: t for t in checkpoint.tensors}
        sources = set(checkpoint.sources)
    # FSDP2 Shard(0), uneven (4 + 3 rows): two contiguous ranges, kernel copies
    rows = tensors["0.weight"].pieces
    assert [(p.count, p.length, p.at) for p in rows] == [(1, 80, 0), (1, 60, 80)]
    # Shard(1) of a 4x6 bf16 matrix: one piece per rank of 4 runs of 3 elements
    wide = tensors["wide.weight"].pieces
    assert [(p.count, p.length, p.at, p.tensor_step) for p in wide] == [
        (4, 6, 0, 12),
        (4, 6, 6, 12),
    ]
    # Shard(2) of a 2x3x5 tensor (3 + 2 columns): 6 runs per rank
    experts = tensors["experts.weight"].pieces
    assert [(p.count, p.length, p.at) for p in experts] == [(6, 12, 0), (6, 8, 12)]
    # Replicate() is written once; the 0-d tensor is one element
    assert len(tensors["norm.weight"].pieces) == 1
    assert tensors["scale"].shape == () and tensors["scale"].nbytes == 4
    # pieces point into the rank files themselves, never into a copy
    assert {p.source for t in tensors.values() for p in t.pieces} <= sources
    assert all(p.source.endswith(".distcp") for t in tensors.values() for p in t.pieces)


def test_key_picks_another_part_of_the_app_state(dcp_saved: Path, tmp_path: Path) -> None:
    run = cli("convert", dcp_saved / "torch_save", "-o", tmp_path / "o", "--key", "optim", "--json")
    assert run.code == 0, run.stderr
    written = _written(tmp_path / "o")
    assert "state.0.weight.exp_avg" in written
    oracle = _torch_reading(dcp_saved / "torch_save", tmp_path)["optim"]["state"]
    assert torch_bytes(written["state.0.weight.exp_avg"]) == torch_bytes(
        oracle["0.weight"]["exp_avg"]
    )
    missing = cli("inspect", dcp_saved / "torch_save", "--json")
    assert missing.code == 0
    bad = cli("convert", dcp_saved / "torch_save", "-o", tmp_path / "x", "--key", "nope")
    assert bad.code == 2
    assert bad.error_lines == [
        f"error: --key: {dcp_saved / 'torch_save'} has no tensors at key 'nope' "
        "(rule usage; keys with tensors: model, optim)"
    ]
    assert not (tmp_path / "x").exists()


def test_convert_options_work_on_dcp(dcp_saved: Path, tmp_path: Path) -> None:
    import torch

    reference = torch.load(dcp_saved / "reference.pt", weights_only=True)
    out = tmp_path / "out"
    run = cli(
        "convert", dcp_saved / "torch_save", "-o", out, "--dtype", "bf16",
        "--exclude", "plain.*", "--max-shard", "300", "--json",
    )  # fmt: skip
    assert run.code == 0, run.stderr
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    written = _written(out)
    assert "plain.bias" not in written
    for name, tensor in reference.items():
        if name == "plain.bias":
            continue
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert torch_bytes(written[name]) == torch_bytes(want), name
        assert written[name].dtype == want.dtype
    dry = cli("convert", dcp_saved / "torch_save", "-o", tmp_path / "dry", "--dry-run", "--json")
    assert dry.code == 0
    assert dry.json()["written"] is None and not (tmp_path / "dry").exists()


def test_inspect_of_training_folders_imports_no_torch(dcp_saved: Path) -> None:
    probe = (
        "import sys, ckptfix\n"
        "report = ckptfix.inspect(sys.argv[1])\n"
        "assert report.tensor_count == 11, report.tensor_count\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(dcp_saved / "safetensors")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "False"
