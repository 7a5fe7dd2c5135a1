"""`convert --to torch`: pytorch_model*.bin shards written by torch.save, one shard in memory
at a time, then read back with ckptfix's own reader and compared tensor by tensor."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

from ckptfix.core.dtypes import TORCH_NAMES
from ckptfix.core.errors import CorruptFileError, VerificationError
from ckptfix.formats import read_file
from ckptfix.io.gather import tensor_bytes
from ckptfix.io.source import LocalFile
from ckptfix.plan.select import OutTensor
from ckptfix.plan.shards import ShardPlan
from ckptfix.write.output import write_index
from ckptfix.write.results import WrittenFile
from ckptfix.write.safetensors import ShardJob, produce


def write_torch_shards(plan: ShardPlan, job: ShardJob) -> list[WrittenFile]:
    import torch

    written: list[WrittenFile] = []
    done = 0
    for shard in plan.shards:
        state: dict[str, torch.Tensor] = {}
        digests: dict[str, bytes] = {}
        for name in shard.tensors:
            tensor = job.tensors[name]
            data = b"".join(produce(job.sources, tensor))
            digests[name] = hashlib.blake2b(data, digest_size=32).digest()
            state[name] = _as_torch(data, tensor)
            done += len(data)
            if job.progress is not None:
                job.progress(done, plan.total_size)
        path = os.path.join(job.staging, shard.file)
        with open(path, "xb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        del state
        if job.verify:
            _verify(path, os.path.join(job.out, shard.file), digests)
        written.append(WrittenFile(shard.file, os.path.getsize(path)))
    if plan.index_file is not None:
        size = write_index(os.path.join(job.staging, plan.index_file), plan, job.index_metadata)
        written.append(WrittenFile(plan.index_file, size))
    return written


def _as_torch(data: bytes, tensor: OutTensor) -> Any:
    import torch

    dtype = getattr(torch, TORCH_NAMES[tensor.dtype])
    values = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
    return values.view(dtype).reshape(tensor.shape).clone()


def _verify(path: str, display: str, digests: Mapping[str, bytes]) -> None:
    source = LocalFile(path, display)
    try:
        weight_file = read_file(source)
    except CorruptFileError as exc:
        raise VerificationError(
            display,
            f"written file does not read back: {exc.detail()}",
            "this is a bug; please report it",
        ) from exc
    if [t.name for t in weight_file.tensors] != list(digests):
        raise VerificationError(
            display,
            "written file holds other tensors than planned",
            "this is a bug; please report it",
        )
    with source:
        for tensor in weight_file.tensors:
            got = hashlib.blake2b(tensor_bytes(source, tensor), digest_size=32).digest()
            if got != digests[tensor.name]:
                raise VerificationError(
                    display,
                    f"tensor {tensor.name!r} reads back different",
                    "check the disk, then run again",
                )
