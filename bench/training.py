"""`make bench` jobs for training checkpoints (`bench.py --only dcp|zero`).

DCP: llama-shaped bf16 models saved by 2 gloo ranks with FSDP-style Shard(0) DTensors (each
rank holds only its own rows), converted to safetensors, against `cp -r` + `sync` of the
folder and torch's `dcp_to_torch_save`; peak RSS from 0.5 to 4 GB. ZeRO: a 268M-parameter
model (1.07 GB of fp32 master weights) trained one step with DeepSpeed stages 2 and 3 in
bf16 on CPU, converted against `cp -r` + `sync` and the checkpoint's own `zero_to_fp32.py`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench import CACHE, CKPTFIX, PYTHON, Measure, run

ROOT = Path(__file__).resolve().parent.parent

SAVE_DCP = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
sys.path.insert(0, {bench!r})
from bench import llama_tensors

def save(rank, out, layers, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(rank)
    state = {{}}
    for name, shape in llama_tensors(layers):
        rows = -(-shape[0] // 2)
        mine = min(rows, shape[0] - rank * rows)
        local = torch.randn((mine, *shape[1:]), generator=g, dtype=torch.bfloat16)
        state[name] = DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size(shape),
                                         stride=torch.empty(shape, device="meta").stride())
    dcp.save({{"model": state}}, checkpoint_id=out)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(save, args=(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])), nprocs=2)
"""

DCP_TO_TORCH = """
import os, sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
os.makedirs(sys.argv[2])
target = os.path.join(sys.argv[2], "model.pt")
dcp_to_torch_save(sys.argv[1], target)
fd = os.open(target, os.O_RDONLY)
os.fsync(fd)
os.close(fd)
"""

TRAIN_ZERO = """
import os, sys, torch, torch.multiprocessing as mp

def train(rank, out, stage, port, layers):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_SIZE="2")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096, bias=False) for _ in range(layers)))
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(1, 4096, dtype=torch.bfloat16)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out)

if __name__ == "__main__":
    stage, port, layers = int(sys.argv[2]), int(sys.argv[4]), int(sys.argv[3])
    mp.spawn(train, args=(sys.argv[1], stage, port, layers), nprocs=2)
"""

