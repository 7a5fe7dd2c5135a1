"""Resource bombs and crashes from the security review that are not plain refusals: each
test builds the hostile input and asserts the promise — bounded time and memory, one error
line, or a correct result — in a fresh process where memory or a hang is at stake."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zipfile
from pathlib import Path

import pytest

from ckptfix.core.errors import SourceChangedError
from tests.attacks import STORAGE, _tensor
from tests.builders import Emit, Factory, Spec, legacy_checkpoint, state_dict_pickle, zip_checkpoint
from tests.helpers import as_another_user, cli, give_away, measured

MB = 2**20


@pytest.mark.slow
def test_memo_index_cannot_size_memory(factory: Factory) -> None:
    """LONG_BINPUT 2^27: CPython's unpickler would allocate and clear 2 GiB for its memo."""
    pickle = _tensor(Emit().empty_dict()).op(b"r" + struct.pack("<I", 2**27)).op(b"s").stop()
    path = zip_checkpoint(factory.path("memo.pt"), pickle, STORAGE)
    run = measured("inspect", path)
    assert run.code == 1 and "(rule memo-index;" in run.error_lines[0], run.stderr
    assert run.peak_rss < 300 * MB, run.peak_rss


@pytest.mark.slow
def test_deeply_nested_lists_are_only_data(factory: Factory, tmp_path: Path) -> None:
    """A list nested 100,000 deep beside the tensors (a legacy file): the walks over the
    unpickled object are iterative, so this is a training checkpoint like any other."""
    depth = 100_000
    emit = _tensor(Emit().empty_dict()).op(b"s").string("deep")
    emit.op(b"]" * depth + b"a" * (depth - 1)).op(b"s")
    path = legacy_checkpoint(factory.path("deep.pt"), emit.stop(), ["0"], [(6, STORAGE["0"])])
    report = cli("inspect", path, "--json")
    assert report.code == 0, report.stderr
    assert [t["name"] for t in report.json()["tensors"]] == ["w"]
    out = tmp_path / "out"
    run = cli("convert", path, "-o", out)
    assert run.code == 0, run.stderr
    assert (out / "model.safetensors").exists()


@pytest.mark.slow
def test_shared_containers_are_walked_once(factory: Factory) -> None:
    """Sixty lists, each holding the one below it twice: 2^60 paths through 60 objects."""
    emit = _tensor(Emit().empty_dict()).op(b"s").string("dag").op(b"]r\x00\x00\x00\x00")
    for level in range(1, 61):
        below = struct.pack("<I", level - 1)
        emit.op(b"0(j" + below + b"j" + below + b"lr" + struct.pack("<I", level))
    path = zip_checkpoint(factory.path("dag.pt"), emit.op(b"s").stop(), STORAGE)
    run = measured("inspect", path, timeout=60)
    assert run.code == 0, run.stderr


@pytest.mark.slow
def test_many_zip_entries_with_a_duplicate(factory: Factory) -> None:
    """150,000 entries and one duplicate: finding it must not compare every pair (that took
    minutes)."""
    path = factory.path("many.pt")
    pickle = _tensor(Emit().empty_dict()).op(b"s").stop()
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle)
        archive.writestr("archive/data/0", STORAGE["0"])
        for number in range(150_000):
            archive.writestr(f"archive/extra/{number}", b"")
        archive.writestr("archive/extra/7", b"")
    run = measured("inspect", path, timeout=60)
    assert run.code == 1 and "(rule zip-duplicate-entry;" in run.error_lines[0], run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("where", ["file name", "index"])
def test_absurd_shard_count(factory: Factory, where: str) -> None:
    """`-of-9999999999` must not build a list of ten billion part numbers."""
    name = "model-00001-of-9999999999.safetensors"
    factory.safetensors(f"m/{name}", [Spec("a")])
    if where == "index":
        factory.index("m/model.safetensors.index.json", {"a": name}, 24)
    run = measured("inspect", factory.root / "m", "--json", timeout=60)
    messages = [f["message"] for f in json.loads(run.stdout)["findings"]]
    assert any("and 9999999993 more of 9999999999 absent" in m for m in messages), messages


