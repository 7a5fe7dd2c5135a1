"""An S3 output under SIGTERM, SIGINT and SIGKILL at several points of the upload (a ckptfix
process signalled by the loopback proxy as a chosen part arrives), --resume after a kill at
half way, and a conversion larger than TMPDIR: nothing published or all of it, the next run
aborting what a killed run left, and only the missing bytes sent again."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.builders import Factory
from tests.helpers import cli
from tests.optional import needs
from tests.store_helpers import (
    big_model,
    ckptfix_process,
    folder_files,
    fresh_env,
    names,
    new_bucket,
    objects,
    peak_rss,
    proxied_moto,
    uploads,
)
from tests.store_proxy import Proxy

pytestmark = [needs("botocore", "moto"), pytest.mark.slow]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[str, Proxy]]:
    with proxied_moto() as running:
        yield running


@pytest.fixture
def proxy(servers: tuple[str, Proxy]) -> Proxy:
    return servers[1]


@pytest.fixture
def env(proxy: Proxy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    return {**fresh_env(proxy, monkeypatch.setenv), "MODEL_ROOT": str(tmp_path)}


@pytest.fixture
def s3(servers: tuple[str, Proxy], env: dict[str, str]) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=servers[0])


_buckets = iter(range(10**6))


@pytest.fixture
def bucket(s3: Any) -> Iterator[str]:
    yield from new_bucket(s3, f"sig-{next(_buckets)}")


def _run_until(
    proxy: Proxy, args: list[str], env: dict[str, str], at_part: int, signum: int
) -> subprocess.CompletedProcess[bytes]:
    """Run ckptfix; signal it as upload part number `at_part` reaches the proxy."""
    started: list[subprocess.Popen[bytes]] = []

    def hook(number: int) -> None:
        if number == at_part and started:
            os.kill(started[0].pid, signum)

    proxy.faults.on_part = hook
    proxy.faults.parts = 0
    process = ckptfix_process(args, env)
    started.append(process)
    out, err = process.communicate(timeout=300)
    proxy.faults.on_part = None
    return subprocess.CompletedProcess(args, process.returncode, out, err)


def _lines(stderr: bytes) -> list[str]:
    return [line for line in stderr.decode().splitlines() if line]


@pytest.mark.parametrize("at_part", [1, 6, 15])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_aborts_the_uploads_and_publishes_nothing(
    s3: Any, bucket: str, proxy: Proxy, env: dict[str, str], at_part: int, signum: int
) -> None:
    folder = big_model(Factory(Path(env["MODEL_ROOT"])))  # 4 shards, 8 parts
    args = ["reshard", str(folder), "-o", f"s3://{bucket}/out", "--max-shard", "40MB"]
    done = _run_until(proxy, args, env, at_part, signum)
    assert done.returncode == 128 + signum, done.stderr
    assert len(_lines(done.stderr)) == 1 and "interrupted" in done.stderr.decode()
    assert uploads(s3, bucket) == []  # aborted, not left to cost storage
    assert not [name for name in names(s3, bucket, "out") if name.endswith("index.json")]


def test_a_stop_signal_to_a_single_file_leaves_no_file(
    s3: Any, bucket: str, proxy: Proxy, env: dict[str, str], tmp_path: Path
) -> None:
    folder = big_model(Factory(tmp_path), shards=3)
    done = _run_until(
        proxy, ["reshard", str(folder), "-o", f"s3://{bucket}/out"], env, 5, signal.SIGTERM
    )
    assert done.returncode == 143, done.stderr
    assert [name for name in names(s3, bucket, "out") if name.endswith(".safetensors")] == []
    assert uploads(s3, bucket) == []


def test_a_signal_while_publishing_waits_and_the_output_is_complete(
    s3: Any, bucket: str, proxy: Proxy, env: dict[str, str], tmp_path: Path
) -> None:
    folder = big_model(Factory(tmp_path), shards=2)
    started: list[subprocess.Popen[bytes]] = []

    def hook(method: str, path: str) -> None:
        if method == "PUT" and "index.json" in path and started:
            os.kill(started[0].pid, signal.SIGTERM)

    proxy.faults.on_request = hook
    process = ckptfix_process(
        ["reshard", str(folder), "-o", f"s3://{bucket}/out", "--max-shard", "40MB"], env
    )
    started.append(process)
    _, err = process.communicate(timeout=300)
    proxy.faults.on_request = None
    assert process.returncode == 0, err
    assert cli("reshard", folder, "-o", tmp_path / "local", "--max-shard", "40MB").code == 0
    assert objects(s3, bucket, "out") == folder_files(tmp_path / "local")


@pytest.mark.parametrize("at_part", [2, 9])
def test_after_sigkill_no_index_exists_and_the_next_run_aborts_the_uploads_left(
    s3: Any, bucket: str, proxy: Proxy, env: dict[str, str], at_part: int
) -> None:
    tmp_path = Path(env["MODEL_ROOT"])
    folder = big_model(Factory(tmp_path))
    args = ["reshard", str(folder), "-o", f"s3://{bucket}/out", "--max-shard", "40MB"]
    done = _run_until(proxy, args, env, at_part, signal.SIGKILL)
    assert done.returncode == -signal.SIGKILL
    assert not [name for name in names(s3, bucket, "out") if name.endswith("index.json")]
    left = uploads(s3, bucket)
    assert left  # the part in flight's upload
    run = cli(*args[:1], folder, *args[2:], "--force", "--json")
    assert run.code == 0, run.stderr
    assert run.json()["written"]["upload"]["aborted_uploads"] == [
        k.removeprefix("out/") for k in left
    ]
    assert uploads(s3, bucket) == []
    assert cli("reshard", folder, "-o", tmp_path / "local", "--max-shard", "40MB").code == 0
    assert objects(s3, bucket, "out") == folder_files(tmp_path / "local")


def test_uploads_that_are_not_ckptfixs_are_reported_and_left(
    s3: Any, bucket: str, env: dict[str, str], tmp_path: Path
) -> None:
    folder = big_model(Factory(tmp_path), shards=1)
    theirs = s3.create_multipart_upload(Bucket=bucket, Key="out/theirs.bin")["UploadId"]
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out", "--json")
    assert run.code == 0, run.stderr
    assert run.json()["written"]["upload"]["other_uploads"] == ["theirs.bin"]
    assert [u["UploadId"] for u in s3.list_multipart_uploads(Bucket=bucket)["Uploads"]] == [theirs]


def test_resume_after_a_kill_half_way_sends_only_the_rest(
    s3: Any, bucket: str, proxy: Proxy, env: dict[str, str], tmp_path: Path
) -> None:
    folder = big_model(Factory(tmp_path))  # 4 shards of 4 parts: killed as part 9 arrives
    args = ["reshard", str(folder), "-o", f"s3://{bucket}/out", "--max-shard", "40MB"]
    assert _run_until(proxy, args, env, 9, signal.SIGKILL).returncode == -signal.SIGKILL
    assert cli("reshard", folder, "-o", tmp_path / "local", "--max-shard", "40MB").code == 0
    total = sum(map(len, folder_files(tmp_path / "local").values()))
    first = cli("reshard", folder, *args[2:], "--resume", "--json")
    assert first.code == 0, first.stderr
    upload = first.json()["written"]["upload"]
    assert upload["bytes_sent"] <= 0.55 * total
    assert upload["bytes_kept"] + upload["bytes_sent"] == total
    assert objects(s3, bucket, "out") == folder_files(tmp_path / "local")
    second = cli("reshard", folder, *args[2:], "--resume", "--json")
    upload = second.json()["written"]["upload"]
    small = [p for p in (tmp_path / "local").iterdir() if not p.name.endswith(".safetensors")]
    assert upload["bytes_sent"] == sum(p.stat().st_size for p in small)  # no tensor bytes
    assert len(upload["kept"]) == 4
    assert "not sent again" in cli("reshard", folder, *args[2:], "--resume").stdout


def test_resume_sends_an_object_again_when_its_bytes_differ(
    s3: Any, bucket: str, env: dict[str, str], tmp_path: Path
) -> None:
    factory = Factory(tmp_path)
    folder = big_model(factory, "a", shards=2, seed="x")
    assert cli("reshard", folder, "-o", f"s3://{bucket}/out", "--max-shard", "40MB").code == 0
    other = big_model(factory, "b", shards=2, seed="x")
    shard = other / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # same size, same names, one bit apart
    shard.write_bytes(bytes(data))
    run = cli(
        "reshard", other, "-o", f"s3://{bucket}/out", "--max-shard", "40MB", "--resume", "--json",
        "--force",  # --resume alone replaces nothing (test_store_hostile)
    )  # fmt: skip
    assert run.code == 0, run.stderr
    assert run.json()["written"]["upload"]["kept"] == ["model-00001-of-00002.safetensors"]
    stored = objects(s3, bucket, "out")["model-00002-of-00002.safetensors"]
    assert stored[-1] == data[-1]


@contextlib.contextmanager
def _small_tmpfs(path: Path) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def _sha256_of(s3: Any, bucket: str, key: str) -> str:
    hasher = hashlib.sha256()
    for chunk in s3.get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(2**24):
        hasher.update(chunk)
    return hasher.hexdigest()


def test_a_conversion_larger_than_tmpdir_streams_through(
    s3: Any, bucket: str, env: dict[str, str], tmp_path: Path
) -> None:
    factory = Factory(tmp_path)
    source = factory.sparse_safetensors("big/model.safetensors", "F32", (160 * 2**20,))  # 640 MiB
    factory.config("big")
    with _small_tmpfs(tmp_path / "tmp") as small:
        process = ckptfix_process(
            ["convert", str(source.parent), "-o", f"s3://{bucket}/out", "--json"],
            {**env, "TMPDIR": str(small)},
            measure=True,
        )
        out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    assert json.loads(out)["written"]["upload"]["bytes_sent"] > 2.5 * 256 * 2**20
    local = cli("convert", source.parent, "-o", tmp_path / "local")
    assert local.code == 0, local.stderr
    want = hashlib.sha256((tmp_path / "local" / "model.safetensors").read_bytes()).hexdigest()
    assert _sha256_of(s3, bucket, "out/model.safetensors") == want
    assert peak_rss(err) < 320 * 2**20  # parts in flight (9 x 8 MiB) and the program
