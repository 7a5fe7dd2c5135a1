"""Session fixtures: training checkpoints written once per test session by the frameworks
themselves (tests/training_frameworks.py), and helpers to damage copies of them."""

from __future__ import annotations

import importlib.util
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import cli

ROOT = Path(__file__).resolve().parent.parent


_WRITTEN: dict[str, Path] = {}  # each kind once per session, whichever module asks first


def _written_by(kind: str, factory: pytest.TempPathFactory) -> Path:
    if kind in _WRITTEN:
        return _WRITTEN[kind]
    out = factory.mktemp(kind) / "saved"
    env = {**os.environ, "DS_BUILD_OPS": "0", "PYTHONWARNINGS": "ignore"}
    module = (
        ["tests.megatron_writer"] if kind == "megatron" else ["tests.training_frameworks", kind]
    )
    for _ in range(2):  # a second try with a fresh port: gloo rendezvous can race
        shutil.rmtree(out, ignore_errors=True)
        done = subprocess.run(
            [sys.executable, "-m", *module, str(out)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if done.returncode == 0:
            break
    assert done.returncode == 0, done.stderr[-4000:]
    _WRITTEN[kind] = out
    return out


@pytest.fixture(scope="session")
def dcp_saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torch_save/, safetensors/ (nested app state), flat/ (model at the top level) and
    reference.pt (the model's full tensors, gathered by the ranks)."""
    return _written_by("dcp", tmp_path_factory)


@pytest.fixture(scope="session")
def zero_saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """zero{1,2,3}_{fp32,bf16}/: DeepSpeed checkpoints (latest, tag folder, zero_to_fp32.py)."""
    return _written_by("zero", tmp_path_factory)


@pytest.fixture(scope="session")
def megatron_saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder per case of tests/megatron_writer.py (llama, mistral, qwen2, qwen3, mixtral,
    qwen3_moe, gpt), each with ckpt/ (written by megatron-core, 2 gloo ranks), hf/ (the
    transformers model it started from), logits.pt and oracle.pt (Megatron's own load)."""
    _require("megatron.core", "megatron-core is not installed (the test extra)")
    _require("psutil", "psutil is not installed (megatron-core's save hangs without it)")
    return _written_by("megatron", tmp_path_factory)


def _require(module: str, reason: str) -> None:
    """Skip unless `module` can be imported. Looked up, not imported: importing megatron.core
    costs seconds and prints Transformer Engine warnings, and only the writer needs it."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that is not a package, or blocked
        found = False
    if not found:
        pytest.skip(reason)


@pytest.fixture
def copy_of(tmp_path: Path) -> Callable[[Path], Path]:
    """A private copy of a saved checkpoint, to damage."""

    def make(source: Path) -> Path:
        target = tmp_path / source.name
        shutil.copytree(source, target)
        return target

    return make


def edit_metadata(folder: Path, change: Callable[[Any], None]) -> None:
    """Rewrite a DCP `.metadata` with torch's own classes (the tests may import them)."""
    path = folder / ".metadata"
    with open(path, "rb") as handle:
        metadata = pickle.load(handle)  # our own fixture, written moments ago by torch
    change(metadata)
    with open(path, "wb") as handle:
        pickle.dump(metadata, handle)


def storage_entry(metadata: Any, fqn: str, index: int = 0) -> tuple[Any, Any]:
    """(MetadataIndex, _StorageInfo) of the index-th chunk of `fqn`."""
    entries = [(k, v) for k, v in metadata.storage_data.items() if k.fqn == fqn]
    return sorted(entries, key=lambda kv: tuple(kv[0].offset))[index]


def assert_refused(
    folder: Path,
    tmp_path: Path,
    code: str,
    file: Path | None = None,
    conversions: tuple[tuple[str, ...], ...] = ((),),
) -> dict[str, Any]:
    """inspect reports `code` as its first error (about `file`); `convert` with each of
    `conversions`' options writes nothing (no OUT, no staging folder) and says why in one
    line. Returns the error finding."""
    run = cli("inspect", folder, "--json")
    assert run.code == 1, run.stdout
    errors = [item for item in run.json()["findings"] if item["severity"] == "error"]
    assert [item["code"] for item in errors][:1] == [code], errors
    if file is not None:
        assert errors[0]["file"] == str(file)
    for options in conversions:
        out = tmp_path / "never"
        converted = cli("convert", folder, "-o", out, *options)
        assert converted.code == 1, converted.stderr
        assert len(converted.error_lines) == 1, converted.stderr
        assert not out.exists() and not list(tmp_path.glob(".ckptfix-*"))
    error: dict[str, Any] = errors[0]
    return error
