"""What `--executor ray` runs: the tensors of a set split over tasks by bytes, each task
opening the checkpoint itself (a path every node sees, or a URL) and returning the content
digests of its tensors, which the driver combines exactly as a local run does (ops.hash);
and `inspect`, one task per path."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ckptfix.core.errors import InputNotFoundError, SourceChangedError, UsageError
from ckptfix.core.tensor import TensorInfo
from ckptfix.executors.ray_cluster import Cluster, Resources, Task, run_tasks
from ckptfix.io.urls import is_url
from ckptfix.ops.digest import REMOTE_CHUNK, LayoutKey, Progress, content_digests, layout_key
from ckptfix.ops.report import Report
from ckptfix.ops.tensorset import OpenArgs, TensorSet, opened

TASKS_PER_CPU = 4  # a handful per CPU: a slow node or a large tensor does not hold the rest
# Memory each task asks for: the interpreter with ckptfix loaded, the checkpoint's metadata
# (each task loads it again, ~2 KiB a tensor measured for safetensors headers) and two
# chunks in flight per thread (ops.digest; a URL is read in REMOTE_CHUNK pieces).
BASE_MEMORY = 256 * 2**20
METADATA_PER_TENSOR = 2048


@dataclass(frozen=True)
class RayDigester:
    """An ops.tensorset.Digester whose reads run as Ray tasks."""

    cluster: Cluster
    cpus_per_task: float = 1.0

    def __call__(
        self, tensors: TensorSet, names: Sequence[str], progress: Progress | None
    ) -> dict[LayoutKey, bytes]:
        if tensors.opened_as is None:
            raise UsageError(
                "--executor", "this comparison cannot run on Ray", "use --executor local"
            )
        unique: dict[LayoutKey, str] = {}
        for name in names:
            unique.setdefault(layout_key(tensors.tensors[name]), name)
        parts = split_by_bytes(
            [(name, tensors.tensors[name]) for name in unique.values()],
            max(1, int(self.cluster.cpus / self.cpus_per_task) * TASKS_PER_CPU),
        )
        threads = max(1, int(self.cpus_per_task))
        tasks = [
            Task(
                hash_part,
                (tensors.opened_as, part, [layout_key(tensors.tensors[n]) for n in part], threads),
                sum(tensors.tensors[name].nbytes for name in part),
            )
            for part in parts
        ]
        memory = BASE_MEMORY + METADATA_PER_TENSOR * len(tensors.tensors)
        resources = Resources(self.cpus_per_task, memory + 2 * threads * REMOTE_CHUNK)
        found: dict[LayoutKey, bytes] = {}
        for part, digests in zip(parts, run_tasks(tasks, resources, progress), strict=True):
            for name, digest in zip(part, digests, strict=True):
                found[layout_key(tensors.tensors[name])] = digest
        return found


def split_by_bytes(named: Sequence[tuple[str, TensorInfo]], count: int) -> list[list[str]]:
    """The names in at most `count` runs of about equal bytes, in file and offset order (so
    that small neighbours stay together and are read in one call, ops.digest._Batch). A
    tensor larger than a run is a run of its own: one digest is one sequential hash."""
    ordered = sorted(named, key=lambda item: (item[1].file, item[1].byte_range[0], item[0]))
    target = max(1, -(-sum(tensor.nbytes for _, tensor in ordered) // max(1, count)))
    parts: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, tensor in ordered:
        if current and size + tensor.nbytes > target:
            parts.append(current)
            current, size = [], 0
        current.append(name)
        size += tensor.nbytes
    if current:
        parts.append(current)
    return parts


def hash_part(
    opened_as: OpenArgs, names: list[str], expected: list[LayoutKey], threads: int
) -> list[bytes]:
    """(A Ray task.) The content digests of `names`, read from the checkpoint opened again
    here; a name the driver planned at another place means the checkpoint changed."""
    with (
        working_folder(opened_as.path, opened_as.cwd),
        opened(
            opened_as.path,
            key=opened_as.key,
            alias_record=opened_as.alias_record,
            zero_weights=opened_as.zero_weights,
        ) as tensors,
    ):
        chosen = []
        for name, key in zip(names, expected, strict=True):
            tensor = tensors.tensors.get(name)
            if tensor is None or layout_key(tensor) != key:
                raise SourceChangedError(
                    opened_as.path,
                    f"tensor {name!r} is no longer where it was planned: the checkpoint "
                    "changed while it was read",
                )
            chosen.append(tensor)
        found = content_digests(chosen, tensors.source, workers=threads)
        return [found[layout_key(tensor)] for tensor in chosen]


@contextmanager
def working_folder(path: str, cwd: str) -> Iterator[None]:
    """In the driver's working folder while a relative local path is read, so that it names
    the same file and the errors and reports name it as the driver's user wrote it. (A
    worker process serves one driver's tasks, one at a time.)"""
    if is_url(path) or os.path.isabs(path):
        yield
        return
    previous = os.getcwd()
    try:
        os.chdir(cwd)
    except OSError as exc:  # a folder the driver's node has and this one has not
        raise InputNotFoundError(
            path,
            f"no such file or directory on this Ray node: the driver's working folder {cwd} "
            f"is not there" + ("" if isinstance(exc, FileNotFoundError) else f" ({exc.strerror})"),
            "give a path every node sees the same way, such as an absolute path on a shared "
            "file system",
        ) from exc
    try:
        yield
    finally:
        os.chdir(previous)


def inspect_all(
    paths: Sequence[str], options: dict[str, Any], resources: Resources
) -> list[Report]:
    """`inspect` of each path, one Ray task each, in the order given."""
    tasks = [Task(inspect_one, (path, os.getcwd(), options), 1) for path in paths]
    reports: list[Report] = run_tasks(tasks, resources)
    return reports


def inspect_one(path: str, cwd: str, options: dict[str, Any]) -> Report:
    """(A Ray task.) The report of one path, as ckptfix.inspect gives it."""
    from ckptfix.ops.inspect import inspect

    with working_folder(path, cwd):
        return inspect(path, **options)
