"""Faults during reshard: signals at many points, a full disk, failing fsync, a changing
source. Afterwards OUT is absent or complete and valid, SRC is byte-identical, and after
a clean failure no staging folder is left."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ckptfix
from ckptfix import writer
from ckptfix.errors import WriteError
from ckptfix.formats.safetensors import read_header
from ckptfix.rewrite import reshard
from tests.conftest import Factory, Spec, seeded_bytes

MB = 2**20


def tensor_digests(path: Path) -> dict[str, str]:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    digests = {}
    for file in files:
        with open(file, "rb") as handle:
            for tensor in read_header(file).tensors:
                handle.seek(tensor.byte_range[0])
                digests[tensor.name] = hashlib.blake2b(handle.read(tensor.nbytes)).hexdigest()
    return digests


def file_digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.blake2b(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def big_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 160 MB in 2 shards: long enough to be interrupted at many points."""
    factory = Factory(tmp_path_factory.mktemp("faults"))
    blob = seeded_bytes(8 * MB, "blob")
    shards = [
        [Spec(f"layer.{s}.{t}", "U8", (8 * MB,), blob[t:] + blob[:t]) for t in range(10)]
        for s in range(2)
    ]
    folder = factory.sharded("src", shards)
    factory.config("src")
    return folder


def _run(source: Path, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ckptfix",
            "reshard",
            str(source),
            "-o",
            str(out),
            "--max-shard",
            "30MB",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _check_after(out: Path, expected: dict[str, str]) -> str:
    """'absent' or 'complete'; fails on anything in between."""
    if not out.exists():
        return "absent"
    report = ckptfix.inspect(out)
    assert report.findings == (), report.findings
    assert tensor_digests(out) == expected
    return "complete"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_signal_at_many_points(big_source: Path, tmp_path: Path, signum: int) -> None:
    expected = tensor_digests(big_source)
    source_before = file_digests(big_source)
    start = time.perf_counter()
    baseline = _run(big_source, tmp_path / "baseline")
    assert baseline.wait() == 0
    duration = time.perf_counter() - start
    outcomes = []
    for trial, fraction in enumerate([0.05, 0.2, 0.35, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.3]):
        out = tmp_path / f"out{trial}"
        process = _run(big_source, out)
        time.sleep(duration * fraction)
        process.send_signal(signum)
        code = process.wait()
        stderr = process.stderr.read().decode() if process.stderr else ""
        assert "Traceback" not in stderr
        outcome = _check_after(out, expected)
        outcomes.append(outcome)
        staging = list(tmp_path.glob(".ckptfix-*"))
        if signum == signal.SIGTERM:
            assert not staging, (trial, code, stderr)
            if code == 143:
                assert stderr.strip().endswith(
                    "interrupted by SIGTERM; the output was left as it was"
                )
                assert outcome == "absent"
        for folder in staging:  # SIGKILL cannot be cleaned up after; the next run may
            shutil.rmtree(folder)
    assert file_digests(big_source) == source_before
    assert "absent" in outcomes  # the early signals landed before the commit


def test_injected_enospc(big_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    real = os.copy_file_range

    def failing(*args: int) -> int:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", failing)
    out = tmp_path / "out"
    with pytest.raises(WriteError) as caught:
        reshard(big_source, out, max_shard=30 * 10**6)
    assert caught.value.line() == (
        f"error: {out}: no space left on device; nothing was written "
        "(free some space or choose another -o folder)"
    )
    assert not out.exists()
    assert not list(tmp_path.glob(".ckptfix-*"))


def test_fsync_failure_is_fatal(
    big_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    out = tmp_path / "out"
    with pytest.raises(WriteError, match="write failed: Input/output error"):
        reshard(big_source, out, max_shard=30 * 10**6)
    assert not out.exists()
    assert not list(tmp_path.glob(".ckptfix-*"))


def test_source_changing_during_the_run(factory: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = factory.sharded("m", [[Spec("a", "U8", (4096,))], [Spec("b", "U8", (4096,))]])
    victim = folder / "model-00002-of-00002.safetensors"
    real = writer.copy_range

    def copy_then_touch(*args: object, **kwargs: object) -> None:
        real(*args, **kwargs)  # type: ignore[arg-type]
        with open(victim, "ab") as handle:
            handle.write(b"x")

    monkeypatch.setattr(writer, "copy_range", copy_then_touch)
    out = factory.root / "out"
    with pytest.raises(WriteError, match="a source file changed while it was being read"):
        reshard(folder, out, max_shard=10**6)
    assert not out.exists()
    assert not list(factory.root.glob(".ckptfix-*"))


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Path:
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_full_disk_is_refused_up_front(factory: Factory, tiny_disk: Path) -> None:
    folder = factory.sharded("m", [[Spec("a", "U8", (3 * MB,))]])
    out = tiny_disk / "out"
    run = subprocess.run(
        [sys.executable, "-m", "ckptfix", "reshard", str(folder), "-o", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 1
    assert run.stderr.startswith(f"error: {out}: not enough free space: the output needs 3.15 MB")
    assert list(tiny_disk.iterdir()) == []


def test_real_enospc_mid_write(
    factory: Factory, tiny_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix import rewrite

    monkeypatch.setattr(rewrite, "check_free_space", lambda *args: None)  # let it hit the wall
    folder = factory.sharded("m", [[Spec("a", "U8", (MB,))], [Spec("b", "U8", (3 * MB,))]])
    out = tiny_disk / "out"
    with pytest.raises(WriteError, match="no space left on device"):
        reshard(folder, out, max_shard=2 * 10**6)
    assert list(tiny_disk.iterdir()) == []
