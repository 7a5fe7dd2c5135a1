"""Which training-checkpoint layout a folder is, if any: Megatron-Core (`metadata.json` beside
a torch.distributed.checkpoint save), torch.distributed.checkpoint (`.metadata`, `*.distcp`),
accelerate's and the Trainer's FSDP folders (`pytorch_model_fsdp_N/`), torch's per-rank
HuggingFaceStorageWriter save (`shard-R-model-K-of-N.safetensors`) or DeepSpeed (`latest` + tag
folder, or a tag folder of `*_model_states.pt`; a universal checkpoint: `latest_universal` + a
tag folder with `zero/`). Everything else is a Hugging Face model folder."""

from __future__ import annotations

import os

from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.errors import UsageError
from ckptfix.formats.base import ReadOptions
from ckptfix.formats.dcp import RANK_SUFFIX
from ckptfix.io.folder import LOCAL, Folder

ZERO_WEIGHTS = ("master", "module")


def load_training(
    root: str, options: ReadOptions, zero_weights: str, folder: Folder = LOCAL
) -> Checkpoint | None:
    """The Checkpoint of a training folder, or None when the folder is not one."""
    if zero_weights not in ZERO_WEIGHTS:
        raise UsageError(
            "--zero-weights", f"unknown choice {zero_weights!r}", "use master or module"
        )
    try:
        names = folder.listdir(root)
    except OSError:
        return None  # the Hugging Face loader reports it
    from ckptfix.layouts import accelerate, dcp, deepspeed, deepspeed_universal, hf_shards, megatron

    if megatron.is_megatron_folder(root, names):
        return megatron.load_megatron(root, names, options, folder)
    if dcp.is_dcp_folder(root, names):
        return dcp.load_dcp(root, names, options, folder)
    models = accelerate.fsdp_models(root, names, folder)
    if models:
        return accelerate.load_fsdp_models(root, names, models, options, folder)
    if hf_shards.is_hf_shard_folder(names):
        return hf_shards.load_hf_shards(root, names, options, folder)
    if folder is not LOCAL:
        deepspeed.refuse_remote(root, names)
    deepspeed_universal.refuse_zero_folder(root, names)
    if deepspeed.is_deepspeed_folder(root, names):
        return deepspeed.load_deepspeed(root, names, zero_weights)
    return None


def refuse_part(path: str) -> None:
    """A file that is only one part of a training checkpoint is refused, with the fix."""
    if path.endswith(RANK_SUFFIX) or os.path.basename(path) == ".metadata":
        raise UsageError(
            path,
            "file is one part of a torch.distributed.checkpoint folder",
            "pass the folder that holds .metadata and the .distcp files",
        )
