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
from tests.remote_servers import S3_ENV, moto_server, upload_tree

pytest.importorskip("s3fs", reason="the remote extra is not installed")
pytest.importorskip("moto", reason="moto[server] is not installed")
pytestmark = pytest.mark.slow  # moto's server takes a second or two to start

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
