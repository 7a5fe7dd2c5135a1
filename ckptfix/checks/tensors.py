"""Findings about the tensors themselves: sizes, dtypes and wrapper prefixes."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter

from ckptfix.core.dtypes import DTYPES, U64_MAX
from ckptfix.core.errors import CorruptFileError
from ckptfix.core.findings import Finding, finding
from ckptfix.core.tensor import TensorInfo

HUGE = 2**31
_DTYPE = attrgetter("dtype")


def tensor_findings(tensors: Sequence[TensorInfo], max_shard: int) -> list[Finding]:
    """Size and dtype findings, one per file and code so large models stay readable."""
    huge: dict[str, list[TensorInfo]] = defaultdict(list)
    oversized: dict[str, list[TensorInfo]] = defaultdict(list)
    unwritable: dict[str, list[TensorInfo]] = defaultdict(list)
    # numel >= 2^31 needs nbytes >= 2^30 even at 4 bits per element: only tensors at least
    # that large or over the shard limit, and tensors of no bytes (whose shape may still be
    # past 64 bits), are looked at again (one pass in C over the rest).
    floor = min(HUGE // 2, max_shard + 1)
    for tensor in [tensor for tensor in tensors if tensor.nbytes >= floor or not tensor.nbytes]:
        if not tensor.nbytes and any(dim > U64_MAX for dim in tensor.shape):
            unwritable[tensor.file].append(tensor)
        if tensor.nbytes >= HUGE // 2 and (tensor.numel >= HUGE or tensor.nbytes >= HUGE):
            huge[tensor.file].append(tensor)
        if tensor.nbytes > max_shard:
            oversized[tensor.file].append(tensor)
    found = [_unwritable_shapes(file, group) for file, group in unwritable.items()]
    for file, group in huge.items():
        biggest = max(group, key=lambda tensor: tensor.numel)
        found.append(
            finding(
                "huge-numel",
                f"{len(group)} tensor(s) reach 2^31 elements or bytes, e.g. {biggest.name!r} with "
                f"{biggest.numel} elements ({biggest.nbytes} bytes); readers that size arrays in "
                "32-bit integers overflow on them (make sure consumers use 64-bit sizes, or split them)",
                file=file,
                tensors=[tensor.name for tensor in group],
            )
        )
    for file, group in oversized.items():
        biggest = max(group, key=lambda tensor: tensor.nbytes)
        found.append(
            finding(
                "oversized-tensor",
                f"{len(group)} tensor(s) exceed the shard limit of {max_shard} bytes, e.g. "
                f"{biggest.name!r} at {biggest.nbytes} bytes; each will need a shard of its own "
                "(raise --max-shard if a hard limit applies)",
                file=file,
                tensors=[tensor.name for tensor in group],
            )
        )
    floating = sorted(name for name in set(map(_DTYPE, tensors)) if DTYPES[name].is_floating)
    if len(floating) > 1:
        found.append(
            finding(
                "dtype-mix",
                f"floating tensors come in {len(floating)} dtypes ({', '.join(floating)}); check this "
                "is intended (`ckptfix convert --dtype` casts them to one)",
                tensors=(),
            )
        )
    return found


def _unwritable_shapes(file: str, group: list[TensorInfo]) -> Finding:
    """Dimensions past 2^64 - 1, which no safetensors file can hold (its reader refuses one
    as bad-shape). Only a tensor of no elements can claim one without claiming more bytes
    than its file holds, which every reader checks: a pickled view of shape (2**70, 0), a DCP
    entry, zero-element pieces of a per-rank set placed past 2^64. Refused here, once for
    every reader, instead of failing the verification of what a rewrite wrote."""
    shape = str(list(group[0].shape))
    shown = shape if len(shape) <= 80 else f"{shape[:77]}..."
    error = CorruptFileError(
        file,
        "bad-shape",
        f"{len(group)} tensor(s) have a dimension past 2^64 - 1, which no safetensors file can "
        f"hold, e.g. {group[0].name!r} of shape {shown}",
        "re-export the checkpoint",
    )
    names = [tensor.name for tensor in group]
    return finding("corrupt-file", error.detail(), file=file or None, tensors=names)


WRAPPER_PREFIXES = {
    "module.": "DistributedDataParallel / DataParallel",
    "_orig_mod.": "torch.compile",
    "_forward_module.": "Lightning",
    "model.": "Lightning",
}


def common_wrapper_prefixes(names: Sequence[str], *, training_checkpoint: bool) -> list[str]:
    """Wrapper prefixes that every name carries, outermost first (e.g. module._orig_mod.).

    `model.` counts only inside a training checkpoint (Lightning's LightningModule.model):
    in a Hugging Face shard it is the ordinary name of the base model.
    """
    candidates = [p for p in WRAPPER_PREFIXES if training_checkpoint or p != "model."]
    found: list[str] = []
    current = list(names)
    while current:
        prefix = next((p for p in candidates if all(n.startswith(p) for n in current)), None)
        if prefix is None or any(len(n) == len(prefix) for n in current):
            break
        found.append(prefix)
        current = [n[len(prefix) :] for n in current]
    return found


def without_prefixes(
    names: Iterable[str], prefixes: Sequence[str], clash: Callable[[str, str, str], Exception]
) -> dict[str, str]:
    """Name without `prefixes` (each removed where it starts what is left, in order:
    `module.` then `_orig_mod.`) -> name; `clash(name, other, new)` is raised when two names
    would become one (the rewrites' and diff's --strip-prefix)."""
    owners: dict[str, str] = {}
    for name in names:
        new = name
        for prefix in prefixes:
            new = new.removeprefix(prefix)
        if new in owners:
            raise clash(name, owners[new], new)
        owners[new] = name
    return owners


def wrapper_prefix_findings(
    tensors: Sequence[TensorInfo], *, training_checkpoint: bool
) -> list[Finding]:
    prefixes = common_wrapper_prefixes(
        [tensor.name for tensor in tensors], training_checkpoint=training_checkpoint
    )
    if not prefixes:
        return []
    chain = "".join(prefixes)
    sources = ", ".join(dict.fromkeys(WRAPPER_PREFIXES[p] for p in prefixes))
    return [
        finding(
            "wrapper-prefix",
            f"every tensor name starts with {chain!r} (left by {sources}); loaders expect the "
            "bare names (`ckptfix convert --strip-prefix auto` removes it)",
            tensors=(),
        )
    ]
