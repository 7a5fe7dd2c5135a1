"""Broken and hostile training checkpoints: every variant is reported as a finding naming the
file (inspect exits 1), and a conversion writes nothing; no pickle ever executes."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import training_fixtures as fixtures
from tests.helpers import cli, measured, torch_bytes
from tests.training_fixtures import (
    PWNED,
    Evil,
    assert_refused,
    converted,
    edit_metadata,
    hostile_zip,
    set_zero_value,
    storage_entry,
)

pytestmark = pytest.mark.slow
copy_of = fixtures.copy_of
dcp_saved = fixtures.dcp_saved
zero_saved = fixtures.zero_saved  # fixtures shared by the training tests
Copy = Callable[[Path], Path]


@pytest.fixture(autouse=True)
def _no_marker() -> Any:
    PWNED.unlink(missing_ok=True)
    yield
    assert not PWNED.exists(), "a pickle was executed"


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


def test_a_single_rank_file_isrefused(dcp_saved: Path) -> None:
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


def _claim_huge(claim: str) -> Callable[[Any], None]:
    def change(metadata: Any) -> None:
        import torch

        index, info = storage_entry(metadata, "model.0.weight")
        if claim in ("length", "offset"):
            setattr(info, claim, 10**15)
            return
        entry = metadata.state_dict_metadata["model.0.weight"]
        entry.size = torch.Size([10**12, *entry.size[1:]])
        chunk = next(c for c in entry.chunks if list(c.offsets) == list(index.offset))
        chunk.sizes = torch.Size([10**12, *chunk.sizes[1:]])

    return change


@pytest.mark.parametrize(
    ("claim", "code"),
    [
        ("length", "truncated-rank-file"),
        ("offset", "truncated-rank-file"),
        ("rows", "chunk-overlap"),
    ],
)
def test_dcp_size_claims_are_checked_against_the_files(
    dcp_saved: Path, copy_of: Copy, tmp_path: Path, claim: str, code: str
) -> None:
    """The DeepSpeed count attacks against DCP's `.metadata` (which held): a chunk 10**15
    bytes long or that far in, a tensor of 10**12 rows; refused at once, naming the file."""
    folder = copy_of(dcp_saved / "torch_save")
    edit_metadata(folder, _claim_huge(claim))
    run = measured("inspect", folder, timeout=60)
    assert run.code == 1 and run.seconds < 20 and run.peak_rss < 500 * 2**20, run
    assert_refused(folder, tmp_path, code, folder / "__0_0.distcp")


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


def test_an_empty_tensor_claiming_a_dimension_past_2_64(
    dcp_saved: Path, copy_of: Copy, tmp_path: Path
) -> None:
    """No elements, so no chunk to check: the shape alone is what no safetensors file can hold
    (a rewrite wrote it, then failed its own verification as 'a bug')."""
    import copy

    import torch

    folder = copy_of(dcp_saved / "torch_save")

    def add(metadata: Any) -> None:
        entry = copy.deepcopy(metadata.state_dict_metadata["model.0.weight"])
        entry.size, entry.chunks = torch.Size([2**70, 0]), []
        metadata.state_dict_metadata["model.ghost"] = entry

    edit_metadata(folder, add)
    error = assert_refused(folder, tmp_path, "corrupt-file", folder / ".metadata")
    assert "'model.ghost' of shape [1180591620717411303424, 0]" in error["message"]
    assert "(rule bad-shape;" in error["message"]


def test_sharding_info_of_a_safetensors_chunk_nested_too_deeply(
    dcp_saved: Path, copy_of: Copy, tmp_path: Path
) -> None:
    """A DCP safetensors part whose DCP_SHARDING_INFO is nested 5,000 deep: an internal
    RecursionError; now its rank file's dcp-chunk error."""
    folder = copy_of(dcp_saved / "safetensors")
    rank = folder / "__0_0.distcp"

    def deepen(header: dict[str, Any]) -> None:
        header["__metadata__"]["DCP_SHARDING_INFO"] = "[" * 5000 + "]" * 5000

    fixtures.edit_header(rank, deepen)  # one part per rank file, at its start
    error = assert_refused(folder, tmp_path, "corrupt-file", rank)
    assert "DCP_SHARDING_INFO is not a JSON object (rule dcp-chunk;" in error["message"]


