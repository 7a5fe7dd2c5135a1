"""Folders of more files than the process may open: 300 safetensors shards, 300 DCP rank
files, DeepSpeed runs of 300 ranks, and the shards over HTTP. Every command runs with soft
and hard RLIMIT_NOFILE 256 (so raising the soft limit cannot help), writes 300 output files
where it can, and its output is compared bitwise with the reference tensors by the
reference readers (safetensors, torch.load) and the reference digest (tests/hash_oracle)."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import hash_oracle
from tests.builders import random_tensor
from tests.helpers import Measured, measured
from tests.optional import need
from tests.remote_servers import http_server
from tests.zero_builders import ZeroSpec, weights, zero_folder

pytestmark = pytest.mark.slow
LIMIT = 256
COUNT = 300  # files of each layout: more than LIMIT
ONE_PER_SHARD = ("--max-shard", "100")  # every tensor is 64 bytes: 300 output files


def _run(*args: str | Path) -> Measured:
    run = measured(*args, open_files=LIMIT, timeout=600)
    assert run.code == 0, run.stderr[-2000:]
    return run


def _reference() -> dict[str, Any]:
    return {f"layers.{i:03d}.weight": random_tensor("F32", (4, 4), seed=i) for i in range(COUNT)}


def _loaded(folder: Path) -> dict[str, Any]:
    """Every tensor of a written folder, read by safetensors and torch themselves."""
    import torch
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".safetensors":
            part = load_file(path)
        elif path.suffix == ".bin":
            part = torch.load(path, weights_only=True)
        else:
            continue
        assert not set(part) & set(tensors), path
        tensors.update(part)
    return tensors


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        other = got[name]
        assert (other.dtype, other.shape) == (tensor.dtype, tensor.shape), name
        assert hash_oracle.row_major(other) == hash_oracle.row_major(tensor), name


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 shards of one tensor each, with their index; no "format" in the headers, so
    `fix` rewrites every one."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("many") / "shards"
    folder.mkdir()
    weight_map = {}
    for number, (name, tensor) in enumerate(_reference().items(), start=1):
        file = f"model-{number:05d}-of-{COUNT:05d}.safetensors"
        save_file({name: tensor}, folder / file)
        weight_map[name] = file
    index = {"metadata": {"total_size": 64 * COUNT}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torch.distributed.checkpoint's own save, one rank file per tensor (thread_count)."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("many") / "dcp"
    writer = dcp.FileSystemWriter(str(folder), thread_count=COUNT)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(_reference(), storage_writer=writer, no_dist=True)
    assert len(list(folder.glob("*.distcp"))) == COUNT
    return folder


def test_a_folder_of_300_shards(shards: Path, tmp_path: Path) -> None:
    reference = _reference()
    report = json.loads(_run("inspect", shards, "--json").stdout)
    assert report["tensor_count"] == COUNT and len(report["files"]) == COUNT + 1
    assert _run("hash", shards).stdout.split()[0] == hash_oracle.digest(reference)
    for command, extra in (("reshard", ONE_PER_SHARD), ("dedupe", ONE_PER_SHARD), ("convert", ())):
        out = tmp_path / command
        _run(command, shards, "-o", out, *extra)
        _same(_loaded(out), reference)
    assert len(list((tmp_path / "reshard").glob("*.safetensors"))) == COUNT
    _run("convert", shards, "-o", tmp_path / "bin", "--to", "torch", *ONE_PER_SHARD)
    assert len(list((tmp_path / "bin").glob("*.bin"))) == COUNT
    _same(_loaded(tmp_path / "bin"), reference)
    assert "identical" in _run("diff", shards, tmp_path / "bin").stdout


def test_fix_of_300_shards(shards: Path, tmp_path: Path) -> None:
    reference = _reference()
    _run("fix", shards, "-o", tmp_path / "fixed")
    _same(_loaded(tmp_path / "fixed"), reference)
    copy = tmp_path / "copy"
    shutil.copytree(shards, copy)
    _run("fix", copy, "--in-place")
    _same(_loaded(copy), reference)


def test_a_dcp_folder_of_300_rank_files(dcp_folder: Path, tmp_path: Path) -> None:
    reference = _reference()
    assert json.loads(_run("inspect", dcp_folder, "--json").stdout)["tensor_count"] == COUNT
    assert _run("hash", dcp_folder).stdout.split()[0] == hash_oracle.digest(reference)
    _run("convert", dcp_folder, "-o", tmp_path / "st")
    _same(_loaded(tmp_path / "st"), reference)
    _run("convert", dcp_folder, "-o", tmp_path / "bin", "--to", "torch", *ONE_PER_SHARD)
    _same(_loaded(tmp_path / "bin"), reference)
    assert "identical" in _run("diff", dcp_folder, tmp_path / "st").stdout


@pytest.mark.parametrize(
    "spec",
    [
        ZeroSpec(stage=3, world=COUNT),  # 600 files: model and optimizer states per rank
        ZeroSpec(stage=2, world=COUNT, model={"embed.weight": (100, 30), "body.weight": (20, 30)}),
    ],
    ids=["zero3", "zero2"],
)
def test_a_deepspeed_run_of_300_ranks(tmp_path: Path, spec: ZeroSpec) -> None:
    folder = zero_folder(tmp_path / "ds", spec)
    reference = weights(spec)
    layout = json.loads(_run("inspect", folder, "--json").stdout)["layout"]
    assert layout["world_size"] == COUNT
    assert _run("hash", folder).stdout.split()[0] == hash_oracle.digest(reference)
    _run("convert", folder, "-o", tmp_path / "st")
    _same(_loaded(tmp_path / "st"), reference)


@pytest.fixture
def served(shards: Path) -> Iterator[str]:
    need("aiohttp")
    with http_server(shards.parent) as server:
        yield f"{server.url}/{shards.name}/"


def test_300_shards_over_http(served: str, tmp_path: Path) -> None:
    reference = _reference()
    assert json.loads(_run("inspect", served, "--json").stdout)["tensor_count"] == COUNT
    _run("convert", served, "-o", tmp_path / "st", *ONE_PER_SHARD)
    _same(_loaded(tmp_path / "st"), reference)
