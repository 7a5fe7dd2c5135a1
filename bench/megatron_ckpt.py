"""`bench.py --only megatron`: a Megatron-Core `torch_dist` checkpoint of TinyLlama-1.1B's shapes
(2.2 GB in bf16) saved by megatron-core itself from 2 gloo ranks (TP 2) on CPU, converted to a
Hugging Face Llama (`--to-hf config.json`), against `cp -r` + `sync` of the folder and the
full-RAM way: torch's `dcp_to_torch_save`, then the same mapping in torch (layers unstacked,
q/k/v de-interleaved, [gate; up] split, vocabulary padding cut) and `save_file`.

Other jobs may share the machine's cores, so each job's fastest and median walls are both
reported (with its largest peak RSS) and the load average around each job; the target is
judged on the medians. One more run of each way, kept, must write the same tensors (`ckptfix
diff` of the two outputs), so both ways are known to do the same conversion.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from training import _build, folder_size, samples

from bench import CACHE, CKPTFIX, PYTHON, ROOT

HIDDEN, HEADS, GROUPS, FFN, VOCAB, LAYERS = 2048, 32, 4, 5632, 32000, 22
INPUT = CACHE / "megatron-tinyllama-rope-tp2"
FLOOR = ROOT / "bench" / "copy_floor.py"  # the rank files copied and verified, nothing else
SMALL = 6  # layers of the smaller checkpoint the peak RSS is compared with

SAVE = """
import os, sys, torch, torch.multiprocessing as mp

def save(rank, out, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(rank)
    config = TransformerConfig(
        num_layers={layers}, hidden_size={hidden}, num_attention_heads={heads},
        num_query_groups={groups}, ffn_hidden_size={ffn}, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True,
        perform_initialization=False, tensor_model_parallel_size=2)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
        normalization="RMSNorm"), vocab_size={vocab}, max_sequence_length=2048,
        share_embeddings_and_output_weights=False, position_embedding_type="rope")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    os.makedirs(out, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), out)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(save, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
"""

# The full-RAM way: every tensor in memory (dcp_to_torch_save), then the mapping in torch.
FULL_RAM = """
import os, sys, torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
source, out, vocab, groups, heads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
os.makedirs(out)
whole = os.path.join(out, "whole.pt")
dcp_to_torch_save(source, whole)
state = torch.load(whole, weights_only=False)
os.remove(whole)
hf = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:vocab],
      "lm_head.weight": state["output_layer.weight"][:vocab],
      "model.norm.weight": state["decoder.final_layernorm.weight"]}
stack = "decoder.layers."
for layer in range(state[stack + "self_attention.linear_qkv.weight"].shape[0]):
    get = lambda name: state[stack + name][layer]
    at = f"model.layers.{layer}."
    qkv = get("self_attention.linear_qkv.weight")
    dim = qkv.shape[0] // (heads + 2 * groups)
    blocks = qkv.view(groups, -1, dim, qkv.shape[1])
    per = heads // groups
    hf[at + "self_attn.q_proj.weight"] = blocks[:, :per].reshape(-1, qkv.shape[1])
    hf[at + "self_attn.k_proj.weight"] = blocks[:, per].reshape(-1, qkv.shape[1])
    hf[at + "self_attn.v_proj.weight"] = blocks[:, per + 1].reshape(-1, qkv.shape[1])
    hf[at + "self_attn.o_proj.weight"] = get("self_attention.linear_proj.weight")
    gate, up = get("mlp.linear_fc1.weight").chunk(2)
    hf[at + "mlp.gate_proj.weight"], hf[at + "mlp.up_proj.weight"] = gate, up
    hf[at + "mlp.down_proj.weight"] = get("mlp.linear_fc2.weight")
    hf[at + "input_layernorm.weight"] = get("self_attention.linear_qkv.layer_norm_weight")
    hf[at + "post_attention_layernorm.weight"] = get("mlp.linear_fc1.layer_norm_weight")
target = os.path.join(out, "model.safetensors")
save_file({k: v.contiguous() for k, v in hf.items()}, target, metadata={"format": "pt"})
fd = os.open(target, os.O_RDONLY)
os.fsync(fd)
os.close(fd)
"""

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": FFN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": GROUPS,
    "vocab_size": 31999,  # one padding row, cut by both ways
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
    "dtype": "bfloat16",
}


def megatron_input(layers: int = LAYERS) -> tuple[Path, Path]:
    """The checkpoint (built once) and the config.json of its Llama."""
    script = SAVE.format(
        layers=layers, hidden=HIDDEN, heads=HEADS, groups=GROUPS, ffn=FFN, vocab=VOCAB
    )
    name = INPUT.name if layers == LAYERS else f"{INPUT.name}-{layers}l"
    config = CACHE / f"{name}-config.json"
    source = _build(CACHE / name, script)
    config.write_text(json.dumps({**CONFIG, "num_hidden_layers": layers}))
    return source, config


@dataclass(frozen=True)
class Job:
    """One way's runs: fastest and median wall, median CPU time (user + system), largest
    peak RSS, and the 1-minute load average before and after them."""

    best: float
    median: float
    cpu: float
    rss_mib: float
    load: tuple[float, float]


def measure(command: list[str], out: Path, source: Path, repeat: int, made: str) -> Job:
    before = os.getloadavg()[0]
    runs = samples(command, out, source, repeat, made)
    walls = [sample.wall for sample in runs]
    cpu = statistics.median(sample.cpu for sample in runs)
    rss = max(sample.rss_mib for sample in runs)
    return Job(min(walls), statistics.median(walls), cpu, rss, (before, os.getloadavg()[0]))


def row(label: str, job: Job, cp: Job, target: str = "") -> str:
    return (
        f"| {label} | {job.best:.2f} s | {job.median:.2f} s | {job.cpu:.2f} s | "
        f"{job.rss_mib:.0f} MiB | {job.best / cp.best:.2f}× | {job.median / cp.median:.2f}× | "
        f"{job.load[0]:.1f} → {job.load[1]:.1f} | {target} |"
    )


def ways(source: Path, config: Path, out: Path) -> dict[str, list[str]]:
    """Each way's command, writing into `out`."""
    vocab = str(CONFIG["vocab_size"])
    ranks = [str(path) for path in sorted(source.glob("*.distcp"))]
    return {
        "cp": ["sh", "-c", f"cp -r {source} {out} && sync -f {out}"],
        "floor": [PYTHON, str(FLOOR), str(out), *ranks],
        "ours": [*CKPTFIX, "convert", str(source), "-o", str(out), "--to-hf", str(config)],
        "full": [PYTHON, "-c", FULL_RAM, str(source), str(out), vocab, str(GROUPS), str(HEADS)],
    }


