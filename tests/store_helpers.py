"""What the object-store output tests share: an S3 client of moto's server, a bucket per
test, the bytes under a prefix, and a ckptfix run in a fresh process (for signals)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.builders import Factory, Spec
from tests.remote_servers import S3_ENV, moto_server
from tests.store_proxy import Faults, Proxy, store_proxy

ROOT = Path(__file__).resolve().parent.parent
FAST = {"CKPTFIX_REMOTE_RETRIES": "1", "CKPTFIX_REMOTE_BACKOFF": "0.01"}
NO_METADATA = {"AWS_EC2_METADATA_DISABLED": "true"}


@contextlib.contextmanager
def proxied_moto() -> Iterator[tuple[str, Proxy]]:
    """moto's S3 server and the misbehaving proxy in front of it: (moto's URL, proxy)."""
    with moto_server() as endpoint, store_proxy(endpoint) as proxy:
        yield endpoint, proxy


def fresh_env(proxy: Proxy, setenv: Any) -> dict[str, str]:
    """No fault left by an earlier test; AWS_* set so that ckptfix reaches moto through
    the proxy (`setenv`: monkeypatch.setenv). Returns the variables set."""
    proxy.faults.__dict__.update(Faults().__dict__)
    values = {**S3_ENV, **FAST, **NO_METADATA, "AWS_ENDPOINT_URL": proxy.url}
    for name, value in values.items():
        setenv(name, value)
    return values


@contextlib.contextmanager
def moto_here(setenv: Any, bucket: str = "bkt") -> Iterator[Any]:
    """moto's S3 with `bucket`, ckptfix in this process pointed at it (`setenv`:
    monkeypatch.setenv); yields a boto3 client of it."""
    import boto3

    with moto_server() as endpoint:
        for name, value in {**S3_ENV, **FAST, **NO_METADATA, "AWS_ENDPOINT_URL": endpoint}.items():
            setenv(name, value)
        client = boto3.client("s3", endpoint_url=endpoint, region_name=S3_ENV["AWS_DEFAULT_REGION"])
        client.create_bucket(Bucket=bucket)
        yield client


def new_bucket(s3: Any, name: str) -> Iterator[str]:
    """A bucket for one test, emptied afterwards (moto keeps objects in memory)."""
    s3.create_bucket(Bucket=name)
    yield name
    for upload in s3.list_multipart_uploads(Bucket=name).get("Uploads", []):
        s3.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
    for key in names(s3, name, ""):
        s3.delete_object(Bucket=name, Key=key)


def objects(s3: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    """name (relative to the prefix) -> bytes of every object under `prefix/`."""
    found: dict[str, bytes] = {}
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    for page in pages:
        for item in page.get("Contents", []):
            body = s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
            found[item["Key"][len(prefix) + 1 :]] = body
    return found


def names(s3: Any, bucket: str, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sorted(
        item["Key"][len(prefix) + 1 :] for page in pages for item in page.get("Contents", [])
    )


def uploads(s3: Any, bucket: str) -> list[str]:
    """Keys of the multipart uploads under way in `bucket`."""
    return sorted(
        item["Key"] for item in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    )


def folder_files(folder: Path) -> dict[str, bytes]:
    return {
        path.relative_to(folder).as_posix(): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def small_model(factory: Factory, name: str = "m") -> Path:
    """Two shards (4 MiB of F32, 16 MiB of BF16; a tiny tensor), a config and a tokenizer."""
    folder = factory.sharded(
        name,
        [[Spec("a", "F32", (1024, 1024)), Spec("b", "BF16", (4096, 2048))], [Spec("c")]],
    )
    factory.config(name, torch_dtype="float32")
    factory.bytes(f"{name}/tokenizer.json", b'{"model": {}}')
    return folder


def torch_model(tmp_path: Path) -> Path:
    """A torch `.bin` of 24 MiB whose two names share one tensor, in tmp_path/src."""
    import torch

    embed = torch.arange(6 * 2**20, dtype=torch.float32).reshape(3 * 2**10, 2**11)
    state = {"embed.weight": embed, "lm_head.weight": embed, "norm": torch.ones(7)}
    path = tmp_path / "src" / "pytorch_model.bin"
    path.parent.mkdir()
    torch.save(state, path)
    return path


def big_model(factory: Factory, name: str = "m", shards: int = 4, seed: str = "") -> Path:
    """`shards` shards of one 33,538,048-byte tensor each (four 8 MiB upload parts per
    shard, header included), and a config.json."""
    specs = [[Spec(f"{seed}w{i}", "F32", (4096, 2047))] for i in range(shards)]
    folder = factory.sharded(name, specs)
    factory.config(name)
    return folder


# The process's own peak RSS, printed last on stderr: VmHWM, of this program image only
# (ru_maxrss after exec still holds the parent's peak, which moto's objects make large).
_MEASURED = (
    "import runpy, sys\n"
    "try:\n"
    "    runpy.run_module('ckptfix', run_name='__main__')\n"
    "finally:\n"
    "    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
    "    print('peak-rss-kib', hwm.split()[1], file=sys.stderr)\n"
)


def peak_rss(stderr: bytes) -> int:
    """Bytes, from a process started with `measure=True`."""
    last = stderr.decode().splitlines()[-1].split()
    assert last[0] == "peak-rss-kib", stderr
    return int(last[1]) * 1024


def ckptfix_process(
    args: list[str], env: dict[str, str], *, measure: bool = False
) -> subprocess.Popen[bytes]:
    """`python -m ckptfix ARGS` in a fresh process of this tree (`measure`: its peak RSS
    printed last on stderr, see peak_rss)."""
    environment = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    start = ["-c", _MEASURED] if measure else ["-m", "ckptfix"]
    return subprocess.Popen(
        [sys.executable, *start, *args],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
