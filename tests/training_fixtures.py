"""Session fixtures: training checkpoints written once per test session by the frameworks
themselves (tests/training_frameworks.py; DeepSpeed's ds_to_universal for the universal
checkpoints), helpers to damage copies of them, and what a refusal of one must look like."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.helpers import cli
from tests.optional import need

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parent.parent
UNIVERSAL = ["zero1_fp32", "zero1_bf16", "zero2_fp32", "zero2_bf16", "zero3_fp32", "zero3_bf16"]


_WRITTEN: dict[str, Path] = {}  # each kind once per session, whichever module asks first
# The optional packages each writer runs (in a fresh process, where a missing one would
# fail the fixture instead of skipping it): tests/training_frameworks.py, training_writers.py
# and megatron_writer.py.
_NEEDS = {
    "dcp": (),
    "hf_writer": (),
    "zero": ("deepspeed",),
    "accelerate": ("accelerate", "transformers"),
    "trainer": ("transformers", "accelerate", "deepspeed"),
    "lightning": ("pytorch_lightning", "deepspeed"),
    # psutil: megatron-core imports it without declaring it, and its save hangs without it
    "megatron": ("megatron.core", "psutil", "transformers"),
}


def _written_by(kind: str, factory: pytest.TempPathFactory) -> Path:
    need(*_NEEDS[kind])
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


def ds_to_universal(tag: Path, output: Path) -> subprocess.CompletedProcess[str]:
    """DeepSpeed's own conversion of the tag folder `tag` into `output`, on CPU.
    `--inject_missing_state` adds the `universal_checkpoint_info` a Megatron-DeepSpeed client
    records (a plain DeepSpeed engine records none)."""
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
    command += ["--input_folder", str(tag), "--output_folder", str(output)]
    command += ["--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"]
    return subprocess.run(
        command,
        env={**os.environ, "DS_BUILD_OPS": "0", "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _to_universal(folder: Path) -> None:
    """`global_step2_universal/` and `latest_universal` beside the tag folder."""
    done = ds_to_universal(folder / "global_step2", folder / "global_step2_universal")
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="session")
def universal_saved(zero_saved: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """zero{1,2,3}_{fp32,bf16}/ again, each with the universal checkpoint ds_to_universal
    made of it (`global_step2_universal/`, `latest_universal`)."""
    if "universal" in _WRITTEN:
        return _WRITTEN["universal"]
    out = tmp_path_factory.mktemp("universal") / "saved"
    for name in UNIVERSAL:
        shutil.copytree(zero_saved / name, out / name)
    with ThreadPoolExecutor(2) as pool:  # two cores
        list(pool.map(_to_universal, [out / name for name in UNIVERSAL]))
    _WRITTEN["universal"] = out
    return out


@pytest.fixture(scope="session")
def hf_writer_saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torch's HuggingFaceStorageWriter per rank: per_rank/, two_files/, and consolidated/
    (torch's consolidation, with its sharded/ input); see tests/training_writers.py."""
    return _written_by("hf_writer", tmp_path_factory)


@pytest.fixture(scope="session")
def accelerate_saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """accelerate's save_state under FSDP2: state/ (one model) and two_models/; without FSDP,
    of two models: plain_two/."""
    return _written_by("accelerate", tmp_path_factory)


@pytest.fixture(scope="session")
def trainer_saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Trainer's checkpoint-2/ under FSDP (fsdp_sharded/, fsdp_full/) and ZeRO-3 (zero3/)."""
    return _written_by("trainer", tmp_path_factory)


@pytest.fixture(scope="session")
def lightning_saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Lightning's save_checkpoint under FSDPStrategy (sharded: fsdp/) and DeepSpeedStrategy
    (stage 2: deepspeed/)."""
    return _written_by("lightning", tmp_path_factory)


@pytest.fixture(scope="session")
def megatron_saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder per case of tests/megatron_writer.py (llama, mistral, qwen2, qwen3, mixtral,
    qwen3_moe, gpt), each with ckpt/ (written by megatron-core, 2 gloo ranks), hf/ (the
    transformers model it started from), logits.pt and oracle.pt (Megatron's own load)."""
    return _written_by("megatron", tmp_path_factory)


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


PWNED = Path("/tmp/ckptfix-training-pwned")


class Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {PWNED}",))


def hostile_zip() -> bytes:
    """A torch zip whose pickle runs a command when loaded."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickle.dumps(Evil(), protocol=2))
        archive.writestr("archive/version", "3\n")
    return buffer.getvalue()


def zero_to_fp32(folder: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's own reconstruction of a ZeRO checkpoint's fp32 weights (the oracle)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(folder)))


def converted(
    folder: Path, out: Path, *options: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`ckptfix convert`'s output, read back, and its alias record (alias -> kept name)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    run = cli("convert", folder, "-o", out, *options)
    assert run.code == 0, run.stderr
    with safe_open(out / "model.safetensors", "pt") as handle:
        metadata = handle.metadata() or {}
    return load_file(out / "model.safetensors"), json.loads(metadata.get("ckptfix.dropped", "{}"))


def edit_header(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite a safetensors file's header (tensor bytes unchanged): `change` edits the
    parsed header in place."""
    import json
    import struct

    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    change(header)
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + length :])


def sharding_of(header: dict[str, Any]) -> dict[str, Any]:
    import json

    info: dict[str, Any] = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    return info


def set_sharding(header: dict[str, Any], info: Any) -> None:
    import json

    header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)


_SET = """
import ast, sys, torch
path, keys, value = sys.argv[1], sys.argv[2].split("/"), ast.literal_eval(sys.argv[3])
saved = torch.load(path, weights_only=False)  # our own fixture, written moments ago
target = saved
for key in keys[:-1]:
    target = target[key]
target[keys[-1]] = value
torch.save(saved, path)
"""


def set_zero_value(path: Path, keys: str, value: object) -> None:
    """Set `keys` ("a/b") of a DeepSpeed states file to a literal `value`, in a subprocess
    (unpickling the file needs DeepSpeed's classes, which the test process never imports)."""
    env = {**os.environ, "DS_BUILD_OPS": "0", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-c", _SET, str(path), keys, repr(value)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
