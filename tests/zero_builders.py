"""Small DeepSpeed ZeRO tag folders written with torch.save, without DeepSpeed: the files as
DeepSpeed lays them out (plain ints where it pickles its ZeroStageEnum), with any count or
name claim set by hand, for the malformed-input tests. Real ones, written by DeepSpeed
itself, are in tests/training_fixtures.py.

The model (by default): `embed.weight` (4, 3) and `body.weight` (2, 3), one parameter group
of 18 fp32 elements. Stages 1-2 pad the group to a multiple of 2·world and give each rank an equal part
(the last rank's without the padding); stage 3 gives each rank ceil(numel / world) elements
of each parameter.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.builders import Factory
from tests.cases import Case

SHAPES = {"embed.weight": (4, 3), "body.weight": (2, 3)}
MODEL = "mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
MODEL3 = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


@dataclass
class ZeroSpec:
    """What to write; the claims default to the truth."""

    stage: int = 2
    world: int = 2
    partition_count: Any = None  # as pickled: a list (stages 1-2) or an int (stage 3)
    model: dict[str, tuple[int, ...]] = field(default_factory=lambda: dict(SHAPES))
    shapes: dict[str, tuple[int, ...]] | None = None  # param_shapes (the model's by default)
    shared_params: dict[str, str] = field(default_factory=dict)
    ranks: tuple[int, ...] | None = None  # the optimizer files written (all by default)
    extra: dict[str, Any] = field(default_factory=dict)  # top-level model-states keys


def weights(spec: ZeroSpec) -> dict[str, Any]:
    """The model's tensors: what a conversion must write."""
    import torch

    return {
        name: torch.arange(1, 1 + shape[0] * shape[1], dtype=torch.float32).reshape(shape) * index
        for index, (name, shape) in enumerate(spec.model.items(), start=1)
    }


def _partitions(spec: ZeroSpec) -> list[Any]:
    """Each rank's fp32 partition as DeepSpeed writes it."""
    import torch

    tensors = weights(spec)
    world = spec.world
    if spec.stage == 3:
        parts = []
        for rank in range(world):
            pieces = []
            for tensor in tensors.values():
                flat = tensor.flatten()
                size = -(-flat.numel() // world)
                piece = flat[rank * size : (rank + 1) * size]
                pieces.append(torch.cat([piece, torch.zeros(size - piece.numel())]))
            parts.append(torch.cat(pieces).clone())
        return parts
    flat = torch.cat([tensor.flatten() for tensor in tensors.values()])
    align = 2 * world
    padded = -(-flat.numel() // align) * align
    total = flat.numel()
    flat = torch.cat([flat, torch.zeros(padded - total)])
    size = padded // world
    parts = [flat[rank * size : (rank + 1) * size].clone() for rank in range(world)]
    parts[-1] = parts[-1][: size - (padded - total)].clone()
    return parts


def _model_states(spec: ZeroSpec, placeholders: bool) -> dict[str, Any]:
    import torch

    module = OrderedDict(
        (name, torch.empty(0) if placeholders else tensor) for name, tensor in weights(spec).items()
    )
    claimed = spec.model if spec.shapes is None else spec.shapes
    shapes = OrderedDict((name, torch.Size(shape)) for name, shape in claimed.items())
    return {
        "module": module,
        "buffer_names": [],
        "param_shapes": [shapes],
        "shared_params": dict(spec.shared_params),
        "frozen_param_shapes": None,
        "frozen_param_fragments": None,
        "ds_config": {"zero_optimization": {"stage": spec.stage}},
        "dp_world_size": spec.world,
        "global_steps": 1,
        **spec.extra,
    }


def zero_folder(root: Path, spec: ZeroSpec) -> Path:
    """`root` with `latest` and the tag folder `global_step1`; returns `root`."""
    import torch

    tag = root / "global_step1"
    tag.mkdir(parents=True)
    (root / "latest").write_text("global_step1")
    stage3 = spec.stage == 3
    count = spec.partition_count
    if count is None:
        count = spec.world if stage3 else [spec.world]
    key = "fp32_flat_groups" if stage3 else "single_partition_of_fp32_groups"
    parts = _partitions(spec)
    for rank in spec.ranks if spec.ranks is not None else range(spec.world):
        state = {
            "zero_stage": spec.stage,
            "partition_count": count,
            key: [parts[rank % spec.world]],
        }
        if not stage3:
            state["param_alignment_paddings"] = [[0] * len(spec.model)]
        torch.save({"optimizer_state_dict": state}, tag / OPTIM.format(rank=rank))
        if stage3:
            torch.save(_model_states(spec, True), tag / MODEL3.format(rank=rank))
    if not stage3:
        torch.save(_model_states(spec, False), tag / MODEL)
    return root


def universal_zero(tag: Path, values: dict[str, Any]) -> Path:
    """`zero/` as ds_to_universal writes it for stages 1-2, in the folder `tag`: each
    parameter's folder with its fp32 weight (`{"param": tensor}`, the `values`) and Adam
    moments, and the optimizer's global state. Returns `tag`."""
    import torch

    zero = tag / "zero"
    for name, tensor in values.items():
        (zero / name).mkdir(parents=True)
        torch.save({"param": tensor.float()}, zero / name / "fp32.pt")
        for moment in ("exp_avg.pt", "exp_avg_sq.pt"):
            torch.save({"param": torch.zeros_like(tensor)}, zero / name / moment)
    torch.save({"param_groups": [{"lr": 0.1}]}, zero / "optimizer_state.pt")
    return tag


def _case(spec: ZeroSpec) -> Callable[[Factory], Path]:
    return lambda factory: zero_folder(factory.root / "ds", spec)


def _tag_file(kind: str) -> Callable[[Factory], Path]:
    """A ZeRO folder as DeepSpeed leaves it (zero_to_fp32.py beside) whose `latest` is a link
    to a file outside it, or a FIFO beside a `latest_universal` naming no folder."""

    def build(factory: Factory) -> Path:
        import os

        root = zero_folder(factory.root / "ds", ZeroSpec())
        (root / "zero_to_fp32.py").write_text("# DeepSpeed's script\n")
        (root / "latest").unlink()
        if kind == "link-out":
            (factory.root / "secret.txt").write_text("global_step1")
            (root / "latest").symlink_to(factory.root / "secret.txt")
        else:
            os.mkfifo(root / "latest")
            (root / "latest_universal").write_text("global_step1_universal")
        return root

    return build


# The count attacks in the bad-input corpus (tests/test_bad_inputs.py); more variants, with
# the file each names, in tests/test_zero_counts.py.
ZERO_CASES = [
    Case("zero-world-1e12", _case(ZeroSpec(partition_count=[10**12])), "zero-counts"),
    Case("zero3-world-1e12", _case(ZeroSpec(stage=3, partition_count=10**12)), "zero-counts"),
    Case("zero-rank-past-world", _case(ZeroSpec(ranks=(0, 1, 9))), "zero-counts"),
    Case(
        "zero3-shape-1e18",
        _case(ZeroSpec(stage=3, shapes={"embed.weight": (10**9, 10**9), "body.weight": (2, 3)})),
        "zero-counts",
    ),
    Case("zero-tag-links-out", _tag_file("link-out"), "tag-missing", "tag-missing"),
    Case("zero-tag-fifo", _tag_file("fifo"), "tag-missing", "tag-missing"),
    Case(
        "zero-alias-chain",
        _case(ZeroSpec(shared_params={"a": "b", "b": "embed.weight"})),
        "zero-states",
    ),
]
