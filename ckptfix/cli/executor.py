"""`--executor local|ray` and `--ray-cpus-per-task` (docs/ray.md): where `hash`, `diff` and
`inspect` read and the rewrites write; `--part I/N` and `--commit` for other schedulers. ray
is imported only when `--executor ray` is given."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, TypedDict

import typer

from ckptfix.core.errors import UsageError

if TYPE_CHECKING:
    from ckptfix.executors.ray_cluster import Cluster
    from ckptfix.ops.report import Report
    from ckptfix.ops.rewrite_options import ShardRunner
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


PartOption = Annotated[
    str | None,
    typer.Option(
        "--part",
        metavar="I/N",
        help="Write slice I of N of the plan's shards, and a record of them, beside OUT (or "
        "under the prefix); nothing is published until the same command runs with --commit.",
    ),
]
CommitOption = Annotated[
    bool,
    typer.Option(
        "--commit",
        help="Check every --part's record against the plan made again from SRC, then "
        "publish the index (same SRC, OUT and options as the parts).",
    ),
]


class Split(TypedDict):
    """The rewrite options of a split run (ops.rewrite_options.RewriteOptions)."""

    part: tuple[int, int] | None
    commit: bool
    runner: ShardRunner | None


def parse_part(text: str | None) -> tuple[int, int] | None:
    """`I/N` as (I, N), 1 <= I <= N; a usage error otherwise."""
    if text is None:
        return None
    from ckptfix.write.part_records import MAX_PARTS

    # ASCII digits only: str.isdigit also takes '²' (which int() refuses) and '١' (which
    # it reads as 1)
    found = re.fullmatch(r"([0-9]{1,6})/([0-9]{1,6})", text)
    if found is None or not 1 <= int(found[1]) <= int(found[2]) <= MAX_PARTS:
        raise UsageError(
            "--part", f"{text!r} is not I/N",
            f"pass e.g. --part 2/8 (1 <= I <= N <= {MAX_PARTS:,})",
        )  # fmt: skip
    return int(found[1]), int(found[2])


@contextmanager
def split_run(
    executor: Executor, cpus_per_task: float, part: str | None, commit: bool
) -> Iterator[tuple[Split, Cluster | None]]:
    """The split options of a write command, and the Ray cluster it runs on (if any)."""
    parsed = parse_part(part)
    if parsed is not None and commit:
        raise UsageError("--commit", "publishes what the parts wrote", "drop --part")
    if executor is Executor.ray and (parsed is not None or commit):
        raise UsageError("--executor", "ray runs every part itself", "drop --part and --commit")
    with joined(executor, cpus_per_task) as cluster:
        runner = None
        if cluster is not None:
            from ckptfix.executors.ray_cluster import MAX_RETRIES
            from ckptfix.executors.ray_write import RayShardRunner

            sys.stderr.write(
                f"ckptfix: ray: a task whose worker or node is lost is retried up to "
                f"{MAX_RETRIES} times\n"
            )
            runner = RayShardRunner(cluster, cpus_per_task)
        yield Split(part=parsed, commit=commit, runner=runner), cluster
