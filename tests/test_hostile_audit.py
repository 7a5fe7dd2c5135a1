"""Holes found by the audit of issue 8 after its first round: each test builds the hostile
input and asserts the promise (a correct result, or exit 1 and one error line naming the
file and the rule; nothing read that the user did not name; never a hang)."""

from __future__ import annotations

import json
import os
import re
import struct
import threading
from pathlib import Path

import pytest

from ckptfix.core.errors import CorruptFileError
from ckptfix.core.tensor import TensorInfo
from ckptfix.io.folder import LOCAL
from ckptfix.plan.select import OutTensor
from ckptfix.platform import system
from tests.builders import Emit, Factory, Spec, zip_checkpoint
from tests.helpers import cli, tensor_names


@pytest.fixture
def model(factory: Factory) -> Path:
    folder = factory.sharded("m", [[Spec("a")], [Spec("b")]])
    factory.config("m")
    return folder


# An empty view may point anywhere -------------------------------------------------------------


def _empty_view_past_the_end(factory: Factory) -> Path:
    """A scalar, and an empty (0, 5) view whose offset lies far past the end of the file:
    torch.save writes such views, and nothing of them is ever read."""
    emit = Emit().empty_dict().string("s").tensor("0", "FloatStorage", 6, 5, [], []).op(b"s")
    emit.string("z").tensor("0", "FloatStorage", 6, 2**40, [0, 5], [5, 1]).op(b"s")
    return zip_checkpoint(
        factory.path("empty.pt"), emit.stop(), {"0": struct.pack("<6f", *range(6))}
    )


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_an_empty_view_past_the_end_is_written(factory: Factory, to: str) -> None:
    """It was refused as "file ended early: it changed during the run" (a zero-length copy
    checked the file's size against its offset)."""
    from safetensors.numpy import load_file

    out = factory.root / "out"
    run = cli("convert", _empty_view_past_the_end(factory), "-o", out, "--to", to)
    assert run.code == 0, run.stderr
    if to == "safetensors":
        loaded = load_file(out / "model.safetensors")
        assert loaded["s"].shape == () and loaded["s"].tobytes() == struct.pack("<f", 5)
        assert loaded["z"].shape == (0, 5)
    else:
        assert cli("inspect", out / "pytorch_model.bin").code == 0


# Names that are not Unicode text --------------------------------------------------------------


def test_a_name_that_is_not_unicode_is_refused_before_writing() -> None:
    """The writers' own guard (every reader refuses such names first; see tests/attacks.py):
    a safetensors header or a JSON index cannot hold a lone surrogate."""
    from ckptfix.write.output import check_names

    source = TensorInfo("\ud800", "F32", (1,), 4, "in.pt", (0, 4))
    with pytest.raises(CorruptFileError) as caught:
        check_names([OutTensor("ok", source, "F32"), OutTensor("\ud800", source, "F32")])
    assert caught.value.rule == "bad-tensor-name" and caught.value.path == "in.pt"


def test_an_alias_record_that_is_not_unicode_is_refused(factory: Factory) -> None:
    """`hash --json` printed an internal error (orjson cannot write a lone surrogate)."""
    record = json.dumps({"\ud800": "a"})  # ASCII: the surrogate is a \u escape
    path = factory.safetensors("m.safetensors", [Spec("a")], {"ckptfix.dropped": record})
    run = cli("hash", path, "--json")
    assert run.code == 1
    assert run.error_lines == [
        f"error: {path}: the ckptfix.dropped record is not an object of names (rule "
        "alias-record; pass --no-alias-record to ignore it)"
    ]


# Links and special files in the folder --------------------------------------------------------


def test_a_loop_of_links_in_the_folder(model: Path, tmp_path: Path) -> None:
    """Listing the folder raised ELOOP: `internal error` from every command."""
    os.symlink("loop2", model / "loop1")
    os.symlink("loop1", model / "loop2")
    os.symlink("model.safetensors", model / "self.safetensors.link")
    assert cli("inspect", model).code == 0
    assert cli("hash", model).code == 0
    out = tmp_path / "out"
    run = cli("reshard", model, "-o", out)
    assert run.code == 0, run.stderr
    assert os.readlink(out / "loop1") == "loop2" and os.readlink(out / "loop2") == "loop1"
    assert tensor_names(out) == ["a", "b"]


def test_a_link_to_a_file_outside_the_folder_is_not_read(model: Path, tmp_path: Path) -> None:
    """A downloaded folder may link `tokenizer.json` to ~/.ssh/id_rsa: -o copied the key into
    the output (to be uploaded with it). Only a Hugging Face cache snapshot's links into its
    blobs are copied as files (test_output_safety.test_hub_cache_snapshot_links_...)."""
    secret = tmp_path / "home" / ".ssh" / "id_rsa"
    secret.parent.mkdir(parents=True)
    secret.write_bytes(b"PRIVATE KEY")
    os.symlink(secret, model / "tokenizer.json")
    (model / "sub").mkdir()
    os.symlink("../../home/.ssh/id_rsa", model / "sub" / "vocab.txt")
    out = tmp_path / "out"
    run = cli("convert", model, "-o", out)
    assert run.code == 0, run.stderr
    assert os.readlink(out / "tokenizer.json") == str(secret)
    assert os.readlink(out / "sub" / "vocab.txt") == "../../home/.ssh/id_rsa"
    for folder, _, files in os.walk(out):
        for name in files:
            path = Path(folder) / name
            assert path.is_symlink() or b"PRIVATE KEY" not in path.read_bytes()


