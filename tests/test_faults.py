"""Faults during every write command: signals at many points, a full disk, a read-only
output folder, failing fsync, a source that changes. Afterwards OUT is absent or complete
and valid, SRC is byte-identical, and after a clean failure no staging folder is left."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import ckptfix
from ckptfix.core.errors import WriteError
from ckptfix.ops.rewrite import (
    ConvertOptions,
    DedupeOptions,
    ReshardOptions,
    convert,
    dedupe,
    reshard,
)
from ckptfix.platform import system
from ckptfix.write import copy as writer
from tests.builders import Factory, Spec, seeded_bytes
from tests.helpers import fail_nth, tensor_digests, tree_digests

MB = 2**20
COMMANDS = ["reshard", "convert", "dedupe"]
TRIALS = 20


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """About 100 MB each: a safetensors folder (reshard) and a torch .bin with views and a
    transposed tensor (convert, dedupe), long enough to be interrupted at many points."""
    import torch

    factory = Factory(tmp_path_factory.mktemp("faults"))
    blob = seeded_bytes(8 * MB, "blob")
    shards = [
        [Spec(f"layer.{s}.{t}", "U8", (8 * MB,), blob[t:] + blob[:t]) for t in range(6)]
        for s in range(2)
    ]
    folder = factory.sharded("src", shards)
    factory.config("src")
    generator = torch.Generator().manual_seed(0)
    fused = torch.randn(6 * 1024, 1024, generator=generator)  # 24 MB, sliced into views
    state = {f"w{i}": torch.randn(1024, 1024, generator=generator) for i in range(12)}
    state.update(
        q=fused[:2048], k=fused[2048:4096], v=fused[4096:], t=state["w0"].t(), tied=state["w1"]
    )
    binary = factory.root / "torch" / "pytorch_model.bin"
    binary.parent.mkdir()
    torch.save(state, binary)
    return {"reshard": folder, "convert": binary.parent, "dedupe": binary.parent}


def _command(command: str, source: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ckptfix",
        command,
        str(source),
        "-o",
        str(out),
        "--max-shard",
        "30MB",
    ]


def _check_after(out: Path, expected: dict[str, str], dropped_ok: bool) -> str:
    """'absent' or 'complete'; fails on anything in between."""
    if not out.exists():
        return "absent"
    report = ckptfix.inspect(out)
    assert not [f for f in report.findings if f.severity.value != "info"], report.findings
    got = tensor_digests(out)
    if dropped_ok:  # aliases are written once
        assert set(got) <= set(expected) and all(got[k] == expected[k] for k in got)
    else:
        assert got == expected
    return "complete"


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("command", COMMANDS)
def test_signal_at_many_points(
    sources: dict[str, Path], tmp_path: Path, command: str, signum: int
) -> None:
    source = sources[command]
    expected = tensor_digests(source)
    source_before = tree_digests(source)
    start = time.perf_counter()
    assert (
        subprocess.run(
            _command(command, source, tmp_path / "baseline"), capture_output=True, check=False
        ).returncode
        == 0
    )
    duration = time.perf_counter() - start
    outcomes = []
    for trial in range(TRIALS):
        out = tmp_path / f"out{trial}"
        with subprocess.Popen(
            _command(command, source, out),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        ) as process:
            time.sleep(duration * (0.02 + 1.2 * trial / TRIALS))
            process.send_signal(signum)
            _, stderr = process.communicate()
            code = process.returncode
        assert "Traceback" not in stderr
        outcome = _check_after(out, expected, dropped_ok=command != "reshard")
        outcomes.append(outcome)
        staging = list(tmp_path.glob(".ckptfix-*"))
        if signum == signal.SIGTERM:
            assert not staging, (trial, code, stderr)
            if code == 143:  # before OUT was claimed, there is no output to name
                assert stderr.splitlines()[-1] in (
                    f"error: {out}: interrupted by SIGTERM; the output was left as it was (rule interrupted)",
                    "error: interrupted by SIGTERM (rule interrupted)",
                ), stderr
                assert outcome == "absent"
        for folder in staging:  # nothing can clean up after SIGKILL; a later run may
            shutil.rmtree(folder)
        shutil.rmtree(out, ignore_errors=True)
    assert tree_digests(source) == source_before
    assert "absent" in outcomes  # the early signals landed before the commit


RUNNERS: dict[str, Callable[[Path, Path, int], object]] = {
    "reshard": lambda src, out, limit: reshard(src, out, ReshardOptions(limit)),
    "convert": lambda src, out, limit: convert(src, out, ConvertOptions(limit)),
    "dedupe": lambda src, out, limit: dedupe(src, out, DedupeOptions(limit)),
}


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_injected_enospc(
    sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    # the third kernel copy (in the portable mode: the third chance of one)
    fail_nth(monkeypatch, system(), "copy_range", 3, errno.ENOSPC)
    out = tmp_path / "out"
    with pytest.raises(WriteError) as caught:
        RUNNERS[command](sources[command], out, 30 * 10**6)
    assert caught.value.line() == (
        f"error: {out}: no space left on device; nothing was written "
        "(rule write-failed; free some space or choose another -o folder)"
    )
    assert not out.exists()
    assert not list(tmp_path.glob(".ckptfix-*"))


@pytest.mark.parametrize(
    "command", [COMMANDS[0], *(pytest.param(c, marks=pytest.mark.slow) for c in COMMANDS[1:])]
)
def test_fsync_failure_is_fatal(
    sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    fail_nth(monkeypatch, os, "fsync", 1, errno.EIO)
    out = tmp_path / "out"
    with pytest.raises(WriteError, match="write failed: Input/output error"):
        RUNNERS[command](sources[command], out, 30 * 10**6)
    assert not out.exists()
    assert not list(tmp_path.glob(".ckptfix-*"))


@pytest.mark.parametrize("command", COMMANDS)
def test_source_changing_during_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    factory = Factory(tmp_path)
    if command == "reshard":
        folder = factory.sharded("m", [[Spec("a", "U8", (4096,))], [Spec("b", "U8", (4096,))]])
        victim = folder / "model-00002-of-00002.safetensors"
        source = folder
    else:
        import torch

        source = tmp_path / "m.bin"
        torch.save({"a": torch.ones(64), "b": torch.zeros(64)}, source)
        victim = source
    real = writer.copy_range

    def copy_then_grow(*args: object, **kwargs: object) -> None:
        real(*args, **kwargs)  # type: ignore[arg-type]
        with open(victim, "ab") as handle:
            handle.write(b"x")

    monkeypatch.setattr(writer, "copy_range", copy_then_grow)
    out = tmp_path / "out"
    with pytest.raises(WriteError, match="a source file changed while it was being read"):
        RUNNERS[command](source, out, 10**6)
    assert not out.exists()
    assert not list(tmp_path.glob(".ckptfix-*"))


@pytest.mark.slow
@pytest.mark.native  # refused up front by statvfs's ST_RDONLY (elsewhere: by the first write)
@pytest.mark.parametrize("command", COMMANDS)
def test_read_only_output_folder(
    sources: dict[str, Path], mount: Callable[[str], Path], command: str
) -> None:
    read_only = mount("ro,size=1m")
    out = read_only / "out"
    run = subprocess.run(
        _command(command, sources[command], out), capture_output=True, text=True, check=False
    )
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        f"error: {out}: cannot write: Read-only file system (rule write-failed; check the folder's permissions)"
    ]
    assert list(read_only.iterdir()) == []


@pytest.mark.slow
def test_full_disk_is_refused_up_front(factory: Factory, mount: Callable[[str], Path]) -> None:
    tiny = mount("size=2m")
    folder = factory.sharded("m", [[Spec("a", "U8", (3 * MB,))]])
    out = tiny / "out"
    run = subprocess.run(
        [sys.executable, "-m", "ckptfix", "reshard", str(folder), "-o", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 1
    assert run.stderr.startswith(f"error: {out}: not enough free space: the output needs 3.15 MB")
    assert list(tiny.iterdir()) == []


@pytest.mark.parametrize("command", COMMANDS)
def test_real_enospc_mid_write(
    tmp_path: Path, mount: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    from ckptfix.ops import rewrite

    monkeypatch.setattr(rewrite, "check_free_space", lambda *args: None)  # hit the wall
    tiny = mount("size=2m")
    factory = Factory(tmp_path)
    if command == "reshard":
        source = factory.sharded("m", [[Spec("a", "U8", (MB,))], [Spec("b", "U8", (3 * MB,))]])
    else:
        import torch

        source = tmp_path / "m.bin"
        torch.save({"a": torch.ones(MB // 4), "t": torch.ones(1024, 768).t()}, source)
    out = tiny / "out"
    with pytest.raises(WriteError, match="no space left on device"):
        RUNNERS[command](source, out, 2 * 10**6)
    assert list(tiny.iterdir()) == []


def test_signal_held_during_the_swap_does_not_undo_it(
    sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM arriving while the swap holds signals is delivered right after it; by then the
    output is complete, and the command finishes normally instead of claiming otherwise."""
    from ckptfix.write import staging

    real_swap = staging.Staging._swap

    def swap_then_signal(self: staging.Staging) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # held back until the swap is over
        real_swap(self)

    monkeypatch.setattr(staging.Staging, "_swap", swap_then_signal)
    out = tmp_path / "out"
    result = reshard(sources["reshard"], out, ReshardOptions(30 * 10**6))
    assert result.written is not None
    assert ckptfix.inspect(out).findings == ()


def test_ctrl_c_mid_write(
    sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.core.errors import Interrupted

    real = writer.copy_range
    calls = 0

    def copy_then_ctrl_c(*args: object, **kwargs: object) -> None:
        nonlocal calls
        real(*args, **kwargs)  # type: ignore[arg-type]
        calls += 1
        if calls == 2:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(writer, "copy_range", copy_then_ctrl_c)
    # As at an interactive shell (CI may run tests with SIGINT ignored, which ckptfix keeps).
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    out = tmp_path / "out"
    try:
        with pytest.raises(Interrupted) as caught:
            reshard(sources["reshard"], out, ReshardOptions(30 * 10**6))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, outer)
    assert caught.value.exit_code == 130
    assert caught.value.line() == (
        f"error: {out}: interrupted by SIGINT; the output was left as it was (rule interrupted)"
    )
    assert not out.exists()
    assert not list(tmp_path.glob(".ckptfix-*"))


def test_an_ignored_signal_stays_ignored(sources: dict[str, Path], tmp_path: Path) -> None:
    outer = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        reshard(sources["reshard"], tmp_path / "out", ReshardOptions(30 * 10**6))
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, outer)
