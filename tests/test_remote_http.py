"""Checkpoints read over HTTP by ranged requests, from a server the tests start on 127.0.0.1
(tests/remote_servers.py): the same report as for the local copy, for every input of the
malformed-input corpus and the fixtures; how few bytes and requests that takes; the error
line for each way a server fails; hash, diff and convert from a URL."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.builders import Factory, Spec, legacy_checkpoint, state_dict_pickle, zip_checkpoint
from tests.cases import INDEX_CASES, PICKLE_CASES, SAFETENSORS_CASES, Case
from tests.helpers import cli, local_fixes, tree_digests
from tests.optional import needs
from tests.remote_servers import HttpServer, http_server

pytestmark = needs("aiohttp")

# Quick failures: one retry, short waits.
FAST = {
    "CKPTFIX_REMOTE_TIMEOUT": "5",
    "CKPTFIX_REMOTE_RETRIES": "2",
    "CKPTFIX_REMOTE_BACKOFF": "0.01",
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    root = tmp_path_factory.mktemp("served")
    with http_server(root) as server:
        yield server


@pytest.fixture
def server(served: HttpServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[HttpServer]:
    for name, value in FAST.items():
        monkeypatch.setenv(name, value)
    served.behaviour.reset()
    yield served
    served.behaviour.reset()


def url_of(server: HttpServer, path: Path) -> str:
    return f"{server.url}/{path.relative_to(server.root).as_posix()}"


def as_local(document: dict[str, object], server: HttpServer) -> dict[str, object]:
    """The remote report with its URLs spelt as the local paths and no remote section."""
    document = dict(document)
    document.pop("remote", None)
    text = json.dumps(document).replace(server.url + "/", str(server.root) + "/")
    return dict(json.loads(text))


def assert_same_report(server: HttpServer, local: Path, url: str) -> dict[str, object]:
    want = cli("inspect", local, "--json", "--fail-on", "never")
    got = cli("inspect", url, "--json", "--fail-on", "never")
    assert got.code == want.code == 0, got.stderr
    document = got.json()
    assert set(document["remote"]) == {"requests", "bytes_fetched", "retries"}
    assert local_fixes(as_local(document, server), local) == want.json()
    assert got.stderr == want.stderr.replace(str(server.root) + "/", server.url + "/")
    return dict(document)


# --- the same report as for the local copy --------------------------------------------------


def _valid_fixtures() -> list[Case]:
    def zip_file(f: Factory) -> Path:
        pkl = state_dict_pickle({"w": ("0", "FloatStorage", 6, 0, [2, 3], [3, 1])})
        return zip_checkpoint(f.path("pytorch_model.bin"), pkl, {"0": bytes(range(24))})

    def legacy_file(f: Factory) -> Path:
        pkl = state_dict_pickle({"w": ("0", "FloatStorage", 6, 0, [2, 3], [3, 1])})
        return legacy_checkpoint(f.path("legacy.pt"), pkl, ["0"], [(6, bytes(range(24)))])

    def stale_index(f: Factory) -> Path:
        folder = f.sharded("m", [[Spec("a"), Spec("b")], [Spec("c")]])
        f.safetensors("m/model-00003-of-00003.safetensors", [Spec("d")])  # not indexed
        (folder / "model-00002-of-00002.safetensors").unlink()
        f.config("m", tie_word_embeddings=True)
        return folder

    def lfs_folder(f: Factory) -> Path:
        f.safetensors("m/model-00001-of-00002.safetensors", [Spec("a")])
        f.lfs_pointer("m/model-00002-of-00002.safetensors")
        f.index(
            "m/model.safetensors.index.json",
            {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
        )
        return f.root / "m"

    return [
        Case("safetensors", lambda f: f.safetensors("model.safetensors", [Spec("w")]), ""),
        Case("sharded", lambda f: f.sharded("m", [[Spec("a")], [Spec("b"), Spec("c")]]), ""),
        Case("stale-index", stale_index, ""),
        Case("lfs-pointer", lambda f: f.lfs_pointer("model.safetensors"), ""),
        Case("lfs-folder", lfs_folder, ""),
        Case("torch-zip", zip_file, ""),
        Case("torch-legacy", legacy_file, ""),
    ]


# The fixtures run in `make test-fast`; the whole malformed-input corpus (about 110 inputs,
# 10 s) in `make test`.
ALL_CASES = [
    *_valid_fixtures(),
    *(
        pytest.param(case, marks=pytest.mark.slow, id=case.id)
        for case in [*SAFETENSORS_CASES, *INDEX_CASES, *PICKLE_CASES]
    ),
]


@pytest.mark.parametrize(
    "case", ALL_CASES, ids=[c.id if isinstance(c, Case) else None for c in ALL_CASES]
)
def test_inspect_of_a_url_reports_what_the_local_copy_does(server: HttpServer, case: Case) -> None:
    built = case.build(Factory(server.root / "cases" / case.id))
    assert_same_report(server, built, url_of(server, built))
    assert not (server.root / "cases" / case.id / "CANARY").exists()  # no pickle was run


def test_a_folder_url_may_end_in_a_slash(server: HttpServer) -> None:
    folder = Factory(server.root / "slash").sharded("m", [[Spec("a")], [Spec("b")]])
    document = assert_same_report(server, folder, url_of(server, folder) + "/")
    assert document["path"] == url_of(server, folder)


# --- what it costs ---------------------------------------------------------------------------


def test_a_2gb_safetensors_file_costs_one_header_request(server: HttpServer) -> None:
    path = Factory(server.root / "huge").sparse_safetensors("model.safetensors", "F32", (2**29,))
    assert path.stat().st_size > 2 * 10**9
    run = cli("inspect", url_of(server, path), "--json")
    assert run.code == 0, run.stderr
    assert server.behaviour.bytes_sent < 1_000_000
    assert len(server.behaviour.gets()) == 1  # the header is in the first 64 KiB
    assert run.json()["remote"]["bytes_fetched"] <= 64 * 2**10


@pytest.mark.slow
def test_a_long_header_takes_a_second_request_for_the_rest(server: HttpServer) -> None:
    specs = [Spec(f"layer.{i}.weight.with.a.long.name", "F16", (1,)) for i in range(3000)]
    path = Factory(server.root / "long").safetensors("model.safetensors", specs)
    run = cli("inspect", url_of(server, path), "--json")
    assert run.code == 0, run.stderr
    header = int.from_bytes(path.read_bytes()[:8], "little")
    assert header > 64 * 2**10
    ranges = server.behaviour.gets("model.safetensors")
    assert ranges == ["bytes=0-65535", f"bytes=65536-{8 + header - 1}"]


@pytest.mark.slow
def test_a_50_shard_folder_costs_a_few_requests_per_shard(server: HttpServer) -> None:
    shards = [[Spec(f"layer.{i}.{j}", "F32", (64, 64)) for j in range(4)] for i in range(50)]
    folder = Factory(server.root / "fifty").sharded("m", shards)
    Factory(server.root / "fifty").config("m")
    run = cli("inspect", url_of(server, folder) + "/", "--json")
    assert run.code == 0, run.stderr
    assert server.behaviour.bytes_sent < 5_000_000
    # one listing; a HEAD (size, ETag) and a GET (header) per shard, the index and config.json
    assert server.behaviour.requests == 1 + 2 * 52
    remote = run.json()["remote"]
    assert remote["requests"] == server.behaviour.requests
    assert remote["bytes_fetched"] <= 52 * 64 * 2**10


def test_the_human_report_ends_with_what_the_run_fetched(server: HttpServer) -> None:
    path = Factory(server.root / "human").safetensors("model.safetensors", [Spec("w")])
    run = cli("inspect", url_of(server, path))
    assert run.code == 0
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("remote: 2 requests, "), last
    assert "fetched" in last


# --- errors: one line naming the URL and the cause, exit 1 ----------------------------------


def _one_error_line(args: list[str], rule: str) -> str:
    run = cli(*args)
    assert run.code == 1, (run.code, run.stderr)
    assert run.stdout == ""
    assert len(run.error_lines) == 1, run.stderr
    assert "Traceback" not in run.stderr
    assert f"(rule {rule};" in run.error_lines[0], run.error_lines[0]
    return run.error_lines[0]


@pytest.fixture
def model(server: HttpServer) -> str:
    folder = Factory(server.root / "errors").sharded("m", [[Spec("a")], [Spec("b")]])
    return url_of(server, folder)


def test_403_names_the_file(server: HttpServer, model: str) -> None:
    server.behaviour.forced = {"00002-of-00002.safetensors": 403}
    line = _one_error_line(["inspect", model], "remote-forbidden")
    assert line.startswith(
        f"error: {model}/model-00002-of-00002.safetensors: access denied (HTTP 403)"
    )


def test_404_of_the_url_itself(server: HttpServer) -> None:
    line = _one_error_line(
        ["inspect", f"{server.url}/nothing/model.safetensors"], "remote-not-found"
    )
    assert line.startswith(f"error: {server.url}/nothing/model.safetensors: no such file")


def test_a_server_that_ignores_range_is_refused(server: HttpServer, model: str) -> None:
    server.behaviour.ignore_range = True
    line = _one_error_line(["inspect", model], "remote-no-range")
    assert "ignores range requests" in line
    # the request's body was not read: nowhere near the whole file came over
    assert server.behaviour.bytes_sent < 10_000


def test_a_server_that_stalls_times_out(
    server: HttpServer, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "0.2")
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "1")
    server.behaviour.delay = 1.0
    line = _one_error_line(["inspect", model], "remote-timeout")
    assert "no answer in time after 2 attempts" in line


def test_transient_server_errors_are_retried(server: HttpServer, model: str) -> None:
    server.behaviour.fail_next = 2  # two 503s, then answers
    run = cli("inspect", model, "--json")
    assert run.code == 0, run.stderr
    assert run.json()["remote"]["retries"] == 2


def test_a_server_error_that_persists_is_reported_after_the_retries(
    server: HttpServer, model: str
) -> None:
    server.behaviour.fail_next = 100
    server.behaviour.fail_status = 500
    line = _one_error_line(["inspect", model], "remote-server-error")
    assert "the server failed (HTTP 500) after 3 attempts" in line


def test_an_answer_shorter_than_the_range_asked_for(server: HttpServer, model: str) -> None:
    server.behaviour.short = 10
    line = _one_error_line(["inspect", model], "remote-changed")
    assert "bytes asked for: the object changed during the run, or the server cut its" in line


def test_a_401_asks_for_credentials(server: HttpServer, model: str) -> None:
    server.behaviour.forced = {"/m/": 401}
    _one_error_line(["inspect", model], "remote-credentials")


def test_an_unreachable_server(server: HttpServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _one_error_line(["inspect", f"http://127.0.0.1:{port}/m/"], "remote-unreachable")


def test_a_missing_extra_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "botocore.session", None)  # its import raises ImportError
    run = cli("inspect", "s3://bucket/model")
    assert run.code == 2
    assert run.error_lines == [
        "error: s3://bucket/model: reading s3:// URLs needs botocore (botocore is not "
        "installed) (rule usage; pip install 'ckptfix[remote]')"
    ]
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    run = cli("inspect", "gs://bucket/model")
    assert run.code == 2
    assert run.error_lines == [
        "error: gs://bucket/model: reading gs:// URLs needs fsspec and gcsfs (gcsfs is not "
        "installed) (rule usage; pip install 'ckptfix[remote]')"
    ]


def test_a_deepspeed_folder_url_is_refused(server: HttpServer) -> None:
    f = Factory(server.root / "ds")
    f.bytes("ckpt/latest", b"global_step1")
    f.bytes("ckpt/global_step1/mp_rank_00_model_states.pt", b"PK")
    run = cli("inspect", url_of(server, f.root / "ckpt"))
    assert run.code == 1
    assert "DeepSpeed checkpoint folders are read from local disk only" in run.stderr


# --- hash, diff and the write commands from a URL --------------------------------------------


@pytest.fixture
def torch_model(server: HttpServer) -> tuple[Path, str]:
    f = Factory(server.root / "writes")
    pkl = state_dict_pickle(
        {
            "w": ("0", "FloatStorage", 6, 0, [2, 3], [3, 1]),
            "t": ("0", "FloatStorage", 6, 0, [3, 2], [1, 3]),  # a transposed view: gathered
        }
    )
    zip_checkpoint(f.path("m/pytorch_model.bin"), pkl, {"0": bytes(range(24))})
    f.config("m")
    f.bytes("m/tokenizer.json", b'{"version": "1.0"}')
    f.bytes("m/sub/notes.txt", b"hello")
    return f.root / "m", url_of(server, f.root / "m")


def test_hash_of_a_url_is_the_local_digest(
    server: HttpServer, torch_model: tuple[Path, str]
) -> None:
    local, url = torch_model
    want, got = cli("hash", local, "--json"), cli("hash", url, "--json")
    assert want.code == got.code == 0, got.stderr
    assert got.json()["digest"] == want.json()["digest"]


def test_diff_of_a_url_and_its_local_copy_is_empty(
    server: HttpServer, torch_model: tuple[Path, str]
) -> None:
    local, url = torch_model
    run = cli("diff", local, url, "--json")
    assert run.code == 0, run.stdout


def test_convert_from_a_url_writes_what_a_local_convert_writes(
    server: HttpServer, torch_model: tuple[Path, str], tmp_path: Path
) -> None:
    local, url = torch_model
    want = cli("convert", local, "-o", tmp_path / "local", "--max-shard", "40")
    got = cli("convert", url, "-o", tmp_path / "remote", "--max-shard", "40", "--json")
    assert want.code == got.code == 0, got.stderr
    assert tree_digests(tmp_path / "remote") == tree_digests(tmp_path / "local")
    assert (tmp_path / "remote" / "sub" / "notes.txt").read_bytes() == b"hello"
    assert got.json()["remote"]["requests"] > 0


def test_a_file_replaced_during_convert_fails_and_leaves_nothing(
    server: HttpServer, tmp_path: Path
) -> None:
    import ckptfix
    from ckptfix.core.errors import SourceChangedError
    from ckptfix.ops.rewrite import ConvertOptions

    f = Factory(server.root / "changing")
    folder = f.sharded("m", [[Spec("a", "F32", (256, 256))], [Spec("b", "F32", (256, 256))]])
    shard = folder / "model-00002-of-00002.safetensors"
    replaced = []

    def progress(done: int, total: int) -> None:
        if not replaced:  # the first shard is copied: replace the second one on the server
            data = shard.read_bytes()
            shard.unlink()
            shard.write_bytes(data[:-4] + b"\x01\x02\x03\x04")
            replaced.append(True)

    out = tmp_path / "out"
    options = ConvertOptions(max_shard=10**9, progress=progress)
    with pytest.raises(SourceChangedError) as raised:
        ckptfix.convert(url_of(server, folder), out, options)
    assert raised.value.rule == "remote-changed"
    assert replaced
    assert not out.exists()
    assert os.listdir(tmp_path) == []  # no staging folder left either


def test_a_file_replaced_during_hash_is_an_error(server: HttpServer) -> None:
    """Nothing is written by `hash`, but a digest of bytes from two versions of a file would
    be a lie: a change seen while hashing is an error."""
    import ckptfix
    from ckptfix.core.errors import SourceChangedError
    from ckptfix.ops.hash import HashOptions

    f = Factory(server.root / "changing-hash")
    folder = f.sharded("m", [[Spec("a", "F32", (256, 256))], [Spec("b", "F32", (256, 256))]])
    shard = folder / "model-00002-of-00002.safetensors"
    replaced: list[bool] = []

    def progress(done: int, total: int) -> None:
        if not replaced:  # the first bytes are hashed: replace the second shard on the server
            data = shard.read_bytes()
            shard.unlink()
            shard.write_bytes(data[:-4] + b"\x01\x02\x03\x04")
            replaced.append(True)

    with pytest.raises(SourceChangedError) as raised:
        ckptfix.hash_checkpoint(url_of(server, folder), HashOptions(progress=progress, workers=1))
    assert raised.value.rule == "remote-changed"
    assert replaced


def test_hash_json_of_a_url_says_what_reading_it_took(
    server: HttpServer, torch_model: tuple[Path, str]
) -> None:
    local, url = torch_model
    want, got = cli("hash", local, "--json"), cli("hash", url, "--json")
    assert want.code == got.code == 0, got.stderr
    assert "remote" not in want.json()
    remote = got.json()["remote"]
    assert remote["requests"] >= 2  # at least the listing and the .bin's bytes
    assert remote["bytes_fetched"] >= got.json()["total_bytes"]
    human = cli("hash", url)
    assert re.search(r"remote: \d+ requests, [\d,]+ bytes .* fetched", human.stdout)
