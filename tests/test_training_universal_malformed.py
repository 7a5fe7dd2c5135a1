"""Broken and hostile DeepSpeed universal checkpoints (made by ds_to_universal, then damaged):
every variant is a finding naming the file and the rule (inspect exits 1) and a conversion
writes nothing, or a one-line refusal; no pickle executes, no file outside the checkpoint is
read, and a damaged parameter file either converts exactly or fails cleanly."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import training_fixtures as fixtures
from tests.helpers import cli, one_error_line, torch_bytes
from tests.training_fixtures import PWNED, assert_refused, hostile_zip

pytestmark = pytest.mark.slow
copy_of = fixtures.copy_of
zero_saved = fixtures.zero_saved  # fixtures shared by the training tests
universal_saved = fixtures.universal_saved
Copy = Callable[[Path], Path]
TAG = "global_step2_universal"


@pytest.fixture(autouse=True)
def _no_marker() -> Any:
    PWNED.unlink(missing_ok=True)
    yield
    assert not PWNED.exists(), "a pickle was executed"


def _universal(saved: Path, copy_of: Copy, name: str = "zero2_fp32") -> Path:
    """A private copy of a universal checkpoint's folder, to damage."""
    return copy_of(saved / name / TAG)


def _save(path: Path, value: object) -> None:
    import torch

    path.unlink()
    torch.save(value, path)


def _written(out: Path, name: str) -> Any:
    """A tensor of a conversion's output, as safetensors itself reads it."""
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors")[name]


def _param(folder: Path, name: str) -> Any:
    import torch

    return torch.load(folder / "zero" / name / "fp32.pt", weights_only=True)


