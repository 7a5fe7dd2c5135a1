"""Per-rank HuggingFaceStorageWriter sets built by hand (tests/hf_shard_builders.py): the
claims their file names and headers make, checked in bounded time and memory. The sets torch
itself writes are tested in tests/test_training_writers.py and test_training_malformed.py."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.builders import Factory, Spec
from tests.helpers import cli, measured, torch_bytes
from tests.hf_shard_builders import DEFAULT_RANKS, RANK_FILE, RankPiece, rank_folder

MUTATIONS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.slow
def test_a_rank_numbered_in_the_hundreds_of_billions_is_counted_not_listed(
    tmp_path: Path,
) -> None:
    """A rank file named `shard-99999999999-...` beside rank 1: the ranks missing between
    them are named up to a few and counted, never enumerated (that ran out of time)."""
    folder = rank_folder(tmp_path / "ranks", {1: DEFAULT_RANKS[1], 99999999999: DEFAULT_RANKS[2]})
    run = measured("inspect", folder, "--json", timeout=30)
    assert run.code == 1, run.stderr
    assert run.seconds < 10 and run.peak_rss < 300 * 2**20, run
    findings = [f for f in cli("inspect", folder, "--json").json()["findings"]]
    missing = [f["message"] for f in findings if f["code"] == "missing-rank-file"]
    assert missing[0].startswith("no file of rank 2 (ranks 1-99999999999 saved files;")
    assert "no file of 99,999,999,989 more of the ranks below 99999999999" in missing[-1]
    assert len(missing) == 9


def test_missing_middle_ranks_are_each_named(tmp_path: Path) -> None:
    folder = rank_folder(tmp_path / "ranks", {1: DEFAULT_RANKS[1], 4: DEFAULT_RANKS[2]})
    findings = cli("inspect", folder, "--json").json()["findings"]
    files = [f["file"] for f in findings if f["code"] == "missing-rank-file"]
    assert files == [str(folder / f"shard-0000{rank}-model-*.safetensors") for rank in (2, 3)]


def test_pieces_placed_past_2_64_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    """Zero-element pieces at offset 2**70: the tensor they make has a dimension no
    safetensors file can hold. inspect --json reports it (it was an internal error), and
    convert refuses it (it wrote it, then failed its verification, 'a bug')."""
    ranks = {**DEFAULT_RANKS, 3: (RankPiece("empty", (3, 0), (2**70, 0)),)}
    folder = rank_folder(tmp_path / "ranks", ranks)
    run = cli("inspect", folder, "--json")
    assert run.code == 1, run.stderr
    (problem,) = [f for f in run.json()["findings"] if f["severity"] == "error"]
    assert problem["file"] == str(folder / "shard-00003-model-00001-of-00001.safetensors")
    assert "'empty' of shape [1180591620717411303427, 0]" in problem["message"]
    assert [t["shape"] for t in run.json()["tensors"] if t["name"] == "empty"] == [[2**70 + 3, 0]]
    out = tmp_path / "out"
    converted = cli("convert", folder, "-o", out)
    assert converted.code == 1 and len(converted.error_lines) == 1
    assert "(rule bad-shape;" in converted.error_lines[0]
    assert not out.exists()


def test_a_per_rank_set_beside_a_model_file_is_two_checkpoints(
    tmp_path: Path, factory: Factory
) -> None:
    """A per-rank set and a model.safetensors in one folder: the set was read and the model
    file silently passed over ('left out: not read by a loader of the model', which is what a
    loader reads). Neither is chosen; convert asks which."""
    folder = rank_folder(tmp_path / "ranks")
    factory.safetensors("model.safetensors", [Spec("other")])
    shutil.copy(factory.root / "model.safetensors", folder / "model.safetensors")
    report = cli("inspect", folder, "--json").json()
    assert [item["code"] for item in report["findings"]] == ["several-checkpoints"]
    assert report["layout"]["separate"] == ["shard-*-model-*.safetensors", "model.safetensors"]
    assert report["tensor_count"] == 0
    out = tmp_path / "out"
    run = cli("convert", folder, "-o", out)
    assert run.code == 2 and not out.exists()
    assert run.error_lines == [
        f"error: {folder}: folder holds 2 models (shard-*-model-*.safetensors, "
        f"model.safetensors), which are never merged (rule usage; pass the one to use, e.g. "
        f"{folder / 'model.safetensors'})"
    ]


def _torch_reads(folder: Path) -> dict[str, Any] | None:
    """The set as torch's own HuggingFaceStorageReader loads it, or None when torch refuses
    it (it checks less than ckptfix: where ckptfix converts, torch must agree)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        metadata = HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata
        state = {
            name: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
            for name, entry in metadata.items()
        }
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
    except Exception:
        return None
    return state


@pytest.mark.slow
@MUTATIONS
@given(st.data())
def test_a_damaged_rank_file_converts_as_torch_reads_it_or_fails_cleanly(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """One byte of one rank file changed anywhere (header, sharding info or data): every
    command fails with exit 1 and one error line, or convert writes what torch's own reader
    loads from the damaged set."""
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("mutated")
    folder = rank_folder(root / "ranks")
    rank = folder / RANK_FILE.format(rank=data.draw(st.sampled_from(sorted(DEFAULT_RANKS))))
    raw = bytearray(rank.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")  # the tensors' bytes: half the draws
    at = data.draw(st.integers(0, start - 1) | st.integers(start, len(raw) - 1))
    raw[at] = data.draw(st.integers(0, 255).filter(lambda value: value != raw[at]))
    rank.write_bytes(bytes(raw))
    for reader in (["inspect", folder], ["hash", folder]):
        run = cli(*reader)
        assert run.code in (0, 1) and "internal error" not in run.stderr, run.stderr
    out = root / "out"
    run = cli("convert", folder, "-o", out)
    assert "Traceback" not in run.stderr and "internal error" not in run.stderr
    if run.code != 0:
        assert run.code == 1 and len(run.error_lines) == 1, run.stderr
        assert not out.exists() and not list(root.glob(".ckptfix-*"))
        return
    expected = _torch_reads(folder)
    if expected is None:
        return
    written = load_file(out / "model.safetensors")
    assert sorted(written) == sorted(expected)
    for name, tensor in written.items():
        assert (tensor.shape, torch_bytes(tensor)) == (
            expected[name].shape,
            torch_bytes(expected[name]),
        ), name


@pytest.mark.parametrize(
    "renamed",
    [
        "shard-00002-model-00001-of-00003.safetensors",  # another save's count of files
        "shard-00002-model-00002-of-00001.safetensors",  # file 2 of 1
    ],
    ids=["other-count", "past-the-count"],
)
def test_rank_files_of_another_save_are_refused(tmp_path: Path, renamed: str) -> None:
    """torch's writer names every file of a save `-of-N` with one N (the highest file index
    of its fqn_to_index_mapping): a file saying another N, or a file number past it, belongs
    to another save. Its pieces tiled, so it was merged into the model unsaid."""
    folder = rank_folder(tmp_path / "ranks")
    (folder / RANK_FILE.format(rank=2)).rename(folder / renamed)
    run = cli("inspect", folder, "--json")
    assert run.code == 1, run.stdout
    (problem,) = [f for f in run.json()["findings"] if f["severity"] == "error"]
    assert problem["file"] == str(folder / renamed)
    assert "(rule rank-set;" in problem["message"]
    out = tmp_path / "out"
    converted = cli("convert", folder, "-o", out)
    assert converted.code == 1 and "(rule rank-set;" in converted.error_lines[0]
    assert not out.exists()
