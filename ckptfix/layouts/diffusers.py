"""diffusers pipelines: a root folder whose `model_index.json` names its components
(`"unet": ["diffusers", "UNet2DConditionModel"]`), each a model folder of its own
(`unet/diffusion_pytorch_model.safetensors`, `text_encoder/model.safetensors`, ...)."""

from __future__ import annotations

import json
import os

from ckptfix.core.text import plain_file_name
from ckptfix.layouts.names import scan_folder

MODEL_INDEX = "model_index.json"
MAX_MODEL_INDEX = 2**20


def components(root: str) -> list[str]:
    """The components `model_index.json` names that are folders of the pipeline, in its
    order; [] when `root` is not a pipeline."""
    path = os.path.join(root, MODEL_INDEX)
    if not os.path.isfile(path) or os.path.getsize(path) > MAX_MODEL_INDEX:
        return []
    try:
        with open(path, "rb") as handle:
            document = json.loads(handle.read())
    except (OSError, ValueError, RecursionError):
        return []
    if not isinstance(document, dict):
        return []
    return [
        name
        for name, value in document.items()
        if isinstance(value, list)
        and len(value) == 2
        and not name.startswith("_")
        and plain_file_name(name)  # never "..": a folder the user did not name
        and _holds_weights(os.path.join(root, name))
    ]


def _holds_weights(folder: str) -> bool:
    """A component with weights (unet/, vae/), not a scheduler's or tokenizer's config."""
    if not os.path.isdir(folder):
        return False
    layout = scan_folder(folder)
    return bool(layout.weight_files) or any(family.index for family in layout.families)


def no_weights_message(root: str) -> str:
    """Why a folder has no weights, and what to do: a diffusers pipeline root keeps them in
    its components; anything else may be a path mistake or a download left out."""
    parts = components(root)
    if parts:
        listed = ", ".join(f"{part}/" for part in parts[:4]) + (" ..." if len(parts) > 4 else "")
        return (
            f"folder is a diffusers pipeline: its weights are in its components ({listed}), "
            "not in the folder itself (inspect the folder to see them all; rewrite one "
            f"component at a time, e.g. {os.path.join(root, parts[0])})"
        )
    return (
        "folder holds no weight file (*.safetensors, *.bin, *.pt, ...) and no shard index "
        "(check the path, or download the weights)"
    )
