"""Git LFS pointers: the small text stub a clone holds until `git lfs pull` fetches the
file it stands for. Loaders fail on them with confusing errors ("HeaderTooLarge"); we
recognise the stub by its first line and say what it points to."""

from __future__ import annotations

import re

from ckptfix.core.errors import LfsPointerError
from ckptfix.core.findings import Finding
from ckptfix.core.sizes import format_size
from ckptfix.formats import sniff
from ckptfix.formats.base import FORMATS, FileRead, ReadOptions, head_of
from ckptfix.io.source import ByteSource

_SIZE = re.compile(rb"^size (\d+)\s*$", re.MULTILINE)
_OID = re.compile(rb"^oid sha256:([0-9a-f]{64})\s*$", re.MULTILINE)


class LfsPointerFormat:
    name = "lfs-pointer"
    description = "a Git LFS pointer"

    def sniff(self, head: bytes) -> bool:
        return sniff.lfs_pointer(head)

    def read(self, source: ByteSource, options: ReadOptions) -> FileRead:
        head = head_of(source)
        size = _SIZE.search(head)
        oid = _OID.search(head)
        target = f" to a {format_size(int(size[1]))} object" if size else ""
        ident = f" (oid sha256:{oid[1][:12].decode()}…)" if oid else ""
        raise LfsPointerError(
            source.label,
            "lfs-pointer",
            f"file is a Git LFS pointer{target}{ident}, not the weights",
            "run `git lfs pull`, or download the file itself",
        )

    def checks(self, file: FileRead) -> list[Finding]:
        return []


LFS_POINTER = FORMATS.register(LfsPointerFormat())
