"""The least a verified copy can cost on this machine: the files given copied into OUT kernel
to kernel (`copy_file_range`, as `cp` does), with the work every ckptfix write adds and
nothing else — each 32 MiB read back and compared with its source on two worker threads
while the copy goes on, each 256 MiB flushed (`fdatasync`) and every file fsynced on a
third. No Python package is imported, no plan made, nothing gathered: the floor of
ckptfix's writers.

    python bench/copy_floor.py OUT FILE... [--no-verify]

Time it as the bench times a command (`/usr/bin/time -f "%e %U %S %M" python ...`).
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

BATCH = 32 * 2**20
FLUSH = 256 * 2**20
CHUNK = 2 * 2**20
_buffers = threading.local()


def _equal(src: int, dst: int, begin: int, end: int) -> None:
    if not hasattr(_buffers, "pair"):
        _buffers.pair = (bytearray(CHUNK), bytearray(CHUNK))
    one, two = _buffers.pair
    while begin < end:
        size = min(CHUNK, end - begin)
        left, right = (one, two) if size == CHUNK else (bytearray(size), bytearray(size))
        if os.preadv(src, [left], begin) != size or os.preadv(dst, [right], begin) != size:
            raise SystemExit("short read")
        if left != right:
            raise SystemExit(f"differs at {begin}")
        begin += size


def copy(
    source: str, out: str, pools: tuple[ThreadPoolExecutor, ThreadPoolExecutor], verify: bool
) -> list[Future[None]]:
    workers, flusher = pools
    src = os.open(source, os.O_RDONLY)
    target = os.path.join(out, os.path.basename(source))
    dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    reader = os.open(target, os.O_RDONLY)
    size, done, jobs = os.fstat(src).st_size, 0, []
    while done < size:
        batch = min(BATCH, size - done)
        copied = 0
        while copied < batch:
            copied += os.copy_file_range(src, dst, batch - copied, done + copied, done + copied)
        if (done + batch) % FLUSH < batch:
            jobs.append(flusher.submit(os.fdatasync, dst))
        if verify:
            jobs.append(workers.submit(_equal, src, reader, done, done + batch))
        done += batch
    jobs.append(flusher.submit(os.fsync, dst))
    return jobs


def main() -> None:
    verify = "--no-verify" not in sys.argv
    out, *files = [arg for arg in sys.argv[1:] if arg != "--no-verify"]
    os.mkdir(out)
    with ThreadPoolExecutor(2) as workers, ThreadPoolExecutor(1) as flusher:
        jobs = [job for name in files for job in copy(name, out, (workers, flusher), verify)]
        for job in jobs:
            job.result()
    folder = os.open(out, os.O_RDONLY)
    os.fsync(folder)
    os.close(folder)  # the files' descriptors close with the process


if __name__ == "__main__":
    main()
