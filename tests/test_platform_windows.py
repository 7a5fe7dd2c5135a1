"""The Windows implementation on Linux, kernel32 and msvcrt replaced at the calls it makes
(tests/fake_windows.py): offsets past 4 GiB in both halves of an OVERLAPPED, opens that
refuse links and junctions, the lock, pinned folders, ReFS block cloning, long paths,
Win32 errors, Ctrl-Break. What it cannot show: Windows itself answering so."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from ckptfix.platform import windows as windows_module
from ckptfix.platform.common import NotARegularFile
from ckptfix.platform.folders import PathFolder
from ckptfix.platform.windows import SIGBREAK, Windows
from ckptfix.platform.windows_api import (
    FILE_FLAG_BACKUP_SEMANTICS,
    FILE_FLAG_OPEN_REPARSE_POINT,
    FILE_SHARE_DELETE,
    FSCTL_DUPLICATE_EXTENTS_TO_FILE,
    LOCKFILE_EXCLUSIVE_LOCK,
    LOCKFILE_FAIL_IMMEDIATELY,
    long_path,
    os_error,
    overlapped,
)
from tests.fake_windows import IO_REPARSE_TAG_CLOUD, FakeKernel32, fake_api

LONG = "x" * 150


def _windows(kernel32: FakeKernel32 | None = None) -> tuple[Windows, FakeKernel32]:
    kernel32 = kernel32 or FakeKernel32()
    return Windows(fake_api(kernel32)), kernel32


@pytest.mark.parametrize(
    ("path", "native"),
    [
        ("C:\\models\\llama", "C:\\models\\llama"),  # short: as given
        (f"C:\\m\\{LONG}\\{LONG}", f"\\\\?\\C:\\m\\{LONG}\\{LONG}"),
        (f"C:/m/{LONG}/../{LONG}/{LONG}", f"\\\\?\\C:\\m\\{LONG}\\{LONG}"),  # normalised
        (f"\\\\server\\share\\{LONG}\\{LONG}", f"\\\\?\\UNC\\server\\share\\{LONG}\\{LONG}"),
        (f"\\\\?\\C:\\{LONG}\\..\\{LONG}", f"\\\\?\\C:\\{LONG}\\..\\{LONG}"),  # taken as it is
        ("C:\\" + "y" * 244, "C:\\" + "y" * 244),  # 247 characters: still short enough
        ("C:\\" + "y" * 245, "\\\\?\\C:\\" + "y" * 245),
    ],
)
def test_long_paths_get_the_extended_form(path: str, native: str) -> None:
    assert long_path(path) == native
    assert Windows(fake_api(FakeKernel32())).native(path) == native


def test_an_overlapped_carries_offsets_past_4_gib_in_both_halves() -> None:
    where = overlapped(5 * 2**32 + 7)
    assert (where.Offset, where.OffsetHigh) == (7, 5)


@pytest.fixture
def sparse(tmp_path: Path) -> Path:
    """A 5 GiB file (a hole) with bytes of its own around 4 GiB and at its end."""
    path = tmp_path / "big.bin"
    with open(path, "wb") as handle:
        handle.truncate(5 * 2**30)
        handle.seek(2**32 - 2)
        handle.write(b"ABCDEF")
        handle.seek(5 * 2**30 - 3)
        handle.write(b"END")
    return path


def test_reads_at_an_offset_are_readfile_with_that_offset(
    sparse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    windows, kernel32 = _windows()
    monkeypatch.setattr(windows_module, "MAX_CALL", 4096)  # ReadFile's 32-bit count, smaller
    fd = os.open(sparse, os.O_RDWR)
    try:
        assert windows.pread(fd, 6, 2**32 - 2) == b"ABCDEF"
        assert windows.pread(fd, 10, 5 * 2**30 - 3) == b"END"  # short at the end
        assert windows.pread(fd, 10, 5 * 2**30) == b""  # ERROR_HANDLE_EOF
        windows.write_all(fd, memoryview(b"xyz"), 2**32 + 10)  # a read-only view
        windows.write_all(fd, bytearray(b"uvw"), 2**33 + 1)  # past the end: extends
        assert windows.pread(fd, 3, 2**32 + 10) == b"xyz"
        assert windows.pread(fd, 3, 2**33 + 1) == b"uvw"
        assert len(windows.pread(fd, 10_000, 0)) == 4096  # one call reads at most MAX_CALL
    finally:
        os.close(fd)
    reads = [args for name, args in kernel32.calls if name == "ReadFile"]
    assert reads[:3] == [(fd, 6, 2**32 - 2), (fd, 10, 5 * 2**30 - 3), (fd, 10, 5 * 2**30)]
    assert reads[-1] == (fd, 4096, 0)
    writes = [args for name, args in kernel32.calls if name == "WriteFile"]
    assert writes == [(fd, 3, 2**32 + 10), (fd, 3, 2**33 + 1)]
    assert windows.stream(fd) is None  # ReadFile moves the handle's pointer: no stream


def test_opens_refuse_links_and_junctions_and_read_placeholders(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"weights")
    (tmp_path / "placeholder").write_bytes(b"in the cloud")
    os.symlink(tmp_path / "file", tmp_path / "link")
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "folder").mkdir()
    windows, kernel32 = _windows(
        FakeKernel32({str(tmp_path / "placeholder"): IO_REPARSE_TAG_CLOUD})
    )
    with pytest.raises(OSError) as caught:
        windows.open_regular(str(tmp_path / "link"), follow=False)
    assert caught.value.errno == errno.ELOOP
    for name in ("pipe", "folder"):
        with pytest.raises(NotARegularFile):
            windows.open_regular(str(tmp_path / name), follow=False)
    closed = [args[0] for name, args in kernel32.calls if name == "CloseHandle"]
    assert len(closed) == 3  # each refused handle closed
    for name in ("placeholder", "link"):
        fd = windows.open_regular(str(tmp_path / name), follow=name == "link")
        assert os.read(fd, 20) in (b"in the cloud", b"weights")
        os.close(fd)
    creates = [args for name, args in kernel32.calls if name == "CreateFileW"]
    assert all(args[2] & FILE_SHARE_DELETE for args in creates)  # never stops a rename
    assert [bool(args[5] & FILE_FLAG_OPEN_REPARSE_POINT) for args in creates] == [
        *(True,) * 4,
        False,  # a source named through a link is read, as on POSIX
    ]


def test_the_lock_is_lockfile_ex_on_a_lock_file(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    windows, kernel32 = _windows()
    lock = windows.lock_folder(str(tmp_path / "out"))
    with pytest.raises(BlockingIOError):
        windows.lock_folder(str(tmp_path / "out"))
    lock.release()
    assert sorted(os.listdir(tmp_path)) == ["out"]
    flags = {args[1] for name, args in kernel32.calls if name == "LockFileEx"}
    assert flags == {LOCKFILE_EXCLUSIVE_LOCK | LOCKFILE_FAIL_IMMEDIATELY}
    shares = [args[2] for name, args in kernel32.calls if name == "CreateFileW"]
    assert shares and not any(share & FILE_SHARE_DELETE for share in shares)


def test_folders_worked_in_are_held_against_renames(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    os.symlink(tmp_path / "out", tmp_path / "link")
    windows, kernel32 = _windows()
    with PathFolder(windows, str(tmp_path / "out"), follow=False) as folder:
        folder.mkdir("sub")
        [(_, args)] = kernel32.calls
        assert args[5] & FILE_FLAG_BACKUP_SEMANTICS and args[5] & FILE_FLAG_OPEN_REPARSE_POINT
        assert not args[2] & FILE_SHARE_DELETE  # nobody renames or removes it meanwhile
        held = folder._pin
    assert kernel32.calls[-1] == ("CloseHandle", (held,))
    assert (tmp_path / "out" / "sub").is_dir()
    with pytest.raises(OSError) as caught:
        PathFolder(windows, str(tmp_path / "link"), follow=False)
    assert caught.value.errno == errno.ELOOP


@pytest.mark.parametrize("cluster", [4096, None])
def test_refs_clones_whole_clusters_and_copies_the_rest(
    tmp_path: Path, cluster: int | None
) -> None:
    data = os.urandom(10_000)
    (tmp_path / "source").write_bytes(data)
    windows, kernel32 = _windows(FakeKernel32(cluster=cluster))
    reader = os.open(tmp_path / "source", os.O_RDONLY)
    try:
        writer, size = windows.copy_to_new(reader, str(tmp_path / "copy"))
        os.close(writer)
        block = windows.clone_block(reader, str(tmp_path))
    finally:
        os.close(reader)
    assert (size, (tmp_path / "copy").read_bytes()) == (len(data), data)
    clones = [args[1:] for name, args in kernel32.calls if name == "duplicate"]
    controls = {args[1] for name, args in kernel32.calls if name == "DeviceIoControl"}
    if cluster is None:
        assert (clones, block) == ([], None)
        return
    assert FSCTL_DUPLICATE_EXTENTS_TO_FILE in controls
    assert clones == [(0, 0, 8192), (0, 0, 4096)]  # the copy's clusters, then the probe's
    assert block == 4096
    assert sorted(os.listdir(tmp_path)) == ["copy", "source"]  # the probe file is gone


@pytest.mark.parametrize(
    ("code", "number"),
    [
        (5, errno.EACCES),
        (32, errno.EACCES),
        (112, errno.ENOSPC),
        (183, errno.EEXIST),
        (9999, errno.EIO),
    ],
)
def test_win32_errors_are_the_errno_they_mean(code: int, number: int) -> None:
    error = os_error(code, "C:\\out")
    assert (error.errno, error.filename, f"Windows error {code}" in str(error)) == (
        number,
        "C:\\out",
        True,
    )


def test_ctrl_break_stops_a_command_and_there_are_no_owners() -> None:
    windows, _ = _windows()
    assert SIGBREAK == 21 and SIGBREAK in windows.stop_signals()
    assert (windows.effective_user(), windows.may_own_anything()) == (None, False)
    assert windows.open_files_limit() == windows.raise_open_files_limit() == 8192
    junction = SimpleNamespace(
        st_mode=stat.S_IFDIR, st_file_attributes=0x410, st_reparse_tag=0xA0000003
    )
    placeholder = SimpleNamespace(
        st_mode=stat.S_IFREG, st_file_attributes=0x480, st_reparse_tag=IO_REPARSE_TAG_CLOUD
    )
    assert windows.is_link(junction) and not windows.is_link(placeholder)  # type: ignore[arg-type]


def test_a_read_only_file_is_made_writable_to_be_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows refuses to remove a file with the read-only attribute (ERROR_ACCESS_DENIED)."""
    (tmp_path / "file").write_text("x")
    windows, _ = _windows()
    real_unlink, calls = os.unlink, []

    def unlink(path: str) -> None:
        calls.append("unlink")
        if len(calls) == 1:
            raise PermissionError(errno.EACCES, "Access is denied")
        real_unlink(path)

    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(os, "lstat", lambda path: SimpleNamespace(st_file_attributes=0x1))
    monkeypatch.setattr(os, "chmod", lambda path, mode: calls.append(f"chmod {mode:o}"))
    windows.remove_file(str(tmp_path / "file"))
    assert calls == ["unlink", f"chmod {stat.S_IWRITE:o}", "unlink"]
    assert not (tmp_path / "file").exists()
