"""Checkpoints read from S3 (moto's server on 127.0.0.1, found through AWS_ENDPOINT_URL as
any S3-compatible endpoint is): the same report as the local copy, few requests, the error
lines, and objects replaced during a convert (plain and versioned buckets)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.builders import Factory, Spec, hostile_checkpoint, hostile_pickles
from tests.helpers import cli, local_fixes
from tests.optional import needs
from tests.remote_servers import S3_ENV, moto_server, upload_tree

pytestmark = [
    needs("botocore", "moto"),
    pytest.mark.slow,
]  # moto's server takes a second or two to start

FAST = {"CKPTFIX_REMOTE_RETRIES": "1", "CKPTFIX_REMOTE_BACKOFF": "0.01"}
# Never ask the EC2 instance metadata service (a link-local address) for credentials.
NO_METADATA = {"AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_server() as url:
        yield url


@pytest.fixture
def s3(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A boto3 client of the moto server, with the environment ckptfix reads it through."""
    import boto3

    for name, value in {**S3_ENV, **FAST, **NO_METADATA, "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(name, value)
    return boto3.client("s3")


_buckets = iter(range(10**6))


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"models-{next(_buckets)}"
    s3.create_bucket(Bucket=name)
    return name


def _model(factory: Factory) -> Path:
    folder = factory.sharded("m", [[Spec("a"), Spec("b")], [Spec("c")], [Spec("d")]])
    factory.safetensors("m/model-00009-of-00009.safetensors", [Spec("orphan")])
    (folder / "model-00003-of-00003.safetensors").unlink()  # the index now points nowhere
    factory.config("m", tie_word_embeddings=True)
    hostile = hostile_pickles(factory.root / "CANARY")["global-os-system"]
    hostile_checkpoint(factory.path("m/extra.bin"), hostile, "legacy")
    factory.lfs_pointer("m/adapter_model.safetensors")
    return folder


def _same(local: Path, url: str, prefix: str) -> dict[str, Any]:
    want = cli("inspect", local, "--json", "--fail-on", "never")
    got = cli("inspect", url, "--json", "--fail-on", "never")
    assert got.code == 0, got.stderr
    document = got.json()
    remote = document.pop("remote")
    found = json.loads(json.dumps(document).replace(prefix, str(local)))
    assert local_fixes(found, local) == want.json()
    return dict(remote)


def test_a_folder_reports_what_the_local_copy_does(s3: Any, bucket: str, tmp_path: Path) -> None:
    folder = _model(Factory(tmp_path))
    upload_tree(s3, bucket, folder, "m")
    remote = _same(folder, f"s3://{bucket}/m", f"s3://{bucket}/m")
    # an info, a listing, and one read for each of the 7 files (S3 listings say size and ETag)
    assert remote["requests"] == 2 + 7
    assert not (tmp_path / "CANARY").exists()


def test_a_file_and_a_trailing_slash(s3: Any, bucket: str, tmp_path: Path) -> None:
    path = Factory(tmp_path).safetensors("model.safetensors", [Spec("w")])
    s3.upload_file(str(path), bucket, "dir/model.safetensors")
    remote = _same(
        path, f"s3://{bucket}/dir/model.safetensors", f"s3://{bucket}/dir/model.safetensors"
    )
    assert remote["requests"] == 2
    folder = Factory(tmp_path / "f").sharded("m", [[Spec("a")]])
    upload_tree(s3, bucket, folder, "slash")
    _same(folder, f"s3://{bucket}/slash/", f"s3://{bucket}/slash")


def test_a_50_shard_folder(s3: Any, bucket: str, tmp_path: Path) -> None:
    shards = [[Spec(f"layer.{i}.{j}", "F32", (64, 64)) for j in range(4)] for i in range(50)]
    folder = Factory(tmp_path).sharded("m", shards)
    upload_tree(s3, bucket, folder, "m")
    run = cli("inspect", f"s3://{bucket}/m", "--json")
    assert run.code == 0, run.stderr
    remote = run.json()["remote"]
    assert remote["requests"] == 2 + 51
    assert remote["bytes_fetched"] < 5_000_000


def _error(args: list[str], rule: str) -> str:
    run = cli(*args)
    assert run.code == 1, (run.code, run.stderr)
    assert len(run.error_lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert f"(rule {rule};" in run.error_lines[0], run.error_lines[0]
    return run.error_lines[0]


def test_not_found(s3: Any, bucket: str) -> None:
    line = _error(["inspect", f"s3://{bucket}/nothing/model.safetensors"], "remote-not-found")
    assert line.startswith(f"error: s3://{bucket}/nothing/model.safetensors: no such file")
    _error(["inspect", "s3://no-such-bucket/model"], "remote-not-found")


def test_no_credentials(
    s3: Any, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    line = _error(["inspect", f"s3://{bucket}/m"], "remote-credentials")
    assert "no credentials were found" in line
    assert "AWS_ACCESS_KEY_ID" in line


def _replace_during_convert(s3: Any, bucket: str, tmp_path: Path) -> tuple[Exception, Path]:
    import ckptfix
    from ckptfix.core.errors import CkptfixError
    from ckptfix.ops.rewrite import ConvertOptions

    folder = Factory(tmp_path / "src").sharded(
        "m", [[Spec("a", "F32", (256, 256))], [Spec("b", "F32", (256, 256))]]
    )
    upload_tree(s3, bucket, folder, "m")
    key = "m/model-00002-of-00002.safetensors"
    data = (folder / "model-00002-of-00002.safetensors").read_bytes()
    replaced: list[bool] = []

    def progress(done: int, total: int) -> None:
        if not replaced:  # the first shard is copied: an upload replaces the second
            s3.put_object(Bucket=bucket, Key=key, Body=data[:-4] + b"\x01\x02\x03\x04")
            replaced.append(True)

    out = tmp_path / "out"
    with pytest.raises(CkptfixError) as raised:
        ckptfix.convert(f"s3://{bucket}/m", out, ConvertOptions(max_shard=10**9, progress=progress))
    assert replaced
    assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no staging folder left
    return raised.value, out


def test_an_object_replaced_during_convert_is_an_error(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    error, _ = _replace_during_convert(s3, bucket, tmp_path)
    assert error.rule == "remote-changed"  # the next read, pinned by If-Match, got a 412


def test_a_versioned_object_replaced_during_convert_is_an_error(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    error, _ = _replace_during_convert(s3, bucket, tmp_path)
    # reads stay on the listed version; the change token asked again at the end differs
    assert "changed while it was being read" in error.what


def test_hash_of_an_s3_folder(s3: Any, bucket: str, tmp_path: Path) -> None:
    folder = Factory(tmp_path).sharded("m", [[Spec("a", "BF16", (300, 70))], [Spec("b")]])
    upload_tree(s3, bucket, folder, "m")
    want, got = cli("hash", folder, "--json"), cli("hash", f"s3://{bucket}/m", "--json")
    assert got.code == 0, got.stderr
    assert got.json()["digest"] == want.json()["digest"]


# --- botocore: what is imported, how the client asks, how it fails ------------------------------

_IMPORTED = """
import json, sys
from ckptfix.cli.entry import main
sys.argv = ["ckptfix", "inspect", sys.argv[1], "--json"]
try:
    main()
except SystemExit:
    pass
heavy = ("s3fs", "aiobotocore", "aiohttp", "fsspec", "boto3", "gcsfs", "huggingface_hub")
print(json.dumps({name: name in sys.modules for name in ("botocore", *heavy)}), file=sys.stderr)
"""


def test_the_s3_path_imports_botocore_and_nothing_async(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    import subprocess
    import sys

    folder = Factory(tmp_path).sharded("m", [[Spec("a")], [Spec("b")]])
    upload_tree(s3, bucket, folder, "m")
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTED, f"s3://{bucket}/m"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert json.loads(done.stdout)["remote"]["requests"] == 2 + 3, done.stderr
    loaded = json.loads(done.stderr.splitlines()[-1])
    assert loaded.pop("botocore")
    assert not any(loaded.values()), loaded


def _put_many(s3: Any, bucket: str, folder: Path, prefix: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def put(path: Path) -> None:
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=path.read_bytes())

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, sorted(folder.iterdir())))


def test_a_folder_listed_over_several_pages(s3: Any, bucket: str, tmp_path: Path) -> None:
    factory = Factory(tmp_path)
    factory.safetensors("m/model.safetensors", [Spec("w")])
    factory.config("m")
    for number in range(1000):  # "extra-…" sorts before "model…": the model is on page 2
        factory.bytes(f"m/extra-{number:04d}.txt", b"x")
    _put_many(s3, bucket, tmp_path / "m", "m")
    remote = _same(tmp_path / "m", f"s3://{bucket}/m", f"s3://{bucket}/m")
    assert remote["requests"] == 2 + 2  # the listing's two pages are one call
    from ckptfix.io.remote_folder import open_url

    target = open_url(f"s3://{bucket}/m")
    assert len(target.folder.listdir(target.url)) == 1002


def test_env_credentials_ask_no_instance_metadata(
    s3: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.remote_servers import http_server

    path = Factory(tmp_path).safetensors("model.safetensors", [Spec("w")])
    s3.upload_file(str(path), bucket, "model.safetensors")
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
    with http_server(tmp_path) as metadata:  # stands in for the instance metadata service
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", metadata.url)
        run = cli("inspect", f"s3://{bucket}/model.safetensors", "--json")
        assert run.code == 0, run.stderr
        assert metadata.behaviour.requests == 0
        # without credentials in the environment, botocore does ask it (so it was reachable)
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(name)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        _error(["inspect", f"s3://{bucket}/model.safetensors"], "remote-credentials")
        assert metadata.behaviour.requests > 0


def test_credentials_from_a_shared_credentials_file(
    s3: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = Factory(tmp_path).safetensors("model.safetensors", [Spec("w")])
    s3.upload_file(str(path), bucket, "model.safetensors")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    credentials = tmp_path / "credentials"
    credentials.write_text("[reader]\naws_access_key_id = testing\naws_secret_access_key = x\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_PROFILE", "reader")
    run = cli("inspect", f"s3://{bucket}/model.safetensors", "--json")
    assert run.code == 0, run.stderr


def _moto_authentication(endpoint: str, count: bytes) -> None:
    """How many requests moto's server serves before it checks signatures against its IAM
    users (b"inf": never, its default)."""
    import urllib.request

    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth",
        data=count,
        method="POST",
        headers={"Content-Type": "text/plain"},
    )
    urllib.request.urlopen(request).close()


@pytest.fixture
def locked(s3: Any, bucket: str, endpoint: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    """A model at s3://bucket/m on a server that checks every request's signature; yields
    the keys of an IAM user who may list the bucket but not read its objects."""
    import boto3

    folder = Factory(tmp_path).sharded("m", [[Spec("a")]])
    upload_tree(s3, bucket, folder, "m")
    iam = boto3.client("iam")
    user = f"lister-{next(_buckets)}"
    iam.create_user(UserName=user)
    key = iam.create_access_key(UserName=user)["AccessKey"]
    statement = {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": "*"}
    iam.put_user_policy(
        UserName=user,
        PolicyName="list-only",
        PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [statement]}),
    )
    _moto_authentication(endpoint, b"0")
    try:
        yield {
            "id": key["AccessKeyId"],
            "secret": key["SecretAccessKey"],
            "url": f"s3://{bucket}/m",
        }
    finally:
        _moto_authentication(endpoint, b"inf")


def test_credentials_refused_and_a_read_forbidden(
    locked: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = locked["url"]
    line = _error(["inspect", url], "remote-credentials")  # "testing" is no IAM user's key
    assert "the credentials were refused (InvalidAccessKeyId)" in line
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", locked["id"])
    line = _error(["inspect", url], "remote-credentials")
    assert "the credentials were refused (SignatureDoesNotMatch)" in line
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", locked["secret"])  # may list, not read
    line = _error(["inspect", url], "remote-forbidden")
    assert line.startswith(f"error: {url}/model-00001-of-00001.safetensors: access denied")


# --- botocore against a server that fails: ckptfix's retries only, timeouts, no server ---------


@pytest.fixture
def failing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    """The tests' HTTP server as the S3 endpoint (for failures only: it speaks no S3)."""
    from tests.remote_servers import http_server

    for name, value in {**S3_ENV, **NO_METADATA, "CKPTFIX_REMOTE_BACKOFF": "0.01"}.items():
        monkeypatch.setenv(name, value)
    with http_server(tmp_path) as server:
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
        yield server


def test_botocore_makes_one_attempt_and_ckptfix_the_retries(
    failing: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "2")
    failing.behaviour.fail_next = 100  # every request answers 503
    line = _error(["inspect", "s3://bucket/m"], "remote-server-error")
    assert "the server failed (HTTP 503) after 3 attempts" in line
    assert failing.behaviour.requests == 3  # botocore tried each once


def test_a_server_that_does_not_answer_in_time(
    failing: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "0.2")
    failing.behaviour.delay = 1.0
    _error(["inspect", "s3://bucket/model.safetensors"], "remote-timeout")


def test_an_unreachable_endpoint(failing: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{probe.getsockname()[1]}")
    line = _error(["inspect", "s3://bucket/m"], "remote-unreachable")
    assert "the connection failed" in line


def test_a_server_that_ignores_range(failing: Any, tmp_path: Path) -> None:
    # HEAD answers as S3 would (size, ETag); the ranged GET gets the whole file with a 200
    path = Factory(tmp_path).safetensors(
        "bucket/model.safetensors", [Spec("w", "F32", (4096, 4096))]
    )
    failing.behaviour.ignore_range = True
    line = _error(["inspect", "s3://bucket/model.safetensors"], "remote-no-range")
    assert line.startswith("error: s3://bucket/model.safetensors: the server ignores range")
    # refused from the status line: the connection is closed with the 64 MiB body unread
    assert failing.behaviour.gets() == ["bytes=0-65535"]
    assert failing.behaviour.bytes_sent < path.stat().st_size // 4


def test_reads_are_pinned_to_the_etag_or_the_version(s3: Any, bucket: str, tmp_path: Path) -> None:
    from ckptfix.io.remote import Settings
    from ckptfix.io.remote_s3 import s3_client

    path = Factory(tmp_path).safetensors("model.safetensors", [Spec("w")])
    s3.upload_file(str(path), bucket, "model.safetensors")
    sent: list[tuple[str | None, str | None]] = []

    def sending(request: Any, **_: Any) -> None:
        pin = request.headers.get("If-Match")
        version = request.url.partition("versionId=")[2]
        sent.append((pin.decode() if isinstance(pin, bytes) else pin, version))

    client = s3_client(Settings.from_env())
    client.meta.events.register("before-send.s3.GetObject", sending)
    try:
        assert cli("inspect", f"s3://{bucket}/model.safetensors").code == 0
        s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
        s3.upload_file(str(path), bucket, "model.safetensors")  # now a version
        assert cli("inspect", f"s3://{bucket}/model.safetensors").code == 0
    finally:
        client.meta.events.unregister("before-send.s3.GetObject", sending)
    head = s3.head_object(Bucket=bucket, Key="model.safetensors")
    assert sent == [(head["ETag"], ""), (None, head["VersionId"])]


# --- concurrency: the shards' reads in flight at once, never more than the bound --------------


def test_requests_in_flight_are_bounded(
    s3: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    from ckptfix.io.remote import Settings
    from ckptfix.io.remote_s3 import s3_client

    folder = Factory(tmp_path).sharded("m", [[Spec(f"t{i}")] for i in range(12)])
    upload_tree(s3, bucket, folder, "m")
    monkeypatch.setenv("CKPTFIX_REMOTE_CONCURRENCY", "3")
    lock, now, most = threading.Lock(), [0], [0]

    def sending(**_: Any) -> None:  # botocore's hook just before a GetObject is sent
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.05)  # long enough for the other threads to reach theirs
        with lock:
            now[0] -= 1

    client = s3_client(Settings.from_env())  # the client the run below shares
    client.meta.events.register("before-send.s3.GetObject", sending)
    try:
        run = cli("inspect", f"s3://{bucket}/m", "--json")
    finally:
        client.meta.events.unregister("before-send.s3.GetObject", sending)
    assert run.code == 0, run.stderr
    assert run.json()["remote"]["requests"] == 2 + 13
    assert most[0] == 3


# --- tensor data from S3: hash, diff and convert agree with the local copy, in bounded memory --


def test_diff_and_convert_from_s3_match_the_local_copy(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    from tests.helpers import tree_digests

    factory = Factory(tmp_path / "src")
    folder = factory.sharded("m", [[Spec("a", "BF16", (300, 70))], [Spec("b"), Spec("c")]])
    factory.bytes("m/tokenizer.json", b'{"version": "1.0"}')
    upload_tree(s3, bucket, folder, "m")
    url = f"s3://{bucket}/m"
    assert cli("diff", folder, url, "--json").code == 0
    want = cli("convert", folder, "-o", tmp_path / "local", "--max-shard", "30KB")
    got = cli("convert", url, "-o", tmp_path / "remote", "--max-shard", "30KB", "--json")
    assert want.code == got.code == 0, got.stderr
    assert tree_digests(tmp_path / "remote") == tree_digests(tmp_path / "local")
    assert (
        got.json()["remote"]["bytes_fetched"]
        >= (folder / "model-00001-of-00002.safetensors").stat().st_size
    )


def test_a_256_mib_tensor_streams_in_bounded_memory(s3: Any, bucket: str, tmp_path: Path) -> None:
    from tests.helpers import measured

    data = bytes(range(256)) * (2**20)  # 256 MiB, one F32 tensor
    path = Factory(tmp_path).safetensors("big.safetensors", [Spec("w", "F32", (2**26,), data)])
    s3.upload_file(str(path), bucket, "big.safetensors")
    url = f"s3://{bucket}/big.safetensors"
    base = measured("inspect", url)
    hashed = measured("hash", url, "--json")
    converted = measured("convert", url, "-o", tmp_path / "out", "--json")
    assert base.code == hashed.code == converted.code == 0, converted.stderr
    assert json.loads(hashed.stdout)["digest"] == cli("hash", path, "--json").json()["digest"]
    assert (tmp_path / "out" / "model.safetensors").stat().st_size == path.stat().st_size
    # copied by ranged reads and read back to verify: the tensor's bytes twice, little more
    remote = json.loads(converted.stdout)["remote"]
    assert abs(remote["bytes_fetched"] - 2 * len(data)) < 2**20, remote
    # hashed and copied in 16 MiB ranges: far less than the tensor's 256 MiB, whatever the
    # machine's load (copied in 64 MiB ranges, a convert took 155 MiB more under load)
    assert hashed.peak_rss - base.peak_rss < 64 * 2**20, (hashed.peak_rss, base.peak_rss)
    assert converted.peak_rss - base.peak_rss < 64 * 2**20, (converted.peak_rss, base.peak_rss)
