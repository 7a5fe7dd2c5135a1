"""Faults during `ckptfix fix`, as for the other write commands (tests/test_faults.py): a
signal at many points of `fix -o` and of `fix --in-place`. Afterwards the source is either
exactly as it was or completely repaired (with `-o`: always as it was, and OUT absent or
complete); never a mix of the two, never a half-written shard."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ckptfix
from ckptfix.plan.repair import ASIDE
from tests.builders import Factory, Spec, seeded_bytes
from tests.helpers import tensor_digests, tree_digests

MB = 2**20
TRIALS = 12
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _broken(root: Path) -> Path:
    """About 100 MB: two shards without "format" (each rewritten whole on this filesystem),
    an index with a stale total, and a stale single-file export beside them (taken out)."""
    factory = Factory(root)
    blob = seeded_bytes(8 * MB, "blob")
    weight_map = {}
    for number, shard in enumerate(SHARDS):
        specs = [
            Spec(f"layer.{number}.{t}", "U8", (8 * MB,), blob[t:] + blob[:t]) for t in range(6)
        ]
        factory.safetensors(f"src/{shard}", specs, with_format=False)
        weight_map |= {spec.name: shard for spec in specs}
    factory.index("src/model.safetensors.index.json", weight_map, 12345)
    factory.safetensors("src/model.safetensors", [Spec("layer.0.0", "U8", (16,))])
    factory.config("src")
    return root / "src"


def _repaired(folder: Path, expected: dict[str, str]) -> None:
    report = ckptfix.inspect(folder)
    assert report.exit_code("warning") == 0, report.findings
    assert tensor_digests(folder) == expected


def _run(args: list[str], delay: float, signum: int) -> tuple[int, str]:
    command = [sys.executable, "-m", "ckptfix", "fix", *args]
    with subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    ) as process:
        time.sleep(delay)
        process.send_signal(signum)
        _, stderr = process.communicate()
    return process.returncode, stderr


def _duration(args: list[str]) -> float:
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "ckptfix", "fix", *args], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    return time.perf_counter() - start


def _leftovers(root: Path) -> list[Path]:
    return list(root.glob(".ckptfix-*"))


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_signal_during_fix_to_out(tmp_path: Path, signum: int) -> None:
    source = _broken(tmp_path)
    expected = tensor_digests(source / SHARDS[0]) | tensor_digests(source / SHARDS[1])
    before = tree_digests(source)
    duration = _duration([str(source), "-o", str(tmp_path / "baseline")])
    outcomes = set()
    for trial in range(TRIALS):
        out = tmp_path / f"out{trial}"
        code, stderr = _run([str(source), "-o", str(out)], duration * 1.2 * trial / TRIALS, signum)
        assert "Traceback" not in stderr
        if out.exists():
            _repaired(out, expected)
            outcomes.add("complete")
        else:
            outcomes.add("absent")
        if signum == signal.SIGTERM:
            assert not _leftovers(tmp_path), (trial, code, stderr)
        for folder in _leftovers(tmp_path):  # nothing can clean up after SIGKILL
            shutil.rmtree(folder)
        assert tree_digests(source) == before
    assert "absent" in outcomes


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_signal_during_fix_in_place(tmp_path: Path, signum: int) -> None:
    pristine = _broken(tmp_path / "pristine")
    expected = tensor_digests(pristine / SHARDS[0]) | tensor_digests(pristine / SHARDS[1])
    before = tree_digests(pristine)
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(pristine, work / "model")
    duration = _duration([str(work / "model"), "--in-place"])
    outcomes = []
    for trial in range(TRIALS):
        folder = work / "model"
        shutil.rmtree(folder)
        shutil.copytree(pristine, folder)
        code, stderr = _run([str(folder), "--in-place"], duration * 1.2 * trial / TRIALS, signum)
        assert "Traceback" not in stderr
        if tree_digests(folder) == before:
            outcomes.append("as it was")
        else:  # repaired in full: shards with "format", the stale export aside
            _repaired(folder, expected)
            assert (folder / ASIDE / "model.safetensors").is_file()
            outcomes.append("repaired")
        if signum == signal.SIGTERM:
            assert not _leftovers(work), (trial, code, stderr)
        for leftover in _leftovers(work):  # SIGKILL: the staging folder, and a lock file
            if leftover.is_dir():
                shutil.rmtree(leftover)
            else:
                leftover.unlink()
    assert "as it was" in outcomes, outcomes
