"""Real filesystems with reflinks for the zero-copy tests: XFS and btrfs images made in a
temporary folder (sparse files), loop-mounted, unmounted and deleted afterwards; and what
`filefrag -v` (e2fsprogs, independent of ckptfix's own FIEMAP code) says about a file's
extents. Where this machine cannot (not root, no mkfs tool, mount refused), the tests skip
saying which."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

# mkfs command per filesystem: XFS with reflinks (the default of current mkfs.xfs, asked for
# explicitly), btrfs (always has them); ext4, which has none (the fallback).
MKFS = {
    "xfs": ["mkfs.xfs", "-q", "-f", "-m", "reflink=1"],
    "btrfs": ["mkfs.btrfs", "-q", "-f"],
    "ext4": ["mkfs.ext4", "-q", "-F"],
}
IMAGE_SIZE = 2 * 2**30  # sparse: only what is written takes disk
_SBIN = "/usr/sbin:/sbin:/usr/bin:/bin"


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=_SBIN)


def unavailable(kind: str) -> str | None:
    """Why a `kind` loop mount cannot be made here, or None."""
    if os.geteuid() != 0:
        return "loop-mounting a filesystem image needs root"
    for tool in (MKFS[kind][0], "mount", "umount", "filefrag"):
        if _tool(tool) is None:
            return (
                f"{tool} is not installed (xfsprogs, btrfs-progs, e2fsprogs: `make test` "
                "installs the first two where missing)"
            )
    return None


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    tool = _tool(command[0]) or command[0]
    return subprocess.run([tool, *command[1:]], capture_output=True, text=True, check=False)


@contextmanager
def loop_mount(kind: str, folder: Path, options: str = "") -> Iterator[Path]:
    """A fresh `kind` filesystem mounted at folder/mnt (with mount `options`, if any); skips
    the test where it cannot be."""
    reason = unavailable(kind)
    if reason:
        pytest.skip(f"no {kind} loop mount: {reason}")
    image, point = folder / f"{kind}.img", folder / "mnt"
    point.mkdir(parents=True)
    with open(image, "wb") as handle:
        handle.truncate(IMAGE_SIZE)
    made = _run([*MKFS[kind], str(image)])
    if made.returncode != 0:
        pytest.skip(f"no {kind} loop mount: mkfs failed: {made.stderr.strip()}")
    mounted = _run(
        ["mount", "-o", ",".join(filter(None, ["loop", options])), str(image), str(point)]
    )
    if mounted.returncode != 0:
        image.unlink()
        pytest.skip(f"no {kind} loop mount: mount refused: {mounted.stderr.strip()}")
    try:
        yield point
    finally:
        if _run(["umount", str(point)]).returncode != 0:
            _run(["umount", "-l", str(point)])  # something still holds it: detach lazily
        image.unlink(missing_ok=True)


@dataclass(frozen=True)
class Extent:
    logical: int  # bytes
    physical: int  # bytes
    length: int  # bytes
    flags: frozenset[str]


_SIZE = re.compile(r"\((\d+) blocks? of (\d+) bytes\)")
_ROW = re.compile(r"^\s*\d+:\s*(\d+)\.\.\s*(\d+):\s*(\d+)\.\.\s*(\d+):\s*(\d+):(.*)$")


def extents(path: Path) -> list[Extent]:
    """The file's extents as `filefrag -v` prints them (FIEMAP, synced first)."""
    done = _run(["filefrag", "-v", "-s", str(path)])
    assert done.returncode == 0, done.stderr
    size = _SIZE.search(done.stdout)
    assert size, done.stdout
    block = int(size.group(2))
    found = []
    for line in done.stdout.splitlines():
        row = _ROW.match(line)
        if row:
            logical, _, physical, _, length = (int(row.group(i)) for i in range(1, 6))
            words = row.group(6).replace(":", " ").replace(",", " ").split()
            flags = frozenset(word for word in words if not word.isdigit())
            found.append(Extent(logical * block, physical * block, length * block, flags))
    return found


def shared_bytes(path: Path) -> int:
    """Bytes of the file on extents that another file shares."""
    return sum(item.length for item in extents(path) if "shared" in item.flags)


def own_bytes(path: Path) -> int:
    """Bytes of the file on extents of its own (not shared): what it adds to used space."""
    return sum(item.length for item in extents(path) if "shared" not in item.flags)


def used_bytes(point: Path, settle: float = 10.0) -> int:
    """The filesystem's used space once everything is written back and it stops changing:
    XFS frees the blocks of deleted files in the background, so read until two readings
    0.2 s apart agree (at most `settle` seconds)."""

    def reading() -> int:
        os.sync()
        stats = os.statvfs(point)
        return (stats.f_blocks - stats.f_bfree) * stats.f_frsize

    last, deadline = reading(), time.monotonic() + settle
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = reading()
        if now == last:
            break
        last = now
    return last
