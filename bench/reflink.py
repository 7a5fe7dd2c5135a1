"""`make bench` job for zero-copy writes (`bench.py --only reflink`).

On an XFS image (reflink=1) loop-mounted under .bench-cache/: `ckptfix reshard` of the
2.2 GB fixture into 500 MB shards, against a plain copy of the file (`cp --reflink=never`,
since coreutils 9 `cp` reflinks by itself where it can) + `sync`, and `cp --reflink=always`
+ `sync` of the whole file: the physical limit, one clone and no verification. Extra disk is
the growth of the filesystem's used space per run over the source's size. Needs root (the
loop mount) and mkfs.xfs; says why and skips otherwise.
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
from pathlib import Path

from bench import CKPTFIX, Measure, run

IMAGE_SIZE = 16 * 2**30  # sparse


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the XFS loop mount needs root"
    if _tool("mkfs.xfs") is None:
        return "mkfs.xfs is missing (apt-get install xfsprogs)"
    return None


@contextmanager
def xfs_mount(folder: Path) -> Iterator[Path]:
    """A fresh XFS (reflink=1) loop mount at folder/mnt, unmounted and deleted after."""
    folder.mkdir(parents=True, exist_ok=True)
    image, point = folder / "xfs.img", folder / "mnt"
    point.mkdir(exist_ok=True)
    with open(image, "wb") as handle:
        handle.truncate(IMAGE_SIZE)
    subprocess.run(
        [_tool("mkfs.xfs") or "mkfs.xfs", "-q", "-f", "-m", "reflink=1", str(image)], check=True
    )
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


def _account(command: list[str]) -> dict[str, object]:
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    written: dict[str, object] = json.loads(done.stdout)["written"]
    return written


def bench_reflink(single: Path, cache: Path, repeat: int) -> list[str]:
    reason = _unavailable()
    if reason:
        return [f"\nreflink: skipped ({reason})"]
    with xfs_mount(cache / "reflink") as point:
        source = point / single.name
        subprocess.run(["cp", "--reflink=never", str(single), str(source)], check=True)
        size = source.stat().st_size
        out = point / "out"
        copy = f"mkdir {out} && cp --reflink=never {source} {out}/ && sync {out}/{source.name}"
        clone = f"mkdir {out} && cp --reflink=always {source} {out}/ && sync {out}/{source.name}"
        reshard = [
            *CKPTFIX,
            "reshard",
            str(source),
            "-o",
            str(out),
            "--max-shard",
            "500MB",
            "--json",
        ]
        cp, cp_extra = _median(["sh", "-c", copy], out, point, repeat)
        ours, ours_extra = _median(reshard, out, point, repeat)
        limit, limit_extra = _median(["sh", "-c", clone], out, point, repeat)
        written = _account(reshard)
        shutil.rmtree(out, ignore_errors=True)
    account, ways = written["zero_copy"], written["verified_by"]
    assert isinstance(account, dict) and isinstance(ways, dict)
    ratio, extra = ours.wall / cp.wall, ours_extra / size
    ok = ratio <= 0.2 and extra <= 0.02
    return [
        f"\nreshard of a {size / 1e9:.2f} GB bf16 file into 500 MB shards on XFS (reflink=1, "
        f"loop-mounted); median of {repeat}, outputs fsynced; extra disk = used space added "
        "over the source's size\n",
        "| job | wall | peak RSS | vs cp | extra disk | target |",
        "|---|---|---|---|---|---|",
        f"| `cp --reflink=never` + `sync` (a plain copy) | {cp.wall:.3f} s | {cp.rss_mib:.0f} MiB "
        f"| 1.00× | {cp_extra / size:.2%} | |",
        f"| `ckptfix reshard --max-shard 500MB` (zero-copy, verified, fsynced, atomic) | "
        f"{ours.wall:.3f} s | {ours.rss_mib:.0f} MiB | {ratio:.3f}× | {extra:.3%} | "
        f"≤ 0.2× and ≤ 2%: {'met' if ok else 'MISSED'} |",
        f"| `cp --reflink=always` + `sync` (one clone, the physical limit) | {limit.wall:.3f} s | "
        f"{limit.rss_mib:.0f} MiB | {limit.wall / cp.wall:.3f}× | {limit_extra / size:.3%} | |",
        f"\nckptfix: {account['cloned']:,} bytes cloned, {account['copied']:,} copied, "
        f"{account['padding']:,} bytes of header padding ({account['block']}-byte blocks); "
        f"verified: {ways['extents']:,} bytes by identical extents, {ways['compared']:,} "
        "compared byte for byte",
    ]
