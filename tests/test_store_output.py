"""Rewrites written to S3 (`-o s3://bucket/prefix`), against moto's server on 127.0.0.1 behind
a loopback proxy that can misbehave (tests/store_proxy.py): the objects are bitwise the
local output's, --force replaces an older checkpoint without a moment where its index
points at new shards, and every failure is one line, exit 1, with no index published."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.builders import Factory, Spec
from tests.helpers import cli
from tests.optional import needs
from tests.remote_servers import upload_tree
from tests.store_helpers import (
    big_model,
    folder_files,
    fresh_env,
    names,
    new_bucket,
    objects,
    proxied_moto,
    small_model,
    torch_model,
    uploads,
)
from tests.store_proxy import Proxy

pytestmark = [needs("botocore", "moto"), pytest.mark.slow]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[str, Proxy]]:
    with proxied_moto() as running:
        yield running


@pytest.fixture
def proxy(servers: tuple[str, Proxy], monkeypatch: pytest.MonkeyPatch) -> Proxy:
    fresh_env(servers[1], monkeypatch.setenv)
    return servers[1]


@pytest.fixture
def s3(servers: tuple[str, Proxy], proxy: Proxy) -> Any:
    """A boto3 client of moto itself; ckptfix reaches moto through the proxy."""
    import boto3

    return boto3.client("s3", endpoint_url=servers[0])


_buckets = iter(range(10**6))


@pytest.fixture
def bucket(s3: Any) -> Iterator[str]:
    yield from new_bucket(s3, f"out-{next(_buckets)}")


def _same_as_local(s3: Any, bucket: str, local: Path) -> None:
    assert objects(s3, bucket, "out") == folder_files(local)


@pytest.mark.parametrize(
    "command",
    [
        ["reshard", "--max-shard", "20MB"],
        ["reshard"],  # one file: published by its completion
        ["convert", "--dtype", "bf16", "--max-shard", "10MB"],
        ["dedupe", "--by-content"],
    ],
)
def test_every_command_writes_the_bytes_it_writes_locally(
    s3: Any, bucket: str, tmp_path: Path, command: list[str]
) -> None:
    folder = small_model(Factory(tmp_path))
    local = cli(command[0], folder, "-o", tmp_path / "local", *command[1:])
    assert local.code == 0, local.stderr
    run = cli(command[0], folder, "-o", f"s3://{bucket}/out", *command[1:], "--json")
    assert run.code == 0, run.stderr
    _same_as_local(s3, bucket, tmp_path / "local")
    upload = run.json()["written"]["upload"]
    assert upload["bytes_sent"] == sum(map(len, folder_files(tmp_path / "local").values()))
    assert uploads(s3, bucket) == []


def test_a_torch_checkpoint_converts_to_s3_as_it_does_locally(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    source = torch_model(tmp_path)
    assert cli("convert", source, "-o", tmp_path / "local", "--max-shard", "10MB").code == 0
    run = cli("convert", source, "-o", f"s3://{bucket}/out", "--max-shard", "10MB")
    assert run.code == 0, run.stderr
    _same_as_local(s3, bucket, tmp_path / "local")
    from safetensors.torch import load

    shards = objects(s3, bucket, "out")
    loaded = {
        k: v
        for name, data in shards.items()
        if name.endswith(".safetensors")
        for k, v in load(data).items()
    }
    assert loaded["embed.weight"].shape == (3 * 2**10, 2**11)


def test_s3_to_s3_writes_what_a_local_rewrite_writes(s3: Any, bucket: str, tmp_path: Path) -> None:
    folder = small_model(Factory(tmp_path))
    upload_tree(s3, bucket, folder, "src")
    local = cli("reshard", folder, "-o", tmp_path / "local", "--max-shard", "20MB")
    assert local.code == 0, local.stderr
    run = cli("reshard", f"s3://{bucket}/src", "-o", f"s3://{bucket}/out", "--max-shard", "20MB")
    assert run.code == 0, run.stderr
    _same_as_local(s3, bucket, tmp_path / "local")


def test_the_library_saves_to_s3_what_it_saves_locally(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    import torch

    import ckptfix

    tensors = {"a": torch.arange(10 * 2**20, dtype=torch.int32), "b": torch.ones(3, 5).t()}
    ckptfix.save(tensors, tmp_path / "local", max_shard="20MB")
    ckptfix.save(tensors, f"s3://{bucket}/out", max_shard="20MB")
    _same_as_local(s3, bucket, tmp_path / "local")
    with pytest.raises(ckptfix.UsageError, match="not empty"):
        ckptfix.save(tensors, f"s3://{bucket}/out")


def test_a_non_empty_prefix_is_refused_without_force(s3: Any, bucket: str, tmp_path: Path) -> None:
    folder = small_model(Factory(tmp_path))
    s3.put_object(Bucket=bucket, Key="out/notes.xlsx", Body=b"mine")
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out")
    assert run.code == 2 and "not empty" in run.stderr and len(run.error_lines) == 1
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out", "--force")
    assert run.code == 2 and "notes.xlsx" in run.stderr and "--replace-any" in run.stderr
    assert names(s3, bucket, "out") == ["notes.xlsx"]
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out", "--force", "--replace-any", "--json")
    assert run.code == 0, run.stderr
    assert "notes.xlsx" not in names(s3, bucket, "out")
    assert f"s3://{bucket}/out/notes.xlsx" in run.json()["written"]["replaced"]


def _index_put_at(log: list[tuple[str, str]], index: str) -> int:
    return next(
        i
        for i, (method, path) in enumerate(log)
        if method == "PUT" and path.split("?")[0].endswith(index)
    )


def test_force_deletes_the_older_checkpoints_objects_after_the_new_index(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path
) -> None:
    folder = small_model(Factory(tmp_path))
    assert cli("reshard", folder, "-o", f"s3://{bucket}/out", "--max-shard", "10MB").code == 0
    old = names(s3, bucket, "out")
    proxy.faults.log.clear()
    run = cli(
        "reshard", folder, "-o", f"s3://{bucket}/out", "--force", "--max-shard", "20MB", "--json"
    )
    assert run.code == 0, run.stderr
    stale = sorted(set(old) - set(names(s3, bucket, "out")))
    assert stale == [name for name in old if name.endswith("-of-00003.safetensors")]
    written = run.json()["written"]
    index = f"s3://{bucket}/out/model.safetensors.index.json"
    # the old index went first, before config.json (a name both hold) was put again
    assert written["upload"]["removed_first"] == [index]
    assert sorted(written["replaced"]) == sorted(
        [index, *(f"s3://{bucket}/out/{n}" for n in stale)]
    )
    log = proxy.faults.log
    deleted = [i for i, (method, path) in enumerate(log) if method == "POST" and "delete" in path]
    assert deleted and max(deleted) > _index_put_at(log, "model.safetensors.index.json")
    assert min(deleted) < _index_put_at(log, "config.json")
    assert (
        "deleted after the new index was published"
        in cli(
            "reshard", folder, "-o", f"s3://{bucket}/out", "--force", "--max-shard", "10MB"
        ).stdout
    )


def test_force_over_shards_of_the_same_names_removes_the_old_index_first(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path
) -> None:
    factory = Factory(tmp_path)
    first = big_model(factory, "one", shards=2, seed="x")
    second = big_model(factory, "two", shards=2, seed="y")
    assert cli("reshard", first, "-o", f"s3://{bucket}/out", "--max-shard", "40MB").code == 0
    proxy.faults.log.clear()
    run = cli(
        "reshard", second, "-o", f"s3://{bucket}/out", "--max-shard", "40MB", "--force", "--json"
    )
    assert run.code == 0, run.stderr
    upload = run.json()["written"]["upload"]
    assert upload["removed_first"] == [f"s3://{bucket}/out/model.safetensors.index.json"]
    log = proxy.faults.log
    first_delete = next(i for i, (m, p) in enumerate(log) if m == "POST" and "delete" in p)
    first_part = next(i for i, (m, p) in enumerate(log) if m == "PUT" and "partNumber" in p)
    assert first_delete < first_part  # the old index was gone before any shard was replaced
    local = cli("reshard", second, "-o", tmp_path / "local", "--max-shard", "40MB")
    assert local.code == 0
    _same_as_local(s3, bucket, tmp_path / "local")


def _no_index(s3: Any, bucket: str) -> None:
    assert not [name for name in names(s3, bucket, "out") if name.endswith(".index.json")]
    assert uploads(s3, bucket) == []


@pytest.mark.parametrize("fault", ["lie_checksum", "corrupt_part", "drop_part"])
def test_a_store_that_does_not_hold_what_was_sent_fails_the_run(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path, fault: str
) -> None:
    folder = big_model(Factory(tmp_path), shards=2)
    setattr(proxy.faults, fault, True if fault == "lie_checksum" else 3)
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out", "--max-shard", "40MB")
    assert run.code == 1, run.stderr
    assert len(run.error_lines) == 1 and run.error_lines[0].startswith("error: s3://"), run.stderr
    assert "Traceback" not in run.stderr
    _no_index(s3, bucket)


def test_a_single_file_that_fails_its_check_is_not_left_behind(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path
) -> None:
    folder = big_model(Factory(tmp_path), shards=1)
    proxy.faults.lie_checksum = True
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out")
    assert run.code == 1 and "crc32" in run.stderr, run.stderr
    assert "model.safetensors" not in names(s3, bucket, "out")


@pytest.mark.parametrize(
    ("status", "rule"), [(403, "remote-forbidden"), (500, "remote-server-error")]
)
def test_refused_uploads_are_one_line_errors(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path, status: int, rule: str
) -> None:
    folder = small_model(Factory(tmp_path))
    proxy.faults.refuse = lambda method, path: status if method == "PUT" else None
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out", "--max-shard", "10MB")
    assert run.code == 1 and len(run.error_lines) == 1, run.stderr
    assert f"rule {rule}" in run.stderr
    _no_index(s3, bucket)


def test_a_missing_bucket_and_missing_credentials_are_one_line_errors(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = small_model(Factory(tmp_path))
    run = cli("reshard", folder, "-o", "s3://no-such-bucket-here/out")
    assert run.code == 1 and "rule remote-not-found" in run.stderr and len(run.error_lines) == 1
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    run = cli("reshard", folder, "-o", "s3://any-bucket/out")
    assert run.code == 1 and "rule remote-credentials" in run.stderr, run.stderr


@pytest.mark.parametrize("url", ["ftp://host/out", "az://container/out", "file:///tmp/out"])
def test_other_url_schemes_are_usage_errors_not_local_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """pathlib folded `ftp://host/out` into the relative folder `ftp:/host/out`, which was
    written, and printed with the URL's password."""
    folder = small_model(Factory(tmp_path / "in"))
    monkeypatch.chdir(tmp_path)
    run = cli("reshard", folder, "-o", url)
    [line] = run.error_lines
    scheme = url.partition("://")[0]
    assert run.code == 2 and f"{scheme}:// is not a URL scheme ckptfix reads or writes" in line
    assert os.listdir(tmp_path) == ["in"]


