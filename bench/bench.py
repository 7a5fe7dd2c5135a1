"""`make bench`: time and peak memory of ckptfix against the usual ways of doing the job.

Checkpoints are built once into .bench-cache/ (real random bytes, llama-shaped, bf16).
Each command runs in a fresh process, several times; the table shows medians. Peak RSS
is the child's ru_maxrss from wait4, which counts resident file-mapped pages too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckptfix.formats.safetensors import HeaderEntry, encode_header

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".bench-cache"
PYTHON = sys.executable
CKPTFIX = [PYTHON, "-m", "ckptfix"]

# TinyLlama-1.1B shapes: 2.2 GB in bf16.
HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS = 2048, 5632, 256, 32000, 22


def llama_tensors(layers: int = LAYERS) -> list[tuple[str, tuple[int, ...]]]:
    tensors = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for index in range(layers):
        prefix = f"model.layers.{index}"
        tensors += [
            (f"{prefix}.self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (f"{prefix}.self_attn.k_proj.weight", (KV, HIDDEN)),
            (f"{prefix}.self_attn.v_proj.weight", (KV, HIDDEN)),
            (f"{prefix}.self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (f"{prefix}.mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{prefix}.mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{prefix}.mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
            (f"{prefix}.input_layernorm.weight", (HIDDEN,)),
            (f"{prefix}.post_attention_layernorm.weight", (HIDDEN,)),
        ]
    tensors += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return tensors


def nbytes(shape: tuple[int, ...], itemsize: int = 2) -> int:
    size = itemsize
    for dim in shape:
        size *= dim
    return size


def write_safetensors(
    path: Path, tensors: list[tuple[str, tuple[int, ...]]], dtype: str = "BF16", itemsize: int = 2
) -> None:
    entries, offset = [], 0
    for name, shape in tensors:
        size = nbytes(shape, itemsize)
        entries.append(HeaderEntry(name, dtype, shape, offset, offset + size))
        offset += size
    tmp = path.with_suffix(".partial")
    block = os.urandom(64 * 2**20)
    with open(tmp, "wb") as handle:
        handle.write(encode_header(entries, {"format": "pt"}))
        remaining = offset
        while remaining:
            chunk = block[: min(remaining, len(block))]
            handle.write(chunk)
            remaining -= len(chunk)
    tmp.rename(path)


def split(
    tensors: list[tuple[str, tuple[int, ...]]], parts: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    total = sum(nbytes(shape) for _, shape in tensors)
    target = total / parts
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for tensor in tensors:
        if size >= target and len(shards) < parts:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes(tensor[1])
    return shards


def write_folder(
    folder: Path,
    shards: list[list[tuple[str, tuple[int, ...]]]],
    dtype: str = "BF16",
    itemsize: int = 2,
) -> None:
    tmp = folder.with_name(folder.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(tmp / name, shard, dtype, itemsize)
        for tensor_name, shape in shard:
            weight_map[tensor_name] = name
            total += nbytes(shape, itemsize)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(
        json.dumps({"model_type": "llama", "tie_word_embeddings": False})
    )
    tmp.rename(folder)


def many_tensors() -> Path:
    """50 shards of 2,000 tiny tensors each (156 KiB headers)."""
    CACHE.mkdir(exist_ok=True)
    many = CACHE / "many-50x2000"
    if not many.exists():
        print(f"building {many} ...", flush=True)
        shards = [[(f"blocks.{s}.t{t}.weight", (4,)) for t in range(2000)] for s in range(50)]
        write_folder(many, shards, "F32", 4)
    return many


def million_tensors() -> Path:
    """1,000,000 one-byte tensors in one header (70 MB)."""
    CACHE.mkdir(exist_ok=True)
    million = CACHE / "million-tensors.safetensors"
    if not million.exists():
        print(f"building {million} ...", flush=True)
        write_safetensors(million, [(f"t.{i}", (1,)) for i in range(1_000_000)], "U8", 1)
    return million


def many_shards(count: int = 1100) -> Path:
    """1,100 shards of one 64 KiB tensor each: more files than the common soft limit of
    1,024 descriptors."""
    CACHE.mkdir(exist_ok=True)
    folder = CACHE / f"shards-{count}"
    if folder.exists():
        return folder
    print(f"building {folder} ...", flush=True)
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for number in range(1, count + 1):
        name, file = f"blocks.{number}.weight", f"model-{number:05d}-of-{count:05d}.safetensors"
        entry = HeaderEntry(name, "F32", (128, 128), 0, 4 * 128 * 128)
        data = encode_header([entry], {"format": "pt"}) + os.urandom(4 * 128 * 128)
        (partial / file).write_bytes(data)
        weight_map[name] = file
    index = {"metadata": {"total_size": count * 4 * 128 * 128}, "weight_map": weight_map}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    partial.rename(folder)
    return folder


def ensure_single() -> Path:
    """The 2.2 GB TinyLlama-shaped file alone (the one input the reflink job needs)."""
    CACHE.mkdir(exist_ok=True)
    single = CACHE / "llama-2gb.safetensors"
    if not single.exists():
        print(f"building {single} ...", flush=True)
        write_safetensors(single, llama_tensors())
    return single


def ensure_inputs() -> dict[str, Path]:
    single = ensure_single()
    five = CACHE / "llama-2gb-5shards"
    if not five.exists():
        print(f"building {five} ...", flush=True)
        write_folder(five, split(llama_tensors(), 5))
    many = many_tensors()
    half = CACHE / "llama-0.5gb.safetensors"
    if not half.exists():
        print(f"building {half} ...", flush=True)
        write_safetensors(half, llama_tensors(layers=3))
    four = CACHE / "llama-4gb.safetensors"
    if not four.exists():
        print(f"building {four} ...", flush=True)
        write_safetensors(four, llama_tensors(layers=44))
    million = million_tensors()
    return {
        "single": single,
        "five": five,
        "many": many,
        "half": half,
        "four": four,
        "million": million,
    }


@dataclass
class Measure:
    wall: float
    rss_mib: float
    cpu: float = 0.0  # user + system seconds: what a shared machine's load does not stretch


def run(command: list[str], *, env: dict[str, str] | None = None) -> Measure:
    """Wall time and peak RSS of one run, measured by /usr/bin/time around the command.

    GNU time forks from its own small process, so the peak is the command's alone (a
    child forked from this Python would start with this process's pages counted).
    """
    with tempfile.NamedTemporaryFile("r", suffix=".time") as report:
        start = time.perf_counter()
        done = subprocess.run(
            ["/usr/bin/time", "-f", "%U %S %M", "-o", report.name, *command],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            check=False,
        )
        wall = time.perf_counter() - start
        if done.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr!r}")
        user, system, peak_kib = report.read().split()[-3:]
    return Measure(wall, int(peak_kib) / 1024, float(user) + float(system))


def drop_caches() -> bool:
    """Empty the page cache (needs root); False where that is not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


