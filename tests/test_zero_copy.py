"""Zero-copy writes on real filesystems with reflinks: XFS and btrfs images loop-mounted in
the test (tests/loop_mounts.py). Every rewrite of safetensors bytes shares the source's
blocks (filefrag says "shared"), uses no more space than its headers and partial blocks,
reports how each byte was verified, and writes files every reader loads. Elsewhere (another
filesystem, cast tensors) the output is what it always was."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptfix.formats.safetensors import HeaderEntry, encode_header, read_header
from tests.builders import Factory, Spec, seeded_bytes
from tests.helpers import cli, load_safetensors_folder, read_tensors, torch_bytes
from tests.loop_mounts import extents, loop_mount, own_bytes, shared_bytes, used_bytes

pytestmark = pytest.mark.slow

# Tensors whose sizes are not whole blocks (boundaries fall inside blocks) and whose offsets
# keep every dtype aligned; about 39 MB, so that a copy would show in used space.
SPECS = [
    Spec("model.embed_tokens.weight", "BF16", (1000, 4096)),
    Spec("model.layers.0.bias", "F32", (3,)),
    Spec("model.layers.0.weight", "F32", (1024, 2049)),
    Spec("model.layers.0.norm", "U8", (6,)),
    Spec("model.layers.1.weight", "BF16", (2048, 1500)),
    Spec("model.scale", "F32", (1,)),
    Spec("lm_head.weight", "BF16", (4096, 1024)),
]
# What the filesystems themselves take for the new files (inodes, directory blocks, extent,
# reference-count and b-tree blocks): a copy of the data would take 39 MB.
METADATA_ALLOWANCE = 2**20


@pytest.fixture(scope="module")
def xfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with loop_mount("xfs", tmp_path_factory.mktemp("xfs")) as point:
        yield point


def _fresh(point: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh folder on a mounted filesystem for one test, removed after it."""
    folder = point / request.node.name.replace("[", "-").replace("]", "")
    folder.mkdir()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def place(filesystem: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    yield from _fresh(filesystem, request)


@pytest.fixture
def on_xfs(xfs: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    yield from _fresh(xfs, request)


def _block(point: Path) -> int:
    return os.statvfs(point).f_bsize


def _unpadded_size(path: Path) -> int:
    """The header size the file would have without alignment padding: its entries and
    metadata encoded again."""
    header = read_header(path)
    start = header.data_start
    entries = [
        HeaderEntry(t.name, t.dtype, t.shape, t.byte_range[0] - start, t.byte_range[1] - start)
        for t in header.tensors
    ]
    return len(encode_header(entries, header.metadata))


def _shards(out: Path) -> list[Path]:
    return sorted(out.glob("*.safetensors"))


def _regions(out: Path, sources: list[Path]) -> int:
    """How many regions the output shards take from their sources: runs of consecutive
    tensors that are consecutive in one source file too. Each can lose a partial block at
    either end; the blocks inside it are all shared."""
    where = {}
    for path in sources:
        for tensor in read_header(path).tensors:
            where[tensor.name.removeprefix("module.")] = (path, *tensor.byte_range)
    count = 0
    for shard in _shards(out):
        last = None
        for tensor in read_header(shard).tensors:
            file, begin, end = where[tensor.name]
            count += last is None or last != (file, begin)
            last = (file, end)
    return count


def _check_account(out: Path, written: dict[str, Any], regions: int, block: int) -> None:
    """What the JSON of every zero-copy write must show: of the bytes copied as they are, all
    but at most two partial blocks per source region were cloned; cloned blocks were verified
    by their extents, except those straddling two tensors (compared, at most one block per
    tensor); every byte was verified one way; the padding is what the headers hold."""
    account, ways = written["zero_copy"], written["verified_by"]
    total = account["cloned"] + account["copied"]
    as_they_are = total - ways["digest"]  # cast tensors are made, not copied
    assert account["block"] == block
    assert account["cloned"] >= as_they_are - 2 * regions * block
    tensors = sum(len(read_header(path).tensors) for path in _shards(out))
    assert ways["extents"] <= account["cloned"] <= ways["extents"] + tensors * block
    assert ways["extents"] + ways["compared"] + ways["digest"] == total
    assert written["verified"] is True
    shards = _shards(out)
    assert account["padding"] == sum(read_header(p).data_start - _unpadded_size(p) for p in shards)


def _check_zero_copy(out: Path, written: dict[str, Any], sources: list[Path], block: int) -> None:
    """_check_account, and on disk: the cloned bytes are on extents shared with the source,
    and what is not shared is only headers and partial blocks."""
    regions = _regions(out, sources)
    _check_account(out, written, regions, block)
    account, shards = written["zero_copy"], _shards(out)
    assert sum(shared_bytes(path) for path in shards) >= account["cloned"]
    headers = sum(read_header(path).data_start for path in shards)
    partial = (2 * regions + len(shards)) * block
    assert sum(own_bytes(path) for path in shards) <= headers + account["copied"] + partial


def _source(folder: Path, specs: list[Spec] = SPECS, name: str = "model.safetensors") -> Path:
    return Factory(folder).safetensors(name, specs)


def test_reshard_shares_every_whole_block(place: Path) -> None:
    source = _source(place / "src")
    block = _block(place)
    before = used_bytes(place)
    run = cli("reshard", source, "-o", place / "out", "--max-shard", "10MB", "--json")
    assert run.code == 0, run.stderr
    after = used_bytes(place)
    written = run.json()["written"]
    _check_zero_copy(place / "out", written, [source], block)
    assert written["zero_copy"]["padding"] > 0  # the case this feature exists for
    assert len(_shards(place / "out")) == len(run.json()["plan"]["shards"]) > 1
    own = sum(own_bytes(path) for path in (place / "out").iterdir())
    assert after - before <= own + METADATA_ALLOWANCE
    assert after - before < written["bytes"] // 10  # a copy would take it all
    assert read_tensors(place / "out") == read_tensors(source)
    assert cli("inspect", place / "out", "--fail-on", "warning").code == 0
    loaded = load_safetensors_folder(place / "out")  # safetensors' own reader
    assert {k: torch_bytes(v) for k, v in loaded.items()} == {
        name: data for name, (_, _, data) in read_tensors(source).items()
    }


def test_human_output_says_what_was_shared_and_how_it_was_verified(place: Path) -> None:
    source = _source(place / "src")
    run = cli("reshard", source, "-o", place / "out", "--max-shard", "10MB")
    assert run.code == 0, run.stderr
    text = " ".join(run.stdout.split())
    assert f"shared with the source ({_block(place):,}-byte blocks)" in text
    assert "by identical extents" in text and "compared byte for byte" in text


def test_a_sharded_folder_shares_blocks_from_each_of_its_files(place: Path) -> None:
    factory = Factory(place)
    folder = factory.sharded("src", [SPECS[:3], SPECS[3:]])
    factory.config("src")
    run = cli("reshard", folder, "-o", place / "out", "--max-shard", "20MB", "--json")
    assert run.code == 0, run.stderr
    sources = sorted(folder.glob("*.safetensors"))
    _check_zero_copy(place / "out", run.json()["written"], sources, _block(place))
    assert read_tensors(place / "out") == read_tensors(folder)
    assert json.loads((place / "out" / "config.json").read_text())["model_type"] == "llama"


def test_reshard_in_place_takes_no_more_space(place: Path) -> None:
    folder = place / "model"
    _source(folder)
    expected = read_tensors(folder)
    before = used_bytes(place)
    run = cli("reshard", folder, "--in-place", "--max-shard", "10MB", "--json")
    assert run.code == 0, run.stderr
    assert len(_shards(folder)) == len(run.json()["plan"]["shards"]) > 1
    shards = len(run.json()["plan"]["shards"])  # each a region of the one source file
    _check_account(folder, run.json()["written"], shards, _block(place))
    # The old file is gone; the new shards hold its blocks, now their own: what they add is
    # their headers' blocks and the partial blocks at either end.
    growth = used_bytes(place) - before
    assert growth <= 3 * shards * _block(place) + METADATA_ALLOWANCE
    assert read_tensors(folder) == expected


def test_merging_files_shares_the_largest_region(place: Path) -> None:
    """One data start per shard: merged from several files whose bytes need different
    starts, a shard clones the region with the most whole blocks and copies the rest."""
    factory = Factory(place)
    folder = factory.sharded("model", [SPECS[:2], SPECS[2:5], SPECS[5:]])
    run = cli("reshard", folder, "-o", place / "out", "--max-shard", "50MB", "--json")
    assert run.code == 0, run.stderr
    account = run.json()["written"]["zero_copy"]
    sizes = [sum(spec.nbytes() for spec in part) for part in (SPECS[:2], SPECS[2:5], SPECS[5:])]
    block = _block(place)
    assert max(sizes) - 2 * 3 * block <= account["cloned"] < sum(sizes) - 2 * block
    extents = run.json()["written"]["verified_by"]["extents"]
    assert extents <= account["cloned"] <= extents + len(SPECS) * block  # see _check_account
    assert read_tensors(place / "out") == read_tensors(folder)


def test_convert_with_exclude_and_strip_prefix_shares_blocks(place: Path) -> None:
    specs = [Spec("module." + spec.name, spec.dtype, spec.shape) for spec in SPECS]
    source = _source(place / "src", specs)
    out = place / "out"
    args = ["--strip-prefix", "module.", "--exclude", "*.norm", "--max-shard", "12MB"]
    run = cli("convert", source, "-o", out, *args, "--json")
    assert run.code == 0, run.stderr
    document = run.json()
    assert document["plan"]["excluded"] == ["module.model.layers.0.norm"]
    _check_zero_copy(out, document["written"], [source], _block(place))
    want = {
        name.removeprefix("module."): value
        for name, value in read_tensors(source).items()
        if not name.endswith(".norm")
    }
    assert read_tensors(out) == want


def test_dedupe_by_content_shares_blocks(place: Path) -> None:
    embed = SPECS[0]
    payload = seeded_bytes(embed.nbytes(), embed.name)
    specs = [Spec(embed.name, embed.dtype, embed.shape, payload), *SPECS[1:6]]
    specs.append(Spec("lm_head.weight", embed.dtype, embed.shape, payload))  # a declared tie
    factory = Factory(place)
    factory.safetensors("src/model.safetensors", specs)
    factory.config("src", model_type="gpt2", tie_word_embeddings=True)
    run = cli("dedupe", place / "src", "-o", place / "out", "--by-content", "--json")
    assert run.code == 0, run.stderr
    document = run.json()
    assert document["plan"]["dropped"] == {"lm_head.weight": "model.embed_tokens.weight"}
    _check_zero_copy(
        place / "out", document["written"], [place / "src" / "model.safetensors"], _block(place)
    )


def test_cast_tensors_are_written_and_verified_by_digest(on_xfs: Path) -> None:
    specs = [Spec("ids", "I64", (512, 1024)), Spec("weight", "F32", (512, 1024))]
    source = _source(on_xfs / "src", specs)
    run = cli("convert", source, "-o", on_xfs / "out", "--dtype", "bf16", "--json")
    assert run.code == 0, run.stderr
    written = run.json()["written"]
    cast = 512 * 1024 * 2
    assert written["verified_by"]["digest"] == cast
    _check_zero_copy(on_xfs / "out", written, [source], _block(on_xfs))
    assert written["zero_copy"]["copied"] >= cast


def test_no_verify_verifies_nothing(on_xfs: Path) -> None:
    source = _source(on_xfs / "src")
    run = cli("convert", source, "-o", on_xfs / "out", "--no-verify", "--json")
    assert run.code == 0, run.stderr
    written = run.json()["written"]
    assert written["verified"] is False
    assert written["verified_by"] == {"extents": 0, "compared": 0, "digest": 0}
    assert written["zero_copy"]["cloned"] > 0
    assert read_tensors(on_xfs / "out") == read_tensors(source)


def test_a_source_on_another_filesystem_is_copied_as_before(on_xfs: Path, tmp_path: Path) -> None:
    """EXDEV: nothing clones, nothing is padded, and the files are byte for byte what the
    same reshard writes on the source's own filesystem."""
    source = _source(tmp_path / "src")
    here = cli("reshard", source, "-o", tmp_path / "out", "--max-shard", "10MB", "--json")
    if here.json()["written"]["zero_copy"]["block"] is not None:
        pytest.skip("the temporary folder's filesystem has reflinks itself")
    there = cli("reshard", source, "-o", on_xfs / "out", "--max-shard", "10MB", "--json")
    assert there.code == 0, there.stderr
    written = there.json()["written"]
    assert written["zero_copy"] == {
        "block": None,
        "cloned": 0,
        "copied": sum(spec.nbytes() for spec in SPECS),
        "padding": 0,
    }
    assert written["verified_by"]["extents"] == 0
    for path in _shards(tmp_path / "out"):
        assert (on_xfs / "out" / path.name).read_bytes() == path.read_bytes()
        assert not any("shared" in e.flags for e in extents(on_xfs / "out" / path.name))


def test_transformers_loads_a_padded_reshard(on_xfs: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.builders import tiny_llama

    model = tiny_llama(hidden_size=256, intermediate_size=1024, vocab_size=2048)
    model.save_pretrained(on_xfs / "src")
    run = cli("reshard", on_xfs / "src", "-o", on_xfs / "out", "--max-shard", "2MB", "--json")
    assert run.code == 0, run.stderr
    written = run.json()["written"]
    assert written["zero_copy"]["cloned"] > 0 and written["zero_copy"]["padding"] > 0
    loaded = AutoModelForCausalLM.from_pretrained(on_xfs / "out").eval()
    tokens = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


def test_extent_identity_proves_only_shared_blocks(on_xfs: Path, tmp_path: Path) -> None:
    """The verification of cloned bytes: identical extents pass without reading; a block
    changed after the clone (copied on write) or bytes that were copied, not cloned, are
    compared instead, and a difference is found."""
    from ckptfix.io.source import LocalFile
    from ckptfix.plan.align import Run
    from ckptfix.platform.linux_ioctl import clone_range
    from ckptfix.write.extents import same_blocks
    from ckptfix.write.zerocopy import Cloning, RunCheck, Tally

    block = _block(on_xfs)
    source = on_xfs / "source"
    source.write_bytes(seeded_bytes(64 * block, "source"))
    target = on_xfs / "target"
    target.write_bytes(b"")
    with LocalFile(str(source)) as src, src.held() as src_fd, open(target, "r+b") as dst:
        data = source.read_bytes()
        os.truncate(dst.fileno(), 70 * block)
        # source [B + 100, 62 B + 50) at 4 B + 100: a copied head and tail, cloned blocks
        os.pwrite(dst.fileno(), data[block + 100 : 2 * block], 4 * block + 100)
        assert clone_range(src_fd, 2 * block, 60 * block, dst.fileno(), 5 * block)
        os.pwrite(dst.fileno(), data[62 * block : 62 * block + 50], 65 * block)
        run = Run("source", block + 100, 4 * block + 100, 61 * block - 50)
        tally = Tally()
        check = RunCheck(dst.fileno(), Cloning(block, frozenset({"source"})), tally)
        assert check.equal(src, run)
        assert (tally.extents, tally.compared) == (60 * block, block - 50)
        os.pwrite(dst.fileno(), b"\xff", 40 * block + 7)  # one byte, inside the cloned blocks
        os.fsync(dst.fileno())
        assert not same_blocks(src_fd, 2 * block, dst.fileno(), 5 * block, 60 * block)
        assert not check.equal(src, run)
        assert tally.extents == 60 * block  # the second check did not count extents
    copy = on_xfs / "copy"
    done = subprocess.run(["cp", "--reflink=never", source, copy], check=False)
    assert done.returncode == 0
    elsewhere = tmp_path / "elsewhere"
    shutil.copyfile(source, elsewhere)
    with open(source, "rb") as a, open(copy, "rb") as b, open(elsewhere, "rb") as c:
        length = 64 * block
        assert same_blocks(a.fileno(), 0, a.fileno(), 0, length)
        assert not same_blocks(a.fileno(), 0, b.fileno(), 0, length)  # equal bytes, not blocks
        assert not same_blocks(a.fileno(), 0, c.fileno(), 0, length)  # another filesystem


def test_write_shards_finds_out_for_itself(on_xfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that does not say whether sources clone (ShardJob.cloning None) gets zero-copy
    all the same: write_shards tries in its staging folder. Early verification and writeback
    (every VERIFY_EVERY and FLUSH_EVERY bytes, here 1 MiB) do not cut a cloned run, which
    would copy the block it is cut in: one shard of one source region copies only its two
    partial end blocks."""
    import ckptfix.write.safetensors
    from ckptfix.io.source import LocalFile
    from ckptfix.plan.select import OutTensor
    from ckptfix.plan.shards import plan_shards
    from ckptfix.write.safetensors import ShardJob, write_shards

    monkeypatch.setattr(ckptfix.write.safetensors, "FLUSH_EVERY", 2**20)
    monkeypatch.setattr(ckptfix.write.safetensors, "VERIFY_EVERY", 2**20)
    specs = [Spec(f"layers.{i}.weight", "F32", (1000, 1001 + i)) for i in range(6)]
    source = _source(on_xfs / "src", specs)
    tensors = {t.name: OutTensor.same(t) for t in read_header(source).tensors}
    plan = plan_shards([(name, t.nbytes) for name, t in tensors.items()], 50 * 10**6)
    assert len(plan.shards) == 1
    out = on_xfs / "staging"
    out.mkdir()
    with LocalFile(str(source)) as file:
        job = ShardJob(tensors, [{"format": "pt"}], {}, lambda _: file, str(out), str(out))
        write_shards(plan, job)
    block = _block(on_xfs)
    assert job.cloning is not None and job.cloning.block == block
    account = job.tally.account(job.cloning, plan.total_size)
    written = {
        "verified": True,
        "zero_copy": account.to_dict(),
        "verified_by": dict(account.verified_by),
    }
    _check_zero_copy(out, written, [source], block)
    assert account.copied < 2 * block
    assert read_tensors(out) == read_tensors(source)


def test_a_torch_bin_clones_its_largest_storage_per_shard(on_xfs: Path) -> None:
    """A .bin's storages sit at their own offsets in the zip: one per shard lines up (the
    largest), the rest is copied; the output is the same tensors either way."""
    import torch

    generator = torch.Generator().manual_seed(12)
    state = {
        "small.weight": torch.randn(3, 5, generator=generator).to(torch.bfloat16),
        "large.weight": torch.randn(1000, 1001, generator=generator),
        "other.weight": torch.randn(700, 300, generator=generator),
    }
    (on_xfs / "src").mkdir()
    torch.save(state, on_xfs / "src" / "pytorch_model.bin")
    run = cli("convert", on_xfs / "src", "-o", on_xfs / "out", "--json")
    assert run.code == 0, run.stderr
    written, block = run.json()["written"], _block(on_xfs)
    largest = state["large.weight"].numel() * 4
    assert written["zero_copy"]["cloned"] >= largest - 2 * block
    assert written["verified_by"]["extents"] >= largest - 3 * block
    assert written["verified"] is True
    loaded = load_safetensors_folder(on_xfs / "out")
    assert {k: torch_bytes(v) for k, v in loaded.items()} == {
        k: torch_bytes(v) for k, v in state.items()
    }


def test_files_carried_whole_share_their_blocks(place: Path) -> None:
    """The files around the weights (and the shards `fix` keeps as they are) are cloned whole
    where the filesystem allows it: write.extras, FICLONE."""
    factory = Factory(place)
    source = factory.safetensors("src/model.safetensors", SPECS[:3])
    tokenizer = factory.bytes("src/tokenizer.json", seeded_bytes(3 * 2**20 + 5, "tok"))
    run = cli("reshard", source.parent, "-o", place / "out", "--json")
    assert run.code == 0, run.stderr
    copied = place / "out" / "tokenizer.json"
    assert copied.read_bytes() == tokenizer.read_bytes()
    assert shared_bytes(copied) >= tokenizer.stat().st_size - _block(place)


@pytest.fixture(scope="module")
def ext4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with loop_mount("ext4", tmp_path_factory.mktemp("ext4")) as point:
        yield point


def test_ext4_has_no_reflinks_and_writes_as_before(ext4: Path) -> None:
    """Without reflinks on the output's own filesystem: no padding (every header is exactly
    its entries encoded), nothing shared, every byte compared, and the files are what the
    writer wrote before zero-copy existed."""
    source = _source(ext4 / "src")
    factory = Factory(ext4)
    factory.bytes("src/tokenizer.json", seeded_bytes(2**20, "tok"))
    run = cli("reshard", source.parent, "-o", ext4 / "out", "--max-shard", "10MB", "--json")
    assert run.code == 0, run.stderr
    written = run.json()["written"]
    total = sum(spec.nbytes() for spec in SPECS)
    assert written["zero_copy"] == {"block": None, "cloned": 0, "copied": total, "padding": 0}
    assert written["verified_by"] == {"extents": 0, "compared": total, "digest": 0}
    for path in [*_shards(ext4 / "out"), ext4 / "out" / "tokenizer.json"]:
        assert not any("shared" in e.flags for e in extents(path))
    for path in _shards(ext4 / "out"):
        assert read_header(path).data_start == _unpadded_size(path)
    assert read_tensors(ext4 / "out") == read_tensors(source)
    text = cli("reshard", source.parent, "-o", ext4 / "again", "--max-shard", "10MB").stdout
    assert "zero-copy" not in text and "identical extents" not in text


def test_extents_fiemap_cannot_vouch_for_are_compared(tmp_path: Path) -> None:
    """btrfs with compression: cloned extents are encoded (compressed), so their physical
    addresses prove nothing and every byte is compared instead, still cloned."""
    with loop_mount("btrfs", tmp_path, "compress-force=zstd") as point:
        specs = [
            Spec(f"w{i}", "F32", (512, 1000 + i), bytes(512 * (1000 + i) * 4)) for i in range(4)
        ]
        source = _source(point / "src", specs)
        run = cli("reshard", source, "-o", point / "out", "--max-shard", "5MB", "--json")
        assert run.code == 0, run.stderr
        written = run.json()["written"]
        total = sum(spec.nbytes() for spec in specs)
        assert any("encoded" in e.flags for e in extents(source))
        assert written["zero_copy"]["cloned"] > total // 2
        assert written["verified_by"] == {"extents": 0, "compared": total, "digest": 0}
        assert shared_bytes(_shards(point / "out")[0]) > 0
        assert read_tensors(point / "out") == read_tensors(source)


@pytest.mark.parametrize("mode", ["-o", "--in-place"])
def test_fix_adding_format_shares_the_tensor_bytes(place: Path, mode: str) -> None:
    """`fix` rewrites a header to add "format": the tensor bytes after it are cloned, not
    copied, and the JSON says how each byte was verified."""
    folder = place / "model"
    source = Factory(folder).safetensors("model.safetensors", SPECS, with_format=False)
    expected = read_tensors(source)
    kept = place / "kept.safetensors"  # the source's blocks, for _regions after --in-place
    os.link(source, kept)
    before = used_bytes(place)
    args = ["--in-place"] if mode == "--in-place" else ["-o", str(place / "out")]
    run = cli("fix", folder, *args, "--json")
    assert run.code == 0, run.stderr
    out = folder if mode == "--in-place" else place / "out"
    written = run.json()["written"]
    _check_zero_copy(out, written, [kept], _block(place))
    assert written["zero_copy"]["cloned"] > 0.9 * sum(spec.nbytes() for spec in SPECS)
    assert used_bytes(place) - before <= 4 * _block(place) + METADATA_ALLOWANCE
    assert read_header(out / "model.safetensors").metadata == {"format": "pt"}
    assert read_tensors(out) == expected
    assert cli("inspect", out, "--fail-on", "warning").code == 0
