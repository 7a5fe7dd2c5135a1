"""DeepSpeed checkpoint folders: `latest` naming a tag folder (or the tag folder itself) with
`*_model_states.pt` and `[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`; or a universal
checkpoint (`latest_universal` naming a folder with `zero/`, read by layouts.deepspeed_universal).

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
from ckptfix.core.errors import CkptfixError, UnsupportedFormatError
from ckptfix.core.findings import finding
from ckptfix.core.training import TrainingLayout
from ckptfix.formats.dcp import plain_file_name
from ckptfix.formats.zero import FORMAT
from ckptfix.io.folder import LOCAL, unlistable
from ckptfix.layouts import deepspeed_universal as universal
from ckptfix.layouts.deepspeed_files import Reader
from ckptfix.layouts.hub import stays_inside
from ckptfix.layouts.zero_model import master, module

_MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_DIGITS = re.compile(r"(\d+)(?:_universal)?$")
_TAG_FILES = ("latest", universal.LATEST)  # `latest` first: what DeepSpeed loads by default
_HF_WEIGHTS = re.compile(r"^(?:.*\.safetensors|pytorch_model.*\.bin)$")
MAX_TAG_BYTES = 4096


def _read_tag(root: str, tag_file: str = "latest") -> tuple[str | None, str]:
    """The tag a tag file names, or None and why it was not read: a link out of the
    checkpoint is never followed (it may lead to any file of the user's, which would be
    printed as the tag), a FIFO never opened (it would wait for a writer for ever)."""
    path = os.path.join(root, tag_file)
    if not stays_inside(path, root):
        return None, f"`{tag_file}` is a link to a file outside the checkpoint, which is not read"
    try:
        raw = LOCAL.read_small(path, path, MAX_TAG_BYTES, "tag")
    except CkptfixError as exc:
        return None, f"`{tag_file}`: {exc.what}"
    return raw.decode("utf-8", "replace").strip(), ""


def is_deepspeed_folder(root: str, names: list[str]) -> bool:
    if any(_MODEL.match(name) or _OPTIM.match(name) for name in names):
        return True
    tag_files = [n for n in _TAG_FILES if n in names and os.path.isfile(os.path.join(root, n))]
    if not tag_files and not universal.holds_universal(root, names):
        return False
    if any(_HF_WEIGHTS.match(name) for name in names):
        return False  # a Hugging Face Trainer checkpoint: its weights are the model (the tag folder can be passed)
    if universal.LATEST in tag_files or universal.holds_universal(
        root, names
    ):  # unlike `latest`, a name only DeepSpeed writes
        return True
    return any(_tag_dir(root, n)[1] for n in tag_files) or "zero_to_fp32.py" in names


def _tag_dir(root: str, tag_file: str) -> tuple[str | None, str | None]:
    """(tag, tag folder) that `latest` (or `latest_universal`) names: the folder None when
    there is no such folder, or the tag is not a plain name."""
    tag, _ = _read_tag(root, tag_file)
    if not tag or not plain_file_name(tag) or not os.path.isdir(os.path.join(root, tag)):
        return tag, None
    return tag, os.path.join(root, tag)


def refuse_remote(root: str, names: list[str]) -> None:
    """A DeepSpeed folder at a URL is refused with the fix (its loader reads local files)."""
    rank_files = any(_MODEL.match(name) or _OPTIM.match(name) for name in names)
    hf_weights = any(_HF_WEIGHTS.match(name) for name in names)
    tag_file = any(name in names for name in _TAG_FILES)
    if rank_files or (tag_file and not hf_weights):
        raise UnsupportedFormatError(
            root,
            "DeepSpeed checkpoint folders are read from local disk only",
            "download the folder (the tag folder and `latest`), then pass its local path",
        )


def _holds_model_states(folder: str) -> bool:
    """A tag folder: model states in it (one that cannot be listed is not counted)."""
    try:
        return os.path.isdir(folder) and any(_MODEL.match(n) for n in os.listdir(folder))
    except OSError:
        return False


def _tag_missing(root: str, names: list[str], tag: str | None, tag_file: str) -> Checkpoint:
    others = sorted(name for name in names if _holds_model_states(os.path.join(root, name)))
    listed = f"; tag folders present: {', '.join(others[:5])}" if others else ""
    if tag is None:  # the tag file was not read: say why
        what = _read_tag(root, tag_file)[1]
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
        if match := _MODEL.match(name):
            if int(match.group(2)):
                raise _parallel(tag_dir, name, is_universal)
            models[int(match.group(1)) if match.group(1) else None] = path
        elif match := _OPTIM.match(name):
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


def _locate(root: str, names: list[str]) -> tuple[str | None, str | None, str]:
    """(tag, tag folder, tag file): the folder itself, or the folder `latest` names (or, with
    no such folder, `latest_universal`)."""
    if any(_MODEL.match(name) or _OPTIM.match(name) for name in names):
        return os.path.basename(os.path.normpath(root)), root, "latest"
    if universal.holds_universal(root, names):
        return os.path.basename(os.path.normpath(root)), root, universal.LATEST
    present = [name for name in _TAG_FILES if name in names] or ["latest"]
    for tag_file in present:
        tag, tag_dir = _tag_dir(root, tag_file)
        if tag_dir is not None:
            return tag, tag_dir, tag_file
    return _read_tag(root, present[0])[0], None, present[0]


def load_deepspeed(root: str, names: list[str], weights: str) -> Checkpoint:
    """The model of a DeepSpeed checkpoint: master weights (or a universal checkpoint's fp32
    weights), or `module` with weights="module"."""
    tag, tag_dir, tag_file = _locate(root, names)
    if tag_dir is None:
        return _tag_missing(root, names, tag, tag_file)
    reader = Reader()
    try:
        listing = os.listdir(tag_dir)
    except OSError as exc:
        raise unlistable(tag_dir, exc) from exc
    optim_files = any(_OPTIM.match(name) for name in listing)
    if not optim_files and universal.is_universal(tag_dir):
        models, _ = _files(tag_dir, listing, is_universal=True)
        found = universal.load_universal(root, tag_dir, models, reader, weights)
    else:
        models, optims = _files(tag_dir, listing)
        build = master if weights == "master" else module
        found = build(tag_dir, models, optims, reader)
    digits = _DIGITS.search(tag or "")
    parts = ("optimizer states",) if found.left_out_bytes else ()
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
        findings=tuple(found.findings),
        dtypes=found.dtypes,
        saved_by="lightning" if found.lightning else None,
    )
    records = list(reader.records.values())
    holder = next(
        (i for i, r in enumerate(records) if r.read and _MODEL.match(os.path.basename(r.label))),
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