ZERO_TO_FP32 = """
import os, subprocess, sys
os.makedirs(sys.argv[2])
subprocess.run([sys.executable, os.path.join(sys.argv[1], "zero_to_fp32.py"), sys.argv[1],
                sys.argv[2], "--safe_serialization"], check=True, stdout=subprocess.DEVNULL)
for name in os.listdir(sys.argv[2]):  # fsynced like ckptfix's output
    fd = os.open(os.path.join(sys.argv[2], name), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _build(folder: Path, script: str, *args: str) -> Path:
    if not folder.exists():
        print(f"building {folder} ...", flush=True)
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        env = {**os.environ, "DS_BUILD_OPS": "0"}
        CACHE.mkdir(exist_ok=True)
        program = CACHE / f"{folder.name}-writer.py"  # a file: spawned ranks re-import it
        program.write_text(script)
        subprocess.run(
            [PYTHON, str(program), str(partial), *args, str(_free_port())],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        partial.rename(folder)
    return folder


DCP_LAYERS = {"0.5gb": 3, "2gb": 22, "4gb": 44}


def dcp_input(key: str) -> Path:
    """The DCP folder of that size, built on first use."""
    script = SAVE_DCP.format(bench=str(ROOT / "bench"))
    return _build(CACHE / f"dcp-llama-{key}", script, str(DCP_LAYERS[key]))


def dcp_inputs() -> dict[str, Path]:
    return {key: dcp_input(key) for key in DCP_LAYERS}


def folder_size(path: Path) -> int:
    return sum(item.stat().st_size for item in path.rglob("*") if item.is_file())


def _warm(folder: Path) -> None:
    for item in folder.rglob("*"):
        if item.is_file():
            subprocess.run(["cat", str(item)], stdout=subprocess.DEVNULL, check=True)
    subprocess.run(["sync"], check=True)


def samples(
    command: list[str], out: Path, source: Path, repeat: int, made: str | None = None
) -> list[Measure]:
    """Each run's wall and peak RSS, into a fresh OUT, the source folder in the page cache;
    with `made`, a run that leaves no OUT/made stops the bench (`run` lets exit 1 pass)."""
    measured = []
    for _ in range(repeat):
        shutil.rmtree(out, ignore_errors=True)
        _warm(source)
        measured.append(run(command))
        if made is not None and not (out / made).exists():
            raise SystemExit(f"{' '.join(command)} wrote no {made}")
    shutil.rmtree(out, ignore_errors=True)
    return measured


def timed(command: list[str], out: Path, source: Path, repeat: int) -> Measure:
    """Median wall and max peak RSS over fresh OUTs, the source folder in the page cache."""
    measured = samples(command, out, source, repeat)
    walls = sorted(s.wall for s in measured)
    return Measure(walls[len(walls) // 2], max(s.rss_mib for s in measured))


def copy_folder(source: Path, out: Path, repeat: int) -> Measure:
    command = f"cp -r {source} {out} && sync -f {out}"
    return timed(["sh", "-c", command], out, source, repeat)


def _row(label: str, measure: Measure, base: Measure, target: str = "") -> str:
    return (
        f"| {label} | {measure.wall:.2f} s | {measure.rss_mib:.0f} MiB | "
        f"{measure.wall / base.wall:.2f}× | {target} |"
    )


def _verdict(ours: Measure, cp: Measure) -> str:
    ok = ours.wall <= 1.5 * cp.wall and ours.rss_mib <= 250
    return f"≤ 1.5× and ≤ 250 MiB: {'met' if ok else 'MISSED'}"


def bench_dcp(repeat: int) -> list[str]:
    inputs = dcp_inputs()
    source, out = inputs["2gb"], CACHE / "bench-out"
    cp = copy_folder(source, out, repeat)
    ours = timed([*CKPTFIX, "convert", str(source), "-o", str(out), "--json"], out, source, repeat)
    torch_way = timed([PYTHON, "-c", DCP_TO_TORCH, str(source), str(out)], out, source, repeat)
    rows = [
        f"\nDCP ({folder_size(source) / 1e9:.2f} GB, 2 ranks, Shard(0), bf16) to safetensors; "
        f"median of {repeat}, source in the page cache, outputs fsynced\n",
        "| job | wall | peak RSS | vs cp | target |",
        "|---|---|---|---|---|",
        _row("`cp -r` + `sync` of the folder", cp, cp),
        _row("`ckptfix convert` (verified, fsynced, atomic)", ours, cp, _verdict(ours, cp)),
        _row("`dcp_to_torch_save` (+ fsync)", torch_way, cp),
        f"\nckptfix vs dcp_to_torch_save: {torch_way.wall / ours.wall:.2f}× faster, "
        f"{torch_way.rss_mib / ours.rss_mib:.0f}× less memory",
        "\npeak RSS of `ckptfix convert` of a DCP folder by checkpoint size\n",
        "| checkpoint | wall | peak RSS |",
        "|---|---|---|",
    ]
    peaks = []
    for folder in inputs.values():
        measure = timed([*CKPTFIX, "convert", str(folder), "-o", str(out)], out, folder, 2)
        peaks.append(measure.rss_mib)
        rows.append(
            f"| {folder_size(folder) / 1e9:.2f} GB | {measure.wall:.2f} s | {measure.rss_mib:.0f} MiB |"
        )
    ratio = peaks[-1] / peaks[0]
    rows.append(
        f"\n4 GB vs 0.5 GB peak RSS: {ratio:.2f}× (flat: {'met' if abs(ratio - 1) <= 0.10 else 'MISSED'})"
    )
    return rows


def _output_copy(source: Path, repeat: int) -> Measure:
    """cp + sync of a file as large as the output: the bytes a conversion must write."""
    made = CACHE / "bench-made"
    shutil.rmtree(made, ignore_errors=True)
    subprocess.run(
        [*CKPTFIX, "convert", str(source), "-o", str(made)], check=True, stdout=subprocess.DEVNULL
    )
    out = CACHE / "bench-out"
    command = f"mkdir {out} && cp {made}/model.safetensors {out}/ && sync -f {out}"
    measure = timed(["sh", "-c", command], out, made, repeat)
    shutil.rmtree(made)
    return measure


def _zero_input(stage: int, layers: int) -> Path:
    """A model of `layers` 4096 x 4096 layers (16.8M parameters, 67 MB of fp32 master
    weights each) trained one step under ZeRO `stage`."""
    millions = layers * 4096 * 4096 // 10**6
    return _build(CACHE / f"zero{stage}-{millions}m", TRAIN_ZERO, str(stage), str(layers))


def zero_flatness(stage: int) -> list[str]:
    """Peak RSS of `ckptfix convert` of a ZeRO checkpoint by size: 0.54 to 2.15 GB of fp32
    master weights (4 GB would need about 20 GB of RAM to train on CPU here)."""
    out = CACHE / "bench-out"
    rows = [
        f"\npeak RSS of `ckptfix convert` of a ZeRO-{stage} checkpoint by size of its fp32 "
        "master weights\n",
        "| master weights | folder | wall | peak RSS |",
        "|---|---|---|---|",
    ]
    peaks = []
    for layers in (8, 16, 32):
        source = _zero_input(stage, layers)
        measure = timed([*CKPTFIX, "convert", str(source), "-o", str(out)], out, source, 2)
        peaks.append(measure.rss_mib)
        rows.append(
            f"| {layers * 4096 * 4096 * 4 / 1e9:.2f} GB | {folder_size(source) / 1e9:.2f} GB | "
            f"{measure.wall:.2f} s | {measure.rss_mib:.0f} MiB |"
        )
    ratio = peaks[-1] / peaks[0]
    ok = abs(ratio - 1) <= 0.10 and max(peaks) <= 250
    rows.append(
        f"\n2.15 GB vs 0.54 GB peak RSS: {ratio:.2f}× (≤ 250 MiB and flat: "
        f"{'met' if ok else 'MISSED'})"
    )
    return rows


def bench_zero(repeat: int) -> list[str]:
    rows = []
    out = CACHE / "bench-out"
    for stage in (2, 3):
        source = _zero_input(stage, 16)
        cp = copy_folder(source, out, repeat)
        ours = timed([*CKPTFIX, "convert", str(source), "-o", str(out)], out, source, repeat)
        theirs = timed([PYTHON, "-c", ZERO_TO_FP32, str(source), str(out)], out, source, repeat)
        written = _output_copy(source, repeat)
        rows += [
            f"\nZeRO-{stage} (2 ranks, bf16 training, 1.07 GB of fp32 master weights; the folder "
            f"holds {folder_size(source) / 1e9:.2f} GB with the optimizer state) to safetensors; "
            f"median of {repeat}, source in the page cache, outputs fsynced\n",
            "| job | wall | peak RSS | vs cp | target |",
            "|---|---|---|---|---|",
            _row("`cp -r` + `sync` of the folder", cp, cp),
            _row("`ckptfix convert` (verified, fsynced, atomic)", ours, cp, _verdict(ours, cp)),
            _row("`zero_to_fp32.py --safe_serialization` (+ fsync)", theirs, cp),
            _row("`cp` + `sync` of one file of the output's size (1.07 GB)", written, cp),
            f"\nckptfix vs zero_to_fp32.py: {theirs.wall / ours.wall:.2f}× faster, "
            f"{theirs.rss_mib / ours.rss_mib:.0f}× less memory",
            *zero_flatness(stage),
        ]
    return rows


if __name__ == "__main__":
    sys.exit("run bench/bench.py --only dcp or --only zero")
