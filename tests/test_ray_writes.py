"""convert, reshard and dedupe with `--executor ray` on a real two-node Ray cluster on
127.0.0.1 (tests/ray_cluster.py), with moto's S3 as the store both nodes share and a local
folder as the other destination: the same bytes as the local executor; a worker killed
during a write is retried; a killed driver publishes nothing; a task's data error is the
one-line error. And `--part I/N` + `--commit` run as separate processes."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.builders import Factory, Spec
from tests.optional import needs
from tests.ray_cluster import ckptfix, cluster_env, ray_cluster, task_workers
from tests.remote_servers import S3_ENV, http_server, moto_server
from tests.store_helpers import NO_METADATA, folder_files, names, new_bucket, objects

pytestmark = [needs("ray"), needs("moto"), pytest.mark.slow]


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_server() as found:
        yield found


@pytest.fixture(scope="module")
def address(endpoint: str) -> Iterator[str]:
    """The cluster, its nodes (the workers) configured for moto as the driver is."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**S3_ENV, **NO_METADATA, "AWS_ENDPOINT_URL": endpoint}.items():
            patch.setenv(name, value)
        with tempfile.TemporaryDirectory(prefix="ckray") as temp, ray_cluster(Path(temp)) as found:
            yield found


@pytest.fixture
def env(endpoint: str, address: str) -> dict[str, str]:
    """A driver's environment: the cluster's, S3 at moto."""
    return {**cluster_env(address), **S3_ENV, **NO_METADATA, "AWS_ENDPOINT_URL": endpoint}


@pytest.fixture
def s3(endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


_buckets = iter(range(10**6))


@pytest.fixture
def bucket(s3: Any) -> Iterator[str]:
    yield from new_bucket(s3, f"ray-{next(_buckets)}")


def _model(root: Path, name: str = "m") -> Path:
    """Three source shards: large tensors and small ones, rewritten into six or more."""
    shards = [
        [Spec(f"s.{shard}.{i}", "F32", (8, 16 + i)) for i in range(20)]
        + [Spec(f"big.{shard}", "F32", (512, 300 + shard))]
        for shard in range(3)
    ]
    folder = Factory(root).sharded(name, shards)
    Factory(root).config(name, torch_dtype="float32")
    return folder


def _local(env: dict[str, str]) -> dict[str, str]:
    """The same environment without the cluster: the local executor."""
    return {name: value for name, value in env.items() if name != "RAY_ADDRESS"}


def _run(*args: object, env: dict[str, str], code: int = 0) -> subprocess.CompletedProcess[str]:
    done = ckptfix(*args, env=env)
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
    return done


REWRITES = [
    ("reshard", "--max-shard", "100KB"),
    ("convert", "--dtype", "bf16", "--max-shard", "100KB"),
    ("dedupe", "--max-shard", "100KB"),
]


@pytest.mark.parametrize("command", REWRITES, ids=lambda c: c[0])
def test_a_folder_written_on_ray_is_the_local_output(
    command: tuple[str, ...], env: dict[str, str], tmp_path: Path
) -> None:
    source = _model(tmp_path)
    name, *options = command
    _run(name, source, "-o", tmp_path / "local", *options, env=_local(env))
    ray = _run(
        name, source, "-o", tmp_path / "ray", *options, "--executor", "ray", "--json", env=env
    )
    expected = folder_files(tmp_path / "local")
    assert folder_files(tmp_path / "ray") == expected and len(expected) >= 7
    assert json.loads(ray.stdout)["executor"]["max_retries"] == 3
    assert "retried up to 3 times" in ray.stderr
    assert sorted(os.listdir(tmp_path)) == ["local", "m", "ray"]  # no staging folder left


def test_s3_written_on_ray_is_the_local_output(
    env: dict[str, str], s3: Any, bucket: str, tmp_path: Path
) -> None:
    source = _model(tmp_path)
    _run("reshard", source, "-o", f"s3://{bucket}/local", "--max-shard", "100KB", env=_local(env))
    _run("reshard", source, "-o", f"s3://{bucket}/ray", "--max-shard", "100KB",
         "--executor", "ray", env=env)  # fmt: skip
    _run("reshard", source, "-o", tmp_path / "folder", "--max-shard", "100KB", env=_local(env))
    expected = objects(s3, bucket, "local")
    assert objects(s3, bucket, "ray") == expected == folder_files(tmp_path / "folder")


def test_a_second_ray_run_replaces_an_s3_output_with_force(
    env: dict[str, str], s3: Any, bucket: str, tmp_path: Path
) -> None:
    source, url = _model(tmp_path), f"s3://{bucket}/out"
    _run("reshard", source, "-o", url, "--max-shard", "50KB", "--executor", "ray", env=env)
    refused = _run("reshard", source, "-o", url, "--executor", "ray", env=env, code=2)
    assert "pass --force" in refused.stderr.splitlines()[-1]
    _run("reshard", source, "-o", url, "--max-shard", "100KB", "--executor", "ray", "--force",
         env=env)  # fmt: skip
    _run("reshard", source, "-o", tmp_path / "folder", "--max-shard", "100KB", env=_local(env))
    assert objects(s3, bucket, "out") == folder_files(tmp_path / "folder")


def _kill_first(function: str, stop: threading.Event, killed: list[int]) -> None:
    while not stop.is_set() and not killed:
        for pid in task_workers(function)[:1]:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        time.sleep(0.01)


@pytest.mark.parametrize("to_store", [False, True], ids=["folder", "s3"])
def test_a_worker_killed_during_a_write_is_retried(
    to_store: bool, env: dict[str, str], s3: Any, bucket: str, tmp_path: Path
) -> None:
    _model(tmp_path / "served")
    out = f"s3://{bucket}/out" if to_store else tmp_path / "out"
    with http_server(tmp_path / "served") as server:
        url = f"{server.url}/m"
        _run("reshard", url, "-o", tmp_path / "local", "--max-shard", "100KB", env=_local(env))
        server.behaviour.delay = 0.2  # each task takes a while: time to find its worker
        stop, killed = threading.Event(), list[int]()
        killer = threading.Thread(target=_kill_first, args=("write_part", stop, killed))
        killer.start()
        try:
            _run("reshard", url, "-o", out, "--max-shard", "100KB", "--executor", "ray", env=env)
        finally:
            stop.set()
            killer.join()
    assert killed, "no worker was found running a write task"
    written = objects(s3, bucket, "out") if to_store else folder_files(tmp_path / "out")
    assert written == folder_files(tmp_path / "local")


def _ray_driver(
    source: str, out: str, max_shard: str, env: dict[str, str], stderr: int
) -> subprocess.Popen[bytes]:
    """`reshard SOURCE -o OUT --executor ray` in a process of its own (to be stopped)."""
    command = [sys.executable, "-m", "ckptfix", "reshard", source, "-o", out,
               "--max-shard", max_shard, "--executor", "ray"]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGINT], ids=["killed", "ctrl-c"])
