"""Model folders: which files hold weights, which family each belongs to, which index."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckptfix.io.folder import LOCAL, Folder

_STEMS = (
    "model",
    "pytorch_model",
    "diffusion_pytorch_model",
    "consolidated",
    "adapter_model",
)
_STEM = "|".join(_STEMS)
WEIGHT_RE = re.compile(
    rf"^(?P<stem>{_STEM})(?:\.(?P<variant>[A-Za-z0-9_]+))?"
    r"(?:-(?P<part>\d+)-of-(?P<total>\d+))?\.(?P<ext>safetensors|bin)$"
)
INDEX_RE = re.compile(
    rf"^(?P<stem>{_STEM})\.(?P<ext>safetensors|bin)\.index(?:\.(?P<variant>[A-Za-z0-9_]+))?\.json$"
)
LOOSE_EXTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
# llama.cpp's split sets: `<prefix>-00001-of-00003.gguf` (`llama_split_path`'s "%05d").
GGUF_PART_RE = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5,})-of-(?P<total>\d{5,})\.gguf$")
GGUF = "gguf"
# Files that trainers leave beside the weights: pickles of settings or optimizer state,
# not model weights. They are copied as ordinary files, never read as weights.
NOT_WEIGHTS = re.compile(
    r"^(training_args\.bin|(optimizer|scheduler|sampler)(_\d+)?\.(pt|bin)|scaler(_\d+)?\.pt|"
    r"rng_state(_\d+)?\.pth)$"
)
# accelerate's FSDP full-state-dict copy of the model (`save_fsdp_model`): beside the weights
# the Trainer saves (`model.safetensors`) it is training state; alone it is the weights.
FSDP_COPY = re.compile(r"^pytorch_model_fsdp(_\d+)?\.bin$")
# accelerate's `save_state` (its `random_states_R.pkl` beside): the first model is
# `model.safetensors` (or `pytorch_model.bin`), the others `model_1.safetensors`, ... — with
# several, they are separate checkpoints, none is chosen.
ACCELERATE_STATE = re.compile(r"^random_states_\d+\.pkl$")
ACCELERATE_MODEL = re.compile(r"^(?:model|pytorch_model)(?:_\d+)?\.(?:safetensors|bin)$")


# What a checkpoint folder holds besides its weights (any family, other frameworks' too):
# indexes and configs, tokenizer and vocabulary files, model cards, licences, custom model
# code. `--force` replaces a folder of only these (sub-folders included, such as a diffusers
# `unet/`); anything else needs `--replace-any`.
CHECKPOINT_FILE = re.compile(
    r"(?:.*\.(?:safetensors|bin|pt|pth|ckpt|h5|msgpack|onnx|gguf|distcp|json|md|txt|py|tiktoken)"
    r"|\.metadata|tokenizer\.model|spiece\.model|sentencepiece.*\.model|vocab\..*|merges\.txt"
    r"|license.*|\.gitattributes)",
    re.IGNORECASE,
)


def _belongs(path: str) -> bool:
    """A file (or link) named as part of a checkpoint, or a folder holding only such files."""
    pending = [path]
    while pending:
        current = pending.pop()
        mode = os.lstat(current).st_mode
        if stat.S_ISDIR(mode):
            with os.scandir(current) as listing:
                pending.extend(entry.path for entry in listing)
        else:
            named = CHECKPOINT_FILE.fullmatch(os.path.basename(current)) is not None
            if not named or not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
                return False
    return True


def foreign_entries(root: str) -> list[str]:
    """The top-level entries of `root` that are not part of a checkpoint, sorted."""
    with os.scandir(root) as listing:
        return sorted(entry.name for entry in listing if not _belongs(entry.path))


@dataclass(frozen=True)
class ShardName:
    """What a weight file's name says: family stem, variant and N-of-M position."""

    stem: str
    variant: str | None
    ext: str
    part: int | None
    total: int | None


def parse_weight_name(name: str) -> ShardName | None:
    match = WEIGHT_RE.match(name)
    if match is None:
        return None
    part, total = match["part"], match["total"]
    return ShardName(
        stem=match["stem"],
        variant=match["variant"],
        ext=match["ext"],
        part=int(part) if part is not None else None,
        total=int(total) if total is not None else None,
    )


