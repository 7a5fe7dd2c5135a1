"""What `--executor ray` runs for the write commands (convert, reshard, dedupe): the plan's
shards cut into slices (write.parts.part_of), one Ray task each, each task making the same
plan again from SRC and writing its slice where the driver said (ops.rewrite_parts)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ckptfix.core.errors import CkptfixError
from ckptfix.executors.ray_cluster import Cluster, Resources, Task, run_tasks
from ckptfix.executors.ray_work import (
    BASE_MEMORY,
    METADATA_PER_TENSOR,
    TASKS_PER_CPU,
    working_folder,
)
from ckptfix.ops.rewrite_options import PartRequest
from ckptfix.write.output import wrap_os_error
from ckptfix.write.part_records import PartRecord
from ckptfix.write.parts import part_of_sizes
from ckptfix.write.results import Progress
from ckptfix.write.stores.base import StoreOptions

# What a task holds besides the interpreter and the checkpoint's metadata (ray_work): an
# upload's parts in flight (a store OUT), or the writer's buffers and the read-back's.
STORE_BUFFERS = StoreOptions().max_in_flight
FOLDER_BUFFERS = 64 * 2**20


@dataclass(frozen=True)
class RayShardRunner:
    """An ops.rewrite_options.ShardRunner whose slices run as Ray tasks: as many as the
    cluster has task slots, TASKS_PER_CPU each, at most one per shard."""

    cluster: Cluster
    cpus_per_task: float = 1.0

    def __call__(
        self, request: PartRequest, sizes: Sequence[int], progress: Progress | None
    ) -> list[PartRecord]:
        slots = max(1, int(self.cluster.cpus / self.cpus_per_task))
        count = max(1, min(len(sizes), slots * TASKS_PER_CPU))
        tasks = []
        for part in range(1, count + 1):
            weight = sum(sizes[i] for i in part_of_sizes(sizes, part, count))
            tasks.append(Task(write_part, (request, part, count), weight))
        target = request.options.target
        buffers = STORE_BUFFERS if target is not None and target.store else FOLDER_BUFFERS
        memory = BASE_MEMORY + METADATA_PER_TENSOR * request.tensors + buffers
        records: list[PartRecord] = run_tasks(
            tasks, Resources(self.cpus_per_task, memory), progress
        )
        return records


def write_part(request: PartRequest, part: int, count: int) -> PartRecord:
    """(A Ray task.) Slice `part` of `count`, written by the command run again here."""
    from ckptfix.ops import rewrite

    target = request.options.target
    assert target is not None
    options = replace(request.options, target=replace(target, part=part, count=count))
    commands: dict[str, Callable[..., rewrite.RewriteResult]] = {
        "convert": rewrite.convert, "reshard": rewrite.reshard, "dedupe": rewrite.dedupe,
    }  # fmt: skip
    try:
        with working_folder(request.src, request.cwd):
            result = commands[request.command](request.src, request.out, options)
    except CkptfixError:
        raise
    except OSError as exc:  # the task's writes, said as a local run's writers say them
        raise wrap_os_error(exc, request.out) from exc
    assert result.part is not None
    return result.part
