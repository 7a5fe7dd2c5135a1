"""Joining a Ray cluster and running tasks on it: Ray schedules, retries a task whose worker
or node was lost (MAX_RETRIES times) and cancels; this module only waits, feeds the progress
callback as tasks complete, and turns a task's failure into the error it raised."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ckptfix.core.errors import ClusterError, UsageError
from ckptfix.core.signals import current as current_signals
from ckptfix.core.text import shown
from ckptfix.executors.ray_address import ENV, choose

# A task whose worker process or node died is run again this many times (Ray's max_retries);
# a task that raised (bad data, a changed source) is not: it ends the run.
MAX_RETRIES = 3
INSTALL = "pip install 'ckptfix[ray]'"
_POLL = 0.1  # seconds between safe points for a signal while tasks run


def ray_module() -> ModuleType:
    """ray, or the usage error that says how to install it."""
    try:
        import ray
    except ImportError:
        raise UsageError("--executor", "ray is not installed", f"run {INSTALL}") from None
    return ray


@dataclass(frozen=True)
class Cluster:
    """The cluster a command runs its tasks on: joined (an address was found) or started
    here for this command (and stopped with it)."""

    address: str
    started: bool
    cpus: int
    note: str = ""  # why a local Ray was started although an address was found

    def describe(self) -> str:
        if self.started:
            why = self.note or "no cluster was running"
            return f"ray: started a local Ray ({self.cpus} CPUs), {why}"
        return f"ray: joined the cluster at {self.address} ({self.cpus} CPUs)"

    def to_dict(self) -> dict[str, object]:
        return {
            "name": "ray",
            "address": self.address,
            "started": self.started,
            "cpus": self.cpus,
            "max_retries": MAX_RETRIES,
        }


def connect() -> Cluster:
    """Join the cluster as Ray programs do (RAY_ADDRESS, else one running on this machine),
    or start a local Ray when there is none, or none answers where Ray's record of the last
    one started here says (ray_address: a named address that does not answer is an error)."""
    ray = ray_module()
    quiet: dict[str, Any] = {"logging_level": logging.ERROR, "log_to_driver": False}
    _messages_to_stderr(ray)
    if ray.is_initialized():
        return _joined(ray, started=False)
    choice = choose(ray)
    if choice.found is not None:
        try:
            ray.init(address="auto", **quiet)  # found as "auto" finds it: Ray's own rules
            return _joined(ray, started=False)
        except ConnectionError:
            if choice.found.named:
                raise ClusterError(
                    None,
                    f"could not join the Ray cluster at {shown(choice.found.address)} ({ENV})",
                    "check that it is the address `ray start --head` printed (ray status)",
                ) from None
            # a found one that stopped answering since: a local Ray, as with none
    # Started for this command only: it listens on loopback, not on the network; "local"
    # so that Ray does not look for a cluster again (the stale record it would wait on).
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", **quiet)
    return _joined(ray, started=True, note=choice.note)


def _joined(ray: ModuleType, started: bool, note: str = "") -> Cluster:
    address = ray.get_runtime_context().gcs_address
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    return Cluster(address, started, cpus, note)


def _messages_to_stderr(ray: ModuleType) -> None:
    """Ray's driver prints the cluster's messages about its tasks (`(raylet) Task ... failed
    due to oom`, retried) on stdout, which is the command's output (a JSON document): on
    stderr instead. Ray reads its printer from its module at each message."""
    worker = getattr(getattr(ray, "_private", None), "worker", None)
    printer = getattr(worker, "print_to_stdstream", None)
    if printer is None or getattr(printer, "ckptfix", False):
        return

    def to_stderr(data: dict[str, Any], ignore_prefix: bool) -> None:
        printer({**data, "is_err": True}, ignore_prefix)

    to_stderr.ckptfix = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = to_stderr  # type: ignore[union-attr]


def disconnect() -> None:
    """Leave the cluster (stopping the local Ray started for this command)."""
    ray = ray_module()
    if ray.is_initialized():
        ray.shutdown()


@dataclass(frozen=True)
class Task:
    """One call of `function` (a module-level function, imported by name on the worker) on
    `args`; `weight` is what its completion adds to the progress (bytes)."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    weight: int = 0


@dataclass(frozen=True)
class Resources:
    """What each task asks Ray for."""

    cpus: float = 1.0
    memory: int = 0  # bytes; 0 asks for none


def run_tasks(
    tasks: Sequence[Task],
    resources: Resources,
    progress: Callable[[int, int], None] | None = None,
) -> list[Any]:
    """Every task's result, in order. The first task to fail ends the run: the others are
    cancelled and its error raised here; so are they on an interruption."""
    ray = ray_module()
    options: dict[str, Any] = {"num_cpus": resources.cpus, "max_retries": MAX_RETRIES}
    if resources.memory:
        options["memory"] = resources.memory
    remotes: dict[Callable[..., Any], Any] = {}
    refs = []
    for task in tasks:
        remote = remotes.setdefault(task.function, ray.remote(task.function))
        refs.append(remote.options(**options).remote(*task.args))
    pending = list(refs)
    try:
        return _gather(ray, pending, [task.weight for task in tasks], progress)
    except BaseException:
        _cancel(ray, pending)
        raise


def _cancel(ray: ModuleType, pending: list[Any]) -> None:
    """Cancel the tasks not finished. Only those: Ray 2.60 aborts the driver ("Tried to
    complete task that was not pending") when a task it is told to cancel finishes."""
    if not pending:
        return
    _, running = ray.wait(pending, num_returns=len(pending), timeout=0)
    for ref in running:
        ray.cancel(ref, force=True)


def _gather(
    ray: ModuleType,
    pending: list[Any],
    weights: list[int],
    progress: Callable[[int, int], None] | None,
) -> list[Any]:
    """The results of `pending`, which holds the tasks not yet finished as they finish."""
    position = {ref: index for index, ref in enumerate(pending)}
    results: list[Any] = [None] * len(pending)
    done_bytes, total = 0, sum(weights)
    signals = current_signals()
    while pending:
        ready, _ = ray.wait(pending, num_returns=1, timeout=_POLL)
        for ref in ready:
            pending.remove(ref)
            results[position[ref]] = _result(ray, ref)
            done_bytes += weights[position[ref]]
            if progress is not None:
                progress(done_bytes, total)
        if signals is not None:  # a signal is kept while Ray's frames run (core.signals)
            signals.raise_deferred()
    return results


def _result(ray: ModuleType, ref: Any) -> Any:
    """A task's result; the error it raised, as raised; a task Ray gave up on, as a
    ClusterError."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        # The error the task raised, as a local run raises it: a CkptfixError is its one
        # line; anything else is handled here as it would be there (not Ray's wrapper,
        # whose text is the worker's traceback in terminal colours).
        if isinstance(exc.cause, Exception):
            raise exc.cause from None
        raise
    except ray.exceptions.RayError as exc:
        raise ClusterError(
            None,
            f"a Ray task failed after {MAX_RETRIES} retries ({type(exc).__name__})",
            "check the cluster's nodes and logs (ray status), then run again",
        ) from None
