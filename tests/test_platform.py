"""ckptfix.platform: nothing else in ckptfix asks which system it runs on; the choice cannot
be changed from outside; the portable primitives keep their promises (reads at offsets from
many threads, opens that never follow a link, folders that are the ones opened, the lock
file, renames that replace nothing)."""

from __future__ import annotations

import ast
import errno
import os
import random
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import ckptfix.platform
from ckptfix.core.errors import Interrupted
from ckptfix.core.signals import Signals, restore
from ckptfix.platform.common import NotARegularFile
from ckptfix.platform.folders import FdFolder, PathFolder
from ckptfix.platform.locks import MAGIC, LockFile, NotOurLockFile, lock_file_path
from ckptfix.platform.portable import Platform
from ckptfix.platform.posix import Posix
from tests.helpers import python_as_another_user

PACKAGE = Path(ckptfix.platform.__file__).resolve().parent.parent
PORTABLE = Platform()

# What differs between systems, and only ckptfix.platform may use.
_OS_ONLY = {
    *("pread", "pwrite", "preadv", "pwritev", "copy_file_range", "sendfile", "fdatasync"),
    *("statvfs", "geteuid", "getuid", "fchmod", "lchmod", "open", "name", "posix_fadvise"),
    *("O_NOFOLLOW", "O_DIRECTORY", "O_NONBLOCK", "O_PATH", "O_TMPFILE", "O_CLOEXEC"),
    *("O_BINARY", "SEEK_DATA", "SEEK_HOLE"),
}
_MODULES = {"fcntl", "msvcrt", "resource", "ctypes", "winreg", "_winapi", "termios"}
# cli/entry.py takes the stop signals before it may import anything (its comment says why).
_ALLOWED = {("cli/entry.py", "hasattr(_signal, ...)")}


