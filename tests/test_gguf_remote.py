"""GGUF over HTTP by ranged reads (the test server of tests/remote_servers.py, counting the
bytes it sends): inspect fetches the metadata and tensor infos plus at most 128 KiB,
whatever the size of the file; a split set is read from its first part's URL; the report
and the digest are the local copy's."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gguf_files import Info, RawGguf, gstr, kv, write_gguf
from tests.helpers import cli, read_weights
from tests.optional import needs
from tests.remote_servers import HttpServer, http_server

pytestmark = needs("aiohttp")

BOUND = 128 * 2**10


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HttpServer]:
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "1")
    with http_server(tmp_path) as served:
        yield served


def _large(path: Path, tokens: int, data: int) -> Path:
    """A GGUF with a tokenizer of `tokens` strings and one F16 tensor of `data` bytes, all
    but its last bytes a hole (sparse)."""
    strings = b"".join(gstr(f"token-{i}") for i in range(tokens))
    keys = [
        kv("general.architecture", 8, gstr("llama")),
        kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, tokens) + strings),
        kv("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, tokens) + bytes(4 * tokens)),
    ]
    rows = data // 2 // 4096
    raw = RawGguf(keys=keys, infos=[Info("token_embd.weight", [4096, rows], 1, 0)], data=b"")
    raw.write(path)
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size + rows * 4096 * 2 - 64)
        handle.seek(0, 2)
        handle.write(bytes(range(64)))  # the tail holds data: no zero-filled finding
    return path


@pytest.mark.parametrize("size", [64 * 2**20, 4 * 2**30])
def test_inspect_fetches_the_header_and_at_most_128_kib(
    server: HttpServer, tmp_path: Path, size: int
) -> None:
    path = _large(tmp_path / f"big-{size}.gguf", 20_000, size)
    read = read_weights(path)
    header = read.data_start
    assert header > 300_000  # the metadata alone spans several 64 KiB blocks
    local = cli("inspect", path, "--json")
    server.behaviour.reset()
    run = cli("inspect", f"{server.url}/{path.name}", "--json")
    assert run.code == local.code == 0, run.stderr
    fetched = run.json()["remote"]["bytes_fetched"]
    assert server.behaviour.bytes_sent == fetched
    assert header <= fetched <= header + BOUND, (header, fetched)
    url = f"{server.url}/{path.name}"
    expected = json.loads(json.dumps(local.json()).replace(str(path), url))
    assert run.json()["tensors"] == expected["tensors"]
    assert run.json()["findings"] == expected["findings"]


def test_a_split_set_from_its_first_parts_url(server: HttpServer, tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", split_max_tensors=4)
    first = tmp_path / "m-00001-of-00003.gguf"
    local = cli("inspect", first, "--json")
    run = cli("inspect", f"{server.url}/{first.name}", "--json")
    assert run.code == local.code == 0, run.stderr
    assert run.json()["format"] == "gguf-split"
    assert [f["path"] for f in run.json()["files"]] == [
        f"{server.url}/m-{i:05d}-of-00003.gguf" for i in (1, 2, 3)
    ]
    assert run.json()["tensor_count"] == local.json()["tensor_count"]
    digests = [
        cli("hash", path, "--json").json()["digest"]
        for path in (first, f"{server.url}/{first.name}")
    ]
    assert digests[0] == digests[1]


def test_a_missing_part_over_http(server: HttpServer, tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", split_max_tensors=4)
    (tmp_path / "m-00003-of-00003.gguf").unlink()
    url = f"{server.url}/m-00001-of-00003.gguf"
    run = cli("inspect", url)
    assert run.code == 1
    assert run.error_lines == [
        f"error: {url}: split set is missing 1 of its 3 parts: m-00003-of-00003.gguf (rule "
        "split-set; download the missing part(s))"
    ]
