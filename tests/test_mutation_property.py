"""The security promise as a property: for random valid checkpoints and a random single-byte
or single-opcode mutation, every command either succeeds with output bitwise equal to the
input's tensors, or fails with exit 1 and one error line; always within time and memory
bounds proportional to the input's size. The same for a checkpoint read from a server (each
backend's test server) one of whose answers is randomly mutated: its status, a header, its
body's bytes or length, a value of its listing's JSON or XML.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickletools
import time
import tracemalloc
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.answer_mutations import Mutation, mutations
from tests.helpers import cli, read_tensors, torch_bytes
from tests.optional import need
from tests.remote_servers import BACKENDS, Served, served_model, serving

EXAMPLES = max(int(os.environ.get("CKPTFIX_FUZZ_EXAMPLES", "300")) // 5, 40)
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
DTYPES = ["float32", "float16", "bfloat16", "int64", "uint8", "bool"]
MB = 2**20


@st.composite
def state_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """1-4 tensors, some of them views (transposed, sliced rows) or aliases of another."""
    import torch

    state: dict[str, Any] = {}
    for index in range(draw(st.integers(1, 4))):
        dtype = getattr(torch, draw(st.sampled_from(DTYPES)))
        shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
        values = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float64) * (index + 1)
        tensor = values.reshape(shape).to(dtype)
        kind = draw(st.sampled_from(["plain", "view", "alias"]))
        if kind == "view" and tensor.dim() >= 2:
            tensor = tensor.transpose(0, 1) if draw(st.booleans()) else tensor[1:]
        if kind == "alias" and state:
            tensor = state[draw(st.sampled_from(sorted(state)))]
        state[f"layer.{index}.weight"] = tensor
    return state


def _save(state: dict[str, Any], form: str) -> bytes:
    import torch

    buffer = io.BytesIO()
    if form == "safetensors":
        from safetensors.torch import save

        unique = {name: tensor.contiguous().clone() for name, tensor in state.items()}
        return save(unique, metadata={"format": "pt"})
    torch.save(state, buffer, _use_new_zipfile_serialization=form == "zip")
    return buffer.getvalue()


def _mutate_pickle_in_zip(data: bytes, draw: st.DrawFn) -> bytes:
    """One opcode of data.pkl replaced or removed, and the zip rebuilt (CRC recomputed) so the
    mutation reaches the unpickler."""
    source = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for info in source.infolist():
            blob = source.read(info)
            if info.filename.endswith("data.pkl"):
                blob = _mutate_opcode(blob, draw)
            archive.writestr(info, blob)
    return out.getvalue()


def _mutate_opcode(blob: bytes, draw: st.DrawFn) -> bytes:
    positions = [position for _, _, position in pickletools.genops(blob)]
    at = draw(st.sampled_from(positions))
    replacement = draw(st.sampled_from([b"", b"b", b"s", b"a", b"0", b"2", b"\x85", b"N", b"R"]))
    return blob[:at] + replacement + blob[at + 1 :]


@st.composite
def mutated_inputs(draw: st.DrawFn) -> tuple[str, bytes, bool]:
    form = draw(st.sampled_from(["zip", "legacy", "safetensors"]))
    data = bytearray(_save(draw(state_dicts()), form))
    kind = draw(st.sampled_from(["none", "byte", "opcode"] if form == "zip" else ["none", "byte"]))
    if kind == "byte":
        at = draw(st.integers(0, len(data) - 1))
        data[at] = draw(st.integers(0, 255))
    elif kind == "opcode":
        data = bytearray(_mutate_pickle_in_zip(bytes(data), draw))
    return form, bytes(data), kind != "none"


def _torch_view(path: Path) -> dict[str, tuple[tuple[int, ...], bytes]] | None:
    """What torch itself loads (weights_only), or None when torch refuses the file."""
    import warnings

    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # old pickle protocols after a mutation
            state = torch.load(path, weights_only=True)
    except Exception:
        return None
    if not isinstance(state, dict):
        return None
    return {
        str(name): (tuple(value.shape), torch_bytes(value))
        for name, value in state.items()
        if isinstance(value, torch.Tensor)
    }


def _bounded_run(*args: str | Path, size: int, seconds: float = 10) -> tuple[Any, float, int]:
    tracemalloc.start()
    start = time.perf_counter()
    try:
        run = cli(*args)
    finally:
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert elapsed <= seconds + size / MB, (args, elapsed)
    assert peak <= 64 * MB + 64 * size, (args, peak)
    return run, elapsed, peak


@pytest.mark.slow
@PROPERTY
@given(mutated_inputs())
def test_every_command_succeeds_exactly_or_fails_cleanly(
    tmp_path_factory: pytest.TempPathFactory, case: tuple[str, bytes, bool]
) -> None:
    form, data, _ = case
    root = tmp_path_factory.mktemp("mutated")
    path = root / ("model.safetensors" if form == "safetensors" else "model.bin")
    path.write_bytes(data)
    commands = [["convert"], ["convert", "--to", "torch"], ["dedupe"]]
    commands += [["reshard"]] if form == "safetensors" else []
    for reader in (["inspect", path], ["hash", path], ["diff", path, path]):
        run, _, _ = _bounded_run(*reader, size=len(data))
        assert run.code in (0, 1), (reader, run.stderr)
        assert "Traceback" not in run.stderr and "internal error" not in run.stderr
        if run.code == 1 and reader[0] != "inspect":  # the same file: never "different"
            assert len(run.error_lines) == 1, run.stderr
        assert all(line.startswith("error: ") for line in run.error_lines), run.stderr
    for command in commands:
        out = root / f"out-{'-'.join(command)}"
        run, _, _ = _bounded_run(*command, path, "-o", out, "--max-shard", "64", size=len(data))
        if _wrote(run, out):
            _check_output(path, out, form)
    assert not list(root.glob(".ckptfix-*"))


def _wrote(run: Any, out: Path) -> bool:
    """A write command either wrote OUT, or failed cleanly with one line and nothing written."""
    assert "Traceback" not in run.stderr and "internal error" not in run.stderr
    if run.code == 0:
        return True
    assert run.code == 1 and len(run.error_lines) == 1, run.stderr
    assert run.error_lines[0].startswith("error: ")
    assert not out.exists()
    return False


def _check_output(source: Path, out: Path, form: str) -> None:
    """Every tensor written equals the source's, bitwise, as ckptfix read it and, for torch
    files that torch itself loads, as torch read it."""
    written = read_tensors(out)
    read = read_tensors(source)
    for name, value in written.items():
        assert value == read[name], name
    expected = _torch_view(source) if form != "safetensors" else None
    if expected is not None:
        for name, (_, shape, raw) in written.items():
            assert expected[name] == (shape, raw), name


# --- GGUF ------------------------------------------------------------------------------------

GGML_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_K", "Q6_K"]
INTERESTING = [0, 1, 2, 31, 32, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1]


@st.composite
def gguf_files(draw: st.DrawFn) -> bytes:
    """1-4 tensors of random ggml types and shapes (whole blocks), written by gguf-py."""
    import tempfile

    from tests.gguf_files import Tensor, write_gguf

    tensors = []
    for index in range(draw(st.integers(1, 4))):
        ggml = draw(st.sampled_from(GGML_TYPES))
        row = 256 * draw(st.integers(1, 2)) if ggml[0] == "Q" else draw(st.integers(1, 64))
        shape = (draw(st.integers(1, 3)), row) if draw(st.booleans()) else (row,)
        tensors.append(Tensor(f"blk.{index}.weight", ggml, shape))
    arch = draw(st.sampled_from(["llama", "qwen2", "gemma3"]))
    with tempfile.TemporaryDirectory() as folder:
        return write_gguf(Path(folder) / "m.gguf", arch, tensors).read_bytes()


def gguf_fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of every count, length, type, dimension and offset field of a valid
    GGUF file, found with ckptfix's reader (spans) and the format's layout."""
    import struct as structs

    from ckptfix.formats.gguf_file import read_gguf

    class _Bytes:
        label, size = "m.gguf", len(data)

        def read_at(self, offset: int, size: int) -> bytes:
            return data[offset : offset + size]

    read = read_gguf(_Bytes())  # type: ignore[arg-type]
    fields = [(4, 4), (8, 8), (16, 8)]
    for key in read.keys:
        at = key.span[0]
        length = structs.unpack_from("<Q", data, at)[0]
        fields += [(at, 8), (at + 8 + length, 4)]
        value = at + 8 + length + 4
        if key.type == "ARRAY":
            fields += [(value, 4), (value + 4, 8)]
        elif key.type == "STRING":
            fields.append((value, 8))
    at = read.keys_end
    for tensor in read.tensors:
        name = len(tensor.name.encode())
        fields += [(at, 8), (at + 8 + name, 4)]
        dims = at + 8 + name + 4
        fields += [(dims + 8 * i, 8) for i in range(len(tensor.shape))]
        tail = dims + 8 * len(tensor.shape)
        fields += [(tail, 4), (tail + 4, 8)]
        at = tail + 12
    return fields


