"""The tar archives torch wrote before 0.4: recognised, and refused as unsupported."""

from __future__ import annotations

from ckptfix.core.errors import UnsupportedFormatError
from ckptfix.core.findings import Finding
from ckptfix.formats import sniff
from ckptfix.formats.base import FORMATS, FileRead, ReadOptions
from ckptfix.io.source import ByteSource


class TarFormat:
    name = "tar"
    description = "a tar archive"

    def sniff(self, head: bytes) -> bool:
        return sniff.tar(head)

    def read(self, source: ByteSource, options: ReadOptions) -> FileRead:
        raise UnsupportedFormatError(
            source.label,
            "file is a tar archive (the PyTorch checkpoint format before 0.4), not read",
            "load and re-save it with torch.save in a trusted environment",
        )

    def checks(self, file: FileRead) -> list[Finding]:
        return []


TAR = FORMATS.register(TarFormat())
