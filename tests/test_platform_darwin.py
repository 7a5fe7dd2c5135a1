"""The macOS implementation on Linux, its C library replaced at the calls it makes
(renamex_np, fclonefileat, fcopyfile), each done here with what it does on macOS: the flags
and arguments passed, and what each answer (done, unsupported, refused) becomes. Everything
else of Darwin is POSIX's, which runs here for real."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Any

import pytest

from ckptfix.platform.darwin import (
    AT_FDCWD,
    CLONE_NOFOLLOW,
    F_FULLFSYNC,
    RENAME_EXCL,
    RENAME_SWAP,
    Darwin,
)
from ckptfix.platform.linux import RENAME_EXCHANGE, renameat2


class FakeLibc:
    """libSystem's calls, done as macOS does them; `supported` False answers ENOTSUP (a file
    system that is not APFS, an old macOS)."""

    def __init__(self, *, supported: bool = True) -> None:
        self.supported = supported
        self.errno = 0
        self.calls: list[tuple[Any, ...]] = []

    def _fail(self, code: int) -> int:
        self.errno = code
        return -1

    def renamex_np(self, first: bytes, second: bytes, flags: int) -> int:
        self.calls.append(("renamex_np", first, second, flags))
        if not self.supported:
            return self._fail(errno.ENOTSUP)
        if flags & RENAME_SWAP:
            return 0 if renameat2(os.fsdecode(first), os.fsdecode(second), RENAME_EXCHANGE) else -1
        if flags & RENAME_EXCL and os.path.lexists(second):
            return self._fail(errno.EEXIST)
        os.rename(first, second)
        return 0

    def fclonefileat(self, source: int, folder: int, target: bytes, flags: int) -> int:
        self.calls.append(("fclonefileat", source, folder, target, flags))
        if not self.supported:
            return self._fail(errno.ENOTSUP)
        if os.path.lexists(target):
            return self._fail(errno.EEXIST)
        with open(target, "xb") as handle:
            handle.write(os.pread(source, os.fstat(source).st_size, 0))
        return 0

    def fcopyfile(self, source: int, target: int, state: object, flags: int) -> int:
        """From each descriptor's own offset, as fcopyfile reads and writes."""
        self.calls.append(("fcopyfile", source, target, state, flags))
        if not self.supported:
            return self._fail(errno.ENOTSUP)
        while chunk := os.read(source, 2**16):
            os.write(target, chunk)
        return 0


def _darwin(libc: FakeLibc) -> Darwin:
    return Darwin(libc, lambda: libc.errno)