@pytest.mark.parametrize("opened", ["side file", "weight file"])
def test_a_fifo_in_place_of_a_file_is_not_waited_for(tmp_path: Path, opened: str) -> None:
    """A FIFO swapped in after the listing (or the check of a named path): opening it for
    reading blocked until a writer came, for ever."""
    from ckptfix.io.source import LocalFile

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    result: list[BaseException] = []

    def read() -> None:
        try:
            if opened == "side file":
                LOCAL.read_small(str(fifo), str(fifo), 2**20, "config")
            else:
                LocalFile(str(fifo)).read_at(0, 8)
        except CorruptFileError as exc:
            result.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock the thread, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a FIFO blocked")
    assert len(result) == 1 and result[0].rule == "unreadable"


def test_a_config_too_large_says_what_to_do_with_a_config(model: Path) -> None:
    with open(model / "config.json", "wb") as handle:
        handle.truncate(2**25)  # sparse: 32 MiB of nothing
    run = cli("inspect", model)
    assert run.code == 1
    assert run.error_lines == [
        f"error: {model / 'config.json'}: config is {2**25} bytes, over the 16777216 limit "
        "(rule config-too-large; check that config.json is the model's own; save it again "
        "with the model)"
    ]


def test_output_that_is_a_loop_of_links(model: Path, tmp_path: Path) -> None:
    """It said that another program had created OUT during the run."""
    os.symlink(tmp_path / "l2", tmp_path / "l1")
    os.symlink(tmp_path / "l1", tmp_path / "l2")
    run = cli("reshard", model, "-o", tmp_path / "l1")
    assert run.code == 2
    assert run.error_lines == [
        f"error: {tmp_path / 'l1'}: output is a link that cannot be followed (a loop of links) "
        "(rule usage; choose another -o)"
    ]
    assert os.readlink(tmp_path / "l1") == str(tmp_path / "l2")


# hash --manifest OUT -------------------------------------------------------------------------


def test_a_manifest_never_replaces_the_checkpoint(model: Path, factory: Factory) -> None:
    """`hash model.safetensors --manifest model.safetensors` replaced the model with its own
    manifest, exit 0."""
    single = factory.safetensors("single.safetensors", [Spec("w")])
    data = single.read_bytes()
    run = cli("hash", single, "--manifest", single)
    assert run.code == 2
    assert run.error_lines == [
        f"error: {single}: is a file of the input {single}; the manifest would replace it "
        "(rule usage; write the manifest to a new file, or outside the checkpoint)"
    ]
    assert single.read_bytes() == data
    config = (model / "config.json").read_bytes()
    run = cli("hash", model, "--manifest", model / "config.json")
    assert run.code == 2 and "the manifest would replace it" in run.error_lines[0]
    assert (model / "config.json").read_bytes() == config
    fresh = model / "model.manifest.json"  # a new file beside the weights is fine
    assert cli("hash", model, "--manifest", fresh).code == 0
    assert json.loads(fresh.read_text())["tensor_count"] == 2


def test_a_manifest_names_the_file_it_replaces(model: Path, tmp_path: Path) -> None:
    target = tmp_path / "notes.json"
    run = cli("hash", model, "--manifest", target)
    assert run.code == 0 and run.stdout.rstrip().endswith(f"manifest written to {target}")
    run = cli("hash", model, "--manifest", target)
    assert run.code == 0
    assert run.stdout.rstrip().endswith(
        f"manifest written to {target} (it replaced the file of that name)"
    )
    run = cli("hash", model, "--manifest", target, "--json")  # the JSON says so too
    assert run.code == 0
    assert run.json()["manifest"] == {"path": str(target), "replaced": True}
    assert "manifest" not in json.loads(target.read_text())  # the manifest is the model's
    fresh = tmp_path / "fresh.json"
    assert cli("hash", model, "--manifest", fresh, "--json").json()["manifest"] == {
        "path": str(fresh),
        "replaced": False,
    }