def cold(command: list[str]) -> str:
    """One run after dropping the page cache: headers and Python modules read from disk."""
    if not drop_caches():
        return "n/a (not root)"
    return f"{run(command).wall:.3f} s"


def median(command: list[str], repeat: int) -> Measure:
    run(command)  # warm-up: page cache and .pyc files
    samples = [run(command) for _ in range(repeat)]
    return Measure(statistics.median(s.wall for s in samples), max(s.rss_mib for s in samples))


SAFE_OPEN_LISTING = """
import sys, glob, os
from safetensors import safe_open
path = sys.argv[1]
files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else [path]
count = 0
for name in files:
    with safe_open(name, "np") as handle:
        for key in handle.keys():
            handle.get_slice(key).get_shape()
            count += 1
print(count)
"""


def imports_torch(path: Path) -> bool:
    code = (
        "import sys; import ckptfix.cli.app as app; sys.argv=['ckptfix','inspect',"
        f"{str(path)!r},'--json']\ntry:\n    app.main()\nexcept SystemExit:\n"
        "    pass\nsys.stderr.write(str('torch' in sys.modules))"
    )
    done = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, check=False)
    return done.stderr.strip().endswith("True")


def bench_inspect(inputs: dict[str, Path], repeat: int) -> list[str]:
    rows = []
    targets = {
        "single": ("2.2 GB single file", 0.5, 120),
        "five": ("2.2 GB, 5 shards", 0.5, 120),
        "many": ("50 shards, 100,000 tensors", 2.0, None),
        "million": ("1,000,000 tensors in one header", 8.0, 1024),
    }
    for key, (label, wall_target, rss_target) in targets.items():
        path = inputs[key]
        command = [*CKPTFIX, "inspect", str(path), "--json"]
        cold_wall = cold(command)
        ours = median(command, repeat)
        reference = median([PYTHON, "-c", SAFE_OPEN_LISTING, str(path)], repeat)
        ok = ours.wall <= wall_target and (rss_target is None or ours.rss_mib <= rss_target)
        rss_goal = f"≤ {rss_target} MiB" if rss_target else "-"
        rows.append(
            f"| inspect --json, {label} | {ours.wall:.3f} s | {cold_wall} | {ours.rss_mib:.0f} MiB | "
            f"{reference.wall:.3f} s / {reference.rss_mib:.0f} MiB | "
            f"{ours.wall / reference.wall:.2f}× | ≤ {wall_target} s, {rss_goal} | "
            f"{'met' if ok else 'MISSED'} |"
        )
    rows.append(
        f"\ntorch imported by `inspect`: {'yes' if imports_torch(inputs['single']) else 'no'}"
    )
    return rows