def test_credentials_in_the_url_are_never_printed(s3: Any, bucket: str, tmp_path: Path) -> None:
    folder = small_model(Factory(tmp_path))
    run = cli("reshard", folder, "-o", "az://user:hunter2@bucket/out")
    assert run.code == 2 and "hunter2" not in run.stderr + run.stdout


@pytest.mark.parametrize("name", ["../escape.bin", "tab\there.json", "x\x1b[2J.safetensors"])
def test_hostile_object_names_under_the_prefix_are_left_alone(
    s3: Any, bucket: str, tmp_path: Path, name: str
) -> None:
    folder = small_model(Factory(tmp_path))
    s3.put_object(Bucket=bucket, Key=f"out/{name}", Body=b"x")
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out", "--force", "--replace-any")
    assert run.code == 1 and "rule store-object-name" in run.stderr, run.stderr
    assert len(run.error_lines) == 1 and "\x1b" not in run.stderr
    assert names(s3, bucket, "out") == [name]


def test_dry_run_names_the_destination_and_sends_nothing(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path
) -> None:
    folder = small_model(Factory(tmp_path))
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out", "--dry-run", "--json")
    assert run.code == 0, run.stderr
    assert run.json()["written"] is None and run.json()["destination"] == f"s3://{bucket}/out"
    assert not [m for m, p in proxy.faults.log if m in ("PUT", "POST", "DELETE")]
    assert names(s3, bucket, "out") == []


