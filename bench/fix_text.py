"""A finding's `fix` text costs a repair plan: made only where a report is shown (issue 23).

    python bench/fix_text.py TREE      # TREE: a checkout of ckptfix (its tests/builders too)

Builds a 200-shard folder whose shards lack "format" metadata (200 warnings), then times
`reshard --dry-run` and `hash` in-process: the median and least CPU time (process_time, less
disturbed by other load on the machine than wall time) of 41 runs after one warm-up.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SHARDS = 200


def timed(run: Callable[[], object]) -> tuple[float, float]:
    run()
    samples = []
    for _ in range(41):
        start = time.process_time()
        run()
        samples.append(time.process_time() - start)
    return statistics.median(samples) * 1000, min(samples) * 1000


def main(tree: str) -> None:
    sys.path.insert(0, tree)
    import ckptfix
    from ckptfix.ops.hash import hash_checkpoint
    from ckptfix.ops.rewrite_options import ReshardOptions
    from tests.builders import Factory, Spec

    root = Path(tempfile.mkdtemp(prefix="fix-text-"))
    factory = Factory(root)
    shards = [[Spec(f"layer{i}.w{j}", "F32", (4,)) for j in range(2)] for i in range(SHARDS)]
    folder = factory.sharded("m", shards)
    for number, specs in enumerate(shards, start=1):
        factory.safetensors(
            f"m/model-{number:05d}-of-{SHARDS:05d}.safetensors", specs, with_format=False
        )
    warnings = ckptfix.inspect(folder).count_code("missing-format-metadata")
    print(f"{ckptfix.__file__}: {warnings} warnings")
    dry_run = ReshardOptions(dry_run=True)
    median, least = timed(lambda: ckptfix.reshard(folder, root / "out", dry_run))
    print(f"reshard --dry-run: median {median:.1f} ms, least {least:.1f} ms (CPU)")
    median, least = timed(lambda: hash_checkpoint(folder))
    print(f"hash: median {median:.1f} ms, least {least:.1f} ms (CPU)")


if __name__ == "__main__":
    main(sys.argv[1])
