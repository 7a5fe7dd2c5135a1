"""ckptfix's errors are also the standard exceptions they mean (FileNotFoundError,
PermissionError, ValueError, KeyError), carry their finding code and rule, and keep the
CLI's exit codes and error lines."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest

import ckptfix
from ckptfix.core.errors import (
    CorruptFileError,
    InputNotFoundError,
    RemoteError,
    UnknownTensorError,
    UsageError,
    WriteError,
)
from ckptfix.write.output import wrap_os_error
from tests.builders import Factory, Spec, hostile_checkpoint, hostile_pickles
from tests.helpers import cli, python_as_another_user


def test_a_missing_path_is_a_file_not_found_error(tmp_path: Path) -> None:
    missing = tmp_path / "missing.safetensors"
    with pytest.raises(FileNotFoundError) as caught:
        ckptfix.open(missing)
    error = caught.value
    assert isinstance(error, InputNotFoundError) and isinstance(error, ValueError)
    assert error.errno == errno.ENOENT and error.filename == str(missing)
    # str() is the CLI's error line, not OSError's "[Errno 2] ..."
    assert (
        str(error)
        == f"error: {missing}: no such file or directory (rule input-not-found; check the path)"
    )
    assert error.exit_code == 2


def test_the_cli_keeps_its_exit_codes_and_error_document(tmp_path: Path) -> None:
    run = cli("inspect", tmp_path / "missing.safetensors", "--json")
    assert run.code == 2
    assert json.loads(run.stdout)["error"]["code"] == "input-not-found"
    assert run.error_lines == [
        f"error: {tmp_path / 'missing.safetensors'}: no such file or directory "
        "(rule input-not-found; check the path)"
    ]


def test_a_corrupt_input_is_a_value_error_with_its_finding_code(factory: Factory) -> None:
    path = factory.safetensors("m.safetensors", [Spec("a")])
    path.write_bytes(path.read_bytes()[:-3])  # the data section now ends early
    with pytest.raises(ValueError) as caught:
        ckptfix.open(path)
    error = caught.value
    assert isinstance(error, ckptfix.InputRefusedError)
    assert error.code == "corrupt-file"  # the finding's code, as inspect reports it
    assert error.rule == "truncated"
    assert error.exit_code == 1
    run = cli("hash", path, "--json")  # the CLI's error document names the finding code too
    assert run.code == 1
    assert json.loads(run.stdout)["error"]["code"] == "corrupt-file"


def test_an_unsafe_pickle_is_refused_with_its_code(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    payload = next(iter(hostile_pickles(canary).values()))
    path = hostile_checkpoint(tmp_path / "evil.pt", payload, "zip")
    with pytest.raises(ValueError) as caught:
        ckptfix.open(path)
    assert getattr(caught.value, "code", None) == "unsafe-pickle"
    assert not canary.exists()


def test_an_unknown_tensor_is_a_key_error(factory: Factory) -> None:
    path = factory.safetensors("m.safetensors", [Spec("a")])
    with ckptfix.open(path) as reader, pytest.raises(KeyError) as caught:
        reader.get("b")
    assert isinstance(caught.value, UnknownTensorError) and isinstance(caught.value, ValueError)
    assert "holds no tensor named 'b'" in str(caught.value)


def test_a_bad_option_is_a_value_error(factory: Factory, tmp_path: Path) -> None:
    path = factory.safetensors("m.safetensors", [Spec("a")])
    with pytest.raises(ValueError, match="rule usage"):
        ckptfix.open(path, zero_weights="fp16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid size"):
        ckptfix.save({}, tmp_path / "out", max_shard="5 gigs")
    with pytest.raises(UsageError):
        ckptfix.save({}, tmp_path / "out", shared="share")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_shard: invalid size '5 gigs'"):
        ckptfix.ReshardOptions(max_shard="5 gigs")  # when the options are made
    with pytest.raises(ValueError, match="max_shard: size 0 must be at least one byte"):
        ckptfix.inspect(path, max_shard=0)


def test_max_shard_takes_a_size_as_text(tmp_path: Path) -> None:
    """max_shard is `int | str` in every call that takes it, as --max-shard takes it."""
    import numpy as np

    state = {f"t{i}": np.full(200, i, dtype=np.float32) for i in range(3)}  # 800 bytes each
    ckptfix.save(state, tmp_path / "one")
    path = tmp_path / "one" / "model.safetensors"
    assert [f.code for f in ckptfix.inspect(path, max_shard="700B").findings] == [
        "oversized-tensor"
    ]
    assert [f.code for f in ckptfix.inspect(path, max_shard="1KB").findings] == []
    result = ckptfix.reshard(tmp_path / "one", tmp_path / "split", ckptfix.ReshardOptions("1KB"))
    assert [len(shard.tensors) for shard in result.plan.shards] == [1, 1, 1]
    assert result.plan.max_shard == 1000
    converted = ckptfix.convert(
        tmp_path / "one", tmp_path / "torch", ckptfix.ConvertOptions(max_shard="2KB", to="torch")
    )
    assert [len(shard.tensors) for shard in converted.plan.shards] == [2, 1]


@pytest.mark.parametrize(
    ("rule", "kind"),
    [
        ("remote-not-found", FileNotFoundError),
        ("remote-forbidden", PermissionError),
        ("remote-credentials", PermissionError),
    ],
)
def test_remote_errors_are_the_os_errors_they_mean(rule: str, kind: type[OSError]) -> None:
    error = RemoteError("s3://bucket/key", rule, "what", "fix")
    assert isinstance(error, kind) and isinstance(error, RemoteError)
    assert error.errno == (errno.ENOENT if kind is FileNotFoundError else errno.EACCES)
    assert str(error) == "error: s3://bucket/key: what (rule " + rule + "; fix)"
    other = RemoteError("s3://bucket/key", "remote-timeout", "what")
    assert not isinstance(other, OSError)


def test_a_write_refused_by_the_os_is_a_permission_error() -> None:
    error = wrap_os_error(PermissionError(errno.EACCES, "Permission denied"), "out")
    assert isinstance(error, WriteError) and isinstance(error, PermissionError)
    assert error.exit_code == 1
    full = wrap_os_error(OSError(errno.ENOSPC, "No space left on device"), "out")
    assert not isinstance(full, PermissionError)


def test_an_unreadable_file_is_a_permission_error_corrupt_file() -> None:
    error = CorruptFileError("m.bin", "unreadable", "cannot read the file: Permission denied")
    assert isinstance(error, PermissionError) and isinstance(error, CorruptFileError)
    assert error.code == "corrupt-file" and error.rule == "unreadable"


PERMISSIONS = """
import sys, ckptfix
try:
    ckptfix.open(sys.argv[1])
