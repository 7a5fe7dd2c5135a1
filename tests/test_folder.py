"""Model folders: families, index cross-checks in both directions, config checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import ckptfix
from ckptfix.layouts.names import parse_weight_name, scan_folder
from ckptfix.ops.report import Report
from tests.builders import Factory, Spec
from tests.helpers import cli

SHARD1 = [
    Spec("model.embed_tokens.weight", "BF16", (8, 4)),
    Spec("model.norm.weight", "BF16", (4,)),
]
SHARD2 = [Spec("lm_head.weight", "BF16", (8, 4))]


def codes(report: Report) -> list[str]:
    return sorted(item.code for item in report.findings)


def only(report: Report, code: str) -> ckptfix.Finding:
    matches = [item for item in report.findings if item.code == code]
    assert len(matches) == 1, report.findings
    return matches[0]


def test_clean_sharded_folder(factory: Factory) -> None:
    folder = factory.sharded("m", [SHARD1, SHARD2])
    report = ckptfix.inspect(folder)
    assert report.findings == ()
    assert report.format == "folder"
    assert report.tensor_count == 3
    assert report.parameter_count == 8 * 4 + 4 + 8 * 4
    assert report.total_bytes == 2 * (8 * 4 + 4 + 8 * 4)
    assert [item.format for item in report.files] == ["safetensors", "safetensors", "index"]
    assert report.exit_code() == 0


def test_weight_name_parsing() -> None:
    parsed = parse_weight_name("model.fp16-00002-of-00003.safetensors")
    assert parsed is not None
    assert (parsed.stem, parsed.variant, parsed.part, parsed.total) == ("model", "fp16", 2, 3)
    assert parse_weight_name("pytorch_model.bin") is not None
    assert parse_weight_name("notes.txt") is None


def test_families_recognised(factory: Factory) -> None:
    factory.sharded("m", [SHARD1, SHARD2])
    factory.sharded("m", [SHARD1], variant="fp16")
    factory.safetensors("m/consolidated.safetensors")
    factory.safetensors("m/adapter_model.safetensors")
    factory.safetensors("m/extra-lora.safetensors")
    factory.bytes("m/training_args.bin", b"\x80\x04K\x01.")
    factory.bytes("m/README.md", b"hi")
    layout = scan_folder(str(factory.root / "m"))
    labels = {family.label: (family.files, family.index) for family in layout.families}
    assert labels["model*.safetensors"] == (
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],
        "model.safetensors.index.json",
    )
    assert labels["model.fp16*.safetensors"] == (
        ["model.fp16-00001-of-00001.safetensors"],
        "model.safetensors.index.fp16.json",
    )
    assert labels["consolidated*.safetensors"] == (["consolidated.safetensors"], None)
    assert labels["adapter_model*.safetensors"] == (["adapter_model.safetensors"], None)
    assert labels["loose *.safetensors files"] == (["extra-lora.safetensors"], None)
    assert "training_args.bin" not in layout.weight_files


def test_index_missing_file(factory: Factory) -> None:
    folder = factory.sharded("m", [SHARD1, SHARD2])
    os.remove(folder / "model-00002-of-00002.safetensors")
    report = ckptfix.inspect(folder)
    item = only(report, "index-missing-file")
    assert item.severity.value == "error"
    assert item.file == str(folder / "model.safetensors.index.json")
    assert item.tensors == ("lm_head.weight",)
    assert "'model-00002-of-00002.safetensors', which does not exist" in item.message
    assert report.exit_code() == 1


def test_index_missing_tensor_and_unlisted(factory: Factory) -> None:
    folder = factory.root / "m"
    factory.safetensors("m/model-00001-of-00002.safetensors", SHARD1)
    factory.safetensors(
        "m/model-00002-of-00002.safetensors", [*SHARD2, Spec("extra.bias", "F32", (2,))]
    )
    factory.index(
        "m/model.safetensors.index.json",
        {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "model.norm.weight": "model-00002-of-00002.safetensors",  # wrong shard
            "lm_head.weight": "model-00002-of-00002.safetensors",
        },
    )
    report = ckptfix.inspect(folder)
    missing = only(report, "index-missing-tensor")
    assert missing.tensors == ("model.norm.weight",)
    unlisted = [item for item in report.findings if item.code == "index-unlisted-tensor"]
    assert {(item.file, item.tensors) for item in unlisted} == {
        (str(folder / "model-00001-of-00002.safetensors"), ("model.norm.weight",)),
        (str(folder / "model-00002-of-00002.safetensors"), ("extra.bias",)),
    }
    assert all(item.severity.value == "warning" for item in unlisted)


def test_index_total_size_stale(factory: Factory) -> None:
    folder = factory.sharded("m", [SHARD1, SHARD2])
    index = folder / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    document["metadata"]["total_size"] = 12345
    index.write_text(json.dumps(document))
    item = only(ckptfix.inspect(folder), "index-total-size")
    assert "total_size is 12345 but the indexed tensors take 136 bytes" in item.message


def test_index_total_size_not_integer(factory: Factory) -> None:
    folder = factory.sharded("m", [SHARD1, SHARD2])
    index = folder / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    document["metadata"]["total_size"] = 136.0
    index.write_text(json.dumps(document))
    assert "not an integer" in only(ckptfix.inspect(folder), "index-total-size").message


def test_single_file_beside_shards_is_what_transformers_loads(factory: Factory) -> None:
    """transformers loads model.safetensors when it exists, never the index beside it: the
    report describes that file and says the shards are shadowed (not that it is an orphan)."""
    folder = factory.sharded("m", [SHARD1, SHARD2])
    factory.safetensors("m/model.safetensors", SHARD1 + SHARD2)
    report = ckptfix.inspect(folder)
    item = only(report, "shadowed-shards")
    assert item.file == str(folder / "model.safetensors.index.json")
    assert "transformers loads model.safetensors and never reads the index" in item.message
    assert "orphan-file" not in codes(report)
    assert "duplicate-name" not in codes(report)
    assert "mixed-formats" not in codes(report)
    assert {t.file for t in report.tensors} == {str(folder / "model.safetensors")}
    assert report.to_dict()["checkpoint"]["files"] == ["model.safetensors"]


def test_duplicate_name_across_shards(factory: Factory) -> None:
    folder = factory.root / "m"
    factory.safetensors("m/model-00001-of-00002.safetensors", SHARD1)
    factory.safetensors("m/model-00002-of-00002.safetensors", [*SHARD2, SHARD1[1]])
    factory.index(
        "m/model.safetensors.index.json",
        {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "model.norm.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
        },
    )
    item = only(ckptfix.inspect(folder), "duplicate-name")
    assert item.severity.value == "error"
    assert item.tensors == ("model.norm.weight",)


def test_mixed_formats(factory: Factory) -> None:
    folder = factory.sharded("m", [SHARD1, SHARD2])
    factory.bytes("m/pytorch_model.bin", b"PK\x03\x04" + b"\0" * 60)
    factory.safetensors("m/consolidated.safetensors", SHARD1)
    report = ckptfix.inspect(folder)
    item = only(report, "mixed-formats")
    assert "3 weight families" in item.message
    assert "model*.safetensors (2 file(s), indexed by model.safetensors.index.json)" in item.message
    assert "pytorch_model*.bin (1 file(s))" in item.message


def test_variants_are_not_mixed(factory: Factory) -> None:
    folder = factory.sharded("m", [SHARD1, SHARD2])
    factory.safetensors("m/model.fp16.safetensors", SHARD1 + SHARD2)
    report = ckptfix.inspect(folder)
    assert codes(report) == []


def test_lfs_pointer_in_folder(factory: Factory) -> None:
    folder = factory.sharded("m", [SHARD1, SHARD2])
    factory.lfs_pointer("m/model-00002-of-00002.safetensors", size=999)
    report = ckptfix.inspect(folder)
    item = only(report, "lfs-pointer")
    assert item.file == str(folder / "model-00002-of-00002.safetensors")
    assert "999 B" in item.message
    # The pointer's tensors are not reported missing on top: the pointer says why.
    assert "index-missing-tensor" not in codes(report)
    assert report.tensor_count == 2


def test_corrupt_shard_does_not_stop_the_folder(factory: Factory) -> None:
    folder = factory.sharded("m", [SHARD1, SHARD2])
    shard = folder / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3])
    report = ckptfix.inspect(folder)
    item = only(report, "corrupt-file")
    assert item.file == str(shard)
    assert "(rule truncated;" in item.message
    assert report.tensor_count == 2


def test_shards_without_index(factory: Factory) -> None:
    folder = factory.sharded("m", [SHARD1, SHARD2], write_index=False)
    item = only(ckptfix.inspect(folder), "shard-numbering")
    assert "no index" in item.message


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        (
            "model-00001-of-00003",
            "model-00002-of-00002",
            "disagree on the shard count (of-00002, of-00003)",
        ),
        ("model-00001-of-00003", "model-00003-of-00003", "part(s) 2 of 3 absent"),
    ],
)
def test_shard_numbering_problems(factory: Factory, first: str, second: str, expected: str) -> None:
    folder = factory.root / "m"
    factory.safetensors(f"m/{first}.safetensors", SHARD1)
    factory.safetensors(f"m/{second}.safetensors", SHARD2)
    factory.index(
        "m/model.safetensors.index.json",
        {
            "model.embed_tokens.weight": f"{first}.safetensors",
            "model.norm.weight": f"{first}.safetensors",
            "lm_head.weight": f"{second}.safetensors",
        },
    )
    item = only(ckptfix.inspect(folder), "shard-numbering")
    assert expected in item.message


def test_index_lists_shard_in_subfolder(factory: Factory) -> None:
    folder = factory.root / "m"
    factory.safetensors("m/sub/weights.safetensors", SHARD1)
    factory.index(
        "m/model.safetensors.index.json",
        {
            "model.embed_tokens.weight": "sub/weights.safetensors",
            "model.norm.weight": "sub/weights.safetensors",
        },
        total_size=72,
    )
    report = ckptfix.inspect(folder)
    assert report.findings == ()
    assert report.tensor_count == 2


def test_tied_config_false_without_head(factory: Factory) -> None:
    folder = factory.root / "m"
    factory.safetensors("m/model.safetensors", SHARD1)
    factory.config("m", tie_word_embeddings=False)
    item = only(ckptfix.inspect(folder), "tied-config-mismatch")
    assert item.tensors == ("model.embed_tokens.weight",)
    assert item.file == str(folder / "config.json")


def test_tied_config_true_with_separate_head(factory: Factory) -> None:
    folder = factory.root / "m"
    factory.safetensors("m/model.safetensors", SHARD1 + SHARD2)
    factory.config("m", tie_word_embeddings=True)
    item = only(ckptfix.inspect(folder), "tied-config-mismatch")
    assert "may differ (run with --hash to compare)" in item.message
    hashed = ckptfix.inspect(folder, hash_values=True)
    assert "holds different bytes" in only(hashed, "tied-config-mismatch").message


def test_tied_config_true_with_identical_head_is_fine(factory: Factory) -> None:
    folder = factory.root / "m"
    same = bytes(range(64))
    factory.safetensors(
        "m/model.safetensors",
        [
            Spec("model.embed_tokens.weight", "BF16", (8, 4), same),
            Spec("lm_head.weight", "BF16", (8, 4), same),
        ],
    )
    factory.config("m", tie_word_embeddings=True)
    report = ckptfix.inspect(folder, hash_values=True)
    assert codes(report) == ["duplicate-content"]


def test_tied_config_consistent(factory: Factory) -> None:
    folder = factory.root / "m"
    factory.safetensors("m/model.safetensors", SHARD1 + SHARD2)
    factory.config("m", tie_word_embeddings=False)
    assert codes(ckptfix.inspect(folder)) == []


def test_broken_config_json(factory: Factory) -> None:
    folder = factory.root / "m"
    factory.safetensors("m/model.safetensors", SHARD1)
    factory.bytes("m/config.json", b"{nope")
    item = only(ckptfix.inspect(folder), "corrupt-file")
    assert "(rule config-not-json;" in item.message


def test_folder_cli_json(factory: Factory) -> None:
    folder = factory.sharded("m", [SHARD1, SHARD2])
    os.remove(folder / "model-00002-of-00002.safetensors")
    run = cli("inspect", folder, "--json")
    assert run.code == 1
    document = run.json()
    assert [f["code"] for f in document["findings"]] == ["index-missing-file"]
    message = document["findings"][0]["message"]
    assert message.endswith(" (download the missing shard, or regenerate the index)")
    what = message.removesuffix(" (download the missing shard, or regenerate the index)")
    assert run.error_lines == [
        f"error: {folder / 'model.safetensors.index.json'}: {what} (rule index-missing-file; "
        "download the missing shard, or regenerate the index)"
    ]


def test_folder_without_weights(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    report = ckptfix.inspect(tmp_path / "empty")
    assert report.files == ()
    assert [(item.code, item.file) for item in report.findings] == [
        ("no-weights", str(tmp_path / "empty"))
    ]
    assert report.exit_code() == 1


def test_empty_tensor_name(factory: Factory) -> None:
    path = factory.safetensors("e.safetensors", [Spec(""), Spec("ok")])
    item = only(ckptfix.inspect(path), "empty-name")
    assert item.severity.value == "warning"
    assert item.file == str(path)


def test_torch_files_in_a_folder_are_read(factory: Factory, tmp_path: Path) -> None:
    import torch

    path = tmp_path / "m" / "pytorch_model.bin"
    path.parent.mkdir()
    torch.save({"w": torch.ones(2)}, path)
    report = ckptfix.inspect(path.parent)
    assert report.findings == ()
    assert [(f.format, f.tensor_count) for f in report.files] == [("torch-zip", 1)]


def test_no_tensor_data_read_without_hash_or_scan(
    factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.io import gather

    folder = factory.sharded("m", [SHARD1, SHARD2])
    factory.config("m", tie_word_embeddings=True)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("tensor data was read")

    monkeypatch.setattr(gather, "tensor_chunks", refuse)
    report = ckptfix.inspect(folder)
    assert report.tensor_count == 3
    with pytest.raises(AssertionError, match="tensor data was read"):
        ckptfix.inspect(folder, hash_values=True)


def test_mixed_formats_names_the_loose_extensions(factory: Factory) -> None:
    folder = factory.sharded("m", [SHARD1, SHARD2])
    factory.bytes("m/weights.pt", b"PK\x03\x04" + b"\0" * 60)
    item = only(ckptfix.inspect(folder), "mixed-formats")
    assert "loose *.pt files (1 file(s))" in item.message
    factory.bytes("m/extra.bin", b"PK\x03\x04" + b"\0" * 60)
    item = only(ckptfix.inspect(folder), "mixed-formats")
    assert "loose *.bin/*.pt files (2 file(s))" in item.message
    assert "torch" not in item.message