# gather: whatever a descriptor says ------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "strides"),
    [((4,), (1,)), ((2, 2), (-1, 1)), ((3,), (-2,)), ((2, 3), (3, 1))],
    ids=["longer", "negative", "negative-1d", "rows-past-the-end"],
)
def test_gather_never_reads_outside_the_span(
    tmp_path: Path, shape: tuple[int, ...], strides: tuple[int, ...]
) -> None:
    """A descriptor that bypassed the readers' checks (negative strides, a shape past the
    span read for it): gather recomputes the element range and refuses, reading nothing."""
    from ckptfix.io.gather import tensor_bytes
    from ckptfix.io.source import LocalFile

    path = tmp_path / "data"
    path.write_bytes(bytes(range(8)) + b"SECRET!!" * 4)
    numel = 1
    for dim in shape:
        numel *= dim
    view = TensorInfo("t", "F32", shape, 4 * numel, str(path), (4, 8), False, "0", strides)
    with LocalFile(str(path)) as source, pytest.raises(CorruptFileError) as caught:
        tensor_bytes(source, view)
    assert caught.value.rule == "view-out-of-bounds"


@pytest.mark.slow
def test_a_million_tensors_in_one_header(tmp_path: Path) -> None:
    """Issue 8: 1,000,000 tensors in one header took 18 s and 1.4 GiB to inspect. Now about
    6 s and 0.95 GiB on 2 cores (an 84 MB header): bounded well under the old figures."""
    from tests.helpers import measured

    count = 1_000_000
    header = {
        f"model.layers.{i}.w": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
        for i in range(count)
    }
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    path = tmp_path / "million.safetensors"
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(body)) + body + bytes(4 * count))
    run = measured("inspect", path, timeout=120)
    assert run.code == 0, run.stderr
    assert re.search(r"^Tensors +1,000,000 *$", run.stdout, re.MULTILINE), run.stdout
    assert run.peak_rss < 1300 * 2**20, run.peak_rss
    # A bound against a walk that grows faster than the header (hours at this size), not a
    # speed target: that is the bench's. 20 s failed beside another test on a loaded machine.
    assert run.seconds < 60, run.seconds


def test_a_pipeline_component_outside_the_pipeline_is_not_read(factory: Factory) -> None:
    """model_index.json naming ".." made inspect and hash read the weights of the folder
    above the pipeline, which the user never named."""
    factory.safetensors("outside.safetensors", [Spec("secret")])
    factory.safetensors("pipe/unet/diffusion_pytorch_model.safetensors", [Spec("u")])
    components = {"_class_name": "P", "unet": ["diffusers", "U"], "..": ["diffusers", "E"]}
    factory.bytes("pipe/model_index.json", json.dumps({**components, ".": ["x", "S"]}).encode())
    run = cli("inspect", factory.root / "pipe", "--json")
    assert run.code == 0, run.stderr
    assert [tensor["name"] for tensor in run.json()["tensors"]] == ["u"]


def test_a_folder_inside_a_cache_snapshot_copies_its_blobs(
    factory: Factory, tmp_path: Path
) -> None:
    """A pipeline component of a cached snapshot (`snapshots/<rev>/unet`): its links into
    ../../../blobs are still the files a loader reads, and are copied."""
    built = factory.safetensors("built/diffusion_pytorch_model.safetensors", [Spec("u")])
    cache = tmp_path / "models--org--pipe"
    (cache / "blobs").mkdir(parents=True)
    unet = cache / "snapshots" / "abc123" / "unet"
    unet.mkdir(parents=True)
    for number, (name, data) in enumerate(
        [(built.name, built.read_bytes()), ("config.json", b'{"sample_size": 64}')]
    ):
        (cache / "blobs" / f"blob{number}").write_bytes(data)
        os.symlink(f"../../../blobs/blob{number}", unet / name)
    out = tmp_path / "out"
    run = cli("reshard", unet, "-o", out)
    assert run.code == 0, run.stderr
    config = out / "config.json"
    assert not config.is_symlink() and config.read_bytes() == b'{"sample_size": 64}'


def test_a_folder_swapped_for_a_link_during_the_copy_is_not_followed(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Extra files were copied by path: a sub-folder replaced by a link to ~/.ssh after it
    was listed (someone else writing in the folder) had the secret copied into OUT. They are
    now read through the descriptors of the folders that were listed."""
    from ckptfix.write import extras

    secret = tmp_path / "home" / ".ssh"
    secret.mkdir(parents=True)
    (secret / "a.txt").write_bytes(b"PRIVATE KEY")
    (model / "sub").mkdir()
    (model / "sub" / "a.txt").write_bytes(b"notes")
    real_copy = extras._copy_file

    def swap_then_copy(entry: object, target: str) -> int:
        if str(getattr(entry, "shown", entry)).endswith(os.path.join("sub", "a.txt")):
            os.rename(model / "sub", model / "sub.moved")
            os.symlink(secret, model / "sub")
        return real_copy(entry, target)  # type: ignore[arg-type]

    monkeypatch.setattr(extras, "_copy_file", swap_then_copy)
    out = tmp_path / "out"
    run = cli("reshard", model, "-o", out)
    if system().name == "portable":  # no folder descriptors: the swap is seen and refused
        assert run.error_lines == [
            f"error: {model / 'sub'}: write failed: was replaced while it was being opened "
            "(rule write-failed; check the disk and run again)"
        ]
        assert not out.exists()
        return
    assert run.code == 0, run.stderr
    assert (out / "sub" / "a.txt").read_bytes() == b"notes"