STANDARD_RECIPE = """
import os, sys
from safetensors.torch import load_file
from huggingface_hub import save_torch_state_dict
state = load_file(sys.argv[1])
os.makedirs(sys.argv[2])
save_torch_state_dict(state, sys.argv[2], max_shard_size=sys.argv[3])
for name in os.listdir(sys.argv[2]):  # fsynced like ckptfix's output, to compare like with like
    fd = os.open(os.path.join(sys.argv[2], name), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
"""


def timed_write(command: list[str], out: Path, source: Path, repeat: int) -> Measure:
    """Median over `repeat` runs, each into a fresh OUT with the source in the page cache."""
    samples = []
    for _ in range(repeat):
        if out.exists():
            shutil.rmtree(out)
        subprocess.run(["cat", str(source)], stdout=subprocess.DEVNULL, check=True)
        subprocess.run(["sync"], check=True)
        samples.append(run(command))
    shutil.rmtree(out, ignore_errors=True)
    return Measure(statistics.median(s.wall for s in samples), max(s.rss_mib for s in samples))


def cp_and_sync(source: Path, out: Path, repeat: int) -> Measure:
    """The reference for a write command: copy the file, then fsync the copy."""
    command = f"mkdir {out} && cp {source} {out}/ && sync {out}/{source.name}"
    return timed_write(["sh", "-c", command], out, source, repeat)


def bench_reshard(inputs: dict[str, Path], repeat: int) -> list[str]:
    source = inputs["single"]
    out = CACHE / "bench-out"
    size = data_size(source)
    cp = cp_and_sync(source, out, repeat)
    ours = timed_write(
        [*CKPTFIX, "reshard", str(source), "-o", str(out), "--max-shard", "500MB", "--json"],
        out,
        source,
        repeat,
    )
    recipe = timed_write(
        [PYTHON, "-c", STANDARD_RECIPE, str(source), str(out), "500MB"], out, source, repeat
    )
    rows = [
        f"| `cp` + `sync` of the file | {cp.wall:.2f} s | {cp.rss_mib:.0f} MiB | 1.00× | |",
        f"| `ckptfix reshard --max-shard 500MB` (verified, fsynced, atomic) | {ours.wall:.2f} s | "
        f"{ours.rss_mib:.0f} MiB | {ours.wall / cp.wall:.2f}× | "
        f"≤ 1.2× and ≤ 150 MiB: {'met' if ours.wall <= 1.2 * cp.wall and ours.rss_mib <= 150 else 'MISSED'} |",
        f"| `load_file` + `save_torch_state_dict` (+ fsync) | {recipe.wall:.2f} s | "
        f"{recipe.rss_mib:.0f} MiB | {recipe.wall / cp.wall:.2f}× | |",
    ]
    header = [
        f"\nreshard of a {size / 1e9:.2f} GB bf16 file into 500 MB shards; median of {repeat}, "
        "source in the page cache, outputs fsynced\n",
        "| job | wall | peak RSS | vs cp | target |",
        "|---|---|---|---|---|",
    ]
    flat = []
    for key in ("half", "single", "four"):
        measure = timed_write(
            [
                *CKPTFIX,
                "reshard",
                str(inputs[key]),
                "-o",
                str(out),
                "--max-shard",
                "500MB",
                "--json",
            ],
            out,
            inputs[key],
            2,
        )
        flat.append((key, data_size(inputs[key]), measure))
    small, large = flat[0][2].rss_mib, flat[-1][2].rss_mib
    flat_rows = [
        "\npeak RSS of `ckptfix reshard --max-shard 500MB` by checkpoint size\n",
        "| checkpoint | wall | peak RSS |",
        "|---|---|---|",
        *(f"| {size / 1e9:.2f} GB | {m.wall:.2f} s | {m.rss_mib:.0f} MiB |" for _, size, m in flat),
        f"\n4 GB vs 0.5 GB peak RSS: {large / small:.2f}× (target within 10%: "
        f"{'met' if abs(large / small - 1) <= 0.10 else 'MISSED'})",
    ]
    return header + rows + flat_rows


