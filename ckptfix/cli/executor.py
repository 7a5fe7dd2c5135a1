"""`--executor local|ray` and `--ray-cpus-per-task` (docs/ray.md): where `hash`, `diff` and
`inspect` read. ray is imported only when `--executor ray` is given."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckptfix.core.errors import UsageError

if TYPE_CHECKING:
    from ckptfix.executors.ray_cluster import Cluster
    from ckptfix.ops.report import Report
    from ckptfix.ops.tensorset import Digester


class Executor(str, Enum):
    local = "local"
    ray = "ray"


ExecutorOption = Annotated[
    Executor,
    typer.Option(
        "--executor",
        help="local: read here; ray: read in Ray tasks, on the cluster RAY_ADDRESS names or "
        "one running here, else on a local Ray started for the command.",
    ),
]
CpusPerTaskOption = Annotated[
    float,
    typer.Option(
        "--ray-cpus-per-task",
        metavar="N",
        help="With --executor ray: CPUs each task asks for (and threads it hashes with).",
    ),
]


@contextmanager
def joined(executor: Executor, cpus_per_task: float) -> Iterator[Cluster | None]:
    """The Ray cluster for the command (said on stderr), left at the end; None for local."""
    if executor is Executor.local:
        yield None
        return
    if not cpus_per_task > 0:
        raise UsageError(
            "--ray-cpus-per-task", f"{cpus_per_task} is not positive", "pass 1 or more"
        )
    from ckptfix.executors.ray_cluster import connect, disconnect

    cluster = connect()
    try:
        sys.stderr.write(f"ckptfix: {cluster.describe()}\n")
        yield cluster
    finally:
        disconnect()


def with_executor(document: dict[str, object], cluster: Cluster | None) -> dict[str, object]:
    """A --json document with how it was read: the cluster, when it ran on one."""
    if cluster is not None:
        document["executor"] = cluster.to_dict()
    return document


def digester(cluster: Cluster | None, cpus_per_task: float) -> Digester | None:
    if cluster is None:
        return None
    from ckptfix.executors.ray_work import RayDigester

    return RayDigester(cluster, cpus_per_task)


def inspect_reports(
    paths: list[str], options: dict[str, Any], executor: Executor, cpus_per_task: float
) -> list[Report]:
    """`inspect` of every path: here, one after another, or one Ray task each."""
    from ckptfix.ops.inspect import inspect

    with joined(executor, cpus_per_task) as cluster:
        if cluster is None:
            return [inspect(path, **options) for path in paths]
        from ckptfix.executors.ray_cluster import Resources
        from ckptfix.executors.ray_work import BASE_MEMORY, inspect_all

        return inspect_all(paths, options, Resources(cpus_per_task, BASE_MEMORY))
