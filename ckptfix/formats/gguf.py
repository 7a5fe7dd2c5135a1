"""GGUF (llama.cpp, Ollama, LM Studio): the format plug-in. It is registered with every
run, so it stays light: the reader (`gguf_file`, on `gguf_header`) is imported when a GGUF
file is read.

Why not gguf-py's GGUFReader: it maps the whole file with numpy (a remote file cannot be
read by ranges that way, and a file truncated under a map is a crash, not an error), trusts
every count it reads, and builds numpy objects for every metadata value. The `gguf` package
is used only to dequantize (`convert --dequantize`) and by the tests.
"""

from __future__ import annotations

import re

from ckptfix.core.errors import CorruptFileError
from ckptfix.core.findings import Finding, finding
from ckptfix.formats import sniff
from ckptfix.formats.base import FORMATS, FileRead, Format, ReadOptions
from ckptfix.io.source import ByteSource

_HTML = rb"^\s*<(?:!doctype\s+html|html|head|body)\b"
_TITLE = rb"<title[^>]*>([^<]{1,80})"


def what_it_is(head: bytes, fmt: Format | None) -> str:
    """What a file named `.gguf` that is not GGUF holds, said from its first bytes."""
    if fmt is not None:
        return fmt.description
    if not head:
        return "an empty file"
    if not head.strip(b"\0"):
        return f"all zero bytes at its start (the first {len(head)}: never written)"
    if re.match(_HTML, head, re.IGNORECASE):  # compiled here: only a bad file needs it
        title = re.search(_TITLE, head, re.IGNORECASE)
        shown = f" titled {title[1].decode('utf-8', 'replace').strip()!r}" if title else ""
        return f"an HTML page{shown}"
    text = head.lstrip()
    if text[:1] in (b"{", b"["):
        return f"JSON text starting {text[:40].decode('utf-8', 'replace')!r}"
    if head[:64].isascii() and head[:64].decode("ascii").isprintable():
        return f"text starting {head[:40].decode('ascii')!r}"
    return f"binary data starting with bytes {head[:8].hex(' ')}"


def not_gguf(label: str, head: bytes, fmt: Format | None) -> CorruptFileError:
    return CorruptFileError(
        label,
        "gguf-bad-magic",
        f"file is named .gguf but is {what_it_is(head, fmt)}, not a GGUF file",
        "download it again from the model's repository: what was saved is not the model",
    )


class GgufFormat:
    """`.gguf`: llama.cpp's single-file format (header, metadata, tensor infos, data)."""

    name = "gguf"
    description = "a GGUF file"

    def sniff(self, head: bytes) -> bool:
        return sniff.gguf(head)

    def read(self, source: ByteSource, options: ReadOptions) -> FileRead:
        from ckptfix.formats.gguf_file import read_gguf

        return read_gguf(source)

    def checks(self, file: FileRead) -> list[Finding]:
        zero_tail = getattr(file, "zero_tail", 0)  # a GgufFile (formats.gguf_file)
        if not zero_tail:
            return []
        return [
            finding(
                "zero-filled",
                f"the last {zero_tail} bytes of tensor data are all zero: the file may "
                "be a preallocated download that never finished (re-download it; "
                "`ckptfix inspect --scan-values` checks every tensor)",
                file=file.label,
            )
        ]


GGUF = FORMATS.register(GgufFormat())