def _expanded(factory: Factory, numel: int) -> Path:
    """One float32 element seen `numel` times through a stride-0 view."""
    pkl = state_dict_pickle({"w": ("0", "FloatStorage", 1, 0, [numel], [0])})
    return zip_checkpoint(factory.path("expanded.pt"), pkl, {"0": struct.pack("<f", 1.5)})


def test_expansion_at_the_cap_is_described_without_reading(factory: Factory) -> None:
    path = _expanded(factory, 2**32)  # 4 bytes claiming exactly 16 GiB: the cap itself
    run = cli("inspect", path, "--json")
    assert run.code == 0, run.stderr
    assert run.json()["tensors"][0]["nbytes"] == 2**34
    out = factory.root / "out"
    plan = cli("convert", path, "-o", out, "--dry-run", "--json", "--allow-expansion")
    assert plan.code == 0 and plan.json()["plan"]["total_size"] == 2**34
    unasked = cli("convert", path, "-o", out, "--dry-run")
    assert "(rule large-expansion;" in unasked.error_lines[0]
    over = _expanded(factory, 2**32 + 1)
    refused = cli("inspect", over)
    assert "(rule expansion-bomb;" in refused.error_lines[0]


@pytest.mark.slow
def test_expansion_streams_in_bounded_memory(factory: Factory, tmp_path: Path) -> None:
    """1 GiB written from 4 bytes (asked for: past the ratio and size a rewrite writes
    unasked): gathered and written a chunk at a time."""
    path = _expanded(factory, 2**28)
    out = tmp_path / "out"
    run = measured("convert", path, "-o", out, "--allow-expansion")
    assert run.code == 0, run.stderr
    assert run.peak_rss < 250 * MB, run.peak_rss
    data = (out / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    expected = hashlib.sha256(struct.pack("<f", 1.5) * 2**28).hexdigest()
    assert hashlib.sha256(data[8 + length :]).hexdigest() == expected


@pytest.mark.slow
def test_opcode_walk_at_the_cap_takes_seconds(factory: Factory) -> None:
    """45 million cheap opcodes (just under the cap) before the tensors: walked and unpickled
    in seconds, not the minutes a pure-Python disassembler would take."""
    emit = Emit().empty_dict().op(b"N0" * 22_500_000)
    path = zip_checkpoint(factory.path("long.pt"), _tensor(emit).op(b"s").stop(), STORAGE)
    run = measured("inspect", path, timeout=300)
    assert run.code == 0, run.stderr
    assert run.cpu < 60, run.cpu  # CPU time: wall time follows the machine's load
    over = zip_checkpoint(
        factory.path("longer.pt"),
        _tensor(Emit().empty_dict().op(b"N0" * 24_000_000)).op(b"s").stop(),
        STORAGE,
    )
    refused = measured("inspect", over, timeout=300)
    assert "(rule pickle-too-large;" in refused.error_lines[0], refused.stderr


@pytest.mark.slow
def test_header_that_would_grow_past_the_limit(factory: Factory, tmp_path: Path) -> None:
    """A valid header just under 100,000,000 bytes, without "format": adding it would break
    the format's limit, so the write is refused before anything is created."""
    header = {
        "__metadata__": {"note": ""},
        "w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
    }
    body = json.dumps(header, separators=(",", ":")).encode()
    header["__metadata__"]["note"] = "x" * (100_000_000 - len(body) - 4)
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    assert len(body) <= 100_000_000
    path = factory.bytes("big.safetensors", struct.pack("<Q", len(body)) + body + b"\x07")
    out = tmp_path / "out"
    run = cli("reshard", path, "-o", out)
    assert run.code == 1
    assert run.error_lines == [
        f"error: {out}/model.safetensors: its header would take {len(body) + 16} bytes, over the "
        "100000000-byte limit of the format (1 tensors) (rule header-too-large; choose a smaller "
        "--max-shard, so that each shard lists fewer tensors)"
    ]
    assert not out.exists() and not list(tmp_path.glob(".ckptfix-*"))


def test_large_metadata_goes_to_the_first_shard_only(factory: Factory, tmp_path: Path) -> None:
    notes = {"notes": "y" * 200_000, "format": "pt"}
    specs = [Spec(f"t{i}", "U8", (1000,)) for i in range(3)]
    source = factory.safetensors("m.safetensors", specs, notes)
    out = tmp_path / "out"
    run = cli("reshard", source, "-o", out, "--max-shard", "1000", "--json")
    assert run.code == 0, run.stderr
    assert run.json()["plan"]["metadata_scope"] == "first shard"
    from ckptfix.formats.safetensors import read_header

    shards = sorted(out.glob("model-*.safetensors"))
    metadata = [read_header(shard).metadata for shard in shards]
    assert metadata == [notes, {"format": "pt"}, {"format": "pt"}]
    small = cli(
        "reshard",
        factory.safetensors("s.safetensors", specs, {"a": "b"}),
        "-o",
        tmp_path / "small",
        "--max-shard",
        "1000",
        "--json",
    )
    assert small.json()["plan"]["metadata_scope"] == "every shard"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["model.safetensors.index.json", "config.json"])
