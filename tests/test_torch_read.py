"""Reading PyTorch files without executing them: torch.load(weights_only=True) is the oracle."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfix
from ckptfix.io.gather import tensor_bytes
from ckptfix.io.source import LocalFile
from tests.builders import (
    HOSTILE_FORMS,
    SAVED_DTYPES,
    ZIP_ONLY_DTYPES,
    Emit,
    Payload,
    crafted_zip,
    hostile_checkpoint,
    hostile_pickles,
    legacy_checkpoint,
    random_tensor,
    random_views_state,
    state_dict_pickle,
    view_specs,
    views_state_dict,
    zip_checkpoint,
)
from tests.helpers import cli, read_weights, torch_bytes


def assert_matches_oracle(path: Path, legacy: bool = False) -> None:
    """ckptfix reads the same names, shapes, contiguity and bytes as torch.load does."""
    import torch

    expected = torch.load(path, weights_only=True, map_location="cpu")
    weight_file = read_weights(path)
    assert weight_file.format == ("torch-legacy" if legacy else "torch-zip")
    assert [t.name for t in weight_file.tensors] == list(expected)
    with LocalFile(str(path)) as source:
        for info in weight_file.tensors:
            tensor = expected[info.name]
            assert info.shape == tuple(tensor.shape), info.name
            assert info.contiguous == tensor.is_contiguous(), info.name
            assert tensor_bytes(source, info) == torch_bytes(tensor), info.name


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_views_aliases_and_strides_match_torch(tmp_path: Path, legacy: bool) -> None:
    import torch

    path = tmp_path / "views.bin"
    torch.save(views_state_dict(), path, _use_new_zipfile_serialization=not legacy)
    assert_matches_oracle(path, legacy)


@pytest.mark.parametrize("dtype", SAVED_DTYPES + ZIP_ONLY_DTYPES)
def test_every_dtype_matches_torch(tmp_path: Path, dtype: str) -> None:
    import torch

    path = tmp_path / "d.pt"
    torch.save(
        {
            "m": random_tensor(dtype, (3, 5), 0),
            "s": random_tensor(dtype, (), 1),
            "z": torch.empty(0, 2, dtype=getattr(torch, dtype)),
        },
        path,
    )
    assert_matches_oracle(path)
    if dtype in SAVED_DTYPES:
        legacy = tmp_path / "legacy.pt"
        torch.save(
            {"m": random_tensor(dtype, (3, 5), 0)}, legacy, _use_new_zipfile_serialization=False
        )
        assert_matches_oracle(legacy, legacy=True)


@pytest.mark.slow
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(view_specs, st.sampled_from(SAVED_DTYPES), st.booleans())
def test_random_views_property(
    tmp_path: Path, specs: list[tuple[int, str]], dtype: str, legacy: bool
) -> None:
    import torch

    path = tmp_path / "random.pt"
    torch.save(random_views_state(dtype, specs), path, _use_new_zipfile_serialization=not legacy)
    assert_matches_oracle(path, legacy)


def test_inspect_reports_sharing_layouts(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "views.bin"
    torch.save(views_state_dict(), path)
    report = ckptfix.inspect(path)
    codes = sorted({item.code for item in report.findings})
    assert codes == ["dtype-mix", "non-contiguous", "shared-storage"]  # every byte is used
    shared = {
        item.tensors: item.message for item in report.findings if item.code == "shared-storage"
    }
    assert any("'embed' = 'lm_head' are aliases (tied weights)" in m for m in shared.values())
    assert any("3 disjoint views of one buffer" in m for m in shared.values())
    assert any("overlapping views of one buffer" in m for m in shared.values())
    strided = next(item for item in report.findings if item.code == "non-contiguous")
    assert set(strided.tensors) == {"t", "strided", "expanded"}
    assert report.exit_code("error") == 0 and report.exit_code("warning") == 1


def test_wasted_storage(tmp_path: Path) -> None:
    import torch

    big = torch.zeros(1000, 1000)
    path = tmp_path / "small-view.pt"
    torch.save({"head": big[:2]}, path)  # torch writes the whole 4 MB storage
    report = ckptfix.inspect(path)
    item = next(item for item in report.findings if item.code == "wasted-storage")
    assert "stores 4.00 MB of storage but its tensors use 8.00 KB" in item.message


def test_nested_lightning_checkpoint_and_prefix(tmp_path: Path) -> None:
    import torch

    weights = {"model.encoder.weight": torch.ones(4, 4), "model.head.weight": torch.ones(2, 4)}
    checkpoint = {
        "epoch": 3,
        "global_step": 1200,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": weights,
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(4, 4)}}, "param_groups": []}],
    }
    path = tmp_path / "last.ckpt"
    torch.save(checkpoint, path)
    report = ckptfix.inspect(path)
    assert [t.name for t in report.tensors] == list(weights)
    nested = next(item for item in report.findings if item.code == "nested-checkpoint")
    assert "under 'state_dict'" in nested.message and "epoch, global_step" in nested.message
    assert "64 B of other tensors" in nested.message
    prefix = next(item for item in report.findings if item.code == "wrapper-prefix")
    assert "'model.'" in prefix.message


def test_ddp_prefix_in_plain_state_dict(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "ddp.bin"
    torch.save({"module._orig_mod.a": torch.ones(2), "module._orig_mod.b": torch.ones(2)}, path)
    prefix = next(i for i in ckptfix.inspect(path).findings if i.code == "wrapper-prefix")
    assert "'module._orig_mod.'" in prefix.message


def test_sharded_bin_folder_gets_index_checks(tmp_path: Path) -> None:
    import json

    import torch

    folder = tmp_path / "m"
    folder.mkdir()
    torch.save({"a": torch.ones(2)}, folder / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": torch.ones(2)}, folder / "pytorch_model-00002-of-00002.bin")
    (folder / "pytorch_model.bin.index.json").write_text(
        json.dumps(
            {
                "metadata": {"total_size": 16},
                "weight_map": {
                    "a": "pytorch_model-00001-of-00002.bin",
                    "b": "pytorch_model-00001-of-00002.bin",
                },
            }
        )
    )
    report = ckptfix.inspect(folder)
    assert sorted(item.code for item in report.findings) == [
        "index-missing-tensor",
        "index-total-size",
        "orphan-file",
        "shard-numbering",
    ]


@pytest.mark.slow
def test_inspecting_a_bin_imports_no_torch(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "plain.bin"
    torch.save(views_state_dict(), path)
    code = (
        "import sys, ckptfix; r = ckptfix.inspect(sys.argv[1]); "
        "assert r.tensor_count == 15, r.tensor_count; print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("container", ["zip", "legacy"])
@pytest.mark.parametrize("form", HOSTILE_FORMS)
def test_hostile_pickles_are_never_run(tmp_path: Path, form: str, container: str) -> None:
    canary = tmp_path / "CANARY"
    payload = hostile_pickles(canary)[form]
    path = hostile_checkpoint(tmp_path / "evil.bin", payload, container)
    out = tmp_path / "out"
    for args in (["inspect", path], ["inspect", path, "--json"]):
        run = cli(*args)
        assert run.code == 1
        assert len(run.error_lines) == 1
        assert run.error_lines[0].startswith(
            f"error: {path}: pickle references globals outside the allowlist: "
        )
        assert "ckptfix never executes pickles" in run.error_lines[0]
    assert not canary.exists()
    assert not out.exists()


def test_hostile_object_hidden_beside_real_tensors(tmp_path: Path) -> None:
    import torch

    canary = tmp_path / "CANARY"
    path = tmp_path / "pytorch_model.bin"
    torch.save({"weight": torch.ones(3), "bias": torch.zeros(3), "extra": Payload(canary)}, path)
    report = ckptfix.inspect(path)
    assert [(i.code, i.severity.value) for i in report.findings] == [("unsafe-pickle", "error")]
    assert "posix.system ×1" in report.findings[0].message
    assert not canary.exists()
    # the same through torch's own safe loader is refused too (sanity of the fixture)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    assert not canary.exists()


def test_crafted_file_reads_like_torch(tmp_path: Path) -> None:
    import torch

    data = bytes(range(24))
    path = crafted_zip(tmp_path / "crafted.pt", 1, [2, 2], [1, 2], data=data)
    expected = torch.load(path, weights_only=True)["w"]
    info = read_weights(path).tensors[0]
    with LocalFile(str(path)) as source:
        assert tensor_bytes(source, info) == torch_bytes(expected)


MALFORMED = {
    "view-out-of-bounds": dict(offset=4, shape=[2, 3], stride=[3, 1]),
    "bad-tensor": dict(offset=0, shape=[2, 3], stride=[-3, 1]),
    "expansion-bomb": dict(offset=0, shape=[2**20, 2**20, 2**4], stride=[0, 0, 0]),
}


@pytest.mark.parametrize("rule", sorted(MALFORMED))
def test_malformed_views(tmp_path: Path, rule: str) -> None:
    path = crafted_zip(tmp_path / "crafted.pt", **MALFORMED[rule])  # type: ignore[arg-type]
    run = cli("inspect", path)
    assert run.code == 1
    assert len(run.error_lines) == 1 and f"(rule {rule};" in run.error_lines[0]


def test_zip_tricks(tmp_path: Path) -> None:
    pkl = state_dict_pickle({"w": ("0", "FloatStorage", 6, 0, [2, 3], [3, 1])})
    cases = {
        "compressed-storage": zip_checkpoint(
            tmp_path / "c.pt", pkl, {"0": bytes(24)}, compress_storages=True
        ),
        "storage-size": zip_checkpoint(tmp_path / "s.pt", pkl, {"0": bytes(20)}),
        "missing-storage": zip_checkpoint(tmp_path / "m.pt", pkl, {}),
        "zip-layout": zip_checkpoint(
            tmp_path / "two.pt", pkl, {"0": bytes(24)}, extra=[("archive/other.pkl", b"\x80\x02}.")]
        ),
        "zip-duplicate-entry": zip_checkpoint(
            tmp_path / "dup.pt", pkl, {"0": bytes(24)}, extra=[("archive/data/0", bytes(24))]
        ),
    }
    for rule, path in cases.items():
        run = cli("inspect", path)
        assert run.code == 1, rule
        assert len(run.error_lines) == 1 and f"(rule {rule};" in run.error_lines[0], run.stderr


def test_torchscript_is_refused(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
    run = cli("inspect", path)
    assert run.code == 1
    assert run.error_lines == [
        f"error: {path}: file is a TorchScript archive, not a checkpoint (rule unsupported-format; "
        "export its state_dict() with torch.save instead)"
    ]


def test_truncated_and_padded_legacy(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(100)}, path, _use_new_zipfile_serialization=False)
    good = path.read_bytes()
    path.write_bytes(good[:-10])
    assert "(rule truncated;" in cli("inspect", path).error_lines[0]
    path.write_bytes(good + b"junk")
    assert "(rule trailing-bytes;" in cli("inspect", path).error_lines[0]


def test_emit_helper_builds_what_torch_reads(tmp_path: Path) -> None:
    """The hand-written pickles are the same dialect torch writes."""
    import torch

    path = legacy_checkpoint(
        tmp_path / "l.pt",
        Emit(legacy_ids=True)
        .empty_dict()
        .mark()
        .string("w")
        .tensor("k", "FloatStorage", 4, 0, [2, 2], [2, 1])
        .setitems()
        .stop(),
        ["k"],
        [(4, bytes(range(16)))],
    )
    assert torch.equal(
        torch.load(path, weights_only=True)["w"],
        torch.frombuffer(bytearray(range(16)), dtype=torch.float32).reshape(2, 2),
    )
    assert_matches_oracle(path, legacy=True)


def test_legacy_pickle_claiming_a_huge_length(tmp_path: Path) -> None:
    """Found by fuzzing: an opcode claiming 7.6e18 bytes must not be allocated or read."""
    import torch

    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(4)}, path, _use_new_zipfile_serialization=False)
    data = bytearray(path.read_bytes())
    data[2] = 0x8E  # LONG1 becomes BINBYTES8, whose 8-byte length is absurd
    path.write_bytes(bytes(data))
    run = cli("inspect", path)
    assert run.code == 1
    assert "(rule bad-pickle;" in run.error_lines[0]