@pytest.mark.parametrize("to_store", [False, True], ids=["folder", "s3"])
def test_a_stopped_driver_publishes_nothing(
    stop: int, to_store: bool, env: dict[str, str], s3: Any, bucket: str, tmp_path: Path
) -> None:
    """SIGKILL: the driver alone publishes; Ctrl-C: the tasks are cancelled too."""
    _model(tmp_path / "served")
    out = f"s3://{bucket}/out" if to_store else str(tmp_path / "out")
    with http_server(tmp_path / "served") as server:
        server.behaviour.delay = 0.3
        driver = _ray_driver(f"{server.url}/m", out, "100KB", env, subprocess.PIPE)
        deadline = time.monotonic() + 60
        while not task_workers("write_part") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert task_workers("write_part"), "no write task started"
        driver.send_signal(stop)
        _, err = driver.communicate(timeout=60)
        deadline = time.monotonic() + 60  # Ray ends a dead driver's tasks
        while task_workers("write_part") and time.monotonic() < deadline:
            time.sleep(0.1)
    assert task_workers("write_part") == []
    if stop == signal.SIGINT:
        assert driver.returncode == 130, err
        assert err.decode().splitlines()[-1].startswith("error: ")
    if to_store:
        assert not [name for name in names(s3, bucket, "out") if name.endswith(".json")]
    else:
        assert not (tmp_path / "out").exists()


def test_a_source_changed_under_a_write_task(env: dict[str, str], tmp_path: Path) -> None:
    """The headers the tasks read say another dtype than the driver planned from: the
    task's error ends the run (exit 1, one line) and nothing is written."""
    _model(tmp_path / "served")
    with http_server(tmp_path / "served") as server:
        url = f"{server.url}/m"
        behaviour = server.behaviour
        behaviour.mutation, behaviour.mutate_at = (lambda data: data), 10**9
        _run("reshard", url, "-o", tmp_path / "plain", env=_local(env))
        planned = behaviour.answers  # what loading, checking and carrying the files takes
        behaviour.reset()
        behaviour.mutation = lambda data: data.replace(b'"F32"', b'"I32"')
        behaviour.mutate_at, behaviour.mutate_on = planned, True
        ray = _run("reshard", url, "-o", tmp_path / "out", "--max-shard", "100KB",
                   "--executor", "ray", env=env, code=1)  # fmt: skip
    last = ray.stderr.splitlines()[-1]
    assert last.startswith("error: ") and "rule source-changed" in last, ray.stderr
    assert not (tmp_path / "out").exists()


@dataclass(frozen=True)
class Destination:
    """A test's OUT: a folder, or a prefix of the bucket; what it holds, by name."""

    out: str | Path
    held: Callable[[], dict[str, bytes]]


@pytest.fixture(params=[False, True], ids=["folder", "s3"])
def destination(request: Any, s3: Any, bucket: str, tmp_path: Path) -> Destination:
    if request.param:
        return Destination(f"s3://{bucket}/out", lambda: objects(s3, bucket, "out"))
    return Destination(tmp_path / "out", lambda: folder_files(tmp_path / "out"))


