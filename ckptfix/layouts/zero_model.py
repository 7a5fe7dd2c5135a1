"""The model a DeepSpeed tag folder holds, as descriptors: the fp32 master weights (from the
optimizer partitions, as zero_to_fp32.py builds them, or from a universal checkpoint's
parameter files) or the `module` copy."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from ckptfix.core.dtypes import DTYPES
from ckptfix.core.errors import UsageError
from ckptfix.core.findings import Finding, finding
from ckptfix.core.tensor import TensorInfo
from ckptfix.formats.zero import ModelStates, OptimStates, read_model_states, read_optim_states
from ckptfix.layouts.deepspeed_files import Reader, segment, spread_tensor, view_tensor
from ckptfix.layouts.zero_counts import (
    Contradiction,
    missing_ranks,
    rank_claims,
    ranks_past,
    size_claims,
)
from ckptfix.layouts.zero_weights import ReconstructionError, concatenated, stage3, stage12

ParamShapes = tuple[dict[str, tuple[int, ...]], ...]


@dataclass
class Assembled:
    """What the loader reports: tensors in the model's order and the layout's facts."""

    tensors: list[TensorInfo] = field(default_factory=list)
    dtypes: dict[str, str] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    stage: int | None = None
    world: int | None = None
    step: int | None = None
    left_out_tensors: int = 0
    left_out_bytes: int = 0
    weights: str = "master"
    lightning: bool = False  # saved by Lightning's DeepSpeedStrategy


# What a DeepSpeed folder whose master weights are lost can still give (the --zero-weights
# choice): a universal checkpoint beside them keeps them in fp32; stages 0-2 keep the weights
# in the training dtype in `module`.
INSTEAD = {
    "universal": "convert with --zero-weights universal to take the fp32 weights the universal "
    "checkpoint beside it holds",
    "module": "convert with --zero-weights module to take the training-dtype weights the model "
    "states hold",
}


def _missing(path: str, what: str, verb: str = "is", instead: str | None = None) -> Finding:
    it = "them" if verb == "are" else "it"
    how = f"{INSTEAD[instead]}, or copy {it} from" if instead else f"copy {it} from"
    return finding(
        "missing-rank-file",
        f"{what} {verb} missing ({how} the training run's output)",
        file=path,
        fix=f"ckptfix convert SRC -o OUT --zero-weights {instead}" if instead else None,
    )


def _optim_name(optims: dict[int, str], rank: int) -> str:
    bf16 = any(os.path.basename(p).startswith("bf16_") for p in optims.values())
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


class _Master:
    """Builds the master weights of one tag folder."""

    def __init__(
        self, tag_dir: str, reader: Reader, found: Assembled, instead: str | None = None
    ) -> None:
        self.tag_dir, self.reader, self.out = tag_dir, reader, found
        self.instead = instead  # the --zero-weights choice that still gives weights, if any
        self.tensors: dict[str, TensorInfo] = {}
        self.present: dict[int, OptimStates] = {}  # the readable optimizer files, by rank
        self.contradicted = False

    def contradiction(self, problem: Contradiction | None) -> bool:
        if problem is not None:
            self.out.findings.append(problem.finding())
            self.contradicted = True
        return problem is not None

    def optimizer(self, optims: dict[int, str]) -> None:
        """Read every rank's partitions: the files present, whatever they claim."""
        read = {rank: self.reader.read(path, read_optim_states) for rank, path in optims.items()}
        self.present = {rank: states for rank, states in read.items() if states is not None}
        self.out.left_out_tensors = sum(s.other_tensors for s in self.present.values())
        self.out.left_out_bytes = sum(s.other_bytes for s in self.present.values())
        if self.present:
            self.out.stage = self.present[min(self.present)].stage
        elif not optims:
            path = os.path.join(self.tag_dir, _optim_name(optims, 0))
            what = "the optimizer states (fp32 master weights) file"
            self.out.findings.append(_missing(path, what, instead=self.instead))

    def claims(self, models: dict[int | None, str], shapes: ParamShapes | None) -> None:
        """The world size the files claim, checked against their sizes (each file's own
        claim), against each other, and against the rank files present; then taken."""
        if not self.present:
            return
        if shapes is not None and self.contradiction(size_claims(self.present, shapes)):
            return
        if self.contradiction(rank_claims(self.present)):
            return
        world = self.present[min(self.present)].partition_count
        ranked = {rank: path for rank, path in models.items() if rank is not None}
        if not self.contradiction(ranks_past(ranked, world, "model states")):
            self.out.world = world

    def partitions(self, optims: dict[int, str]) -> list[OptimStates] | None:
        """Every rank's partitions in rank order; None when a rank is missing or unreadable."""
        world = self.out.world
        if world is None:
            return None
        name = _optim_name(optims, 0).replace("_rank_0_", "_rank_{rank}_", 1)
        if not self.all_there(optims, world, name, "optimizer partition", self.instead):
            return None
        ranks = [self.present.get(rank) for rank in range(world)]  # world <= files present
        complete = [states for states in ranks if states is not None]
        return complete if len(complete) == len(ranks) else None

    def all_there(
        self, ranks: Iterable[int], world: int, name: str, what: str, instead: str | None = None
    ) -> bool:
        """Whether every rank below `world` has its file (`name`, formatted with the rank);
        the missing ones reported, the first few by name and the rest counted."""
        listed, count = missing_ranks(ranks, world)
        for rank in listed:
            path = os.path.join(self.tag_dir, name.format(rank=rank))
            self.out.findings.append(_missing(path, f"rank {rank}'s {what}", instead=instead))
        if count > len(listed):
            more = f"the {what} files of {count - len(listed)} more of the {world} ranks"
            self.out.findings.append(_missing(self.tag_dir, more, "are", instead))
        return not count

    def model_files(self, models: dict[int | None, str]) -> dict[int | None, ModelStates | None]:
        """The model states files present, read: rank 0's alone (stages 0-2: the only
        file), or every rank's (stage 3)."""
        if not self.stage3_files(models):
            return (
                {None: self.reader.read(models[None], read_model_states)} if None in models else {}
            )
        return {rank: self.reader.read(path, read_model_states) for rank, path in models.items()}

    def stage3_files(self, models: dict[int | None, str]) -> bool:
        return self.out.stage == 3 or (None not in models and bool(models))

    def model_states(
        self, models: dict[int | None, str], read: dict[int | None, ModelStates | None]
    ) -> list[ModelStates] | None:
        """Every model states file needed, in rank order; None when one is missing or
        unreadable."""
        if not self.stage3_files(models):
            if None not in models:
                path = os.path.join(self.tag_dir, "mp_rank_00_model_states.pt")
                self.out.findings.append(_missing(path, "model states"))
            states = read.get(None)
            return [states] if states is not None else None
        ranks = [rank for rank in models if rank is not None]
        name = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        if not self.all_there(ranks, self.out.world or 1, name, "model states"):
            return None
        wanted = [read.get(rank) for rank in range(self.out.world or 1)]
        complete = [states for states in wanted if states is not None]
        return complete if len(complete) == len(wanted) else None

    def add(self, tensor: TensorInfo) -> None:
        self.tensors[tensor.name] = tensor

    def buffers(self, first: ModelStates) -> None:
        for name in first.buffer_names:
            view = first.module.get(name)
            if view is None:
                continue
            self.add(view_tensor(name, view, first.label))
            if DTYPES[view.dtype].is_floating and view.dtype != "F32":
                self.out.dtypes[name] = "F32"  # zero_to_fp32.py writes buffers .float()

    def frozen(self, states: list[ModelStates]) -> None:
        first = states[0]
        for name, shape in first.frozen_shapes.items():
            if self.out.stage != 3:
                if (view := first.frozen_fragments.get(name)) is not None:
                    self.add(view_tensor(name, view, first.label))
                continue
            views = [s.frozen_fragments.get(name) for s in states]
            segments = [segment(v, s.label) for v, s in zip(views, states, strict=True) if v]
            try:
                pieces = concatenated(segments, shape)
            except ReconstructionError as exc:
                self._broken(f"{name!r}: {exc}")
                continue
            self.add(spread_tensor(name, views[0].dtype if views[0] else "F32", shape, pieces))

    def _broken(self, what: str) -> None:
        self.out.findings.append(
            finding(
                "corrupt-file",
                f"the partitions do not hold the model the shapes describe: {what} "
                "(rule zero-partitions; copy the rank files again, or save again)",
                file=self.tag_dir,
            )
        )

    def trainable(self, states: list[ModelStates], optim: list[OptimStates]) -> list[TensorInfo]:
        shapes = states[0].param_shapes
        try:
            if self.out.stage == 3:
                merged = {name: shape for group in shapes for name, shape in group.items()}
                ranks = [[segment(v, o.label) for v in o.groups] for o in optim]
                weights = stage3(ranks, merged)
            else:
                groups = [
                    [segment(o.groups[g], o.label) for o in optim]
                    for g in range(len(optim[0].groups))
                ]
                weights = stage12(groups, shapes, optim[0].alignment_paddings, len(optim))
        except (ReconstructionError, IndexError) as exc:
            self._broken(str(exc))
            return []
        dtype = optim[0].groups[0].dtype if optim[0].groups else "F32"
        return [
            spread_tensor(name, dtype, shape, weights[name])
            for group in shapes
            for name, shape in group.items()
        ]

    def unrecorded(self, first: ModelStates) -> None:
        """Stages 1-2: module tensors DeepSpeed recorded nowhere else (stage 1 keeps no
        frozen_param_shapes), taken as saved so that no parameter is lost."""
        trained = {name for group in first.param_shapes for name in group}
        for name, view in first.module.items():
            if name not in self.tensors and name not in trained and name not in first.shared_params:
                self.add(view_tensor(name, view, first.label))

    def aliases(self, first: ModelStates) -> None:
        for alias, source in first.shared_params.items():
            if source in self.tensors:
                self.add(replace(self.tensors[source], name=alias))
                if source in self.out.dtypes:
                    self.out.dtypes[alias] = self.out.dtypes[source]


