"""DeepSpeed folders that hold the fp32 weights twice, made by DeepSpeed itself: the ZeRO
stage 2 and 3 checkpoints of tests/training_frameworks.py with ds_to_universal's output in the
tag folder (ds_to_universal given the tag folder as its output) or beside it
(`latest_universal`), one weight of the universal copy changed so that the output shows which
copy it came from. The default reads the partitions, bitwise what zero_to_fp32.py
reconstructs; `--zero-weights universal` reads the universal copy, bitwise what each fp32.pt
holds; the other copy is named, never mixed in."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ckptfix.ops.hash import hash_checkpoint
from tests import hash_oracle
from tests import training_fixtures as fixtures
from tests.helpers import cli, torch_bytes
from tests.training_fixtures import converted, ds_to_universal, zero_to_fp32

if TYPE_CHECKING:
    import torch

pytestmark = pytest.mark.slow
zero_saved = fixtures.zero_saved  # fixtures shared by the training tests
universal_saved = fixtures.universal_saved
NAMES = ["zero2_bf16", "zero3_bf16"]
TAG = "global_step2"
CHANGED = "body.weight"  # the weight changed in the universal copy


def _shapes(tag: Path) -> dict[str, Any]:
    import torch

    first = sorted(tag.glob("*model_states.pt"))[0]
    states = torch.load(first, weights_only=False)  # our own fixture
    return {name: shape for group in states["param_shapes"] for name, shape in group.items()}


def _change(zero: Path) -> torch.Tensor:
    """Add 1 to the weight zero/body.weight/fp32.pt holds, saved as DeepSpeed saved it (a dict
    with `param`, or the bare flat tensor of ZeRO-3); the new weight, shaped as the model's."""
    import torch

    path = zero / CHANGED / "fp32.pt"
    held = torch.load(path, weights_only=True)
    if isinstance(held, dict):
        held["param"] = held["param"] + 1
        weight = held["param"]
    else:
        held = weight = held + 1
    path.unlink()
    torch.save(held, path)
    return weight.reshape(_shapes(zero.parent)[CHANGED])


def _in_place(zero_saved: Path, tmp_path: Path, name: str) -> tuple[Path, torch.Tensor]:
    """A copy of the ZeRO checkpoint `name` after `ds_to_universal --input_folder T
    --output_folder T`: zero/ written into the tag folder (the run then fails copying the
    model states onto themselves)."""
    root = tmp_path / name
    shutil.copytree(zero_saved / name, root)
    done = ds_to_universal(root / TAG, root / TAG)
    assert (root / TAG / "zero" / "optimizer_state.pt").is_file(), done.stderr[-2000:]
    return root, _change(root / TAG / "zero")


def _assert_written(
    written: dict[str, Any], dropped: dict[str, str], oracle: dict[str, Any], changed: Any
) -> None:
    """The conversion holds the oracle's tensors, bitwise, but `changed` for CHANGED when
    given (the universal copy's weight) — and the partitions' weight when not."""
    for key, tensor in oracle.items():
        expected = changed if key == CHANGED and changed is not None else tensor
        got = written[dropped.get(key, key)]
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), key
        assert torch_bytes(got) == torch_bytes(expected), key


@pytest.mark.parametrize("name", NAMES)
def test_zero_in_the_tag_folder_reads_one_copy_and_says_which(
    zero_saved: Path, tmp_path: Path, name: str
) -> None:
    root, changed = _in_place(zero_saved, tmp_path, name)
    oracle = zero_to_fp32(zero_saved / name)  # the partitions, untouched
    tag, zero = root / TAG, root / TAG / "zero"
    for path in (root, tag):
        written, dropped = converted(path, tmp_path / f"out-{path.name}")
        _assert_written(written, dropped, oracle, None)
        layout = cli("inspect", path, "--json").json()["layout"]
        assert (layout["tag"], layout["weights"]) == (TAG, "master")
        assert layout["other_weights"] == {"universal": str(zero)}
        assert "universal checkpoint" in layout["left_out"]["parts"]
        written, dropped = converted(
            path, tmp_path / f"u-{path.name}", "--zero-weights", "universal"
        )
        _assert_written(written, dropped, oracle, changed)
    digest = hash_checkpoint(root).digest
    assert digest == hash_oracle.digest(zero_to_fp32(zero_saved / name))
    hashed = cli("hash", root)
    assert f"not read: the universal weights in {zero}" in hashed.stdout


@pytest.mark.parametrize("name", NAMES)
def test_latest_and_latest_universal_read_latest_and_say_so(
    universal_saved: Path, tmp_path: Path, name: str
) -> None:
    root = tmp_path / name
    shutil.copytree(universal_saved / name, root)
    other = root / f"{TAG}_universal"
    changed = _change(other / "zero")
    oracle = zero_to_fp32(universal_saved / name)
    run = cli("convert", root, "-o", tmp_path / "out", "--json")
    assert run.code == 0, run.stderr
    written, dropped = converted(root, tmp_path / "again")
    _assert_written(written, dropped, oracle, None)
    layout = run.json()["layout"]
    assert (layout["tag"], layout["weights"]) == (TAG, "master")
    assert layout["other_weights"] == {"universal": str(other)}
    [note] = [item for item in run.json()["findings"] if item["code"] == "other-weights"]
    assert note["file"] == str(other)
    written, dropped = converted(root, tmp_path / "u", "--zero-weights", "universal")
    _assert_written(written, dropped, oracle, changed)
    asked = cli("inspect", root, "--zero-weights", "universal", "--json").json()["layout"]
    assert (asked["tag"], asked["weights"]) == (other.name, "universal")
    assert asked["other_weights"] == {"master": str(root / TAG)}


def test_a_partial_universal_copy_is_refused_and_the_partitions_still_read(
    zero_saved: Path, tmp_path: Path
) -> None:
    """ds_to_universal interrupted: one parameter's folder missing from zero/."""
    root, _ = _in_place(zero_saved, tmp_path, "zero2_bf16")
    shutil.rmtree(root / TAG / "zero" / "embed.weight")
    oracle = zero_to_fp32(zero_saved / "zero2_bf16")
    written, dropped = converted(root, tmp_path / "out")
    _assert_written(written, dropped, oracle, None)
    out = tmp_path / "never"
    refused = cli("convert", root, "-o", out, "--zero-weights", "universal")
    assert refused.code == 1
    [line] = refused.error_lines
    missing = root / TAG / "zero" / "embed.weight" / "fp32.pt"
    assert line.startswith(f"error: {missing}: the fp32 weight of 'embed.weight' is missing")
    assert line.endswith("or read the partitions: --zero-weights master)")
    assert not out.exists() and not list(tmp_path.glob(".ckptfix-*"))