def _parts(source: Path, out: object, env: dict[str, str], order: list[int]) -> None:
    """`--part I/3` for each I of `order`, each in a process of its own."""
    for part in order:
        _run("convert", source, "-o", out, "--max-shard", "100KB", "--part", f"{part}/3", env=env)


def test_parts_in_any_order_then_commit(
    destination: Destination, env: dict[str, str], tmp_path: Path
) -> None:
    source, local, out = _model(tmp_path), _local(env), destination.out
    _run("convert", source, "-o", tmp_path / "local", "--max-shard", "100KB", env=local)
    order = [1, 2, 3, random.choice([1, 2, 3])]
    random.shuffle(order)
    _parts(source, out, local, order)
    if isinstance(out, str):  # the prefix holds shards and records, no index
        held = destination.held()
        assert held and not [name for name in held if name.endswith("index.json")]
    else:  # the parts are beside OUT
        assert not out.exists() and (tmp_path / ".ckptfix-parts-out").is_dir()
    _run("convert", source, "-o", out, "--max-shard", "100KB", "--commit", env=local)
    assert destination.held() == folder_files(tmp_path / "local"), order
    assert sorted(os.listdir(tmp_path)) == [
        "local",
        "m",
        *([] if isinstance(out, str) else ["out"]),
    ]


def test_commit_refuses_a_missing_part(
    destination: Destination, env: dict[str, str], tmp_path: Path
) -> None:
    source, local, out = _model(tmp_path), _local(env), destination.out
    _parts(source, out, local, [3, 1])
    refused = _run("convert", source, "-o", out, "--max-shard", "100KB", "--commit", env=local,
                   code=1)  # fmt: skip
    assert refused.stderr.splitlines()[-1].endswith(
        "part 2 of 3 is missing (rule verification-failed; run the same command with "
        "--part 2/3, then --commit again)"
    )
    assert not [name for name in destination.held() if name.endswith("index.json")]
    other = _run("convert", source, "-o", out, "--max-shard", "100KB", "--dtype", "bf16",
                 "--commit", env=local, code=1)  # fmt: skip
    assert "was written for another plan" in other.stderr.splitlines()[-1]


def _slow_model(root: Path) -> Path:
    """Four shards of forty 256 KiB tensors: each output shard (10 MiB, two upload parts)
    reads forty ranges from the server, so its upload stays under way while they come."""
    shards = [[Spec(f"w.{shard}.{i}", "F32", (64, 1024)) for i in range(40)] for shard in range(4)]
    folder = Factory(root).sharded("m", shards)
    Factory(root).config("m", torch_dtype="float32")
    return folder


def _uploads_under_way(s3: Any, bucket: str) -> list[tuple[str, str]]:
    listed = s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    return sorted((item["Key"], item["UploadId"]) for item in listed)


def _recorded(s3: Any, bucket: str) -> list[tuple[str, str]]:
    """The uploads under way, once each has its record (a task killed between starting an
    upload and recording it leaves that one to be reported, not aborted: the safe side)."""
    from ckptfix.write.stores.s3_marker import record_name

    under_way = _uploads_under_way(s3, bucket)
    records = set(names(s3, bucket, "out"))
    mine = [(key, upload) for key, upload in under_way if record_name(key[4:], upload) in records]
    return mine if mine == under_way else []


def _kill_run(driver: subprocess.Popen[bytes]) -> None:
    """SIGKILL the driver and every write task at once (no task is retried, none aborts
    its upload)."""
    driver.kill()
    for pid in task_workers("write_part"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    driver.wait(60)
    deadline = time.monotonic() + 60
    while task_workers("write_part") and time.monotonic() < deadline:
        time.sleep(0.1)


def test_a_killed_ray_runs_uploads_of_every_task_are_aborted_by_the_next_run(
    env: dict[str, str], s3: Any, bucket: str, tmp_path: Path
) -> None:
    """The tasks of a Ray run share the prefix: each records its own uploads, so a --force
    run after the run was killed aborts every task's, not only the last one's."""
    source, out = _slow_model(tmp_path / "served"), f"s3://{bucket}/out"
    with http_server(tmp_path / "served") as server:
        server.behaviour.delay = 0.25
        driver = _ray_driver(f"{server.url}/m", out, "11MB", env, subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while len(_recorded(s3, bucket)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        _kill_run(driver)
    assert task_workers("write_part") == []
    left = _uploads_under_way(s3, bucket)
    assert len(left) >= 2, "no two tasks had an upload under way"
    run = _run("reshard", source, "-o", out, "--max-shard", "11MB", "--force", "--json",
               env=_local(env))  # fmt: skip
    upload = json.loads(run.stdout)["written"]["upload"]
    assert sorted(upload["aborted_uploads"]) == sorted(key[4:] for key, _ in left), (upload, left)
    assert upload["other_uploads"] == [], (upload, left)
    assert _uploads_under_way(s3, bucket) == []
    assert not [name for name in names(s3, bucket, "out") if ".ckptfix" in name]