def test_verify_readback_reads_every_object_back(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path
) -> None:
    folder = big_model(Factory(tmp_path), shards=2)
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out", "--verify-readback", "--json")
    assert run.code == 0, run.stderr
    assert run.json()["written"]["upload"]["read_back"] is True
    ranged = [p for m, p in proxy.faults.log if m == "GET" and "model.safetensors" in p]
    assert len(ranged) >= 4  # 67 MB read back in 16 MiB ranges


def test_fix_writes_to_s3_what_it_writes_locally(s3: Any, bucket: str, tmp_path: Path) -> None:
    factory = Factory(tmp_path)
    factory.safetensors("f/model.safetensors", [Spec("w", "F32", (2048, 2048))], with_format=False)
    factory.config("f")
    local = cli("fix", tmp_path / "f", "-o", tmp_path / "local")
    assert local.code == 0, local.stderr
    run = cli("fix", tmp_path / "f", "-o", f"s3://{bucket}/out", "--json")
    assert run.code == 0, run.stderr
    _same_as_local(s3, bucket, tmp_path / "local")
    assert run.json()["written"]["upload"]["bytes_sent"] == sum(
        map(len, folder_files(tmp_path / "local").values())
    )
    again = cli("fix", tmp_path / "f", "-o", f"s3://{bucket}/out")
    assert again.code == 2 and "not empty" in again.stderr


