"""What a hostile review of the GGUF support (issue 27) broke, each pinned by a test that
failed before its fix (see each docstring for what it did then)."""

from __future__ import annotations

import json
import random
import struct
import time
import warnings
from pathlib import Path

import pytest

from ckptfix.core.errors import PlanError
from ckptfix.core.tensor import TensorInfo
from ckptfix.formats.gguf_encode import metadata_json, split_keys, tensor_info
from ckptfix.formats.gguf_file import read_gguf
from ckptfix.io.source import LocalFile
from ckptfix.plan.gguf_parts import PartEntry, PartKeys, pack_parts, part_size, plan_parts
from ckptfix.plan.select import OutTensor
from ckptfix.write.gguf import GgufJob, needed_bytes
from tests.gguf_files import PLAIN_TENSORS, Info, RawGguf, gstr, kv, write_gguf
from tests.helpers import cli, one_error_line, read_weights, tree_snapshot
from tests.optional import need

_FIX = "re-download the file, or convert the model to GGUF again"


# --- many tensors, many parts --------------------------------------------------------------


def test_parts_are_packed_greedily_by_file_size() -> None:
    """In source order, each part as full as --max-shard lets its whole file be (a tensor
    over it alone in a part of its own), each part's size counted as part_size counts it."""
    rng = random.Random(27)
    for _ in range(300):
        entries = [
            PartEntry(f"t{i}", rng.randint(1, 600), rng.randint(30, 90))
            for i in range(rng.randint(0, 25))
        ]
        keys = PartKeys(rng.randint(0, 300), rng.randint(0, 80), 0)
        alignment, limit = rng.choice([1, 32, 64]), rng.randint(100, 2500)
        groups = pack_parts(entries, limit, keys, alignment)
        assert [entry for group in groups for entry in group] == entries
        for number, group in enumerate(groups):
            own = keys.first if number == 0 else keys.rest
            assert len(group) == 1 or part_size(own, group, alignment) <= limit
            if number + 1 < len(groups):  # the next tensor did not fit
                assert part_size(own, [*group, groups[number + 1][0]], alignment) > limit


@pytest.mark.slow
def test_packing_many_tensors_takes_one_pass() -> None:
    """Packing summed every part so far again for each tensor: 10,000 tensors merged into
    one file took minutes, the million a header may hold would never end."""
    entries = [PartEntry(f"blk.{i}.weight", 4096, 40) for i in range(300_000)]
    start = time.perf_counter()
    plan = plan_parts(entries, 10**12, "model", PartKeys(500, 60, 60), 32)
    assert time.perf_counter() - start < 10
    assert [len(shard.tensors) for shard in plan.shards] == [300_000]


@pytest.mark.slow
def test_laying_out_many_parts_takes_one_pass(tmp_path: Path) -> None:
    """Each part's layout listed every tensor of the plan again (its split.tensors.count):
    a split into 20,000 parts took minutes before the first byte was written. The parts
    laid out are the sizes the plan packed them by."""
    count = 20_000
    tensors = {
        name: OutTensor.same(TensorInfo(name, "F32", (8,), 32, "m.gguf", (i * 32, i * 32 + 32)))
        for i, name in enumerate(f"t{i}" for i in range(count))
    }
    entries = [PartEntry(name, 32, len(tensor_info(name, (8,), "F32", 0))) for name in tensors]
    split = sum(map(len, split_keys(0, count, count)))
    plan = plan_parts(entries, 1, "m", PartKeys(split, split, split), 32)
    job = GgufJob(tensors, [{}] * count, {}, {}, staging="", out=str(tmp_path), verify=False)
    start = time.perf_counter()
    needed = needed_bytes(plan, job)
    assert time.perf_counter() - start < 10
    assert len(plan.shards) == count
    assert needed == sum(part_size(split, [entry], 32) for entry in entries)


@pytest.mark.slow
def test_more_parts_than_split_count_can_say_are_refused(tmp_path: Path) -> None:
    """split.count is a UINT16: a plan of 65,536 parts was an internal error (struct's
    ushort) once the first part was laid out; now it is refused with the plan."""
    count = 65_536
    raw = RawGguf(
        infos=[Info(f"t{i}", [1], 24, 32 * i) for i in range(count)],
        data=b"".join(bytes([i % 251]) + bytes(31) for i in range(count)),
    )
    source = raw.write(tmp_path / "in" / "many.gguf")
    before = tree_snapshot(tmp_path)
    line = one_error_line("reshard", source, "-o", tmp_path / "out", "--max-shard", "1")
    assert line == (
        f"error: {source}: --max-shard 1 would split it into 65,536 parts; a GGUF split set "
        "holds at most 65,535 (split.count is a UINT16) (rule gguf-split-count; choose a "
        "larger --max-shard)"
    )
    assert tree_snapshot(tmp_path) == before


