"""llama.cpp split sets: written by ckptfix (reshard under --max-shard) and read back part
by part with gguf-py's GGUFReader, tensor by tensor; written by gguf-py and merged by
ckptfix into the file gguf-py writes unsplit; the digest of a set equals its merged file's;
and every way a set's parts can disagree, each with its exact finding."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from tests.gguf_files import (
    LLAMA_TENSORS,
    gguf_py_fields,
    gguf_py_tensors,
    write_gguf,
)
from tests.helpers import cli, one_error_line, tree_snapshot


def _parts(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.gguf"))


def test_split_parts_read_back_with_gguf_py(tmp_path: Path) -> None:
    source = write_gguf(tmp_path / "in" / "llama-Q4_K.gguf")
    limit = 3000
    run = cli("reshard", source, "-o", tmp_path / "out", "--max-shard", str(limit), "--json")
    assert run.code == 0, run.stderr
    parts = _parts(tmp_path / "out")
    count = len(parts)
    assert count >= 3
    assert [p.name for p in parts] == [
        f"llama-Q4_K-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)
    ]
    original, fields = gguf_py_tensors(source), gguf_py_fields(source)
    seen: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for number, part in enumerate(parts):
        assert part.stat().st_size <= limit, part
        got = gguf_py_fields(part)
        split = {
            "split.no": number,
            "split.count": count,
            "split.tensors.count": len(LLAMA_TENSORS),
        }
        assert {k: got[k] for k in split} == split
        rest = {k: v for k, v in got.items() if not k.startswith("split.")}
        assert rest == (fields if number == 0 else {})
        for name, tensor in gguf_py_tensors(part).items():
            assert name not in seen
            seen[name] = tensor
            assert tensor == original[name], name
    assert list(seen) == list(original)
    written = run.json()["written"]
    assert written["verified"] and [f["bytes"] for f in written["files"]] == [
        p.stat().st_size for p in parts
    ]


def test_first_part_keeps_every_metadata_value(tmp_path: Path) -> None:
    source = write_gguf(tmp_path / "in" / "m.gguf", "gemma3")
    assert cli("reshard", source, "-o", tmp_path / "out", "--max-shard", "2500").code == 0
    first = gguf_py_fields(_parts(tmp_path / "out")[0])
    fields = gguf_py_fields(source)
    for key, value in fields.items():
        assert first[key] == value or value != value, key  # NaN: not equal to itself
    assert [k for k in first if not k.startswith("split.")] == list(fields)


def test_merge_gives_back_the_file_byte_for_byte(tmp_path: Path) -> None:
    source = write_gguf(tmp_path / "in" / "m.gguf")
    assert cli("reshard", source, "-o", tmp_path / "split", "--max-shard", "2500").code == 0
    first = _parts(tmp_path / "split")[0]
    assert cli("reshard", first, "-o", tmp_path / "merged", "--max-shard", "1GB").code == 0
    assert [p.name for p in _parts(tmp_path / "merged")] == ["m.gguf"]
    assert (tmp_path / "merged" / "m.gguf").read_bytes() == source.read_bytes()


def test_a_set_gguf_py_wrote_merges_into_the_file_it_writes_unsplit(tmp_path: Path) -> None:
    single = write_gguf(tmp_path / "one" / "m.gguf", "qwen2")
    write_gguf(tmp_path / "set" / "m.gguf", "qwen2", split_max_tensors=3)
    parts = _parts(tmp_path / "set")
    assert [p.name for p in parts] == [f"m-{i:05d}-of-00004.gguf" for i in range(1, 5)]
    inspected = cli("inspect", parts[0], "--json")
    assert inspected.code == 0, inspected.stderr
    assert inspected.json()["format"] == "gguf-split"
    assert inspected.json()["tensor_count"] == len(LLAMA_TENSORS)
    assert cli("reshard", parts[0], "-o", tmp_path / "merged", "--max-shard", "1GB").code == 0
    assert (tmp_path / "merged" / "m.gguf").read_bytes() == single.read_bytes()


def test_a_set_hashes_as_its_merged_file(tmp_path: Path) -> None:
    single = write_gguf(tmp_path / "one" / "m.gguf")
    write_gguf(tmp_path / "set" / "m.gguf", split_max_tensors=4)
    first = _parts(tmp_path / "set")[0]
    digests = [
        cli("hash", path, "--json").json()["digest"] for path in (single, first, tmp_path / "set")
    ]
    assert len(set(digests)) == 1, digests
    assert cli("diff", single, first).code == 0


def test_an_oversized_tensor_gets_a_part_of_its_own(tmp_path: Path) -> None:
    source = write_gguf(tmp_path / "in" / "m.gguf")
    run = cli("reshard", source, "-o", tmp_path / "out", "--max-shard", "1300", "--json")
    assert run.code == 0, run.stderr
    # 1152 bytes: with the metadata of the first part, over the limit, so in a part of its own
    oversized = run.json()["plan"]["oversized"]
    assert oversized == ["token_embd.weight"]
    assert run.json()["plan"]["shards"][0]["tensors"] == oversized
    sizes = [p.stat().st_size for p in _parts(tmp_path / "out")]
    assert sizes[0] > 1300 and all(size <= 1300 for size in sizes[1:])


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    source = write_gguf(tmp_path / "in" / "m.gguf")
    before = tree_snapshot(tmp_path)
    run = cli(
        "reshard", source, "-o", tmp_path / "out", "--max-shard", "2500", "--dry-run", "--json"
    )
    assert run.code == 0, run.stderr
    files = [shard["file"] for shard in run.json()["plan"]["shards"]]
    assert files == [f"m-{i:05d}-of-00004.gguf" for i in range(1, 5)]
    assert run.json()["written"] is None
    assert tree_snapshot(tmp_path) == before


# --- a folder -------------------------------------------------------------------------------


def test_a_folder_with_one_set_is_that_set(tmp_path: Path) -> None:
    write_gguf(tmp_path / "repo" / "m.gguf", split_max_tensors=4)
    (tmp_path / "repo" / "README.md").write_text("# model card\n")
    run = cli("inspect", tmp_path / "repo", "--json")
    assert run.code == 0, run.stderr
    assert run.json()["checkpoint"]["loader"] == "llama.cpp"
    assert run.json()["checkpoint"]["files"] == [f"m-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    out = tmp_path / "out"
    assert cli("reshard", tmp_path / "repo", "-o", out, "--max-shard", "1GB").code == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "m.gguf"]


def test_a_folder_of_quantizations_holds_separate_checkpoints(tmp_path: Path) -> None:
    write_gguf(tmp_path / "repo" / "m-Q4_K.gguf")
    write_gguf(tmp_path / "repo" / "m-F16.gguf", split_max_tensors=5)
    run = cli("inspect", tmp_path / "repo", "--json")
    assert run.code == 0, run.stderr
    codes = [item["code"] for item in run.json()["findings"]]
    assert "several-checkpoints" in codes and "mixed-formats" not in codes
    refused = cli("reshard", tmp_path / "repo", "-o", tmp_path / "out")
    assert refused.code == 2
    assert "separate checkpoints (m-F16-00001-of-00002.gguf, m-Q4_K.gguf)" in refused.error_lines[0]


# --- parts that disagree --------------------------------------------------------------------


@pytest.fixture
def three(tmp_path: Path) -> list[Path]:
    """A set of three parts, written by gguf-py."""
    write_gguf(tmp_path / "set" / "m.gguf", split_max_tensors=4)
    return _parts(tmp_path / "set")


def _u16_at(path: Path, key: str, value: int) -> None:
    """Set a split key's u16 value in place."""
    data = bytearray(path.read_bytes())
    at = data.index(key.encode()) + len(key) + 4
    data[at : at + 2] = struct.pack("<H", value)
    path.write_bytes(bytes(data))


