"""Fixtures: a Factory writing into tmp_path, tmpfs mounts. The builders themselves live in
tests/builders.py and the CLI runner and readers in tests/helpers.py.

`--platform portable` (or CKPTFIX_TEST_PLATFORM=portable) runs the tests on ckptfix's
portable primitives (ckptfix.platform.portable: no pread, O_NOFOLLOW, dir_fd, renameat2,
copy_file_range, flock; the fallbacks Windows and other systems build on) instead of the
system's own, in this process and in those the tests start (tests/platform_site). `make
test` runs the fast suite a second time so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import pytest

from tests.builders import Factory
from tests.loop_mounts import loop_mount
from tests.optional import OPTIONAL, installed, reason

TESTS = Path(__file__).parent

_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "platform_site")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--platform",
        choices=("native", "portable"),
        default=os.environ.get("CKPTFIX_TEST_PLATFORM", "native"),
        help="run on the system's own primitives (native) or ckptfix's portable ones",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Switch the platform before any test runs (each xdist worker does too). A suite
    started in the background of a shell without job control inherits SIGINT ignored, and
    so would every ckptfix the tests start (an ignored signal stays ignored): Ctrl-C tests
    would then see a run that cannot be interrupted. The tests' processes get it back."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # xdist's own mark, added by _frameworks_on_one_worker: known to --strict-markers in a
    # run without xdist too (`-p no:xdist`)
    config.addinivalue_line("markers", "xdist_group(name): tests xdist runs on one worker")
    from ckptfix.platform import _use_for_tests

    name = config.getoption("--platform")
    _use_for_tests(name)
    if name == "portable":
        os.environ["CKPTFIX_TEST_PLATFORM"] = "portable"
        path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = _SITE + (os.pathsep + path if path else "")


def pytest_report_header(config: pytest.Config) -> str:
    from ckptfix.platform import system

    return f"ckptfix platform: {system().name} (--platform {config.getoption('--platform')})"


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects
@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups it adds
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test run against each remote backend runs against one of them in the fast suite, a
    different one for each test in turn (make test: all); the tests of checkpoints the
    frameworks write run on one worker; tests of one system's own primitives (marked
    `native`) skip in the portable mode."""
    _one_backend_each_in_the_fast_run(items)
    _frameworks_on_one_worker(items)
    if config.getoption("--platform") != "portable":
        return
    skip = pytest.mark.skip(reason="tests the system's own primitives; --platform portable")
    for item in items:
        if item.get_closest_marker("native") is not None:
            item.add_marker(skip)


def _one_backend_each_in_the_fast_run(items: list[pytest.Item]) -> None:
    from tests.remote_servers import BACKENDS

    for item in items:
        backend = getattr(item, "callspec", None) and item.callspec.params.get("served")
        if backend not in BACKENDS or item.get_closest_marker("slow") is not None:
            continue
        turn = zlib.crc32(getattr(item, "originalname", item.name).encode())
        if backend != BACKENDS[turn % len(BACKENDS)]:
            item.add_marker(pytest.mark.slow)


# Session fixtures that run a framework (DeepSpeed, accelerate, the Trainer, Lightning,
# megatron-core) for up to minutes of CPU each: written once per worker process, so their
# tests share one worker (`--dist loadgroup`) instead of each worker writing them again
# (the same checkpoints were written twice, some 4 minutes of CPU, measured with --durations).
_FRAMEWORK_FIXTURES = frozenset(
    {
        "dcp_saved",
        "zero_saved",
        "universal_saved",
        "hf_writer_saved",
        "accelerate_saved",
        "trainer_saved",
        "lightning_saved",
        "megatron_saved",
    }
)


def _frameworks_on_one_worker(items: list[pytest.Item]) -> None:
    for item in items:
        uses = _FRAMEWORK_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if uses and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group("frameworks"))


@pytest.fixture(params=["native", "portable"])
def each_platform(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run the test on the system's own primitives, then on the portable ones (whatever
    --platform says): for what must hold on both in every run of the suite."""
    import ckptfix.platform

    monkeypatch.setattr(ckptfix.platform, "_chosen", ckptfix.platform._choose(sys.platform))
    if request.param == "portable":
        monkeypatch.setattr(ckptfix.platform, "_chosen", ckptfix.platform.Platform())
    yield request.param


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
