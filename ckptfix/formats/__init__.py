"""Weight-file formats, one module each, registered in the order they are tried: the
first whose `sniff` recognises a file's first bytes reads it (see base.py)."""

from ckptfix.formats import (  # noqa: F401  (registration order matters)
    gguf,
    lfs,
    safetensors,
    tar,
    torch_legacy,
    torch_zip,
)
from ckptfix.formats.base import FORMATS, FileRead, ReadOptions, read_file, sniffed_name

__all__ = ["FORMATS", "FileRead", "ReadOptions", "read_file", "sniffed_name"]