def same_output(source: Path, config: Path) -> str:
    """Each conversion run once more into a folder kept, and the two compared by ckptfix."""
    kept = {way: CACHE / f"bench-megatron-{way}" for way in ("ours", "full")}
    for way, out in kept.items():
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(ways(source, config, out)[way], check=True, capture_output=True)
    diff = [*CKPTFIX, "diff", str(kept["ours"]), str(kept["full"])]
    done = subprocess.run(diff, capture_output=True, text=True, check=False)
    for out in kept.values():
        shutil.rmtree(out, ignore_errors=True)
    return "identical" if done.returncode == 0 else f"DIFFERENT: {done.stdout[-300:]!r}"


def flatness(large: Job, source: Path, repeat: int) -> Iterator[str]:
    """Peak RSS of the same conversion of a checkpoint with fewer layers."""
    small_source, small_config = megatron_input(SMALL)
    out = CACHE / "bench-out"
    command = ways(small_source, small_config, out)["ours"]
    small = measure(command, out, small_source, repeat, "model.safetensors")
    ratio = large.rss_mib / small.rss_mib
    yield (
        f"\npeak RSS of the same conversion: {folder_size(small_source) / 1e9:.2f} GB "
        f"({SMALL} layers) {small.rss_mib:.0f} MiB (median wall {small.median:.2f} s), "
        f"{folder_size(source) / 1e9:.2f} GB ({LAYERS} layers) {large.rss_mib:.0f} MiB: "
        f"{ratio:.2f}× (flat within 10%: {'met' if abs(ratio - 1) <= 0.10 else 'MISSED'})\n"
    )


def bench_megatron(repeat: int) -> Iterator[str]:
    """The rows, each as soon as it is measured (the full-RAM way may be killed for memory
    on a shared machine: that is reported, not lost with the rest)."""
    if importlib.util.find_spec("megatron.core") is None and not INPUT.exists():
        yield "\nMegatron-Core: skipped, megatron-core (the test extra) writes its input"
        return
    (source, config), out = megatron_input(), CACHE / "bench-out"
    megatron_input(SMALL)  # built before anything is timed
    command = ways(source, config, out)
    slow = max(2, repeat // 2)
    yield (
        f"\nMegatron-Core torch_dist ({folder_size(source) / 1e9:.2f} GB, TinyLlama-1.1B "
        "shapes, bf16, TP 2, written by megatron-core) to a Hugging Face Llama; "
        f"{repeat} runs each (the full-RAM way: {slow}), source in the page cache, outputs "
        f"fsynced; {os.cpu_count()} cores shared with other jobs\n"
    )
    yield (
        "| job | wall (fastest) | wall (median) | CPU (median) | peak RSS | vs cp (fastest) "
        "| vs cp (median) | load avg before → after | target |\n|---|---|---|---|---|---|---|---|---|"
    )
    cp = measure(command["cp"], out, source, repeat, ".metadata")
    yield row("`cp -r` + `sync` of the folder", cp, cp)
    ours = measure(command["ours"], out, source, repeat, "model.safetensors")
    ok = ours.median <= 1.5 * cp.median and ours.rss_mib <= 250
    target = f"≤ 1.5× and ≤ 250 MiB (medians): {'met' if ok else 'MISSED'}"
    yield row("`ckptfix convert --to-hf config.json` (verified, fsynced, atomic)", ours, cp, target)
    floor = measure(command["floor"], out, source, repeat, Path(command["floor"][-1]).name)
    yield row("the floor: the rank files copied and read back (`bench/copy_floor.py`)", floor, cp)
    yield from full_ram(command, (cp, ours), source, config, slow)
    yield from flatness(ours, source, repeat)


def full_ram(
    command: dict[str, list[str]], base: tuple[Job, Job], source: Path, config: Path, repeat: int
) -> Iterator[str]:
    """The full-RAM way's row, and how it compares with ckptfix (`base`: cp's and ours)."""
    cp, ours = base
    try:
        full = measure(command["full"], CACHE / "bench-out", source, repeat, "model.safetensors")
    except SystemExit as exc:
        yield f"| `dcp_to_torch_save` + the mapping in torch | failed: {str(exc)[-80:]} |"
        return
    yield row("`dcp_to_torch_save` + the mapping in torch + `save_file` (+ fsync)", full, cp)
    yield (
        f"\nckptfix vs the full-RAM way (medians): {full.median / ours.median:.2f}× faster, "
        f"{full.rss_mib / ours.rss_mib:.0f}× less memory; their outputs: "
        f"{same_output(source, config)}"
    )
