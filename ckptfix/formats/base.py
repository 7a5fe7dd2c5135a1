"""The format plug-in protocol and its registry.

A format says whether a file's first bytes are its own (`sniff`), reads a file into tensor
descriptors without touching tensor data (`read`), and knows the findings only it can see
(`checks`). Formats are declared in FORMATS in the order they are tried (formats/sniff.py:
each one's first bytes), and a format's module is imported the first time a file is of it,
registering itself; the first whose `sniff` says yes reads the file. A file's format is never decided by its name alone.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from ckptfix.core.errors import CorruptFileError
from ckptfix.core.findings import Finding, finding
from ckptfix.core.tensor import TensorInfo
from ckptfix.io.source import ByteSource

SNIFF_BYTES = 1024  # enough for every format's magic, the tar header's included


@dataclass(frozen=True)
class ReadOptions:
    """What the caller asks of a reader: where a training checkpoint keeps its tensors, and
    which weights of a DeepSpeed checkpoint (fp32 "master" ones or the "module" copy)."""

    key: str = "auto"
    zero_weights: str = "master"


@dataclass(frozen=True)
class FileRead:
    """One weight file read into descriptors (tensor data untouched). Formats extend it
    with what their own checks need."""

    label: str
    format: str
    size: int
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str] | None = None


class Format(Protocol):
    """A weight-file format. Implementations are plain classes, one module each."""

    name: str  # as reported, e.g. "safetensors", "torch-zip"
    description: str  # "a safetensors file": for messages about a file of this kind

    def sniff(self, head: bytes) -> bool:
        """Whether these first bytes (up to SNIFF_BYTES) are this format's."""
        ...

    def read(self, source: ByteSource, options: ReadOptions) -> FileRead:
        """Read descriptors; raise a CkptfixError naming the rule when the file is bad."""
        ...

    def checks(self, file: FileRead) -> list[Finding]:
        """Findings about one file that was read, which only this format can see."""
        ...


@dataclass
class _Entry:
    """A registered format, or one declared by name and first bytes whose module is
    imported the first time it is needed (it then registers itself, filling `format`)."""

    name: str
    module: str | None = None
    sniff: Callable[[bytes], bool] | None = None
    format: Format | None = None

    def load(self) -> Format:
        if self.format is None:
            importlib.import_module(str(self.module))
        assert self.format is not None, f"{self.module} registers no format {self.name!r}"
        return self.format

    def claims(self, head: bytes) -> bool:
        if self.sniff is not None:
            return self.sniff(head)
        return self.format is not None and self.format.sniff(head)


class Registry:
    """Formats in the order they are tried."""

    def __init__(self) -> None:
        self._entries: list[_Entry] = []

    def declare(self, name: str, module: str, sniff: Callable[[bytes], bool]) -> None:
        """A format tried by `sniff` whose module loads only for a file it claims."""
        self._entries.append(_Entry(name, module, sniff))

    def register(self, fmt: Format) -> Format:
        entry = next((e for e in self._entries if e.name == fmt.name), None)
        if entry is None:
            self._entries.append(_Entry(fmt.name, format=fmt))
        else:
            entry.format = fmt
        return fmt

    def __iter__(self) -> Iterator[Format]:
        return iter([entry.load() for entry in self._entries])

    def named(self, name: str) -> Format:
        return next(entry.load() for entry in self._entries if entry.name == name)

    def sniff(self, head: bytes) -> Format | None:
        return next((entry.load() for entry in self._entries if entry.claims(head)), None)


FORMATS = Registry()


def empty_names(count: int, label: str) -> list[Finding]:
    """The finding about `count` tensors of a file stored under the empty name (none for 0)."""
    if not count:
        return []
    message = (
        f"{count} tensor(s) have an empty name, which loaders cannot address "
        "(rename them at export)"
    )
    return [finding("empty-name", message, file=label, tensors=[""])]


def head_of(source: ByteSource) -> bytes:
    return source.read_at(0, min(SNIFF_BYTES, source.size))


def sniffed_name(source: ByteSource) -> str:
    """The format a file's first bytes say it is, or "unknown" (for reports of bad files)."""
    try:
        fmt = FORMATS.sniff(head_of(source))
    except Exception:  # unreadable: the read itself reports why
        return "unknown"
    return fmt.name if fmt is not None else "unknown"


_GGUF_OR_STUB = ("gguf", "lfs-pointer")  # a .gguf that is an LFS stub says so as one


def read_file(source: ByteSource, options: ReadOptions | None = None) -> FileRead:
    """Read any weight file by its first bytes. A file named `.safetensors` that is not one
    is refused as such; one that no format claims gets the safetensors reader, whose rules
    say precisely what is wrong (too small, absurd header length, ...)."""
    head = head_of(source)
    fmt = FORMATS.sniff(head)
    if source.label.endswith(".gguf") and (fmt is None or fmt.name not in _GGUF_OR_STUB):
        from ckptfix.formats.gguf import not_gguf

        raise not_gguf(source.label, head, fmt)
    named_safetensors = source.label.endswith(".safetensors")
    if fmt is None and named_safetensors:
        fmt = FORMATS.named("safetensors")
    if fmt is None:
        raise CorruptFileError(
            source.label,
            "unknown-format",
            "file is not a recognised checkpoint format (safetensors, GGUF, PyTorch zip or pickle)",
            "check that this is a weight file",
        )
    if named_safetensors and fmt.name in ("torch-zip", "torch-legacy", "gguf"):
        raise CorruptFileError(
            source.label,
            "not-safetensors",
            f"file is named .safetensors but is {fmt.description}",
            "rename it to what it is, or convert it with `ckptfix convert`",
        )
    return fmt.read(source, options or ReadOptions())
