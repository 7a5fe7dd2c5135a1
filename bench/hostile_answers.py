"""Hostile server answers, measured: `ckptfix inspect` of the test model served by each
backend's test server (tests/remote_servers.py) while it sends each answer of
tests/hostile_answers.py, against the same server behaving.

    python bench/hostile_answers.py [--tree CHECKOUT] [--timeout 90] [BACKEND ...]

Each run is a fresh process, `python -m ckptfix inspect URL`, with CKPTFIX_REMOTE_TIMEOUT=2
and CKPTFIX_REMOTE_RETRIES=0 (as tests/test_remote_hostile.py runs them); its peak RSS is
the highest VmHWM read from /proc every 50 ms and as it exits, its time perf_counter's
around it. A run past --timeout seconds is killed and shown as such. With --tree the
processes run that checkout's ckptfix (an older one, for a before/after); the servers are
always this checkout's tests.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402  (its MonkeyPatch sets what points ckptfix at a server)

from tests.hostile_answers import KINDS, applies  # noqa: E402
from tests.remote_servers import BACKENDS, Served, served_model, serving  # noqa: E402

MIB = 2**20
# the peak as the process exits: a 50 ms poll may miss the last rise
_WRAPPER = """
import runpy, sys
try:
    sys.argv = ["ckptfix", *sys.argv[1:]]
    runpy.run_module("ckptfix", run_name="__main__")
finally:
    with open("/proc/self/status") as status:
        peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    sys.stderr.write(f"\\nVmHWM-kB {peak}\\n")
"""


@dataclass
class Run:
    code: int | None  # None: killed at the timeout
    seconds: float
    peak: int  # bytes
    last_line: str
    bytes_sent: int


def _peak_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            found = [line.split()[1] for line in status if line.startswith("VmHWM:")]
    except OSError:
        return 0
    return int(found[0]) * 1024 if found else 0


def inspect(served: Served, tree: str, timeout: float) -> Run:
    env = {
        **os.environ,
        "PYTHONPATH": tree,
        "CKPTFIX_REMOTE_TIMEOUT": "2",
        "CKPTFIX_REMOTE_RETRIES": "0",
    }
    served.server.behaviour.bytes_sent = 0
    with tempfile.TemporaryDirectory() as cwd:  # not this checkout's ckptfix by accident
        start = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-c", _WRAPPER, "inspect", served.url],
            cwd=cwd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        polled = [0]
        done = threading.Event()

        def poll() -> None:
            while not done.wait(0.05):
                polled[0] = max(polled[0], _peak_of(process.pid))

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        try:
            _, stderr = process.communicate(timeout=timeout)
            code: int | None = process.returncode
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
            code = None
        seconds = time.perf_counter() - start
        done.set()
        watcher.join()
    lines = [line for line in stderr.splitlines() if line.strip()]
    reported = [int(line.split()[1]) * 1024 for line in lines if line.startswith("VmHWM-kB")]
    shown = [line for line in lines if not line.startswith("VmHWM-kB")]
    peak = max([polled[0], *reported])
    return Run(code, seconds, peak, shown[-1] if shown else "", served.server.behaviour.bytes_sent)


def _row(backend: str, kind: str, run: Run, good: Run | None) -> str:
    code = "killed" if run.code is None else str(run.code)
    extra = " | |"
    if good is not None:
        extra = f" | {(run.peak - good.peak) / MIB:+.0f} | {run.seconds - good.seconds:+.1f}"
    what = run.last_line.replace("|", "/")[:150]
    return (
        f"| {backend} | {kind} | {code} | {run.peak / MIB:.0f} | {run.seconds:.1f}{extra} "
        f"| {run.bytes_sent // 1024:,} | {what} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", default=str(ROOT), help="the checkout whose ckptfix runs")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds before a kill")
    parser.add_argument("--kinds", nargs="*", default=list(KINDS))
    parser.add_argument("backends", nargs="*", default=list(BACKENDS))
    options = parser.parse_args()
    print(f"tree {options.tree}; load average {os.getloadavg()[0]:.1f} at the start")
    print(
        "| backend | answer | exit | peak RSS MiB | seconds | +RSS MiB | +seconds "
        "| KiB sent | last line |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for backend in options.backends:
            root = Path(scratch) / backend
            with (
                pytest.MonkeyPatch.context() as env,
                serving(backend, root, served_model(root), env) as served,
            ):
                good = inspect(served, options.tree, options.timeout)
                print(_row(backend, "(behaving)", good, None), flush=True)
                for kind in options.kinds:
                    if not applies(backend, kind):
                        continue
                    served.server.behaviour.reset()
                    served.server.behaviour.hostile = kind
                    run = inspect(served, options.tree, options.timeout)
                    print(_row(backend, kind, run, good), flush=True)
                    served.server.behaviour.reset()
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
