"""llama.cpp split sets: `name-00001-of-00003.gguf`, ... A set is named by its first part,
as llama.cpp loads one (`llama-cli -m name-00001-of-00003.gguf` reads the others beside
it): that path stands for the set, and the set's other parts, and only those, are read.
In a folder, a set is one family of `layouts.names` (see `layouts.choice`)."""

from __future__ import annotations

import os

from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.errors import UsageError
from ckptfix.formats.base import ReadOptions
from ckptfix.io.folder import LOCAL, Folder
from ckptfix.layouts.huggingface import read_record
from ckptfix.layouts.names import GGUF, GGUF_PART_RE, Family, FolderLayout

SPLIT_KIND = "gguf-split"


def part_name(stem: str, number: int, count: int) -> str:
    """A part's name as llama.cpp's `llama_split_path` makes it (numbers from 1)."""
    return f"{stem}-{number:05d}-of-{count:05d}.gguf"


def split_part(path: str) -> tuple[str, int, int] | None:
    """(stem, part, count) when a file is named as a part of a split set."""
    match = GGUF_PART_RE.match(os.path.basename(path))
    if match is None:
        return None
    return match["stem"], int(match["part"]), int(match["total"])


def set_members(root: str, stem: str, folder: Folder = LOCAL) -> list[str]:
    """The parts of the set named `stem` that a folder holds, in name order (whatever count
    each names: parts of two exports are all listed, and the checks say so)."""
    names = []
    for name in folder.file_names(root):
        match = GGUF_PART_RE.match(name)
        if match is not None and match["stem"] == stem:
            names.append(name)
    return names


def load_split_set(path: str, options: ReadOptions, folder: Folder = LOCAL) -> Checkpoint | None:
    """The split set a part's path names (None when the path does not name one): its first
    part stands for the set; another part alone is refused, as llama.cpp refuses it."""
    named = split_part(path)
    if named is None:
        return None
    stem, number, count = named
    root = os.path.dirname(path)
    if number != 1:
        first = os.path.join(root, part_name(stem, 1, count))
        raise UsageError(
            path,
            f"file is part {number} of {count} of a GGUF split set, which is read from its "
            "first part",
            f"pass {first} (or the folder that holds the set)",
        )
    given = os.path.basename(path)
    names = set_members(root or ".", stem, folder)
    labels = [path if name == given else os.path.join(root, name) for name in names]
    if given not in names:  # the path given is the set's first part: read whatever else
        labels.insert(0, path)
    sources = [folder.open(label) for label in labels]
    records = folder.map(lambda source: read_record(source, options), sources)
    family = Family(stem, None, GGUF, [os.path.basename(label) for label in labels])
    return Checkpoint(
        path=path,
        kind=SPLIT_KIND,
        files=tuple(records),
        layout=FolderLayout((family,), tuple(family.files), None),
        sources={source.label: source for source in sources},
        exists={},
    )
