"""Which tag folder of a DeepSpeed checkpoint gives the weights, and which weights the folder
also holds that are not read.

A folder can hold the fp32 weights twice: as the ZeRO optimizer partitions of a tag folder
(`*_optim_states.pt`: what DeepSpeed loads by default, what zero_to_fp32.py reads) and as a
universal checkpoint (`zero/<param>/fp32.pt`: what ds_to_universal writes, into the folder
`latest_universal` names, or into the tag folder itself when it was given that folder as its
output). The two are never mixed: `--zero-weights master` (the default) reads the partitions,
`universal` the universal checkpoint, `module` the model states' copy; the copy not read is
named in the layout (`other_weights`) and in an `other-weights` finding, with the option that
reads it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ckptfix.core.errors import CkptfixError, UsageError
from ckptfix.core.findings import Finding, finding
from ckptfix.core.text import plain_file_name
from ckptfix.io.folder import LOCAL
from ckptfix.layouts import deepspeed_universal as universal
from ckptfix.layouts.hub import stays_inside

MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
TAG_FILES = ("latest", universal.LATEST)  # `latest` first: what DeepSpeed loads by default
MAX_TAG_BYTES = 4096


def read_tag(root: str, tag_file: str = "latest") -> tuple[str | None, str]:
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


def tag_dir(root: str, tag_file: str) -> tuple[str | None, str | None]:
    """(tag, tag folder) that `latest` (or `latest_universal`) names: the folder None when
    there is no such folder, or the tag is not a plain name."""
    tag, _ = read_tag(root, tag_file)
    if not tag or not plain_file_name(tag) or not os.path.isdir(os.path.join(root, tag)):
        return tag, None
    return tag, os.path.join(root, tag)


def is_tag_folder(root: str, names: list[str]) -> bool:
    """The folder itself holds a checkpoint: rank files, or a universal checkpoint's zero/."""
    ranks = any(MODEL.match(name) or OPTIM.match(name) for name in names)
    return ranks or universal.holds_universal(root, names)


@dataclass(frozen=True)
class TagFolder:
    """A tag folder and the weights it holds."""

    tag: str | None
    path: str
    optim: bool  # ZeRO optimizer partitions (`*_optim_states.pt`)
    universal: bool  # a universal checkpoint's `zero/`
    tag_file: str = ""  # the tag file that names it ("": the folder passed itself)

    @property
    def zero(self) -> bool:
        """A ZeRO tag folder: its partitions (present or missing) are its master weights."""
        return self.optim or not self.universal


@dataclass(frozen=True)
class Choice:
    """The tag folder read, whether its universal checkpoint is, and the weights not read
    (the `--zero-weights` choice that reads them -> where they are)."""

    folder: TagFolder
    universal: bool
    other: dict[str, str] = field(default_factory=dict)
    note: Finding | None = None


def _tag_folder(tag: str | None, path: str, tag_file: str) -> TagFolder:
    """What the tag folder `path` holds, from its listing."""
    try:
        names = os.listdir(path)
    except OSError:
        names = []  # reported by the loader, which lists it again
    optim = any(OPTIM.match(name) for name in names)
    return TagFolder(tag, path, optim, universal.is_universal(path), tag_file)


def tag_folders(root: str, names: list[str]) -> list[TagFolder]:
    """The tag folders the folder passed holds, in the order DeepSpeed would look: the
    folder itself, then what `latest` names, then what `latest_universal` names."""
    found = []
    if is_tag_folder(root, names):
        found.append(_tag_folder(os.path.basename(os.path.normpath(root)), root, ""))
    for tag_file in (name for name in TAG_FILES if name in names):
        tag, path = tag_dir(root, tag_file)
        if path is not None and all(path != other.path for other in found):
            found.append(_tag_folder(tag, path, tag_file))
    return found


def choose(root: str, names: list[str], weights: str) -> Choice | None:
    """The weights to read (None: no tag folder; the loader says why). Never a mix: one
    tag folder, its partitions or its universal checkpoint."""
    folders = tag_folders(root, names)
    zero = next((folder for folder in folders if folder.zero), None)
    # A universal checkpoint as DeepSpeed's universal loader finds it: `latest_universal` first.
    held = next((f for f in sorted(folders, key=_universal_first) if f.universal), None)
    if weights == "universal":
        if held is None:
            if universal.LATEST in names:
                return None  # `latest_universal` names no folder: tag-missing says so
            raise UsageError(
                "--zero-weights",
                f"universal: {root} holds no DeepSpeed universal checkpoint (no zero/ folder, "
                "no `latest_universal` naming one)",
                "use --zero-weights master, or convert the folder ds_to_universal writes",
            )
        other = zero if zero is not None and zero.optim else None
        return _noted(Choice(held, True), other)
    read = zero or held
    if read is None:
        return None
    if weights == "master" and read is zero and held is not None:
        return _noted(Choice(zero, False), held)
    return Choice(read, read is not zero)


def _universal_first(folder: TagFolder) -> int:
    return {"": 0, universal.LATEST: 1}.get(folder.tag_file, 2)


def _noted(choice: Choice, other: TagFolder | None) -> Choice:
    """The choice with the weights it leaves unread, said."""
    if other is None:
        return choice
    read = choice.folder
    zero = os.path.join(read.path, universal.ZERO)
    if choice.universal:
        kind, where = "master", other.path
        taken = f"a universal checkpoint in {zero}, which is read (--zero-weights universal)"
        unread = f"the ZeRO optimizer partitions in {where}, which are not read or checked"
    else:
        kind = "universal"
        where = zero if other.path == read.path else other.path
        by = {"latest": " (named by `latest`, what DeepSpeed loads by default)"}
        taken = f"the ZeRO optimizer partitions in {read.path}{by.get(read.tag_file, '')}, "
        taken += "which are read"
        unread = f"a universal checkpoint in {where}, which is not read or checked"
    message = (
        f"folder holds the fp32 weights twice: {taken}, and {unread} (--zero-weights {kind} "
        f"reads {'them' if choice.universal else 'it'} instead; the two are never mixed)"
    )
    fix = f"ckptfix convert SRC -o OUT --zero-weights {kind} (reads {where} instead)"
    note = finding("other-weights", message, file=where, fix=fix)
    return Choice(read, choice.universal, {kind: where}, note)
