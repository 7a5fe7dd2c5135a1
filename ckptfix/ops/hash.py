"""`hash`: a digest of every tensor and of the model, the same whatever the format, sharding,
tensor order, header metadata, strides or alias record (definition: ops.digest)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from operator import itemgetter

from ckptfix.core.memory import paused_gc
from ckptfix.core.tensor import TensorInfo
from ckptfix.ops.digest import (
    ALGORITHM,
    WORKERS,
    LayoutKey,
    Progress,
    content_digests,
    layout_key,
    model_digest,
    tensor_digest,
)
from ckptfix.ops.tensorset import Digester, TensorSet, opened

SCHEMA_VERSION = 1


# Not frozen: a frozen dataclass costs ~4 µs per instance to build, seconds for a header of
# 1,000,000 tensors. Treat instances as immutable all the same.
@dataclass(slots=True)
class TensorHash:
    """One name: its dtype and shape, its content digest and its (named) digest, in hex."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    content: str
    digest: str

    def to_dict(self) -> dict[str, object]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "content": self.content,
            "digest": self.digest,
        }


@dataclass(frozen=True)
class HashResult:
    """The model digest and every tensor's, sorted by name (the manifest, as data)."""

    path: str
    digest: str
    tensors: tuple[TensorHash, ...]
    aliases: dict[str, str] = field(default_factory=dict)  # dropped -> kept, from the record
    algorithm: str = ALGORITHM
    # Read from a URL: requests made and bytes fetched. Not part of the manifest (the same
    # model hashed from a local copy has the same manifest).
    remote: dict[str, int] | None = field(default=None, compare=False)
    # Which copy of a DeepSpeed folder's weights was hashed, when it holds two: not part of
    # the manifest either (it describes the folder, not the model).
    weights_note: str | None = field(default=None, compare=False)

    @property
    def tensor_count(self) -> int:
        return len(self.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors)

    def to_dict(self) -> dict[str, object]:
        """The `--json` document, which is also the manifest `--manifest` writes."""
        with paused_gc():
            return self._document()

    def _document(self) -> dict[str, object]:
        return {
            "schema_version": SCHEMA_VERSION,
            "algorithm": self.algorithm,
            "digest": self.digest,
            "path": self.path,
            "tensor_count": self.tensor_count,
            "total_bytes": self.total_bytes,
            "aliases": dict(sorted(self.aliases.items())),
            "tensors": {tensor.name: tensor.to_dict() for tensor in self.tensors},
        }


@dataclass(frozen=True)
class HashOptions:
    key: str = "auto"  # where the tensors sit in a training checkpoint
    alias_record: bool = True  # names recorded as dropped -> kept hash like the kept tensor
    workers: int = WORKERS
    progress: Progress | None = None
    # Who reads and hashes the tensors: this process (None) or an executor's tasks.
    digester: Digester | None = None


def hash_checkpoint(path: str | os.PathLike[str], options: HashOptions | None = None) -> HashResult:
    """Hash the checkpoint a loader would load from `path` (a file or a model folder)."""
    options = options or HashOptions()
    with opened(path, key=options.key, alias_record=options.alias_record) as tensors:
        result = hash_tensor_set(
            tensors, workers=options.workers, progress=options.progress, digester=options.digester
        )
        remote = tensors.checkpoint.remote if tensors.checkpoint is not None else None
        if remote is not None:
            result = replace(result, remote=remote.session.stats())
        return replace(result, weights_note=tensors.weights_note)


def hash_tensor_set(
    tensors: TensorSet,
    *,
    workers: int = WORKERS,
    progress: Progress | None = None,
    digester: Digester | None = None,
) -> HashResult:
    with paused_gc():  # several small objects per tensor: 1,000,000 tensors for some headers
        if digester is None:
            contents = content_digests(
                list(tensors.tensors.values()), tensors.source, workers=workers, progress=progress
            )
        else:
            contents = digester(tensors, list(tensors.tensors), progress)
        return result_of(tensors.path, tensors.tensors, contents, tensors.aliases)


def result_of(
    path: str,
    named: Mapping[str, TensorInfo],
    contents: Mapping[LayoutKey, bytes],
    aliases: Mapping[str, str],
) -> HashResult:
    """The result for names whose content digests are known (by layout key)."""
    entries = []
    digests: dict[str, bytes] = {}
    # Code point order, which is the order of the UTF-8 bytes; the pairs sorted rather than
    # the names and each looked up again (1,000,000 lookups in no order cost seconds).
    for name, tensor in sorted(named.items(), key=itemgetter(0)):
        content = contents[layout_key(tensor)]
        digest = digests[name] = tensor_digest(name, content)
        entries.append(
            TensorHash(name, tensor.dtype, tensor.shape, tensor.nbytes, content.hex(), digest.hex())
        )
    return HashResult(path, model_digest(digests).hex(), tuple(entries), dict(aliases))