def test_hash_writes_its_manifest_to_s3(s3: Any, bucket: str, tmp_path: Path) -> None:
    folder = small_model(Factory(tmp_path))
    local = cli("hash", folder, "--manifest", tmp_path / "m.json", "--json")
    assert local.code == 0, local.stderr
    run = cli("hash", folder, "--manifest", f"s3://{bucket}/out/m.json", "--json")
    assert run.code == 0, run.stderr
    assert objects(s3, bucket, "out") == {"m.json": (tmp_path / "m.json").read_bytes()}
    assert run.json()["manifest"]["replaced"] is False
    again = cli("hash", folder, "--manifest", f"s3://{bucket}/out/m.json", "--json")
    assert again.json()["manifest"]["replaced"] is True
    checked = cli("inspect", folder, "--manifest", tmp_path / "m.json")
    assert checked.code == 0, checked.stderr
    upload_tree(s3, bucket, folder, "src")
    inside = cli("hash", f"s3://{bucket}/src", "--manifest", f"s3://{bucket}/src/m.json")
    assert inside.code == 2 and "inside the input" in inside.stderr


@pytest.mark.parametrize(
    ("lie", "expected"),
    [
        (lambda xml: xml.replace(b"<Size>", b"<Size>-"), "without a size"),
        (lambda xml: xml.replace(b"<Key>out/", b"<Key>elsewhere/"), "outside the prefix"),
        (lambda xml: xml.replace(b"<Size>", b"<Size>x"), "rule remote-error"),
    ],
)
def test_a_listing_that_lies_is_a_one_line_error(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path, lie: Any, expected: str
) -> None:
    folder = small_model(Factory(tmp_path))
    s3.put_object(Bucket=bucket, Key="out/config.json", Body=b"{}")
    proxy.faults.listing = lie
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out", "--force")
    assert run.code == 1 and len(run.error_lines) == 1 and expected in run.stderr, run.stderr
    assert names(s3, bucket, "out") == ["config.json"]


def test_resume_trusts_the_object_not_a_listing_that_lies_about_its_size(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path
) -> None:
    folder = big_model(Factory(tmp_path), shards=2)
    planned = cli("reshard", folder, "-o", tmp_path / "local", "--max-shard", "40MB")
    assert planned.code == 0
    shard = "model-00001-of-00002.safetensors"
    size = (tmp_path / "local" / shard).stat().st_size
    s3.put_object(Bucket=bucket, Key=f"out/{shard}", Body=b"short")
    proxy.faults.listing = lambda xml: xml.replace(
        b"<Size>5</Size>", f"<Size>{size}</Size>".encode()
    )
    run = cli(
        "reshard", folder, "-o", f"s3://{bucket}/out", "--max-shard", "40MB", "--resume", "--json",
        "--force",  # --resume alone replaces nothing
    )  # fmt: skip
    assert run.code == 0, run.stderr
    assert run.json()["written"]["upload"]["kept"] == []
    _same_as_local(s3, bucket, tmp_path / "local")