def master(
    tag_dir: str,
    models: dict[int | None, str],
    optims: dict[int, str],
    reader: Reader,
    universal: bool = False,
) -> Assembled:
    """The fp32 master weights of a tag folder's partitions. `universal`: a universal
    checkpoint is there too (missing partitions then say it can be read instead)."""
    if not optims and None in models:  # stage 0 keeps no partitions: `module` is the weights
        saved = reader.read(models[None], read_model_states)
        if saved is not None and not saved.stage:
            return _from_module(saved, optims)
    found = Assembled()
    instead = "universal" if universal else ("module" if None in models else None)
    build = _Master(tag_dir, reader, found, instead)
    build.optimizer(optims)
    read = build.model_files(models)
    first = next((states for _, states in sorted(read.items(), key=_rank_order) if states), None)
    build.claims(models, first.param_shapes if first is not None else None)
    if build.contradicted:
        return found
    optim = build.partitions(optims)

    def trainable(states: list[ModelStates]) -> list[TensorInfo] | None:
        return None if optim is None else build.trainable(states, optim)

    return _assemble(build, models, read, trainable)


# The trainable parameters, given the model states: None when there are none to give (the
# optimizer partitions are missing), so that nothing else is taken in their place.
Trainable = Callable[[list[ModelStates]], list[TensorInfo] | None]
ReadStates = dict[int | None, ModelStates | None]


