"""`load(path)`: the one loader every command starts from (see checkpoint.py)."""

from __future__ import annotations

import os

from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.errors import InputNotFoundError, UsageError
from ckptfix.formats import ReadOptions
from ckptfix.layouts.huggingface import load_file, load_folder


def load(path: str | os.PathLike[str], options: ReadOptions | None = None) -> Checkpoint:
    """Read a checkpoint file or model folder: every file once, tensor data untouched.

    A torch.distributed.checkpoint or DeepSpeed folder is read as the model it holds
    (`options.key` picks the part of a DCP app state; `options.zero_weights` DeepSpeed's
    master or module weights)."""
    shown = os.fspath(path)
    if not os.path.exists(shown):
        raise InputNotFoundError(shown, "no such file or directory", "check the path")
    options = options or ReadOptions()
    if os.path.isdir(shown):
        from ckptfix.layouts.training import load_training

        _refuse_hub_repository(shown)
        training = load_training(shown, options, options.zero_weights)
        return training if training is not None else load_folder(shown, options)
    if os.path.isfile(shown):
        from ckptfix.layouts.training import refuse_part

        refuse_part(shown)
        return load_file(shown, options)
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
