"""Broken model folders for the `ckptfix fix` tests, each beside the clean folder it was
broken from, and what a loader reads of a folder (to compare a repair with the clean one).

Tensor bytes are seeded by name (tests.builders), so a "stale copy" written here is given
other bytes on purpose: a repair that kept the wrong copy would show."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ckptfix.formats.safetensors import read_header
from tests.builders import Factory, Spec
from tests.helpers import read_weights

S1 = [Spec("model.embed_tokens.weight", "F32", (8, 4)), Spec("model.norm.weight", "F32", (4,))]
S2 = [Spec("lm_head.weight", "F32", (8, 4))]
TOTAL = sum(spec.nbytes() for spec in S1 + S2)
ONE = "model-00001-of-00002.safetensors"
TWO = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"
MAP = {"model.embed_tokens.weight": ONE, "model.norm.weight": ONE, "lm_head.weight": TWO}
STALE = bytes(range(256))  # other bytes than the seeded ones, for stale copies


def stale(spec: Spec) -> Spec:
    """`spec` with other bytes: a stale copy of the tensor."""
    return Spec(spec.name, spec.dtype, spec.shape, (STALE * 8)[: spec.nbytes()])


def clean(f: Factory, name: str) -> Path:
    """The healthy folder every case is broken from: two shards, an index, a config and
    a tokenizer file."""
    folder = f.sharded(name, [S1, S2])
    f.config(name)
    f.bytes(f"{name}/tokenizer.json", b'{"version": "1.0"}')
    return folder


def _unlisted(f: Factory, name: str) -> None:
    weight_map = {k: v for k, v in MAP.items() if k != "model.norm.weight"}
    f.index(f"{name}/{INDEX}", weight_map, TOTAL - 16)


def _total_size(f: Factory, name: str) -> None:
    f.index(f"{name}/{INDEX}", MAP, 999)


def _missing_tensor(f: Factory, name: str) -> None:
    f.index(f"{name}/{INDEX}", {**MAP, "model.norm.weight": TWO}, TOTAL)


def _missing_file(f: Factory, name: str) -> None:
    f.index(f"{name}/{INDEX}", {**MAP, "lm_head.weight": "model-00003-of-00003.safetensors"}, TOTAL)


def _lost_index(f: Factory, name: str) -> None:
    (f.root / name / INDEX).unlink()


def _numbering(f: Factory, name: str) -> None:
    folder = f.root / name
    renamed = {}
    for old in (ONE, TWO):
        new = old.replace("-of-00002", "-of-00003")
        (folder / old).rename(folder / new)
        renamed[old] = new
    f.index(f"{name}/{INDEX}", {k: renamed[v] for k, v in MAP.items()}, TOTAL)


def _format(f: Factory, name: str) -> None:
    f.safetensors(f"{name}/{TWO}", S2, with_format=False)


def _duplicate(f: Factory, name: str) -> None:
    f.safetensors(f"{name}/{TWO}", [*S2, stale(S1[1])])


def _stale_single(f: Factory, name: str) -> None:
    f.safetensors(f"{name}/model.safetensors", [stale(spec) for spec in S1 + S2])


def _orphan(f: Factory, name: str) -> None:
    f.safetensors(f"{name}/model-00003-of-00003.safetensors", [stale(S2[0])])


def _other_family(f: Factory, name: str) -> None:
    f.lfs_pointer(f"{name}/pytorch_model.bin")


# name -> (how the clean folder is broken, the finding codes inspect reports for it)
REPAIRABLE: dict[str, tuple[Callable[[Factory, str], None], set[str]]] = {
    "unlisted": (_unlisted, {"index-unlisted-tensor"}),
    "total-size": (_total_size, {"index-total-size"}),
    "missing-tensor": (
        _missing_tensor,
        {"index-missing-tensor", "index-unlisted-tensor", "index-total-size"},
    ),
    "missing-file": (
        _missing_file,
        {"index-missing-file", "orphan-file", "shard-numbering", "tied-config-mismatch"},
    ),
    "lost-index": (_lost_index, {"shard-numbering"}),
    "numbering": (_numbering, {"shard-numbering"}),
    "format": (_format, {"missing-format-metadata"}),
    "duplicate": (_duplicate, {"duplicate-name"}),
    "stale-single": (_stale_single, {"shadowed-shards"}),
    "orphan": (_orphan, {"orphan-file"}),
    "other-family": (_other_family, {"lfs-pointer", "mixed-formats"}),
}


def broken(f: Factory, case: str, name: str = "broken") -> Path:
    folder = clean(f, name)
    REPAIRABLE[case][0](f, name)
    return folder


def lfs_folder(f: Factory) -> tuple[Path, str]:
    """The clean folder with its second shard an LFS pointer, and the error line fix gives."""
    folder = clean(f, "m")
    path = f.lfs_pointer(f"m/{TWO}")
    return folder, (
        f"error: {path}: file is a Git LFS pointer to a 4.98 GB object (oid "
        "sha256:abababababab…), not the weights (rule lfs-pointer; run `git lfs pull`, or "
        "download the file itself, then run `ckptfix fix` again)"
    )


def loaded(folder: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype, shape, bytes) of what a loader reads: the single file, else the
    files the index maps each name to."""
    from ckptfix.io.gather import tensor_bytes
    from ckptfix.io.source import LocalFile

    single = folder / "model.safetensors"
    if single.exists():
        files = {single.name: None}
    else:
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        files = {file: set() for file in weight_map.values()}
        for tensor, file in weight_map.items():
            files[file].add(tensor)
    found = {}
    for file, wanted in files.items():
        with LocalFile(str(folder / file)) as source:
            for tensor in read_weights(folder / file).tensors:
                if wanted is None or tensor.name in wanted:
                    found[tensor.name] = (tensor.dtype, tensor.shape, tensor_bytes(source, tensor))
    return found


def header_metadata(path: Path) -> dict[str, str]:
    return dict(read_header(path).metadata or {})
