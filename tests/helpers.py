"""Running ckptfix in tests and reading back what it wrote: the CLI in process or in a
fresh process, tensors as ckptfix or safetensors read them, digests and snapshots of files.

torch is imported inside the helpers that need it, never at import time."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer.main
from typer.testing import CliRunner

from ckptfix.cli.app import app

if TYPE_CHECKING:
    import torch


class MemorySource:
    """An in-memory byte source: what io.gather reads pieces from by `read_at` (one read,
    then a strided copy), where a local file's runs are read straight into place."""

    def __init__(self, data: bytes, label: str = "chunks") -> None:
        self.data, self.label = data, label
        self.size = len(data)

    def read_at(self, offset: int, size: int) -> bytes:
        return self.data[offset : offset + size]

    def change_token(self) -> tuple[object, ...]:
        return (self.size,)

    def fileno(self) -> None:
        return None


@dataclass(frozen=True)
class Run:
    """One CLI run: its exit code, and stdout and stderr kept apart."""

    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line]


# The click command typer builds from `app`, built once: `CliRunner.invoke` rebuilds it from
# every command's annotations at each call (~20 ms, most of a typical test's time).
_command = functools.cache(functools.partial(typer.main.get_command, app))


def cli(*args: str | os.PathLike[str]) -> Run:
    """`ckptfix ARGS` in this process, its output captured as `CliRunner.invoke` captures
    it; an exception escaping the CLI fails the test."""
    code: object = 0
    with CliRunner().isolation() as (stdout, stderr, _):
        try:
            _command().main([os.fspath(arg) for arg in args], prog_name="ckptfix")
        except SystemExit as exc:
            code = exc.code
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            out, err = (_text(stream.getvalue()) for stream in (stdout, stderr))
    assert isinstance(code, int), code  # the CLI always exits with a number (cli/exits.py)
    return Run(code, out, err)


def _text(output: bytes) -> str:
    return output.decode("utf-8", "replace").replace("\r\n", "\n")


def local_fixes(document: Any, local: str | os.PathLike[str]) -> Any:
    """A report of a URL with each finding's `fix` as the report of its local copy at
    `local` says it: fix repairs a local copy, so for a URL it names none."""
    command = f"ckptfix fix {os.fspath(local)} -o OUT (or --in-place)"
    for item in document["findings"]:
        remote = "ckptfix fix on a local copy (-o OUT or --in-place)"
        assert item["fix"].startswith(("none: ", "ckptfix ")), item
        item["fix"] = item["fix"].replace(remote, command)
    return document


def retried_inspect(url: str, failures: int, env: Any) -> Run:
    """`inspect --json URL` with CKPTFIX_REMOTE_RETRIES 3 (`env`: a pytest MonkeyPatch),
    while the server fails `failures` requests first: it must succeed and count them."""
    env.setenv("CKPTFIX_REMOTE_RETRIES", "3")
    env.setenv("CKPTFIX_REMOTE_BACKOFF", "0.01")
    run = cli("inspect", url, "--json")
    assert run.code == 0, run.stderr
    assert run.json()["remote"]["retries"] == failures
    return run


def one_error_line(*args: str | os.PathLike[str]) -> str:
    """The error line of a command that must fail with exit 1 and print exactly one."""
    run = cli(*args)
    assert run.code == 1, (run.code, run.stderr)
    [line] = run.error_lines
    return line


# Root without the capabilities that let it read, write or chmod any file: to the command,
# files root owns behave as any user's own files (a mode-000 file is unreadable, a read-only
# folder cannot be written into), and files owned by another uid as another user's.
_NOT_ROOT = "-dac_override,-dac_read_search,-fowner"


def as_another_user(*args: str | os.PathLike[str]) -> Run:
    """`ckptfix ARGS` in a fresh process without root's file capabilities (above); skips
    where that cannot be arranged. Needed because the tests run as root here, and a non-root
    uid cannot even start the shared virtualenv's interpreter (under /root)."""
    return python_as_another_user("-m", "ckptfix", *args)