TO_BIN = """
import sys, torch
from safetensors.torch import load_file
torch.save(load_file(sys.argv[1]), sys.argv[2])
"""

CONVERT_RECIPE = """
import os, sys, torch
from huggingface_hub import save_torch_state_dict
state = torch.load(sys.argv[1], weights_only=True, mmap=True)
os.makedirs(sys.argv[2])
save_torch_state_dict(state, sys.argv[2], max_shard_size=sys.argv[3])
for name in os.listdir(sys.argv[2]):  # fsynced like ckptfix's output
    fd = os.open(os.path.join(sys.argv[2], name), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
"""


def ensure_bin(source: Path) -> Path:
    target = source.with_suffix(".bin")
    if not target.exists():
        print(f"building {target} ...", flush=True)
        partial = target.with_suffix(".partial")
        subprocess.run([PYTHON, "-c", TO_BIN, str(source), str(partial)], check=True)
        partial.rename(target)
    return target


def bench_convert(inputs: dict[str, Path], repeat: int) -> list[str]:
    source = ensure_bin(inputs["single"])
    out = CACHE / "bench-out"
    size = data_size(source)
    cp = cp_and_sync(source, out, repeat)
    ours = timed_write(
        [*CKPTFIX, "convert", str(source), "-o", str(out), "--json"], out, source, repeat
    )
    recipe = timed_write(
        [PYTHON, "-c", CONVERT_RECIPE, str(source), str(out), "5GB"], out, source, repeat
    )
    ok = ours.wall <= 1.5 * cp.wall and ours.rss_mib <= 250
    rows = [
        f"\nconvert of a {size / 1e9:.2f} GB `.bin` (torch.save) to safetensors; median of "
        f"{repeat}, source in the page cache, outputs fsynced\n",
        "| job | wall | peak RSS | vs cp | target |",
        "|---|---|---|---|---|",
        f"| `cp` + `sync` of the file | {cp.wall:.2f} s | {cp.rss_mib:.0f} MiB | 1.00× | |",
        f"| `ckptfix convert` (verified, fsynced, atomic) | {ours.wall:.2f} s | "
        f"{ours.rss_mib:.0f} MiB | {ours.wall / cp.wall:.2f}× | "
        f"≤ 1.5× and ≤ 250 MiB: {'met' if ok else 'MISSED'} |",
        f"| `torch.load(weights_only=True, mmap=True)` + `save_torch_state_dict` (+ fsync) | "
        f"{recipe.wall:.2f} s | {recipe.rss_mib:.0f} MiB | {recipe.wall / cp.wall:.2f}× | |",
        "\npeak RSS of `ckptfix convert` by checkpoint size\n",
        "| checkpoint | wall | peak RSS |",
        "|---|---|---|",
    ]
    flat = []
    for key in ("half", "single", "four"):
        binary = ensure_bin(inputs[key])
        measure = timed_write(
            [*CKPTFIX, "convert", str(binary), "-o", str(out), "--json"], out, binary, 2
        )
        flat.append(measure.rss_mib)
        rows.append(
            f"| {data_size(binary) / 1e9:.2f} GB | {measure.wall:.2f} s | "
            f"{measure.rss_mib:.0f} MiB |"
        )
    ratio = flat[-1] / flat[0]
    rows.append(
        f"\n4 GB vs 0.5 GB peak RSS: {ratio:.2f}× (flat: "
        f"{'met' if abs(ratio - 1) <= 0.10 else 'MISSED'})"
    )
    return rows


SAVE_RECIPE = """
import os, sys, torch
from safetensors.torch import load_file
state = load_file(sys.argv[1])
os.makedirs(sys.argv[2])
with open(os.path.join(sys.argv[2], "pytorch_model.bin"), "wb") as handle:
    torch.save(state, handle)
    handle.flush()
    os.fsync(handle.fileno())  # fsynced like ckptfix's output
"""