def _split_error(path: Path) -> str:
    return one_error_line("inspect", path)


def test_a_missing_part(three: list[Path]) -> None:
    three[1].unlink()
    assert _split_error(three[0]) == (
        f"error: {three[0]}: split set is missing 1 of its 3 parts: m-00002-of-00003.gguf "
        "(rule split-set; download the missing part(s))"
    )
    folder = _split_error(three[0].parent)
    assert folder == _split_error(three[0])


def test_names_that_disagree_on_the_count(three: list[Path]) -> None:
    three[2].rename(three[2].with_name("m-00003-of-00004.gguf"))
    assert _split_error(three[0]) == (
        f"error: {three[0]}: the parts' names disagree on the count (of-00003, of-00004) "
        "(rule split-set; download the set again, every part from one upload)"
    )


def test_split_count_disagrees_with_the_names(three: list[Path]) -> None:
    _u16_at(three[1], "split.count", 4)
    assert _split_error(three[0]) == (
        f"error: {three[1]}: file is named as part 2 of 3 but split.count is 4 (rule "
        "split-set; download the set again, every part from one upload)"
    )


def test_split_no_disagrees_with_the_name(three: list[Path]) -> None:
    _u16_at(three[2], "split.no", 1)
    assert _split_error(three[0]) == (
        f"error: {three[2]}: file is named as part 3 of 3 but split.no is 1 (expected 2: it "
        "counts from 0) (rule split-set; download the set again, every part from one upload)"
    )


def test_tensor_count_disagrees(three: list[Path]) -> None:
    data = bytearray(three[0].read_bytes())
    key = b"split.tensors.count"
    at = data.index(key) + len(key) + 4
    data[at : at + 4] = struct.pack("<i", 11)
    three[0].write_bytes(bytes(data))
    assert _split_error(three[0]) == (
        f"error: {three[0]}: split.tensors.count is 11 but the 3 parts hold 10 tensors (1 "
        "part(s) disagree) (rule split-set; download the set again, every part from one upload)"
    )


