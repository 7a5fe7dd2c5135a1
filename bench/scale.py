"""`make bench` job for checkpoints of very many tensors and for stride-0 expansions
(`bench.py --only scale`). Alone: `python bench/scale.py [--tree PATH] [--before PATH]
[--repeat N] [--only million|expansion] [--write-expansion]`; with --before, the two
checkouts take turns for each command, so that they share the machine's load alike.

Inputs, built once into .bench-cache/:
- 1,000,000 one-byte U8 tensors `t.<i>` in one header (bench.py's `million` input, 70 MB);
- 1,000,000 expert matrices named as a mixture of experts names them
  (`model.layers.<l>.mlp.experts.<e>.<gate|up|down>_proj.weight`, 80 layers × 4,167 experts ×
  3), BF16 [8, 16] each, in a folder of 100 shards and its index (256 MB of data);
- a `torch.save` file holding `torch.zeros(1).expand(2**32)`: 16 GiB from 4 stored bytes.

Each command runs in a fresh process, `python -m ckptfix` with PYTHONPATH the checkout
measured, under GNU time: wall time, CPU time (user + sys: less sensitive than wall time to
other work on the machine) and peak RSS (the child's ru_maxrss, which counts resident
file-mapped pages too). Median wall and CPU of --repeat runs, the largest peak. The load
average is printed after each row: on a shared machine, wall times follow it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import CACHE, PYTHON, million_tensors, write_folder  # noqa: E402

LAYERS, EXPERTS, MATRICES = 80, 4_167, ("gate_proj", "up_proj", "down_proj")
TARGETS = {"inspect": 5.0, "reshard --dry-run": 10.0}  # seconds (issue 22); 1 GB peak for both
PEAK_TARGET_MIB = 10**9 / 2**20
EXPANSION = """
import sys, torch
torch.save({"expanded": torch.zeros(1).expand(2**32), "w": torch.ones(4, 4)}, sys.argv[1])
"""


@dataclass
class Sample:
    wall: float
    cpu: float
    peak_mib: float
    code: int


def moe_million() -> Path:
    """A folder of 100 shards of 10,000 expert matrices each (1,000,000 such names make a
    119 MB header, over the format's 100 MB limit: no one file can hold them)."""
    folder = CACHE / "moe-million-100shards"
    if not folder.exists():
        print(f"building {folder} ...", flush=True)
        tensors = [
            (f"model.layers.{layer}.mlp.experts.{expert}.{matrix}.weight", (8, 16))
            for layer in range(LAYERS)
            for expert in range(EXPERTS)
            for matrix in MATRICES
        ]
        write_folder(folder, [tensors[i : i + 10_000] for i in range(0, len(tensors), 10_000)])
    return folder


def expansion_file() -> Path:
    path = CACHE / "expand-16gib.pt"
    if not path.exists():
        subprocess.run([PYTHON, "-c", EXPANSION, str(path)], check=True)
    return path


def once(tree: str, args: list[str]) -> Sample:
    env = dict(os.environ, PYTHONPATH=tree)
    with tempfile.NamedTemporaryFile("r", suffix=".time") as report:
        command = ["/usr/bin/time", "-f", "%e %U %S %M", "-o", report.name, PYTHON, "-m"]
        done = subprocess.run(
            [*command, "ckptfix", *args],
            env=env,
            cwd="/tmp",  # so that -m finds the checkout PYTHONPATH names
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            check=False,
        )
        wall, user, system, peak = report.read().split()[-4:]
    return Sample(float(wall), float(user) + float(system), int(peak) / 1024, done.returncode)


def measured(trees: list[str], args: list[str], repeat: int) -> list[Sample]:
    """Median wall and CPU and the largest peak of each tree's runs, the trees taking turns
    (so that they share the machine's load alike)."""
    runs: list[list[Sample]] = [[] for _ in trees]
    for _ in range(repeat):
        for samples, tree in zip(runs, trees, strict=True):
            samples.append(once(tree, args))
    return [
        Sample(
            statistics.median(s.wall for s in samples),
            statistics.median(s.cpu for s in samples),
            max(s.peak_mib for s in samples),
            samples[-1].code,
        )
        for samples in runs
    ]


def _load() -> str:
    return "/".join(f"{value:.1f}" for value in os.getloadavg())


def _cell(sample: Sample) -> str:
    return f"{sample.wall:.2f} s / {sample.cpu:.2f} s / {sample.peak_mib:.0f} MiB ({sample.code})"


def _row(label: str, samples: list[Sample], target: float | None) -> str:
    """The job, each tree's cell, the last tree's against the first (CPU), the load after
    the row, and the last tree against the target."""
    last = samples[-1]
    goal = "-"
    if target is not None:
        met = last.wall <= target and last.peak_mib <= PEAK_TARGET_MIB
        goal = f"≤ {target:g} s, ≤ 1 GB: {'met' if met else 'MISSED'}"
    ratio = f" {last.cpu / samples[0].cpu:.2f}× |" if len(samples) > 1 else ""
    cells = " | ".join(map(_cell, samples))
    return f"| {label} | {cells} |{ratio} {_load()} | {goal} |"


def _head(trees: list[str], labels: list[str] | None = None) -> list[str]:
    names = labels or [f"{os.path.basename(tree)}: wall / CPU / peak RSS (exit)" for tree in trees]
    ratio = ["CPU after / before"] if len(trees) > 1 else []
    columns = ["job", *names, *ratio, "load after", "target (wall, peak)"]
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def bench_million(trees: list[str], repeat: int) -> Iterator[str]:
    # (1,000,000 expert names make a 119 MB header in one shard: 50 MB shards, 6 headers)
    inputs = {
        "1,000,000 U8 tensors": (million_tensors(), []),
        "1,000,000 experts, 100 shards": (moe_million(), ["--max-shard", "50MB"]),
    }
    out = str(CACHE / "scale-out")
    yield (
        f"\n1,000,000 tensors: {', '.join(trees)}; median of {repeat} (wall, CPU: user + "
        "sys), largest peak RSS; load average (1/5/15 min) after each row\n"
    )
    yield from _head(trees)
    for label, (path, shards) in inputs.items():
        jobs = [
            ("inspect", ["inspect", str(path)]),
            ("inspect --json", ["inspect", str(path), "--json"]),
            ("inspect --tensors", ["inspect", str(path), "--tensors"]),
            ("reshard --dry-run", ["reshard", str(path), "-o", out, "--dry-run", *shards]),
        ]
        for job, args in jobs:
            yield _row(f"`{job}`, {label}", measured(trees, args, repeat), TARGETS.get(job))


def bench_expansion(trees: list[str], write: bool) -> Iterator[str]:
    """convert of 16 GiB expanded from 4 bytes by each tree: refused (a checkout from before
    the rule writes it all), and by the last with --allow-expansion when `write` (16 GiB
    written)."""
    source, out = str(expansion_file()), CACHE / "scale-expansion-out"
    yield "\nconvert of a stride-0 expansion, 16 GiB from 4 bytes; one run each\n"
    yield from _head(["-"], ["wall / CPU / peak RSS (exit)"])
    jobs = [(tree, ["convert", source, "-o", str(out)]) for tree in trees]
    if write:
        jobs.append((trees[-1], [*jobs[-1][1], "--allow-expansion"]))
    for tree, args in jobs:
        shutil.rmtree(out, ignore_errors=True)
        sample = once(tree, args)
        written = sum(item.stat().st_size for item in out.iterdir()) if out.exists() else 0
        shutil.rmtree(out, ignore_errors=True)
        label = f"{os.path.basename(tree)}: `{' '.join(args[:1] + args[4:])}`, {written:,} bytes written"
        yield _row(label, [sample], None)


def bench_scale(repeat: int, trees: list[str] | None = None, write: bool = False) -> Iterator[str]:
    trees = trees or [str(ROOT)]
    yield from bench_million(trees, repeat)
    yield from bench_expansion(trees, write)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tree", default=str(ROOT), help="the checkout to measure")
    parser.add_argument("--before", help="a checkout to compare it with, runs taking turns")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--write-expansion", action="store_true", help="also convert it with --allow-expansion"
    )
    parser.add_argument("--only", choices=["million", "expansion"], default=None)
    args = parser.parse_args()
    trees = [os.path.abspath(tree) for tree in (args.before, args.tree) if tree]
    if args.only in (None, "million"):
        for row in bench_million(trees, args.repeat):
            print(row, flush=True)
    if args.only in (None, "expansion"):
        for row in bench_expansion(trees, args.write_expansion):
            print(row, flush=True)


if __name__ == "__main__":
    main()
