"""A Ray write run's failures said as a local run says them, without a cluster: the tasks
run in this process through a ShardRunner (as executors.ray_write.RayShardRunner runs them
on Ray), and Ray's wrapper of a task's error is unwrapped on the driver."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ckptfix.core.errors import SourceChangedError, WriteError
from ckptfix.executors.ray_write import write_part
from ckptfix.ops import rewrite, rewrite_parts
from ckptfix.ops.rewrite_options import PartRequest, ReshardOptions
from ckptfix.platform import system
from ckptfix.write.extras import copy_extra
from ckptfix.write.parts import PartRecord
from ckptfix.write.staging import write_marker
from tests.builders import Factory, Spec
from tests.optional import needs
from tests.store_helpers import folder_files


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
    """Every slice written, and beside them in the run's staging folder the scratch folder
    a task's first attempt left when its worker was killed (Ray ran it again): mid-write,
    or between making the folder and marking it (`marked` False: no marker yet)."""

    def __init__(self, marked: bool) -> None:
        super().__init__()
        self.marked = marked

    def __call__(
        self, request: PartRequest, sizes: Sequence[int], progress: Any
    ) -> list[PartRecord]:
        records = super().__call__(request, sizes, progress)
        target = request.options.target
        assert target is not None and target.folder is not None
        scratch = tempfile.mkdtemp(prefix=".ckptfix-", dir=target.folder)
        if self.marked:
            write_marker(scratch)
            Path(scratch, records[0].shards[0].file).write_bytes(b"half a shard")
        return records


@pytest.mark.parametrize("marked", [True, False], ids=["mid-write", "before-its-marker"])
def test_a_dead_attempts_scratch_folder_is_not_published(tmp_path: Path, marked: bool) -> None:
    source = _source(tmp_path)
    rewrite.reshard(source, tmp_path / "local", ReshardOptions(max_shard="20KB"))
    options = ReshardOptions(max_shard="20KB", runner=_AfterADeadAttempt(marked))
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