def test_unreadable_side_file_is_a_finding(factory: Factory, name: str) -> None:
    folder = factory.sharded("m", [[Spec("a")], [Spec("b")]])
    factory.config("m")
    os.chmod(folder / name, 0)
    run = as_another_user("inspect", folder)
    assert "Traceback" not in run.stderr and "internal error" not in run.stderr
    assert run.code == 1, run.stderr
    assert f"error: {folder / name}: cannot read the " in run.stderr
    assert "(rule unreadable; check its permissions)" in run.stderr


def _one_line_as_another_user(
    factory: Factory, args: list[str | os.PathLike[str]], line: str
) -> None:
    """Run as another user: exit 1, exactly `line`, nothing written or left behind."""
    out = factory.root / "out"
    run = as_another_user(*[out if arg == "OUT" else arg for arg in args])
    assert run.code == 1, run.stderr
    assert run.error_lines == [line]
    assert not out.exists() and not list(factory.root.glob(".ckptfix-*"))


@pytest.mark.slow
@pytest.mark.parametrize("command", ["reshard", "convert", "dedupe"])
def test_an_unreadable_index_refuses_a_rewrite(factory: Factory, command: str) -> None:
    """Reported as still open: the output written from the shards alone, the index ignored."""
    folder = factory.sharded("m", [[Spec("a")], [Spec("b")]])
    os.chmod(folder / "model.safetensors.index.json", 0)
    _one_line_as_another_user(
        factory,
        [command, folder, "-o", "OUT"],
        f"error: {folder / 'model.safetensors.index.json'}: cannot read the index: Permission "
        "denied (rule unreadable; check its permissions)",
    )


WRITES = [["reshard", "-o", "OUT"], ["fix", "-o", "OUT"], ["reshard", "--in-place"]]
WRITES += [["fix", "--in-place"]]


@pytest.mark.slow
@pytest.mark.parametrize("command", WRITES, ids=" ".join)
def test_an_unreadable_sub_folder_is_one_error_line(factory: Factory, command: list[str]) -> None:
    """It was `internal error: PermissionError`: the sub-folder is carried to the output,
    so it must be listed. --in-place said `PATH: cannot write: Permission denied`."""
    folder = factory.sharded("m", [[Spec("a")], [Spec("b")]])
    (folder / "extra").mkdir()
    (folder / "extra" / "notes.txt").write_text("notes")
    give_away(folder / "extra")
    os.chmod(folder / "extra", 0o700)
    _one_line_as_another_user(
        factory,
        [command[0], folder, *command[1:]],
        f"error: {folder / 'extra'}: cannot list the folder: Permission denied (rule "
        "unreadable; check its permissions)",
    )


# Each runs ckptfix as another user: `make test-fast` runs `inspect`, `make test` them all.
@pytest.mark.parametrize(
    "command",
    [["inspect"], *(pytest.param(c, marks=pytest.mark.slow) for c in [["hash"], *WRITES])],
    ids=" ".join,
)
def test_an_unlistable_model_folder_is_one_error_line(factory: Factory, command: list[str]) -> None:
    folder = factory.sharded("m", [[Spec("a")], [Spec("b")]])
    os.chmod(folder, 0o300)  # it can be entered, not listed
    _one_line_as_another_user(
        factory,
        [command[0], folder, *command[1:]],
        f"error: {folder}: cannot list the folder: Permission denied (rule unreadable; check "
        "its permissions)",
    )


