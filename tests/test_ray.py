"""`--executor ray` on a real two-node Ray cluster on 127.0.0.1 (tests/ray_cluster.py): the
same digests, differences and reports as the local executor, from local folders and URLs;
a task's data error ends the run with its one-line error; a killed worker is retried."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import training_fixtures as fixtures
from tests.builders import Factory, Spec
from tests.optional import needs
from tests.ray_cluster import CPUS_PER_NODE, ckptfix, cluster_env, ray_cluster, task_workers
from tests.remote_servers import http_server

# One xdist worker runs every Ray test (make test: --dist loadgroup): one cluster at a time,
# and tests that look for task processes by name see only their own cluster's.
pytestmark = [needs("ray"), pytest.mark.slow, pytest.mark.xdist_group("ray")]
dcp_saved = fixtures.dcp_saved  # fixtures shared by the training tests


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    # Ray's socket paths must stay short (108 bytes): a short folder under /tmp.
    with tempfile.TemporaryDirectory(prefix="ckray") as temp, ray_cluster(Path(temp)) as found:
        yield found


def both(
    address: str, *args: object, cwd: Path | None = None
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """`ckptfix ARGS --json` with each executor: the two documents (the Ray one without its
    "executor" object, checked) and the Ray run's stderr."""
    local = ckptfix(*args, "--json", env=cluster_env(), cwd=cwd)
    ray = ckptfix(*args, "--json", "--executor", "ray", env=cluster_env(address), cwd=cwd)
    assert local.returncode == ray.returncode, ray.stderr
    document = json.loads(ray.stdout)
    if isinstance(document, dict) and "executor" in document:
        executor = document.pop("executor")
        assert executor["address"] == address and not executor["started"]
        assert executor["cpus"] == 2 * CPUS_PER_NODE and executor["max_retries"] == 3
    return json.loads(local.stdout), document, ray.stderr


def _model(root: Path, name: str = "m", seed: int = 0) -> Path:
    """Three shards: large tensors and many small ones (read in batches), split over tasks."""
    shards = [
        [Spec(f"s{seed}.{shard}.{i}", "F32", (8, 16 + i)) for i in range(40)]
        + [Spec(f"big{seed}.{shard}", "BF16", (512, 700 + shard))]
        for shard in range(3)
    ]
    return Factory(root).sharded(name, shards)


def test_hash_on_ray_is_the_local_digest(address: str, tmp_path: Path) -> None:
    folder = _model(tmp_path)
    local, ray, stderr = both(address, "hash", folder)
    assert ray == local and len(local["tensors"]) == 123
    assert f"ckptfix: ray: joined the cluster at {address} (2 CPUs)" in stderr.splitlines()


def test_relative_paths_on_ray(address: str, tmp_path: Path) -> None:
    """The workers run elsewhere: a relative path is the driver's, as are the names."""
    _model(tmp_path)
    Factory(tmp_path).bytes("c.bin", b"junk")
    local, ray, _ = both(address, "hash", "m", cwd=tmp_path)
    assert ray == local and local["path"] == "m"
    local, ray, _ = both(address, "inspect", "m", "c.bin", cwd=tmp_path)
    assert ray == local and [report["path"] for report in local] == ["m", "c.bin"]


def test_hash_of_a_dcp_folder_on_ray(address: str, dcp_saved: Path) -> None:
    local, ray, _ = both(address, "hash", dcp_saved / "torch_save")
    assert ray == local and local["tensor_count"] > 0


def test_hash_of_a_url_on_ray(address: str, tmp_path: Path) -> None:
    _model(tmp_path / "served")
    with http_server(tmp_path / "served") as server:
        url = f"{server.url}/m"
        local, ray, _ = both(address, "hash", url)
    local.pop("remote"), ray.pop("remote")  # requests made: more with several readers
    assert ray == local and local["path"] == url


def test_diff_on_ray(address: str, tmp_path: Path) -> None:
    first, same = _model(tmp_path, "a"), _model(tmp_path, "b")
    other = Factory(tmp_path).sharded(
        "c", [[Spec("s0.0.0", "F32", (8, 16), b"\0" * 512), Spec("big0.0", "BF16", (512, 700))]]
    )
    local, ray, _ = both(address, "diff", first, same)
    assert ray == local and local["identical"] and local["digest"]
    local, ray, _ = both(address, "diff", first, other, "--values")
    assert ray == local and local["bytes_changed"][0]["name"] == "s0.0.0"
    assert local["bytes_changed"][0]["values"] is not None and len(local["only_in_a"]) == 121


