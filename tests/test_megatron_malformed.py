"""Broken and hostile Megatron-Core checkpoints (copies of ones megatron-core wrote): each is
a finding naming the file when inspected (exit 1), and every conversion, Megatron-named or
--to-hf, writes nothing and prints one error line; no pickle ever executes."""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import training_fixtures as fixtures
from tests.helpers import cli
from tests.training_fixtures import assert_refused, edit_metadata, storage_entry

pytestmark = pytest.mark.slow
megatron_saved = fixtures.megatron_saved
copy_of = fixtures.copy_of
Copy = Callable[[Path], Path]
MARKER = Path("/tmp/ckptfix-megatron-pwned")
QKV = "decoder.layers.self_attention.linear_qkv.weight"


@pytest.fixture(autouse=True)
def _no_marker() -> Any:
    MARKER.unlink(missing_ok=True)
    yield
    assert not MARKER.exists(), "a pickle was executed"


@pytest.fixture
def llama(megatron_saved: Path, copy_of: Copy) -> Path:
    return copy_of(megatron_saved / "llama" / "ckpt")


def _refused(folder: Path, tmp_path: Path, code: str, file: Path | None = None) -> dict[str, Any]:
    """As for any training folder, and the conversion with --to-hf too."""
    return assert_refused(folder, tmp_path, code, file, ((), ("--to-hf", "llama")))


def test_a_missing_rank_file(llama: Path, tmp_path: Path) -> None:
    (llama / "__1_0.distcp").unlink()
    error = _refused(llama, tmp_path, "missing-rank-file", llama / "__1_0.distcp")
    assert "decoder.layers." in error["message"]


def test_a_truncated_rank_file(llama: Path, tmp_path: Path) -> None:
    rank = llama / "__0_1.distcp"
    os.truncate(rank, rank.stat().st_size // 2)
    _refused(llama, tmp_path, "truncated-rank-file", rank)


def test_an_edited_metadata_leaves_a_gap(llama: Path, tmp_path: Path) -> None:
    def drop_layer_one(metadata: Any) -> None:
        chunks = metadata.state_dict_metadata[QKV].chunks
        chunks[:] = [chunk for chunk in chunks if chunk.offsets[0] != 1]

    edit_metadata(llama, drop_layer_one)
    error = _refused(llama, tmp_path, "chunk-gap")
    assert QKV in error["tensors"]


def test_an_edited_metadata_moves_a_chunk(llama: Path, tmp_path: Path) -> None:
    """A chunk's storage entry pointing at another chunk's bytes: caught by the chunk's own
    header (the torch.save zip inside the rank file), not taken on trust."""

    def misplace(metadata: Any) -> None:
        _, info = storage_entry(metadata, QKV, 0)
        _, other = storage_entry(metadata, "decoder.layers.mlp.linear_fc1.weight", 0)
        info.relative_path, info.offset, info.length = (
            other.relative_path,
            other.offset,
            other.length,
        )

    edit_metadata(llama, misplace)
    _refused(llama, tmp_path, "corrupt-file")


def test_stacked_chunks_that_are_not_one_layer_each(llama: Path, tmp_path: Path) -> None:
    """The tensor is kept as saved (named as stacked), and --to-hf finds no source for it."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    def merge_layers(metadata: Any) -> None:
        entry = metadata.state_dict_metadata["decoder.final_layernorm.weight"]
        metadata.state_dict_metadata["decoder.layers.extra.weight"] = entry
        index, info = storage_entry(metadata, "decoder.final_layernorm.weight")
        metadata.storage_data[MetadataIndex("decoder.layers.extra.weight", index.offset)] = info

    edit_metadata(llama, merge_layers)
    run = cli("inspect", llama, "--json")
    assert run.code == 0 and "decoder.layers.extra.weight" in run.stdout
    to_hf = cli("convert", llama, "-o", tmp_path / "never", "--to-hf", "llama")
    assert to_hf.code == 1 and "(rule megatron-unmapped;" in to_hf.stderr
    assert "'decoder.layers.extra.weight' has no destination" in to_hf.stderr


class Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {MARKER}",))


def _hostile_zip(root: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{root}/data.pkl", pickle.dumps({"args": Evil()}, protocol=2))
        archive.writestr(f"{root}/version", "3\n")
    return buffer.getvalue()


def test_a_hostile_pickle_in_common_pt(llama: Path, tmp_path: Path) -> None:
    (llama / "common.pt").write_bytes(_hostile_zip("common"))
    error = _refused(llama, tmp_path, "unsafe-pickle", llama / "common.pt")
    assert "posix.system" in error["message"] or "os.system" in error["message"]


def test_a_hostile_pickle_in_metadata(llama: Path, tmp_path: Path) -> None:
    (llama / ".metadata").write_bytes(pickle.dumps(Evil(), protocol=4))
    _refused(llama, tmp_path, "unsafe-pickle", llama / ".metadata")


def test_a_megatron_class_in_common_pt_stays_a_stub(llama: Path) -> None:
    """Megatron-LM's args name Megatron enums: read as inert stubs, never imported (an
    import of megatron would print its Transformer Engine warnings and take seconds)."""
    run = cli("inspect", llama, "--json")
    assert run.code == 0
    assert run.json()["layout"]["architecture"]["position_embedding_type"] == "rope"
    raw = (llama / "common.pt").read_bytes()
    assert b"megatron.core.transformer.enums" in raw and b"AttnBackend" in raw


@pytest.mark.parametrize(
    ("document", "code", "rule"),
    [
        ({"sharded_backend": "zarr"}, "unsupported-format", "megatron-backend"),
        (
            {"sharded_backend": "torch_dist", "sharded_backend_version": 2},
            "unsupported-format",
            "megatron-backend",
        ),
        (
            {"sharded_backend": "torch_dist", "common_backend": "msc"},
            "unsupported-format",
            "megatron-backend",
        ),
        ({"sharded_backend": ["torch_dist"]}, "corrupt-file", "megatron-config"),
        ("not json", "corrupt-file", None),
    ],
    ids=["zarr", "version", "common", "not-a-name", "not-json"],
)
def test_a_backend_record_that_is_refused(
    llama: Path, tmp_path: Path, document: object, code: str, rule: str | None
) -> None:
    text = document if isinstance(document, str) else json.dumps(document)
    (llama / "metadata.json").write_text(text)
    error = _refused(llama, tmp_path, code, llama / "metadata.json")
    if rule is not None:
        assert f"(rule {rule};" in error["message"]
    if document == {"sharded_backend": "zarr"}:
        assert "zarr chunk files" in error["message"]


def test_without_common_pt_the_weights_are_read_but_not_a_model_type(
    llama: Path, tmp_path: Path
) -> None:
    (llama / "common.pt").unlink()
    assert cli("convert", llama, "-o", tmp_path / "named").code == 0
    run = cli("convert", llama, "-o", tmp_path / "never", "--to-hf", "llama")
    assert run.code == 1 and "(rule megatron-args;" in run.stderr
    assert "pass the model's config.json as --to-hf" in run.stderr
    assert not (tmp_path / "never").exists()


def test_a_single_file_of_the_folder_is_refused(megatron_saved: Path) -> None:
    for name in ("__0_0.distcp", ".metadata"):
        run = cli("inspect", megatron_saved / "llama" / "ckpt" / name)
        assert run.code == 2 and "pass the folder" in run.stderr
