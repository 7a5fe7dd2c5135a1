"""A Ray write run's failures said as a local run says them, without a cluster: the tasks
run in this process through a ShardRunner (as executors.ray_write.RayShardRunner runs them
on Ray), and Ray's wrapper of a task's error is unwrapped on the driver."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ckptfix.core.errors import SourceChangedError, WriteError
from ckptfix.executors.ray_write import write_part
from ckptfix.ops import rewrite, rewrite_parts
from ckptfix.ops.rewrite_options import PartRequest, PartTarget, ReshardOptions
from ckptfix.platform import system
from ckptfix.write.extras import copy_extra
from ckptfix.write.parts import PartRecord
from ckptfix.write.staging import write_marker
from ckptfix.write.stores import open_store
from ckptfix.write.stores.base import StoreOptions
from ckptfix.write.stores.s3 import MultipartUpload
from tests.builders import Factory, Spec
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
