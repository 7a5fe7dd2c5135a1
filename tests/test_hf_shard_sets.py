"""Per-rank HuggingFaceStorageWriter sets built by hand (tests/hf_shard_builders.py): the
claims their file names and headers make, checked in bounded time and memory. The sets torch
itself writes are tested in tests/test_training_writers.py and test_training_malformed.py."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import cli, measured
from tests.hf_shard_builders import DEFAULT_RANKS, rank_folder


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
