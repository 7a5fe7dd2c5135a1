"""Weight-file formats, one module each, declared in the order they are tried: the first
whose first bytes (formats/sniff.py) a file has reads it, its module imported then (see
base.py). Folder formats (DCP, DeepSpeed, Megatron) register when their layout loads them."""

from ckptfix.formats.base import FORMATS, FileRead, ReadOptions, read_file, sniffed_name
from ckptfix.formats.sniff import FILE_FORMATS

for _name, _module, _sniff in FILE_FORMATS:
    FORMATS.declare(_name, _module, _sniff)

__all__ = ["FORMATS", "FileRead", "ReadOptions", "read_file", "sniffed_name"]
