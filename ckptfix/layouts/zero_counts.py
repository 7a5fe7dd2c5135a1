"""The counts a DeepSpeed tag folder claims, checked against the files present and their real
sizes before anything is iterated or sized by them.

`partition_count` is the data-parallel world size W. Every rank file must say the same, no
rank file may be numbered W or more, and W must agree with what the partitions really hold
(their sizes come from the storages, which are checked against the file's bytes): a stage 1-2
rank holds about 1/W of each parameter group (DeepSpeed pads a group to a multiple of 2·W and
takes the padding off the last rank only), a stage-3 rank holds ceil(numel / W) elements of
each parameter. A claim the files contradict is a corrupt-file finding on the file that makes
it (rule `zero-counts`). Where the sizes cannot settle W (a model of two elements per rank),
the ranks missing are counted, never enumerated (`missing_ranks`).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ckptfix.core.errors import CorruptFileError
from ckptfix.core.findings import Finding, finding
from ckptfix.core.sizes import padded
from ckptfix.formats.zero import OptimStates, Shape
from ckptfix.layouts.zero_weights import numel

MAX_LISTED = 8  # missing ranks named one by one; the rest are counted in one finding
_FIX = "copy the rank files again from the training run, or save the checkpoint again"


@dataclass(frozen=True)
class Contradiction:
    """A count one file claims that the files present contradict."""

    file: str
    what: str

    def finding(self) -> Finding:
        error = CorruptFileError(self.file, "zero-counts", self.what, _FIX)
        return finding(error.code, error.detail(), file=self.file)


def rank_claims(present: Mapping[int, OptimStates]) -> Contradiction | None:
    """Every optimizer file must claim the same stage and world size (the claim most files
    make is taken as the run's; the lowest rank's, when as many make each), and be numbered
    below that world size."""
    claims = Counter((s.stage, s.partition_count) for _, s in sorted(present.items()))
    (stage, world), _ = claims.most_common(1)[0]
    agreeing = min(
        rank for rank, s in present.items() if (s.stage, s.partition_count) == (stage, world)
    )
    for _, states in sorted(present.items()):
        if (states.stage, states.partition_count) != (stage, world):
            return Contradiction(
                states.label,
                f"says ZeRO stage {states.stage} over {states.partition_count} ranks, but "
                f"{os.path.basename(present[agreeing].label)} says stage {stage} over {world}",
            )
    paths = {rank: states.label for rank, states in present.items()}
    return ranks_past(paths, world, "optimizer partition")


def ranks_past(paths: Mapping[int, str], world: int, what: str) -> Contradiction | None:
    """The first rank file numbered at or past the world size (it belongs to another run)."""
    past = [rank for rank in paths if rank >= world]
    if not past:
        return None
    rank = min(past)
    return Contradiction(
        paths[rank],
        f"is rank {rank}'s {what}, but partition_count says the run had {world} rank(s)",
    )


def size_claims(
    present: Mapping[int, OptimStates], shapes: Sequence[dict[str, Shape]]
) -> Contradiction | None:
    """Each optimizer file's own world size against its partitions' real sizes and the
    parameters' shapes (so the file that lies is the one named)."""
    for rank, states in sorted(present.items()):
        if states.stage == 3:
            problem = _stage3_sizes(states, shapes)
        else:
            problem = _stage12_sizes(rank, states, shapes)
        if problem is not None:
            return problem
    return None


def _stage3_sizes(states: OptimStates, shapes: Sequence[dict[str, Shape]]) -> Contradiction | None:
    """Each rank holds ceil(numel / W) elements of every parameter, one after another."""
    world = states.partition_count
    per_rank = sum(-(-numel(shape) // world) for group in shapes for shape in group.values())
    held = sum(view.numel for view in states.groups)
    if held == per_rank:
        return None
    return Contradiction(
        states.label,
        f"partition_count says {world} ranks, so each holds {per_rank} elements of the "
        f"parameters param_shapes lists, but this rank's flat groups hold {held}",
    )


def _stage12_sizes(
    rank: int, states: OptimStates, shapes: Sequence[dict[str, Shape]]
) -> Contradiction | None:
    """A rank's partition of a group of N elements (parameters and their alignment padding)
    is aligned(N, 2·W) / W elements, less the padding on the last rank: W times it can
    be no more than aligned(N, 2·W), and (but on the last rank) no less than N."""
    world = states.partition_count
    if len(states.groups) != len(shapes):
        return Contradiction(
            states.label,
            f"holds {len(states.groups)} partition group(s) for the {len(shapes)} "
            "parameter group(s) param_shapes lists",
        )
    for index, (view, group) in enumerate(zip(states.groups, shapes, strict=True)):
        total = sum(numel(shape) for shape in group.values()) + _padding(states, index)
        whole = world * view.numel
        if whole > padded(total, 2 * world) or (rank < world - 1 and whole < total):
            return Contradiction(
                states.label,
                f"partition_count says {world} ranks, each holding about 1/{world} of "
                f"group {index}, but this rank holds {view.numel} of its {total} elements",
            )
    return None


def _padding(states: OptimStates, index: int) -> int:
    paddings = states.alignment_paddings
    return sum(paddings[index]) if paddings is not None and index < len(paddings) else 0


def missing_ranks(
    present: Iterable[int], world: int, limit: int = MAX_LISTED
) -> tuple[list[int], int]:
    """The first `limit` ranks below `world` that are not present, and how many are missing
    in all; the work is bounded by the ranks present, never by `world`."""
    have = {rank for rank in present if 0 <= rank < world}
    listed: list[int] = []
    rank = 0
    while len(listed) < limit and rank < world:
        if rank not in have:
            listed.append(rank)
        rank += 1
    return listed, world - len(have)
