"""Fixtures: a Factory writing into tmp_path, tmpfs mounts. The builders themselves live in
tests/builders.py and the CLI runner and readers in tests/helpers.py."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import pytest

from tests.builders import Factory
from tests.loop_mounts import loop_mount
from tests.optional import OPTIONAL, installed, reason

TESTS = Path(__file__).parent


@pytest.fixture
def factory(tmp_path: Path) -> Factory:
    return Factory(tmp_path)


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mount a tmpfs with the given options (read-only, tiny) under tmp_path; skips where
    mounting is not allowed."""
    mounted: list[Path] = []

    def make(options: str) -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield make
    for point in mounted:
        subprocess.run(["umount", str(point)], check=False)


@pytest.fixture(scope="module", params=["xfs", "btrfs"])
def filesystem(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """A fresh filesystem with reflinks, XFS then btrfs, loop-mounted for a test module
    (tests/loop_mounts.py; skips where this machine cannot)."""
    with loop_mount(request.param, tmp_path_factory.mktemp(request.param)) as point:
        yield point


os.environ.setdefault("NO_COLOR", "1")
# The machine is offline but for package registries: no test may reach the Hub (a lookup
# would only time out). Set before anything imports huggingface_hub, which reads it once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Iterator[None]:  # the generator form of a wrapper hook
    """A test (or fixture) whose own code imports an optional package that is not installed
    is skipped, the reason naming the package, instead of failing. Only an import written in
    tests/ counts: ckptfix importing a missing package is a bug the test must show."""
    report: pytest.TestReport = yield  # type: ignore[misc]
    missing = _missing_optional(call.excinfo)
    if report.failed and missing is not None:
        path, line = item.reportinfo()[:2]
        report.outcome = "skipped"
        report.longrepr = (os.fspath(path), (line or 0) + 1, f"Skipped: {reason([missing])}")
    return report  # type: ignore[return-value]


def _missing_optional(excinfo: pytest.ExceptionInfo[BaseException] | None) -> str | None:
    """The optional package (tests/optional.py) that `excinfo` failed to import in a file of
    tests/, if it is not installed."""
    error = None if excinfo is None else excinfo.value
    if not isinstance(error, ModuleNotFoundError) or error.name is None:
        return None
    top = error.name.partition(".")[0]
    wanted = [name for name in OPTIONAL if name.partition(".")[0] == top]
    if not wanted or installed(wanted[0]) or not _imported_in_tests(error.__traceback__):
        return None
    return wanted[0]


def _imported_in_tests(traceback: TracebackType | None) -> bool:
    """Whether the innermost frame outside the import machinery is in tests/."""
    files = []
    while traceback is not None:
        files.append(traceback.tb_frame.f_code.co_filename)
        traceback = traceback.tb_next
    own = [name for name in files if not name.startswith("<frozen ")]
    return bool(own) and Path(own[-1]).is_relative_to(TESTS)
