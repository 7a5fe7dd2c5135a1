"""A Ray write run's failures said as a local run says them, without a cluster: the tasks
run in this process through a ShardRunner (as executors.ray_write.RayShardRunner runs them
on Ray), and Ray's wrapper of a task's error is unwrapped on the driver."""

from __future__ import annotations

import errno
import os
import pickle
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ckptfix.core.errors import InputNotFoundError, SourceChangedError, WriteError
from ckptfix.executors.ray_cluster import Task
from ckptfix.executors.ray_work import hash_part, inspect_one
from ckptfix.executors.ray_write import write_part
from ckptfix.ops import rewrite, rewrite_parts
from ckptfix.ops.rewrite_options import PartRequest, PartTarget, ReshardOptions
from ckptfix.ops.tensorset import opened
from ckptfix.platform import system
from ckptfix.write.extras import copy_extra
from ckptfix.write.parts import PartRecord
from ckptfix.write.staging import write_marker
from ckptfix.write.stores import open_store
from ckptfix.write.stores.base import StoreOptions
from ckptfix.write.stores.s3 import MultipartUpload
from tests.builders import Factory, Spec
from tests.helpers import cli
from tests.optional import needs
from tests.store_helpers import folder_files, moto_here, objects


class _InProcess:
    """A ShardRunner that runs every slice here, one after another, as a task would."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(
        self, request: PartRequest, sizes: Sequence[int], progress: Any
    ) -> list[PartRecord]:
        self.calls += 1
        return [write_part(request, part, len(sizes)) for part in range(1, len(sizes) + 1)]


def _source(tmp_path: Path) -> Path:
    return Factory(tmp_path).sharded("m", [[Spec(f"w{i}", "F32", (64, 64))] for i in range(3)])


class _AfterADeadAttempt(_InProcess):
    """Every slice written, and what a task's first attempt left (`dead`: the target and
    the first shard's name) when its worker was killed and Ray ran it again."""

    def __call__(
        self, request: PartRequest, sizes: Sequence[int], progress: Any
    ) -> list[PartRecord]:
        records = super().__call__(request, sizes, progress)
        assert request.options.target is not None
        self.dead(request.options.target, records[0].shards[0].file)
        return records

    def dead(self, target: PartTarget, name: str) -> None:
        raise NotImplementedError


class _DeadScratch(_AfterADeadAttempt):
    """The attempt's scratch folder in the run's staging folder: killed mid-write, or
    between making the folder and marking it (`marked` False: no marker yet)."""

    def __init__(self, marked: bool) -> None:
        super().__init__()
        self.marked = marked

    def dead(self, target: PartTarget, name: str) -> None:
        assert target.folder is not None
        scratch = tempfile.mkdtemp(prefix=".ckptfix-", dir=target.folder)
        if self.marked:
            write_marker(scratch)
            Path(scratch, name).write_bytes(b"half a shard")


@pytest.mark.parametrize("marked", [True, False], ids=["mid-write", "before-its-marker"])
def test_a_dead_attempts_scratch_folder_is_not_published(tmp_path: Path, marked: bool) -> None:
    source = _source(tmp_path)
    rewrite.reshard(source, tmp_path / "local", ReshardOptions(max_shard="20KB"))
    options = ReshardOptions(max_shard="20KB", runner=_DeadScratch(marked))
    rewrite.reshard(source, tmp_path / "out", options)
    assert folder_files(tmp_path / "out") == folder_files(tmp_path / "local")
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.listdir(tmp_path / "local"))
    assert sorted(os.listdir(tmp_path)) == ["local", "m", "out"]


def test_the_in_process_runner_writes_what_a_local_run_writes(tmp_path: Path) -> None:
    """The runner the tests below rely on: the output of a split run, every slice written."""
    runner = _InProcess()
    options = ReshardOptions(max_shard="20KB", runner=runner)
    result = rewrite.reshard(_source(tmp_path), tmp_path / "out", options)
    assert runner.calls == 1 and result.written is not None
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        [shard.file for shard in result.plan.shards] + ["model.safetensors.index.json"]
    )


def test_free_space_is_checked_before_any_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _InProcess()
    monkeypatch.setattr(type(system()), "disk_space", lambda self, folder: (10_000, False))
    with pytest.raises(WriteError) as raised:
        rewrite.reshard(
            _source(tmp_path), tmp_path / "out", ReshardOptions(max_shard="20KB", runner=runner)
        )
    assert raised.value.line().startswith(f"error: {tmp_path / 'out'}: not enough free space")
    assert runner.calls == 0 and os.listdir(tmp_path) == ["m"]