except PermissionError as exc:
    print("open", type(exc).__name__, exc.code, exc.rule)
try:
    ckptfix.save({}, sys.argv[2])
except PermissionError as exc:
    print("save", type(exc).__name__)
"""


@pytest.mark.slow
def test_what_the_os_will_not_let_a_user_read_or_write(factory: Factory, tmp_path: Path) -> None:
    path = factory.safetensors("m.safetensors", [Spec("a")])
    path.chmod(0)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    run = python_as_another_user("-c", PERMISSIONS, path, locked / "out")
    assert run.code == 0, run.stderr
    assert run.stdout.splitlines() == [
        "open UnreadableInputError corrupt-file unreadable",
        "save WritePermissionError",
    ]
    assert os.listdir(locked) == []


def test_a_mapping_that_does_not_fit_is_a_value_error(tmp_path: Path) -> None:
    """convert's --to-hf as a function: a Megatron checkpoint and a target config whose
    tensors do not correspond is a bad argument (ValueError) naming its rule."""
    from tests import megatron_builders as tiny

    config = tiny.config_file(tmp_path / "base", model_type="qwen3")
    options = ckptfix.ConvertOptions(to_hf=str(config))
    with pytest.raises(ValueError) as refused:
        ckptfix.convert(tiny.SAVED, tmp_path / "never", options)
    assert isinstance(refused.value, ckptfix.MappingError)
    assert (refused.value.rule, refused.value.exit_code) == ("hf-unsourced", 1)
    assert not (tmp_path / "never").exists()
