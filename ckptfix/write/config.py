"""config.json in the output of a cast: the dtype values `convert --dtype` sets, written
over the copy carried into the staging folder (plan.config_dtype decides the edits).

Only that copy is ever read here, opened in the staging folder without following a link: a
config.json carried as a link (one pointing outside the model folder) is never planned for
editing (`write.extras.carried_as_file`), and one that became a link since is an error, so
a link's target is never read into the output."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from ckptfix.core.errors import CorruptFileError, SourceChangedError
from ckptfix.plan.config_dtype import ConfigEdit, retype
from ckptfix.platform import system
from ckptfix.platform.folders import FolderHandle

NAME = "config.json"


def config_text(data: bytes, path: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptFileError(
            path, "config-not-json", "config.json is not UTF-8", "save it as UTF-8 JSON"
        ) from exc


def _read_copy(folder: FolderHandle, path: str, limit: int) -> tuple[str, int]:
    """The carried copy's text and permission bits; anything but a regular file there (a
    link, gone) is not what was planned."""
    try:
        fd = folder.open_file(NAME)
    except OSError as exc:
        raise SourceChangedError(path) from exc
    with open(fd, "rb") as handle:
        info = os.fstat(fd)
        if info.st_size > limit:
            raise SourceChangedError(path)
        return config_text(handle.read(limit + 1), path), stat.S_IMODE(info.st_mode)


def retype_config(staging: str, edits: Sequence[ConfigEdit], limit: int) -> None:
    """Set the cast dtype in the copied config.json, as planned: a new file, fsynced, put in
    place of the copy by a rename."""
    if not edits:
        return
    path = os.path.join(staging, NAME)
    with system().open_folder(staging, follow=False) as folder:
        text, mode = _read_copy(folder, path, limit)
        text, found = retype(text, edits[0].new)
        if tuple(found) != tuple(edits):
            raise SourceChangedError(path)
        temporary = NAME + ".ckptfix-tmp"
        fd = folder.create(temporary, 0o600)
        with open(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            system().set_mode(fd, os.path.join(staging, temporary), mode)
            system().sync(fd)
        folder.replace(temporary, NAME)