@pytest.mark.slow
@pytest.mark.parametrize("command", ["reshard", "convert", "dedupe", "fix"])
def test_an_unreadable_side_file_is_named_by_a_write(factory: Factory, command: str) -> None:
    """It was `OUT: cannot write: Permission denied (rule write-failed)`: the copy of the
    folder's other files failed to read one, and the output was blamed."""
    folder = factory.sharded("m", [[Spec("a")], [Spec("b")]])
    (folder / "tokenizer.json").write_text("{}")
    os.chmod(folder / "tokenizer.json", 0)
    _one_line_as_another_user(
        factory,
        [command, folder, "-o", "OUT"],
        f"error: {folder / 'tokenizer.json'}: cannot read the file: Permission denied (rule "
        "unreadable; check its permissions)",
    )


@pytest.mark.slow
def test_an_unreadable_side_file_is_named_by_a_gguf_reshard(factory: Factory) -> None:
    """As for safetensors: the file that could not be read is named, not OUT (an unreadable
    file's error is a PermissionError too, which the write's OSError handler took for the
    output's)."""
    from tests.gguf_files import write_gguf

    folder = factory.root / "g"
    write_gguf(folder / "llama-Q4_K.gguf")
    (folder / "README.md").write_text("notes")
    os.chmod(folder / "README.md", 0)
    _one_line_as_another_user(
        factory,
        ["reshard", folder, "-o", "OUT", "--max-shard", "3000"],
        f"error: {folder / 'README.md'}: cannot read the file: Permission denied (rule "
        "unreadable; check its permissions)",
    )


@pytest.mark.parametrize("kind", ["streamed", "gathered"])
def test_source_truncated_while_being_read(
    factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    import torch

    from ckptfix.ops import rewrite

    source = factory.path("m.bin")
    weight = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    torch.save({"w": weight if kind == "streamed" else weight.t()}, source)
    real_open = rewrite.open_checkpoint

    def open_then_truncate(*args: object, **kwargs: object) -> object:
        checkpoint = real_open(*args, **kwargs)  # type: ignore[arg-type]
        os.truncate(source, os.path.getsize(source) // 2)
        return checkpoint

    monkeypatch.setattr(rewrite, "open_checkpoint", open_then_truncate)
    out = tmp_path / "out"
    with pytest.raises(SourceChangedError) as caught:
        rewrite.convert(source, out)
    assert caught.value.line() == (
        f"error: {source}: file ended early: it changed during the run (rule source-changed; run again on a stable copy)"
    )
    assert not out.exists() and not list(tmp_path.glob(".ckptfix-*"))


def test_stubs_keep_data_and_refuse_a_second_build() -> None:
    """The allowlist's inert stubs: a pickle may build one (NEWOBJ then BUILD) and only once."""

    from ckptfix.core.errors import CorruptFileError
    from ckptfix.formats.unpickler import TORCH_ALLOWLIST, Stub, extended, stub_class, unpickle

    allowed = extended(
        TORCH_ALLOWLIST, {("argparse", "Namespace"): stub_class("argparse.Namespace")}
    )

    def no_storage(*args: object) -> object:
        raise AssertionError("no storage here")

    built = (
        b"\x80\x02cargparse\nNamespace\n)\x81}X\x02\x00\x00\x00lrG?\xb9\x99\x99\x99\x99\x99\x9asb."
    )
    namespace = unpickle(built, "n.pt", no_storage, allowed)  # type: ignore[arg-type]
    assert isinstance(namespace, Stub) and namespace.field("lr") == 0.1
    twice = built[:-1] + b"}X\x02\x00\x00\x00lrK\x07sb."
    with pytest.raises(
        CorruptFileError, match=r"builds a argparse.Namespace twice \(rule mutated-object"
    ):
        unpickle(twice, "n.pt", no_storage, allowed)  # type: ignore[arg-type]
    with pytest.raises(Exception, match="outside the allowlist"):
        unpickle(built, "n.pt", no_storage, TORCH_ALLOWLIST)  # type: ignore[arg-type]