def test_the_exchange_is_rename_swap(tmp_path: Path) -> None:
    for name in ("new", "old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / name).write_text(name)
    libc = FakeLibc()
    assert _darwin(libc).exchange(str(tmp_path / "new"), str(tmp_path / "old"))
    assert os.listdir(tmp_path / "old") == ["new"] and os.listdir(tmp_path / "new") == ["old"]
    assert libc.calls[0][3] == RENAME_SWAP
    unsupported = FakeLibc(supported=False)
    assert _darwin(unsupported).exchange(str(tmp_path / "new"), str(tmp_path / "old")) is False
    assert os.listdir(tmp_path / "old") == ["new"]  # nothing moved


@pytest.mark.parametrize("supported", [True, False])
def test_a_new_output_is_renamed_in_with_rename_excl(tmp_path: Path, supported: bool) -> None:
    (tmp_path / "staging").mkdir()
    (tmp_path / "theirs").mkdir()  # empty: a plain rename would replace it
    libc = FakeLibc(supported=supported)
    darwin = _darwin(libc)
    with pytest.raises(FileExistsError):
        darwin.rename_new(str(tmp_path / "staging"), str(tmp_path / "theirs"))
    darwin.rename_new(str(tmp_path / "staging"), str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["out", "theirs"]
    assert {call[3] for call in libc.calls} == {RENAME_EXCL}


def test_whole_files_are_cloned_where_apfs_allows(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes(b"x" * 100_000)
    libc = FakeLibc()
    reader = os.open(tmp_path / "tokenizer.json", os.O_RDONLY)
    try:
        writer, size = _darwin(libc).copy_to_new(reader, str(tmp_path / "copy"))
        os.write(writer, b"")  # open for writing: its mode and times are set through it
        os.close(writer)
        with pytest.raises(FileExistsError):  # never over an existing entry
            _darwin(libc).copy_to_new(reader, str(tmp_path / "copy"))
    finally:
        os.close(reader)
    assert size == 100_000 and (tmp_path / "copy").read_bytes() == b"x" * 100_000
    target = os.fsencode(str(tmp_path / "copy"))
    assert libc.calls[0] == ("fclonefileat", reader, AT_FDCWD, target, CLONE_NOFOLLOW)


@pytest.mark.parametrize("fcopyfile", [True, False])
def test_elsewhere_files_are_copied_from_their_start(tmp_path: Path, fcopyfile: bool) -> None:
    data = os.urandom(300_000)
    (tmp_path / "source").write_bytes(data)
    libc = FakeLibc(supported=False)
    darwin = _darwin(libc)
    if fcopyfile:  # no clone here, but fcopyfile
        libc.fcopyfile = FakeLibc().fcopyfile  # type: ignore[method-assign]
    reader = os.open(tmp_path / "source", os.O_RDONLY)
    try:
        os.lseek(reader, 1234, os.SEEK_SET)  # an offset moved by an earlier read
        writer, size = darwin.copy_to_new(reader, str(tmp_path / "copy"))
        os.close(writer)
    finally:
        os.close(reader)
    assert (size, (tmp_path / "copy").read_bytes()) == (len(data), data)
    assert [call[0] for call in libc.calls] == ["fclonefileat", *(["fcopyfile"] * (not fcopyfile))]


def test_a_full_sync_asks_the_drive_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fd = os.open(tmp_path / "file", os.O_WRONLY | os.O_CREAT)
    calls: list[object] = []
    monkeypatch.setattr(fcntl, "fcntl", lambda fd, command: calls.append(command))
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append("fsync"))
    darwin = _darwin(FakeLibc())
    darwin.sync(fd)
    assert calls == [F_FULLFSYNC]

    def unsupported(fd: int, command: int) -> None:
        raise OSError(errno.ENOTSUP, "not here")

    monkeypatch.setattr(fcntl, "fcntl", unsupported)
    darwin.sync(fd)
    assert calls == [F_FULLFSYNC, "fsync"]  # a file system without it: fsync
    monkeypatch.undo()
    os.close(fd)


def test_an_unreadable_folder_is_opened_up_without_following_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fchmodat(AT_SYMLINK_NOFOLLOW), which macOS has and Linux refuses."""
    (tmp_path / "closed").mkdir(mode=0o000)
    calls: list[tuple[object, ...]] = []
    monkeypatch.setattr(os, "chmod", lambda *args, **kwargs: calls.append((*args, kwargs)))
    folder = os.open(tmp_path, os.O_RDONLY)
    try:
        _darwin(FakeLibc()).add_owner_access_at(folder, "closed")
    finally:
        os.close(folder)
    assert calls == [("closed", 0o700, {"dir_fd": folder, "follow_symlinks": False})]


def test_a_c_library_without_the_calls_falls_back(tmp_path: Path) -> None:
    """An older macOS without renamex_np or fclonefileat: ENOSYS, as if unsupported."""
    (tmp_path / "a").mkdir()
    (tmp_path / "source").write_bytes(b"weights")
    darwin = Darwin(object(), lambda: 0)
    assert darwin.exchange(str(tmp_path / "a"), str(tmp_path / "source")) is False
    darwin.rename_new(str(tmp_path / "a"), str(tmp_path / "b"))
    reader = os.open(tmp_path / "source", os.O_RDONLY)
    try:
        writer, size = darwin.copy_to_new(reader, str(tmp_path / "copy"))
        os.close(writer)
    finally:
        os.close(reader)
    assert sorted(os.listdir(tmp_path)) == ["b", "copy", "source"]
    assert (size, (tmp_path / "copy").read_bytes()) == (7, b"weights")
