"""Per-rank HuggingFaceStorageWriter sets built by hand (tests/hf_shard_builders.py): the
claims their file names and headers make, checked in bounded time and memory. The sets torch
itself writes are tested in tests/test_training_writers.py and test_training_malformed.py."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.builders import Factory, Spec
from tests.helpers import cli, measured
from tests.hf_shard_builders import DEFAULT_RANKS, RankPiece, rank_folder


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
