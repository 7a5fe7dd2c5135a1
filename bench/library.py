"""`make bench` job for the library (`bench.py --only library`).

save: a 2 GB state dict of torch tensors in memory (bf16, llama-sized matrices, one of them
a transposed view, one pair of names sharing a tensor) written by `ckptfix.save`, by
huggingface_hub's `save_torch_state_dict` and by `safetensors.torch.save_file` (which takes
neither shared nor non-contiguous tensors: its input is made contiguous and deduplicated in
the timed part, as a caller must). Each run is a fresh process; wall is the call's, peak RSS
above the tensors is VmHWM (reset just before the call) minus the RSS the tensors take.
ckptfix fsyncs what it writes and the others do not, so they are timed with an fsync of
their files too.

open().get(): one 128 MiB tensor read from a 2 GB torch.distributed.checkpoint folder; the
bytes read are the process's read() bytes (/proc/self/io rchar) over the call.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench import CACHE, PYTHON

ROOT = Path(__file__).resolve().parent.parent

MAKE_STATE = """
import torch
ROWS, COLUMNS = 8192, 8192  # 128 MiB in bf16
def make_state():
    state = {}
    for index in range(14):
        state[f"model.layers.{index}.weight"] = torch.full((ROWS, COLUMNS), index / 7, dtype=torch.bfloat16)
    state["model.embed_tokens.weight"] = torch.full((ROWS, COLUMNS), -1.0, dtype=torch.bfloat16)
    state["model.layers.14.proj"] = torch.full((COLUMNS, ROWS // 2), 3.0, dtype=torch.bfloat16).t()
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied
    return state
"""

SAVE = (
    MAKE_STATE
    + """
import json, os, sys, time
method, out = sys.argv[1], sys.argv[2]
def memory(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field))
def fsync_tree(folder):
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
if method.startswith("ckptfix"):
    import ckptfix
    ckptfix.save({"warm": torch.ones(4)}, out + "-warm")
    def call(state):
        ckptfix.save(state, out)
else:
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import save_file
    save_file({"warm": torch.ones(4)}, out + "-warm.safetensors")
    def call(state):
        os.makedirs(out)
        if method.startswith("hub"):
            save_torch_state_dict(state, out)
        else:
            ready = {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}
            save_file(ready, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        if method.endswith("+fsync"):
            fsync_tree(out)
state = make_state()
tensors = memory("VmRSS")
with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")
start = time.perf_counter()
call(state)
wall = time.perf_counter() - start
print(json.dumps({"wall": wall, "above": memory("VmHWM") - tensors}))
"""
)

METHODS = [
    ("ckptfix", "`ckptfix.save` (verified, fsynced)"),
    ("hub", "`huggingface_hub.save_torch_state_dict`"),
    ("hub+fsync", "`save_torch_state_dict` + fsync"),
    ("safetensors", "`safetensors.torch.save_file`"),
    ("safetensors+fsync", "`save_file` + fsync"),
]


def _save_once(method: str, work: Path) -> dict[str, float]:
    out = work / f"out-{method}"
    done = subprocess.run(
        [PYTHON, "-c", SAVE, method, str(out)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{method} failed: {done.stderr[-2000:]}")
    for leftover in work.iterdir():
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()
    measured: dict[str, float] = json.loads(done.stdout)
    return measured


def _load() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


def bench_save(repeat: int) -> list[str]:
    work = CACHE / "library-save"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    samples: dict[str, list[dict[str, float]]] = {method: [] for method, _ in METHODS}
    load = _load()  # the machine may be shared: say how busy it was
    for _ in range(repeat):  # interleaved, so that a busy spell weighs on every method alike
        for method, _ in METHODS:
            samples[method].append(_save_once(method, work))
    walls = {m: statistics.median(s["wall"] for s in samples[m]) for m in samples}
    least = {m: min(s["wall"] for s in samples[m]) for m in samples}
    rows = [
        "\n2.0 GiB of bf16 tensors in memory (14 matrices of 128 MiB, a tied pair, a transposed "
        f"64 MiB view); {repeat} runs each, wall median (min), max peak RSS above the tensors; "
        f"load average {load}\n",
        "| writer | wall | peak RSS above the tensors |",
        "|---|---|---|",
    ]
    for method, label in METHODS:
        above = max(s["above"] for s in samples[method]) / 2**20
        rows.append(
            f"| {label} | {walls[method]:.2f} s ({least[method]:.2f} s) | {above:.0f} MiB |"
        )
    for by, name in ((walls, "median"), (least, "min")):
        ratio = by["ckptfix"] / min(by["hub"], by["safetensors"])
        synced = by["ckptfix"] / min(by["hub+fsync"], by["safetensors+fsync"])
        rows.append(
            f"\nckptfix / the faster of the two ({name}): {ratio:.2f}x as they are, "
            f"{synced:.2f}x with their files fsynced (target <= 1.0x)"
        )
    rows.append(f"load average after: {_load()}")
    shutil.rmtree(work, ignore_errors=True)
    return rows


MAKE_DCP = """
import sys, torch, torch.distributed.checkpoint as dcp
state = {f"model.layers.{i}.weight": torch.full((8192, 8192), float(i), dtype=torch.bfloat16) for i in range(16)}
dcp.save({"model": state}, checkpoint_id=sys.argv[1])
"""

GET = """
import json, sys, time, torch, ckptfix
def read_so_far():
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar"))
with ckptfix.open(sys.argv[1]) as reader:  # modules imported, page cache warm
    reader.get("model.layers.0.weight", framework="pt")
before = read_so_far()
start = time.perf_counter()
with ckptfix.open(sys.argv[1]) as reader:
    opened = read_so_far()
    tensor = reader.get(sys.argv[2], framework="pt")
wall = time.perf_counter() - start
print(json.dumps({"open": opened - before, "get": read_so_far() - opened, "nbytes": tensor.nbytes, "wall": wall}))
"""


def bench_get(repeat: int) -> list[str]:
    folder = CACHE / "library-dcp"
    if not (folder / ".metadata").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        subprocess.run([PYTHON, "-c", MAKE_DCP, str(folder)], check=True, env=env)
    size = sum(path.stat().st_size for path in folder.iterdir())
    metadata = (folder / ".metadata").stat().st_size
    runs = []
    for _ in range(repeat):
        done = subprocess.run(
            [PYTHON, "-c", GET, str(folder), "model.layers.7.weight"],
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append(json.loads(done.stdout))
    worst = max(runs, key=lambda run: run["open"] + run["get"])
    return [
        f"\nopen().get() of one tensor from a {size / 2**30:.2f} GiB DCP folder "
        f"(.metadata {metadata} bytes), {repeat} runs\n",
        "| tensor bytes | read by open() | read by get() | get() beyond the tensor | wall (median) |",
        "|---|---|---|---|---|",
        f"| {worst['nbytes']:,} | {worst['open']:,} | {worst['get']:,} | "
        f"{worst['get'] - worst['nbytes']:,} | "
        f"{statistics.median(run['wall'] for run in runs):.3f} s |",
    ]


def bench_library(repeat: int) -> list[str]:
    return bench_save(repeat) + bench_get(repeat)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "bench"))
    for row in bench_library(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
        print(row, flush=True)