def test_missing_weight_file(universal_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = _universal(universal_saved, copy_of)
    missing = folder / "zero" / "body.weight" / "fp32.pt"
    missing.unlink()
    error = assert_refused(folder, tmp_path, "missing-rank-file", missing)
    assert "the fp32 weight of 'body.weight' is missing" in error["message"]


def test_missing_parameter_folder(universal_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = _universal(universal_saved, copy_of, "zero3_bf16")
    shutil.rmtree(folder / "zero" / "body.bias")
    assert_refused(folder, tmp_path, "missing-rank-file", folder / "zero" / "body.bias" / "fp32.pt")


def test_missing_model_states(universal_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = _universal(universal_saved, copy_of)
    (folder / "mp_rank_00_model_states.pt").unlink()
    error = assert_refused(
        folder, tmp_path, "missing-rank-file", folder / "mp_rank_00_model_states.pt"
    )
    assert "model states is missing" in error["message"]


def test_truncated_weight_file(universal_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = _universal(universal_saved, copy_of)
    weight = folder / "zero" / "embed.weight" / "fp32.pt"
    os.truncate(weight, weight.stat().st_size // 2)
    error = assert_refused(folder, tmp_path, "corrupt-file", weight)
    assert "rule bad-zip" in error["message"]


def test_hostile_weight_file(universal_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = _universal(universal_saved, copy_of, "zero3_fp32")
    weight = folder / "zero" / "embed.weight" / "fp32.pt"
    weight.write_bytes(hostile_zip())
    error = assert_refused(folder, tmp_path, "unsafe-pickle", weight)
    assert "posix.system" in error["message"]


def test_a_weight_file_without_a_tensor(
    universal_saved: Path, copy_of: Copy, tmp_path: Path
) -> None:
    folder = _universal(universal_saved, copy_of)
    weight = folder / "zero" / "body.bias" / "fp32.pt"
    _save(weight, {"cat_dim": 0, "params": "none"})
    error = assert_refused(folder, tmp_path, "corrupt-file", weight)
    assert "(rule universal-param;" in error["message"]


@pytest.mark.parametrize(
    ("name", "cut", "said"),
    [
        ("zero2_fp32", lambda t: t.T.contiguous(), "shape [6, 5], but the model states give "
         "'body.weight' the shape [5, 6]"),
        ("zero3_fp32", lambda t: t[:-1].clone(), "shape [29], but the model states give "
         "'body.weight' the shape [5, 6]"),
        ("zero2_fp32", lambda t: t[:4].clone(), "shape [4, 6], but the model states give "
         "'body.weight' the shape [5, 6]"),
    ],
    ids=["transposed", "flat-short", "rows-cut-without-vocab-flag"],
)  # fmt: skip
def test_shapes_that_disagree_with_param_shapes(
    universal_saved: Path, copy_of: Copy, tmp_path: Path, name: str, cut: Any, said: str
) -> None:
    folder = _universal(universal_saved, copy_of, name)
    weight = folder / "zero" / "body.weight" / "fp32.pt"
    held = _param(folder, "body.weight")
    _save(weight, {**held, "param": cut(held["param"])} if isinstance(held, dict) else cut(held))
    error = assert_refused(folder, tmp_path, "corrupt-file", weight)
    assert said in error["message"] and "(rule universal-shape;" in error["message"]


def _vocab_cut(folder: Path, rows: int, recorded: int | None) -> Any:
    """embed.weight's fp32.pt holding its first `rows` rows as a vocabulary cut
    (`vocab_tensor`), and the model states recording `original_vocab_size` (as the client's
    universal_checkpoint_info that ds_to_universal cut by), unless None."""
    held = _param(folder, "embed.weight")
    kept = held["param"][:rows].clone()
    _save(
        folder / "zero" / "embed.weight" / "fp32.pt", {**held, "param": kept, "vocab_tensor": True}
    )
    if recorded is not None:
        states = folder / "mp_rank_00_model_states.pt"
        info = {"original_vocab_size": recorded}
        fixtures.set_zero_value(states, "universal_checkpoint_info", info)
    return kept


def test_a_vocabulary_tensor_without_its_padding_rows(
    universal_saved: Path, copy_of: Copy, tmp_path: Path
) -> None:
    """ds_to_universal cuts a vocabulary's padding rows off (`vocab_tensor`) down to the
    original_vocab_size the client recorded: the rows it kept are the weight (DeepSpeed pads
    them again on load)."""
    folder = _universal(universal_saved, copy_of)
    rows = _vocab_cut(folder, 12, recorded=12)
    run = cli("convert", folder, "-o", tmp_path / "out")
    assert run.code == 0, run.stderr
    written = _written(tmp_path / "out", "embed.weight")
    assert (written.shape, torch_bytes(written)) == ((12, 6), torch_bytes(rows))


@pytest.mark.parametrize(
    ("recorded", "said"),
    [
        (12, "but the model states record original_vocab_size 12"),
        (None, "but the model states record no original_vocab_size"),
    ],
    ids=["other-size", "unrecorded"],
)
def test_a_vocabulary_cut_to_other_rows_is_refused(
    universal_saved: Path, copy_of: Copy, tmp_path: Path, recorded: int | None, said: str
) -> None:
    """vocab_tensor on a weight of 1 row of the 13 param_shapes gives it: any number of rows
    was taken as the vocabulary (12 of 13 rows silently lost), whatever the model states
    recorded as the vocabulary's size."""
    folder = _universal(universal_saved, copy_of)
    _vocab_cut(folder, 1, recorded)
    weight = folder / "zero" / "embed.weight" / "fp32.pt"
    error = assert_refused(folder, tmp_path, "corrupt-file", weight)
    assert "holds 1 row(s) of 'embed.weight' [13, 6]" in error["message"]
    assert said in error["message"] and "(rule universal-shape;" in error["message"]


def test_an_expert_parallel_parameter_is_refused(
    universal_saved: Path, copy_of: Copy, tmp_path: Path
) -> None:
    folder = _universal(universal_saved, copy_of)
    weight = folder / "zero" / "body.weight" / "fp32.pt"
    held = _param(folder, "body.weight")
    _save(weight, {**held, "is_expert_param": True, "ep_num_experts": 5})
    error = assert_refused(folder, tmp_path, "unsupported-format", weight)
    assert "expert-parallel parameter" in error["message"]


@pytest.mark.parametrize(
    ("moved", "said"),
    [
        ("body.weight", "zero/body.weight is a link; a parameter's folder must be a real folder"),
        ("body.weight/fp32.pt", "file is a link to a file outside the checkpoint"),
    ],
    ids=["folder", "weight-file"],
)
def test_links_out_of_the_checkpoint_are_never_followed(
    universal_saved: Path, copy_of: Copy, tmp_path: Path, moved: str, said: str
) -> None:
    folder = _universal(universal_saved, copy_of)
    inside, outside = folder / "zero" / moved, tmp_path / "elsewhere"
    shutil.move(inside, outside)
    inside.symlink_to(outside)
    error = assert_refused(folder, tmp_path, "corrupt-file", inside)
    assert f"{said} (rule universal-link;" in error["message"]


def test_a_weight_file_linked_inside_the_checkpoint_is_read(
    universal_saved: Path, copy_of: Copy, tmp_path: Path
) -> None:
    folder = _universal(universal_saved, copy_of)
    weight = folder / "zero" / "body.weight" / "fp32.pt"
    kept = folder / "kept-body-weight.pt"
    shutil.move(weight, kept)
    os.symlink(os.path.relpath(kept, weight.parent), weight)
    run = cli("convert", folder, "-o", tmp_path / "out")
    assert run.code == 0, run.stderr
    held = _param(folder, "body.weight")["param"]
    assert torch_bytes(_written(tmp_path / "out", "body.weight")) == torch_bytes(held)


def test_a_weight_file_that_is_a_fifo_is_never_opened(
    universal_saved: Path, copy_of: Copy, tmp_path: Path
) -> None:
    folder = _universal(universal_saved, copy_of)
    weight = folder / "zero" / "body.bias" / "fp32.pt"
    weight.unlink()
    os.mkfifo(weight)
    error = assert_refused(folder, tmp_path, "corrupt-file", weight)  # no hang
    assert "file is not a regular file (rule universal-link;" in error["message"]


def test_zero_folder_that_is_a_link(universal_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = _universal(universal_saved, copy_of)
    shutil.move(folder / "zero", tmp_path / "zero-elsewhere")
    (folder / "zero").symlink_to(tmp_path / "zero-elsewhere")
    error = assert_refused(folder, tmp_path, "corrupt-file", folder / "zero")
    assert "(rule universal-link;" in error["message"]


def test_folders_that_name_no_parameter(
    universal_saved: Path, copy_of: Copy, tmp_path: Path
) -> None:
    folder = _universal(universal_saved, copy_of)
    for name in ("stray", "evil\nname\x1b[31m"):
        shutil.copytree(folder / "zero" / "body.bias", folder / "zero" / name)
    error = assert_refused(folder, tmp_path, "corrupt-file", folder / "zero")
    assert (
        "zero/ holds 2 folder(s) that name no parameter of the model states: " in (error["message"])
    )
    assert "'evil\\nname\\x1b[31m', 'stray' (rule universal-names;" in error["message"]
    line = cli("convert", folder, "-o", tmp_path / "o").error_lines
    assert len(line) == 1 and "\x1b" not in line[0]


def test_parameter_names_that_climb_out_of_zero(
    universal_saved: Path, copy_of: Copy, tmp_path: Path
) -> None:
    """The model states are as hostile as the folder: a parameter named `../x` is never
    looked up outside zero/."""
    import torch

    folder = _universal(universal_saved, copy_of)
    states_path = folder / "mp_rank_00_model_states.pt"
    states = torch.load(states_path, weights_only=False)  # our own fixture
    states["param_shapes"][-1] = {"../../escape": torch.Size([5])}
    (tmp_path / "escape").mkdir()
    shutil.copy(folder / "zero" / "body.bias" / "fp32.pt", tmp_path / "escape" / "fp32.pt")
    _save(states_path, states)
    error = assert_refused(folder, tmp_path, "corrupt-file", folder / "zero")
    assert "a parameter '../../escape', which is no folder name in zero/" in error["message"]
    assert "(rule path-traversal;" in error["message"]


def test_tensor_parallel_universal_checkpoints_are_refused(
    universal_saved: Path, copy_of: Copy, tmp_path: Path
) -> None:
    folder = _universal(universal_saved, copy_of)
    shutil.copy(folder / "mp_rank_00_model_states.pt", folder / "mp_rank_01_model_states.pt")
    assert one_error_line("convert", folder, "-o", tmp_path / "never") == (
        f"error: {folder}: mp_rank_01_model_states.pt belongs to a tensor-, pipeline- or "
        "expert-parallel universal checkpoint, whose model states (buffers, frozen parameters) "
        "hold per-rank parts ckptfix does not merge (rule unsupported-format; load it with "
        "DeepSpeed at tensor- and pipeline-parallel size 1 and save it, then convert that)"
    )
    assert not (tmp_path / "never").exists()


def test_the_zero_folder_alone_is_refused(universal_saved: Path) -> None:
    folder = universal_saved / "zero2_fp32" / TAG
    run = cli("inspect", folder / "zero")
    assert run.code == 2
    assert run.error_lines == [
        f"error: {folder / 'zero'}: folder is the zero/ part of a DeepSpeed universal "
        f"checkpoint (no model states) (rule usage; pass the folder that holds it: {folder})"
    ]


def test_latest_universal_pointing_nowhere(
    universal_saved: Path, copy_of: Copy, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    (root / "latest_universal").write_text("global_step9_universal")
    shutil.copytree(universal_saved / "zero2_fp32" / TAG, root / TAG)
    error = assert_refused(root, tmp_path, "tag-missing", root / "latest_universal")
    assert error["message"].startswith("`latest_universal` names the tag 'global_step9_universal'")


MUTATIONS = settings(
    max_examples=int(os.environ.get("CKPTFIX_FUZZ_EXAMPLES", "300")) // 15 + 5,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@MUTATIONS
@given(st.data())
def test_a_damaged_weight_file_converts_exactly_or_fails_cleanly(
    universal_saved: Path, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """One byte of an fp32.pt changed anywhere: the conversion writes what torch itself
    reads from the damaged file (weights_only), or refuses with exit 1 and one error line."""
    import torch

    root = tmp_path_factory.mktemp("mutated")
    folder = root / TAG
    shutil.copytree(universal_saved / "zero2_fp32" / TAG, folder)
    weight = folder / "zero" / "body.weight" / "fp32.pt"
    raw = bytearray(weight.read_bytes())
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at] = data.draw(st.integers(0, 255).filter(lambda value: value != raw[at]))
    weight.write_bytes(bytes(raw))
    run = cli("convert", folder, "-o", root / "out")
    assert "Traceback" not in run.stderr and "internal error" not in run.stderr
    if run.code != 0:
        assert run.code == 1 and len(run.error_lines) == 1, run.stderr
        assert not (root / "out").exists()
        return
    try:
        held = torch.load(weight, weights_only=True)["param"]
    except Exception:  # torch refuses what ckptfix read: nothing to compare with
        return
    written = _written(root / "out", "body.weight")
    assert (written.shape, torch_bytes(written)) == (held.shape, torch_bytes(held))