def python_as_another_user(*args: str | os.PathLike[str]) -> Run:
    """`python ARGS` (this interpreter) as `as_another_user` runs ckptfix."""
    import shutil
    import subprocess
    import sys

    import pytest

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv, to run ckptfix without root's file capabilities")
    done = subprocess.run(
        [
            *("setpriv", f"--inh-caps={_NOT_ROOT}", f"--bounding-set={_NOT_ROOT}", "--"),
            *(sys.executable, *map(os.fspath, args)),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    return Run(done.returncode, done.stdout, done.stderr)


def with_locked_folder(locked: Path, *args: str | os.PathLike[str]) -> Run:
    """`ckptfix ARGS` as another user while `locked` may not be listed (mode 0), restored
    after."""
    locked.chmod(0)
    try:
        return as_another_user(*args)
    finally:
        locked.chmod(0o755)


def give_away(root: Path, uid: int = 65534) -> None:
    """Make `root` and everything under it (links themselves, not their targets) another
    user's: for `as_another_user`, they are then not its own."""
    for folder, subfolders, files in os.walk(root):
        for name in [*subfolders, *files]:
            os.chown(os.path.join(folder, name), uid, uid, follow_symlinks=False)
    os.chown(root, uid, uid, follow_symlinks=False)


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
    cpu: float = 0.0  # the child's CPU seconds (user + system): less sensitive to other load

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line]


# VmHWM, not getrusage's ru_maxrss: that one keeps the parent's size across fork and exec.
_MEASURE = """
import os, sys
from ckptfix.cli.{module} import main
sys.argv = ["ckptfix", *sys.argv[2:]]
try:
    main()
finally:
    with open("/proc/self/status") as status:
        peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    times = os.times()
    with open(os.environ["CKPTFIX_RSS_REPORT"], "w") as report:
        report.write(f"{{int(peak) * 1024}} {{times.user + times.system}}")
"""


def limit_open_files(count: int) -> Callable[[], None]:
    """A preexec_fn: soft and hard RLIMIT_NOFILE both `count`, so nothing can raise it."""

    def limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (count, count))

    return limit


def measured(
    *args: str | os.PathLike[str],
    timeout: float = 120,
    open_files: int | None = None,
    console: bool = False,
) -> Measured:
    """Run the CLI in a fresh process; report its exit code, output, peak RSS, time and CPU
    time. A run past `timeout` seconds fails the test (a hang is a bug). `open_files`: run
    it with at most that many descriptors. `console`: as the console script runs it
    (cli.entry: signal handlers, the collector's freezing), not the bare app."""
    import subprocess
    import sys
    import tempfile
    import time

    with tempfile.NamedTemporaryFile("r", suffix=".rss") as report:
        env = {**os.environ, "CKPTFIX_RSS_REPORT": report.name}
        start = time.perf_counter()
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                _MEASURE.format(module="entry" if console else "app"),
                "ckptfix",
                *map(os.fspath, args),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
            preexec_fn=None if open_files is None else limit_open_files(open_files),
        )
        seconds = time.perf_counter() - start
        peak, cpu = (report.read() or "0 0").split()
    return Measured(done.returncode, done.stdout, done.stderr, int(peak), seconds, float(cpu))


def fail_nth(monkeypatch: Any, owner: object, name: str, nth: int, error: int) -> None:
    """Make the `nth` call of `owner.name` (a module's function, or the platform's
    primitive: `system()`) fail with OSError `error`; the others run as they did."""
    real = getattr(owner, name)
    calls = 0

    def failing(*args: object) -> object:
        nonlocal calls
        calls += 1
        if calls == nth:
            raise OSError(error, os.strerror(error))
        return real(*args)

    monkeypatch.setattr(owner, name, failing)