# --- split keys of another type ----------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "record", "shown"),
    [
        ("split.count", struct.pack("<II", 4, 1), "UINT32 1"),
        ("split.no", struct.pack("<Iq", 11, 0), "INT64 0"),
        ("split.tensors.count", struct.pack("<IQ", 10, 1), "UINT64 1"),
    ],
    ids=["split.count", "split.no", "split.tensors.count"],
)
def test_split_keys_are_read_only_as_llama_cpp_reads_them(
    tmp_path: Path, key: str, record: bytes, shown: str
) -> None:
    """llama.cpp reads split.no and split.count as UINT16 and split.tensors.count as INT32,
    and refuses a file that stores them otherwise ("key split.count has wrong type"; a later
    part's split.no aborts it). Such a file passed inspect clean."""
    wanted = {"split.count": "UINT16", "split.no": "UINT16", "split.tensors.count": "INT32"}
    keys = [kv("general.architecture", 8, gstr("llama")), gstr(key) + record]
    path = RawGguf(keys=keys).write(tmp_path / "m.gguf")
    assert one_error_line("inspect", path) == (
        f"error: {path}: metadata key {key!r} is {shown}; llama.cpp reads it only as "
        f"{wanted[key]} and refuses the file (rule gguf-bad-value; {_FIX})"
    )


# --- the metadata a conversion keeps ---------------------------------------------------------


class _Counted(LocalFile):
    """A LocalFile that counts the bytes read from it."""

    read = 0

    def read_at(self, offset: int, size: int) -> bytes:
        self.read += size
        return super().read_at(offset, size)


def test_metadata_over_the_header_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A 101 MB string value (a hole, walked over in no time as a header) cannot fit in the
    100,000,000-byte header of a safetensors file: it was decoded in full (as \\u0000
    escapes, six bytes each) before the header was measured; now the spans say so at once."""
    size = 101_000_000
    keys = [
        kv("general.architecture", 8, gstr("llama")),
        kv("tokenizer.chat_template", 8, struct.pack("<Q", size)),
    ]
    path = tmp_path / "in" / "m.gguf"
    path.parent.mkdir()
    header = RawGguf(keys=keys, infos=[]).header()
    path.write_bytes(header)
    with open(path, "r+b") as handle:  # the string's bytes: a hole, then the file ends
        handle.truncate(len(header) + size)
    start = time.perf_counter()
    line = one_error_line("convert", path, "-o", tmp_path / "out")
    assert time.perf_counter() - start < 10
    assert line == (
        f"error: {path}: its metadata would take at least {size + 4 + 9:,} bytes as the "
        "JSON a safetensors header keeps, over that format's 100,000,000-byte header limit "
        "(rule header-too-large; keep the model as GGUF, or re-download it: no model's "
        "metadata is this large)"
    )
    assert not (tmp_path / "out").exists()


def _tokens(path: Path, strings: list[bytes]) -> Path:
    """A GGUF whose metadata holds `strings` as its tokenizer's tokens."""
    payload = struct.pack("<IQ", 8, len(strings)) + b"".join(map(gstr, strings))
    keys = [kv("general.architecture", 8, gstr("llama")), kv("tokenizer.ggml.tokens", 9, payload)]
    return RawGguf(keys=keys).write(path)


def _refused(path: Path, limit: int) -> tuple[PlanError, int]:
    """The error metadata_json raises under `limit`, and the bytes it read before."""
    with _Counted(str(path), str(path)) as source:
        head = read_gguf(source)
        source.read = 0
        with pytest.raises(PlanError) as raised:
            metadata_json(head, source, limit)
        return raised.value, source.read


def _tokens_kept(path: Path) -> object:
    with LocalFile(str(path), str(path)) as source:
        kept = json.loads(metadata_json(read_gguf(source), source, 10**8))
    return kept["metadata"]["tokenizer.ggml.tokens"]["value"]


