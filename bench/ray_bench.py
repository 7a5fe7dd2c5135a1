"""`make bench` job for `--executor ray` (`bench.py --only ray`): `hash` of the 2.2 GB
five-shard folder, and `convert` of the 4.4 GB DCP folder to S3 (moto, on 127.0.0.1), with
the local executor, then on a Ray cluster on 127.0.0.1 of one node and of two
(tests/ray_cluster.py, 1 CPU each): Ray's overhead over the local executor. The cluster is
started before the runs and not timed; each run's own joining of it is."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import CKPTFIX, ROOT, Measure, data_size, ensure_inputs, median, run

sys.path.insert(0, str(ROOT))
from tests.ray_cluster import CPUS_PER_NODE, cluster_env, ray_cluster
from tests.remote_servers import S3_ENV, moto_server

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


WRITE_SHARD = "500MB"  # nine shards of the 4.4 GB folder: nine write tasks


@contextmanager
def _s3_env(endpoint: str) -> Iterator[dict[str, str]]:
    """AWS_* set for moto in this process (so the Ray nodes started meanwhile have them too,
    as a cluster's nodes have their own credentials); the variables set."""
    values = {**S3_ENV, "AWS_ENDPOINT_URL": endpoint, "AWS_EC2_METADATA_DISABLED": "true"}
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield values
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _listing(client: Any) -> dict[str, tuple[int, str]]:
    """name -> (size, ETag) under out/: a multipart ETag is the MD5s of its parts, whose sizes
    follow from the object's size, so equal listings mean equal bytes."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix="out/")
    return {
        item["Key"]: (item["Size"], item["ETag"])
        for page in pages
        for item in page.get("Contents", [])
    }


def _fresh_runs(command: list[str], env: dict[str, str], repeat: int, client: Any) -> Measure:
    """A warm-up run, then the median of `repeat`, each into an emptied prefix (not timed);
    a run that fails stops the bench with its error (a failed run is not a fast one)."""
    walls = []
    for _ in range(repeat + 1):
        for key in _listing(client):
            client.delete_object(Bucket="bench", Key=key)
        start = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        walls.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr}")
    return Measure(statistics.median(walls[1:]), 0.0)


def bench_ray_writes(repeat: int) -> list[str]:
    """convert of the 4 GB DCP folder to s3:// with each executor, into an emptied prefix
    each time (moto keeps one output at a time: its objects spill to TMPDIR)."""
    import boto3
    from training import dcp_input, folder_size

    folder = dcp_input("4gb")
    size = folder_size(folder) / 1e9
    command = [*CKPTFIX, "convert", str(folder), "-o", "s3://bench/out",
               "--max-shard", WRITE_SHARD]  # fmt: skip
    with moto_server() as endpoint, _s3_env(endpoint) as values:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket="bench")
        env = {**cluster_env(), **values}
        local = _fresh_runs(command, env, repeat, client)
        expected = _listing(client)
        rows = [
            f"\n`convert` of {folder.name} (DCP, {size:.2f} GB) to s3:// (moto on 127.0.0.1, "
            f"--max-shard {WRITE_SHARD}: {sum(k.endswith('.safetensors') for k in expected)} shards), median wall of {repeat} "
            f"runs; Ray nodes of {CPUS_PER_NODE} CPU on 127.0.0.1, the cluster's start-up not "
            "timed; measured on 2 shared cores\n",
            "| executor | wall | GB/s | over local | target | |",
            "|---|---|---|---|---|---|",
            f"| local | {local.wall:.2f} s | {size / local.wall:.2f} | 1.00x | | |",
        ]
        for nodes in (1, 2):
            with _cluster(nodes) as address:
                measure = _fresh_runs(
                    [*command, "--executor", "ray"], cluster_env(address), repeat, client
                )
            assert _listing(client) == expected, "Ray's output is not the local one"
            ratio = measure.wall / local.wall
            rows.append(
                f"| ray, {nodes} worker{'s' if nodes > 1 else ''} | {measure.wall:.2f} s | "
                f"{size / measure.wall:.2f} | {ratio:.2f}x | <= {TARGET}x | "
                f"{'ok' if ratio <= TARGET else 'MISSED'} |"
            )
    return rows


if __name__ == "__main__":
    sys.exit("run bench/bench.py --only ray")
