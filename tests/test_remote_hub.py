"""hf:// URLs read through the Hub's HTTP API on huggingface_hub's session, pointed at a Hub
the tests start on 127.0.0.1 (tests/remote_servers.hub_server: revisions, tree listings,
`resolve` downloads with Range), as HF_ENDPOINT points it at any Hub."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.builders import Factory, Spec
from tests.helpers import cli, local_fixes, one_error_line, retried_inspect
from tests.optional import needs
from tests.remote_servers import REPO, REVISION_SHA, HttpServer, hub_server

pytestmark = needs("huggingface_hub")


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


def test_a_failing_listing_is_retried_as_ckptfix_says(
    hub: HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hub's API requests are ckptfix's own: retried and counted by ckptfix, with none
    of huggingface_hub's retry loops (which waited 23 s and printed ten lines)."""
    _model(hub.root)
    hub.behaviour.fail_next = 1  # the revision lookup: the first API request
    run = cli("inspect", f"hf://{REPO}")
    assert run.code == 1
    assert run.error_lines == [
        f"error: hf://{REPO}: the server failed (HTTP 503) (rule remote-server-error; try "
        "again later)"
    ]
    assert run.stderr.count("\n") == 1
    hub.behaviour.fail_next = 2
    retried_inspect(f"hf://{REPO}", 2, monkeypatch)


@pytest.mark.slow
def test_a_hub_that_does_not_answer_in_time(
    hub: HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    _model(hub.root)
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "0.5")
    hub.behaviour.delay = 3.0
    start = time.perf_counter()
    line = one_error_line("inspect", f"hf://{REPO}")
    assert time.perf_counter() - start < 2.5
    assert line.startswith(f"error: hf://{REPO}: no answer in time")


def test_an_answer_that_is_not_the_hub_api(hub: HttpServer) -> None:
    _model(hub.root)
    hub.behaviour.fail_next, hub.behaviour.fail_status = 1, 200  # a JSON object, not a list
    run = cli("inspect", f"hf://{REPO}")
    assert run.code == 1
    assert run.error_lines == [
        f"error: hf://{REPO}: unexpected answer from the server: no commit in the answer about "
        "the revision (rule remote-error; check the URL and the endpoint the backend is "
        "configured with)"
    ]


@pytest.mark.parametrize(
    ("url", "what"),
    [
        ("hf://org/model@", "names an empty revision after @"),
        ("hf://org", "is not a Hub repository URL"),
        ("hf://datasets", "is not a Hub repository URL"),
        ("hf://buckets/org/b", "is a Hub storage bucket, which ckptfix does not read"),
    ],
)
def test_a_url_that_names_no_repository_is_a_usage_error(url: str, what: str) -> None:
    run = cli("inspect", url)
    assert run.code == 2
    [line] = run.error_lines
    assert line.startswith(f"error: {url}: {what} (rule usage; ")


def test_a_revision_with_a_slash_and_a_commit(hub: HttpServer) -> None:
    _model(hub.root)
    for revision in ("refs%2Fpr%2F1", REVISION_SHA):
        run = cli("inspect", f"hf://{REPO}@{revision}", "--json")
        assert run.code == 0, run.stderr
        assert run.json()["tensor_count"] == 3
    revisions = [p for _, p, _ in hub.behaviour.log if "/revision/" in p]
    assert revisions == [f"/api/models/{REPO}/revision/refs%2Fpr%2F1"]  # a commit needs none
