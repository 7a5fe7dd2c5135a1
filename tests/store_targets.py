"""The three stores a CLI output test writes to, behind one face (`Target`): S3 (moto behind
the misbehaving proxy of tests/store_proxy.py), Cloud Storage (tests/store_servers'
gcs_write_server) and the Hub (its hub_write_server, LFS uploads; Xet cannot be served on
127.0.0.1 and is turned off through huggingface_hub's own setting). Each gives the URL of an
output prefix, the bytes under it, a way to put an object there first, the requests that
wrote, a fault that makes the store not hold what was sent, and the environment a ckptfix
subprocess needs to reach it (every endpoint on 127.0.0.1).

`loopback_guard` makes opening a store whose endpoint is not on 127.0.0.1 fail the test."""

from __future__ import annotations

import contextlib
import shutil
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.remote_servers import REPO, HttpServer
from tests.store_helpers import fresh_env, names, new_bucket, objects, uploads
from tests.store_proxy import Proxy
from tests.store_servers import stored

STORES = ("s3", "gs", "hf")
GCS_BUCKET = "out"
GCS_ENV = {"GOOGLE_APPLICATION_CREDENTIALS": "/nonexistent/no-credentials.json"}
GCS_ENV |= {"NO_GCE_CHECK": "true"}
HUB_ENV = {"HF_TOKEN": "hf_secretSECRETsecretSECRET0123456789", "HF_HUB_DISABLE_XET": "1"}
HUB_ENV |= {"HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0"}


@dataclass
class Target:
    """One store under test (see the module docstring)."""

    scheme: str
    base: str  # the URL of the output prefix, without a trailing slash
    env: dict[str, str]  # what a ckptfix subprocess needs to reach the store
    read: Callable[[], dict[str, bytes]]  # name under the prefix -> bytes
    put: Callable[[str, bytes], None]  # an object under the prefix, before the run
    writes: Callable[[], list[tuple[str, str]]]  # (method, path) of every writing request
    clear_log: Callable[[], None]
    break_store: Callable[[str], None]  # a fault: "checksum" (the store lies) or "drop"
    leftovers: Callable[[], list[str]] = field(default=lambda: [])  # unfinished uploads
    server: HttpServer | None = None  # the test server (GCS, the Hub)

    def url(self, name: str = "") -> str:
        return f"{self.base}/{name}" if name else self.base

    def names(self) -> list[str]:
        return sorted(self.read())


_WRITES = ("PUT", "POST", "DELETE")
_counter = iter(range(10**6))


def s3_target(servers: tuple[str, Proxy], setenv: Any) -> Iterator[Target]:
    import boto3

    proxy = servers[1]
    env = fresh_env(proxy, setenv)
    s3 = boto3.client("s3", endpoint_url=servers[0])
    bucket = f"cli-{next(_counter)}"

    def put(name: str, data: bytes) -> None:
        s3.put_object(Bucket=bucket, Key=f"out/{name}", Body=data)

    def break_store(fault: str) -> None:
        if fault == "checksum":
            proxy.faults.lie_checksum = True
        else:
            proxy.faults.drop_part = 3

    for _ in new_bucket(s3, bucket):
        yield Target(
            "s3",
            f"s3://{bucket}/out",
            env,
            lambda: objects(s3, bucket, "out"),
            put,
            lambda: [(m, p) for m, p in proxy.faults.log if m in _WRITES],
            proxy.faults.log.clear,
            break_store,
            lambda: uploads(s3, bucket) + [n for n in names(s3, bucket, "") if "/.ckptfix" in n],
        )


def _server_writes(server: HttpServer) -> Callable[[], list[tuple[str, str]]]:
    return lambda: [(m, p) for m, p, _ in server.behaviour.log if m in _WRITES]


