"""How a URL is named in what ckptfix prints and writes: never with its credentials (the
userinfo, a signed URL's signature and credential parameters), in any command, format or
error, while the requests still carry them; and in the CI formats, a finding read from a URL
is located at that URL, not at a path under the workspace."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from tests.builders import Factory, Spec
from tests.helpers import cli
from tests.optional import needs
from tests.output_checks import is_uri_reference, workflow_commands
from tests.remote_servers import HttpServer, http_server

pytestmark = needs("aiohttp")

FAST = {"CKPTFIX_REMOTE_TIMEOUT": "5", "CKPTFIX_REMOTE_RETRIES": "1", "CKPTFIX_REMOTE_BACKOFF": "0"}
SECRET = "s3cr3t-pw"
# The user name of the URL: a word no output holds otherwise ("reader" is in a SARIF rule).
USER = "u53r-of-the-url"
SHARD = "model-00001-of-00002.safetensors"
SCHEMA = json.loads((Path(__file__).parent / "data" / "sarif-schema-2.1.0.json").read_text())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    """m/: a sharded folder with a config; plain.safetensors: no "format" (a finding);
    bad/: a sharded folder whose index has a wrong total size, a shard without "format", and
    an LFS stub of another family (mixed-formats: a finding about the folder itself)."""
    root = tmp_path_factory.mktemp("served")
    factory = Factory(root)
    factory.sharded("m", [[Spec("a")], [Spec("b")]])
    factory.config("m")
    factory.safetensors("plain.safetensors", with_format=False)
    factory.sharded("bad", [[Spec("a")], [Spec("b")]])
    factory.index("bad/model.safetensors.index.json", {"a": SHARD, "b": SHARD}, 1)
    factory.safetensors(f"bad/{SHARD}", [Spec("a"), Spec("b")], with_format=False)
    factory.lfs_pointer("bad/pytorch_model.bin")
    with http_server(root) as server:
        yield server


@pytest.fixture
def server(served: HttpServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[HttpServer]:
    for name, value in FAST.items():
        monkeypatch.setenv(name, value)
    served.behaviour.reset()
    served.behaviour.auth = f"{USER}:{SECRET}"  # every request must carry them
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
    url = server.url.replace("http://", f"http://{USER}:{SECRET}@")
    run = cli(*(arg.format(url=url, out=tmp_path / "out") for arg in command))
    written = "".join(path.read_text() for path in tmp_path.rglob("*.json"))
    printed = run.stdout + run.stderr
    for secret in (SECRET, USER):
        assert secret not in printed and secret not in written
    assert "//***@127.0.0.1" in printed or command[0] == "reshard"
    if MISSING not in command and command[0] != "fix":  # the requests carried them
        assert run.code in (0, 1) and "remote-credentials" not in printed, printed


def test_a_signed_url_is_printed_without_its_signature(server: HttpServer) -> None:
    server.behaviour.auth = None
    signed = (
        f"{server.url}/plain.safetensors?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=AKIAEXAMPLEKEY%2F20240101%2Fus-east-1%2Fs3%2Faws4_request"
        f"&X-Amz-Security-Token=tok{SECRET}&X-Amz-Signature=sig{SECRET}&jwt=t{SECRET}"
    )
    shown = (  # every value: a secret may go by any name (`jwt` was printed as given)
        f"{server.url}/plain.safetensors?X-Amz-Algorithm=***"
        "&X-Amz-Credential=***&X-Amz-Security-Token=***&X-Amz-Signature=***&jwt=***"
    )
    for args in (["inspect", signed], ["inspect", signed, "--json"], ["hash", signed]):
        run = cli(*args)
        assert run.code == 0, run.stderr
        printed = run.stdout + run.stderr
        assert SECRET not in printed and "AKIAEXAMPLEKEY" not in printed
        assert shown in printed


# -- where a URL's findings are, in the CI formats ---------------------------------------


@pytest.fixture
def in_ci(server: HttpServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HttpServer:
    """The server (no credentials asked), read from a CI job's workspace."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GITHUB_WORKSPACE", str(tmp_path))
    server.behaviour.auth = None
    return server


