"""Which checkpoint of a folder its loader would load, chosen the way the loaders choose.

transformers (`model*`, `pytorch_model*`), diffusers (`diffusion_pytorch_model*`), peft
(`adapter_model*`) and Mistral's tools (`consolidated*`) all take, without a variant asked
for: the single safetensors file, else the safetensors index, else the single `.bin`, else
the `.bin` index. Loose files (`*.safetensors`, `*.bin`, `*.pt`, `*.ckpt` with other names)
are each a checkpoint of their own: one of them is the folder's checkpoint; several are
separate checkpoints, never merged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckptfix.layouts.names import GGUF, Family, FolderLayout, parse_weight_name

# The stems a loader reads, in the order a folder holding several is taken, and by whom.
LOADERS = {
    "model": "transformers",
    "pytorch_model": "transformers",
    "diffusion_pytorch_model": "diffusers",
    "adapter_model": "peft",
    "consolidated": "mistral",
}
# Per loader: (stem, extension) in the order the loader tries them.
_ORDER = {
    "transformers": [("model", "safetensors"), ("pytorch_model", "bin")],
    "diffusers": [("diffusion_pytorch_model", "safetensors"), ("diffusion_pytorch_model", "bin")],
    "peft": [("adapter_model", "safetensors"), ("adapter_model", "bin")],
    "mistral": [("consolidated", "safetensors")],
}


@dataclass(frozen=True)
class Choice:
    """The checkpoint chosen in a folder: its family, the files a loader reads, its index."""

    family: Family | None  # None: no checkpoint, or several separate loose ones
    files: tuple[str, ...]  # names in the folder, in the order they are read
    index: str | None = None
    loader: str = ""  # transformers, diffusers, peft, mistral, or "" for a loose file
    separate: tuple[str, ...] = ()  # several loose checkpoints: none is chosen

    @property
    def label(self) -> str:
        if self.family is None:
            return ""
        if self.family.stem == "loose":
            return self.files[0] if self.files else self.family.label
        return self.family.label

    def to_dict(self) -> dict[str, object]:
        return {
            "family": self.label or None,
            "loader": self.loader or None,
            "index": self.index,
            "files": list(self.files),
            "separate": list(self.separate),
        }


def single_name(family: Family) -> str:
    """The name of a family's one-file form: `model.safetensors`, `model.fp16.safetensors`."""
    variant = f".{family.variant}" if family.variant else ""
    return f"{family.stem}{variant}.{family.ext}"


def _family_choice(family: Family, shards: Mapping[str, Sequence[str]]) -> Choice | None:
    """What a loader reads of one family: its single file, else its index's shards, else
    its numbered files (an index lost)."""
    loader = LOADERS[family.stem]
    single = single_name(family)
    if single in family.files:
        return Choice(family, (single,), None, loader)
    if family.index is not None:
        return Choice(family, tuple(sorted(shards.get(family.index, ()))), family.index, loader)
    numbered = [name for name in family.files if parse_weight_name(name) is not None]
    return Choice(family, tuple(sorted(numbered)), None, loader) if numbered else None


def _named(layout: FolderLayout, shards: Mapping[str, Sequence[str]]) -> Choice | None:
    families = {(f.stem, f.variant, f.ext): f for f in layout.families if f.stem != "loose"}
    variants = sorted({key[1] for key in families if key[1] is not None})
    for variant in [None, *variants]:  # loaders take no variant unless asked for one
        for order in _ORDER.values():
            for stem, ext in order:
                family = families.get((stem, variant, ext))
                choice = _family_choice(family, shards) if family is not None else None
                if choice is not None:
                    return choice
    return None


def choose(layout: FolderLayout, shards: Mapping[str, Sequence[str]]) -> Choice:
    """The folder's checkpoint. `shards` maps each readable index to the shards it names."""
    named = _named(layout, shards)
    if named is not None:
        return named
    loose = sorted(name for f in layout.families if f.stem == "loose" for name in f.files)
    families = [f for f in layout.families if f.stem == "loose" and f.files]
    # A GGUF split set is one checkpoint of its own, as a loose file is (llama.cpp reads
    # the parts in order); a folder of several quantizations holds several checkpoints.
    sets = [f for f in layout.families if f.ext == GGUF and f.stem != "loose"]
    if len(sets) == 1 and not loose:
        return Choice(sets[0], tuple(sets[0].files), None, "llama.cpp")
    if len(loose) == 1 and not sets:
        return Choice(
            families[0], tuple(loose), loader="llama.cpp" if loose[0].endswith(".gguf") else ""
        )
    return Choice(None, (), separate=tuple(sorted(loose + [f.files[0] for f in sets])))
