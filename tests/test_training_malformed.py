"""Broken and hostile training checkpoints: every variant is reported as a finding naming the
file (inspect exits 1), and a conversion writes nothing; no pickle ever executes."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import training_fixtures as fixtures
from tests.helpers import cli
from tests.training_fixtures import assert_refused, edit_metadata, storage_entry

pytestmark = pytest.mark.slow
copy_of = fixtures.copy_of
dcp_saved = fixtures.dcp_saved
zero_saved = fixtures.zero_saved  # fixtures shared by the training tests
Copy = Callable[[Path], Path]


class Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /tmp/ckptfix-training-pwned",))


def _hostile_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickle.dumps(Evil(), protocol=2))
        archive.writestr("archive/version", "3\n")
    return buffer.getvalue()


@pytest.fixture(autouse=True)
def _no_marker() -> Any:
    marker = Path("/tmp/ckptfix-training-pwned")
    marker.unlink(missing_ok=True)
    yield
    assert not marker.exists(), "a pickle was executed"


# --- torch.distributed.checkpoint -----------------------------------------------------------


def test_truncated_rank_file(dcp_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(dcp_saved / "torch_save")
    rank = folder / "__1_0.distcp"
    os.truncate(rank, rank.stat().st_size - 100)
    error = assert_refused(folder, tmp_path, "truncated-rank-file", rank)
    assert "cut short" in error["message"]


def test_missing_rank_file(dcp_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(dcp_saved / "safetensors")
    (folder / "__0_0.distcp").unlink()
    error = assert_refused(folder, tmp_path, "missing-rank-file", folder / "__0_0.distcp")
    assert "0.weight" in error["tensors"]


def test_rank_files_without_metadata(dcp_saved: Path, copy_of: Copy) -> None:
    folder = copy_of(dcp_saved / "torch_save")
    (folder / ".metadata").unlink()
    run = cli("inspect", folder)
    assert run.code == 1
    assert run.error_lines == [
        f"error: {folder}: folder holds 2 .distcp rank file(s) but no .metadata: without it "
        "nothing says which tensors they hold (a save writes .metadata last; was it "
        "interrupted?) (rule dcp-no-metadata; copy .metadata from the training run's output, "
        "or save the checkpoint again)"
    ]


def test_a_single_rank_file_is_refused(dcp_saved: Path) -> None:
    run = cli("inspect", dcp_saved / "torch_save" / "__0_0.distcp")
    assert run.code == 2
    assert "one part of a torch.distributed.checkpoint folder" in run.stderr


def test_overlapping_chunks(dcp_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(dcp_saved / "torch_save")

    def grow(metadata: Any) -> None:  # rank 0's chunk of `positions` claims 5 rows, not 4
        import torch

        chunk = metadata.state_dict_metadata["model.positions"].chunks[0]
        chunk.sizes = torch.Size([5])

    edit_metadata(folder, grow)
    error = assert_refused(folder, tmp_path, "chunk-overlap")
    assert "'model.positions'" in error["message"]
    assert "__0_0.distcp" in error["message"] and "__1_0.distcp" in error["message"]


def test_chunk_gap(dcp_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(dcp_saved / "torch_save")

    def drop(metadata: Any) -> None:
        metadata.state_dict_metadata["model.0.weight"].chunks.pop()

    edit_metadata(folder, drop)
    error = assert_refused(folder, tmp_path, "chunk-gap")
    assert "cover 80 of its 140 bytes" in error["message"]


def test_chunk_out_of_range(dcp_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(dcp_saved / "torch_save")

    def shift(metadata: Any) -> None:
        import torch

        metadata.state_dict_metadata["model.0.weight"].size = torch.Size([6, 5])

    edit_metadata(folder, shift)
    error = assert_refused(folder, tmp_path, "chunk-out-of-range", folder / "__1_0.distcp")
    assert "lies outside 'model.0.weight' of shape [6, 5]" in error["message"]


def test_metadata_disagreeing_with_the_chunk(
    dcp_saved: Path, copy_of: Copy, tmp_path: Path
) -> None:
    folder = copy_of(dcp_saved / "torch_save")

    def retype(metadata: Any) -> None:
        import torch

        metadata.state_dict_metadata["model.1.bias"].properties.dtype = torch.int32

    edit_metadata(folder, retype)
    error = assert_refused(folder, tmp_path, "corrupt-file")
    assert "holds a F32 tensor of shape" in error["message"]


def test_compressed_chunks_are_refused(dcp_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(dcp_saved / "torch_save")

    def compress(metadata: Any) -> None:
        _, info = storage_entry(metadata, "model.0.bias")
        info.transform_descriptors = ["stream.zstd/1"]

    edit_metadata(folder, compress)
    error = assert_refused(folder, tmp_path, "unsupported-format")
    assert "stream.zstd/1" in error["message"]


def test_paths_outside_the_folder_are_refused(
    dcp_saved: Path, copy_of: Copy, tmp_path: Path
) -> None:
    folder = copy_of(dcp_saved / "torch_save")

    def escape(metadata: Any) -> None:
        _, info = storage_entry(metadata, "model.0.bias")
        info.relative_path = "../__0_0.distcp"

    edit_metadata(folder, escape)
    error = assert_refused(folder, tmp_path, "corrupt-file", folder / ".metadata")
    assert "rule path-traversal" in error["message"]


def test_hostile_metadata(dcp_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(dcp_saved / "torch_save")
    (folder / ".metadata").write_bytes(pickle.dumps(Evil()))
    error = assert_refused(folder, tmp_path, "unsafe-pickle", folder / ".metadata")
    assert "posix.system" in error["message"]


def test_hostile_pickle_in_a_chunk(dcp_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(dcp_saved / "torch_save")
    rank = folder / "__1_0.distcp"
    hostile = _hostile_zip()
    start = rank.stat().st_size
    with open(rank, "ab") as handle:
        handle.write(hostile)

    def point(metadata: Any) -> None:
        _, info = storage_entry(metadata, "model.0.weight", 1)
        info.offset, info.length = start, len(hostile)

    edit_metadata(folder, point)
    error = assert_refused(folder, tmp_path, "unsafe-pickle", rank)
    assert "chunk [4, 0] of 'model.0.weight'" in error["message"]
    assert "posix.system" in error["message"]
    # only the tensor with the hostile chunk is left out; the rest is still described
    assert cli("inspect", folder, "--json").json()["tensor_count"] == 10


# --- DeepSpeed ------------------------------------------------------------------------------


def test_missing_optimizer_partition(zero_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(zero_saved / "zero2_bf16")
    missing = folder / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    missing.unlink()
    error = assert_refused(folder, tmp_path, "missing-rank-file", missing)
    assert "rank 1's optimizer partition is missing" in error["message"]


def test_missing_stage3_model_states(zero_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(zero_saved / "zero3_fp32")
    missing = folder / "global_step2" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    missing.unlink()
    assert_refused(folder, tmp_path, "missing-rank-file", missing)


def test_tag_pointing_nowhere(zero_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(zero_saved / "zero1_fp32")
    (folder / "latest").write_text("global_step9")
    error = assert_refused(folder, tmp_path, "tag-missing", folder / "latest")
    assert "tag folders present: global_step2" in error["message"]


def test_truncated_optimizer_file(zero_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(zero_saved / "zero3_bf16")
    rank = folder / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    os.truncate(rank, rank.stat().st_size // 2)
    error = assert_refused(folder, tmp_path, "corrupt-file", rank)
    assert "rule bad-zip" in error["message"]


def test_hostile_model_states(zero_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(zero_saved / "zero2_fp32")
    states = folder / "global_step2" / "mp_rank_00_model_states.pt"
    states.write_bytes(_hostile_zip())
    error = assert_refused(folder, tmp_path, "unsafe-pickle", states)
    assert "posix.system" in error["message"]


def test_hostile_optimizer_states(zero_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(zero_saved / "zero3_fp32")
    states = folder / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    states.write_bytes(_hostile_zip())
    assert_refused(folder, tmp_path, "unsafe-pickle", states)


@pytest.mark.parametrize(
    "name", ["mp_rank_01_model_states.pt", "expert_0_mp_rank_00_model_states.pt"]
)
def test_parallel_parts_are_refused_not_dropped(
    zero_saved: Path, copy_of: Copy, tmp_path: Path, name: str
) -> None:
    folder = copy_of(zero_saved / "zero2_fp32")
    tag = folder / "global_step2"
    (tag / name).write_bytes((tag / "mp_rank_00_model_states.pt").read_bytes())
    run = cli("convert", folder, "-o", tmp_path / "never")
    assert run.code == 1
    assert run.error_lines == [
        f"error: {tag}: {name} belongs to a tensor-, pipeline- or expert-parallel checkpoint, "
        "whose parts ckptfix does not merge (rule unsupported-format; convert it with DeepSpeed's "
        "ds_to_universal.py first)"
    ]
    assert not (tmp_path / "never").exists()
