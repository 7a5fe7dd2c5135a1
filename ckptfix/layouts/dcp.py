"""torch.distributed.checkpoint folders: `.metadata` and `__{rank}_{n}.distcp` rank files.

Each model tensor becomes one TensorInfo whose pieces are its chunks' bytes in the rank
files (see layouts.chunks); no tensor byte is read. The model part of the saved app state
(`{"model": ..., "optim": ...}`) is chosen from `planner_data` like `--key` in a torch file;
optimizer state and non-tensor items are left out and counted. Problems are data: a
missing, truncated or unreadable rank file, chunks that leave gaps or overlap.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass

from ckptfix.core.checkpoint import Checkpoint, FileRecord
from ckptfix.core.dtypes import DTYPES, numel_of
from ckptfix.core.errors import (
    CkptfixError,
    CorruptFileError,
    DuplicateNameError,
    UsageError,
)
from ckptfix.core.findings import Finding, finding, name_list
from ckptfix.core.tensor import Piece, TensorInfo
from ckptfix.core.training import RANK_SUFFIX, TrainingLayout
from ckptfix.formats.base import FileRead, ReadOptions
from ckptfix.formats.dcp import METADATA, DcpMetadata, TensorEntry, read_metadata
from ckptfix.formats.dcp_chunks import ChunkReader, chunk_nbytes
from ckptfix.formats.tensor_dict import STATE_DICT_KEYS
from ckptfix.io.folder import LOCAL, Folder
from ckptfix.io.source import ByteSource
from ckptfix.layouts.chunks import (
    MAX_PIECES,
    MAX_PIECES_PER_CHUNK,
    Placed,
    TooManyChunks,
    chunk_pieces,
    first_overlap,
    out_of_range,
    pieces_needed,
)

_RANK = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_STEP = re.compile(r"(?:step|iter|checkpoint)[-_]?(\d+)$", re.IGNORECASE)
FORMAT = "dcp"
LIGHTNING_META = "meta.pt"  # Lightning's FSDPStrategy writes its other state there


def is_dcp_folder(root: str, names: list[str]) -> bool:
    return METADATA in names or any(name.endswith(RANK_SUFFIX) for name in names)


def _no_metadata(root: str, names: list[str]) -> CorruptFileError:
    ranks = sorted(name for name in names if name.endswith(RANK_SUFFIX))
    per_rank = any(re.fullmatch(r"__\d+\.metadata", name) for name in names)
    hint = (
        " (only per-rank __R.metadata files, from a save without collectives)" if per_rank else ""
    )
    return CorruptFileError(
        root,
        "dcp-no-metadata",
        f"folder holds {len(ranks)} .distcp rank file(s) but no .metadata{hint}: without it "
        "nothing says which tensors they hold (a save writes .metadata last; was it interrupted?)",
        "copy .metadata from the training run's output, or save the checkpoint again",
    )


def _parts(paths: dict[str, tuple[str, ...]], fqns: list[str]) -> dict[str, list[str]]:
    """fqns by the part of the app state they sit in: "" for top-level items."""
    parts: dict[str, list[str]] = defaultdict(list)
    for fqn in fqns:
        path = paths.get(fqn, (fqn,))
        parts[path[0] if len(path) > 1 else ""].append(fqn)
    return parts


def choose_model(meta: DcpMetadata, key: str, root: str) -> tuple[str, dict[str, str]]:
    """(model key, fqn -> tensor name) of the part of the app state taken as the model."""
    if key != "auto":
        wanted = tuple(key.split("/"))
        names = {
            fqn: ".".join(path[len(wanted) :])
            for fqn in meta.tensors
            if (path := meta.paths.get(fqn, (fqn,)))[: len(wanted)] == wanted
            and len(path) > len(wanted)
        }
        if not names:
            listed = ", ".join(
                sorted(k or "(top level)" for k in _parts(meta.paths, [*meta.tensors]))
            )
            raise UsageError(
                "--key",
                f"{root} has no tensors at key {key!r}",
                f"keys with tensors: {listed[:120]}",
            )
        return key, names
    parts = _parts(meta.paths, list(meta.tensors))
    known = [k for k in ("", *STATE_DICT_KEYS) if k in parts]

    def stored(part: str) -> int:
        return sum(
            sum(chunk_nbytes(meta.tensors[f], c) for c in meta.tensors[f].chunks)
            for f in parts[part]
        )

    chosen = known[0] if known else max(parts, key=stored, default="")
    return chosen, {
        fqn: ".".join(meta.paths.get(fqn, (fqn,))[1 if chosen else 0 :])
        for fqn in parts.get(chosen, [])
    }


class _Loader:
    """Builds the Checkpoint of one DCP folder; collects findings and rank-file errors."""

    def __init__(self, root: str, meta: DcpMetadata, folder: Folder = LOCAL) -> None:
        self.root, self.meta, self.folder = root, meta, folder
        self.findings: list[Finding] = []
        self.errors: dict[str, CkptfixError] = {}
        self.sources: dict[str, ByteSource] = {}
        self.readers: dict[str, ChunkReader] = {}
        self.missing: dict[str, set[str]] = defaultdict(set)
        self.sizes: dict[str, int] = {}  # of the rank files that could be opened
        self.pieces = 0

    def open_rank_files(self) -> None:
        """Open every rank file `.metadata` names; a missing or short one is a finding."""
        needs: dict[str, int] = defaultdict(int)
        for item in self.meta.storage.values():
            needs[item.file] = max(needs[item.file], item.offset + item.length)
        for name, end in sorted(needs.items()):
            path = os.path.join(self.root, name)
            if not self.folder.is_file(path):
                continue
            source = self.folder.open(path)
            self.sources[path] = source
            try:
                size = source.size
            except CkptfixError as exc:
                self.errors[path] = exc
                continue
            self.readers[path] = ChunkReader(source)
            self.sizes[path] = size
            if size < end:
                self.findings.append(
                    finding(
                        "truncated-rank-file",
                        f"rank file has {size:,} bytes but .metadata places chunks up to byte "
                        f"{end:,}: it was cut short (copy it again from the training run's output)",
                        file=path,
                    )
                )

    def placed(self, entry: TensorEntry, name: str) -> list[Placed] | None:
        """Each non-empty chunk located in its rank file, or None when one cannot be."""
        found = []
        for chunk in entry.chunks:
            if chunk_nbytes(entry, chunk) == 0:
                continue
            item = self.meta.storage.get((entry.fqn, chunk.offsets))
            if item is None:
                self._chunk_problem(
                    "chunk-gap",
                    entry,
                    f"chunk {list(chunk.offsets)} of {entry.fqn!r} has no storage entry in .metadata",
                    None,
                )
                return None
            path = os.path.join(self.root, item.file)
            if path not in self.readers:
                if path not in self.errors:  # else unreadable, and reported as such
                    self.missing[path].add(name)
                return None
            if item.offset + item.length > self.sizes[path]:
                return None  # past the end of a truncated rank file: reported once, above
            try:
                offset = self.readers[path].locate(entry, chunk, item)
            except CkptfixError as exc:
                if exc.code is None:
                    raise
                if path in self.errors:  # the file's record holds its first error
                    self.findings.append(finding(exc.code, exc.detail(), file=path))
                self.errors.setdefault(path, exc)
                return None
            found.append(Placed(path, offset, chunk.offsets, chunk.sizes))
        return found

    def _chunk_problem(
        self, code: str, entry: TensorEntry, what: str, files: list[str] | None
    ) -> None:
        where = f" (rank file {', '.join(os.path.basename(f) for f in files)})" if files else ""
        self.findings.append(
            finding(
                code,
                f"{what}{where}; the tensor cannot be assembled (save the checkpoint again)",
                file=files[0] if files else os.path.join(self.root, METADATA),
                tensors=[entry.fqn],
            )
        )

    def _file_of(self, entry: TensorEntry, offsets: tuple[int, ...]) -> str:
        item = self.meta.storage.get((entry.fqn, offsets))
        return os.path.join(self.root, item.file) if item else os.path.join(self.root, METADATA)

    def _in_range(self, entry: TensorEntry) -> bool:
        for chunk in entry.chunks:
            if out_of_range(entry.size, chunk.offsets, chunk.sizes):
                what = (
                    f"chunk at {list(chunk.offsets)} of size {list(chunk.sizes)} lies outside "
                    f"{entry.fqn!r} of shape {list(entry.size)}"
                )
            elif pieces_needed(entry.size, chunk.sizes) > MAX_PIECES_PER_CHUNK:
                what = f"chunk {list(chunk.offsets)} of {entry.fqn!r} is cut into over {MAX_PIECES_PER_CHUNK} pieces"
            else:
                continue
            files = [self._file_of(entry, chunk.offsets)]
            self._chunk_problem("chunk-out-of-range", entry, what, files)
            return False
        return True

    def _tiles(self, entry: TensorEntry) -> bool:
        """The chunks cover the tensor exactly once (checked on .metadata, before reading)."""
        boxes = [
            Placed(self._file_of(entry, c.offsets), 0, c.offsets, c.sizes) for c in entry.chunks
        ]
        try:
            pair = first_overlap(boxes)
        except TooManyChunks:
            what = f"the {len(boxes):,} chunks of {entry.fqn!r} are too scattered to check"
            self._chunk_problem("chunk-overlap", entry, what, None)
            return False
        if pair is not None:
            a, b = pair
            what = f"chunks {list(a.offsets)} and {list(b.offsets)} of {entry.fqn!r} overlap"
            self._chunk_problem("chunk-overlap", entry, what, sorted({a.source, b.source}))
            return False
        covered = sum(chunk_nbytes(entry, chunk) for chunk in entry.chunks)
        total = numel_of(entry.size) * DTYPES[entry.dtype].bits // 8
        if covered != total:
            files = sorted({box.source for box in boxes}) or None
            what = f"the chunks of {entry.fqn!r} cover {covered:,} of its {total:,} bytes"
            self._chunk_problem("chunk-gap", entry, what, files)
            return False
        return True

    def tensor(self, entry: TensorEntry, name: str) -> TensorInfo | None:
        if not self._in_range(entry) or not self._tiles(entry):
            return None
        placed = self.placed(entry, name)
        if placed is None:
            return None
        itemsize = DTYPES[entry.dtype].bits // 8
        self.pieces += sum(pieces_needed(entry.size, chunk.sizes) for chunk in placed)
        if self.pieces > MAX_PIECES:
            what = f"the chunks of the checkpoint make over {MAX_PIECES:,} pieces"
            self._chunk_problem("chunk-out-of-range", entry, what, None)
            return None
        pieces = [piece for chunk in placed for piece in chunk_pieces(chunk, entry.size, itemsize)]
        return _tensor_info(name, entry, pieces, os.path.join(self.root, METADATA))


def _tensor_info(name: str, entry: TensorEntry, pieces: list[Piece], empty: str) -> TensorInfo:
    nbytes = numel_of(entry.size) * DTYPES[entry.dtype].bits // 8
    first = pieces[0] if pieces else Piece(empty, 0, 0)
    single = len(pieces) == 1 and first.count == 1 and first.at == 0
    return TensorInfo(
        name=name,
        dtype=entry.dtype,
        shape=entry.size,
        nbytes=nbytes,
        file=first.source,
        byte_range=(first.offset, first.offset + first.length),
        spread=None if single else tuple(pieces),
    )


def _refuse_duplicates(model: dict[str, str], path: str) -> None:
    """Two key paths joined into one name (('a.b',) and ('a', 'b')) would lose a tensor."""
    seen: dict[str, str] = {}
    for fqn, name in model.items():
        if name in seen:
            raise DuplicateNameError(
                path,
                "duplicate-name",
                f"{seen[name]!r} and {fqn!r} would both be named {name!r}; one would be lost",
                "pass --key to pick a part of the app state where names are unique",
            )
        seen[name] = fqn


def _left_out(meta: DcpMetadata, model: dict[str, str]) -> dict[str, object]:
    """What is not the model: other tensors (optimizer state...) and non-tensor items."""
    others = [entry for fqn, entry in meta.tensors.items() if fqn not in model]
    parts = {meta.paths.get(fqn, (fqn,))[0] for fqn in meta.tensors if fqn not in model}
    parts |= {meta.paths.get(fqn, (fqn,))[0] for fqn in meta.byte_items}
    return {
        "left_out_tensors": len(others),
        "left_out_bytes": sum(chunk_nbytes(e, c) for e in others for c in e.chunks),
        "left_out_parts": tuple(sorted(parts)),
        "other_items": len(meta.byte_items),
        "other_bytes": sum(
            item.length for (fqn, offsets), item in meta.storage.items() if offsets is None
        ),
    }


def _world_size(meta: DcpMetadata) -> int:
    files = {item.file for item in meta.storage.values()}
    ranks = {m.group(1) for name in files if (m := _RANK.match(name))}
    return len(ranks) if ranks else len(files)


def _missing_findings(missing: dict[str, set[str]]) -> list[Finding]:
    return [
        finding(
            "missing-rank-file",
            f"rank file is missing; it holds chunks of {len(names)} tensor(s) such as "
            f"{name_list(sorted(names))} (copy it from the training run's output)",
            file=path,
            tensors=sorted(names),
        )
        for path, names in sorted(missing.items())
    ]


def _rank_records(loader: _Loader) -> list[FileRecord]:
    records = []
    for path, source in loader.sources.items():
        error = loader.errors.get(path)
        try:
            size = source.size
        except CkptfixError:
            size = 0
        read = None if error else FileRead(path, FORMAT, size, ())
        records.append(FileRecord(path, FORMAT, size, read=read, error=error))
    return records


def step_of(root: str) -> int | None:
    match = _STEP.search(os.path.basename(os.path.normpath(root)))
    return int(match.group(1)) if match else None


def load_dcp(
    root: str, names: list[str], options: ReadOptions, folder: Folder = LOCAL
) -> Checkpoint:
    """Every tensor of the model part of a DCP folder, as pieces of its rank files."""
    meta_path = os.path.join(root, METADATA)
    if METADATA not in names:
        raise _no_metadata(root, names)
    meta_source = folder.open(meta_path)
    try:
        meta = read_metadata(meta_source)
    except CkptfixError as exc:
        if exc.code is None:
            raise
        record = FileRecord(meta_path, FORMAT, folder.size(meta_path), error=exc)
        layout = TrainingLayout("dcp", step=step_of(root))
        return Checkpoint(
            root, FORMAT, (record,), sources={meta_path: meta_source}, training=layout
        )
    key, model = choose_model(meta, options.key, root)
    _refuse_duplicates(model, meta_path)
    read = read_tensors(root, meta, model, folder)
    layout = TrainingLayout(
        "dcp",
        world_size=read.world_size,
        serialization=read.serialization,
        step=step_of(root),
        model_key=key or None,
        saved_by="lightning" if LIGHTNING_META in names else None,
        findings=read.findings,
        **_left_out(meta, model),  # type: ignore[arg-type]
    )
    meta_read = FileRead(meta_path, FORMAT, meta_source.size, read.tensors)
    records = [FileRecord(meta_path, FORMAT, meta_source.size, read=meta_read)]
    return Checkpoint(
        path=root,
        kind=FORMAT,
        files=tuple(records + read.records),
        sources={meta_path: meta_source, **read.sources},
        training=layout,
    )


@dataclass(frozen=True)
class DcpTensors:
    """The model tensors of a DCP folder as pieces of its rank files, the rank files' records
    and sources, and the problems found (missing, truncated or unreadable rank files, chunks
    that do not tile a tensor)."""

    tensors: tuple[TensorInfo, ...]
    records: list[FileRecord]
    sources: dict[str, ByteSource]
    findings: tuple[Finding, ...]
    world_size: int
    serialization: str | None


def read_tensors(
    root: str, meta: DcpMetadata, model: dict[str, str], folder: Folder = LOCAL
) -> DcpTensors:
    """The tensors `model` names (fqn -> tensor name), located in the rank files."""
    loader = _Loader(root, meta, folder)
    loader.open_rank_files()
    tensors = [
        tensor
        for fqn, name in model.items()
        if (tensor := loader.tensor(meta.tensors[fqn], name)) is not None
    ]
    formats = set().union(*(reader.formats for reader in loader.readers.values()))
    return DcpTensors(
        tensors=tuple(tensors),
        records=_rank_records(loader),
        sources=loader.sources,
        findings=tuple(_missing_findings(loader.missing) + loader.findings),
        world_size=_world_size(meta),
        serialization="+".join(sorted(formats)) or None,
    )