def test_a_tensor_in_two_parts(tmp_path: Path) -> None:
    """Two parts of two uploads that share a tensor (gguf-py refuses to write one set that
    does), their split keys made to agree: the tensor stored twice is the finding."""
    write_gguf(tmp_path / "a" / "m.gguf", tensors=LLAMA_TENSORS[:4], split_max_tensors=2)
    write_gguf(tmp_path / "b" / "m.gguf", tensors=LLAMA_TENSORS[1:5], split_max_tensors=2)
    first, second = (
        tmp_path / "a" / "m-00001-of-00002.gguf",
        tmp_path / "a" / "m-00002-of-00002.gguf",
    )
    (tmp_path / "b" / "m-00001-of-00002.gguf").replace(second)
    _u16_at(second, "split.no", 1)
    run = cli("inspect", first, "--json")
    assert run.code == 1
    assert run.error_lines == [
        f"error: {first}: 1 tensor name(s) such as 'blk.0.attn_norm.weight' are stored in 2 "
        f"files ({first}, {second}); a loader keeps whichever it reads last (rule "
        "duplicate-name; remove the stale copy)"
    ]


def test_a_renamed_part(three: list[Path]) -> None:
    renamed = three[0].with_name("m.gguf")
    three[0].rename(renamed)
    assert one_error_line("inspect", renamed) == (
        f"error: {renamed}: file carries split.no 0 of split.count 3 but is not named as a "
        "part of a split set, so llama.cpp cannot find the other parts (rule split-set; give "
        "the parts their names, NAME-00001-of-00003.gguf, ..., or merge them with `ckptfix "
        "reshard`)"
    )


def test_a_later_part_alone_is_a_usage_error(three: list[Path]) -> None:
    run = cli("inspect", three[1])
    assert run.code == 2
    assert run.error_lines == [
        f"error: {three[1]}: file is part 2 of 3 of a GGUF split set, which is read from its "
        f"first part (rule usage; pass {three[0]} (or the folder that holds the set))"
    ]


def test_a_set_with_errors_is_not_rewritten(three: list[Path], tmp_path: Path) -> None:
    three[2].unlink()
    run = cli("reshard", three[0], "-o", tmp_path / "out", "--max-shard", "1GB")
    assert run.code == 1 and "(rule split-set;" in run.error_lines[0]
    assert not (tmp_path / "out").exists()


def test_parts_carry_a_custom_alignment(tmp_path: Path) -> None:
    """Each part is read with its own alignment (ggml's default, 32, where it has no key):
    parts after the first carry the source's when it is not the default."""
    source = write_gguf(tmp_path / "in" / "m.gguf", alignment=64)
    assert cli("reshard", source, "-o", tmp_path / "out", "--max-shard", "2500").code == 0
    parts = _parts(tmp_path / "out")
    assert len(parts) > 2
    assert all(gguf_py_fields(part)["general.alignment"] == 64 for part in parts)
    original = gguf_py_tensors(source)
    for part in parts:
        assert all(original[name] == tensor for name, tensor in gguf_py_tensors(part).items())
    assert cli("reshard", parts[0], "-o", tmp_path / "merged", "--max-shard", "1GB").code == 0
    assert (tmp_path / "merged" / "m.gguf").read_bytes() == source.read_bytes()


def test_fix_says_it_does_not_rewrite_gguf(three: list[Path]) -> None:
    assert one_error_line("fix", three[0], "-o", three[0].parent / "out") == (
        f"error: {three[0]}: file is gguf, which fix does not rewrite (rule unsupported-format; "
        f"`ckptfix convert {three[0]} -o OUT` writes it as safetensors)"
    )


@pytest.mark.parametrize("when", ["with the header", "after the tensors"])
def test_a_damaged_part_header_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """A header byte of a part wrong as it is written (the version: read back beside the
    copy, it does not validate), or changed after its tensors are copied (a letter of the
    first key's name, which still parses: only the digest of the header bytes, checked at
    the end, finds it): the write fails, nothing is left."""
    from ckptfix.write import gguf as writer

    source = write_gguf(tmp_path / "in" / "llama-Q4_K.gguf")

    def flip(fd: int, at: int) -> None:
        with open(f"/proc/self/fd/{fd}", "rb") as handle:  # the writer's fd: write-only
            handle.seek(at)
            old = handle.read(1)[0]
        os.pwrite(fd, bytes([old ^ 0x20]), at)

    if when == "with the header":
        real_write = writer.write_all

        def write_all(fd: int, data: bytes, offset: int) -> None:
            real_write(fd, data, offset)
            if offset == 0:  # the header's first piece: its magic and counts
                flip(fd, 5)

        monkeypatch.setattr(writer, "write_all", write_all)
    else:
        real_copy = writer.PartWriter.copy_tensors

        def copy_tensors(self: writer.PartWriter, *args: object) -> None:
            real_copy(self, *args)  # type: ignore[arg-type]
            flip(self.fd, 33)  # "general.architecture" -> "gEneral.architecture"

        monkeypatch.setattr(writer.PartWriter, "copy_tensors", copy_tensors)
    run = cli("reshard", source, "-o", tmp_path / "out", "--max-shard", "3000")
    assert run.code == 1
    found = "does not validate" if when == "with the header" else "differs from the plan"
    assert found in run.stderr
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".ckptfix-*"))
