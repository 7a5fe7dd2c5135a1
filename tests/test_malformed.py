"""Every malformed file and index: exit 1, one error line naming the file and the rule."""

from __future__ import annotations

import pytest

import ckptfix
from ckptfix.core.errors import CorruptFileError
from ckptfix.formats.safetensors import read_header
from tests.builders import Factory
from tests.cases import INDEX_CASES, SAFETENSORS_CASES, Case
from tests.helpers import cli, tree_snapshot


def test_corpus_is_large_enough() -> None:
    ids = [case.id for case in SAFETENSORS_CASES + INDEX_CASES]
    assert len(set(ids)) == len(ids)
    assert len(ids) >= 50
    rules = {case.rule for case in SAFETENSORS_CASES + INDEX_CASES}
    assert len(rules) >= 30


@pytest.mark.parametrize("case", SAFETENSORS_CASES, ids=lambda case: case.id)
def test_malformed_file_cli(factory: Factory, case: Case) -> None:
    path = case.build(factory)
    before = tree_snapshot(factory.root)
    run = cli("inspect", path)
    assert run.code == 1
    assert "Traceback" not in run.stdout + run.stderr
    assert len(run.error_lines) == 1
    line = run.error_lines[0]
    assert line.startswith(f"error: {path}: ")
    expected_rule = "lfs-pointer" if case.code == "lfs-pointer" else f"rule {case.rule}"
    assert expected_rule in line
    assert tree_snapshot(factory.root) == before  # inspect is read-only


@pytest.mark.parametrize("case", SAFETENSORS_CASES, ids=lambda case: case.id)
def test_malformed_file_json(factory: Factory, case: Case) -> None:
    path = case.build(factory)
    run = cli("inspect", path, "--json")
    assert run.code == 1
    document = run.json()
    assert [item["code"] for item in document["findings"]] == [case.code]
    finding = document["findings"][0]
    assert finding["severity"] == "error"
    assert finding["file"] == str(path)
    assert document["tensor_count"] == 0
    assert document["files"] == [
        {
            "path": str(path),
            "format": document["format"],
            "bytes": path.stat().st_size,
            "tensor_count": 0,
        }
    ]


@pytest.mark.parametrize(
    "case",
    # not-safetensors is decided by sniffing, before the safetensors reader runs.
    [
        case
        for case in SAFETENSORS_CASES
        if case.code == "corrupt-file" and case.rule != "not-safetensors"
    ],
    ids=lambda case: case.id,
)
def test_reader_raises_named_rule(factory: Factory, case: Case) -> None:
    path = case.build(factory)
    with pytest.raises(CorruptFileError) as caught:
        read_header(path)
    assert caught.value.rule == case.rule
    assert caught.value.path == str(path)
    assert "\n" not in caught.value.line()


@pytest.mark.parametrize("case", INDEX_CASES, ids=lambda case: case.id)
def test_malformed_index(factory: Factory, case: Case) -> None:
    folder = case.build(factory)
    index = folder / "model.safetensors.index.json"
    run = cli("inspect", folder)
    assert run.code == 1
    assert "Traceback" not in run.stdout + run.stderr
    assert len(run.error_lines) == 1
    assert run.error_lines[0].startswith(f"error: {index}: ")
    assert f"(rule {case.rule};" in run.error_lines[0]
    report = ckptfix.inspect(folder)
    errors = [item for item in report.findings if item.severity.value == "error"]
    assert [(item.code, item.file) for item in errors] == [("corrupt-file", str(index))]
    # The shard itself is still read: one bad file does not hide the rest of the folder.
    assert report.tensor_count == 1


def test_exact_error_line_for_truncated_file(factory: Factory) -> None:
    path = factory.raw(
        "cut.safetensors", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 5
    )
    header_len = path.stat().st_size - 8 - 5
    run = cli("inspect", path)
    assert run.error_lines == [
        f"error: {path}: file is truncated: its header needs {8 + header_len + 8} bytes but the "
        f"file has {8 + header_len + 5} (rule truncated; re-download the file)"
    ]


def test_exact_error_line_for_lfs_pointer(factory: Factory) -> None:
    path = factory.lfs_pointer("model.safetensors", size=4_976_698_672)
    run = cli("inspect", path)
    assert run.error_lines == [
        f"error: {path}: file is a Git LFS pointer to a 4.98 GB object (oid sha256:abababababab…), "
        "not the weights (rule lfs-pointer; run `git lfs pull`, or download the file itself)"
    ]
