"""Proving a cloned range equal to its source without reading it: both files map the range
to the same physical blocks, on the same filesystem. Blocks are the bytes, so two files that
share every block of a range hold the same bytes there.

Where the system maps files (`Platform.extent_map`: FIEMAP on Linux) only plain extents
count; anywhere else, or for an extent without a comparable physical address (delalloc,
unwritten, inline, compressed, encrypted), the range is compared byte for byte by the caller.
"""

from __future__ import annotations

import os

from ckptfix.platform import system


def same_blocks(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, length: int) -> bool:
    """True only if both ranges lie on the same physical blocks of one filesystem (then they
    hold the same bytes); False when that is not so or cannot be told."""
    if os.fstat(src_fd).st_dev != os.fstat(dst_fd).st_dev:
        return False  # physical addresses of two devices are not comparable
    source = system().extent_map(src_fd, src_offset, length)
    if not source:  # an unmapped (all-hole) range proves nothing here: compare its bytes
        return False
    return source == system().extent_map(dst_fd, dst_offset, length)