def bench_to_torch(inputs: dict[str, Path], repeat: int) -> list[str]:
    """convert --to torch of the 2.2 GB safetensors file: a streamed .bin."""
    source = inputs["single"]
    out = CACHE / "bench-out"
    cp = cp_and_sync(source, out, repeat)
    command = [*CKPTFIX, "convert", str(source), "-o", str(out), "--to", "torch", "--json"]
    ours = timed_write(command, out, source, repeat)
    recipe = timed_write([PYTHON, "-c", SAVE_RECIPE, str(source), str(out)], out, source, repeat)
    ok = ours.wall <= 1.5 * cp.wall and ours.rss_mib <= 250
    rows = [
        f"\nconvert --to torch of a {data_size(source) / 1e9:.2f} GB safetensors file into one "
        f"`.bin`; median of {repeat}, source in the page cache, outputs fsynced\n",
        "| job | wall | peak RSS | vs cp | target |",
        "|---|---|---|---|---|",
        f"| `cp` + `sync` of the file | {cp.wall:.2f} s | {cp.rss_mib:.0f} MiB | 1.00× | |",
        f"| `ckptfix convert --to torch` (verified, fsynced, atomic) | {ours.wall:.2f} s | "
        f"{ours.rss_mib:.0f} MiB | {ours.wall / cp.wall:.2f}× | "
        f"≤ 1.5× and ≤ 250 MiB: {'met' if ok else 'MISSED'} |",
        f"| `load_file` + `torch.save` (+ fsync) | {recipe.wall:.2f} s | "
        f"{recipe.rss_mib:.0f} MiB | {recipe.wall / cp.wall:.2f}× | |",
        "\npeak RSS of `ckptfix convert --to torch` by checkpoint size\n",
        "| checkpoint | wall | peak RSS |",
        "|---|---|---|",
    ]
    for key in ("half", "single", "four"):
        command = [*CKPTFIX, "convert", str(inputs[key]), "-o", str(out), "--to", "torch"]
        measure = timed_write(command, out, inputs[key], 2)
        rows.append(
            f"| {data_size(inputs[key]) / 1e9:.2f} GB | {measure.wall:.2f} s | "
            f"{measure.rss_mib:.0f} MiB |"
        )
    return rows


def resharded(source: Path) -> Path:
    """The same tensors as `source`, resharded by ckptfix into 500 MB safetensors shards."""
    target = source.with_name(source.stem + "-resharded")
    if not target.exists():
        print(f"building {target} ...", flush=True)
        command = [*CKPTFIX, "reshard", str(source), "-o", str(target), "--max-shard", "500MB"]
        subprocess.run(command, stdout=subprocess.DEVNULL, check=True)
    return target


def gbps(size: int, seconds: float) -> str:
    return f"{size / seconds / 1e9:.2f} GB/s"


