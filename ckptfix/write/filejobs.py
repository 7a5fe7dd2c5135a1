"""The work the writers leave to their worker threads (read-backs, verification) and to a
thread of flushes (fdatasync, fsync), grouped by the output file whose descriptors it uses.

A file's descriptors are closed as soon as its last job is done, and no more than
MAX_OPEN_FILES finished files wait for their jobs at a time (the writer then waits for the
oldest): a rewrite into 1,100 shards holds a few descriptors, not two per shard, and so runs
under the common soft limit of 1,024 (or far lower).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

MAX_OPEN_FILES = 8


@dataclass
class _File:
    fds: tuple[int, ...]
    jobs: list[Future[Any]] = field(default_factory=list)
    ended: bool = False  # no more jobs will come


class FileJobs:
    """Jobs on `workers`, by output file (keyed by its first descriptor); flushes on a
    thread of their own (`flush`)."""

    def __init__(self, workers: ThreadPoolExecutor) -> None:
        self.workers = workers
        self.jobs: list[Future[Any]] = []  # every job, for `finish`
        self._files: dict[int, _File] = {}  # the files still open, oldest first
        self._flusher: ThreadPoolExecutor | None = None

    def open(self, *fds: int) -> int:
        """Take charge of a new output file's descriptors; its key."""
        self._files[fds[0]] = _File(fds)
        return fds[0]

    def submit(self, key: int, function: Callable[..., Any], *args: Any) -> Future[Any]:
        return self._track(key, self.workers.submit(function, *args))

    def flush(self, key: int, function: Callable[..., Any], *args: Any) -> Future[Any]:
        """A job that waits for the disk (fdatasync, fsync), run in order on one thread of
        its own: the workers go on reading back and comparing meanwhile, and a file's
        last fsync runs beside its last verifications instead of after them."""
        if self._flusher is None:
            self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfix-flush")
        return self._track(key, self._flusher.submit(function, *args))

    def _track(self, key: int, future: Future[Any]) -> Future[Any]:
        self._files[key].jobs.append(future)
        self.jobs.append(future)
        return future

    def ended(self, key: int) -> None:
        """No more jobs for this file: close it once they are done (see `settle`)."""
        self._files[key].ended = True
        self.settle()

    def settle(self) -> None:
        """Close the ended files whose jobs are done (a job's failure is raised here, as
        early as it can be); then, while too many files are open, wait for the oldest."""
        for key, file in list(self._files.items()):
            if file.ended and all(job.done() for job in file.jobs):
                self._retire(key)
        waiting = [key for key, file in self._files.items() if file.ended]
        while len(self._files) > MAX_OPEN_FILES and waiting:
            self._retire(waiting.pop(0))

    def _retire(self, key: int) -> None:
        file = self._files.pop(key)
        try:
            for job in file.jobs:
                job.result()
        finally:
            for fd in file.fds:
                os.close(fd)

    def finish(self) -> None:
        for job in self.jobs:
            job.result()

    def close(self) -> None:
        """Close every descriptor still open (after the workers, and here the flushes, have
        stopped)."""
        if self._flusher is not None:
            self._flusher.shutdown(wait=True)
        for file in self._files.values():
            for fd in file.fds:
                os.close(fd)
        self._files.clear()
        for job in self.jobs:
            if job.done() and not job.cancelled():
                job.exception()  # retrieved: a Cancelled there is expected
