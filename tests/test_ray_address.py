"""Which cluster `--executor ray` joins, decided before Ray is asked (executors.ray_address):
a RAY_ADDRESS that is not `host:port` is a usage error, one where nothing answers a one-line
cluster error within seconds (Ray itself waits forever), and Ray's record of a cluster that
has stopped starts a local Ray. No cluster is started here: the ports are closed ones."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.builders import Factory
from tests.helpers import cli
from tests.optional import needs
from tests.remote_servers import http_server

pytestmark = needs("ray")


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No RAY_ADDRESS, Ray's temp folder private (its current-cluster record is ours to
    write), and Ray's scan for a Ray running on this machine finding none (another run's
    cluster on this machine would be found first: ray._private.services)."""
    from ray._private import services

    for name in ("RAY_ADDRESS", "RAY_TMPDIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(services, "find_gcs_addresses", frozenset)
    return tmp_path


def _hash_on(address: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """`ckptfix hash --executor ray` with RAY_ADDRESS=address: its error lines, checked to
    be its only output and to end it with the exit code of the error's kind."""
    monkeypatch.setenv("RAY_ADDRESS", address)
    run = cli("hash", Factory(tmp_path).safetensors("m.safetensors"), "--executor", "ray")
    assert run.stdout == "" and run.code == (2 if "rule usage" in run.stderr else 1)
    return run.stderr.splitlines()


@pytest.mark.timeout(60)  # Ray waited forever for it
def test_an_address_where_nothing_answers_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    address = f"127.0.0.1:{_closed_port()}"
    assert _hash_on(address, monkeypatch, tmp_path) == [
        f"error: no Ray cluster answers at {address} (RAY_ADDRESS) (rule cluster-failed; "
        "start one with `ray start --head` or unset RAY_ADDRESS)"
    ]


@pytest.mark.slow
@pytest.mark.timeout(60)  # Ray waited forever on it too
def test_an_address_where_something_else_answers_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An HTTP server (the dashboard's port, say) is not a cluster's GCS, a gRPC server."""
    from ray._private import ray_constants

    # As RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (tests/ray_cluster.py) keeps it, read when Ray
    # is imported: 127.0.0.1 stays 127.0.0.1 (else Ray, and so the probe, goes to this
    # node's interface address, where the loopback server does not answer).
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    with http_server(tmp_path) as server:
        address = server.url.removeprefix("http://")
        lines = _hash_on(address, monkeypatch, tmp_path)
    assert lines == [
        f"error: no Ray cluster answers at {address} (RAY_ADDRESS): what answers there is not "
        "one (no gRPC server) (rule cluster-failed; start one with `ray start --head` or unset "
        "RAY_ADDRESS)"
    ]


@contextlib.contextmanager
def _grpc_server(refuse: bool) -> Iterator[str]:
    """A gRPC server on 127.0.0.1 that serves no Ray service (every call UNIMPLEMENTED),
    or (`refuse`) answers every call UNAUTHENTICATED; yields its address."""
    import grpc

    class Refusing(grpc.GenericRpcHandler):  # type: ignore[misc]
        def service(self, details: Any) -> Any:
            def refused(request: bytes, context: Any) -> None:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "no token")

            return grpc.unary_unary_rpc_method_handler(refused)

    server = grpc.server(ThreadPoolExecutor(max_workers=2), handlers=[Refusing()] if refuse else [])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


@contextlib.contextmanager
def _settings_then_garbage() -> Iterator[str]:
    """A server that answers as an HTTP/2 server does (a SETTINGS frame), then with bytes
    that are no HTTP/2 frame; yields its address."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    connections: list[socket.socket] = []  # left open: the client sees the garbage

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            connections.append(connection)
            connection.recv(100)
            connection.sendall(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]) + b"garbage" * 100)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for connection in [*connections, listener]:
            connection.close()


@pytest.mark.timeout(60)  # Ray printed its log lines for 20 s, or waited forever
@pytest.mark.parametrize("server", ["grpc", "garbage", "refusing"])
def test_a_server_that_is_not_a_clusters_gcs_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, server: str
) -> None:
    """A gRPC server of another program, one that answers garbage once it has said it speaks
    HTTP/2, and one that refuses the client's token (a cluster of another token)."""
    from ray._private import ray_constants

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)  # see the test above
    opened = _settings_then_garbage() if server == "garbage" else _grpc_server(server == "refusing")
    with opened as address:
        lines = _hash_on(address, monkeypatch, tmp_path)
    if server == "refusing":
        assert lines == [
            f"error: the Ray cluster at {address} refuses this client's authentication token "
            "(rule cluster-failed; set RAY_AUTH_MODE=token and the cluster's token "
            "(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), as `ray start` had them)"
        ]
        return
    status = "UNIMPLEMENTED" if server == "grpc" else "UNAVAILABLE"
    assert lines == [
        f"error: no Ray cluster answers at {address} (RAY_ADDRESS): what answers there is not "
        f"one (a gRPC server, not Ray's GCS: {status}) (rule cluster-failed; start one with "
        "`ray start --head` or unset RAY_ADDRESS)"
    ]


@pytest.mark.parametrize(
    ("address", "shown"),
    [
        ("not a host", "not a host"),
        ("http://127.0.0.1:1", "http://127.0.0.1:1"),
        ("127.0.0.1:1\x1b[31mRED", "127.0.0.1:1\\x1b[31mRED"),
        ("127.0.0.1:70000", "127.0.0.1:70000"),
    ],
)
def test_an_address_that_is_not_host_port_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, address: str, shown: str
) -> None:
    assert _hash_on(address, monkeypatch, tmp_path) == [
        f"error: RAY_ADDRESS: '{shown}' is not a Ray cluster's address (host:port) (rule "
        "usage; set it to the address `ray start --head` printed, e.g. 10.0.0.5:6379, or "
        "unset it)"
    ]


class _Started(Exception):
    """What the fake ray.init raises once it has recorded how it was called."""


def test_a_stale_current_cluster_record_starts_a_local_ray(
    no_cluster: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record a killed `ray start` leaves: ray.init(address="auto") would wait on it
    forever; ckptfix probes it and starts a local Ray instead ("local": Ray does not look
    for the record again), saying why."""
    import ray

    from ckptfix.executors import ray_address, ray_cluster

    record = no_cluster / "ray" / "ray_current_cluster"
    record.parent.mkdir()
    address = f"127.0.0.1:{_closed_port()}"
    record.write_text(address)
    calls: list[dict[str, Any]] = []

    def init(**options: Any) -> None:
        calls.append(options)
        raise _Started

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(_Started):
        ray_cluster.connect()
    assert [call.get("address") for call in calls] == ["local"]
    choice = ray_address.choose(ray)
    assert choice.found is None
    assert choice.note == f"no cluster answers at {address}, the address in {record}"