def test_inspect_of_several_paths_on_ray(address: str, tmp_path: Path) -> None:
    f = Factory(tmp_path)
    paths = [_model(tmp_path, "a"), f.safetensors("b.safetensors"), f.bytes("c.bin", b"junk")]
    local, ray, stderr = both(address, "inspect", *paths)
    assert ray == local and [report["path"] for report in local] == list(map(str, paths))
    assert "joined the cluster" in stderr


def test_a_data_error_in_a_task_is_the_one_line_error(address: str, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    ray = ckptfix(
        "inspect", _model(tmp_path), missing, "--executor", "ray", env=cluster_env(address)
    )
    local = ckptfix("inspect", _model(tmp_path), missing, env=cluster_env())
    assert (ray.returncode, ray.stdout) == (local.returncode, local.stdout) == (2, ""), ray.stderr
    assert ray.stderr.splitlines()[-1] == local.stderr.splitlines()[-1]
    assert "Traceback" not in ray.stderr and str(missing) in ray.stderr


def test_a_source_changed_under_a_task(address: str, tmp_path: Path) -> None:
    """The header the tasks read says another dtype than the one the driver planned from:
    the task's error ends the run (exit 1, one line), no digest printed."""
    _model(tmp_path / "served")
    with http_server(tmp_path / "served") as server:
        url = f"{server.url}/m"
        behaviour = server.behaviour
        behaviour.mutation, behaviour.mutate_at = (lambda data: data), 10**9
        assert ckptfix("inspect", url, env=cluster_env()).returncode == 0
        planned = behaviour.answers  # what loading and checking the metadata takes
        behaviour.reset()
        behaviour.mutation = lambda data: data.replace(b'"F32"', b'"I32"')
        behaviour.mutate_at, behaviour.mutate_on = planned, True
        ray = ckptfix("hash", url, "--executor", "ray", env=cluster_env(address))
    assert ray.returncode == 1 and ray.stdout == "", ray.stderr
    last = ray.stderr.splitlines()[-1]
    assert last.startswith(f"error: {url}") and "rule source-changed" in last, ray.stderr
    assert "Traceback" not in ray.stderr


def _kill_a_task_worker(stop: threading.Event, killed: list[int]) -> None:
    """SIGKILL the first worker process found running hash_part."""
    while not stop.is_set() and not killed:
        for pid in _task_workers()[:1]:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        time.sleep(0.01)


def test_a_worker_killed_during_a_task_is_retried(address: str, tmp_path: Path) -> None:
    _model(tmp_path / "served")
    with http_server(tmp_path / "served") as server:
        url = f"{server.url}/m"
        local = ckptfix("hash", url, "--json", env=cluster_env())
        server.behaviour.delay = 0.3  # each task takes a while: time to find its worker
        stop, killed = threading.Event(), []
        killer = threading.Thread(target=_kill_a_task_worker, args=(stop, killed))
        killer.start()
        try:
            ray = ckptfix("hash", url, "--json", "--executor", "ray", env=cluster_env(address))
        finally:
            stop.set()
            killer.join()
    assert killed, "no worker was found running a task"
    assert ray.returncode == 0, ray.stderr
    assert json.loads(ray.stdout)["digest"] == json.loads(local.stdout)["digest"]


def _task_workers() -> list[int]:
    return task_workers("hash_part")


def test_ctrl_c_cancels_the_tasks(address: str, tmp_path: Path) -> None:
    _model(tmp_path / "served")
    with http_server(tmp_path / "served") as server:
        server.behaviour.delay = 0.5  # tasks that would run for seconds
        command = [sys.executable, "-m", "ckptfix", "hash", f"{server.url}/m", "--executor", "ray"]
        process = subprocess.Popen(
            command, env=cluster_env(address), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 60
        while not _task_workers() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _task_workers(), "no task started"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
        deadline = time.monotonic() + 30
        while _task_workers() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _task_workers()
    assert process.returncode == 130 and out == b"", err
    assert err.decode().splitlines()[-1] == "error: interrupted by SIGINT (rule interrupted)"
    assert left == [], "tasks still running after the interruption"
