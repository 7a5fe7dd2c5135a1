"""An HTTP 401 said as what the request carried: credentials it sent were refused, it sent
none, or a redirect took it to a host its credentials are not sent to. Each line is checked
against what the test server saw (the Authorization header, or none), so the text cannot
claim what did not happen."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import one_error_line
from tests.optional import needs
from tests.remote_servers import Served, http_server, served_model, serving

pytestmark = needs("aiohttp", "huggingface_hub")

SHARD = "model-00001-of-00002.safetensors"


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "5")
    # no Hub token but the one a test sets: not one `hf auth login` saved on this machine
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    return tmp_path


@pytest.fixture
def hub(root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    with serving("hf", root, served_model(root), monkeypatch) as served:
        yield served


def _with_userinfo(url: str, userinfo: str) -> str:
    return url.replace("http://", f"http://{userinfo}@", 1)


def _given(backend: str, served: Served, monkeypatch: pytest.MonkeyPatch) -> str:
    """The URL to read, credentials given: in the URL (http), HF_TOKEN (hf)."""
    if backend == "hf":
        monkeypatch.setenv("HF_TOKEN", "hf_expired_token")
        return served.url
    return _with_userinfo(served.url, "reader:wrong")


REFUSED = {
    ("http", True): "the server refused the user name and password the request carried "
    "(HTTP 401) (rule remote-credentials; check the user name and password in the URL)",
    ("http", False): "the server refused the request: HTTP 401 (the request carried no user "
    "name and password) (rule remote-credentials; give a user name and password in the URL "
    "(user:password@ before the host), or a signed URL that is still valid)",
    ("hf", True): "the server refused the token the request carried (HTTP 401) (rule "
    "remote-credentials; check the token (HF_TOKEN, or the one `hf auth login` saved): it "
    "may have expired, been revoked, or not be allowed to read this repository)",
    ("hf", False): "the server refused the request: HTTP 401 (the request carried no token) "
    "(rule remote-credentials; set HF_TOKEN, or run `hf auth login` (or check the "
    "repository's name: the Hub answers 401 for one it does not show))",
}


@pytest.mark.parametrize(("backend", "given"), list(REFUSED))
def test_a_401_says_whether_credentials_were_sent(
    backend: str, given: bool, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with serving(backend, root, served_model(root), monkeypatch) as served:
        served.server.behaviour.forced = {SHARD: 401}
        url = _given(backend, served, monkeypatch) if given else served.url
        line = one_error_line("inspect", url)
        assert bool(served.server.behaviour.authorized) == given
    assert line.endswith(f"/{SHARD}: {REFUSED[backend, given]}"), line


def test_http_credentials_not_sent_to_the_host_a_redirect_names(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder's server sends its files' requests to another server (another origin):
    the credentials in the URL stay with the first, and the second's 401 says so."""
    model = served_model(root)
    with serving("http", root, model, monkeypatch) as served, http_server(root) as other:
        served.server.behaviour.cdn = other.url
        other.behaviour.forced = {SHARD: 401}
        line = one_error_line("inspect", _with_userinfo(served.url, "reader:secret"))
        assert served.server.behaviour.authorized  # the folder's server got them
        assert other.behaviour.log and other.behaviour.authorized == []
    assert "HTTP 401 from another server the request was redirected to, which its " in line
    assert "credentials are not sent to (rule remote-credentials; check the URL" in line, line


def test_hub_token_not_sent_to_the_host_a_download_is_redirected_to(
    hub: Served, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token")
    with http_server(hub.local) as cdn:
        hub.server.behaviour.cdn = cdn.url
        cdn.behaviour.forced = {SHARD: 401}
        line = one_error_line("inspect", hub.url)
        assert cdn.behaviour.log and cdn.behaviour.authorized == []
    assert "HTTP 401 from another server the request was redirected to, which its " in line
    assert "credentials are not sent to (rule remote-credentials; check the URL" in line, line


@pytest.mark.parametrize("backend", ["http", "hf"])
def test_credentials_a_redirect_gives_are_not_taken_for_the_users(
    backend: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server redirects to a URL with a user name and password of its own (the HTTP
    clients send them): a 401 there is not the user's credentials refused."""
    model = served_model(root)
    with serving(backend, root, model, monkeypatch) as served, http_server(root) as other:
        other.behaviour.forced = {SHARD: 401}
        path = "" if backend == "http" else "/bucket/m"  # the Hub redirects to cdn/{path}
        served.server.behaviour.cdn = _with_userinfo(other.url, "its:own") + path
        line = one_error_line("inspect", served.url)
        assert other.behaviour.authorized and served.server.behaviour.authorized == []
    assert "HTTP 401 to the user name and password in the URL the server redirected" in line
    assert "not ones given to ckptfix (rule remote-credentials; check the URL and the" in line


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_where_the_backend_does_not_say_what_was_sent_neither_is_claimed(scheme: str) -> None:
    """gcsfs and botocore sign requests themselves: a 401 through them says neither that
    nothing was sent nor that something was refused."""
    from ckptfix.io.remote_errors import classify

    class Refused(OSError):  # gcsfs's HttpError, as remote_errors reads it
        status = 401

    failure = classify(Refused("Unauthorized"), scheme)
    assert failure is not None
    assert (
        failure.what == "the server refused the request: HTTP 401 (credentials missing or refused)"
    )
    assert failure.fix.startswith("set ")
