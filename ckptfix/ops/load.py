"""`load(path)`: the one loader every command starts from (see checkpoint.py)."""

from __future__ import annotations

import os
from dataclasses import replace

from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.errors import InputNotFoundError, UsageError
from ckptfix.core.memory import paused_gc
from ckptfix.formats import ReadOptions
from ckptfix.io.folder import LOCAL, Folder
from ckptfix.io.urls import is_url, refuse_unknown_scheme
from ckptfix.layouts.huggingface import load_file, load_folder


def load(path: str | os.PathLike[str], options: ReadOptions | None = None) -> Checkpoint:
    """Read a checkpoint file or model folder: every file once, tensor data untouched.

    A torch.distributed.checkpoint or DeepSpeed folder is read as the model it holds
    (`options.key` picks the part of a DCP app state; `options.zero_weights` DeepSpeed's
    master or module weights). A URL (s3://, gs://, hf://, http(s)://) is read by ranged
    requests (io.remote_folder), the same way."""
    with paused_gc():  # several objects per tensor, none in a cycle: 1,000,000 tensors occur
        return _load(os.fspath(path), options or ReadOptions())


def _load(shown: str, options: ReadOptions) -> Checkpoint:
    refuse_unknown_scheme(shown)
    if is_url(shown):
        return _load_url(shown, options)
    if not os.path.exists(shown):
        raise InputNotFoundError(shown, "no such file or directory", "check the path")
    if os.path.isdir(shown):
        _refuse_hub_repository(shown)
        return _load_folder(shown, options, LOCAL)
    if os.path.isfile(shown):
        return _load_file(shown, options, LOCAL)
    raise UsageError(shown, "not a regular file or folder", "pass a checkpoint file or folder")


def _refuse_hub_repository(path: str) -> None:
    """A Hugging Face cache repository (`models--org--name`) holds snapshots, not weights."""
    from ckptfix.layouts.hub import repo_root, snapshots

    if repo_root(path):
        revisions = snapshots(path)
        example = os.path.join(path, "snapshots", revisions[0] if revisions else "<revision>")
        raise UsageError(
            path,
            "is a Hugging Face cache repository (blobs/, refs/, snapshots/), not a model folder",
            f"pass one of its snapshots, e.g. {example}",
        )


def _load_folder(root: str, options: ReadOptions, folder: Folder) -> Checkpoint:
    from ckptfix.layouts.training import load_training

    training = load_training(root, options, options.zero_weights, folder)
    return training if training is not None else load_folder(root, options, folder)


def _load_file(path: str, options: ReadOptions, folder: Folder) -> Checkpoint:
    from ckptfix.layouts.training import refuse_part

    refuse_part(path)
    if path.endswith(".gguf"):  # the first part of a llama.cpp split set names the set
        from ckptfix.layouts.gguf import load_split_set

        split = load_split_set(path, options, folder)
        if split is not None:
            return split
    return load_file(path, options, folder)


def _load_url(url: str, options: ReadOptions) -> Checkpoint:
    """The remote backends (botocore, fsspec, ...) are imported from here, and only from here
    (the remote extra)."""
    from ckptfix.io.remote_folder import open_url

    target = open_url(url)
    if target.file is None:
        checkpoint = _load_folder(target.url, options, target.folder)
    else:
        checkpoint = _load_file(target.url, options, target.folder)
    return replace(checkpoint, remote=target.folder)
