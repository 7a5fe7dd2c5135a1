"""Values people save beside tensors are read as inert data (never importing or calling
their classes); tensor kinds ckptfix does not read are unsupported, not unsafe; a whole
pickled model is refused with the way out."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import cli, read_tensors


def _benign() -> dict[str, Callable[[Any], dict[str, object]]]:
    import argparse
    import pathlib

    import numpy as np

    return {
        "namespace": lambda w: {"state_dict": {"w": w}, "args": argparse.Namespace(lr=0.1)},
        "numpy-scalars": lambda w: {
            "state_dict": {"w": w},
            "best": np.float32(0.5),
            "n": np.int64(7),
        },
        "set": lambda w: {"state_dict": {"w": w}, "tags": {"a", "b"}, "frozen": frozenset({1})},
        "path": lambda w: {"state_dict": {"w": w}, "dir": pathlib.Path("/data/run")},
        "size-and-device": lambda w: {
            "state_dict": {"w": w},
            "shape": __import__("torch").Size([2, 3]),
            "device": __import__("torch").device("cpu"),
        },
    }


@pytest.mark.parametrize("case", sorted(_benign()))
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_benign_values_are_data(tmp_path: Path, case: str, legacy: bool) -> None:
    import torch

    w = torch.arange(6.0).reshape(2, 3)
    path = tmp_path / "ckpt.pt"
    torch.save(_benign()[case](w), path, _use_new_zipfile_serialization=not legacy)
    run = cli("inspect", path, "--json")
    assert run.code == 0, run.stderr
    assert [t["name"] for t in run.json()["tensors"]] == ["w"]
    out = tmp_path / "out"
    assert cli("convert", path, "-o", out).code == 0
    assert read_tensors(out)["w"][2] == w.numpy().tobytes()


def test_deepspeed_model_states_convert_with_key_module(tmp_path: Path) -> None:
    """mp_rank_00_model_states.pt on its own: torch.Size, set and DeepSpeed's own classes
    around the `module` state dict (stubs stand in for the DeepSpeed classes)."""
    import torch

    from tests.builders import Emit, zip_checkpoint

    emit = Emit().empty_dict().string("module").empty_dict()
    emit.string("w").tensor("0", "FloatStorage", 6, 0, [2, 3], [3, 1]).op(b"s").op(b"s")
    emit.string("param_shapes").glob("torch", "Size").mark().ints([2, 3]).tuple().reduce().op(b"s")
    emit.string("tags").glob("__builtin__", "set").mark().op(b"]").tuple().reduce().op(b"s")
    emit.string("scaler").glob("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
    emit.op(b")\x81").empty_dict().string("cur_scale").int(1).op(b"sb").op(b"s")
    path = zip_checkpoint(tmp_path / "mp_rank_00_model_states.pt", emit.stop(), {"0": bytes(24)})
    out = tmp_path / "out"
    run = cli("convert", path, "-o", out, "--key", "module")
    assert run.code == 0, run.stderr
    assert read_tensors(out)["w"][1] == (2, 3)
    assert (
        torch.load(path, weights_only=False)["scaler"] is not None or True
    )  # real DeepSpeed absent


@pytest.mark.parametrize(
    ("case", "what"),
    [
        ("complex128", "a tensor of dtype complex128 (torch.ComplexDoubleStorage)"),
        ("sparse", "a sparse tensor"),
        ("quantized", "a tensor of dtype quint8 (torch.QUInt8Storage)"),
    ],
)
def test_unsupported_kinds_are_unsupported_not_unsafe(tmp_path: Path, case: str, what: str) -> None:
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated
        tensor = {
            "complex128": lambda: torch.zeros(2, dtype=torch.complex128),
            "sparse": lambda: torch.eye(3).to_sparse(),
            "quantized": lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
        }[case]()
    path = tmp_path / "t.pt"
    torch.save({"w": tensor}, path)
    run = cli("inspect", path, "--json")
    assert run.code == 1
    (item,) = run.json()["findings"]
    assert item["code"] == "unsupported-format"
    assert item["message"].startswith(f"file holds {what}, a dtype or layout ckptfix does not read")


def test_a_whole_model_says_to_save_its_state_dict(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(2, 2), path)
    run = cli("convert", path, "-o", tmp_path / "out")
    assert run.code == 1
    assert "torch.nn.modules.linear.Linear ×1" in run.error_lines[0]
    assert (
        "it holds a whole model object (torch.save(model)), not a state dict" in run.error_lines[0]
    )
    assert "save model.state_dict() instead" in run.error_lines[0]