def bench_hash(inputs: dict[str, Path], repeat: int) -> list[str]:
    """hash against sha256sum of the same file, warm and cold, and peak RSS by model size."""
    source = inputs["single"]
    size = data_size(source)
    ours_command = [*CKPTFIX, "hash", str(source), "--json"]
    reference_command = ["sha256sum", str(source)]
    ours, reference = median(ours_command, repeat), median(reference_command, repeat)
    cold_ours, cold_reference = cold(ours_command), cold(reference_command)
    ok = ours.wall <= reference.wall and ours.rss_mib <= 150
    openssl_command = ["openssl", "dgst", "-sha256", str(source)]
    openssl = median(openssl_command, repeat) if shutil.which("openssl") else None
    rows = [
        f"\nhash of a {size / 1e9:.2f} GB bf16 safetensors file; median of {repeat}, page cache "
        "warm (cold: one run after dropping it)\n",
        "| job | wall (warm) | rate (warm) | cold cache | peak RSS | target |",
        "|---|---|---|---|---|---|",
        f"| `sha256sum` of the file | {reference.wall:.2f} s | {gbps(size, reference.wall)} | "
        f"{cold_reference} | {reference.rss_mib:.0f} MiB | |",
        *(
            [
                f"| `openssl dgst -sha256` of the file (one core, SHA-NI) | {openssl.wall:.2f} s | "
                f"{gbps(size, openssl.wall)} | | {openssl.rss_mib:.0f} MiB | |"
            ]
            if openssl
            else []
        ),
        f"| `ckptfix hash --json` (2 threads) | {ours.wall:.2f} s | {gbps(size, ours.wall)} | "
        f"{cold_ours} | {ours.rss_mib:.0f} MiB | "
        f"faster than sha256sum, ≤ 150 MiB: {'met' if ok else 'MISSED'} |",
    ]
    binary = ensure_bin(source)
    on_bin = median([*CKPTFIX, "hash", str(binary), "--json"], repeat)
    rows.append(
        f"| `ckptfix hash --json` of the same tensors as a `.bin` (torch.save) | "
        f"{on_bin.wall:.2f} s | {gbps(size, on_bin.wall)} | | {on_bin.rss_mib:.0f} MiB | |"
    )
    rows += [
        "\npeak RSS of `ckptfix hash` by checkpoint size\n",
        "| checkpoint | wall | peak RSS |",
    ]
    rows.append("|---|---|---|")
    peaks = []
    for key in ("half", "single", "four"):
        measure = median([*CKPTFIX, "hash", str(inputs[key]), "--json"], 2)
        peaks.append(measure.rss_mib)
        rows.append(
            f"| {data_size(inputs[key]) / 1e9:.2f} GB | {measure.wall:.2f} s | "
            f"{measure.rss_mib:.0f} MiB |"
        )
    rows.append(
        f"\n4 GB vs 0.5 GB peak RSS: {peaks[-1] / peaks[0]:.2f}× (≤ 150 MiB and flat: "
        f"{'met' if max(peaks) <= 150 and peaks[-1] / peaks[0] <= 1.10 else 'MISSED'})"
    )
    return rows


def bench_diff(inputs: dict[str, Path], repeat: int) -> list[str]:
    """diff of the same model as a .bin and as resharded safetensors, against hashing both."""
    binary, folder = ensure_bin(inputs["single"]), resharded(inputs["single"])
    size = data_size(binary)
    hash_a = median([*CKPTFIX, "hash", str(binary), "--json"], repeat)
    hash_b = median([*CKPTFIX, "hash", str(folder), "--json"], repeat)
    ours = median([*CKPTFIX, "diff", str(binary), str(folder), "--json"], repeat)
    both = hash_a.wall + hash_b.wall
    ok = ours.wall <= 1.2 * both and ours.rss_mib <= 150
    different = median([*CKPTFIX, "diff", str(inputs["single"]), str(inputs["five"])], repeat)
    values = median([*CKPTFIX, "diff", str(inputs["single"]), str(inputs["five"]), "--values"], 1)
    return [
        f"\ndiff of two {size / 1e9:.2f} GB checkpoints; median of {repeat}, page cache warm\n",
        "| job | wall | peak RSS | vs hashing both | target |",
        "|---|---|---|---|---|",
        f"| `ckptfix hash` of the `.bin`, then of the 5-shard safetensors folder | {both:.2f} s "
        f"({hash_a.wall:.2f} + {hash_b.wall:.2f}) | {max(hash_a.rss_mib, hash_b.rss_mib):.0f} MiB "
        "| 1.00× | |",
        f"| `ckptfix diff` of the two (identical: every byte read) | {ours.wall:.2f} s | "
        f"{ours.rss_mib:.0f} MiB | {ours.wall / both:.2f}× | "
        f"≤ 1.2×, ≤ 150 MiB: {'met' if ok else 'MISSED'} |",
        f"| `ckptfix diff` of two different models (every tensor differs) | {different.wall:.2f} s "
        f"| {different.rss_mib:.0f} MiB | {different.wall / both:.2f}× | |",
        f"| `ckptfix diff --values` of the same two (every element decoded) | {values.wall:.2f} s "
        f"| {values.rss_mib:.0f} MiB | {values.wall / both:.2f}× | |",
    ]


def data_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(item.stat().st_size for item in path.iterdir())


def bench_training(kind: str, repeat: int) -> None:
    """Training checkpoints (DCP, ZeRO): bench/training.py."""
    import training

    job = training.bench_dcp if kind == "dcp" else training.bench_zero
    for row in job(repeat):
        print(row, flush=True)


def bench_megatron(repeat: int) -> None:
    """A Megatron-Core torch_dist checkpoint to a Hugging Face model: bench/megatron_ckpt.py."""
    import megatron_ckpt

    for row in megatron_ckpt.bench_megatron(repeat):
        print(row, flush=True)


