"""How a URL is named in what ckptfix prints and writes: never with its credentials (the
userinfo, a signed URL's signature and credential parameters), in any command, format or
error, while the requests still carry them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.builders import Factory, Spec
from tests.helpers import cli
from tests.remote_servers import HttpServer, http_server

pytest.importorskip("aiohttp", reason="the remote extra is not installed")

FAST = {"CKPTFIX_REMOTE_TIMEOUT": "5", "CKPTFIX_REMOTE_RETRIES": "1", "CKPTFIX_REMOTE_BACKOFF": "0"}
SECRET = "s3cr3t-pw"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    """m/: a sharded folder with a config; plain.safetensors: no "format" (a finding)."""
    root = tmp_path_factory.mktemp("served")
    factory = Factory(root)
    factory.sharded("m", [[Spec("a")], [Spec("b")]])
    factory.config("m")
    factory.safetensors("plain.safetensors", with_format=False)
    with http_server(root) as server:
        yield server


@pytest.fixture
def server(served: HttpServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[HttpServer]:
    for name, value in FAST.items():
        monkeypatch.setenv(name, value)
    served.behaviour.reset()
    served.behaviour.auth = f"reader:{SECRET}"  # every request must carry them
    yield served
    served.behaviour.reset()


FOLDER, FILE, MISSING = "{url}/m/", "{url}/plain.safetensors", "{url}/missing.safetensors"
COMMANDS = [
    ["inspect", FOLDER, FILE],
    ["inspect", FILE, "--tensors"],
    *(["inspect", FOLDER, FILE, "--format", fmt] for fmt in ("json", "github", "gitlab")),
    *(["inspect", FILE, "--format", fmt] for fmt in ("sarif", "junit")),
    ["hash", FOLDER, "--tensors"],
    ["hash", FILE, "--json", "--manifest", "{out}.json"],
    ["diff", FOLDER, FILE],
    ["diff", FOLDER, FILE, "--json"],
    ["convert", FOLDER, "-o", "{out}", "--dry-run", "--json"],
    ["reshard", FOLDER, "-o", "{out}"],  # names no URL: what it wrote
    ["inspect", MISSING],  # an error line
    ["hash", MISSING, "--json"],  # and its JSON document
    ["fix", FOLDER, "-o", "{out}"],  # a usage error naming the URL
]


@pytest.mark.parametrize(
    "command", COMMANDS, ids=[" ".join(c).replace("{url}", "") for c in COMMANDS]
)
def test_credentials_in_the_url_are_never_printed_nor_written(
    server: HttpServer, tmp_path: Path, command: list[str]
) -> None:
    url = server.url.replace("http://", f"http://reader:{SECRET}@")
    run = cli(*(arg.format(url=url, out=tmp_path / "out") for arg in command))
    written = "".join(path.read_text() for path in tmp_path.rglob("*.json"))
    printed = run.stdout + run.stderr
    for secret in (SECRET, "reader"):
        assert secret not in printed and secret not in written
    assert "***@127.0.0.1" in printed or command[0] == "reshard"
    if MISSING not in command and command[0] != "fix":  # the requests carried them
        assert run.code in (0, 1) and "remote-credentials" not in printed, printed


def test_a_signed_url_is_printed_without_its_signature(server: HttpServer) -> None:
    server.behaviour.auth = None
    signed = (
        f"{server.url}/plain.safetensors?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=AKIAEXAMPLEKEY%2F20240101%2Fus-east-1%2Fs3%2Faws4_request"
        f"&X-Amz-Security-Token=tok{SECRET}&X-Amz-Signature=sig{SECRET}"
    )
    shown = (
        f"{server.url}/plain.safetensors?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=***&X-Amz-Security-Token=***&X-Amz-Signature=***"
    )
    for args in (["inspect", signed], ["inspect", signed, "--json"], ["hash", signed]):
        run = cli(*args)
        assert run.code == 0, run.stderr
        printed = run.stdout + run.stderr
        assert SECRET not in printed and "AKIAEXAMPLEKEY" not in printed
        assert shown in printed