@st.composite
def mutated_gguf(draw: st.DrawFn) -> tuple[bytes, str]:
    """(bytes, kind): a valid file with a random byte changed, or a random header field set
    to a random or boundary value, or nothing."""
    original = draw(gguf_files())
    data = bytearray(original)
    kind = draw(st.sampled_from(["none", "byte", "field", "field"]))
    if kind == "byte":
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    elif kind == "field":
        at, width = draw(st.sampled_from(gguf_fields(original)))
        value = draw(st.sampled_from(INTERESTING) | st.integers(0, 2 ** (8 * width) - 1))
        data[at : at + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
    return bytes(data), kind


MEGATRON_FILES = ["metadata.json", "common.pt", ".metadata", "__0_0.distcp"]


@st.composite
def mutated_megatron(draw: st.DrawFn) -> tuple[str, bytes]:
    """One file of the tiny Megatron-Core folder with one byte changed, or (its pickles) one
    opcode changed."""
    from tests.megatron_builders import SAVED

    name = draw(st.sampled_from(MEGATRON_FILES))
    data = (SAVED / name).read_bytes()
    if name == ".metadata" and draw(st.booleans()):
        return name, _mutate_opcode(data, draw)
    if name == "common.pt" and draw(st.booleans()):
        return name, _mutate_pickle_in_zip(data, draw)
    mutated = bytearray(data)
    mutated[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return name, bytes(mutated)


def _consistent(folder: Path, out: Path, *options: str | Path) -> None:
    """What was written is what ckptfix reads from the (mutated) folder, tensor for tensor."""
    run = cli("diff", folder, out, *options)
    assert run.code == 0, run.stdout + run.stderr


# --- a server's answers, randomly mutated ---------------------------------------------------

REMOTE_TIMEOUT = 2.0  # CKPTFIX_REMOTE_TIMEOUT: no run may take more than 10 of them, and 10 s
REMOTE_COMMANDS = ["inspect", "hash", "convert"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Served]]:
    """The same model served by each backend's test server, for the whole module; requests
    one at a time, so the answers of a run come in the same order every time."""
    need("aiohttp", "gcsfs", "botocore", "huggingface_hub")
    with pytest.MonkeyPatch.context() as env, contextlib.ExitStack() as stack:
        env.setenv("CKPTFIX_REMOTE_TIMEOUT", str(REMOTE_TIMEOUT))
        env.setenv("CKPTFIX_REMOTE_RETRIES", "1")
        env.setenv("CKPTFIX_REMOTE_BACKOFF", "0.01")
        env.setenv("CKPTFIX_REMOTE_CONCURRENCY", "1")
        found = {}
        for backend in BACKENDS:
            root = tmp_path_factory.mktemp(f"served-{backend}")
            found[backend] = stack.enter_context(serving(backend, root, served_model(root), env))
        yield found


def _remote_args(command: str, url: str, out: Path) -> list[str | Path]:
    return [command, url, "--json"] + (["-o", out] if command == "convert" else [])


_good: dict[tuple[str, str], tuple[int, Any]] = {}


def _good_run(served: Served, command: str, out: Path) -> tuple[int, Any]:
    """How many answers a run of `command` gets from the well-behaved server, and what it
    gives: the digest (hash), the tensors written (convert)."""
    key = (served.backend, command)
    if key not in _good:
        behaviour = served.server.behaviour
        behaviour.reset()
        behaviour.mutation = lambda answer: answer  # counts the answers, changes none
        run = cli(*_remote_args(command, served.url, out))
        assert run.code == 0, run.stderr
        _good[key] = (behaviour.answers, _outcome(command, run, out))
        behaviour.reset()
    return _good[key]


def _outcome(command: str, run: Any, out: Path) -> Any:
    if command == "hash":
        return run.json()["digest"]
    return read_tensors(out) if command == "convert" else None


@pytest.mark.slow
@PROPERTY
@given(mutated_gguf())
def test_every_command_reads_a_mutated_gguf_exactly_or_fails_cleanly(
    tmp_path_factory: pytest.TempPathFactory, case: tuple[bytes, str]
) -> None:
    data, kind = case
    root = tmp_path_factory.mktemp("gguf")
    path = root / "m.gguf"
    path.write_bytes(data)
    for reader in (["inspect", path], ["hash", path], ["diff", path, path]):
        run, _, _ = _bounded_run(*reader, size=len(data))
        assert run.code in (0, 1), (reader, run.stderr)
        assert "Traceback" not in run.stderr and "internal error" not in run.stderr
        assert all(line.startswith("error: ") for line in run.error_lines), run.stderr
        if kind == "none":
            assert run.code == 0, run.stderr
    for command in (
        ["reshard", "--max-shard", "600"],
        ["reshard", "--max-shard", "1GB"],
        ["convert", "--dequantize", "fp32"],
    ):
        out = root / f"out-{'-'.join(command)}"
        run, _, _ = _bounded_run(command[0], path, "-o", out, *command[1:], size=len(data))
        assert "Traceback" not in run.stderr and "internal error" not in run.stderr
        if run.code != 0:
            assert run.code == 1 and len(run.error_lines) == 1, run.stderr
            assert run.error_lines[0].startswith("error: ") and not out.exists()
            continue
        _check_gguf_output(path, out, command[0])
    assert not list(root.glob(".ckptfix-*"))


def _check_gguf_output(source: Path, out: Path, command: str) -> None:
    """A rewrite that succeeded holds exactly the source's tensors (the GGUF parts read by
    gguf-py as well); a conversion, exactly its unquantized ones."""
    from ckptfix.core.dtypes import DTYPES
    from tests.gguf_files import gguf_py_tensors

    read = read_tensors(source, (".gguf",))
    if command == "reshard":
        written = read_tensors(out, (".gguf",))
        assert written == read
        from_parts = {}
        for part in sorted(out.glob("*.gguf")):
            from_parts.update(gguf_py_tensors(part))
        assert from_parts == written
        return
    converted = read_tensors(out)
    assert set(converted) == set(read)
    for name, (dtype, shape, data) in read.items():
        if not DTYPES[dtype].quantized:
            assert converted[name] == (dtype, shape, data), name


@pytest.mark.slow
@PROPERTY
@given(mutated_megatron())
def test_a_mutated_megatron_folder_converts_exactly_or_fails_cleanly(
    tmp_path_factory: pytest.TempPathFactory, case: tuple[str, bytes]
) -> None:
    from tests.megatron_builders import config_file, tiny_megatron

    name, data = case
    root = tmp_path_factory.mktemp("megatron")
    folder = tiny_megatron(root / "ckpt")
    (folder / name).write_bytes(data)
    config = config_file(root / "base")
    size = sum(path.stat().st_size for path in folder.iterdir())
    for reader in (["inspect", folder], ["hash", folder], ["diff", folder, folder]):
        run, _, _ = _bounded_run(*reader, size=size)
        assert run.code in (0, 1), (reader, run.stderr)
        assert "Traceback" not in run.stderr and "internal error" not in run.stderr
        assert all(line.startswith("error: ") for line in run.error_lines), run.stderr
    for options in ([], ["--to-hf", config]):
        out = root / f"out{len(options)}"
        run, _, _ = _bounded_run("convert", folder, "-o", out, *options, size=size)
        if _wrote(run, out):
            _consistent(folder, out, *options)
    assert not list(root.glob(".ckptfix-*"))


@pytest.mark.slow
@PROPERTY
@given(
    backend=st.sampled_from(BACKENDS),
    command=st.sampled_from(REMOTE_COMMANDS),
    mutation=mutations(),
)
def test_every_command_on_a_mutated_answer_succeeds_exactly_or_fails_cleanly(
    servers: dict[str, Served],
    tmp_path_factory: pytest.TempPathFactory,
    backend: str,
    command: str,
    mutation: Mutation,
) -> None:
    served = servers[backend]
    answers, want = _good_run(served, command, tmp_path_factory.mktemp("good") / "out")
    behaviour = served.server.behaviour
    behaviour.mutation, behaviour.mutate_at = mutation, mutation.at % answers
    out = tmp_path_factory.mktemp("mutated") / "out"
    try:
        args = _remote_args(command, served.url, out)
        run, _, _ = _bounded_run(*args, size=0, seconds=10 * REMOTE_TIMEOUT + 10)
    finally:
        behaviour.reset()
    assert mutation.applied, (backend, command, answers, mutation, run.stderr)  # it was sent
    assert run.code in (0, 1), (mutation, run.stderr)
    assert "Traceback" not in run.stderr and "internal error" not in run.stderr, run.stderr
    assert all(line.startswith("error: ") for line in run.error_lines), run.stderr
    if run.code == 1 and command != "inspect":
        assert len(run.error_lines) == 1, run.stderr
        assert not out.exists()
        assert not list(out.parent.glob(".ckptfix-*"))
    # A file's bytes changed in flight cannot be told from the file's own (there is nothing
    # to compare them with); any other change fails, or changes nothing the command gives.
    if run.code == 0 and not mutation.changed_file_bytes:
        assert _outcome(command, run, out) == want, mutation