def test_metadata_is_refused_as_soon_as_it_outgrows_the_limit(tmp_path: Path) -> None:
    """Quotes take one byte in the file and four in the header (`\\\\\\"`): the spans
    cannot tell, so the document is measured as it is built, and refused once it is over,
    without reading the rest."""
    strings = [b'"' * 1000] * 2000
    path = _tokens(tmp_path / "m.gguf", strings)
    error, read = _refused(path, 1_000_000)
    assert error.rule == "header-too-large"
    assert read < 1000 * 2000 / 2
    assert _tokens_kept(path) == ['"' * 1000] * 2000  # under a limit it fits: in full


@pytest.mark.slow
def test_metadata_floor_refuses_without_reading_a_value(tmp_path: Path) -> None:
    """30 million empty strings (what a 240 MB header can hold) took 163 s and 440 MB to
    decode before their header was found too large for safetensors."""
    count = 200_000
    path = _tokens(tmp_path / "m.gguf", [b""] * count)
    error, read = _refused(path, 5 * count - 2)  # `\"\",` each, the last without ","
    assert read == 0
    assert "at least 1,000,008 bytes" in error.detail()
    assert _tokens_kept(path) == [""] * count


# --- dequantizing, dedupe, reserved names --------------------------------------------------


def test_nan_scales_decode_without_numpy_warnings() -> None:
    """A Q6_K block with an Inf scale decodes to NaN, as in ggml; numpy printed two
    RuntimeWarnings with their source lines among convert's output."""
    need("gguf")
    from ckptfix.write.dequantize import dequantize_bytes

    block = bytearray(210)
    block[208:210] = struct.pack("<e", float("inf"))  # the block's fp16 scale, its scales 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        values = struct.unpack("<256f", dequantize_bytes(bytes(block), "Q6_K"))
    assert all(value != value for value in values)


def test_dedupe_keeps_the_gguf_metadata_as_convert_does(tmp_path: Path) -> None:
    """dedupe writes safetensors from a GGUF too; it dropped the metadata (the tokenizer
    among it) that convert keeps under "gguf"."""
    source = write_gguf(tmp_path / "in" / "m.gguf", "qwen2", PLAIN_TENSORS)
    for command in ("convert", "dedupe"):
        assert cli(command, source, "-o", tmp_path / command).code == 0
    kept = [
        read_weights(tmp_path / c / "model.safetensors").metadata for c in ("convert", "dedupe")
    ]
    assert kept[0] == kept[1] and "tokenizer.ggml.merges" in json.loads(kept[1]["gguf"])["metadata"]


def test_a_tensor_named_metadata_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """GGUF (and torch) names are free; safetensors keeps `__metadata__` for its metadata.
    The file was written, then failed its own verification as "a bug"."""
    raw = RawGguf(infos=[Info("__metadata__", [8]), Info("b", [8], 0, 32)])
    source = raw.write(tmp_path / "in" / "m.gguf")
    for command in ("convert", "dedupe"):
        out = tmp_path / command
        assert one_error_line(command, source, "-o", out) == (
            f"error: {out / 'model.safetensors'}: a tensor named '__metadata__' cannot be "
            "written: safetensors keeps that key for the header's string metadata (rule "
            "metadata-as-tensor; leave it out (`ckptfix convert --exclude __metadata__`), "
            "or write torch files (`--to torch`))"
        )
        assert not out.exists() and not list(tmp_path.glob(".ckptfix-*"))
    excluded = cli("convert", source, "-o", tmp_path / "ex", "--exclude", "__metadata__")
    assert excluded.code == 0, excluded.stderr
    assert cli("convert", source, "-o", tmp_path / "pt", "--to", "torch").code == 0


def test_a_file_named_only_gguf_splits_into_parts_named_as_parts(tmp_path: Path) -> None:
    """`.gguf` has no name to keep: its parts were `-00001-of-00003.gguf`, ..., which are not
    named as parts, so inspect of the output reported every one as a renamed part."""
    source = write_gguf(tmp_path / "in" / ".gguf", "llama", PLAIN_TENSORS)
    assert cli("reshard", source, "-o", tmp_path / "out", "--max-shard", "3000").code == 0
    names = sorted(path.name for path in (tmp_path / "out").iterdir())
    assert names == [f"model-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    run = cli("inspect", tmp_path / "out", "--json")
    assert run.code == 0, run.stderr
    assert [f["code"] for f in run.json()["findings"] if f["severity"] != "info"] == []
