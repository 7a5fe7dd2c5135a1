"""gs:// URLs through gcsfs, pointed at a Cloud Storage JSON API the tests start on 127.0.0.1
(tests/remote_servers.gcs_server: object metadata, listings, media downloads with Range and
generations), as STORAGE_EMULATOR_HOST points gcsfs at any emulator. Access is anonymous, as
for a public bucket: no credentials file, no metadata server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from tests.builders import Factory, Spec
from tests.helpers import cli, local_fixes, one_error_line, retried_inspect, tensor_digests
from tests.optional import needs
from tests.remote_servers import HttpServer, gcs_server, generation_of

pytestmark = needs("gcsfs")

BUCKET = "weights"


@pytest.fixture
def gcs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HttpServer]:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-credentials.json"))
    monkeypatch.setenv("NO_GCE_CHECK", "true")  # never ask a metadata server
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    (tmp_path / "root" / BUCKET).mkdir(parents=True)
    with gcs_server(tmp_path / "root") as server:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
        yield server


def _model(server: HttpServer, name: str = "run/model") -> Path:
    f = Factory(server.root / BUCKET)
    folder = f.sharded(name, [[Spec("a"), Spec("b")], [Spec("c", "F32", (64, 64))]])
    f.safetensors(f"{name}/model-00007-of-00009.safetensors", [Spec("orphan")])
    f.config(name)
    return folder


def _downloads(server: HttpServer) -> list[tuple[str, dict[str, list[str]], str]]:
    """(file, query, Range) of each media download."""
    found = []
    for method, path, ranged in server.behaviour.log:
        parts = urlsplit(path)
        if method == "GET" and not parts.path.startswith("/storage/"):
            name = unquote(parts.path).rsplit("/", 1)[-1]
            found.append((name, parse_qs(parts.query), ranged))
    return found


def test_a_folder_reports_what_the_local_copy_does(gcs: HttpServer) -> None:
    folder = _model(gcs)
    url = f"gs://{BUCKET}/run/model"
    want = cli("inspect", folder, "--json")
    got = cli("inspect", url, "--json")
    assert got.code == want.code, got.stderr
    document = got.json()
    assert [f["code"] for f in document["findings"]] == ["orphan-file"]
    remote = document.pop("remote")
    local = json.loads(json.dumps(document).replace(url, str(folder)))
    assert local_fixes(local, folder) == want.json()
    downloads = _downloads(gcs)
    # one ranged read per file (3 shards, the index, the config), each pinned to its generation
    assert sorted(name for name, _, _ in downloads) == sorted(p.name for p in folder.iterdir())
    for name, query, ranged in downloads:
        assert query["generation"] == [generation_of(folder / name)]
        assert ranged.startswith("bytes=0-")
    # besides: the folder's info (gcsfs: an object lookup, then a listing) and its listing;
    # ckptfix counts its calls to gcsfs, the info one call
    assert len(gcs.behaviour.log) == len(downloads) + 3
    assert remote["requests"] == len(downloads) + 2
    assert remote["bytes_fetched"] == sum(int(r.split("-")[1]) + 1 for _, _, r in downloads)
    assert remote["bytes_fetched"] < 40_000


@pytest.mark.slow
def test_hash_and_convert_read_the_same_tensors(gcs: HttpServer, tmp_path: Path) -> None:
    folder = _model(gcs)
    (folder / "model-00007-of-00009.safetensors").unlink()
    url = f"gs://{BUCKET}/run/model"
    want, got = cli("hash", folder, "--json"), cli("hash", url, "--json")
    assert got.code == want.code == 0, got.stderr
    assert got.json()["digest"] == want.json()["digest"]
    out = tmp_path / "out"
    run = cli("convert", url, "-o", out, "--max-shard", "10kB")
    assert run.code == 0, run.stderr
    assert tensor_digests(out) == tensor_digests(folder)
    assert (out / "config.json").read_bytes() == (folder / "config.json").read_bytes()


def test_an_object_replaced_during_a_convert_fails_and_leaves_nothing(
    gcs: HttpServer, tmp_path: Path
) -> None:
    import ckptfix
    from ckptfix.core.errors import SourceChangedError
    from ckptfix.ops.rewrite import ConvertOptions

    f = Factory(gcs.root / BUCKET)
    folder = f.sharded("changing", [[Spec("a", "F32", (256, 256))], [Spec("b", "F32", (256, 256))]])
    shard = folder / "model-00002-of-00002.safetensors"
    replaced = []

    def progress(done: int, total: int) -> None:
        if not replaced:  # the first shard is copied: replace the second one in the bucket
            data, listed = shard.read_bytes(), shard.stat().st_mtime_ns
            shard.unlink()
            shard.write_bytes(data[:-4] + b"\x01\x02\x03\x04")
            later = listed + 10**6  # a new generation even within one clock tick
            os.utime(shard, ns=(later, later))
            replaced.append(True)

    out = tmp_path / "out"
    options = ConvertOptions(max_shard=10**9, progress=progress)
    with pytest.raises(SourceChangedError) as raised:
        ckptfix.convert(f"gs://{BUCKET}/changing", out, options)
    assert raised.value.rule == "remote-changed"
    assert replaced
    # the read that found it asked for the generation listed, which is gone
    asked = [q["generation"] for name, q, _ in _downloads(gcs) if name == shard.name]
    assert asked and asked[-1] != [generation_of(shard)]
    assert not out.exists()
    assert not list(tmp_path.glob(".ckptfix-*"))


def test_a_missing_object(gcs: HttpServer) -> None:
    _model(gcs)
    run = cli("inspect", f"gs://{BUCKET}/run/nothing.safetensors")
    assert run.code == 1
    assert run.error_lines == [
        f"error: gs://{BUCKET}/run/nothing.safetensors: no such file or folder "
        "(rule remote-not-found; check the URL)"
    ]


@pytest.mark.parametrize(
    ("status", "rule", "what"),
    [
        (403, "remote-forbidden", "access denied"),
        (401, "remote-credentials", "the server refused the request"),
        (500, "remote-server-error", "the server failed (HTTP 500)"),
        (502, "remote-unreachable", "the connection failed"),
    ],
)
def test_a_refused_object_is_one_error_line(
    gcs: HttpServer, status: int, rule: str, what: str
) -> None:
    _model(gcs)
    gcs.behaviour.forced = {"model-00002-of-00002.safetensors": status}
    run = cli("inspect", f"gs://{BUCKET}/run/model")
    assert run.code == 1, run.stderr
    [line] = run.error_lines
    assert line.startswith(
        f"error: gs://{BUCKET}/run/model/model-00002-of-00002.safetensors: {what}"
    )
    assert f"(rule {rule};" in line


@pytest.mark.slow
def test_the_console_shows_one_line_not_gcsfs_logs(gcs: HttpServer) -> None:
    """gcsfs logs each failed request with its traceback; the console script prints only
    ckptfix's error line."""
    _model(gcs)
    gcs.behaviour.forced = {"model-00002-of-00002.safetensors": 500}
    run = subprocess.run(
        [sys.executable, "-m", "ckptfix", "inspect", f"gs://{BUCKET}/run/model"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        f"error: gs://{BUCKET}/run/model/model-00002-of-00002.safetensors: the server failed "
        "(HTTP 500) (rule remote-server-error; try again later)"
    ]


def test_transient_failures_are_retried_by_ckptfix(
    gcs: HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    _model(gcs)
    gcs.behaviour.fail_next = 2
    run = retried_inspect(f"gs://{BUCKET}/run/model", 2, monkeypatch)
    assert len(gcs.behaviour.log) == run.json()["remote"]["requests"] + 1  # the folder's info


@pytest.mark.slow
def test_a_server_that_does_not_answer_in_time(
    gcs: HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    _model(gcs)
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "0.5")
    gcs.behaviour.delay = 2.0
    line = one_error_line("inspect", f"gs://{BUCKET}/run/model")
    assert line.startswith(f"error: gs://{BUCKET}/run/model: no answer in time")
    assert "(rule remote-timeout;" in line


def test_the_scheme_is_case_insensitive(gcs: HttpServer) -> None:
    folder = _model(gcs)
    want = cli("hash", folder, "--json")
    for scheme in ("GS", "gcs"):
        got = cli("hash", f"{scheme}://{BUCKET}/run/model", "--json")
        assert got.code == 0, got.stderr
        assert got.json()["digest"] == want.json()["digest"]


def test_an_answer_that_is_not_the_api_is_the_servers_fault(gcs: HttpServer) -> None:
    """A captive portal's page where the JSON API should answer: gcsfs fails to parse it.
    (Listings without end, and other hostile answers: tests/test_remote_hostile.py.)"""
    _model(gcs)
    gcs.behaviour.portal = True
    line = one_error_line("inspect", f"gs://{BUCKET}/run/model")
    what = "not Cloud Storage's JSON (JSONDecodeError"
    assert line.startswith(
        f"error: gs://{BUCKET}/run/model: unexpected answer from the server: {what}"
    ), line
    assert line.endswith(
        "(rule remote-error; check the URL and the endpoint the backend is configured with)"
    )
