"""`make bench` job for `--executor ray` (`bench.py --only ray`): `hash` of the 2.2 GB
five-shard folder with the local executor, then on a Ray cluster on 127.0.0.1 of one node
and of two (tests/ray_cluster.py, 1 CPU each): Ray's overhead over the local executor. The
cluster is started before the runs and not timed; each run's own joining of it is."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench import CKPTFIX, ROOT, Measure, data_size, ensure_inputs, median, run

sys.path.insert(0, str(ROOT))
from tests.ray_cluster import CPUS_PER_NODE, cluster_env, ray_cluster

TARGET = 1.3  # Ray's wall over the local executor's, at most


def _digest(command: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return str(json.loads(done.stdout)["digest"])


def bench_ray(repeat: int) -> list[str]:
    folder = ensure_inputs()["five"]
    command = [*CKPTFIX, "hash", str(folder), "--json"]
    local_env = cluster_env()
    expected = _digest(command, local_env)
    local = median(command, repeat)  # the local executor: 2 threads on this machine's 2 cores
    rows = [
        f"\n`hash` of {folder.name} ({data_size(folder) / 1e9:.2f} GB, page cache warm), "
        f"median wall of {repeat} runs; Ray nodes of {CPUS_PER_NODE} CPU on 127.0.0.1, "
        "the cluster's start-up not timed; measured on 2 cores\n",
        "| executor | wall | GB/s | over local | target | |",
        "|---|---|---|---|---|---|",
        f"| local (2 threads) | {local.wall:.2f} s | {data_size(folder) / 1e9 / local.wall:.2f} "
        "| 1.00x | | |",
    ]
    for nodes in (1, 2):
        with _cluster(nodes) as address:
            env = cluster_env(address)
            ray_command = [*command, "--executor", "ray"]
            assert _digest(ray_command, env) == expected, "Ray's digest is not the local one"
            measure = _median_with(ray_command, env, repeat)
        ratio = measure.wall / local.wall
        rows.append(
            f"| ray, {nodes} worker{'s' if nodes > 1 else ''} | {measure.wall:.2f} s | "
            f"{data_size(folder) / 1e9 / measure.wall:.2f} | {ratio:.2f}x | <= {TARGET}x | "
            f"{'ok' if ratio <= TARGET else 'MISSED'} |"
        )
    return rows


@contextmanager
def _cluster(nodes: int) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="ckray") as temp, ray_cluster(Path(temp), nodes) as a:
        yield a


def _median_with(command: list[str], env: dict[str, str], repeat: int) -> Measure:
    run(command, env=env)  # warm-up: the workers' imports
    return Measure(statistics.median(run(command, env=env).wall for _ in range(repeat)), 0.0)


if __name__ == "__main__":
    sys.exit("run bench/bench.py --only ray")
