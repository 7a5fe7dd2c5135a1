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

from ckptfix.write.staging import is_staging_folder
from tests.builders import Factory, Spec
from tests.optional import needs
from tests.ray_cluster import ckptfix, cluster_env, ray_cluster, task_workers
from tests.remote_servers import S3_ENV, http_server, moto_server
from tests.store_helpers import NO_METADATA, folder_files, names, new_bucket, objects
from tests.store_targets import Target, gcs_target

# One xdist worker runs every Ray test (make test: --dist loadgroup): one cluster at a time,
# and tests that look for task processes by name see only their own cluster's.
pytestmark = [
    needs("ray"),
    needs("moto"),
    needs("gcsfs"),
    pytest.mark.slow,
    pytest.mark.xdist_group("ray"),
]


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_server() as found:
        yield found


@pytest.fixture(scope="module")
def servers(endpoint: str) -> Iterator[tuple[str, Target]]:
    """The cluster, its nodes (the workers) configured for moto and for the loopback Cloud
    Storage server as the driver is (the environment the nodes start with: as a cluster's
    nodes have their own credentials and endpoints); and that server."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**S3_ENV, **NO_METADATA, "AWS_ENDPOINT_URL": endpoint}.items():
            patch.setenv(name, value)
        with (
            tempfile.TemporaryDirectory(prefix="ckray") as temp,
            gcs_target(Path(temp) / "gcs", patch.setenv) as gcs,
            ray_cluster(Path(temp)) as found,
        ):
            yield found, gcs


@pytest.fixture(scope="module")
def address(servers: tuple[str, Target]) -> str:
    return servers[0]


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


def _joined(driver: subprocess.Popen[bytes]) -> bytes:
    """What the driver said up to joining the cluster (read from its stderr)."""
    assert driver.stderr is not None
    said = b""
    while b"ray: joined the cluster" not in said:
        line = driver.stderr.readline()
        assert line, f"the driver ended before joining the cluster: {said!r}"
        said += line
    return said


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
        said = _joined(driver)  # its handlers are in place: the tasks seen next may be
        deadline = time.monotonic() + 60  # another test's (another xdist worker's cluster)
        while not task_workers("write_part") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert task_workers("write_part"), "no write task started"
        driver.send_signal(stop)
        _, rest = driver.communicate(timeout=60)
        err = said + rest
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
    done = _run("convert", source, "-o", out, "--max-shard", "100KB", "--commit", "--json",
                env=local)  # fmt: skip
    assert destination.held() == folder_files(tmp_path / "local"), order
    shards = [data for name, data in destination.held().items() if name.endswith(".safetensors")]
    checked = json.loads(done.stdout)["commit"]
    assert checked["parts"] == 3 and checked["shards"] == len(shards)
    if isinstance(out, str):  # the store's checksums, nothing read back
        assert (checked["by"], checked["bytes_read"]) == ("store checksum", 0)
    else:
        assert (checked["by"], checked["bytes_read"]) == ("sha256 read back", sum(map(len, shards)))
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


def test_gcs_written_on_ray_is_the_local_output(
    servers: tuple[str, Target], env: dict[str, str], tmp_path: Path
) -> None:
    """The tasks upload to gs:// with the endpoint and credentials their nodes have."""
    gcs, source = servers[1], _model(tmp_path)
    _run("reshard", source, "-o", tmp_path / "local", "--max-shard", "100KB", env=_local(env))
    ray = _run("reshard", source, "-o", gcs.url(), "--max-shard", "100KB", "--executor", "ray",
               "--json", env=env)  # fmt: skip
    expected = folder_files(tmp_path / "local")
    assert gcs.read() == expected and len(expected) >= 7
    shards = sum(len(data) for name, data in expected.items() if name.endswith(".safetensors"))
    assert json.loads(ray.stdout)["written"]["upload"]["bytes_sent"] >= shards


def test_an_hf_output_is_refused_on_ray(env: dict[str, str], tmp_path: Path) -> None:
    """The Hub publishes what one process uploaded, in one commit."""
    refused = _run("reshard", _model(tmp_path), "-o", "hf://someone/model", "--executor", "ray",
                   env=env, code=2)  # fmt: skip
    assert refused.stderr.splitlines()[-1] == (
        "error: --executor: an hf:// output is uploaded and committed by one process (rule "
        "usage; write to a folder or s3:// with parts, or run without --part and --executor ray)"
    )


def _killed_at_half(args: list[object], env: dict[str, str], count: Callable[[], int]) -> int:
    """Start `ckptfix ARGS` and SIGKILL it once `count()` (the shards complete at OUT) is
    about half of `planned`; the count when it was killed, after Ray ended its tasks."""
    planned = int(str(args.pop()))
    command = [sys.executable, "-m", "ckptfix", *map(str, args)]
    driver = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while count() < planned // 2 and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert driver.poll() is None, "the run ended before half its shards were written"
    driver.kill()
    driver.communicate(timeout=60)
    deadline = time.monotonic() + 60  # Ray ends a dead driver's tasks
    while task_workers("write_part") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert task_workers("write_part") == []
    return count()


