"""Training checkpoints written by the frameworks themselves, for the tests: DCP saved by
2 gloo ranks on CPU (FSDP2 `fully_shard` plus hand-placed DTensors), and DeepSpeed ZeRO
stages 1-3 in fp32 and bf16, trained for two steps on CPU. Every rank talks over the
loopback interface only.

Run as `python -m tests.training_frameworks KIND OUT` (dcp, zero, or a kind of
tests/training_writers.py) (the test fixtures do, once per
session); ranks are spawned with torch.multiprocessing.
"""

from __future__ import annotations

import contextlib
import glob
import os
import socket
import sys
from typing import Any

WORLD = 2
ZERO_CONFIGS = [
    (0, "fp32"),
    (1, "fp32"),
    (1, "bf16"),
    (2, "fp32"),
    (2, "bf16"),
    (3, "fp32"),
    (3, "bf16"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def env_for_rank(rank: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        LOCAL_SIZE=str(WORLD),
        GLOO_SOCKET_IFNAME="lo",
    )


def _dcp_state(mesh: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """An FSDP2 model (uneven Shard(0)) after one AdamW step, plus DTensors placed by hand:
    Shard(1) (even and uneven), Shard(2) of a 3-D tensor, Replicate(), a 0-d tensor, a plain
    tensor, in F32, BF16, F16 and I64."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 5)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    g = torch.Generator().manual_seed(1)
    extra = {
        "wide.weight": (torch.randn(4, 6, generator=g).bfloat16(), [Shard(1)]),
        "odd.weight": (torch.randn(3, 5, generator=g).half(), [Shard(1)]),
        "experts.weight": (torch.randn(2, 3, 5, generator=g), [Shard(2)]),
        "norm.weight": (torch.randn(3, generator=g), [Replicate()]),
        "positions": (torch.arange(7, dtype=torch.int64), [Shard(0)]),
        "scale": (torch.tensor(0.5), [Replicate()]),
    }
    for name, (full, placements) in extra.items():
        model_sd[name] = distribute_tensor(full, mesh, placements)
    model_sd["plain.bias"] = torch.linspace(0, 1, 4)
    return dict(model_sd), dict(optim_sd)


def _full(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items()}


def _save_dcp(rank: int, out: str, port: int) -> None:
    env_for_rank(rank, port)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    model_sd, optim_sd = _dcp_state(mesh)
    app = {"model": model_sd, "optim": optim_sd, "train_state": {"step": 3, "note": "x"}}
    dcp.save(app, checkpoint_id=os.path.join(out, "torch_save"))
    writer = FileSystemWriter(
        os.path.join(out, "safetensors"), serialization_format=SerializationFormat.SAFETENSORS
    )
    dcp.save(app, storage_writer=writer)
    dcp.save({**model_sd, "optimizer": optim_sd}, checkpoint_id=os.path.join(out, "flat"))
    full = _full(model_sd)  # collective: every rank gathers
    if rank == 0:
        torch.save(full, os.path.join(out, "reference.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _zero_model() -> Any:
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(13, 6)
            self.body = torch.nn.Linear(6, 5)
            self.frozen = torch.nn.Linear(5, 6)
            self.head = torch.nn.Linear(6, 13, bias=False)
            self.head.weight = self.embed.weight  # a tied weight
            self.register_buffer("scale", torch.arange(4, dtype=torch.float32))
            self.register_buffer("half_scale", torch.linspace(0, 1, 3).bfloat16())
            for parameter in self.frozen.parameters():
                parameter.requires_grad_(False)

        def forward(self, x: Any) -> Any:
            h = torch.relu(self.body(self.embed(x)))
            return self.head(self.frozen(h)).float().pow(2).mean()

    return Net()


def _save_zero(rank: int, out: str, port: int) -> None:
    env_for_rank(rank, port)
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    for stage, dtype in ZERO_CONFIGS:
        torch.manual_seed(0)
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**6,
        }
        if dtype == "bf16":
            config["bf16"] = {"enabled": True}
        model = _zero_model()
        groups = [  # two parameter groups, as weight-decay splits make them
            {"params": [model.embed.weight, model.body.weight]},
            {"params": [model.body.bias], "weight_decay": 0.0},
        ]
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
        for _ in range(2):
            loss = engine(torch.randint(0, 13, (2, 3)))
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(os.path.join(out, f"zero{stage}_{dtype}"))
        engine.destroy()


def main() -> None:
    import torch.multiprocessing as mp

    from tests.training_writers import WRITERS

    kind, out = sys.argv[1], sys.argv[2]
    runs = {"dcp": [(_save_dcp, ())], "zero": [(_save_zero, ())], **WRITERS}[kind]
    for target, extra in runs:
        port = free_port()
        try:
            mp.spawn(target, args=(out, port, *extra), nprocs=WORLD)
        finally:
            _release_shared_memory(port)


def _release_shared_memory(port: int) -> None:
    """DeepSpeed's all-reduce on CPU leaves its shared-memory buffers (66 MB a rank) in
    /dev/shm when its ranks exit: removed once they have, or every run leaks them (a day of
    test runs had filled 16 GB of this machine's memory)."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


if __name__ == "__main__":
    main()
