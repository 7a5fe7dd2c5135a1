"""Folders that accelerate's `save_state` and the Hugging Face Trainer write under FSDP with a
sharded state dict: the model as a torch.distributed.checkpoint folder `pytorch_model_fsdp_0/`
(app state `{"model": ...}`, as accelerate's `save_fsdp_model` writes it), beside
`optimizer_0/`, rng states, the scheduler and (the Trainer's) `trainer_state.json`.

The folder is read as the model it holds, the DCP folder's; with several models
(`pytorch_model_fsdp_1/`, ...) none is chosen, as for several separate checkpoints: the one
to use is passed by its own path.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace

from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.findings import finding, name_list
from ckptfix.core.training import TrainingLayout
from ckptfix.formats.base import ReadOptions
from ckptfix.io.folder import LOCAL, Folder, unlistable

FSDP_MODEL = re.compile(r"^pytorch_model_fsdp_(\d+)$")
TRAINER_STATE = "trainer_state.json"


def fsdp_models(root: str, names: list[str], folder: Folder = LOCAL) -> list[str]:
    """The `pytorch_model_fsdp_N/` DCP folders of a checkpoint folder, by N (one without
    its `.metadata` is reported by the DCP loader)."""
    found = [
        name for name in names if FSDP_MODEL.match(name) and folder.is_dir(os.path.join(root, name))
    ]
    return sorted(found, key=lambda name: int(name.rsplit("_", 1)[1]))


def saved_by(names: list[str]) -> str:
    return "transformers Trainer" if TRAINER_STATE in names else "accelerate"


def several_message(root: str, models: list[str]) -> str:
    return (
        f"folder holds {len(models)} models saved by accelerate ({name_list(models)}), not one "
        f"model in several parts; nothing merges them (inspect or convert one at a time, e.g. "
        f"{os.path.join(root, models[-1])})"
    )


def load_fsdp_models(
    root: str, names: list[str], models: list[str], options: ReadOptions, folder: Folder = LOCAL
) -> Checkpoint:
    """The model of an accelerate / Trainer FSDP folder: its one `pytorch_model_fsdp_N/`."""
    from ckptfix.layouts.dcp import load_dcp, step_of

    who = saved_by(names)
    if len(models) > 1:
        problem = finding("several-checkpoints", several_message(root, models), file=root)
        layout = TrainingLayout(
            "dcp", saved_by=who, step=step_of(root), separate=tuple(models), findings=(problem,)
        )
        return Checkpoint(root, "dcp", (), training=layout)
    inner = os.path.join(root, models[0])
    try:
        inner_names = folder.listdir(inner)
    except OSError as exc:
        raise unlistable(inner, exc) from exc
    checkpoint = load_dcp(inner, inner_names, options, folder)
    assert checkpoint.training is not None
    layout = replace(checkpoint.training, saved_by=who, model_folder=models[0], step=step_of(root))
    return replace(checkpoint, path=root, training=layout)