def test_ci_formats_locate_a_url_finding_at_the_url(in_ci: HttpServer) -> None:
    """docs/ci.md: a file outside the workspace keeps its absolute form; a URL is its own."""
    url = f"{in_ci.url}/plain.safetensors"
    sarif = cli("inspect", url, "--format", "sarif").json()
    validator = jsonschema.validators.validator_for(SCHEMA)
    validator(SCHEMA, format_checker=validator.FORMAT_CHECKER).validate(sarif)
    [result] = sarif["runs"][0]["results"]
    assert result["locations"][0]["physicalLocation"]["artifactLocation"] == {"uri": url}
    assert is_uri_reference(url) and not is_uri_reference("http://h/a b")
    [issue] = cli("inspect", url, "--format", "gitlab").json()
    assert issue["location"]["path"] == url
    [command] = workflow_commands(cli("inspect", url, "--format", "github").stdout)
    assert command.properties["file"] == url
    junit = ET.fromstring(cli("inspect", url, "--format", "junit").stdout.encode())
    [case] = junit.iter("testcase")
    assert (case.get("classname"), case.get("name")) == (url, url)


def test_ci_formats_locate_a_url_folders_findings_at_their_urls(in_ci: HttpServer) -> None:
    folder = f"{in_ci.url}/bad/"
    document = cli("inspect", folder, "--format", "gitlab", "--fail-on", "never").json()
    uris = sorted({issue["location"]["path"] for issue in document})
    sarif = cli("inspect", folder, "--format", "sarif", "--fail-on", "never").json()
    located = sorted(
        {
            r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
            for r in sarif["runs"][0]["results"]
        }
    )
    bad = f"{in_ci.url}/bad"
    assert uris == located
    assert uris == sorted(
        [
            bad,  # mixed-formats: about the folder itself
            f"{bad}/{SHARD}",
            f"{bad}/model-00002-of-00002.safetensors",
            f"{bad}/model.safetensors.index.json",
            f"{bad}/pytorch_model.bin",
        ]
    )


@pytest.mark.parametrize(
    ("label", "uri"),
    [
        ("hf://org/model@main/x.safetensors", "hf://org/model@main/x.safetensors"),
        ("https://***@h/m/a%2Fb.bin?sig=***", "https://***@h/m/a%2Fb.bin?sig=***"),
        ("https://h/100% sure/é.bin", "https://h/100%25%20sure/%C3%A9.bin"),
        ("s3://b/" + os.fsdecode(b"bad\xff.bin"), "s3://b/bad%FF.bin"),
    ],
)
def test_a_url_location_is_a_uri(label: str, uri: str) -> None:
    from ckptfix.reports.sarif import artifact_location

    assert artifact_location(label, "/workspace") == {"uri": uri}
    assert is_uri_reference(uri)


@pytest.mark.parametrize(
    "args",
    [
        ["reshard", "m.safetensors", "-o", f"http://reader:{SECRET}@host/out"],
        ["convert", "m.safetensors", "-o", f"https://reader:{SECRET}@host/out?sig={SECRET}"],
        ["dedupe", "m.safetensors", "--out", f"ftp://reader:{SECRET}@host/out"],
        ["fix", "m.safetensors", "-o", f"az://reader:{SECRET}@container/out"],
        ["hash", "m.safetensors", "--manifest", f"https://reader:{SECRET}@host/m.json"],
        ["inspect", "m.safetensors", "--manifest", f"http://reader:{SECRET}@host/m.json"],
    ],
    ids=lambda args: args[0] + " " + args[2],
)
def test_a_url_for_a_local_output_is_refused(
    factory: Factory, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    """`-o s3://bucket/out` was folded by pathlib into the relative path `s3:/bucket/out`,
    written there, and printed (with the password of an https:// URL). s3:// is an output
    now, as are gs:// and hf:// (tests/test_store_output.py); the others are refused, their
    credentials unprinted."""
    monkeypatch.chdir(factory.root)
    factory.safetensors("m.safetensors")
    run = cli(*args)
    assert run.code == 2, run.stderr
    [line] = run.error_lines
    assert SECRET not in line and "(rule usage; " in line
    scheme = args[3].split("://")[0]
    assert line.startswith((f"error: {scheme}://", "error: Invalid value for '"))
    said = ("is not a URL scheme ckptfix reads", ": is a URL; ", f"cannot write to {scheme}://")
    assert any(words in line for words in said), line
    assert sorted(os.listdir(factory.root)) == ["m.safetensors"]
