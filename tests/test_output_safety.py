"""The output side of a write under hostile conditions: other writers racing for OUT,
--force and --in-place next to user files, symlinks and special files in a model folder,
signals after the commit and during start-up, read-only mounts. Every test builds the
situation and checks the promise: one error line and nothing lost, or a complete output."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptfix import staging
from ckptfix.catalog import TensorInfo
from ckptfix.formats.safetensors import read_header
from ckptfix.transform import select
from tests.conftest import Factory, Spec
from tests.helpers import cli

COMMANDS = ["reshard", "convert", "dedupe"]


@pytest.fixture
def model(factory: Factory) -> Path:
    folder = factory.sharded("m", [[Spec("a")], [Spec("b")]])
    factory.config("m")
    return folder


def names(folder: Path) -> list[str]:
    return sorted(entry.name for entry in folder.iterdir())


def tensor_names(folder: Path) -> list[str]:
    return [
        t.name for file in sorted(folder.glob("*.safetensors")) for t in read_header(file).tensors
    ]


def leftovers(*folders: Path) -> list[Path]:
    return [path for folder in folders for path in folder.glob(".ckptfix-*")]


def flat(text: str) -> str:
    """Human output with rich's line wrapping undone."""
    return " ".join(text.split())


def before_commit(monkeypatch: pytest.MonkeyPatch, action: Callable[[], object]) -> None:
    """Run `action` once, just before the first staging folder is swapped in."""
    real = staging.Staging.commit
    done = False

    def commit(self: staging.Staging) -> None:
        nonlocal done
        if not done:
            done = True
            action()
        real(self)

    monkeypatch.setattr(staging.Staging, "commit", commit)


# Races and replacement --------------------------------------------------------------------


def _user_entries_named_like_staging(folder: Path) -> None:
    (folder / ".ckptfix-notes").mkdir()
    (folder / ".ckptfix-notes" / "todo.txt").write_text("todo")
    (folder / ".ckptfix-plan.txt").write_text("plan")


# Symlinks and special files ---------------------------------------------------------------


def _no_file_holds(root: Path, data: bytes) -> bool:
    for folder, _, files in os.walk(root):  # never follows links
        for name in files:
            path = Path(folder) / name
            if not path.is_symlink() and path.read_bytes() == data:
                return False
    return True


def _special_files(model: Path, monkeypatch: pytest.MonkeyPatch) -> socket.socket:
    os.mkfifo(model / "pipe")
    (model / "sub").mkdir()
    (model / "sub" / "ok.txt").write_text("ok")
    os.mkfifo(model / "sub" / "pipe2")
    monkeypatch.chdir(model)  # a socket path must be short
    listener = socket.socket(socket.AF_UNIX)
    listener.bind("sock")
    return listener


# Signals -----------------------------------------------------------------------------------

_SIGNAL_WHILE_RENDERING = """
import os, runpy, signal, sys
import ckptfix.cli.render as render
real = render.rewrite
def rewrite(result):
    os.kill(os.getpid(), signal.{name})
    real(result)
render.rewrite = rewrite
sys.argv = ["ckptfix", *sys.argv[1:]]
runpy.run_module("ckptfix", run_name="__main__", alter_sys=True)
"""


def test_a_failed_comparison_keeps_its_own_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numpy views of the maps are alive in the traceback; closing must not raise BufferError."""
    import numpy as np

    from ckptfix.writer import ranges_equal

    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)) * 64)

    def interrupted(*args: object) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "array_equal", interrupted)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(KeyboardInterrupt):
            ranges_equal(fd, 0, fd, 0, 8192)
    finally:
        os.close(fd)


# Smaller ones -------------------------------------------------------------------------------


def test_no_verify_does_not_claim_verification(model: Path, tmp_path: Path) -> None:
    run = cli("convert", model, "-o", tmp_path / "out", "--no-verify")
    assert run.code == 0, run.stderr
    assert "not verified (--no-verify)" in flat(run.stdout)
    assert "verified against its source" not in run.stdout
    run = cli("convert", model, "-o", tmp_path / "verified")
    assert "every tensor verified against its source" in flat(run.stdout)


def _tensors(count: int) -> list[TensorInfo]:
    return [
        TensorInfo(f"layer.{i}.weight", "F32", (1,), 4, "f", (4 * i, 4 * i + 4))
        for i in range(count)
    ]


def test_exclude_is_linear() -> None:
    tensors = _tensors(20_000)
    exclude = [t.name for t in tensors]
    start = time.perf_counter()
    selection = select(tensors, exclude=exclude)
    elapsed = time.perf_counter() - start
    assert selection.tensors == () and len(selection.excluded) == 20_000
    assert elapsed < 5, elapsed  # about 0.05 s; the quadratic version took minutes


def test_exclude_globs_match_like_fnmatch() -> None:
    import fnmatch

    tensors = _tensors(300)
    globs = ["layer.1*.weight", "layer.?.weight", "layer.2[05].weight", "layer.299.weight", "a[b"]
    expected = [t.name for t in tensors if any(fnmatch.fnmatchcase(t.name, g) for g in globs)]
    assert list(select(tensors, exclude=globs).excluded) == expected
