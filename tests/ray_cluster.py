"""A real two-node Ray cluster on 127.0.0.1 for the `--executor ray` tests, run in a process
of its own (`python tests/ray_cluster.py`, which prints the address and holds the cluster
until its stdin closes).

Two nodes on one host are Ray's own `ray.cluster_utils.Cluster`: `ray start` of a second node
refuses to join unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1, and with it set Ray rewrites
127.0.0.1 into the interface address (which the head, bound to loopback, does not answer).
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps every node and client on 127.0.0.1, and
RAY_AUTH_MODE=token is Ray 2.60's token authentication, which nodes and clients share.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
# Ray's memory monitor kills the newest task when the machine is 95% full, which a shared
# test machine can be for reasons of its own (the task is retried, but the runs slow down):
# off for the test cluster, whose tasks hold a few MiB.
NODE_ENV = {"RAY_memory_monitor_refresh_ms": "0"}
CPUS_PER_NODE = 1


def cluster_env(address: str | None = None) -> dict[str, str]:
    """The environment of the cluster's nodes and of the ckptfix processes that join it:
    this tree first on the path (the workers import ckptfix from it)."""
    env = dict(os.environ, **LOOPBACK_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    if address is not None:
        env["RAY_ADDRESS"] = address
    return env


def ckptfix(
    *args: object, env: dict[str, str], cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m ckptfix ARGS` in a fresh process (a driver of its own)."""
    command = [sys.executable, "-m", "ckptfix", *map(str, args)]
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def task_workers(function: str) -> list[int]:
    """The worker processes running `function` (Ray names a process after its task)."""
    listing = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True)
    rows = [line.strip().partition(" ") for line in listing.stdout.splitlines()]
    return [int(pid) for pid, _, title in rows if title.startswith(f"ray::{function}")]


@contextmanager
def ray_cluster(temp_dir: Path, nodes: int = 2) -> Iterator[str]:
    """A head and `nodes - 1` more, CPUS_PER_NODE CPUs each; yields the address to join."""
    process = subprocess.Popen(
        [sys.executable, __file__, str(temp_dir), str(nodes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**cluster_env(), **NODE_ENV},
        text=True,
        start_new_session=True,  # a Ctrl-C of the tests reaches the cluster through stdin
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        address = process.stdout.readline().strip()
        if not address:
            raise RuntimeError("the Ray test cluster did not start")
        yield address
    finally:
        process.stdin.close()  # the cluster shuts down and the process ends
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()


def _serve(temp_dir: str, nodes: int) -> None:
    from ray.cluster_utils import Cluster

    node_args = {"num_cpus": CPUS_PER_NODE, "include_dashboard": False, "temp_dir": temp_dir}
    cluster = Cluster(initialize_head=True, head_node_args=node_args)
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=CPUS_PER_NODE)
        cluster.wait_for_nodes()
        sys.stdout.write(cluster.address + "\n")
        sys.stdout.flush()
        sys.stdin.read()  # until the tests close it
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
