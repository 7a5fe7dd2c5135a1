"""hf:// outputs through the store protocol (ckptfix/write/stores/hub.py), against the Hub
test server with huggingface_hub's commit path (tests/store_servers.hub_write_server):
preupload, the LFS batch API, basic and multipart LFS uploads, the commit's NDJSON, pull
requests. The LFS protocol is the one exercised: Xet cannot be served on 127.0.0.1, so the
tests turn it off through huggingface_hub's own setting (constants.HF_HUB_DISABLE_XET, what
HF_HUB_DISABLE_XET=1 sets)."""

from __future__ import annotations

import hashlib
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptfix.core.errors import RemoteError, VerificationError
from ckptfix.io.remote import Settings
from tests.optional import needs
from tests.remote_servers import REPO, REVISION_SHA, HttpServer
from tests.store_servers import LFS_PART, hub_write_server, pattern, stored, upload_whole

pytestmark = [
    needs("huggingface_hub"),
    # huggingface_hub's LFS uploads pass a file as `data=` to httpx, which warns
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]

SETTINGS = Settings(timeout=10.0, retries=2, concurrency=4, backoff=0.0)
TOKEN = "hf_secretSECRETsecretSECRET0123456789"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HttpServer]:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # see the module docstring
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "repo").mkdir()
    with hub_write_server(tmp_path / "repo") as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield server


def _store(url: str = f"hf://{REPO}", **options: object) -> object:
    from ckptfix.write.stores.base import StoreOptions
    from ckptfix.write.stores.hub import HubStore

    return HubStore(url, StoreOptions(**options), SETTINGS)  # type: ignore[arg-type]


def _commits(
    server: HttpServer,
) -> list[tuple[str, dict[str, object], list[dict[str, object]], bool]]:
    return list(server.behaviour.kept.get("commits", []))


SIZES = [0, 1000, LFS_PART, 3 * LFS_PART + 17]


@pytest.mark.slow
def test_one_commit_holds_every_shard_the_small_files_and_the_deletions(hub: HttpServer) -> None:
    (hub.root / "old-00001-of-00001.safetensors").write_bytes(b"old")
    store = _store()
    shards = {
        f"model-0000{i + 1}-of-00004.safetensors": pattern(size, i) for i, size in enumerate(SIZES)
    }
    for name, data in shards.items():
        found = upload_whole(store, name, data)
        assert found.checksum == ("sha256", hashlib.sha256(data).hexdigest())  # type: ignore[attr-defined]
    assert _commits(hub) == []  # nothing visible before publish
    index = b'{"metadata": {}, "weight_map": {}}'
    store.publish(  # type: ignore[attr-defined]
        {"model.safetensors.index.json": index, "config.json": b"{}"},
        ["old-00001-of-00001.safetensors"],
        message="ckptfix reshard",
    )
    [(_, header, operations, pr)] = _commits(hub)
    assert header["summary"] == "ckptfix reshard" and header["parentCommit"] == REVISION_SHA
    assert not pr
    kinds = sorted((op["key"], op["value"]["path"]) for op in operations)  # type: ignore[index]
    assert kinds == sorted(
        [("lfsFile" if data else "file", name) for name, data in shards.items()]  # empty: git
        + [("file", "model.safetensors.index.json"), ("file", "config.json")]
        + [("deletedFile", "old-00001-of-00001.safetensors")]
    )
    assert stored(hub.root) == {
        **shards,
        "model.safetensors.index.json": index,
        "config.json": b"{}",
    }
    listed = {item.name: item for item in store.list()}  # type: ignore[attr-defined]
    for name, data in shards.items():
        lfs = ("sha256", hashlib.sha256(data).hexdigest()) if data else None  # empty: in git
        assert (listed[name].size, listed[name].checksum) == (len(data), lfs)
    big = "model-00004-of-00004.safetensors"
    assert store.read(big, 3, LFS_PART + 9) == shards[big][3 : LFS_PART + 9]  # type: ignore[attr-defined]
    # the multipart LFS path was taken for the shard larger than a part
    assert any("/lfs-part/" in path for method, path, _ in hub.behaviour.log if method == "PUT")


