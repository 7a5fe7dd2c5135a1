"""The Hugging Face cache (`~/.cache/huggingface/hub`): a repository folder
`models--org--name` holds `blobs/` (the files, by hash), `refs/` and `snapshots/<rev>/`,
whose entries are relative links into `../../blobs/`. A snapshot is read like any model
folder (links are followed for reading); it is never rewritten in place."""

from __future__ import annotations

import os

_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


def repo_root(path: str) -> bool:
    """A cache repository folder itself (`models--org--name`), not one of its snapshots."""
    name = os.path.basename(os.path.normpath(path))
    return name.startswith(_REPO_PREFIXES) and os.path.isdir(os.path.join(path, "snapshots"))


def snapshot_of(path: str) -> str | None:
    """The repository a snapshot folder belongs to, or None when `path` is not one."""
    real = os.path.normpath(os.path.abspath(path))
    snapshots = os.path.dirname(real)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) != "snapshots" or not repo_root(repo):
        return None
    return repo


def blobs_of(path: str) -> str | None:
    """The `blobs/` folder of the cache repository whose snapshot holds `path` (the snapshot
    itself or a folder in it, such as a pipeline's `unet/`), or None."""
    folder = os.path.normpath(os.path.abspath(path))
    while True:
        repo = snapshot_of(folder)
        if repo is not None:
            return os.path.join(repo, "blobs")
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def stays_inside(path: str, root: str) -> bool:
    """Whether a file of the checkpoint at `root`, links followed, is inside `root`, or in the
    blobs of the cache repository whose snapshot holds `root` (where a snapshot's links go):
    a link elsewhere may lead to any file of the user's, which is never read."""
    real = os.path.realpath(path)
    blobs = blobs_of(root)
    places = [os.path.realpath(root)] + ([os.path.realpath(blobs)] if blobs else [])
    return any(os.path.commonpath([real, place]) == place for place in places)


def snapshots(repo: str) -> list[str]:
    """The revisions a cache repository holds, newest first."""
    folder = os.path.join(repo, "snapshots")
    names = [name for name in os.listdir(folder) if os.path.isdir(os.path.join(folder, name))]
    return sorted(names, key=lambda name: -os.path.getmtime(os.path.join(folder, name)))
