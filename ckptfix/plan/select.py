"""What a conversion writes: exclusions, prefix stripping, shared-storage policy, content
dedupe and dtype casts, decided as data before anything is written."""

from __future__ import annotations

import fnmatch
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from ckptfix.checks.tensors import common_wrapper_prefixes, without_prefixes
from ckptfix.core.dtypes import DTYPES, byte_size
from ckptfix.core.errors import UsageError
from ckptfix.core.memory import paused_gc
from ckptfix.core.tensor import TensorInfo
from ckptfix.io.gather import fragmented

_GLOB_MAGIC = re.compile(r"[*?[]")


# Not frozen, for the reason TensorInfo is not (one per tensor written, 1,000,000 for some
# checkpoints): treat instances as immutable all the same.
@dataclass(slots=True)
class OutTensor:
    """A tensor to write: its output name and dtype, and the source tensor it comes from."""

    name: str
    source: TensorInfo
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def nbytes(self) -> int:
        if self.dtype == self.source.dtype:  # as stored (a block-quantized one too)
            return self.source.nbytes
        size = byte_size(DTYPES[self.dtype], self.source.numel)
        assert size is not None, "casts and dequantization target whole-byte dtypes"
        return size

    @property
    def streamed(self) -> bool:
        """Copied as byte ranges; otherwise gathered (a strided view, or pieces of runs too
        short to copy one by one) or cast, in memory, in bounded chunks."""
        return (
            self.source.contiguous
            and self.dtype == self.source.dtype
            and not fragmented(self.source)
        )

    @property
    def gathered_runs(self) -> bool:
        """Gathered from short runs and not cast: verified by gathering them again (cheaper
        than a digest of both sides), not by a digest."""
        return self.source.contiguous and self.dtype == self.source.dtype and not self.streamed

    @classmethod
    def same(cls, source: TensorInfo) -> OutTensor:
        return cls(source.name, source, source.dtype)

    @classmethod
    def unchanged(cls, sources: Sequence[TensorInfo]) -> tuple[OutTensor, ...]:
        """`same` of each tensor, built in one pass."""
        names, dtypes = map(attrgetter("name"), sources), map(attrgetter("dtype"), sources)
        return tuple(map(cls, names, sources, dtypes))


_DTYPE, _STORED = attrgetter("dtype"), attrgetter("source.dtype")
_STORED_NBYTES = attrgetter("source.nbytes")


def out_sizes(tensors: Sequence[OutTensor]) -> list[int]:
    """The `nbytes` of each tensor: in one pass in C when none changes dtype (a reshard,
    most conversions), where each is its source's."""
    if list(map(_DTYPE, tensors)) == list(map(_STORED, tensors)):
        return list(map(_STORED_NBYTES, tensors))
    return [tensor.nbytes for tensor in tensors]


@dataclass(frozen=True)
class Selection:
    """The tensors to write (output names, source order) and every name decision made."""

    tensors: tuple[OutTensor, ...]
    dropped: dict[str, str] = field(default_factory=dict)  # dropped name -> kept name
    renamed: dict[str, str] = field(default_factory=dict)  # source name -> output name
    excluded: tuple[str, ...] = ()
    dropped_bytes: int = 0
    kept_equal: tuple[tuple[str, ...], ...] = ()  # equal bytes, each name kept (by_content)
    merged: dict[str, str] = field(default_factory=dict)  # the drops of equal bytes (by_content)


def _keeper(names: Sequence[str], keep: str) -> str:
    """The name kept for a group of aliases: first, last, or the first matching a regex."""
    if keep == "first":
        return names[0]
    if keep == "last":
        return names[-1]
    pattern = re.compile(keep)
    return next((name for name in names if pattern.search(name)), names[0])


def check_keep(keep: str) -> None:
    if keep in ("first", "last"):
        return
    try:
        re.compile(keep)
    except re.error as exc:
        raise UsageError(
            "--keep",
            f"{keep!r} is not a regular expression: {exc}",
            "use first, last or a valid regex",
        ) from exc


def _exclusion(globs: Sequence[str]) -> Callable[[str], bool]:
    """One test for all --exclude globs, linear in the names: exact names (the usual long
    lists) are a set lookup, the rest one compiled pattern."""
    literal = {glob for glob in globs if not _GLOB_MAGIC.search(glob)}
    patterns = [fnmatch.translate(glob) for glob in globs if glob not in literal]
    wildcard = re.compile("|".join(patterns)).match if patterns else None

    def excluded(name: str) -> bool:
        return name in literal or (wildcard is not None and wildcard(name) is not None)

    return excluded


@dataclass(frozen=True)
class SelectOptions:
    exclude: tuple[str, ...] = ()  # globs of names to leave out
    strip_prefix: str | None = None  # None, "auto" or an exact prefix
    training_checkpoint: bool = False  # `model.` counts as a wrapper prefix there
    keep: str = "first"  # the name kept for aliases: first, last, or a regex to prefer
    clone: bool = False  # write every alias as its own copy
    by_content: bool = False  # merge separately stored tensors with equal bytes too
    dtype: str | None = None  # cast floating tensors to this dtype
    # by_content merges only these: {head: embedding} ties config.json declares. Other equal
    # tensors are kept (a loader needs every name) and reported.
    ties: dict[str, str] = field(default_factory=dict)
    dtypes: Mapping[str, str] = field(default_factory=dict)  # else this tensor's dtype
    # dropped -> kept from the source's ckptfix.dropped record: aliases as surely as names
    # on one storage (the dropped name is in the tensors, as the kept tensor)
    recorded: Mapping[str, str] = field(default_factory=dict)
    dequantize: str | None = None  # decode block-quantized (GGUF) tensors to this dtype


