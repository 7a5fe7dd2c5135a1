"""Running the CLI in tests: exit code, stdout and stderr kept apart."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from ckptfix.cli.app import app


@dataclass(frozen=True)
class Run:
    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line]


def cli(*args: str | os.PathLike[str]) -> Run:
    result = CliRunner().invoke(
        app, [os.fspath(arg) for arg in args], catch_exceptions=False, prog_name="ckptfix"
    )
    return Run(result.exit_code, result.stdout, result.stderr)


def tree_snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes: for proving that nothing changed."""
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


@dataclass(frozen=True)
class Measured:
    code: int
    stdout: str
    stderr: str
    peak_rss: int  # bytes: the child's maximum resident set, mapped file pages included
    seconds: float

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line]


# VmHWM, not getrusage's ru_maxrss: that one keeps the parent's size across fork and exec.
_MEASURE = """
import os, sys
from ckptfix.cli.app import main
sys.argv = ["ckptfix", *sys.argv[2:]]
try:
    main()
finally:
    with open("/proc/self/status") as status:
        peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    with open(os.environ["CKPTFIX_RSS_REPORT"], "w") as report:
        report.write(str(int(peak) * 1024))
"""


def measured(*args: str | os.PathLike[str], timeout: float = 120) -> Measured:
    """Run the CLI in a fresh process; report its exit code, output, peak RSS and time. A
    run past `timeout` seconds fails the test (a hang is a bug)."""
    import subprocess
    import sys
    import tempfile
    import time

    with tempfile.NamedTemporaryFile("r", suffix=".rss") as report:
        env = {**os.environ, "CKPTFIX_RSS_REPORT": report.name}
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", _MEASURE, "ckptfix", *map(os.fspath, args)],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
        seconds = time.perf_counter() - start
        peak = int(report.read() or 0)
    return Measured(done.returncode, done.stdout, done.stderr, peak, seconds)


def read_weights(path: str | os.PathLike[str]) -> Any:
    """One weight file read into descriptors (a FileRead), by ckptfix's own readers."""
    from ckptfix.formats import read_file
    from ckptfix.io.source import LocalFile

    with LocalFile(os.fspath(path)) as source:
        return read_file(source)


def read_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype, shape, row-major bytes) of every tensor in a checkpoint file, or in
    the .safetensors/.bin files of a folder, as ckptfix reads them."""
    from ckptfix.io.gather import tensor_bytes
    from ckptfix.io.source import LocalFile

    files = (
        sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
        if path.is_dir()
        else [path]
    )
    found = {}
    for file in files:
        with LocalFile(str(file)) as source:
            for tensor in read_weights(file).tensors:
                found[tensor.name] = (tensor.dtype, tensor.shape, tensor_bytes(source, tensor))
    return found
