"""The counts a DeepSpeed folder claims (world size, shapes, aliases) against the files
present: a contradicted claim is one corrupt-file finding naming the file and the rule, in
bounded time and memory; a claim the sizes cannot settle is counted, never enumerated; and
true claims of every stage and world size still convert bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptfix.layouts.zero_counts import MAX_LISTED, missing_ranks
from tests.helpers import cli, measured, read_tensors
from tests.zero_builders import OPTIM, ZeroSpec, weights, zero_folder

HUGE = 10**12
BIG_SHAPES = {"embed.weight": (10**9, 10**9), "body.weight": (2, 3)}
STEP = "global_step1"


def _optim(rank: int) -> str:
    return f"{STEP}/{OPTIM.format(rank=rank)}"


# (id, spec, the file named, rule, words of the message)
CONTRADICTED = [
    ("stage2-world", ZeroSpec(partition_count=[HUGE]), _optim(0), "zero-counts", "holds 10 of"),
    ("stage2-one-group", ZeroSpec(partition_count=[2, HUGE]), _optim(0), "zero-counts", "1/"),
    ("stage1-world", ZeroSpec(stage=1, partition_count=[HUGE]), _optim(0), "zero-counts", "1/"),
    ("stage3-world", ZeroSpec(stage=3, partition_count=HUGE), _optim(0), "zero-counts", "hold 9"),
    ("stage2-rank-past", ZeroSpec(ranks=(0, 1, 7)), _optim(7), "zero-counts", "rank 7's"),
    ("stage3-rank-past", ZeroSpec(stage=3, ranks=(0, 1, 5)), _optim(5), "zero-counts", "had 2"),
    ("stage2-shape", ZeroSpec(shapes=BIG_SHAPES), _optim(0), "zero-counts", "of its 10000"),
    ("stage3-shape", ZeroSpec(stage=3, shapes=BIG_SHAPES), _optim(0), "zero-counts", "5000000"),
    (
        "alias-chain",
        ZeroSpec(shared_params={"a": "b", "b": "embed.weight"}),
        f"{STEP}/mp_rank_00_model_states.pt",
        "zero-states",
        "itself an alias",
    ),
    (
        "alias-stored",
        ZeroSpec(shared_params={"body.weight": "embed.weight"}),
        f"{STEP}/mp_rank_00_model_states.pt",
        "zero-states",
        "is stored itself",
    ),
    (
        "alias-dangling",
        ZeroSpec(shared_params={"head.weight": "nothing"}),
        f"{STEP}/mp_rank_00_model_states.pt",
        "zero-states",
        "does not hold",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "file", "rule", "words"),
    [case[1:] for case in CONTRADICTED],
    ids=[case[0] for case in CONTRADICTED],
)
def test_a_contradicted_claim_is_one_finding_on_its_file(
    tmp_path: Path, spec: ZeroSpec, file: str, rule: str, words: str
) -> None:
    folder = zero_folder(tmp_path / "ds", spec)
    run = measured("inspect", folder, "--json", timeout=60)
    assert run.code == 1, run.stderr
    assert run.seconds < 20 and run.peak_rss < 600 * 2**20, (run.seconds, run.peak_rss)
    [line] = run.error_lines
    assert line.startswith(f"error: {folder / file}: "), line
    assert f"(rule {rule};" in line and words in line, line
    out = tmp_path / "out"
    converted = cli("convert", folder, "-o", out)
    assert converted.code == 1 and converted.error_lines == [line]
    assert not out.exists()


@pytest.mark.slow
def test_ranks_claimed_past_the_sizes_reach_are_counted_not_listed(tmp_path: Path) -> None:
    """Nine ranks holding two elements each fit any larger world size by their sizes: the
    missing ranks are named up to MAX_LISTED and the rest counted, at once."""
    folder = zero_folder(tmp_path / "ds", ZeroSpec(world=9, partition_count=[HUGE], ranks=(0, 1)))
    run = measured("inspect", folder, "--json", timeout=60)
    assert run.code == 1 and run.seconds < 20, (run.code, run.seconds)
    findings = [item for item in run_json(run)["findings"] if item["severity"] == "error"]
    assert [item["code"] for item in findings] == ["missing-rank-file"] * (MAX_LISTED + 1)
    assert findings[0]["file"] == str(folder / _optim(2))
    assert findings[-1]["file"] == str(folder / STEP)
    assert f"{HUGE - 2 - MAX_LISTED} more of the {HUGE} ranks" in findings[-1]["message"]


def run_json(run: Any) -> Any:
    import json

    return json.loads(run.stdout)


def test_missing_ranks_never_counts_up_to_the_claim() -> None:
    assert missing_ranks([0, 1, 3], 5) == ([2, 4], 2)
    assert missing_ranks([0, 7], 2) == ([1], 1)  # a rank past the world is not one of its
    listed, count = missing_ranks(range(4), 10**18, limit=3)  # instant: bounded by the ranks
    assert (listed, count) == ([4, 5, 6], 10**18 - 4)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_true_claims_convert_bitwise(tmp_path: Path, stage: int, world: int) -> None:
    """Every world size of every stage passes the checks (no false finding), padding on the
    last rank and all, and converts to the model's exact bytes."""
    spec = ZeroSpec(stage=stage, world=world)
    folder = zero_folder(tmp_path / "ds", spec)
    run = cli("convert", folder, "-o", tmp_path / "out")
    assert run.code == 0, run.stderr
    got = read_tensors(tmp_path / "out")
    want = {name: ("F32", tuple(t.shape), t.numpy().tobytes()) for name, t in weights(spec).items()}
    assert got == want
