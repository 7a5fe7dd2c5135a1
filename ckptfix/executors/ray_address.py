"""Which Ray cluster `--executor ray` joins, decided before Ray is asked to join it: Ray 2.60's
`ray.init` waits forever for a cluster that does not answer (RAY_ADDRESS naming a closed
port, or Ray's record of the last cluster `ray start` started on this machine, left behind
when that cluster was killed) and refuses a malformed address with a ValueError. Here the
address is found as `ray.init(address="auto")` finds it (ray._private.services:
RAY_ADDRESS; else a Ray running on this machine, or the address in
`<temp>/ray/ray_current_cluster`), checked for its form, and a connection to it tried with
a short timeout: a gRPC server must answer there, and serve Ray's GCS (ray.init asks
anything else for the cluster's id again and again, printing a line a second, for 20 s,
or for ever when the server answers garbage, a SIGTERM kept for a safe point it never
reaches)."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from types import ModuleType

from ckptfix.core.errors import ClusterError, UsageError
from ckptfix.core.text import shown

ENV = "RAY_ADDRESS"
PROBE_TIMEOUT = 3.0  # seconds: a cluster's GCS on a reachable host accepts at once
GCS_TIMEOUT = 10.0  # seconds for its first answer (a cluster's id, kept in memory)
# A GCS address as Ray's parse_address splits it: host (a name, an IPv4 address, or an
# IPv6 one in brackets) and a port; ASCII only, so nothing in it can move a terminal.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_FORM = re.compile(rf"(?P<host>{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]+\]):(?P<port>[0-9]{{1,5}})")
# A client's connection preface and an empty SETTINGS frame (RFC 9113 3.4): a gRPC server
# answers with its own SETTINGS frame; an HTTP/1 server or anything else does not.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_NOTHING = ""
_RUNNING = "the address of the Ray running on this machine"


@dataclass(frozen=True)
class Found:
    """An address to join: as given or found, and where it came from (RAY_ADDRESS, the
    current-cluster file, or a Ray process on this machine)."""

    address: str
    origin: str

    @property
    def named(self) -> bool:
        """Whether the user named it (RAY_ADDRESS): one that does not answer is an error,
        not a reason to start a local Ray."""
        return self.origin == ENV


@dataclass(frozen=True)
class Choice:
    """Join `found` (None: start a local Ray); `note` says why a found address was passed
    over."""

    found: Found | None
    note: str = ""


def host_port(address: str) -> tuple[str, int] | None:
    """`address`'s host and port, None when it is not `host:port`."""
    match = _FORM.fullmatch(address)
    if match is None or not 1 <= int(match["port"]) <= 65535:
        return None
    return match["host"].strip("[]"), int(match["port"])


def answers(address: str, timeout: float = PROBE_TIMEOUT) -> str | None:
    """None when a gRPC server (a Ray cluster's GCS) answers at `address` (host:port) within
    `timeout` seconds; else why not: "" (nothing answers), or that what answers is not gRPC
    (Ray would wait on either for ever)."""
    parts = host_port(address)
    if parts is None:
        return _NOTHING
    try:
        with socket.create_connection(parts, timeout=timeout) as connection:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return None  # a TLS handshake first: the connection is all that is checked
            connection.sendall(_HTTP2_PREFACE)
            first = _received(connection, 9)
    except (OSError, UnicodeError):  # refused, timed out, a name that does not resolve
        return _NOTHING
    # HTTP/2's server preface: a SETTINGS frame (type 4) on stream 0
    if len(first) == 9 and first[3] == 4 and first[5:9] == bytes(4):
        return _not_gcs(address)
    return "what answers there is not one (no gRPC server)"


def _not_gcs(address: str) -> str | None:
    """None when the gRPC server at `address` is a Ray cluster's GCS: it answers the first
    call ray.init makes (the cluster's id), sent with the token Ray's own clients send;
    else why not. A cluster that refuses the token is a cluster error of its own."""
    try:
        import grpc
        from ray.core.generated.gcs_service_pb2 import GetClusterIdRequest
        from ray.core.generated.gcs_service_pb2_grpc import NodeInfoGcsServiceStub
    except ImportError:  # Ray without grpcio (not the ray extra): the connection checked only
        return None
    with grpc.insecure_channel(address) as channel:
        try:
            NodeInfoGcsServiceStub(channel).GetClusterId(
                GetClusterIdRequest(), timeout=GCS_TIMEOUT, metadata=_token()
            )
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise ClusterError(
                    None,
                    f"the Ray cluster at {shown(address)} refuses this client's "
                    "authentication token",
                    "set RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN, "
                    "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), as `ray start` had them",
                ) from None
            return f"what answers there is not one (a gRPC server, not Ray's GCS: {code.name})"
    return None


def _token() -> tuple[tuple[str, str], ...]:
    """The metadata Ray's clients authenticate with (none when no token is configured)."""
    try:
        from ray._private.authentication.grpc_authentication_client_interceptor import (
            _get_authentication_metadata_tuple,
        )
    except ImportError:  # a Ray without token authentication
        return ()
    return tuple(_get_authentication_metadata_tuple())


def _received(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = connection.recv(size - len(data))
        if not more:
            break
        data += more
    return data


def choose(ray: ModuleType) -> Choice:
    """The cluster to join, as ray.init(address="auto") would find it, or a local Ray: a
    named address that is malformed is a usage error, one that does not answer a cluster
    error; a found one that does not answer (a stale record) starts a local Ray."""
    found = _find(ray)
    if found is None:
        return Choice(None)
    if found.named and host_port(found.address) is None:
        raise UsageError(
            ENV,
            f"'{shown(found.address)}' is not a Ray cluster's address (host:port)",
            "set it to the address `ray start --head` printed, e.g. 10.0.0.5:6379, or unset it",
        )
    wrong = answers(_canonical(ray, found.address))
    if wrong is None:
        return Choice(found)
    if found.named:
        raise ClusterError(
            None,
            f"no Ray cluster answers at {shown(found.address)} ({ENV}){wrong and ': '}{wrong}",
            f"start one with `ray start --head` or unset {ENV}",
        )
    where = f"{shown(found.address)}, {shown(found.origin)}"
    return Choice(None, f"no cluster answers at {where}{wrong and ': '}{wrong}")


def _find(ray: ModuleType) -> Found | None:
    """RAY_ADDRESS, else what Ray finds on this machine; None for none (or `local`)."""
    named = os.environ.get(ENV, "")
    if named == "local":
        return None
    if named and named != "auto":
        return Found(named, ENV)
    services = ray._private.services
    try:
        address = services.get_ray_address_from_environment("auto", None)
    except ConnectionError:  # no Ray process here and no record of one
        return None
    file = ray._common.utils.get_ray_address_file(None)
    recorded = address == ray._private.utils.read_ray_address()
    return Found(address, f"the address in {file}" if recorded else _RUNNING)


def _canonical(ray: ModuleType, address: str) -> str:
    """The address ray.init connects to for `address`: Ray replaces a loopback host with
    this node's address unless its cluster is kept on loopback
    (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)."""
    try:
        canonical = ray._private.services.canonicalize_bootstrap_address(address)
    except Exception:  # a form Ray does not take: probed as given, and refused there
        return address
    return canonical if isinstance(canonical, str) else address