@contextlib.contextmanager
def _removed(folder: Path) -> Iterator[None]:
    """`folder` (a test's tmp_path) deleted afterwards: a server's objects and the outputs
    compared with them are tens of MB a test, which pytest would keep for three runs."""
    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def gcs_target(tmp_path: Path, setenv: Any) -> Iterator[Target]:
    from tests.store_servers import gcs_write_server

    (tmp_path / "gcs" / GCS_BUCKET).mkdir(parents=True)
    with _removed(tmp_path), gcs_write_server(tmp_path / "gcs") as server:
        env = {**GCS_ENV, "STORAGE_EMULATOR_HOST": server.url}
        env |= {"CKPTFIX_REMOTE_RETRIES": "1", "CKPTFIX_REMOTE_BACKOFF": "0.01"}
        for name, value in env.items():
            setenv(name, value)
        prefix = server.root / GCS_BUCKET / "out"

        def put(name: str, data: bytes) -> None:
            (prefix / name).parent.mkdir(parents=True, exist_ok=True)
            (prefix / name).write_bytes(data)

        def break_store(fault: str) -> None:
            if fault == "checksum":
                server.behaviour.wrong_checksum = ".safetensors"
            else:
                server.behaviour.drop_chunk = ".safetensors"  # a part, or a one-part object

        def read() -> dict[str, bytes]:
            found = stored(prefix) if prefix.is_dir() else {}
            return {k: v for k, v in found.items() if not k.startswith(".ckptfix")}

        yield Target(
            "gs",
            f"gs://{GCS_BUCKET}/out",
            env,
            read,
            put,
            _server_writes(server),
            server.behaviour.log.clear,
            break_store,
            lambda: [n for n in (stored(prefix) if prefix.is_dir() else {}) if ".ckptfix" in n],
            server,
        )


@contextlib.contextmanager
def hub_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Target]:
    """The Hub's `org/model`, the output in its subfolder `out` (main's tree on disk)."""
    from huggingface_hub import constants

    from tests.store_servers import hub_write_server

    (tmp_path / "repo").mkdir()
    (tmp_path / "hub-tmp").mkdir()
    with _removed(tmp_path), hub_write_server(tmp_path / "repo") as server:
        env = {**HUB_ENV, "HF_ENDPOINT": server.url, "TMPDIR": str(tmp_path / "hub-tmp")}
        env |= {"CKPTFIX_REMOTE_RETRIES": "1", "CKPTFIX_REMOTE_BACKOFF": "0.01"}
        for name, value in env.items():
            if name != "TMPDIR":
                monkeypatch.setenv(name, value)
        # what HF_ENDPOINT and HF_HUB_DISABLE_XET set when huggingface_hub is imported
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        prefix = server.root / "out"

        def put(name: str, data: bytes) -> None:
            (prefix / name).parent.mkdir(parents=True, exist_ok=True)
            (prefix / name).write_bytes(data)

        def break_store(fault: str) -> None:
            if fault == "checksum":
                server.behaviour.wrong_checksum = ""  # every LFS object kept under another
            else:
                server.behaviour.drop_chunk = ""  # every multipart LFS upload loses a part

        yield Target(
            "hf",
            f"hf://{REPO}/out",
            env,
            lambda: stored(prefix) if prefix.is_dir() else {},
            put,
            _server_writes(server),
            server.behaviour.log.clear,
            break_store,
            server=server,
        )


# --- the guard: no store opened on an endpoint off this machine ----------------------------


def _host(url: str | None) -> str | None:
    if not url:
        return None
    if "://" not in url:
        url = "http://" + url
    return urllib.parse.urlsplit(url).hostname


def _endpoint(scheme: str) -> str | None:
    import os

    if scheme == "s3":
        return os.environ.get("AWS_ENDPOINT_URL")
    if scheme in ("gs", "gcs"):
        return os.environ.get("STORAGE_EMULATOR_HOST")
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def loopback_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every store ckptfix opens in this process must have its endpoint on 127.0.0.1."""
    from ckptfix.write import store_output, stores

    real = stores.open_store

    def guarded(url: str, options: Any) -> Any:
        scheme = stores.store_scheme(url)
        if scheme in stores.BACKENDS and _host(_endpoint(scheme)) not in ("127.0.0.1", "localhost"):
            pytest.fail(f"a store was opened for {url} without a loopback endpoint")
        return real(url, options)

    monkeypatch.setattr(stores, "open_store", guarded)
    # store_output took it by name; the others import it when they call it
    monkeypatch.setattr(store_output, "open_store", guarded)
