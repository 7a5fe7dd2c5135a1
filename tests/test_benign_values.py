"""Values people save beside tensors are read as inert data (never importing or calling
their classes); tensor kinds ckptfix does not read are unsupported, not unsafe; a whole
pickled model is refused with the way out."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import training_fixtures as fixtures
from tests.helpers import cli, read_tensors

dcp_saved = fixtures.dcp_saved  # fixtures shared by the training tests
zero_saved = fixtures.zero_saved
universal_saved = fixtures.universal_saved


CASES = ["namespace", "numpy-scalars", "path", "set", "size-and-device"]


def _benign() -> dict[str, dict[str, object]]:
    """Values saved beside the tensors, by case (built when a test runs: torch and numpy are
    never imported to collect the suite)."""
    import argparse
    import pathlib

    import numpy as np
    import torch

    return {
        "namespace": {"args": argparse.Namespace(lr=0.1)},
        "numpy-scalars": {"best": np.float32(0.5), "n": np.int64(7)},
        "set": {"tags": {"a", "b"}, "frozen": frozenset({1}), "names": set()},
        "path": {"dir": pathlib.Path("/data/run")},
        "size-and-device": {"shape": torch.Size([2, 3]), "device": torch.device("cpu")},
    }


# torch.save writes protocol 2 (`__builtin__.set`, `_codecs.encode`); others write 4.
PROTOCOLS = [2, 4]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_benign_values_are_data(tmp_path: Path, case: str, legacy: bool, protocol: int) -> None:
    import torch

    assert sorted(_benign()) == CASES
    w = torch.arange(6.0).reshape(2, 3)
    path = tmp_path / "ckpt.pt"
    saved = {"state_dict": {"w": w}, **_benign()[case]}
    torch.save(saved, path, _use_new_zipfile_serialization=not legacy, pickle_protocol=protocol)
    run = cli("inspect", path, "--json")
    assert run.code == 0, run.stderr
    assert [t["name"] for t in run.json()["tensors"]] == ["w"]
    out = tmp_path / "out"
    assert cli("convert", path, "-o", out).code == 0
    assert read_tensors(out)["w"][2] == w.numpy().tobytes()


def test_every_reader_shares_the_benign_table() -> None:
    """One table for every pickle reader, each entry under both of its spellings; no reader
    builds its allowlist any other way."""
    import ckptfix.formats.dcp_chunks
    import ckptfix.formats.torch_zip
    import ckptfix.formats.zero
    import ckptfix.formats.zero_universal  # noqa: F401  (each registers its allowlist)
    from ckptfix.formats.benign import BENIGN, READERS

    assert set(READERS) == {
        "plain",
        "deepspeed",
        "deepspeed-universal",
        "dcp-metadata",
        "dcp-chunk",
    }
    for reader, allowed in READERS.items():
        for key, value in BENIGN.items():
            assert allowed.get(key) is value, (reader, key)
        for name in ("set", "frozenset"):
            assert allowed[("builtins", name)] is allowed[("__builtin__", name)], reader
    package = Path(__file__).resolve().parent.parent / "ckptfix"
    builders = {
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if "TORCH_ALLOWLIST" in path.read_text() or "extended(" in path.read_text()
    }
    assert builders == {"formats/unpickler.py", "formats/benign.py"}


def _with_value(path: Path, value: dict[str, object], protocol: int) -> None:
    """A training checkpoint's pickle again, with `value` beside what it held."""
    import pickle

    import torch

    if path.name == ".metadata":  # DCP's: a plain pickle of its Metadata dataclass
        metadata = pickle.loads(path.read_bytes())  # our own fixture
        metadata.benign = value
        path.write_bytes(pickle.dumps(metadata, protocol=protocol))
        return
    saved = torch.load(path, weights_only=False)  # our own fixture
    saved["benign"] = value
    torch.save(saved, path, pickle_protocol=protocol)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", CASES)
def test_every_training_reader_accepts_benign_values(
    dcp_saved: Path,
    zero_saved: Path,
    universal_saved: Path,
    tmp_path: Path,
    case: str,
    protocol: int,
) -> None:
    """The same values in DeepSpeed's model and optimizer states, a universal checkpoint's
    parameter file and DCP's `.metadata`: read as data, the model unchanged (its digest)."""
    import shutil

    from ckptfix import hash_checkpoint, inspect

    step = "global_step2"
    places = {
        zero_saved / "zero2_bf16": [
            f"{step}/mp_rank_00_model_states.pt",
            f"{step}/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        ],
        universal_saved / "zero3_bf16" / f"{step}_universal": [
            "zero_pp_rank_0_mp_rank_00_model_states.pt",
        ],
        universal_saved / "zero2_fp32" / f"{step}_universal": ["zero/embed.weight/fp32.pt"],
        dcp_saved / "torch_save": [".metadata"],
    }
    for index, (original, files) in enumerate(places.items()):
        folder = tmp_path / str(index)
        shutil.copytree(original, folder)
        for name in files:
            _with_value(folder / name, _benign()[case], protocol)
        report = inspect(folder)
        assert not [item for item in report.findings if item.severity.value == "error"], files
        assert hash_checkpoint(folder).digest == hash_checkpoint(original).digest, files


def test_deepspeed_model_states_convert_with_key_module(tmp_path: Path) -> None:
    """mp_rank_00_model_states.pt on its own: torch.Size, set and DeepSpeed's own classes
    around the `module` state dict (stubs stand in for the DeepSpeed classes)."""
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
