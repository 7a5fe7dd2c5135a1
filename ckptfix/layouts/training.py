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
from ckptfix.core.findings import finding, name_list
from ckptfix.core.training import RANK_SUFFIX, TrainingLayout
from ckptfix.formats.base import ReadOptions
from ckptfix.io.folder import LOCAL, Folder

ZERO_WEIGHTS = ("master", "module", "universal")


def load_training(
    root: str, options: ReadOptions, zero_weights: str, folder: Folder = LOCAL
) -> Checkpoint | None:
    """The Checkpoint of a training folder, or None when the folder is not one."""
    if zero_weights not in ZERO_WEIGHTS:
        raise UsageError(
            "--zero-weights", f"unknown choice {zero_weights!r}", "use master, module or universal"
        )
    try:
        names = folder.listdir(root)
    except OSError:
        return None  # the Hugging Face loader reports it
    from ckptfix.layouts import accelerate, dcp, deepspeed, deepspeed_universal, hf_shards, megatron

    if megatron.is_megatron_folder(root, names):
        return megatron.load_megatron(root, names, options, folder)
    models = accelerate.fsdp_models(root, names, folder)
    kinds = _side_by_side(root, names, models)
    if len(kinds) > 1 and kinds != models:  # several models of accelerate's: its own message
        return _several(root, kinds)
    if dcp.is_dcp_folder(root, names):
        return dcp.load_dcp(root, names, options, folder)
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


DCP_FILES = ".metadata"  # how a DCP save at the top of the folder is named among others
RANK_FILES = "shard-*-model-*.safetensors"


def _side_by_side(root: str, names: list[str], models: list[str]) -> list[str]:
    """The checkpoints a folder holding a DCP save, a per-rank HF writer set or accelerate's
    model folders holds, one name each: those, and a Hugging Face model's weights (what a
    loader of the folder reads). Ordered so that the last can be passed by its own path."""
    from ckptfix.layouts import choice, dcp, hf_shards
    from ckptfix.layouts import names as hf_names

    kinds = [DCP_FILES] if dcp.is_dcp_folder(root, names) else []
    kinds += [RANK_FILES] if hf_shards.is_hf_shard_folder(names) else []
    kinds += models
    if not kinds:
        return []
    for family in hf_names.layout_of(names).families:
        if family.stem in choice.LOADERS and (family.files or family.index):
            single = choice.single_name(family)
            kinds.append(single if single in family.files else family.index or family.label)
    return kinds


def _several(root: str, kinds: list[str]) -> Checkpoint:
    """Checkpoints of different layouts in one folder: none is taken for the model."""
    last = kinds[-1]
    how = "move all but one of them to a folder of its own"
    if last not in (DCP_FILES, RANK_FILES):
        how = f"pass {os.path.join(root, last)} itself, or {how}"
    problem = finding(
        "several-checkpoints",
        f"folder holds {len(kinds)} checkpoints side by side ({name_list(kinds)}), not one "
        f"model in several parts; none is read, nothing merges them ({how})",
        file=root,
    )
    layout = TrainingLayout("dcp", separate=tuple(kinds), findings=(problem,))
    return Checkpoint(root, "dcp", (), training=layout)


def refuse_part(path: str) -> None:
    """A file that is only one part of a training checkpoint is refused, with the fix."""
    if path.endswith(RANK_SUFFIX) or os.path.basename(path) == ".metadata":
        raise UsageError(
            path,
            "file is one part of a torch.distributed.checkpoint folder",
            "pass the folder that holds .metadata and the .distcp files",
        )
