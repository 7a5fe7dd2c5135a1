"""`make bench` job for start-up time (`bench.py --only startup`): what a user waits for
before ckptfix does anything. `ckptfix inspect --help` is the figure the architecture issue
asks to keep; beside it bare Python, `import ckptfix`, and `inspect` of a tiny file (which
must not import the writers or torch)."""

from __future__ import annotations

import sys
from pathlib import Path

from bench import CACHE, PYTHON, median, write_safetensors

# The console script when installed (what users run), else `python -m ckptfix`.
_SCRIPT = Path(PYTHON).with_name("ckptfix")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [PYTHON, "-m", "ckptfix"]


def _tiny() -> Path:
    path = CACHE / "startup-tiny.safetensors"
    if not path.exists():
        CACHE.mkdir(exist_ok=True)
        write_safetensors(path, [("w", (4, 4))])
    return path


def bench_startup(repeat: int) -> list[str]:
    repeat = max(repeat, 10)
    jobs = [
        ("`python -c pass` (the interpreter alone)", [PYTHON, "-c", "pass"]),
        ("`python -c 'import ckptfix'`", [PYTHON, "-c", "import ckptfix"]),
        ("`ckptfix --help`", [*CLI, "--help"]),
        ("`ckptfix inspect --help`", [*CLI, "inspect", "--help"]),
        ("`ckptfix inspect` of a one-tensor safetensors file", [*CLI, "inspect", str(_tiny())]),
    ]
    rows = [
        f"\nstart-up: median wall of {repeat} runs after one warm-up (.pyc files and page "
        "cache warm)\n",
        "| job | wall | peak RSS |",
        "|---|---|---|",
    ]
    for label, command in jobs:
        measure = median(command, repeat)
        rows.append(f"| {label} | {measure.wall * 1000:.0f} ms | {measure.rss_mib:.0f} MiB |")
    return rows


if __name__ == "__main__":
    sys.exit("run bench/bench.py --only startup")
