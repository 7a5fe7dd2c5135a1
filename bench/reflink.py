"""`make bench` job for zero-copy writes (`bench.py --only reflink`).

On an XFS image (reflink=1) loop-mounted under .bench-cache/, then on a btrfs one:
`ckptfix reshard` of the 2.2 GB fixture into 500 MB shards, against a plain copy of the file
(`cp --reflink=never`, since coreutils 9 `cp` reflinks by itself where it can) + `sync`, and
`cp --reflink=always` + `sync` of the whole file: the physical limit, one clone and no
verification. Extra disk is the growth of the filesystem's used space per run over the
source's size. Needs root (the loop mount) and mkfs.xfs / mkfs.btrfs; says why and skips
otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import CKPTFIX, Measure, run

IMAGE_SIZE = 16 * 2**30  # sparse


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


MKFS = {
    "XFS": (["mkfs.xfs", "-q", "-f", "-m", "reflink=1"], "xfsprogs"),
    "btrfs": (["mkfs.btrfs", "-q", "-f"], "btrfs-progs"),
}


def _unavailable(kind: str) -> str | None:
    if os.geteuid() != 0:
        return f"the {kind} loop mount needs root"
    command, package = MKFS[kind]
    if _tool(command[0]) is None:
        return f"{command[0]} is missing (apt-get install {package})"
    return None


@contextmanager
def fs_mount(kind: str, folder: Path) -> Iterator[Path]:
    """A fresh `kind` loop mount at folder/mnt, unmounted and deleted after."""
    folder.mkdir(parents=True, exist_ok=True)
    image, point = folder / "fs.img", folder / "mnt"
    point.mkdir(exist_ok=True)
    with open(image, "wb") as handle:
        handle.truncate(IMAGE_SIZE)
    command = MKFS[kind][0]
    tool = _tool(command[0]) or command[0]
    subprocess.run([tool, *command[1:], str(image)], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(point)], check=True)
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=False)
        image.unlink(missing_ok=True)


def used(point: Path) -> int:
    """Used bytes once everything is written back and the filesystem has settled (XFS frees
    deleted files' blocks in the background)."""
    last = -1
    for _ in range(50):
        os.sync()
        stats = os.statvfs(point)
        now = (stats.f_blocks - stats.f_bfree) * stats.f_frsize
        if now == last:
            return now
        last = now
        time.sleep(0.2)
    return last


def _timed(command: list[str], out: Path, point: Path) -> tuple[Measure, int]:
    """One run into a fresh `out`: wall time, peak RSS and the used space it added."""
    shutil.rmtree(out, ignore_errors=True)
    before = used(point)
    measure = run(command)
    return measure, used(point) - before


def _median(command: list[str], out: Path, point: Path, repeat: int) -> tuple[Measure, int]:
    runs = [_timed(command, out, point) for _ in range(repeat)]
    shutil.rmtree(out, ignore_errors=True)
    wall = statistics.median(m.wall for m, _ in runs)
    rss = max(m.rss_mib for m, _ in runs)
    return Measure(wall, rss), int(statistics.median(extra for _, extra in runs))


def _account(command: list[str]) -> dict[str, Any]:
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    written: dict[str, Any] = json.loads(done.stdout)["written"]
    return written


@dataclass(frozen=True)
class Row:
    """One job's median wall time, peak RSS and used space added."""

    measure: Measure
    extra: int


def _measure_on(
    point: Path, single: Path, repeat: int
) -> tuple[int, dict[str, Row], dict[str, Any]]:
    """The three jobs on the mounted filesystem: sizes, rows and reshard's `written`."""
    source = point / single.name
    subprocess.run(["cp", "--reflink=never", str(single), str(source)], check=True)
    out = point / "out"
    copy = f"mkdir {out} && cp --reflink=never {source} {out}/ && sync {out}/{source.name}"
    clone = f"mkdir {out} && cp --reflink=always {source} {out}/ && sync {out}/{source.name}"
    reshard = [*CKPTFIX, "reshard", str(source), "-o", str(out), "--max-shard", "500MB", "--json"]
    rows = {
        "cp": Row(*_median(["sh", "-c", copy], out, point, repeat)),
        "ours": Row(*_median(reshard, out, point, repeat)),
        "limit": Row(*_median(["sh", "-c", clone], out, point, repeat)),
    }
    written = _account(reshard)
    shutil.rmtree(out, ignore_errors=True)
    return source.stat().st_size, rows, written


def _table(
    kind: str, size: int, rows: dict[str, Row], written: dict[str, Any], repeat: int
) -> list[str]:
    cp, ours, limit = rows["cp"], rows["ours"], rows["limit"]
    account, ways = written["zero_copy"], written["verified_by"]
    ratio, extra = ours.measure.wall / cp.measure.wall, ours.extra / size
    ok = ratio <= 0.2 and extra <= 0.02

    def cells(row: Row) -> str:
        return (
            f"{row.measure.wall:.3f} s | {row.measure.rss_mib:.0f} MiB | "
            f"{row.measure.wall / cp.measure.wall:.3f}× | {row.extra / size:.3%}"
        )

    return [
        f"\nreshard of a {size / 1e9:.2f} GB bf16 file into 500 MB shards on {kind} "
        f"(loop-mounted image); median of {repeat}, outputs fsynced; extra disk = used space "
        "added over the source's size\n",
        "| job | wall | peak RSS | vs cp | extra disk | target |",
        "|---|---|---|---|---|---|",
        f"| `cp --reflink=never` + `sync` (a plain copy) | {cells(cp)} | |",
        "| `ckptfix reshard --max-shard 500MB` (zero-copy, verified, fsynced, atomic) | "
        f"{cells(ours)} | ≤ 0.2× and ≤ 2%: {'met' if ok else 'MISSED'} |",
        f"| `cp --reflink=always` + `sync` (one clone, the physical limit) | {cells(limit)} | |",
        f"\nckptfix: {account['cloned']:,} bytes cloned, {account['copied']:,} copied, "
        f"{account['padding']:,} bytes of header padding ({account['block']}-byte blocks); "
        f"verified: {ways['extents']:,} bytes by identical extents, {ways['compared']:,} "
        "compared byte for byte",
    ]


def bench_reflink(single: Path, cache: Path, repeat: int) -> list[str]:
    lines = []
    for kind in MKFS:
        reason = _unavailable(kind)
        if reason:
            lines.append(f"\nreflink on {kind}: skipped ({reason})")
            continue
        with fs_mount(kind, cache / f"reflink-{kind.lower()}") as point:
            size, rows, written = _measure_on(point, single, repeat)
        lines += _table(kind, size, rows, written, repeat)
    return lines
