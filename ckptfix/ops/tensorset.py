"""The tensors a checkpoint stands for, by name: what `hash`, `diff` and manifest checks
compare.

That is the checkpoint a loader would load (the family a rewrite would choose, see
ops.source), plus every name its `ckptfix.dropped` record says was written once as another
(`dropped -> kept`: the dropped name stands for the kept tensor's bytes). Names can be
compared through wrapper prefixes (`module.`, `_orig_mod.`, ...).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Any

from ckptfix import checks
from ckptfix.checks.tensors import common_wrapper_prefixes, without_prefixes
from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.errors import UsageError
from ckptfix.core.sizes import DEFAULT_MAX_SHARD
from ckptfix.core.tensor import TensorInfo
from ckptfix.core.training import weights_note
from ckptfix.formats.base import ReadOptions
from ckptfix.io.source import ByteSource
from ckptfix.ops.digest import LayoutKey, Progress
from ckptfix.ops.inspect import report_of
from ckptfix.ops.load import load
from ckptfix.ops.report import Report
from ckptfix.ops.source import choose_source, recorded

_RECORD_FIX = "pass --no-alias-record to ignore it"


@dataclass(frozen=True)
class OpenArgs:
    """What `opened` was given: enough for another process (a Ray task) to open the same
    checkpoint and find the same tensors by name."""

    path: str
    key: str = "auto"
    alias_record: bool = True
    zero_weights: str = "master"
    cwd: str = "."  # the folder a relative path is relative to


@dataclass(frozen=True)
class TensorSet:
    """Logical name -> the tensor whose bytes it stands for (aliases share a TensorInfo)."""

    path: str
    tensors: dict[str, TensorInfo]
    aliases: dict[str, str] = field(default_factory=dict)  # dropped -> kept, from the record
    training_checkpoint: bool = False
    checkpoint: Checkpoint | None = field(default=None, repr=False, compare=False)
    # The tensors a training layout casts on the way out, as written (ops.cast_source).
    cast_sources: dict[str, ByteSource] = field(default_factory=dict, repr=False, compare=False)
    # The chosen files' string header metadata, and their index's metadata (ops.source).
    metadata: dict[str, str] = field(default_factory=dict, compare=False)
    index_metadata: dict[str, Any] = field(default_factory=dict, compare=False)
    # Which copy of a DeepSpeed folder's weights was read, when it holds two (core.training).
    weights_note: str | None = None
    # How it was opened, when `opened` opened it (a set mapped to other names has none).
    opened_as: OpenArgs | None = field(default=None, compare=False)

    def source(self, label: str) -> ByteSource:
        cast = self.cast_sources.get(label)
        if cast is not None:
            return cast
        assert self.checkpoint is not None
        return self.checkpoint.source(label)

    @property
    def total_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors.values())


def tensor_set(checkpoint: Checkpoint, report: Report, *, alias_record: bool = True) -> TensorSet:
    """The tensor set of a loaded, checked checkpoint; refused (like a rewrite) when the
    files it would read have errors."""
    chosen = choose_source(checkpoint, report, torch=True)
    if alias_record:
        chosen = recorded(chosen, _RECORD_FIX)
    stored = dict(zip(map(attrgetter("name"), chosen.tensors), chosen.tensors, strict=True))
    cast_sources = _as_written(stored, chosen.dtypes, checkpoint)
    aliases = chosen.aliases
    tensors = dict(stored)
    tensors.update({dropped: stored[kept] for dropped, kept in aliases.items()})
    layout = checkpoint.training.to_dict() if checkpoint.training is not None else None
    return TensorSet(
        checkpoint.path,
        tensors,
        aliases,
        chosen.training_checkpoint,
        checkpoint=checkpoint,
        cast_sources=cast_sources,
        metadata=dict(chosen.metadata),
        index_metadata=dict(chosen.index_metadata),
        weights_note=weights_note(layout),
    )


def _as_written(
    stored: dict[str, TensorInfo], dtypes: Mapping[str, str], checkpoint: Checkpoint
) -> dict[str, ByteSource]:
    """Replace each tensor the layout writes in another dtype (`dtypes`, e.g. a DeepSpeed
    checkpoint's bf16 buffers, written as F32) by the tensor as written; its sources."""
    sources: dict[str, ByteSource] = {}
    for name, target in dtypes.items():
        tensor = stored.get(name)
        if tensor is None or tensor.dtype == target:
            continue
        from ckptfix.ops.cast_source import cast_tensor

        stored[name], source = cast_tensor(tensor, target, checkpoint.source)
        sources[source.label] = source
    return sources


@contextmanager
def opened(
    path: str | os.PathLike[str],
    *,
    key: str = "auto",
    alias_record: bool = True,
    zero_weights: str = "master",
) -> Iterator[TensorSet]:
    """Load and check a checkpoint once, yield its tensor set, close it at the end."""
    checkpoint = load(path, ReadOptions(key=key, zero_weights=zero_weights))
    with checkpoint:
        report = report_of(
            checkpoint, checks.run(checkpoint, checks.CheckOptions(DEFAULT_MAX_SHARD))
        )
        found = tensor_set(checkpoint, report, alias_record=alias_record)
        opened_as = OpenArgs(os.fspath(path), key, alias_record, zero_weights, os.getcwd())
        yield replace(found, opened_as=opened_as)


# The content digest of each distinct tensor among the named ones of a set, by layout key:
# read here (local_digests) or by an executor's tasks (ckptfix.executors).
Digester = Callable[[TensorSet, Sequence[str], Progress | None], dict[LayoutKey, bytes]]


def stripped_names(
    names: Sequence[str], strip: str | None, *, training_checkpoint: bool, side: str
) -> tuple[dict[str, str], list[str]]:
    """Compared name -> name, after removing `strip` ("auto": the wrapper prefixes every
    name carries, see checks.tensors) from the names that start with it; and the prefixes
    removed. Two names that would become one are a usage error."""
    if strip == "auto":
        prefixes = common_wrapper_prefixes(names, training_checkpoint=training_checkpoint)
    else:
        prefixes = [strip] if strip else []

    def clash(name: str, other: str, new: str) -> UsageError:
        what = f"{name!r} and {other!r} of {side} would both become {new!r}"
        return UsageError("--strip-prefix", what, "strip a shorter prefix")

    return without_prefixes(names, prefixes, clash), prefixes