def test_a_tasks_oserror_is_the_local_writers_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(rewrite_parts, "write_slice_to_folder", full)
    out = tmp_path / "out"
    with pytest.raises(WriteError) as raised:
        rewrite.reshard(
            _source(tmp_path), out, ReshardOptions(max_shard="20KB", runner=_InProcess())
        )
    assert raised.value.line() == (
        f"error: {out}: no space left on device; nothing was written (rule write-failed; "
        "free some space or choose another -o folder)"
    )
    assert os.listdir(tmp_path) == ["m"]  # the staging folder removed


@needs("ray")
@pytest.mark.parametrize(
    "cause",
    [OSError(errno.EIO, "Input/output error"), SourceChangedError("m/x.safetensors")],
    ids=["oserror", "ckptfix-error"],
)
def test_the_driver_raises_the_tasks_own_error(cause: Exception) -> None:
    """Not Ray's wrapper, whose text is the worker's traceback in terminal colours."""
    import ray

    from ckptfix.executors.ray_cluster import _result

    wrapped = ray.exceptions.RayTaskError("write_part", "\x1b[36mTraceback", cause)

    def get(ref: object) -> None:
        raise wrapped.as_instanceof_cause()

    fake = SimpleNamespace(get=get, exceptions=ray.exceptions)
    with pytest.raises(type(cause)) as raised:
        _result(fake, object())
    assert raised.value is cause


def test_a_carried_file_removed_during_the_run_is_a_changed_source(tmp_path: Path) -> None:
    """Listed when the source was loaded, gone when it is copied (a local run, or the
    driver of a Ray run, carrying config and notes beside the weights)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "staging").mkdir()
    with pytest.raises(SourceChangedError) as raised:
        copy_extra(str(tmp_path / "src"), ["notes.txt"], str(tmp_path / "staging"))
    assert raised.value.line() == (
        f"error: {tmp_path / 'src' / 'notes.txt'}: was removed during the run: the source "
        "changed (rule source-changed; run again on a stable copy)"
    )


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    with moto_here(monkeypatch.setenv) as client:
        yield client


class _DeadUpload(_AfterADeadAttempt):
    """The multipart upload of the first shard the attempt started: recorded as every
    upload a ckptfix process starts is (`recorded`), or killed before its record was put."""

    def __init__(self, s3: Any, recorded: bool) -> None:
        super().__init__()
        self.s3, self.recorded = s3, recorded
        self.started: list[str] = []

    def dead(self, target: PartTarget, name: str) -> None:
        assert target.store is not None
        if self.recorded:
            upload = open_store(target.store, StoreOptions()).begin(name, 64 * 2**20)
            assert isinstance(upload, MultipartUpload)
            self.started.append(str(upload.upload_id))
        else:
            key = f"{target.store.removeprefix('s3://bkt/')}/{name}"
            answer = self.s3.create_multipart_upload(Bucket="bkt", Key=key)
            self.started.append(answer["UploadId"])


@pytest.mark.slow
@needs("moto")
@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "before-its-record"])
def test_a_dead_attempts_upload_to_s3(s3: Any, tmp_path: Path, recorded: bool) -> None:
    """A recorded upload of this run's that no task completed is aborted at publication;
    one without a record (it may be anyone's) is left and reported."""
    source, prefix = _source(tmp_path), f"out-{recorded}"  # moto's buckets outlive a server
    rewrite.reshard(source, tmp_path / "local", ReshardOptions(max_shard="20KB"))
    runner = _DeadUpload(s3, recorded)
    options = ReshardOptions(max_shard="20KB", runner=runner)
    result = rewrite.reshard(source, f"s3://bkt/{prefix}", options)
    assert objects(s3, "bkt", prefix) == folder_files(tmp_path / "local")
    left = s3.list_multipart_uploads(Bucket="bkt", Prefix=f"{prefix}/").get("Uploads", [])
    assert result.written is not None and result.written.upload is not None
    shard, upload = "model-00001-of-00003.safetensors", result.written.upload
    if recorded:
        assert left == [] and upload.aborted == (shard,) and upload.left == ()
    else:
        started = [(item["Key"], item["UploadId"]) for item in left]
        assert started == [(f"{prefix}/{shard}", runner.started[0])]
        assert upload.left == (shard,) and upload.aborted == ()


@pytest.fixture
def on_ray_here(monkeypatch: pytest.MonkeyPatch) -> list[Callable[[], None]]:
    """`--executor ray` with its hash and inspect tasks run in this process, one after
    another, a task's error crossing a pickle as it crosses from a worker to the driver
    (ray_cluster._result then raises it as it was raised). What the test puts in the list
    returned runs once the driver has planned, before the first task."""
    from ckptfix.executors import ray_cluster, ray_work

    before: list[Callable[[], None]] = []

    def run_tasks(tasks: Sequence[Task], resources: object, progress: object = None) -> list[Any]:
        for damage in before:
            damage()
        results = []
        for task in tasks:
            try:
                results.append(task.function(*task.args))
            except Exception as exc:
                raise pickle.loads(pickle.dumps(exc)) from None
        return results

    monkeypatch.setattr(ray_cluster, "connect", lambda: ray_cluster.Cluster("here", False, 2))
    monkeypatch.setattr(ray_cluster, "disconnect", lambda: None)
    monkeypatch.setattr(ray_work, "run_tasks", run_tasks)
    return before


@pytest.mark.parametrize(
    ("command", "smallest"),
    [("hash", 4096), ("hash", 0), ("inspect", 0), ("diff", 4096)],
    ids=["hash-data", "hash-header", "inspect", "diff-data"],
)
def test_a_read_the_os_fails_in_a_task_is_the_local_runs_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_ray_here: list[object], command: str,
    smallest: int,
) -> None:  # fmt: skip
    """A read that fails (EIO: a disk's bad sector, a network file system's stale handle),
    of a header or of tensor data (reads of `smallest` bytes or more fail): the local
    reader's one-line error naming the file, the same on Ray. Was an internal error."""
    factory = Factory(tmp_path)
    for name in ("m", "n"):
        factory.sharded(name, [[Spec(f"w{i}", "F32", (64, 64))] for i in range(3)])
    pread = type(system()).pread

    def failing(self: object, fd: int, size: int, offset: int) -> bytes:
        if size >= smallest:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return pread(self, fd, size, offset)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(type(system()), "pread", failing)
    args = [command, "m", "n"] if command != "hash" else [command, "m"]
    local, ray = cli(*args), cli(*args, "--executor", "ray")
    assert local.code == 1 and local.stderr.startswith(
        "error: m/model-00001-of-00003.safetensors: cannot read the file: Input/output error "
        "(rule unreadable; check the disk or file system it is on"
    )
    assert ray.code == local.code and ray.stdout == local.stdout
    assert ray.stderr == "ckptfix: ray: joined the cluster at here (2 CPUs)\n" + local.stderr