# The groups of tensors that hold equal bytes (checks.values.content_groups over the
# checkpoint's sources): the caller reads them, so that a plan is made of data alone.
EqualGroups = Callable[[Sequence[TensorInfo]], list[list[TensorInfo]]]


def select(
    tensors: Sequence[TensorInfo],
    options: SelectOptions,
    equal_groups: EqualGroups | None = None,
) -> Selection:
    """Decide names and dtypes; `equal_groups` finds the equal tensors `by_content` merges."""
    with paused_gc():  # an object per tensor, none in a cycle
        return _select(tensors, options, equal_groups)


def _select(
    tensors: Sequence[TensorInfo],
    options: SelectOptions,
    equal_groups: EqualGroups | None,
) -> Selection:
    check_keep(options.keep)
    kept_equal: tuple[tuple[str, ...], ...] = ()
    excluded: tuple[str, ...] = ()
    kept = list(tensors)
    if options.exclude:
        excluded_by = _exclusion(options.exclude)
        excluded = tuple(t.name for t in tensors if excluded_by(t.name))
        excluded_names = set(excluded)
        kept = [t for t in tensors if t.name not in excluded_names]
    renamed = _renames(kept, options)
    dropped: dict[str, str] = {}
    merged: dict[str, str] = {}
    if not options.clone:
        dropped.update(_aliases(kept, options.keep, renamed, options.recorded))
    if options.by_content:
        if equal_groups is None:
            raise ValueError("by_content needs equal_groups to find equal tensors")
        remaining = [t for t in kept if renamed.get(t.name, t.name) not in dropped]
        groups = [[renamed.get(t.name, t.name) for t in g] for g in equal_groups(remaining)]
        ties = {renamed.get(h, h): renamed.get(e, e) for h, e in options.ties.items()}
        merged = _declared_ties(groups, ties)
        dropped.update(merged)
        kept_equal = tuple(tuple(g) for g in groups if not set(g) & set(merged))
    out = []
    dropped_bytes = 0
    for tensor in kept:
        name = renamed.get(tensor.name, tensor.name)
        if name in dropped:
            dropped_bytes += tensor.nbytes
            continue
        kind = DTYPES[tensor.dtype]
        target = (options.dtype or options.dtypes.get(tensor.name)) if kind.is_floating else None
        target = target or (options.dequantize if kind.quantized else None) or tensor.dtype
        out.append(OutTensor(name, tensor, target))
    return Selection(tuple(out), dropped, renamed, excluded, dropped_bytes, kept_equal, merged)


def _prefixes(names: Sequence[str], options: SelectOptions) -> list[str]:
    if options.strip_prefix == "auto":
        return common_wrapper_prefixes(names, training_checkpoint=options.training_checkpoint)
    if not options.strip_prefix:
        return []
    if not any(name.startswith(options.strip_prefix) for name in names):
        examples = ", ".join(repr(name) for name in names[:3])
        raise UsageError(
            "--strip-prefix",
            f"no tensor name starts with {options.strip_prefix!r}",
            f"names look like {examples}; use auto to find the wrapper prefix",
        )
    return [options.strip_prefix]


def _renames(tensors: Sequence[TensorInfo], options: SelectOptions) -> dict[str, str]:
    """Source name -> output name for the names a stripped prefix changes; two names that
    would become one are a usage error."""
    names = list(map(attrgetter("name"), tensors))
    prefixes = _prefixes(names, options)
    if not prefixes and len(set(names)) == len(names):
        return {}  # nothing renamed, no two names alike

    def clash(name: str, other: str, new: str) -> UsageError:
        what = f"{name!r} and {other!r} would both become {new!r}"
        return UsageError("--strip-prefix", what, "strip less, or exclude one of them")

    owners = without_prefixes(names, prefixes, clash)
    return {name: new for new, name in owners.items() if new != name}


def _aliases(
    tensors: Sequence[TensorInfo],
    keep: str,
    renamed: dict[str, str],
    recorded: Mapping[str, str],
) -> dict[str, str]:
    """Exact aliases (same storage, offset, shape, strides, dtype) collapse to one name; a
    name the record dropped is one of its kept tensor's (a safetensors tensor has no
    storage of its own to share, so the record's names are its group)."""
    by_name = {t.name: t for t in tensors}
    linked = set(recorded) | set(recorded.values())
    groups: dict[tuple[object, ...], list[str]] = defaultdict(list)
    for t in tensors:
        base = by_name.get(recorded.get(t.name, t.name), t)
        if base.storage is None and t.name not in linked:
            continue
        storage = base.storage if base.storage is not None else ("recorded", base.name)
        key = (base.file, storage, base.byte_range, base.shape, base.strides, base.dtype)
        groups[key].append(renamed.get(t.name, t.name))
    return _drop_all_but_one(groups.values(), keep)


def _declared_ties(groups: Sequence[list[str]], ties: dict[str, str]) -> dict[str, str]:
    """The heads dropped for their embedding: only where config.json declares the tie and
    the two hold equal bytes. A loader expects every other name, equal or not."""
    merged = {}
    for names in groups:
        for head, embedding in ties.items():
            if head in names and embedding in names:
                merged[head] = embedding
    return merged


def _drop_all_but_one(groups: Iterable[list[str]], keep: str) -> dict[str, str]:
    dropped: dict[str, str] = {}
    for names in groups:
        if len(names) < 2:
            continue
        kept = _keeper(names, keep)
        dropped.update({name: kept for name in names if name != kept})
    return dropped
