"""The files around the weights of a remote model folder (config, tokenizer, sub-folders),
downloaded into the staging folder by ranged reads of bounded size, each file created
exclusively and fsynced. A remote folder holds only files and folders: no links, no FIFOs."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ckptfix.io.folder import Folder
from ckptfix.platform import system
from ckptfix.write.copy import write_all
from ckptfix.write.results import WrittenFile

CHUNK = 8 * 2**20


def _download(folder: Folder, url: str, target: str) -> int:
    source = folder.open(url)
    fd = system().create(target, 0o666)
    try:
        offset = 0
        while offset < source.size:
            data = source.read_at(offset, min(CHUNK, source.size - offset))
            write_all(fd, data, offset)
            offset += len(data)
        system().sync(fd)
    finally:
        os.close(fd)
    return offset


def download_extra(
    folder: Folder, source_root: str, names: Sequence[str], staging: str
) -> list[WrittenFile]:
    """Download the named entries of a remote folder (folders with all they hold) into
    `staging`; returns the files written, with their sizes."""
    written = []
    pending = list(reversed(names))
    while pending:
        relative = pending.pop()
        url, target = os.path.join(source_root, relative), os.path.join(staging, relative)
        if folder.is_dir(url):
            os.mkdir(target)
            children = folder.listdir(url)
            pending.extend(os.path.join(relative, child) for child in reversed(children))
        elif folder.is_file(url):
            written.append(WrittenFile(relative, _download(folder, url, target)))
    return written