@dataclass
class Family:
    """Weight files that a loader would treat as one checkpoint (e.g. `model*.safetensors`)."""

    stem: str
    variant: str | None
    ext: str
    files: list[str] = field(default_factory=list)
    index: str | None = None

    @property
    def label(self) -> str:
        if self.ext == GGUF:
            return "loose *.gguf files" if self.stem == "loose" else f"{self.stem}-*-of-*.gguf"
        if self.stem == "loose":  # the torch family holds .bin, .pt, .pth and .ckpt files
            exts = sorted({os.path.splitext(name)[1] for name in self.files}) or [f".{self.ext}"]
            return f"loose {'/'.join(f'*{ext}' for ext in exts)} files"
        variant = f".{self.variant}" if self.variant else ""
        return f"{self.stem}{variant}*.{self.ext}"

    @property
    def kind(self) -> str:
        """The family without its variant: what counts towards `mixed-formats` (GGUF files,
        single or split, are one kind: a folder of quantizations is not mixed formats)."""
        if self.ext == GGUF:
            return "*.gguf"
        return self.label if self.stem == "loose" else f"{self.stem}*.{self.ext}"


@dataclass(frozen=True)
class FolderLayout:
    """What a folder's file names say: its weight families, its weight files and its config."""

    families: tuple[Family, ...]
    weight_files: tuple[str, ...]
    config: str | None


def scan_folder(root: str, folder: Folder = LOCAL) -> FolderLayout:
    """Sort the top-level files of a model folder into weight families and their indexes."""
    return layout_of(folder.file_names(root))


def _accelerate_models(names: Sequence[str]) -> set[str]:
    """The models of an accelerate `save_state` folder that holds more than one."""
    if not any(ACCELERATE_STATE.match(name) for name in names):
        return set()
    models = {name for name in names if ACCELERATE_MODEL.match(name)}
    numbered = any(name.split(".")[0].rsplit("_", 1)[-1].isdigit() for name in models)
    return models if numbered else set()


def layout_of(names: Sequence[str]) -> FolderLayout:
    """Sort the names of a folder's top-level files into weight families and their indexes
    (also for a folder that exists only as a plan, such as what `ckptfix fix` would leave)."""
    families: dict[tuple[str, str | None, str], Family] = {}

    def family(stem: str, variant: str | None, ext: str) -> Family:
        key = (stem, variant, ext)
        if key not in families:
            families[key] = Family(stem, variant, ext)
        return families[key]

    weight_files: list[str] = []
    copies = [name for name in names if FSDP_COPY.match(name)]
    separate = _accelerate_models(names)
    for name in names:
        if name in separate:
            ext = "safetensors" if name.endswith(".safetensors") else "torch"
            family("loose", None, ext).files.append(name)
            weight_files.append(name)
            continue
        index_match = INDEX_RE.match(name)
        if index_match is not None:
            family(index_match["stem"], index_match["variant"], index_match["ext"]).index = name
            continue
        gguf_part = GGUF_PART_RE.match(name)
        if name.endswith(".gguf"):  # a split set's part, or a file of its own
            family(gguf_part["stem"] if gguf_part else "loose", None, GGUF).files.append(name)
            weight_files.append(name)
            continue
        parsed = parse_weight_name(name)
        if parsed is not None:
            family(parsed.stem, parsed.variant, parsed.ext).files.append(name)
            weight_files.append(name)
        elif name.endswith(LOOSE_EXTS) and not NOT_WEIGHTS.match(name) and name not in copies:
            ext = "safetensors" if name.endswith(".safetensors") else "torch"
            family("loose", None, ext).files.append(name)
            weight_files.append(name)
    if copies and not any(f.files for f in families.values() if f.stem != "loose"):
        family("loose", None, "torch").files.extend(copies)
        weight_files.extend(copies)
    config = "config.json" if "config.json" in names else None
    return FolderLayout(tuple(families.values()), tuple(weight_files), config)
