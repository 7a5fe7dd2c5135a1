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
        assert "Traceback" not in run.stderr and "internal error" not in run.stderr
        if run.code != 0:
            assert run.code == 1 and len(run.error_lines) == 1, run.stderr
            assert run.error_lines[0].startswith("error: ")
            assert not out.exists()
            continue
        _check_output(path, out, form)
    assert not list(root.glob(".ckptfix-*"))


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


# --- a server's answers, randomly mutated ---------------------------------------------------

REMOTE_TIMEOUT = 2.0  # CKPTFIX_REMOTE_TIMEOUT: no run may take more than 10 of them, and 10 s
REMOTE_COMMANDS = ["inspect", "hash", "convert"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Served]]:
    """The same model served by each backend's test server, for the whole module; requests
    one at a time, so the answers of a run come in the same order every time."""
    for package in ("aiohttp", "gcsfs", "botocore", "huggingface_hub"):
        pytest.importorskip(package, reason="the remote extra is not installed")
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