def bench_remote(repeat: int) -> None:
    """inspect over S3 and a Hub on 127.0.0.1: bench/remote.py."""
    import remote

    for row in remote.bench_remote(many_tensors(), CACHE, repeat):
        print(row, flush=True)


def bench_library(repeat: int) -> None:
    """ckptfix.save against huggingface_hub and safetensors, open().get(): bench/library.py."""
    import library

    for row in library.bench_library(repeat):
        print(row, flush=True)


def bench_startup(repeat: int) -> None:
    """Start-up time (`ckptfix inspect --help` and others): bench/startup.py."""
    import startup

    for row in startup.bench_startup(repeat):
        print(row, flush=True)


def bench_zero_copy(repeat: int) -> None:
    """reshard on an XFS loop mount, zero-copy: bench/reflink.py."""
    import reflink

    for row in reflink.bench_reflink(ensure_single(), CACHE, repeat):
        print(row, flush=True)


def bench_scale(repeat: int) -> None:
    """1,000,000 tensors (inspect, reshard --dry-run) and a 16 GiB expansion: bench/scale.py."""
    import scale

    for row in scale.bench_scale(max(1, repeat // 2)):
        print(row, flush=True)


def bench_gguf(repeat: int) -> None:
    """GGUF inspect, split and merge: bench/gguf_bench.py."""
    import gguf_bench

    for row in gguf_bench.bench_gguf(CACHE, repeat):
        print(row, flush=True)


def bench_ray(repeat: int) -> None:
    """hash, and convert to S3, with --executor ray on 1 and 2 Ray nodes against local:
    bench/ray_bench.py."""
    import ray_bench

    for row in ray_bench.bench_ray(repeat) + ray_bench.bench_ray_writes(repeat):
        print(row, flush=True)


def print_inspect(inputs: dict[str, Path], repeat: int) -> None:
    print(
        f"\ninputs: {inputs['single'].name} ({data_size(inputs['single']) / 1e9:.2f} GB), "
        f"{inputs['five'].name} ({data_size(inputs['five']) / 1e9:.2f} GB), "
        f"{inputs['many'].name}; {repeat} runs each, median wall, max peak RSS\n"
    )
    print(
        "| job | ckptfix wall (median) | cold cache | ckptfix peak RSS "
        "| safe_open listing (wall / RSS) | ratio | target | |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in bench_inspect(inputs, repeat):
        print(row, flush=True)


def bench_store_write() -> None:
    from store_write import bench_store  # bench/store_write.py: S3 outputs against boto3

    bench_store()  # prints its rows as they are measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    jobs = [
        "startup",
        "hash",
        "reshard",
        "convert",
        "to-torch",
        "dcp",
        "zero",
        "megatron",
        "inspect",
        "remote",
        "reflink",
        "library",
        "scale",
        "gguf",
        "ray",
        "store",
    ]
    parser.add_argument("--only", choices=jobs, default=None)
    args = parser.parse_args()
    writes = max(3, args.repeat // 2 + 1)
    runs: dict[str, Callable[[], object]] = {
        "startup": lambda: bench_startup(args.repeat),
        "hash": lambda: [
            print(row, flush=True)
            for row in bench_hash(ensure_inputs(), args.repeat)
            + bench_diff(ensure_inputs(), writes)
        ],
        "reshard": lambda: [
            print(row, flush=True) for row in bench_reshard(ensure_inputs(), writes)
        ],
        "convert": lambda: [
            print(row, flush=True) for row in bench_convert(ensure_inputs(), writes)
        ],
        "to-torch": lambda: [
            print(row, flush=True) for row in bench_to_torch(ensure_inputs(), writes)
        ],
        "dcp": lambda: bench_training("dcp", writes),
        "zero": lambda: bench_training("zero", writes),
        "megatron": lambda: bench_megatron(writes),
        "inspect": lambda: print_inspect(ensure_inputs(), args.repeat),
        "remote": lambda: bench_remote(args.repeat),
        "reflink": lambda: bench_zero_copy(writes),
        "library": lambda: bench_library(writes),
        "scale": lambda: bench_scale(args.repeat),
        "gguf": lambda: bench_gguf(writes),
        "ray": lambda: bench_ray(args.repeat),
        "store": lambda: bench_store_write(),
    }
    for job in [args.only] if args.only else jobs:
        runs[job]()


if __name__ == "__main__":
    main()
