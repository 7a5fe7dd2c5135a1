"""The checkpoint model every command works from: what the loader found and read, once.

`load()` (ckptfix.ops.load) fills it; `inspect` runs checks over it and write commands plan
from it. Read errors are data here (a FileRecord with an error), not exceptions, so a
folder with one broken shard is still described in full.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ckptfix.core.errors import CkptfixError
from ckptfix.core.tensor import TensorInfo, concatenated
from ckptfix.core.training import TrainingLayout

if TYPE_CHECKING:  # what the layers above fill it with: core imports none of them
    from ckptfix.formats.base import FileRead
    from ckptfix.formats.index import ShardIndex
    from ckptfix.io.source import ByteSource


@dataclass(frozen=True)
class FileRecord:
    """One weight file: what reading it gave, or the error that stopped it."""

    label: str
    format: str
    size: int
    read: FileRead | None = None
    error: CkptfixError | None = None

    @property
    def tensors(self) -> tuple[TensorInfo, ...]:
        return self.read.tensors if self.read is not None else ()

    @property
    def metadata(self) -> dict[str, str] | None:
        return self.read.metadata if self.read is not None else None


@dataclass(frozen=True)
class IndexRecord:
    """A shard index of one weight family: parsed, or the error that stopped it."""

    label: str
    size: int
    family: str  # the family's key, see layouts.huggingface.Family.key
    index: ShardIndex | None = None
    error: CkptfixError | None = None


@dataclass(frozen=True)
class ConfigRecord:
    """`config.json`: parsed, or the error that stopped it."""

    label: str
    config: dict[str, Any] | None = None
    error: CkptfixError | None = None


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint file or folder as read: files, indexes, config, and every tensor."""

    path: str
    kind: str  # "folder", "dcp", "deepspeed", or the format of a single file
    files: tuple[FileRecord, ...]
    indexes: tuple[IndexRecord, ...] = ()
    config: ConfigRecord | None = None
    layout: Any = None  # the folder layout that organised it (layouts.huggingface.FolderLayout)
    sources: dict[str, ByteSource] = field(default_factory=dict, repr=False, compare=False)
    exists: dict[str, bool] = field(default_factory=dict, repr=False, compare=False)
    # A training checkpoint folder (DCP, DeepSpeed): its layout, findings and what is left out.
    training: TrainingLayout | None = None
    # A Hugging Face folder: the checkpoint its loader would load (layouts.choice.Choice).
    choice: Any = None

    @property
    def chosen_files(self) -> tuple[FileRecord, ...]:
        """The files of the checkpoint a loader would load: in a folder, its chosen family
        (every file when several separate checkpoints stand side by side)."""
        if self.choice is None or not self.choice.files:
            return self.files
        wanted = {os.path.join(self.path, name) for name in self.choice.files}
        return tuple(record for record in self.files if record.label in wanted)

    @property
    def model_tensors(self) -> tuple[TensorInfo, ...]:
        """The tensors of the checkpoint a loader would load (see chosen_files)."""
        return concatenated(record.tensors for record in self.chosen_files)

    # A checkpoint read from a URL: the folder it was read through (io.remote_folder.
    # RemoteFolder), which lists the rest of the folder and counts requests and bytes.
    remote: Any = field(default=None, repr=False, compare=False)

    @property
    def tensors(self) -> tuple[TensorInfo, ...]:
        return concatenated(record.tensors for record in self.files)

    def record(self, label: str) -> FileRecord | None:
        return self._by_label.get(label)

    @cached_property
    def _by_label(self) -> dict[str, FileRecord]:
        """The first record of each label: a folder of 1,100 shards asks for each several
        times, and a scan per question is 1,100 × 1,100."""
        found: dict[str, FileRecord] = {}
        for record in self.files:
            found.setdefault(record.label, record)
        return found

    def source(self, label: str) -> ByteSource:
        return self.sources[label]

    def close(self) -> None:
        """Close every source the loader opened."""
        for source in self.sources.values():
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
