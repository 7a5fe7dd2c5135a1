"""What a hostile review of `-o s3://|gs://|hf://` found (tests of its fixes, most severe
first): an output that is the input by another spelling, a listing that contradicts itself,
--resume replacing what is not its own, a bucket root's sub-prefixes, ... Against moto's
server behind the loopback proxy (tests/store_proxy.py)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.builders import Factory, Spec
from tests.helpers import cli
from tests.optional import needs
from tests.remote_servers import upload_tree
from tests.store_helpers import fresh_env, names, new_bucket, objects, proxied_moto, uploads
from tests.store_proxy import Proxy

T = TypeVar("T")


def s3_test(test: T) -> T:
    """A test against moto (slow: a server per module, a CLI run or more per test)."""
    marked: T = needs("botocore", "moto")(pytest.mark.slow(test))
    return marked


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
    import boto3

    return boto3.client("s3", endpoint_url=servers[0])


_buckets = iter(range(10**6))


@pytest.fixture
def bucket(s3: Any) -> Iterator[str]:
    yield from new_bucket(s3, f"hostile-{next(_buckets)}")


def _model(factory: Factory, name: str = "m", seed: str = "") -> Path:
    """Two shards (one of them above S3's smallest part: a multipart upload) and a config."""
    folder = factory.sharded(
        name, [[Spec(f"{seed}a", "F32", (1024, 1536))], [Spec(f"{seed}b"), Spec(f"{seed}c")]]
    )
    factory.config(name)
    return folder


# --- 1. an output that is the input by another spelling --------------------------------


@s3_test
@pytest.mark.parametrize(
    "spelling", ["s3://{b}//src", "S3://{b}/src/", "s3://{b}/src//", "s3://{b}//src/sub"]
)
@pytest.mark.parametrize("flags", [[], ["--force"], ["--resume"]])
def test_an_output_that_is_the_input_spelled_otherwise_is_refused(
    s3: Any, bucket: str, tmp_path: Path, spelling: str, flags: list[str]
) -> None:
    upload_tree(s3, bucket, _model(Factory(tmp_path)), "src")
    before = objects(s3, bucket, "src")
    out = spelling.format(b=bucket)
    run = cli("reshard", f"s3://{bucket}/src", "-o", out, "--max-shard", "4MB", *flags)
    assert run.code == 2, run.stderr
    assert len(run.error_lines) == 1 and "overlaps the input" in run.stderr
    assert objects(s3, bucket, "src") == before and uploads(s3, bucket) == []


@s3_test
def test_a_manifest_that_is_a_file_of_the_input_spelled_otherwise_is_refused(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    upload_tree(s3, bucket, _model(Factory(tmp_path)), "src")
    before = objects(s3, bucket, "src")
    target = f"s3://{bucket}//src/model-00001-of-00002.safetensors"
    run = cli("hash", f"s3://{bucket}/src", "--manifest", target)
    assert run.code == 2 and "inside the input" in run.stderr, run.stderr
    assert objects(s3, bucket, "src") == before


@s3_test
@pytest.mark.parametrize(
    "suffix", ["?X-Amz-Signature=secret", "#frag", "/./x", "/a/../x", "/%2e%2e/x", "/a/%2E/x"]
)
def test_an_output_url_whose_keys_would_differ_from_what_it_shows_is_refused(
    s3: Any, bucket: str, tmp_path: Path, suffix: str
) -> None:
    folder = _model(Factory(tmp_path))
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out{suffix}")
    assert run.code == 2 and len(run.error_lines) == 1, run.stderr
    assert "secret" not in run.stderr
    assert names(s3, bucket, "") == [] and uploads(s3, bucket) == []


@s3_test
def test_a_normalised_output_url_writes_where_it_is_printed(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    folder = _model(Factory(tmp_path))
    run = cli("reshard", folder, "-o", f"S3://{bucket}//out//", "--json")
    assert run.code == 0, run.stderr
    files = [item["path"] for item in run.json()["written"]["files"]]
    assert files and all(path.startswith(f"s3://{bucket}/out/") for path in files)
    assert sorted(path.rpartition("/")[2] for path in files) == names(s3, bucket, "out")


@pytest.mark.parametrize(
    ("output", "source", "same"),
    [
        ("gs://b/m", "gcs://b/m/model.safetensors", True),
        ("GS://b//m/", "gs://b/m", True),
        ("gs://b/m2", "gs://b/m", False),
        ("hf://org/repo@other", "hf://org/repo", True),
        ("hf://org/repo/sub", "hf://org/Repo@v1.0", True),
        ("hf://org/repo/a", "hf://org/repo/b", False),
        ("hf://datasets/org/repo", "hf://org/repo", False),
        ("s3://b/m", "gs://b/m", False),
    ],
)
def test_places_are_compared_normalised(output: str, source: str, same: bool) -> None:
    from ckptfix.write.stores.location import output_url, overlap

    assert (overlap(output_url(output), [source]) == source) is same


# --- 2. a listing that contradicts itself ---------------------------------------------


def _no_token(body: bytes) -> bytes:
    """Every object left out, the page said truncated, no token given."""
    body = re.sub(rb"<Contents>.*?</Contents>", b"", body, flags=re.S)
    return body.replace(b"<IsTruncated>false</IsTruncated>", b"<IsTruncated>true</IsTruncated>")


def _same_token() -> Callable[[bytes], bytes]:
    """Pages (of one object each: MOTO_S3_DEFAULT_MAX_KEYS) whose token is the first one's:
    the listing is sent back where it has been."""
    first: list[bytes] = []

    def lie(body: bytes) -> bytes:
        token = re.search(rb"<NextContinuationToken>(.*?)</NextContinuationToken>", body)
        if token is not None and not first:
            first.append(token.group(1))
        if token is not None:
            body = body.replace(token.group(1), first[0])
        return body

    return lie


@s3_test
@pytest.mark.parametrize("loops", [False, True])
def test_a_listing_that_contradicts_itself_stops_the_run_before_anything_is_written(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path, loops: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    factory = Factory(tmp_path)
    upload_tree(s3, bucket, _model(factory, "old", seed="old"), "out")
    before = objects(s3, bucket, "out")
    if loops:
        monkeypatch.setenv("MOTO_S3_DEFAULT_MAX_KEYS", "1")  # moto's server is in this process
    proxy.faults.listing = _same_token() if loops else _no_token
    run = cli("reshard", _model(factory, "new"), "-o", f"s3://{bucket}/out", "--force")
    assert run.code == 1 and len(run.error_lines) == 1, run.stderr
    assert "listing is inconsistent" in run.stderr and "remote-error" in run.stderr
    assert objects(s3, bucket, "out") == before and uploads(s3, bucket) == []


def test_a_multipart_listing_that_contradicts_itself_is_an_error() -> None:
    from ckptfix.core.errors import RemoteError
    from ckptfix.write.stores.common import Pages

    pages = Pages("s3://b/out")
    assert pages.more(True, ("k", "u")) and not pages.more(False, None)
    with pytest.raises(RemoteError, match="came back"):
        pages.more(True, ("k", "u"))
    with pytest.raises(RemoteError, match="no token"):
        Pages("s3://b/out").more(True, (None, None))


# --- 3. --resume without --force replaces nothing ------------------------------------

_SPLIT = ["--max-shard", "4MB"]  # two shards, named as _model's


@s3_test
def test_resume_without_force_never_replaces_another_checkpoint(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    factory = Factory(tmp_path)
    upload_tree(s3, bucket, _model(factory, "old", seed="old"), "out")  # the same names
    before = objects(s3, bucket, "out")
    run = cli("reshard", _model(factory, "new"), "-o", f"s3://{bucket}/out", *_SPLIT, "--resume")
    assert run.code == 2 and len(run.error_lines) == 1, run.stderr
    assert "--resume without --force" in run.stderr and "--force" in run.stderr
    assert objects(s3, bucket, "out") == before and uploads(s3, bucket) == []


@s3_test
@pytest.mark.parametrize(
    ("key", "body"),
    [("model-00001-of-00009.safetensors", b"theirs"), ("config.json", b'{"theirs": 1}')],
)
def test_resume_without_force_refuses_an_object_that_is_not_its_own(
    s3: Any, bucket: str, tmp_path: Path, key: str, body: bytes
) -> None:
    """Not part of the run's output, or a small file holding other bytes than planned."""
    folder = _model(Factory(tmp_path))
    assert cli("reshard", folder, "-o", f"s3://{bucket}/out", *_SPLIT).code == 0
    s3.put_object(Bucket=bucket, Key=f"out/{key}", Body=body)
    before = objects(s3, bucket, "out")
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out", *_SPLIT, "--resume")
    assert run.code == 2 and key in run.stderr and len(run.error_lines) == 1, run.stderr
    assert objects(s3, bucket, "out") == before


@s3_test
def test_resume_without_force_completes_its_own_earlier_output(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    folder = _model(Factory(tmp_path))
    assert cli("reshard", folder, "-o", f"s3://{bucket}/out", *_SPLIT).code == 0
    whole = objects(s3, bucket, "out")
    s3.delete_objects(  # as a killed run leaves it: a shard, no index, no config
        Bucket=bucket,
        Delete={"Objects": [{"Key": f"out/{n}"} for n in whole if not n.startswith("model-0")]},
    )
    s3.delete_object(Bucket=bucket, Key="out/model-00002-of-00002.safetensors")
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out", *_SPLIT, "--resume", "--json")
    assert run.code == 0, run.stderr
    assert objects(s3, bucket, "out") == whole
    kept = run.json()["written"]["upload"]["kept"]
    assert kept == ["model-00001-of-00002.safetensors"]