def test_a_killed_s3_run_resumed_on_ray(
    env: dict[str, str], s3: Any, bucket: str, tmp_path: Path
) -> None:
    """A driver killed at about half its shards, then the same command with --resume: the
    local executor's bytes; what was kept is said and not sent again; run again, every
    shard is kept and no tensor byte is sent."""
    _model(tmp_path / "served")
    out, shard = f"s3://{bucket}/out", ("--max-shard", "100KB")
    with http_server(tmp_path / "served") as server:
        url = f"{server.url}/m"
        _run("reshard", url, "-o", tmp_path / "local", *shard, env=_local(env))
        expected = folder_files(tmp_path / "local")
        planned = [name for name in expected if name.endswith(".safetensors")]
        server.behaviour.delay = 0.2

        def complete() -> int:
            return len([name for name in names(s3, bucket, "out") if name in planned])

        args: list[object] = ["reshard", url, "-o", out, *shard, "--executor", "ray"]
        there = _killed_at_half([*args, len(planned)], env, complete)
        assert 0 < there < len(planned)
        kept = {name: len(data) for name, data in objects(s3, bucket, "out").items()}
        assert not [name for name in kept if name.endswith(".json")]  # nothing published
        server.behaviour.delay = 0
        first = json.loads(_run(*args, "--resume", "--json", env=env).stdout)
        second = json.loads(_run(*args, "--resume", "--json", env=env).stdout)
    assert objects(s3, bucket, "out") == expected
    small = sum(len(data) for name, data in expected.items() if name not in planned)
    upload = first["written"]["upload"]
    assert sorted(upload["kept"]) == sorted(n for n in kept if n in planned)
    assert upload["bytes_kept"] == sum(size for n, size in kept.items() if n in planned) > 0
    total = sum(map(len, expected.values()))
    assert upload["bytes_sent"] == total - upload["bytes_kept"]
    again = second["written"]["upload"]
    assert sorted(again["kept"]) == sorted(planned)
    assert again["bytes_sent"] == small  # the index and the small files, published again


def test_a_killed_folder_run_on_ray(env: dict[str, str], tmp_path: Path) -> None:
    """To a shared folder: --resume is the local executor's usage error (a folder is
    written whole or not at all, nothing of it to resume); the same command again writes
    the local output."""
    _model(tmp_path / "served")
    out, shard = tmp_path / "out", ("--max-shard", "100KB")
    with http_server(tmp_path / "served") as server:
        url = f"{server.url}/m"
        _run("reshard", url, "-o", tmp_path / "local", *shard, env=_local(env))
        planned = [n for n in folder_files(tmp_path / "local") if n.endswith(".safetensors")]
        server.behaviour.delay = 0.2

        def complete() -> int:
            staged = [p for p in tmp_path.glob(".ckptfix-*/*.safetensors")]
            return len([path for path in staged if path.name in planned])

        args: list[object] = ["reshard", url, "-o", out, *shard, "--executor", "ray"]
        assert 0 < _killed_at_half([*args, len(planned)], env, complete) < len(planned)
        assert not out.exists()
        server.behaviour.delay = 0
        on_ray = _run(*args, "--resume", env=env, code=2).stderr.splitlines()[-1]
        local = _run(*args[:-2], "--resume", env=_local(env), code=2).stderr.splitlines()[-1]
        assert on_ray == local and "--resume" in on_ray
        _run(*args, env=env)
    assert folder_files(out) == folder_files(tmp_path / "local")
    # What a killed local run leaves too: its marked staging folder, which nothing deletes
    # (another run may be writing there; see README, "safe to delete when no run writes")
    left = sorted(set(os.listdir(tmp_path)) - {"local", "out", "served"})
    assert [name for name in left if not is_staging_folder(str(tmp_path / name))] == []


def test_resume_refuses_an_object_of_another_run_before_any_task(
    env: dict[str, str], s3: Any, bucket: str, tmp_path: Path
) -> None:
    """--resume without --force replaces nothing: a shard of another checkpoint under the
    prefix is the local executor's usage error, before any task sends a byte."""
    source, out = _model(tmp_path), f"s3://{bucket}/out"
    s3.put_object(Bucket=bucket, Key="out/model-00009-of-00009.safetensors", Body=b"x")
    args = ("reshard", source, "-o", out, "--max-shard", "100KB", "--resume")
    local = _run(*args, env=_local(env), code=2).stderr.splitlines()[-1]
    on_ray = _run(*args, "--executor", "ray", env=env, code=2).stderr.splitlines()[-1]
    assert on_ray == local and "is not part of this run's output" in on_ray
    assert names(s3, bucket, "out") == ["model-00009-of-00009.safetensors"]


def test_resume_refuses_a_shard_of_other_bytes_on_ray(
    env: dict[str, str], s3: Any, bucket: str, tmp_path: Path
) -> None:
    """--resume without --force, a planned shard's name holding other bytes of the same
    size: the local executor's usage error (raised by the task that writes that shard),
    and nothing is published."""
    source, out = _model(tmp_path), f"s3://{bucket}/out"
    _run("reshard", source, "-o", tmp_path / "local", "--max-shard", "100KB", env=_local(env))
    name = sorted(n for n in os.listdir(tmp_path / "local") if n.endswith(".safetensors"))[-1]
    size = (tmp_path / "local" / name).stat().st_size
    s3.put_object(Bucket=bucket, Key=f"out/{name}", Body=b"\0" * size)
    args = ("reshard", source, "-o", out, "--max-shard", "100KB", "--resume")
    local = _run(*args, env=_local(env), code=2).stderr.splitlines()[-1]
    on_ray = _run(*args, "--executor", "ray", env=env, code=2).stderr.splitlines()[-1]
    assert on_ray == local and f"out/{name}: is not what this run writes there" in on_ray
    assert objects(s3, bucket, "out")[name] == b"\0" * size
    assert not [n for n in names(s3, bucket, "out") if n.endswith(".json")]


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
    its upload): the tasks are stopped first (SIGSTOP), so that none runs its own clean-up
    when Ray, seeing its driver gone, ends it before the SIGKILL does."""
    workers = task_workers("write_part")
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    driver.kill()
    for pid in workers:
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
