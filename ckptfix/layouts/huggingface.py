"""Hugging Face model folders: load every weight file, index and config.json, once.

Which files are weights and which family each belongs to comes from `folder.scan_folder`
(names: `model*.safetensors`, `pytorch_model*.bin`, variants, loose files). Reading never
stops at a bad file: its error is recorded and the rest is still read.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ckptfix.core.checkpoint import Checkpoint, ConfigRecord, FileRecord, IndexRecord
from ckptfix.core.errors import CkptfixError, CorruptFileError
from ckptfix.formats import ReadOptions, read_file, sniffed_name
from ckptfix.formats.index import read_index
from ckptfix.io.folder import LOCAL, Folder
from ckptfix.io.source import ByteSource
from ckptfix.layouts.choice import choose
from ckptfix.layouts.names import Family, FolderLayout, scan_folder

MAX_CONFIG_SIZE = 16 * 2**20


def family_key(family: Family) -> str:
    return f"{family.stem}|{family.variant or ''}|{family.ext}"


def read_record(source: ByteSource, options: ReadOptions) -> FileRecord:
    """Read one weight file; a problem that has a finding code is recorded, not raised."""
    try:
        size = source.size
    except CkptfixError as exc:
        if exc.code is None:  # a remote error: the run stops, as for a write
            raise
        return FileRecord(source.label, "unknown", 0, error=exc)
    try:
        read = read_file(source, options)
    except CkptfixError as exc:
        if exc.code is None:
            raise
        return FileRecord(source.label, sniffed_name(source), size, error=exc)
    return FileRecord(source.label, read.format, size, read=read)


class _Reader:
    """Reads each file of a folder at most once, keeping their sources open."""

    def __init__(self, options: ReadOptions, folder: Folder = LOCAL) -> None:
        self.options = options
        self.folder = folder
        self.records: dict[str, FileRecord] = {}
        self.sources: dict[str, ByteSource] = {}

    def read(self, path: str) -> FileRecord:
        if path not in self.records:
            source = self.folder.open(path)
            self.sources[path] = source
            self.records[path] = read_record(source, self.options)
        return self.records[path]

    def read_all(self, paths: list[str]) -> None:
        """Read each file once, several at a time where the folder says so (remote ones);
        the records keep the order of `paths`."""
        todo = [self.folder.open(path) for path in dict.fromkeys(paths) if path not in self.records]
        records = self.folder.map(lambda source: read_record(source, self.options), todo)
        for source, record in zip(todo, records, strict=True):
            self.sources[source.label] = source
            self.records[source.label] = record


def _read_indexes(
    root: str, layout: FolderLayout, reader: _Reader, exists: dict[str, bool]
) -> list[IndexRecord]:
    records = []
    for family in layout.families:
        if family.index is None:
            continue
        path = os.path.join(root, family.index)
        weight_ext = family.ext if family.ext in ("safetensors", "bin") else None
        size = reader.folder.size(path) if reader.folder.is_file(path) else 0
        try:
            index = read_index(path, path, weight_ext, reader.folder)
        except CorruptFileError as exc:
            records.append(IndexRecord(path, size, family_key(family), error=exc))
            continue
        records.append(IndexRecord(path, size, family_key(family), index=index))
        for shard in index.shard_names:  # shards in sub-folders are not in the scan
            shard_path = os.path.join(root, shard)
            exists[shard_path] = reader.folder.is_file(shard_path)
            if exists[shard_path]:
                reader.read(shard_path)
    return records


def _read_config(root: str, folder: Folder = LOCAL) -> ConfigRecord | None:
    path = os.path.join(root, "config.json")
    if not folder.is_file(path):
        return None
    try:
        config: Any = json.loads(folder.read_small(path, path, MAX_CONFIG_SIZE, "config"))
    except CorruptFileError as exc:
        return ConfigRecord(path, error=exc)
    except (ValueError, RecursionError) as exc:
        what = f"config.json is not valid JSON: {str(exc)[:80]}"
        return ConfigRecord(path, error=CorruptFileError(path, "config-not-json", what, _FIX))
    if not isinstance(config, dict):
        what = "config.json is not a JSON object"
        return ConfigRecord(path, error=CorruptFileError(path, "config-not-object", what, _FIX))
    return ConfigRecord(path, config=config)


_FIX = "fix or re-download it"


def load_folder(root: str, options: ReadOptions, folder: Folder = LOCAL) -> Checkpoint:
    """Every weight file, index and the config of a model folder, each read once."""
    layout = scan_folder(root, folder)
    reader = _Reader(options, folder)
    reader.read_all([os.path.join(root, name) for name in layout.weight_files])
    exists: dict[str, bool] = {}
    indexes = _read_indexes(root, layout, reader, exists)
    indexed = {shard for record in indexes if record.index for shard in record.index.shard_names}
    for family in layout.families:  # a loose file an index lists belongs to that checkpoint
        if family.stem == "loose":
            family.files = [name for name in family.files if name not in indexed]
    shards = {
        os.path.basename(record.label): record.index.shard_names
        for record in indexes
        if record.index is not None
    }
    return Checkpoint(
        path=root,
        kind="folder",
        files=tuple(reader.records.values()),
        indexes=tuple(indexes),
        config=_read_config(root, folder),
        layout=layout,
        sources=dict(reader.sources),
        exists=exists,
        choice=choose(layout, shards),
    )


def load_file(path: str, options: ReadOptions, folder: Folder = LOCAL) -> Checkpoint:
    source = folder.open(path)
    record = read_record(source, options)
    return Checkpoint(
        path=path, kind=record.format, files=(record,), sources={path: source}, exists={}
    )
