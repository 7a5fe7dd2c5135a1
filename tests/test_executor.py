"""`--executor` without a cluster: ray is imported only for `--executor ray`, its absence is
a usage error naming the extra, tasks are planned by bytes, and an error raised in a task
crosses to the driver whole (pickled by its fields)."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from ckptfix.core.errors import (
    CkptfixError,
    CorruptFileError,
    InputNotFoundError,
    Interrupted,
    SourceChangedError,
    UsageError,
)
from ckptfix.core.tensor import TensorInfo
from ckptfix.executors.ray_work import hash_part, split_by_bytes
from ckptfix.ops.digest import layout_key
from ckptfix.ops.tensorset import opened
from tests.builders import Factory, Spec


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["hash", "inspect"])
def test_without_ray_executor_ray_is_a_usage_error(tmp_path: Path, command: str) -> None:
    """ray made unimportable (a None entry in sys.modules) in the CLI's own process."""
    path = Factory(tmp_path).safetensors("m.safetensors")
    done = _run(
        "import sys; sys.modules['ray'] = None\n"
        "from ckptfix.cli.app import main\n"
        f"sys.argv = ['ckptfix', {command!r}, {str(path)!r}, '--executor', 'ray']\n"
        "main()"
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.strip().splitlines() == [
        "error: --executor: ray is not installed (rule usage; run pip install 'ckptfix[ray]')"
    ]


@pytest.mark.slow
def test_the_local_executor_does_not_import_ray(tmp_path: Path) -> None:
    path = Factory(tmp_path).safetensors("m.safetensors")
    done = _run(
        "import sys\nfrom ckptfix.cli.app import main\n"
        f"sys.argv = ['ckptfix', 'hash', {str(path)!r}, '--json']\n"
        "try:\n    main()\nexcept SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        "    print('ray' in sys.modules, file=sys.stderr)"
    )
    assert done.stderr.strip() == "False"


def _tensor(name: str, file: str, offset: int, nbytes: int) -> TensorInfo:
    return TensorInfo(name, "U8", (nbytes,), nbytes, file, (offset, offset + nbytes))


def test_tasks_are_runs_of_about_equal_bytes_in_file_order() -> None:
    named = [(f"t{i}", _tensor(f"t{i}", "b" if i % 2 else "a", 100 * i, 100)) for i in range(8)]
    named.append(("huge", _tensor("huge", "a", 10_000, 2_000)))
    in_order = ["t0", "t2", "t4", "t6", "huge", "t1", "t3", "t5", "t7"]  # by file, offset
    # 2,800 bytes in 4: runs of up to 700; the huge tensor is a run of its own
    assert split_by_bytes(named, 4) == [in_order[:4], ["huge"], in_order[5:]]
    assert split_by_bytes(named[:8], 4) == [["t0", "t2"], ["t4", "t6"], ["t1", "t3"], ["t5", "t7"]]
    assert split_by_bytes(named, 100) == [[name] for name in in_order]
    assert split_by_bytes(named, 1) == [in_order]
    assert split_by_bytes([], 4) == []


@pytest.mark.parametrize(
    "error",
    [
        CorruptFileError("/m/a.safetensors", "bad-shape", "a dimension past 2^64", "rewrite it"),
        CorruptFileError("/m/a.safetensors", "unreadable", "permission denied"),
        InputNotFoundError("/m", "no such file or folder"),
        UsageError("--executor", "ray is not installed", "pip install it"),
        SourceChangedError("/m", "it changed"),
        Interrupted(None, "SIGINT", 130),
    ],
)
def test_errors_cross_a_pickle_whole(error: CkptfixError) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert (copy.line(), copy.to_dict(), copy.exit_code) == (
        error.line(),
        error.to_dict(),
        error.exit_code,
    )
    assert str(copy) == str(error) and copy.args == error.args
    if isinstance(error, OSError):
        assert (copy.errno, copy.filename) == (error.errno, error.filename)  # type: ignore[attr-defined]


def test_a_task_refuses_a_checkpoint_changed_since_the_plan(tmp_path: Path) -> None:
    f = Factory(tmp_path)
    path = f.safetensors("m.safetensors", [Spec("a", "F32", (4, 4)), Spec("b")])
    with opened(path) as tensors:
        assert tensors.opened_as is not None
        names = sorted(tensors.tensors)
        keys = [layout_key(tensors.tensors[name]) for name in names]
        opened_as = tensors.opened_as
    assert len(hash_part(opened_as, names, keys, 1)) == 2
    f.safetensors("m.safetensors", [Spec("a", "F32", (2, 8)), Spec("b")])
    with pytest.raises(SourceChangedError) as raised:
        hash_part(opened_as, names, keys, 1)
    assert raised.value.line() == (
        f"error: {path}: tensor 'a' is no longer where it was planned: the checkpoint changed "
        "while it was read (rule source-changed; run again on a stable copy)"
    )