def read_weights(path: str | os.PathLike[str]) -> Any:
    """One weight file read into descriptors (a FileRead), by ckptfix's own readers."""
    from ckptfix.formats import read_file
    from ckptfix.io.source import LocalFile

    with LocalFile(os.fspath(path)) as source:
        return read_file(source)


def read_tensors(
    path: Path, suffixes: tuple[str, ...] = (".safetensors", ".bin")
) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype, shape, row-major bytes) of every tensor in a checkpoint file, or in
    the files of a folder with one of `suffixes`, as ckptfix reads them. A name stored
    twice fails: it would hide one of the tensors."""
    from ckptfix.io.gather import tensor_bytes
    from ckptfix.io.source import LocalFile

    files = sorted(p for p in path.iterdir() if p.suffix in suffixes) if path.is_dir() else [path]
    found: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for file in files:
        with LocalFile(str(file)) as source:
            for tensor in read_weights(file).tensors:
                assert tensor.name not in found, (tensor.name, file)
                found[tensor.name] = (tensor.dtype, tensor.shape, tensor_bytes(source, tensor))
    return found


def tensor_digests(path: Path) -> dict[str, str]:
    """name -> digest of the row-major bytes, for any checkpoint file or folder: for large
    checkpoints, where keeping every tensor's bytes would cost too much memory."""
    return {
        name: hashlib.blake2b(data).hexdigest() for name, (_, _, data) in read_tensors(path).items()
    }


def tree_digests(root: Path) -> dict[str, str]:
    """Every file under root with a digest of its bytes: tree_snapshot for large trees."""
    return {
        str(p.relative_to(root)): hashlib.blake2b(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def tensor_names(folder: Path) -> list[str]:
    """The tensor names of a folder's safetensors files, in file order and header order:
    the order a rewrite must keep."""
    from ckptfix.formats.safetensors import read_header

    return [
        t.name for file in sorted(folder.glob("*.safetensors")) for t in read_header(file).tensors
    ]


def torch_bytes(tensor: torch.Tensor) -> bytes:
    """A torch tensor's elements as row-major bytes: what a checkpoint must store for it."""
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The same names, and for each the same dtype, shape and row-major bytes."""
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch_bytes(got[name]) == torch_bytes(tensor), name


def load_safetensors_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files, read by safetensors itself (the
    consumer's view, independent of ckptfix's readers)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def flat(text: str) -> str:
    """Human output with rich's line wrapping undone."""
    return " ".join(text.split())


SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
UPDATE_SNAPSHOTS = "CKPTFIX_UPDATE_SNAPSHOTS"


def assert_snapshot(name: str, actual: str, folder: Path = SNAPSHOTS) -> None:
    """`actual` must equal the stored snapshot `folder/name` byte for byte; a difference
    fails with a diff. With CKPTFIX_UPDATE_SNAPSHOTS=1 the snapshot is (re)written
    instead: review `git diff tests/snapshots` before committing it."""
    import difflib

    path = folder / name
    data = actual.encode("utf-8")
    if os.environ.get(UPDATE_SNAPSHOTS) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    assert path.exists(), f"no snapshot {path} yet: run with {UPDATE_SNAPSHOTS}=1 to write it"
    expected = path.read_bytes()
    if data != expected:
        diff = difflib.unified_diff(
            expected.decode("utf-8", "replace").splitlines(keepends=True),
            actual.splitlines(keepends=True),
            f"{path} (stored)",
            "actual output",
        )
        raise AssertionError(
            f"output differs from {path} (if the change is intended, rerun with "
            f"{UPDATE_SNAPSHOTS}=1 and commit the new snapshot):\n{''.join(diff)}"
        )


def loads_with_same_logits(model_class: Any, folder: Path, model: Any) -> Any:
    """`model_class.from_pretrained(folder)`, which must find every weight it expects and
    give `model`'s logits exactly; the loaded model."""
    import torch

    loaded, info = model_class.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(loaded.eval()(tokens).logits, model(tokens).logits)
    return loaded
