"""The bad-input corpus's Megatron-Core folders: copies of tests/data/megatron-tiny with one
thing broken or hostile, each naming the rule (or finding code) it breaks."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from tests.builders import HOSTILE_FORMS, Factory, hostile_pickles, zip_checkpoint
from tests.cases import Case
from tests.megatron_builders import tiny_megatron

Edit = Callable[[Path, Factory], object]


def _tiny(edit: Edit) -> Callable[[Factory], Path]:
    def build(f: Factory) -> Path:
        folder = tiny_megatron(f.root / "megatron")
        edit(folder, f)
        return folder

    return build


def _write(name: str, data: bytes) -> Edit:
    return lambda folder, f: (folder / name).write_bytes(data)


def _backends(**document: object) -> Edit:
    return _write("metadata.json", json.dumps(document).encode())


def _hostile_common(form: str) -> Edit:
    def edit(folder: Path, f: Factory) -> None:
        zip_checkpoint(folder / "common.pt", hostile_pickles(f.root / "CANARY")[form])

    return edit


def _hostile_metadata(form: str) -> Edit:
    def edit(folder: Path, f: Factory) -> None:
        (folder / ".metadata").write_bytes(hostile_pickles(f.root / "CANARY")[form])

    return edit


def _truncated(name: str) -> Edit:
    def edit(folder: Path, f: Factory) -> None:
        os.truncate(folder / name, (folder / name).stat().st_size // 2)

    return edit


def _run_folder(tracker: bytes) -> Callable[[Factory], Path]:
    """A Megatron-LM run folder whose tracker names no iteration folder it has."""

    def build(f: Factory) -> Path:
        run = f.root / "run"
        tiny_megatron(run / "iter_0000007")
        (run / "latest_checkpointed_iteration.txt").write_bytes(tracker)
        return run

    return build


MEGATRON_CASES = [
    Case("megatron-backends-not-json", _tiny(_write("metadata.json", b"{")), "megatron-config"),
    Case(
        "megatron-backend-not-named",
        _tiny(_backends(sharded_backend=7, common_backend="torch")),
        "megatron-config",
    ),
    Case(
        "megatron-zarr",
        _tiny(_backends(sharded_backend="zarr", common_backend="torch")),
        "megatron-backend",
        "unsupported-format",
    ),
    Case(
        "megatron-common-backend",
        _tiny(_backends(sharded_backend="torch_dist", common_backend="yaml")),
        "megatron-backend",
        "unsupported-format",
    ),
    Case(
        "megatron-common-not-a-dict",
        _tiny(lambda folder, f: zip_checkpoint(folder / "common.pt", b"\x80\x02]q\x00.")),
        "megatron-common",
    ),
    Case("megatron-metadata-cut", _tiny(_truncated(".metadata")), "bad-pickle"),
    Case(
        "megatron-missing-rank-file",
        _tiny(lambda folder, f: (folder / "__0_0.distcp").unlink()),
        "missing-rank-file",
        "missing-rank-file",
    ),
    Case(
        "megatron-truncated-rank-file",
        _tiny(_truncated("__0_0.distcp")),
        "truncated-rank-file",
        "truncated-rank-file",
    ),
    Case("megatron-tracker-past-the-run", _run_folder(b"8\n"), "megatron-tracker"),
    Case("megatron-tracker-not-a-number", _run_folder(b"latest"), "megatron-tracker"),
    Case("megatron-tracker-too-large", _run_folder(b"7" * 100), "tracker-too-large"),
]
MEGATRON_CASES += [
    Case(f"megatron-common-{form}", _tiny(_hostile_common(form)), "unsafe-pickle", "unsafe-pickle")
    for form in HOSTILE_FORMS
]
MEGATRON_CASES += [  # .metadata is DCP's, whose tests see every form: two here
    Case(
        f"megatron-metadata-{form}",
        _tiny(_hostile_metadata(form)),
        "unsafe-pickle",
        "unsafe-pickle",
    )
    for form in HOSTILE_FORMS[:2]
]
