"""DeepSpeed checkpoint folders: `latest` naming a tag folder (or the tag folder itself) with
`*_model_states.pt` and `[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`; or a universal
checkpoint (`latest_universal` naming a folder with `zero/`, read by layouts.deepspeed_universal).
Which tag folder, and which copy of the weights when a folder holds both, layouts.deepspeed_tags
decides: one copy, never a mix, the other named.

By default the weights are the fp32 master weights, reconstructed from the optimizer
partitions as `zero_to_fp32.py` does (layouts.zero_weights), plus frozen parameters,
buffers (floating ones written in fp32, as zero_to_fp32.py does) and `shared_params` aliases,
each a few byte ranges of the rank files. `--zero-weights module` takes the training-dtype
copy in `module` instead (stages 0-2). Problems are data: a tag pointing nowhere, a missing
or unreadable rank file, partitions that disagree with the shapes.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace

from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.errors import UnsupportedFormatError
from ckptfix.core.findings import finding
from ckptfix.core.training import TrainingLayout
from ckptfix.formats.zero import FORMAT
from ckptfix.io.folder import unlistable
from ckptfix.layouts import deepspeed_tags as tags
from ckptfix.layouts import deepspeed_universal as universal
from ckptfix.layouts.deepspeed_files import Reader
from ckptfix.layouts.zero_model import Assembled, master, module, size_of

_DIGITS = re.compile(r"(\d+)(?:_universal)?$")
_HF_WEIGHTS = re.compile(r"^(?:.*\.safetensors|pytorch_model.*\.bin)$")


def is_deepspeed_folder(root: str, names: list[str]) -> bool:
    if any(tags.MODEL.match(name) or tags.OPTIM.match(name) for name in names):
        return True
    tag_files = [n for n in tags.TAG_FILES if n in names and os.path.isfile(os.path.join(root, n))]
    if not tag_files and not universal.holds_universal(root, names):
        return False
    if any(_HF_WEIGHTS.match(name) for name in names):
        return False  # a Hugging Face Trainer checkpoint: its weights are the model (the tag folder can be passed)
    if universal.LATEST in tag_files or universal.holds_universal(
        root, names
    ):  # unlike `latest`, a name only DeepSpeed writes
        return True
    return any(tags.tag_dir(root, n)[1] for n in tag_files) or "zero_to_fp32.py" in names


def refuse_remote(root: str, names: list[str]) -> None:
    """A DeepSpeed folder at a URL is refused with the fix (its loader reads local files)."""
    rank_files = any(tags.MODEL.match(name) or tags.OPTIM.match(name) for name in names)
    hf_weights = any(_HF_WEIGHTS.match(name) for name in names)
    tag_file = any(name in names for name in tags.TAG_FILES)
    if rank_files or (tag_file and not hf_weights):
        raise UnsupportedFormatError(
            root,
            "DeepSpeed checkpoint folders are read from local disk only",
            "download the folder (the tag folder and `latest`), then pass its local path",
        )


def _holds_model_states(folder: str) -> bool:
    """A tag folder: model states in it (one that cannot be listed is not counted)."""
    try:
        return os.path.isdir(folder) and any(tags.MODEL.match(n) for n in os.listdir(folder))
    except OSError:
        return False


def _tag_missing(root: str, names: list[str], tag: str | None, tag_file: str) -> Checkpoint:
    others = sorted(name for name in names if _holds_model_states(os.path.join(root, name)))
    listed = f"; tag folders present: {', '.join(others[:5])}" if others else ""
    if tag is None:  # the tag file was not read: say why
        what = tags.read_tag(root, tag_file)[1]
    else:
        what = f"`{tag_file}` names the tag {tag!r}, but there is no such folder"
    problem = finding(
        "tag-missing",
        f"{what}{listed} (pass a tag folder itself, or fix `{tag_file}`)",
        file=os.path.join(root, tag_file),
    )
    layout = TrainingLayout("deepspeed", tag=tag, findings=(problem,))
    return Checkpoint(root, FORMAT, (), training=layout)


def _files(
    tag_dir: str, names: list[str], is_universal: bool = False
) -> tuple[dict[int | None, str], dict[int, str]]:
    """Model-states files (by rank; None for `mp_rank_00_model_states.pt`) and optimizer
    files by rank. Tensor- or pipeline-parallel checkpoints are refused."""
    models: dict[int | None, str] = {}
    optims: dict[int, str] = {}
    for name in sorted(names):
        path = os.path.join(tag_dir, name)
        if match := tags.MODEL.match(name):
            if int(match.group(2)):
                raise _parallel(tag_dir, name, is_universal)
            models[int(match.group(1)) if match.group(1) else None] = path
        elif match := tags.OPTIM.match(name):
            if int(match.group(3)):
                raise _parallel(tag_dir, name)
            optims[int(match.group(2))] = path
        elif name.startswith(("layer_", "expert_")) and name.endswith("model_states.pt"):
            raise _parallel(tag_dir, name, is_universal)
    return models, optims


def _parallel(tag_dir: str, name: str, is_universal: bool = False) -> UnsupportedFormatError:
    if is_universal:  # ds_to_universal merged the trained weights, but not the model states
        return UnsupportedFormatError(
            tag_dir,
            f"{name} belongs to a tensor-, pipeline- or expert-parallel universal checkpoint, "
            "whose model states (buffers, frozen parameters) hold per-rank parts ckptfix does "
            "not merge",
            "load it with DeepSpeed at tensor- and pipeline-parallel size 1 and save it, then "
            "convert that",
        )
    return UnsupportedFormatError(
        tag_dir,
        f"{name} belongs to a tensor-, pipeline- or expert-parallel checkpoint, whose parts "
        "ckptfix does not merge",
        "convert it with DeepSpeed's ds_to_universal.py first",
    )


def _no_tag_folder(root: str, names: list[str], weights: str) -> Checkpoint:
    """The tag-missing finding of the tag file that names no folder: `latest_universal` for
    --zero-weights universal, else the first one present."""
    present = [name for name in tags.TAG_FILES if name in names] or ["latest"]
    wanted = weights == "universal" and universal.LATEST in names
    tag_file = universal.LATEST if wanted else present[0]
    return _tag_missing(root, names, tags.read_tag(root, tag_file)[0], tag_file)


def _unread(found: Assembled, choice: tags.Choice, optims: dict[int, str]) -> tuple[str, ...]:
    """What the weights read leave out of their tag folder (the parts of the layout), with
    its bytes counted: the optimizer states, and the other copy of the weights the folder
    holds (the partitions beside a universal checkpoint read, or the reverse)."""
    parts = ["optimizer states"] if found.left_out_bytes else []
    if choice.universal:
        partitions = sum(size_of(path) for path in optims.values())
        found.left_out_bytes += partitions
        parts = ["optimizer states"] if found.left_out_bytes else []
    elif choice.folder.universal:
        nbytes, tensors = universal.unread(choice.folder.path)
        found.left_out_bytes += nbytes
        found.left_out_tensors += tensors
        parts.append("universal checkpoint")
    return tuple(parts)


def load_deepspeed(root: str, names: list[str], weights: str) -> Checkpoint:
    """The model of a DeepSpeed checkpoint: master weights (or a universal checkpoint's fp32
    weights), or `module` with weights="module"; never a mix of two copies of the weights."""
    choice = tags.choose(root, names, weights)
    if choice is None:
        return _no_tag_folder(root, names, weights)
    tag_dir = choice.folder.path
    reader = Reader()
    try:
        listing = os.listdir(tag_dir)
    except OSError as exc:
        raise unlistable(tag_dir, exc) from exc
    models, optims = _files(tag_dir, listing, is_universal=choice.universal)
    if choice.universal:
        found = universal.load_universal(root, tag_dir, models, reader, weights, bool(optims))
    elif weights == "master":
        found = master(tag_dir, models, optims, reader, "universal" in choice.other)
    else:
        found = module(tag_dir, models, optims, reader)
    parts = _unread(found, choice, optims)
    tag = choice.folder.tag
    digits = _DIGITS.search(tag or "")
    layout = TrainingLayout(
        "deepspeed",
        world_size=found.world,
        tag=tag,
        step=found.step if found.step is not None else (int(digits.group(1)) if digits else None),
        stage=found.stage,
        weights=found.weights,
        left_out_tensors=found.left_out_tensors,
        left_out_bytes=found.left_out_bytes,
        left_out_parts=parts,
        findings=(*found.findings, *([choice.note] if choice.note else [])),
        dtypes=found.dtypes,
        saved_by="lightning" if found.lightning else None,
        other_weights=dict(choice.other),
    )
    return _checkpoint(root, reader, found, layout)


def _checkpoint(root: str, reader: Reader, found: Assembled, layout: TrainingLayout) -> Checkpoint:
    """The files read, the model's tensors on the (first) model states file's record."""
    records = list(reader.records.values())
    holder = next(
        (
            i
            for i, r in enumerate(records)
            if r.read and tags.MODEL.match(os.path.basename(r.label))
        ),
        None,
    )
    if holder is not None:
        read = records[holder].read
        assert read is not None
        records[holder] = replace(records[holder], read=replace(read, tensors=tuple(found.tensors)))
    return Checkpoint(
        path=root,
        kind=FORMAT,
        files=tuple(records),
        sources=dict(reader.sources),
        training=layout,
    )