def test_compressed_chunks_arerefused(dcp_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(dcp_saved / "torch_save")

    def compress(metadata: Any) -> None:
        _, info = storage_entry(metadata, "model.0.bias")
        info.transform_descriptors = ["stream.zstd/1"]

    edit_metadata(folder, compress)
    error = assert_refused(folder, tmp_path, "unsupported-format")
    assert "stream.zstd/1" in error["message"]


def test_paths_outside_the_folder_arerefused(
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
    hostile = hostile_zip()
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
    states.write_bytes(hostile_zip())
    error = assert_refused(folder, tmp_path, "unsafe-pickle", states)
    assert "posix.system" in error["message"]


def test_hostile_optimizer_states(zero_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(zero_saved / "zero3_fp32")
    states = folder / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    states.write_bytes(hostile_zip())
    assert_refused(folder, tmp_path, "unsafe-pickle", states)


@pytest.mark.parametrize(("name", "count"), [("zero2_bf16", [10**12, 2]), ("zero3_fp32", 10**12)])
def test_a_world_size_the_partitions_contradict(
    zero_saved: Path, copy_of: Copy, tmp_path: Path, name: str, count: object
) -> None:
    """partition_count 10**12 in one rank's file: one finding on that file, at once (it was
    a loop over every claimed rank: 30 s and 2 GB, then more)."""
    folder = copy_of(zero_saved / name)
    prefix = "bf16_" if name.endswith("bf16") else ""
    states = folder / "global_step2" / f"{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt"
    set_zero_value(states, "optimizer_state_dict/partition_count", count)
    error = assert_refused(folder, tmp_path, "corrupt-file", states)
    assert "partition_count says 1000000000000 ranks" in error["message"]
    assert "(rule zero-counts;" in error["message"]


def test_a_rank_file_past_the_world_size(zero_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(zero_saved / "zero2_fp32")
    tag = folder / "global_step2"
    stray = tag / "zero_pp_rank_7_mp_rank_00_optim_states.pt"
    stray.write_bytes((tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").read_bytes())
    error = assert_refused(folder, tmp_path, "corrupt-file", stray)
    assert (
        "is rank 7's optimizer partition, but partition_count says the run had 2"
        in (error["message"])
    )


def test_a_chain_of_shared_params(zero_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    """DeepSpeed maps each alias to a stored name: a chain would make the order of the
    record decide which names survive (zero_to_fp32.py drops one silently)."""
    folder = copy_of(zero_saved / "zero2_fp32")
    states = folder / "global_step2" / "mp_rank_00_model_states.pt"
    set_zero_value(states, "shared_params", {"head.weight": "tied", "tied": "embed.weight"})
    error = assert_refused(folder, tmp_path, "corrupt-file", states)
    assert "makes 'head.weight' an alias of 'tied', itself an alias" in error["message"]


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


@pytest.mark.parametrize("name", ["zero1_fp32", "zero2_bf16", "zero3_fp32"])
def test_missing_optimizer_states_point_at_the_module_weights(
    zero_saved: Path, copy_of: Copy, tmp_path: Path, name: str
) -> None:
    """Without the optimizer states the fp32 master weights are lost; stages 1-2 still keep
    the weights in the training dtype in `module`, which the fix then takes, bitwise."""
    import torch

    folder = copy_of(zero_saved / name)
    for path in (folder / "global_step2").glob("*optim_states.pt"):
        path.unlink()
    error = assert_refused(folder, tmp_path, "missing-rank-file")
    if name.startswith("zero3"):  # `module` holds placeholders: nothing to take instead
        assert error["fix"] == "none: copy the missing rank file from where the run saved it"
        assert "--zero-weights" not in error["message"]
        return
    assert error["fix"] == f"ckptfix convert {folder} -o OUT --zero-weights module"
    assert error["message"] == (
        "the optimizer states (fp32 master weights) file is missing (convert with "
        "--zero-weights module to take the training-dtype weights the model states hold, or "
        "copy it from the training run's output)"
    )
    written, dropped = converted(folder, tmp_path / "out", "--zero-weights", "module")
    states = folder / "global_step2" / "mp_rank_00_model_states.pt"
    module = torch.load(states, weights_only=False)["module"]  # our own fixture
    assert set(written) | set(dropped) == set(module)
    for key, tensor in module.items():
        got = written[dropped.get(key, key)]
        assert (got.dtype, torch_bytes(got)) == (tensor.dtype, torch_bytes(tensor)), key


# --- torch's HuggingFaceStorageWriter, per rank; accelerate's FSDP folders ------------------

hf_writer_saved = fixtures.hf_writer_saved
accelerate_saved = fixtures.accelerate_saved
RANK = "shard-0000{}-model-00001-of-00001.safetensors"


def _edit_rank(folder: Path, rank: int, change: Callable[[dict[str, Any]], None]) -> Path:
    path = folder / RANK.format(rank)
    fixtures.edit_header(path, change)
    return path


@pytest.mark.parametrize(
    "info",
    [
        {"embed.weight": {"saved_offsets": [106]}},  # one offset for a 2-D piece
        {"embed.weight": {"saved_offsets": [106, -1]}},
        {"embed.weight": {"offsets": [106, 0]}},
        "not json",
    ],
    ids=["short", "negative", "no-offsets", "not-json"],
)
def test_malformed_sharding_info(
    hf_writer_saved: Path, copy_of: Copy, tmp_path: Path, info: Any
) -> None:
    folder = copy_of(hf_writer_saved / "per_rank")

    def change(header: dict[str, Any]) -> None:
        if isinstance(info, str):
            header["__metadata__"]["DCP_SHARDING_INFO"] = info
            return
        fixtures.set_sharding(header, {**fixtures.sharding_of(header), **info})

    path = _edit_rank(folder, 2, change)
    error = assert_refused(folder, tmp_path, "corrupt-file", path)
    assert "(rule dcp-sharding-info;" in error["message"]


@pytest.mark.parametrize(
    ("row", "code"), [(100, "chunk-overlap"), (120, "chunk-gap")], ids=["overlap", "gap"]
)
def test_pieces_that_do_not_tile(
    hf_writer_saved: Path, copy_of: Copy, tmp_path: Path, row: int, code: str
) -> None:
    folder = copy_of(hf_writer_saved / "per_rank")

    def move(header: dict[str, Any]) -> None:
        info = fixtures.sharding_of(header)
        info["embed.weight"]["saved_offsets"] = [row, 0]
        fixtures.set_sharding(header, info)

    _edit_rank(folder, 2, move)
    error = assert_refused(folder, tmp_path, code)
    assert error["tensors"] == ["embed.weight"]
    assert RANK.format(2) in error["message"]


def test_pieces_disagreeing_on_dtype(hf_writer_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    folder = copy_of(hf_writer_saved / "per_rank")

    def retype(header: dict[str, Any]) -> None:
        header["embed.weight"]["dtype"] = "I32"  # same width, another dtype

    _edit_rank(folder, 2, retype)
    error = assert_refused(folder, tmp_path, "corrupt-file")
    assert "disagree on dtype" in error["message"]


def test_missing_first_rank_file(hf_writer_saved: Path, copy_of: Copy, tmp_path: Path) -> None:
    """Rank 1 gone: rank 2's pieces start at row 106, and rank 1 is named missing. (A missing
    last rank cannot be seen: nothing in the headers records the world size or the shapes.)"""
    folder = copy_of(hf_writer_saved / "two_files")
    for part in (1, 2):
        (folder / f"shard-00001-model-0000{part}-of-00002.safetensors").unlink()
    error = assert_refused(folder, tmp_path, "missing-rank-file")
    assert "no file of rank 1" in error["message"]
    codes = [f["code"] for f in cli("inspect", folder, "--json").json()["findings"]]
    assert "chunk-gap" in codes


def test_accelerate_model_folder_without_metadata(
    accelerate_saved: Path, copy_of: Copy, tmp_path: Path
) -> None:
    folder = copy_of(accelerate_saved / "state")
    (folder / "pytorch_model_fsdp_0" / ".metadata").unlink()
    for command in (["inspect", folder], ["convert", folder, "-o", tmp_path / "out"]):
        run = cli(*command)
        assert run.code == 1
        assert run.error_lines[0].startswith(f"error: {folder / 'pytorch_model_fsdp_0'}: ")
        assert "(rule dcp-no-metadata;" in run.error_lines[0]
    assert not (tmp_path / "out").exists()


def test_accelerate_missing_rank_file(
    accelerate_saved: Path, copy_of: Copy, tmp_path: Path
) -> None:
    folder = copy_of(accelerate_saved / "state")
    missing = folder / "pytorch_model_fsdp_0" / "__1_0.distcp"
    missing.unlink()
    assert_refused(folder, tmp_path, "missing-rank-file", missing)
