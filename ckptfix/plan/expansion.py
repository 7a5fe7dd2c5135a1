"""Expanded tensors in a rewrite: a stride-0 view (`torch.zeros(1).expand(n)`, as torch.save
stores it) reads a few bytes and is written in full, so 4 stored bytes can ask for 16 GiB of
output and minutes of writing and verifying. Past a stated ratio and size a rewrite refuses
them unless asked (`--allow-expansion`); the readers' `expansion-bomb` rule (formats.
tensor_dict) bounds what can be asked for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from ckptfix.core.errors import PlanError
from ckptfix.plan.select import OutTensor

# Refused unless asked: expanded tensors that would take more than this many times the bytes
# they store (the readers' ratio), once they would take more than EXPANSION_BYTES together.
EXPANSION_RATIO = 1024
EXPANSION_BYTES = 10**9  # 1 GB, in the SI units sizes are given in
_CONTIGUOUS = attrgetter("source.contiguous")


@dataclass(frozen=True)
class Expansion:
    """The expanded tensors of a selection: how many, the bytes they would take written and
    the bytes they store, and the one that takes the most."""

    count: int
    written: int
    stored: int
    largest: OutTensor


def expansion(tensors: Sequence[OutTensor]) -> Expansion | None:
    """The expanded tensors of `tensors` (views that read fewer bytes than they hold), or
    None when there are none."""
    if all(map(_CONTIGUOUS, tensors)):  # the usual checkpoint: one pass in C
        return None
    count = written = stored = 0
    largest: OutTensor | None = None
    for tensor in tensors:
        source = tensor.source
        begin, end = source.byte_range
        if source.contiguous or source.spread is not None or source.nbytes <= end - begin:
            continue
        count += 1
        written += tensor.nbytes
        stored += end - begin
        if largest is None or tensor.nbytes > largest.nbytes:
            largest = tensor
    return None if largest is None else Expansion(count, written, stored, largest)


def check_expansion(tensors: Sequence[OutTensor], *, allowed: bool) -> None:
    """Refuse, before anything is written, expanded tensors past the ratio and size above,
    unless `allowed`."""
    found = expansion(tensors)
    if allowed or found is None:
        return
    if found.written <= EXPANSION_BYTES or found.written <= EXPANSION_RATIO * max(found.stored, 1):
        return
    largest = found.largest
    if found.count == 1:
        which = f"tensor {largest.name!r} {list(largest.source.shape)} is a stride-0 expansion that"
    else:
        which = (
            f"{found.count} tensors are stride-0 expansions (e.g. {largest.name!r} "
            f"{list(largest.source.shape)}) that together"
        )
    they = "it stores" if found.count == 1 else "they store"
    raise PlanError(
        largest.source.file,
        f"{which} would be written as {found.written:,} bytes from the {found.stored:,} bytes "
        f"{they}: over {EXPANSION_RATIO:,} times as many, and over 1 GB",
        "pass --allow-expansion to write the expansion in full",
        rule="large-expansion",
    )