@pytest.mark.parametrize("task", ["hash", "inspect"])
def test_a_working_folder_a_node_lacks_is_the_paths_error(tmp_path: Path, task: str) -> None:
    """A relative path is read from the driver's working folder: a node where that folder
    is not (not mounted there) cannot find the path."""
    source = _source(tmp_path)
    gone = str(tmp_path / "gone")
    with pytest.raises(InputNotFoundError) as raised:
        if task == "hash":
            with opened(source) as tensors:
                assert tensors.opened_as is not None
                relative = replace(tensors.opened_as, path="m", cwd=gone)
            hash_part(relative, [], [], 1)
        else:
            inspect_one("m", gone, {})
    assert raised.value.line() == (
        f"error: m: no such file or directory on this Ray node: the driver's working folder "
        f"{gone} is not there (rule input-not-found; give a path every node sees the same way, "
        "such as an absolute path on a shared file system)"
    )
    assert raised.value.exit_code == 2


def _damaged(shard: Path, how: str) -> None:
    if how == "truncated":
        os.truncate(shard, shard.stat().st_size - 100)
        return
    shard.unlink()
    if how == "folder":
        shard.mkdir()
    elif how == "fifo":
        os.mkfifo(shard)


@pytest.mark.parametrize("how", ["removed", "folder", "fifo", "truncated"])
@pytest.mark.parametrize("command", ["hash", "inspect"])
def test_a_shard_damaged_after_the_plan_is_the_local_runs_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_ray_here: list[Callable[[], None]],
    command: str, how: str,
) -> None:  # fmt: skip
    """Readable when the driver planned, not when the task reads it (another node's view,
    or changed meanwhile): the task's error is the local run's on the damaged checkpoint."""
    _source(tmp_path)
    monkeypatch.chdir(tmp_path)
    shard = tmp_path / "m" / "model-00002-of-00003.safetensors"
    on_ray_here.append(lambda: _damaged(shard, how))
    args = [command, "m", "m"] if command == "inspect" else [command, "m"]
    ray = cli(*args, "--executor", "ray")
    local = cli(*args)
    assert local.code == 1 and "internal error" not in local.stderr
    assert ray.code == local.code and ray.stdout == local.stdout
    assert ray.stderr == "ckptfix: ray: joined the cluster at here (2 CPUs)\n" + local.stderr