@pytest.mark.slow
def test_a_subfolder_and_a_pull_request(hub: HttpServer) -> None:
    store = _store(f"hf://{REPO}/exported", hf_pr=True)
    upload_whole(store, "model.safetensors", pattern(2000))
    store.publish({"config.json": b"{}"}, [], message="export")  # type: ignore[attr-defined]
    [(_, _, operations, pr)] = _commits(hub)
    assert pr
    assert {op["value"]["path"] for op in operations} == {  # type: ignore[index]
        "exported/model.safetensors",
        "exported/config.json",
    }
    assert stored(hub.root) == {}  # main is untouched
    [pr_tree] = hub.behaviour.kept["trees"].values()
    assert stored(pr_tree) == {
        "exported/model.safetensors": pattern(2000),
        "exported/config.json": b"{}",
    }
    [request] = [p for m, p, _ in hub.behaviour.log if m == "POST" and "/commit/" in p]
    assert "create_pr=1" in request


@pytest.mark.slow
def test_at_most_one_object_is_staged_at_a_time(hub: HttpServer, tmp_path: Path) -> None:
    """Two threads upload three shards each; a watcher counts the staged files."""
    hub.behaviour.delay = 0.05  # each upload request: the staged file stays a while
    store = _store()
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(len(list((tmp_path / "tmp").glob("ckptfix-hub-*"))))
            time.sleep(0.002)

    def shards(worker: int) -> None:
        for i in range(3):
            upload_whole(
                store, f"w{worker}-{i}.safetensors", pattern(LFS_PART // 2, worker * 3 + i)
            )

    watcher = threading.Thread(target=watch)
    watcher.start()
    workers = [threading.Thread(target=shards, args=(n,)) for n in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    done.set()
    watcher.join()
    assert max(seen) == 1  # staged files were seen, never two at once
    assert list((tmp_path / "tmp").iterdir()) == []
    assert len(store.operations) == 6  # type: ignore[attr-defined]


@pytest.mark.parametrize("fault", ["corrupt", "wrong_checksum", "drop_chunk"])
def test_a_hub_that_keeps_other_bytes_is_a_verification_error(hub: HttpServer, fault: str) -> None:
    setattr(hub.behaviour, fault, "")  # every object
    store = _store()
    with pytest.raises(VerificationError) as caught:
        upload_whole(store, "model.safetensors", pattern(3 * LFS_PART))
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"error: hf://{REPO}/model.safetensors: ")
    assert "nothing was published" in line
    assert _commits(hub) == []


def test_a_commit_whose_tree_lists_other_bytes_is_a_verification_error(hub: HttpServer) -> None:
    hub.behaviour.wrong_checksum = "tree"
    store = _store()
    upload_whole(store, "model.safetensors", pattern(3000))
    with pytest.raises(VerificationError) as caught:
        store.publish({}, [], message="m")  # type: ignore[attr-defined]
    line = str(caught.value)
    assert line.startswith(f"error: hf://{REPO}/model.safetensors: commit ")
    assert "the commit is published (rule verification-failed; revert the commit" in line


def test_abort_leaves_nothing_staged_or_committed(hub: HttpServer, tmp_path: Path) -> None:
    store = _store()
    upload = store.begin("model.safetensors", 5000)  # type: ignore[attr-defined]
    upload.send(pattern(100))
    upload.abort()
    upload.abort()
    assert list((tmp_path / "tmp").iterdir()) == []
    upload_whole(store, "config.safetensors", pattern(10))  # the staging place is free again
    store.publish({}, [], message="one file")  # type: ignore[attr-defined]
    [(_, _, operations, _)] = _commits(hub)
    assert [op["value"]["path"] for op in operations] == ["config.safetensors"]  # type: ignore[index]


@pytest.mark.slow
def test_transient_failures_are_retried(hub: HttpServer) -> None:
    """huggingface_hub waits 1 s before its first retry."""
    store = _store()
    hub.behaviour.fail_next, hub.behaviour.fail_status = 2, 500
    data = pattern(3000)
    upload_whole(store, "model.safetensors", data)
    store.publish({}, [], message="m")  # type: ignore[attr-defined]
    assert stored(hub.root) == {"model.safetensors": data}


@pytest.mark.parametrize(
    ("route", "status", "rule"),
    [("/commit/main", 403, "remote-forbidden"), ("/preupload/main", 401, "remote-credentials")],
)
def test_refusals_are_one_line_errors_without_the_token(
    hub: HttpServer, route: str, status: int, rule: str
) -> None:
    hub.behaviour.forced = {route: status}
    store = _store()
    with pytest.raises(RemoteError) as caught:
        upload_whole(store, "model.safetensors", pattern(3000))
        store.publish({}, [], message="m")  # type: ignore[attr-defined]
    line = str(caught.value)
    assert caught.value.rule == rule and "\n" not in line
    assert TOKEN not in line and TOKEN not in repr(caught.value.__cause__)
    assert stored(hub.root) == {}


def test_an_answer_the_client_cannot_use_is_one_error(hub: HttpServer) -> None:
    hub.behaviour.hostile = "malformed"
    store = _store()
    with pytest.raises(RemoteError) as caught:
        upload_whole(store, "model.safetensors", pattern(3000))
    line = str(caught.value)
    assert caught.value.rule == "remote-error" and "\n" not in line
    assert "not the Hub's API (ValueError: Malformed response from server)" in line


def test_a_missing_repository_is_one_error(hub: HttpServer) -> None:
    with pytest.raises(RemoteError) as caught:
        _store("hf://org/none")
    assert caught.value.rule == "remote-not-found"
    assert "the repository org/none or its revision 'main' does not exist" in str(caught.value)


def test_a_branch_moved_meanwhile_fails_the_commit(hub: HttpServer) -> None:
    store = _store()
    upload_whole(store, "model.safetensors", pattern(3000))
    hub.behaviour.kept["head"] = "f" * 40  # someone pushed
    with pytest.raises(RemoteError) as caught:
        store.publish({}, [], message="m")  # type: ignore[attr-defined]
    assert caught.value.rule == "remote-changed" and "moved since the upload began" in str(
        caught.value
    )
    assert stored(hub.root) == {}


def test_stat_hasher_and_deletions_in_the_one_commit(hub: HttpServer) -> None:
    """What --resume compares (i24-core's protocol: stat, hasher, delete, flush)."""
    (hub.root / "old.safetensors").write_bytes(b"old")
    store = _store()
    data = pattern(3000)
    kept = store.begin("model.safetensors", len(data))  # type: ignore[attr-defined]
    kept.send(data)
    kept.flush()  # uploaded and checked; the staging place is free again
    dropped = store.begin("dropped.safetensors", 10)  # type: ignore[attr-defined]
    dropped.send(pattern(10))
    dropped.flush()
    dropped.abort()  # sent, then forgotten: not in the commit
    kept.complete()
    store.delete(["old.safetensors"])  # type: ignore[attr-defined]
    assert (hub.root / "old.safetensors").exists() and _commits(hub) == []
    store.publish({}, [], message="m")  # type: ignore[attr-defined]
    [(_, _, operations, _)] = _commits(hub)
    assert sorted((op["key"], op["value"]["path"]) for op in operations) == [  # type: ignore[index]
        ("deletedFile", "old.safetensors"),
        ("lfsFile", "model.safetensors"),
    ]
    hasher = store.hasher(len(data))  # type: ignore[attr-defined]
    hasher.update(data)
    found = store.stat("model.safetensors")  # type: ignore[attr-defined]
    assert found is not None and (found.size, found.checksum) == (len(data), hasher.value())
    assert store.stat("old.safetensors") is None  # type: ignore[attr-defined]


_KILLED = """
import sys
from huggingface_hub import constants
constants.ENDPOINT, constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_XET = sys.argv[1], False, True
from ckptfix.io.remote import Settings
from ckptfix.write.stores.hub import HubStore
store = HubStore("hf://org/model", settings=Settings(timeout=10, retries=0, backoff=0))
for i in range(20):
    upload = store.begin(f"model-{i:05d}.safetensors", 4 * 2**20)
    for _ in range(4):
        upload.send(bytes([i]) * 2**20)  # each object its own bytes: no LFS dedup
    upload.complete()
store.publish({}, [], message="never")
"""


@pytest.mark.slow
def test_a_killed_upload_commits_nothing_and_leaves_one_staged_file_at_most(
    hub: HttpServer, tmp_path: Path
) -> None:
    import os
    import signal
    import subprocess
    import sys

    hub.behaviour.delay = 0.05
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "TMPDIR": str(tmp_path / "tmp")}
    child = subprocess.Popen([sys.executable, "-c", _KILLED, hub.url], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # killed while its third object is in flight
        if sum(1 for m, p, _ in hub.behaviour.log if m == "PUT") >= 20:
            break
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert _commits(hub) == [] and stored(hub.root) == {}
    assert len(list((tmp_path / "tmp").glob("ckptfix-hub-*"))) <= 1
