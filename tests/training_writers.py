"""More training checkpoints written by the frameworks themselves (run through
tests/training_frameworks.py, once per session): torch's HuggingFaceStorageWriter per rank,
accelerate's `save_state` under FSDP, the Hugging Face Trainer under FSDP (sharded and full
state dicts) and under DeepSpeed ZeRO-3, and Lightning's FSDP (sharded) and DeepSpeed
strategies. Two gloo ranks on 127.0.0.1, CPU only.

None of these frameworks trains FSDP or DeepSpeed on CPU as shipped; the least invasive
changes that let them, each confined to this process:

- accelerate (and the Trainer, which builds an `Accelerator`): given an FSDP plugin on a
  machine without GPUs it chooses MULTI_CPU and ignores the plugin. After the Accelerator is
  made, its state is switched to FSDP with the plugin (`_fsdp_on_cpu`); accelerate's own
  `prepare`, `save_state` and `save_fsdp_model` then run unchanged (FSDP2 `fully_shard`
  works on CPU).
- Lightning's FSDPStrategy refuses a CPU accelerator by an exact type check, and passes
  `device_id=None`, which FSDP1 refuses without an accelerator: a subclass wraps the model
  with `device_id=cpu`. Its DeepSpeedStrategy refuses CPUAccelerator and passes a device
  index of None: a subclass skips the CUDA check and passes the local rank.
"""

from __future__ import annotations

import os
from typing import Any

from tests.training_frameworks import WORLD, env_for_rank

VOCAB = 61


def _distributed(rank: int, port: int) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    env_for_rank(rank, port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    return init_device_mesh("cpu", (WORLD,))


def save_hf_writer(rank: int, out: str, port: int) -> None:
    """torch's HuggingFaceStorageWriter with `save_distributed=True`: per_rank/ (one file per
    rank), two_files/ (two model files per rank, by fqn_to_index_mapping) and consolidated/
    (the same save with `enable_consolidation=True`: torch's own consolidation beside its
    sharded/ input)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _distributed(rank, port)
    g = torch.Generator().manual_seed(0)
    placed = {
        "embed.weight": (torch.randn(211, 48, generator=g), [Shard(0)]),
        "wide.weight": (torch.randn(4, 6, generator=g).bfloat16(), [Shard(1)]),
        "experts.weight": (torch.randn(2, 3, 5, generator=g).half(), [Shard(2)]),
        "norm.weight": (torch.randn(3, generator=g), [Replicate()]),
        "bias": (torch.randn(7, generator=g), [Shard(0)]),  # uneven: 4 + 3
    }
    state = {name: distribute_tensor(t, mesh, p) for name, (t, p) in placed.items()}
    mapping = {name: 1 if name == "embed.weight" else 2 for name in state}
    writers = {
        "per_rank": HuggingFaceStorageWriter(os.path.join(out, "per_rank"), save_distributed=True),
        "two_files": HuggingFaceStorageWriter(
            os.path.join(out, "two_files"), fqn_to_index_mapping=mapping, save_distributed=True
        ),
        "consolidated": HuggingFaceStorageWriter(
            os.path.join(out, "consolidated"),
            fqn_to_index_mapping=mapping,
            save_distributed=True,
            enable_consolidation=True,
        ),
    }
    for writer in writers.values():
        dcp.save(state, storage_writer=writer)
    dist.barrier()
    dist.destroy_process_group()


def tiny_llama() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", eos_token="t0", pad_token="t1"
    )


def _fsdp_on_cpu() -> None:
    """Let an Accelerator made with an FSDP plugin use it on CPU (see the module's doc)."""
    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = accelerate.Accelerator.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None:
            self.state.distributed_type = DistributedType.FSDP
            self.state.fsdp_plugin = plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    accelerate.Accelerator.__init__ = init  # type: ignore[method-assign]


def save_accelerate(rank: int, out: str, port: int) -> None:
    """`Accelerator.save_state` of an FSDP2-sharded tiny Llama after one AdamW step: state/
    (pytorch_model_fsdp_0/, optimizer_0/, random_states_R.pkl); two_models/ adds a second
    model's folder, pytorch_model_fsdp_1/, written by accelerate's own save_fsdp_model as
    save_state writes each model (accelerate's FSDP2 prepares one model only)."""
    import torch
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import save_fsdp_model

    env_for_rank(rank, port)
    _fsdp_on_cpu()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(fsdp_plugin=plugin)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    tokens = torch.randint(0, VOCAB, (2, 6))
    accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
    optimizer.step()
    for name in ("state", "two_models"):
        accelerator.save_state(os.path.join(out, name))
    save_fsdp_model(plugin, accelerator, model, os.path.join(out, "two_models"), 1)
    accelerator.wait_for_everyone()


def save_accelerate_plain(rank: int, out: str, port: int) -> None:
    """`Accelerator.save_state` without FSDP, of two models: plain_two/ (model.safetensors,
    model_1.safetensors, optimizer.bin, optimizer_1.bin, random_states_R.pkl)."""
    import torch
    from accelerate import Accelerator

    env_for_rank(rank, port)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3), torch.nn.Linear(7, 5)]
    optimizers = [torch.optim.AdamW(model.parameters()) for model in models]
    accelerator.prepare(*models, *optimizers)
    accelerator.save_state(os.path.join(out, "plain_two"))
    accelerator.wait_for_everyone()