def from_states(
    tag_dir: str,
    models: dict[int | None, str],
    reader: Reader,
    found: Assembled,
    trainable: Trainable,
) -> Assembled:
    """The model of a tag folder whose trainable parameters come from elsewhere (a universal
    checkpoint's parameter files), and everything else from the model states, as for the
    master weights (`found` says the stage and world size, which choose the files)."""
    build = _Master(tag_dir, reader, found)
    return _assemble(build, models, build.model_files(models), trainable)


def _assemble(
    build: _Master, models: dict[int | None, str], read: ReadStates, trainable: Trainable
) -> Assembled:
    found = build.out
    states = build.model_states(models, read)
    if states is None:
        return found
    found.step, found.lightning = states[0].global_steps, states[0].lightning
    build.buffers(states[0])
    build.frozen(states)
    trained = trainable(states)
    if trained is not None:
        for tensor in trained:
            build.add(tensor)
        if found.stage in (1, 2):
            build.unrecorded(states[0])
    build.aliases(states[0])
    order = {name: index for index, name in enumerate(states[0].module)}
    found.tensors = sorted(build.tensors.values(), key=lambda t: order.get(t.name, len(order)))
    return found


def _rank_order(item: tuple[int | None, object]) -> int:
    return -1 if item[0] is None else item[0]


def module(
    tag_dir: str, models: dict[int | None, str], optims: dict[int, str], reader: Reader
) -> Assembled:
    """`--zero-weights module`: the training-dtype weights in `module` (stages 0-2)."""
    if None not in models:
        raise UsageError(
            "--zero-weights",
            "module: a ZeRO-3 checkpoint keeps no full weights in `module` (only placeholders)",
            "use --zero-weights master",
        )
    states = reader.read(models[None], read_model_states)
    return Assembled() if states is None else _from_module(states, optims)


def _from_module(states: ModelStates, optims: dict[int, str]) -> Assembled:
    found = Assembled(weights="module", lightning=states.lightning)
    found.stage, found.world, found.step = states.stage, states.dp_world_size, states.global_steps
    found.tensors = [view_tensor(name, view, states.label) for name, view in states.module.items()]
    found.left_out_bytes = sum(size_of(path) for path in optims.values())
    return found


def size_of(path: str) -> int:
    """A file's size; nothing for one that is gone (a dangling link): it holds nothing."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
