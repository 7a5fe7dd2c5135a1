"""Shard index files (`model.safetensors.index.json` and friends): strict reading."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

from ckptfix.core.errors import CorruptFileError
from ckptfix.formats.strict_json import parse_header_json
from ckptfix.io.folder import LOCAL, Folder

MAX_INDEX_SIZE = 100_000_000
_FIX = "regenerate the index, or fix the entry by hand"
_DRIVE = re.compile(r"^[A-Za-z]:")


@dataclass(frozen=True)
class ShardIndex:
    """A validated index: tensor name -> shard file name, plus its metadata object."""

    path: str
    weight_map: dict[str, str]
    metadata: dict[str, Any]

    @property
    def shard_names(self) -> list[str]:
        """Shard files in first-mention order."""
        return list(dict.fromkeys(self.weight_map.values()))


def check_shard_name(name: str, path: str, weight_ext: str | None) -> None:
    """Refuse names that would escape the model folder or point at the wrong format."""
    if "\x00" in name or not name:
        raise CorruptFileError(
            path, "unsafe-shard-path", f"shard name {name!r} is empty or has NUL", _FIX
        )
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    if (
        posix.is_absolute()
        or windows.is_absolute()
        or _DRIVE.match(name)
        or name.startswith("\\")
        or ".." in posix.parts
        or ".." in windows.parts
    ):
        raise CorruptFileError(
            path,
            "unsafe-shard-path",
            f"shard name {name!r} points outside the model folder (path traversal)",
            _FIX,
        )
    if weight_ext is not None and not name.endswith("." + weight_ext):
        raise CorruptFileError(
            path,
            "wrong-shard-format",
            f"shard {name!r} is listed in a .{weight_ext} index but is not a .{weight_ext} file",
            _FIX,
        )


def read_index(
    path: str | os.PathLike[str], display: str, weight_ext: str | None, folder: Folder = LOCAL
) -> ShardIndex:
    """Read an index; `weight_ext` ('safetensors' or 'bin') is what its shards must end with."""
    raw = folder.read_small(os.fspath(path), display, MAX_INDEX_SIZE, "index")
    try:
        parsed = parse_header_json(raw, display)
    except CorruptFileError as exc:
        rule = exc.rule or "index-not-json"
        rule = "index-not-json" if rule.startswith("header-") else rule
        what = exc.what.replace("header", "index")
        raise CorruptFileError(display, rule, what, _FIX) from exc
    weight_map = parsed.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CorruptFileError(
            display, "index-no-weight-map", 'index has no "weight_map" object', _FIX
        )
    odd = set(map(type, weight_map.values())) - {str}  # (JSON values have exact types)
    for tensor, shard in weight_map.items() if odd else ():
        if not isinstance(shard, str):
            raise CorruptFileError(
                display,
                "index-bad-entry",
                f"weight_map entry {tensor!r} maps to a {type(shard).__name__}, not a file name",
                _FIX,
            )
    base = os.path.dirname(os.fspath(path))
    for shard in set(weight_map.values()):
        check_shard_name(shard, display, weight_ext)
        if folder.escapes(os.path.join(base, shard)):  # `%2e%2e/x` in a URL is `../x`
            raise CorruptFileError(
                display,
                "unsafe-shard-path",
                f"shard name {shard!r} points outside the model folder once its URL is "
                "decoded (path traversal)",
                _FIX,
            )
    metadata = parsed.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise CorruptFileError(
            display, "index-bad-metadata", 'index "metadata" is not an object', _FIX
        )
    return ShardIndex(path=display, weight_map=dict(weight_map), metadata=metadata)
