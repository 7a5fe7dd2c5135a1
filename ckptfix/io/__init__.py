"""Byte sources: where checkpoint bytes are read from (local files now, remote ones later)."""
