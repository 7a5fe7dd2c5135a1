"""`ckptfix hash`: the digest as docs/hash.md defines it, checked against hashlib over bytes that
torch and the fixture factory produce (tests/hash_oracle.py), never against stored digests."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ckptfix.core.tensor import Piece, TensorInfo
from ckptfix.io.source import LocalFile
from ckptfix.ops.digest import content_digests, layout_key
from ckptfix.ops.hash import HashOptions, hash_checkpoint
from tests import hash_oracle as oracle
from tests.builders import Factory, Spec, seeded_bytes
from tests.helpers import cli, measured

if TYPE_CHECKING:
    import torch

HASH_PAGE = Path(__file__).resolve().parent.parent / "docs" / "hash.md"


def _spec_digests(specs: list[Spec]) -> dict[str, bytes]:
    """The oracle for factory-written tensors: their bytes are the factory's seeded bytes."""
    return {
        spec.name: oracle.named(
            spec.name,
            oracle.content(
                spec.dtype, spec.shape, spec.data or seeded_bytes(spec.nbytes(), spec.name)
            ),
        )
        for spec in specs
    }


def test_documented_worked_example(tmp_path: Path) -> None:
    """docs/hash.md's code, run as it is, prints the digests the page shows, and ckptfix gives the
    same ones for that tensor saved by safetensors and by torch.save."""
    import torch
    from safetensors.torch import save_file

    text = HASH_PAGE.read_text()
    section = text[text.index("## How the digest is defined") :]
    code, shown = re.findall(r"```(?:python)?\n(.*?)```", section, re.DOTALL)[:2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == shown.split()
    content, named, model = shown.split()
    tensor = torch.tensor([1.0, -2.0], dtype=torch.float16)
    save_file({"w": tensor}, str(tmp_path / "w.safetensors"))
    torch.save({"w": tensor}, tmp_path / "w.pt")
    for path in (tmp_path / "w.safetensors", tmp_path / "w.pt"):
        document = cli("hash", path, "--json").json()
        assert document["digest"] == model
        assert document["tensors"]["w"]["content"] == content
        assert document["tensors"]["w"]["digest"] == named


def test_json_document(factory: Factory) -> None:
    specs = [Spec("b", "BF16", (2, 3)), Spec("a", "I64", (4,)), Spec("c", "F32", ())]
    path = factory.safetensors("m.safetensors", specs, {"producer": "test"})
    run = cli("hash", path, "--json")
    assert run.code == 0, run.stderr
    digests = _spec_digests(specs)
    contents = {
        s.name: oracle.content(s.dtype, s.shape, seeded_bytes(s.nbytes(), s.name)) for s in specs
    }
    assert run.json() == {
        "schema_version": 1,
        "algorithm": "sha256",
        "digest": oracle.model(digests),
        "path": str(path),
        "tensor_count": 3,
        "total_bytes": 12 + 32 + 4,
        "aliases": {},
        "tensors": {
            name: {
                "dtype": spec.dtype,
                "shape": list(spec.shape),
                "nbytes": spec.nbytes(),
                "content": contents[name].hex(),
                "digest": digests[name].hex(),
            }
            for name, spec in sorted((s.name, s) for s in specs)
        },
    }
    assert list(run.json()["tensors"]) == ["a", "b", "c"]


def test_human_output(factory: Factory) -> None:
    specs = [Spec("x"), Spec("y", "F16", (3,))]
    path = factory.safetensors("m.safetensors", specs)
    digests = _spec_digests(specs)
    run = cli("hash", path, "--tensors")
    assert run.code == 0
    assert run.stdout.splitlines() == [
        f"{oracle.model(digests)}  {path}",
        "sha256 of 2 tensors, 30 B",
        f"{digests['x'].hex()}  F32 [2, 3]  x",
        f"{digests['y'].hex()}  F16 [3]  y",
    ]
    one = cli("hash", factory.safetensors("one.safetensors", [Spec("x")]))
    assert one.stdout.splitlines()[1] == "sha256 of 1 tensor, 24 B"


def test_order_metadata_and_sharding_do_not_matter(factory: Factory) -> None:
    specs = [
        Spec(f"layer.{i}.weight", dtype, (i + 1, 3))
        for i, dtype in enumerate(["F32", "BF16", "U8", "F64"])
    ]
    expected = oracle.model(_spec_digests(specs))
    single = factory.safetensors("single.safetensors", specs)
    shuffled = factory.safetensors("shuffled.safetensors", specs[::-1], {"note": "other metadata"})
    bare = factory.safetensors("bare.safetensors", specs, with_format=False)
    sharded = factory.sharded("sharded", [[specs[3], specs[0]], [specs[2]], [specs[1]]])
    unindexed = factory.sharded(
        "loose", [[specs[1]], [specs[0], specs[2], specs[3]]], write_index=False
    )
    for path in (single, shuffled, bare, sharded, unindexed):
        assert hash_checkpoint(path).digest == expected, path


def test_what_changes_the_digest(factory: Factory) -> None:
    data = seeded_bytes(24, "w")
    base = hash_checkpoint(factory.safetensors("base.safetensors", [Spec("w", data=data)]))
    flipped = bytes([data[0] ^ 1]) + data[1:]
    variants = {
        "flipped bit": [Spec("w", data=flipped)],
        "renamed": [Spec("v", data=data)],
        "dtype": [Spec("w", "I32", data=data)],
        "shape": [Spec("w", "F32", (3, 2), data=data)],
        "rank": [Spec("w", "F32", (6,), data=data)],
        "extra tensor": [Spec("w", data=data), Spec("z", "U8", (0,))],
    }
    digests = {base.digest}
    for label, specs in variants.items():
        result = hash_checkpoint(factory.safetensors(f"{label}.safetensors", specs))
        assert result.digest == oracle.model(_spec_digests(specs)), label
        digests.add(result.digest)
    assert len(digests) == len(variants) + 1


def test_views_aliases_and_formats(tmp_path: Path) -> None:
    """A pickle with a transposed view, slices of one buffer, an expanded tensor and tied
    weights hashes like its contiguous safetensors copy, in zip and legacy form."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    fused = torch.randn(6, 4)
    embed = torch.randn(5, 3).to(torch.bfloat16)
    state = {
        "embed.weight": embed,
        "lm_head.weight": embed,
        "q": fused[:2],
        "k": fused[2:4],
        "v": fused[4:],
        "t": torch.randn(3, 5).t(),
        "e": torch.randn(1, 3).expand(4, 3),
        "s": torch.arange(10, dtype=torch.int16)[::3],
        "scalar": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }
    expected = oracle.digest(state)
    torch.save(state, tmp_path / "zip.pt")
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    save_file(
        {k: v.contiguous().clone() for k, v in state.items()}, str(tmp_path / "m.safetensors")
    )
    for name in ("zip.pt", "legacy.pt", "m.safetensors"):
        assert hash_checkpoint(tmp_path / name).digest == expected, name


def test_training_checkpoint_hashes_its_model(tmp_path: Path) -> None:
    import torch

    model = {"layer.weight": torch.randn(3, 3), "layer.bias": torch.randn(3)}
    torch.save(
        {"state_dict": model, "optimizer_states": [{"m": torch.randn(3)}], "epoch": 3},
        tmp_path / "c.ckpt",
    )
    assert hash_checkpoint(tmp_path / "c.ckpt").digest == oracle.digest(model)


def test_folder_hashes_the_family_a_loader_loads(factory: Factory, tmp_path: Path) -> None:
    import torch

    specs = [Spec("a"), Spec("b", "F16", (4,))]
    folder = factory.sharded("model", [specs[:1], specs[1:]])
    torch.save({"a": torch.zeros(2, 3)}, folder / "pytorch_model.bin")  # a stale other family
    assert hash_checkpoint(folder).digest == oracle.model(_spec_digests(specs))


def test_dropped_record_single_file_and_sharded(tmp_path: Path) -> None:
    import torch

    embed = torch.randn(8, 4)
    state = {"model.embed.weight": embed, "lm_head.weight": embed, "norm": torch.randn(4)}
    torch.save(state, tmp_path / "tied.bin")
    expected = oracle.digest(state)
    for label, max_shard in (("one", "5GB"), ("sharded", "100")):
        out = tmp_path / label
        assert cli("convert", tmp_path / "tied.bin", "-o", out, "--max-shard", max_shard).code == 0
        result = hash_checkpoint(out)
        assert result.digest == expected, label
        assert result.aliases == {"lm_head.weight": "model.embed.weight"}
        stored = {k: v for k, v in state.items() if k != "lm_head.weight"}
        assert hash_checkpoint(out, HashOptions(alias_record=False)).digest == oracle.digest(stored)
    assert hash_checkpoint(tmp_path / "tied.bin").digest == expected


@pytest.mark.parametrize(
    ("record", "what"),
    [
        ("{not json", "is not JSON"),
        ("[" * 100_000 + "]" * 100_000, "is not JSON"),  # was an internal RecursionError
        ('["a"]', "is not an object of names"),
        ('{"lm_head": "gone"}', "maps names to 'gone', which is not stored"),
        ('{"a": "b"}', "names 'a' as dropped, but it is stored"),
    ],
)
def test_bad_record_is_refused(factory: Factory, record: str, what: str) -> None:
    path = factory.safetensors("m.safetensors", [Spec("a"), Spec("b")], {"ckptfix.dropped": record})
    run = cli("hash", path)
    assert run.code == 1
    assert run.error_lines == [
        f"error: {path}: the ckptfix.dropped record {what} (rule alias-record; pass "
        "--no-alias-record to ignore it)"
    ]
    assert cli("hash", path, "--no-alias-record").code == 0
    # a rewrite takes the record's names as the file's own, so it cannot ignore it either
    converted = cli("convert", path, "-o", factory.root / "out")
    assert converted.error_lines == [
        f"error: {path}: the ckptfix.dropped record {what} (rule alias-record; remove the "
        "record from the metadata, or correct it)"
    ]
    assert not (factory.root / "out").exists()


def test_a_tensor_over_several_files(tmp_path: Path) -> None:
    """Pieces of one tensor in two files (as ranks save them) hash as their joined bytes."""
    first, second = seeded_bytes(40, 1), seeded_bytes(24, 2)
    (tmp_path / "r0").write_bytes(b"head" + first)
    (tmp_path / "r1").write_bytes(second + b"tail")
    files = {label: LocalFile(str(tmp_path / label)) for label in ("r0", "r1")}
    tensor = TensorInfo(
        "w",
        "F32",
        (4, 4),
        64,
        "r0",
        (4, 44),
        spread=(Piece("r1", 0, 24, at=40), Piece("r0", 4, 40, at=0)),
    )
    digest = content_digests([tensor], files.__getitem__)[layout_key(tensor)]
    assert digest == oracle.content("F32", (4, 4), first + second)


def test_missing_path_and_empty_folder(tmp_path: Path) -> None:
    missing = cli("hash", tmp_path / "nope")
    assert missing.code == 2
    assert missing.error_lines == [
        f"error: {tmp_path / 'nope'}: no such file or directory (rule input-not-found; check the path)"
    ]


@pytest.mark.parametrize("command", ["hash", "diff", "reshard", "convert", "dedupe", "inspect"])
def test_an_empty_folder_is_one_line_naming_its_rule(tmp_path: Path, command: str) -> None:
    """Every command but inspect and fix ended the line `(check the path, or download the
    weights) (rule input-refused)`, not `(rule no-weights; ...)` as SPEC's lines go."""
    empty = tmp_path / "empty"
    empty.mkdir()
    extra = {"diff": [empty], "hash": [], "inspect": []}.get(command, ["-o", tmp_path / "out"])
    run = cli(command, empty, *extra)
    assert run.code == 1
    assert run.error_lines == [
        f"error: {empty}: folder holds no weight file (*.safetensors, *.bin, *.pt, ...) and no "
        "shard index (rule no-weights; check the path, or download the weights)"
    ]


@pytest.mark.parametrize("command", ["hash", "reshard", "convert", "dedupe"])
def test_an_empty_folder_refused_names_the_finding_code_in_json(
    tmp_path: Path, command: str
) -> None:
    """A refusal for a finding carries the finding's code (docs/inspect.md, Exit codes), in the JSON
    error document and on the library's error: it was `input-refused`."""
    empty = tmp_path / "empty"
    empty.mkdir()
    extra = [] if command == "hash" else ["-o", tmp_path / "out"]
    run = cli(command, empty, *extra, "--json")
    assert run.code == 1
    error = json.loads(run.stdout)["error"]
    assert (error["code"], error["rule"]) == ("no-weights", "no-weights")


@pytest.mark.parametrize("form", ["safetensors", "zip"])
def test_a_single_flipped_bit_is_found(tmp_path: Path, form: str) -> None:
    """One bit flipped in the file's tensor data changes the digest to the one torch's
    reading of the damaged file gives, and diff names exactly the damaged tensors."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(1)
    weight = torch.randn(16, 16)
    state = {"a": weight, "tied": weight, "b": torch.randn(64).to(torch.bfloat16)}
    path = tmp_path / ("m.safetensors" if form == "safetensors" else "m.bin")
    if form == "safetensors":
        save_file({k: v.clone() for k, v in state.items()}, str(path))
    else:
        torch.save(state, path)
    data = bytearray(path.read_bytes())
    position = data.index(oracle.row_major(state["b"])) + 37
    data[position] ^= 0x10
    damaged = tmp_path / f"damaged{path.suffix}"
    damaged.write_bytes(bytes(data))
    after = (
        {"a": weight, "tied": weight, "b": _load_safetensors(damaged)["b"]}
        if form == "safetensors"
        else torch.load(damaged, weights_only=True)
    )
    assert hash_checkpoint(damaged).digest == oracle.digest(after) != oracle.digest(state)
    run = cli("diff", path, damaged, "--json")
    assert run.code == 1
    assert [item["name"] for item in run.json()["bytes_changed"]] == ["b"]


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.slow
def test_memory_is_bounded_whatever_the_size(factory: Factory) -> None:
    """A 2 GiB tensor (a sparse file: no disk used) hashes in well under 150 MiB."""
    shape = (2**30,)
    path = factory.sparse_safetensors("big.safetensors", "BF16", shape)
    run = measured("hash", path, "--json", timeout=300)
    assert run.code == 0, run.stderr
    zeros = hashlib.sha256(oracle.u64(4) + b"BF16" + oracle.u64(1, *shape))
    block = bytes(2**24)
    for _ in range(2**31 // len(block)):
        zeros.update(block)
    assert json.loads(run.stdout)["tensors"]["huge"]["content"] == zeros.hexdigest()
    assert run.peak_rss < 150 * 2**20, run.peak_rss


@pytest.mark.slow
def test_small_tensors_read_in_batches_hash_alike(factory: Factory, tmp_path: Path) -> None:
    """Small tensors are hashed from shared reads of up to 1 MiB (ops.digest._Batch): many of
    them, some just under and over the size that decides it, and views into one storage."""
    import torch

    specs = [Spec(f"t.{i}", "U8", (2**16 - 1 + i % 3,)) for i in range(40)]
    specs += [Spec(f"s.{i}", "F16", (i % 7,)) for i in range(3000)]
    path = factory.safetensors("many.safetensors", specs)
    assert hash_checkpoint(path).digest == oracle.model(_spec_digests(specs))
    storage = torch.randn(300, 100)
    state = {f"row.{i}": storage[i] for i in range(0, 300, 7)} | {"col": storage[:, 3]}
    torch.save(state, tmp_path / "views.pt")
    assert hash_checkpoint(tmp_path / "views.pt").digest == oracle.digest(state)


@pytest.mark.slow  # three CLI runs in fresh processes: about a second
def test_no_torch_and_no_numpy_unless_values(factory: Factory) -> None:
    """hash and diff of safetensors import neither torch nor numpy; diff --values needs
    numpy only (bf16 and fp8 are decoded from their bits)."""
    path = factory.safetensors("m.safetensors", [Spec("a", "BF16"), Spec("b", "F8_E4M3")])
    other = factory.safetensors(
        "o.safetensors", [Spec("a", "BF16", data=bytes(12)), Spec("b", "F8_E4M3")]
    )
    probe = (
        "import sys; from ckptfix.cli.app import main; sys.argv = ['ckptfix', *sys.argv[1:]]\n"
        "try:\n    main()\nexcept SystemExit:\n"
        "    print(sorted(m for m in ('torch', 'numpy') if m in sys.modules), file=sys.stderr)"
    )
    loaded = {}
    for args in (["hash", path], ["diff", path, other], ["diff", path, other, "--values"]):
        done = subprocess.run(
            [sys.executable, "-c", probe, *map(str, args)],
            capture_output=True,
            text=True,
            check=False,
        )
        loaded[
            " ".join(a for a in map(str, args) if a.startswith("-") or a in ("hash", "diff"))
        ] = done.stderr.strip().splitlines()[-1]
    assert loaded == {"hash": "[]", "diff": "[]", "diff --values": "['numpy']"}


def test_empty_tensors_read_nothing(tmp_path: Path) -> None:
    """An empty tensor of a legacy pickle may point past the end of the file (found by the
    property test): it is hashed without reading, alone or among small ones."""
    import torch

    state = {
        "empty": torch.zeros(2, 0)[1:],  # storage offset 1 in an empty storage
        "small": torch.arange(3.0),
        "none": torch.zeros(3, 0, 2, dtype=torch.int8)[1:],
    }
    for legacy in (True, False):
        path = tmp_path / f"m-{legacy}.pt"
        torch.save(state, path, _use_new_zipfile_serialization=not legacy)
        assert hash_checkpoint(path).digest == oracle.digest(state)
        assert cli("diff", path, path).code == 0
