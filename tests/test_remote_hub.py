"""hf:// URLs through huggingface_hub's HfFileSystem, pointed at a Hub the tests start on
127.0.0.1 (tests/remote_servers.hub_server: repo info, tree listings, `resolve` downloads
with Range), as HF_ENDPOINT points it at any Hub."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.builders import Factory, Spec
from tests.helpers import cli, local_fixes
from tests.remote_servers import REPO, REVISION_SHA, HttpServer, hub_server

pytest.importorskip("huggingface_hub", reason="the remote extra is not installed")


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HttpServer]:
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    with hub_server(tmp_path / "repo") as server:
        # what HF_ENDPOINT sets when huggingface_hub is imported
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        # the suite is offline (conftest); this Hub is on 127.0.0.1
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield server


def _model(root: Path) -> Path:
    f = Factory(root.parent)
    folder = f.sharded(root.name, [[Spec("a"), Spec("b")], [Spec("c")]])
    f.safetensors(f"{root.name}/model-00007-of-00009.safetensors", [Spec("orphan")])
    f.config(root.name)
    return folder


def test_a_repo_reports_what_the_local_copy_does(hub: HttpServer) -> None:
    folder = _model(hub.root)
    want = cli("inspect", folder, "--json")
    got = cli("inspect", f"hf://{REPO}", "--json")
    assert got.code == want.code, got.stderr
    document = got.json()
    remote = document.pop("remote")
    local = json.loads(json.dumps(document).replace(f"hf://{REPO}", str(folder)))
    assert local_fixes(local, folder) == want.json()
    # one tree listing, one ranged GET per file: no HEAD, the listing says sizes
    gets = [path for method, path, _ in hub.behaviour.log if not path.startswith("/api/")]
    assert len(gets) == 5
    # listed and read at the commit main pointed to when the run began, not at "main"
    trees = [path for _, path, _ in hub.behaviour.log if "/tree/" in path]
    assert trees and all(f"/tree/{REVISION_SHA}" in path for path in trees), trees
    assert all(f"/resolve/{REVISION_SHA}/" in path for path in gets), gets
    assert remote["bytes_fetched"] < 10_000


def test_a_file_in_a_repo_and_its_hash(hub: HttpServer) -> None:
    folder = _model(hub.root)
    url = f"hf://{REPO}/model-00001-of-00002.safetensors"
    run = cli("inspect", url, "--json")
    assert run.code == 0, run.stderr
    assert run.json()["tensor_count"] == 2
    want, got = cli("hash", folder, "--json"), cli("hash", f"hf://{REPO}", "--json")
    assert got.code == 0, got.stderr
    assert got.json()["digest"] == want.json()["digest"]


def test_a_missing_file(hub: HttpServer) -> None:
    _model(hub.root)
    run = cli("inspect", f"hf://{REPO}/nothing.safetensors")
    assert run.code == 1
    assert run.error_lines == [
        f"error: hf://{REPO}/nothing.safetensors: no such file or folder "
        "(rule remote-not-found; check the URL)"
    ]


def test_a_repository_that_does_not_exist(hub: HttpServer) -> None:
    run = cli("inspect", "hf://org/missing")
    assert run.code == 1
    [line] = run.error_lines
    assert line.startswith("error: hf://org/missing: ")
    assert "(rule remote-not-found;" in line or "(rule remote-credentials;" in line, line