def _asks(tree: ast.AST) -> list[str]:
    """The system-specific calls, names, imports and capability probes in a module."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr in _OS_ONLY) == ("os", True):
                found.append(f"os.{node.attr}")
            if (node.value.id, node.attr) == ("sys", "platform"):
                found.append("sys.platform")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            found += [f"import {n}" for n in names if n and n.split(".")[0] in _MODULES]
        elif isinstance(node, ast.keyword) and node.arg in ("dir_fd", "src_dir_fd", "dst_dir_fd"):
            found.append(f"{node.arg}=")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in ("os", "sys", "signal", "_signal")
        ):
            found.append(f"{node.func.id}({node.args[0].id}, ...)")
    return found


@pytest.mark.slow
def test_only_the_platform_asks_which_system_it_runs_on() -> None:
    asking = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("platform/"):
            continue
        found = [
            use
            for use in _asks(ast.parse(path.read_text(), relative))
            if (relative, use) not in _ALLOWED
        ]
        if found:
            asking[relative] = sorted(set(found))
    assert asking == {}


def test_the_scan_finds_what_it_looks_for() -> None:
    code = (
        "import fcntl, os, sys\nos.pread(3, 1, 0)\nos.open('x', os.O_NOFOLLOW)\n"
        "os.mkdir('a', dir_fd=3)\nhasattr(os, 'x')\nsys.platform\n"
    )
    assert sorted(_asks(ast.parse(code))) == [
        "dir_fd=",
        "hasattr(os, ...)",
        "import fcntl",
        "os.O_NOFOLLOW",
        "os.open",
        "os.pread",
        "sys.platform",
    ]


def test_nothing_in_ckptfix_switches_the_platform() -> None:
    users = [
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if "_use_for_tests" in path.read_text()
    ]
    assert users == ["platform/__init__.py"]


def _fresh(code: str, **env: str) -> str:
    """What `code` prints in a fresh interpreter with this tree first on its path."""
    variables = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    variables.update({"PYTHONPATH": str(PACKAGE.parent), **env})
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=variables, check=True
    )
    return done.stdout.strip()


def test_the_choice_is_the_systems_whatever_the_environment_says() -> None:
    code = "from ckptfix.platform import system; print(system().name)"
    native = ckptfix.platform._choose(sys.platform).name
    assert _fresh(code, CKPTFIX_TEST_PLATFORM="portable") == native


def test_the_tests_portable_mode_reaches_the_processes_they_start() -> None:
    """tests/platform_site: only once ckptfix.platform is imported, never earlier."""
    site = str(Path(__file__).parent / "platform_site")
    code = (
        "import sys, ckptfix; print('ckptfix.platform' in sys.modules); "
        "from ckptfix.platform import system; print(system().name)"
    )
    path = os.pathsep.join((site, str(PACKAGE.parent)))
    variables = {"CKPTFIX_TEST_PLATFORM": "portable", "PYTHONPATH": path}
    assert _fresh(code, **variables).split() == ["False", "portable"]


def test_the_console_script_takes_the_signals_that_stop_a_command() -> None:
    from ckptfix.cli.entry import _NAMES

    assert sorted(_NAMES) == sorted(ckptfix.platform._choose(sys.platform).stop_signals())


class _ThreeSignals(Platform):
    """A system with a third signal that stops a command (as Windows' Ctrl-Break)."""

    def stop_signals(self) -> tuple[int, ...]:
        return (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def test_every_stop_signal_stops_a_write(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckptfix.platform, "_chosen", _ThreeSignals())
    signals = Signals()
    previous = signals.install()
    try:
        # all three, but one the caller ignores (xdist's workers ignore SIGINT)
        assert {signal.SIGTERM, signal.SIGUSR1} <= set(previous)
        signals.writing = True
        signal.raise_signal(signal.SIGUSR1)  # outside ckptfix's code: kept for a safe point
        with pytest.raises(Interrupted) as caught:
            signals.raise_deferred()
        assert (caught.value.exit_code, "SIGUSR1" in caught.value.line()) == (138, True)
    finally:
        restore(previous)


def _random_file(path: Path, size: int) -> bytes:
    data = random.Random(size).randbytes(size)
    path.write_bytes(data)
    return data


def test_portable_reads_and_writes_at_offsets_from_many_threads(tmp_path: Path) -> None:
    """Without pread, a seek and a read: two threads must never move one offset between
    each other's seek and read (nor write)."""
    data = _random_file(tmp_path / "file", 2**20)
    fd = os.open(tmp_path / "file", os.O_RDWR)
    wrong: list[tuple[int, int]] = []

    def reader(seed: int) -> None:
        pick = random.Random(seed)
        for _ in range(1500):
            offset, size = pick.randrange(2**20), pick.randrange(1, 4096)
            if PORTABLE.pread(fd, size, offset) != data[offset : offset + size]:
                wrong.append((offset, size))

    def writer(seed: int) -> None:  # writes what is there already, at offsets of its own
        pick = random.Random(seed)
        for _ in range(1500):
            offset = pick.randrange(2**20 - 64)
            PORTABLE.write_all(fd, data[offset : offset + 64], offset)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
    threads += [threading.Thread(target=writer, args=(seed,)) for seed in range(4, 6)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        os.close(fd)
    assert wrong == []
    assert (tmp_path / "file").read_bytes() == data
    assert PORTABLE.stream(0) is None  # nothing may share (and move) that offset


@pytest.mark.parametrize("host", [PORTABLE, Posix()], ids=["portable", "posix"])
def test_opens_never_follow_a_link_nor_wait_on_a_fifo(tmp_path: Path, host: Platform) -> None:
    (tmp_path / "secret").write_bytes(b"PRIVATE KEY")
    os.symlink(tmp_path / "secret", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    with pytest.raises(OSError) as caught:
        host.open_regular(str(tmp_path / "link"), follow=False)
    assert caught.value.errno == errno.ELOOP
    for name in ("fifo", "folder"):
        with pytest.raises((NotARegularFile, IsADirectoryError)):
            host.open_regular(str(tmp_path / name))
    fd = host.open_regular(str(tmp_path / "link"))  # a source named through a link is read
    assert os.read(fd, 20) == b"PRIVATE KEY"
    os.close(fd)


def test_an_entry_swapped_between_the_look_and_the_open_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "secret").write_bytes(b"PRIVATE KEY")
    (tmp_path / "config.json").write_bytes(b"{}")
    real_open = os.open
    opened: list[int] = []

    def swap_then_open(path: str, flags: int, *args: int) -> int:
        os.replace(tmp_path / "config.json", tmp_path / "moved.json")
        os.symlink(tmp_path / "secret", tmp_path / "config.json")
        opened.append(real_open(path, flags, *args))
        return opened[-1]

    monkeypatch.setattr(os, "open", swap_then_open)
    with pytest.raises(OSError) as caught:
        PORTABLE.open_regular(str(tmp_path / "config.json"), follow=False)
    monkeypatch.undo()
    assert caught.value.errno == errno.EBUSY
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(opened[0])  # closed unread


def test_a_folder_replaced_after_it_was_opened_is_not_worked_in(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "elsewhere").mkdir()
    folder = PathFolder(PORTABLE, str(tmp_path / "out"), follow=False)
    folder.mkdir("made")
    os.rename(tmp_path / "out", tmp_path / "out.moved")
    os.symlink(tmp_path / "elsewhere", tmp_path / "out")
    for act in (lambda: folder.mkdir("x"), lambda: folder.create("x", 0o600), folder.names):
        with pytest.raises(OSError) as caught:
            act()
        assert caught.value.errno == errno.EBUSY
    assert os.listdir(tmp_path / "elsewhere") == []
    with pytest.raises(OSError) as caught:
        PathFolder(PORTABLE, str(tmp_path / "out"), follow=False)
    assert caught.value.errno == errno.ELOOP


def test_portable_folders_remove_links_not_what_they_point_to(tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep").write_text("keep")
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    os.symlink(tmp_path / "outside", tmp_path / "tree" / "link")
    (tmp_path / "tree" / "file").write_text("x")
    with PathFolder(PORTABLE, str(tmp_path / "tree")) as tree:
        with pytest.raises(IsADirectoryError):
            tree.unlink("sub")
        for name, number in (("link", errno.ELOOP), ("file", errno.ENOTDIR)):
            with pytest.raises(OSError) as caught:
                tree.child(name)
            assert caught.value.errno == number
        tree.unlink("link")
        assert sorted(tree.names()) == ["file", "sub"]
    assert (tmp_path / "outside" / "keep").read_text() == "keep"


@pytest.mark.parametrize("original", ["moved", "removed"])
def test_a_hard_link_of_an_entry_swapped_for_a_link_is_undone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, original: str
) -> None:
    """An entry swapped for a link between the look and the hard link: the new entry is not
    the file looked at (a removed file's inode number may be the link's own now)."""
    (tmp_path / "secret").write_bytes(b"PRIVATE KEY")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "notes.txt").write_text("notes")
    real_link = os.link

    def swap_then_link(source: str, target: str, **kwargs: object) -> None:
        if original == "moved":
            os.replace(source, tmp_path / "moved.txt")
        else:
            os.remove(source)
        os.symlink(tmp_path / "secret", source)
        real_link(source, target)

    monkeypatch.setattr(os, "link", swap_then_link)
    with PathFolder(PORTABLE, str(tmp_path / "src")) as folder, pytest.raises(OSError) as caught:
        folder.link("notes.txt", str(tmp_path / "carried"))
    assert caught.value.errno == errno.EBUSY
    assert not os.path.lexists(tmp_path / "carried")


def test_posix_folders_say_a_folder_is_one_where_unlink_refuses_it_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """macOS and the BSDs refuse unlink(2) of a folder with EPERM, Linux with EISDIR."""
    (tmp_path / "sub").mkdir()
    real_unlink = os.unlink

    def unlink(name: str, *, dir_fd: int | None = None) -> None:
        if stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise PermissionError(errno.EPERM, "Operation not permitted")
        real_unlink(name, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", unlink)
    with (
        FdFolder.open(Posix(), str(tmp_path), follow=False) as folder,
        pytest.raises(IsADirectoryError),
    ):
        folder.unlink("sub")


@pytest.mark.parametrize("host", [PORTABLE, Posix()], ids=["portable", "posix"])
def test_the_lock_keeps_a_second_writer_out(tmp_path: Path, host: Platform) -> None:
    (tmp_path / "out").mkdir()
    first = host.lock_folder(str(tmp_path / "out"))
    with pytest.raises(BlockingIOError):
        host.lock_folder(str(tmp_path / "out"))
    first.release()
    first.release()  # once only
    host.lock_folder(str(tmp_path / "out")).release()
    assert sorted(os.listdir(tmp_path)) == ["out"]  # a lock file is removed with the lock


def test_a_lock_file_left_by_a_killed_run_is_taken_over(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    path = lock_file_path(str(tmp_path / "out"))
    Path(path).write_bytes(MAGIC + b"pid 12345\n")  # no process holds it any more
    lock = LockFile.take(PORTABLE, str(tmp_path / "out"))
    assert os.path.exists(path)
    lock.release()
    assert not os.path.lexists(path)


@pytest.mark.parametrize("kind", ["a file of the user's", "a link"])
def test_a_lock_file_name_taken_by_anything_else_is_left_alone(tmp_path: Path, kind: str) -> None:
    (tmp_path / "out").mkdir()
    path = Path(lock_file_path(str(tmp_path / "out")))
    (tmp_path / "target").write_bytes(MAGIC)
    if kind == "a link":
        os.symlink(tmp_path / "target", path)
    else:
        path.write_bytes(b"the user's notes")
    with pytest.raises((NotOurLockFile, OSError)) as caught:
        PORTABLE.lock_folder(str(tmp_path / "out"))
    expected = NotOurLockFile if kind != "a link" else OSError
    assert isinstance(caught.value, expected)
    assert path.is_symlink() if kind == "a link" else path.read_bytes() == b"the user's notes"
    assert (tmp_path / "target").read_bytes() == MAGIC


def test_portable_renames_replace_nothing(tmp_path: Path) -> None:
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "model.safetensors").write_text("new")
    for existing in ("file", "empty"):
        if existing == "file":
            (tmp_path / existing).write_text("theirs")
        else:
            (tmp_path / existing).mkdir()
        with pytest.raises(FileExistsError):
            PORTABLE.rename_new(str(tmp_path / "new"), str(tmp_path / existing))
    assert PORTABLE.exchange(str(tmp_path / "new"), str(tmp_path / "empty")) is False
    assert (tmp_path / "file").read_text() == "theirs" and os.listdir(tmp_path / "empty") == []
    PORTABLE.rename_new(str(tmp_path / "new"), str(tmp_path / "out"))
    assert (tmp_path / "out" / "model.safetensors").read_text() == "new"


def test_portable_copies_go_through_a_bounded_buffer(tmp_path: Path) -> None:
    data = _random_file(tmp_path / "source", 3 * 2**20 + 5)
    reader = os.open(tmp_path / "source", os.O_RDONLY)
    try:
        writer, copied = PORTABLE.copy_to_new(reader, str(tmp_path / "copy"))
        os.close(writer)
    finally:
        os.close(reader)
    assert copied == len(data) and (tmp_path / "copy").read_bytes() == data
    assert PORTABLE.copy_range(0, 1, 10, 0, 0) is None
    assert PORTABLE.clone_range(0, 0, 4096, 1, 0) is False
    assert list(PORTABLE.data_segments(0, 5, 2**40)) == [(5, 2**40)]  # holes read as zeros
    with pytest.raises(FileExistsError):
        PORTABLE.copy_to_new(0, str(tmp_path / "copy"))  # never over an existing file


def test_a_lock_file_that_cannot_be_made_leaves_the_error_to_the_write(tmp_path: Path) -> None:
    """Beside an OUT whose parent may not be written to, the staging folder cannot be made
    either: that is the error the run gives (`cannot write`), not one about listing OUT."""
    parent = tmp_path / "parent"
    (parent / "out").mkdir(parents=True)
    parent.chmod(0o555)
    code = (
        "import sys; from ckptfix.platform.portable import Platform; "
        "lock = Platform().lock_folder(sys.argv[1]); print(type(lock).__name__); lock.release()"
    )
    try:
        run = python_as_another_user("-c", code, str(parent / "out"))
    finally:
        parent.chmod(0o755)
    assert (run.code, run.stdout.strip()) == (0, "Unlocked"), run.stderr
    assert os.listdir(parent) == ["out"]


def test_a_signal_that_ends_the_console_script_at_once_removes_its_lock_file(
    tmp_path: Path,
) -> None:
    """Outside a write the console script exits at once (os._exit): no `finally` runs, and
    a lock file (where the system keeps one) stayed beside OUT; flock's went with the
    process."""
    (tmp_path / "out").mkdir()
    code = (
        "import os, signal, sys\n"
        "from ckptfix.core.signals import Signals\n"
        "from ckptfix.platform.portable import Platform\n"
        "Platform().lock_folder(sys.argv[1])\n"
        "Signals(exit_outside_writes=True).install()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True
    )
    assert (done.returncode, done.stderr) == (
        143,
        "error: interrupted by SIGTERM (rule interrupted)\n",
    )
    assert os.listdir(tmp_path) == ["out"]