def save_trainer(rank: int, out: str, port: int, kind: str) -> None:
    """Two steps of `Trainer.train` with `save_steps=2`: OUT/<kind>/checkpoint-2."""
    import torch
    from transformers import Trainer, TrainingArguments

    env_for_rank(rank, port)
    _fsdp_on_cpu()
    data = [
        {"input_ids": torch.randint(0, VOCAB, (6,)), "labels": torch.randint(0, VOCAB, (6,))}
        for _ in range(8)
    ]
    state_dict = {"fsdp_sharded": "SHARDED_STATE_DICT", "fsdp_full": "FULL_STATE_DICT"}[kind]
    args = TrainingArguments(
        output_dir=os.path.join(out, kind),
        max_steps=2,
        save_steps=2,
        per_device_train_batch_size=2,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        fsdp="full_shard",
        fsdp_config={
            "fsdp_version": 2,
            "state_dict_type": state_dict,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        },
    )
    trainer = Trainer(
        model=tiny_llama(), args=args, train_dataset=data, processing_class=tiny_tokenizer()
    )
    trainer.train()


def save_trainer_zero3(rank: int, out: str, port: int) -> None:
    """What the Trainer writes into checkpoint-N under ZeRO-3 without
    `stage3_gather_16bit_weights_on_model_save`, in its order: `save_pretrained` with an empty
    state dict (config.json, generation_config.json; the empty weights file removed, as
    `remove_dummy_checkpoint` does), the tokenizer, then the engine's `save_checkpoint`
    (latest, global_step2/, zero_to_fp32.py) and the trainer state. The Trainer itself cannot
    start DeepSpeed on CPU (its batch-size arithmetic sees one process); these are the calls it
    makes, on a tiny Llama trained for two steps by the engine."""
    import deepspeed
    import torch
    from transformers.trainer_callback import TrainerState

    env_for_rank(rank, port)
    deepspeed.init_distributed(dist_backend="gloo")
    model = tiny_llama()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**6,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (2, 6))
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
    folder = os.path.join(out, "zero3", "checkpoint-2")
    if rank == 0:
        model.save_pretrained(folder, state_dict={})
        for name in ("model.safetensors", "pytorch_model.bin"):
            if os.path.isfile(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))
        tiny_tokenizer().save_pretrained(folder)
    torch.distributed.barrier()
    engine.save_checkpoint(folder)
    if rank == 0:
        TrainerState(global_step=2, max_steps=2).save_to_json(
            os.path.join(folder, "trainer_state.json")
        )
    torch.save({"python": 1}, os.path.join(folder, f"rng_state_{rank}.pth"))
    engine.destroy()


def _lightning_module() -> Any:
    import pytorch_lightning as pl
    import torch

    class LitNet(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, 7))

        def training_step(self, batch: Any, index: int) -> Any:
            return self.model(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    return LitNet()


def _cpu_strategy(kind: str) -> Any:
    """Lightning's FSDP (sharded state dict) or DeepSpeed stage-2 strategy, on CPU (see the
    module's doc)."""
    import argparse

    import torch
    from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

    class CpuFSDP(FSDPStrategy):  # type: ignore[misc]
        def _setup_model(self, model: Any) -> Any:
            from torch.distributed.fsdp import FullyShardedDataParallel

            return FullyShardedDataParallel(model, device_id=torch.device("cpu"), **self.kwargs)

    class CpuDeepSpeed(DeepSpeedStrategy):  # type: ignore[misc]
        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(
            self, model: Any, optimizer: Any, scheduler: Any = None
        ) -> Any:
            import deepspeed

            engine, optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self.local_rank),
                config=self.config,
                model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
                optimizer=optimizer,
                lr_scheduler=scheduler,
                dist_init_required=False,
            )
            return engine, optimizer

    if kind == "fsdp":
        return CpuFSDP(state_dict_type="sharded", process_group_backend="gloo")
    return CpuDeepSpeed(stage=2, process_group_backend="gloo")


def save_lightning(rank: int, out: str, port: int, kind: str) -> None:
    """Two steps of `Trainer.fit`, then `trainer.save_checkpoint(OUT/<kind>)`."""
    import pytorch_lightning as pl
    import torch

    env_for_rank(rank, port)
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (8, 6))), batch_size=2
    )
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=WORLD,
        strategy=_cpu_strategy(kind),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(_lightning_module(), data)
    trainer.save_checkpoint(os.path.join(out, kind))


# kind -> [(function, extra arguments)]: each a spawn of WORLD ranks, in turn.
WRITERS: dict[str, list[tuple[Any, tuple[str, ...]]]] = {
    "hf_writer": [(save_hf_writer, ())],
    "accelerate": [(save_accelerate, ()), (save_accelerate_plain, ())],
    "trainer": [
        (save_trainer, ("fsdp_sharded",)),
        (save_trainer, ("fsdp_full",)),
        (save_trainer_zero3, ()),
    ],
    "lightning": [(save_lightning, ("fsdp",)), (save_lightning, ("deepspeed",))],
}
