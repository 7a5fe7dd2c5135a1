"""Loader-matrix layouts of training checkpoints: Lightning's `ModelCheckpoint` files written
by a real `Trainer.fit`, and the pickled dictionaries DeepSpeed's engine and timm's
`CheckpointSaver` write with `torch.save` (an `argparse.Namespace` of arguments, a `set`,
`torch.Size` shapes, numpy scalars beside the weights).

The reference is the library's own load of the training file (`load_from_checkpoint`, or the
module's strict `load_state_dict` of the dictionary's weights, as DeepSpeed's engine and timm's
`load_checkpoint` do); the output, a plain weights file, is loaded into a fresh module (the
LightningModule itself: convert keeps its `model.` names by default) with a strict
`load_state_dict`: every name the module has, nothing else.

torch and the libraries are imported inside the functions (tests/test_no_torch.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.loader_layouts import TOKENS, Layout, quietly
from tests.loader_libraries import net_output, tiny_net

LIGHTNING_FILES = ("epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt")


@functools.cache
def lit_class() -> Any:
    """A LightningModule around tiny_net (its weights under `model.`)."""
    import pytorch_lightning as pl
    import torch

    class LitNet(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_net()

        def forward(self, tokens: Any) -> Any:
            return self.model(tokens)

        def training_step(self, batch: Any, index: int) -> Any:
            return self(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=0.05)

    return LitNet


@quietly
def build_lightning(root: Path) -> None:
    """Two epochs of two steps with `ModelCheckpoint(save_top_k=-1, save_last=True)`:
    ckpts/epoch=0-step=2.ckpt, ckpts/epoch=1-step=4.ckpt and ckpts/last.ckpt, each a full
    training checkpoint (optimizer state, loops, callbacks) of different weights but the last."""
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.callbacks import ModelCheckpoint

    torch.manual_seed(1)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randint(0, 96, (8, 6))), batch_size=4
    )
    checkpoints = ModelCheckpoint(dirpath=root / "ckpts", save_top_k=-1, save_last=True)
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoints],
    )
    trainer.fit(lit_class()(), data)
    assert sorted(p.name for p in (root / "ckpts").iterdir()) == sorted(LIGHTNING_FILES)


def lightning_reference(name: str) -> Any:
    def reference(root: Path, dtype: str | None) -> Any:
        import torch

        model = lit_class().load_from_checkpoint(root / "ckpts" / name, weights_only=False)
        with torch.no_grad():
            return model.eval()(torch.tensor(TOKENS))

    return reference


def weights_loader(module: Callable[[], Any]) -> Callable[[Path, Path, str | None], Any]:
    """Loads the output's one weights file strictly into a fresh `module()` (its
    `load_state_dict(strict=True)`: every name it has, nothing else) and runs it on TOKENS.
    The file is read by safetensors' `load_file`, or `torch.load(weights_only=True)`."""

    def load(root: Path, path: Path, dtype: str | None) -> Any:
        import torch
        from safetensors.torch import load_file

        model = module()
        files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
        assert len(files) == 1, f"one weights file expected, found {files}"
        if files[0].suffix == ".safetensors":
            weights = load_file(files[0])
        else:
            weights = torch.load(files[0], weights_only=True)
        model.load_state_dict(weights, strict=True)
        with torch.no_grad():
            return model.eval()(torch.tensor(TOKENS))

    return load


# --- DeepSpeed's engine and timm's CheckpointSaver: torch.save of a training dictionary -------


def _arguments() -> Any:
    import argparse

    return argparse.Namespace(lr=0.05, epochs=2, model="tiny", deepspeed=True, seed=1)


@quietly
def build_deepspeed(root: Path) -> None:
    """What `DeepSpeedEngine.save_checkpoint` writes at ZeRO stage 0 into
    `global_step2/mp_rank_00_model_states.pt`, with Megatron's `args` as client state."""
    import deepspeed
    import numpy
    import torch

    model = tiny_net()
    state = model.state_dict()
    folder = root / "ds" / "global_step2"
    folder.mkdir(parents=True)
    torch.save(
        {
            "module": state,
            "buffer_names": [],
            "optimizer": None,
            "param_shapes": [{name: tensor.shape for name, tensor in state.items()}],
            "frozen_param_shapes": None,
            "shared_params": {},
            "frozen_param_fragments": None,
            "lr_scheduler": None,
            "data_sampler": None,
            "random_ltd": None,
            "sparse_tensor_module_names": set(),
            "skipped_steps": 0,
            "global_steps": 2,
            "global_samples": numpy.int64(8),
            "dp_world_size": 1,
            "mp_world_size": 1,
            "ds_config": {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0}},
            "ds_version": deepspeed.__version__,
            "args": _arguments(),
            "iteration": 2,
        },
        folder / "mp_rank_00_model_states.pt",
    )
    (root / "ds" / "latest").write_text("global_step2")


@quietly
def build_timm(root: Path) -> None:
    """What timm's `CheckpointSaver` writes (`checkpoint-1.pth.tar`): weights under
    `state_dict`, the optimizer, the run's `args` and a numpy metric."""
    import numpy
    import torch

    model = tiny_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    (root / "timm").mkdir()
    torch.save(
        {
            "epoch": 1,
            "arch": "tiny_net",
            "state_dict": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "version": 2,
            "args": _arguments(),
            "metric": numpy.float64(71.5),
            "seen_classes": {1, 2, 3},
        },
        root / "timm" / "checkpoint-1.pth.tar",
    )


def dictionary_reference(path: str, key: str) -> Any:
    """The library's own load: the module's strict load_state_dict of `key` (DeepSpeed's
    engine and timm's `load_checkpoint` unpickle the whole file)."""

    def reference(root: Path, dtype: str | None) -> Any:
        import torch

        model = tiny_net()
        checkpoint = torch.load(root / path, weights_only=False)
        model.load_state_dict(checkpoint[key], strict=True)
        return net_output(model)

    return reference


DS_FILE = "ds/global_step2/mp_rank_00_model_states.pt"
TIMM_FILE = "timm/checkpoint-1.pth.tar"
TRAINING_LAYOUTS = [
    Layout(
        f"lightning-{name.removesuffix('.ckpt')}",
        build_lightning,
        weights_loader(lambda: lit_class()()),
        target=f"ckpts/{name}",
        reference=lightning_reference(name),
    )
    for name in ("epoch=0-step=2.ckpt", "last.ckpt")
] + [
    Layout(
        "deepspeed-model-states",
        build_deepspeed,
        weights_loader(tiny_net),
        target=DS_FILE,
        reference=dictionary_reference(DS_FILE, "module"),
        convert_options=("--key", "module"),
    ),
    Layout(
        "timm-checkpoint",
        build_timm,
        weights_loader(tiny_net),
        target=TIMM_FILE,
        reference=dictionary_reference(TIMM_FILE, "state_dict"),
        convert_options=("--key", "state_dict"),
    ),
]
