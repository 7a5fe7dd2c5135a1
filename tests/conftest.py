"""Fixture factory: writes tiny checkpoints of every kind (valid and broken) into tmp_path."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ckptfix.core.dtypes import DTYPES, byte_size, numel_of
from ckptfix.formats.safetensors import HeaderEntry, encode_header


@dataclass(frozen=True)
class Spec:
    """A tensor to write: name, safetensors dtype, shape and optional exact bytes."""

    name: str
    dtype: str = "F32"
    shape: tuple[int, ...] = (2, 3)
    data: bytes | None = None

    def nbytes(self) -> int:
        size = byte_size(DTYPES[self.dtype], numel_of(self.shape))
        assert size is not None
        return size


def seeded_bytes(count: int, seed: object) -> bytes:
    return random.Random(str(seed)).randbytes(count)


class Factory:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, name: str) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def bytes(self, name: str, data: bytes) -> Path:
        path = self.path(name)
        path.write_bytes(data)
        return path

    def safetensors(
        self,
        name: str,
        specs: Sequence[Spec] = (Spec("weight"),),
        metadata: Mapping[str, str] | None = None,
        *,
        with_format: bool = True,
    ) -> Path:
        """A valid file laid out the way the reference writer lays it out."""
        meta = dict(metadata or {})
        if with_format:
            meta.setdefault("format", "pt")
        entries, blobs, offset = [], [], 0
        for spec in specs:
            data = spec.data if spec.data is not None else seeded_bytes(spec.nbytes(), spec.name)
            assert len(data) == spec.nbytes(), spec
            entries.append(
                HeaderEntry(spec.name, spec.dtype, spec.shape, offset, offset + len(data))
            )
            blobs.append(data)
            offset += len(data)
        path = self.path(name)
        path.write_bytes(encode_header(entries, meta) + b"".join(blobs))
        return path

    def raw(
        self,
        name: str,
        header: bytes | Mapping[str, Any],
        data: bytes = b"",
        *,
        declared_length: int | None = None,
    ) -> Path:
        """A file from exact header bytes (or a dict dumped as-is): for malformed inputs."""
        body = header if isinstance(header, bytes) else json.dumps(header).encode()
        length = len(body) if declared_length is None else declared_length
        path = self.path(name)
        path.write_bytes(struct.pack("<Q", length) + body + data)
        return path

    def sparse_safetensors(self, name: str, dtype: str, shape: tuple[int, ...]) -> Path:
        """One huge tensor whose data is a hole in a sparse file: no disk, exact size."""
        nbytes = byte_size(DTYPES[dtype], numel_of(shape))
        assert nbytes is not None
        header = encode_header([HeaderEntry("huge", dtype, shape, 0, nbytes)], {"format": "pt"})
        path = self.path(name)
        with open(path, "wb") as handle:
            handle.write(header)
            handle.truncate(len(header) + nbytes)
        return path

    def index(
        self,
        name: str,
        weight_map: Mapping[str, str],
        total_size: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Path:
        document: dict[str, Any] = {"metadata": {}, "weight_map": dict(weight_map)}
        if total_size is not None:
            document["metadata"]["total_size"] = total_size
        document.update(extra or {})
        path = self.path(name)
        path.write_text(json.dumps(document, indent=2, sort_keys=True))
        return path

    def sharded(
        self,
        folder: str,
        shards: Sequence[Sequence[Spec]],
        *,
        stem: str = "model",
        variant: str | None = None,
        write_index: bool = True,
    ) -> Path:
        """A Hugging Face sharded folder with a correct index."""
        count = len(shards)
        weight_map: dict[str, str] = {}
        total = 0
        middle = f".{variant}" if variant else ""
        for number, specs in enumerate(shards, start=1):
            shard = f"{stem}{middle}-{number:05d}-of-{count:05d}.safetensors"
            self.safetensors(f"{folder}/{shard}", specs)
            for spec in specs:
                weight_map[spec.name] = shard
                total += spec.nbytes()
        if write_index:
            suffix = f".{variant}" if variant else ""
            self.index(f"{folder}/{stem}.safetensors.index{suffix}.json", weight_map, total)
        return self.root / folder

    def config(self, folder: str, **values: Any) -> Path:
        path = self.path(f"{folder}/config.json")
        path.write_text(json.dumps({"model_type": "llama", **values}))
        return path

    def lfs_pointer(self, name: str, size: int = 4_976_698_672) -> Path:
        path = self.path(name)
        path.write_text(
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{'ab' * 32}\nsize {size}\n"
        )
        return path


@pytest.fixture
def factory(tmp_path: Path) -> Factory:
    return Factory(tmp_path)


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    mounted: list[Path] = []

    def make(options: str) -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield make
    for point in mounted:
        subprocess.run(["umount", str(point)], check=False)


os.environ.setdefault("NO_COLOR", "1")
