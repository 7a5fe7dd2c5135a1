"""Before/after: the same commands on the same inputs (make bench's) with two checkouts of
ckptfix, in the same virtualenv, runs taking turns old/new.

    git worktree add /tmp/ckptfix-old 20b9a85
    python bench/before_after.py /tmp/ckptfix-old [help] [inspect] [reshard] [convert] [many]
    NEW_TREE=/tmp/ckptfix-mid python bench/before_after.py /tmp/ckptfix-old ...

Wall time by perf_counter around each fresh process, peak RSS by /usr/bin/time; each write
goes to a fresh OUT with its source in the page cache. The processes run in /tmp, so that
`python -m ckptfix` finds the checkout named by PYTHONPATH, not the one in the current folder.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench

# the checkout compared with OLD_TREE: this one, or NEW_TREE (e.g. a commit between the two)
NEW = os.environ.get("NEW_TREE") or str(Path(__file__).resolve().parent.parent)
REPEAT = int(os.environ.get("REPEAT", "7"))
Sample = tuple[float, float]  # wall seconds, peak RSS MiB


def once(tree: str, args: list[str]) -> Sample:
    env = dict(os.environ, PYTHONPATH=tree)
    with tempfile.NamedTemporaryFile("r", suffix=".time") as report:
        command = ["/usr/bin/time", "-f", "%M", "-o", report.name, bench.PYTHON, "-m", "ckptfix"]
        start = time.perf_counter()
        subprocess.run([*command, *args], env=env, cwd="/tmp", capture_output=True, check=False)
        wall = time.perf_counter() - start
        return wall, int(report.read().split()[-1]) / 1024


def _fresh(out: Path, source: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    files = sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    subprocess.run(["sync"], check=True)


def _cell(samples: list[Sample]) -> str:
    walls = [wall for wall, _ in samples]
    rss = max(peak for _, peak in samples)
    return f"{min(walls):.3f} / {statistics.median(walls):.3f} s, {rss:.0f} MiB"


def compare(trees: dict[str, str], label: str, args: list[str], write: Path | None = None) -> str:
    samples: dict[str, list[Sample]] = {name: [] for name in trees}
    for _ in range(REPEAT):
        for name, tree in trees.items():
            if write is not None:
                _fresh(write, Path(args[1]))
            samples[name].append(once(tree, args))
    if write is not None:
        shutil.rmtree(write, ignore_errors=True)
    old, new = ([wall for wall, _ in samples[name]] for name in trees)
    ratio = statistics.median(new) / statistics.median(old)
    cells = " | ".join(_cell(samples[name]) for name in trees)
    return f"| {label} | {cells} | {ratio:.2f}× (min {min(new) / min(old):.2f}×) |"


def jobs(out: Path) -> dict[str, list[tuple[str, list[str], Path | None]]]:
    single = bench.ensure_single()
    five = bench.CACHE / "llama-2gb-5shards"
    if not five.exists():
        bench.write_folder(five, bench.split(bench.llama_tensors(), 5))
    many, binary = bench.many_tensors(), bench.ensure_bin(single)
    shards = bench.many_shards()
    return {
        "help": [("`inspect --help`", ["inspect", "--help"], None)],
        "inspect": [
            (f"`inspect --json`, {path.name}", ["inspect", str(path), "--json"], None)
            for path in (single, five, many)
        ],
        "reshard": [
            (
                "`reshard --max-shard 500MB`, 2.2 GB",
                ["reshard", str(single), "-o", str(out), "--max-shard", "500MB", "--json"],
                out,
            )
        ],
        "convert": [("`convert`, 2.2 GB `.bin`", ["convert", str(binary), "-o", str(out)], out)],
        "many": [
            ("`inspect --json`, 1,100 shards", ["inspect", str(shards), "--json"], None),
            ("`reshard`, 1,100 shards into 1", ["reshard", str(shards), "-o", str(out)], out),
            (
                "`reshard --max-shard 64KiB`, 1,100 shards into 1,100",
                ["reshard", str(shards), "-o", str(out), "--max-shard", "65536"],
                out,
            ),
            ("`hash`, 1,100 shards", ["hash", str(shards)], None),
        ],
    }


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    trees = {"before": sys.argv[1], "after": NEW}
    chosen = sys.argv[2:] or ["help", "inspect", "reshard", "convert", "many"]
    print("| command | before: min / median, peak RSS | after | after / before (median) |")
    print("|---|---|---|---|")
    for name, runs in jobs(bench.CACHE / "before-after-out").items():
        if name in chosen:
            for label, args, write in runs:
                print(compare(trees, label, args, write), flush=True)


if __name__ == "__main__":
    main()
