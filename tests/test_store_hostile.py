"""What a hostile review of `-o s3://|gs://|hf://` found (tests of its fixes, most severe
first): an output that is the input by another spelling, a listing that contradicts itself,
--resume replacing what is not its own, a bucket root's sub-prefixes, ... and the S3 run
marker's records (write.stores.s3_marker): marker traffic linear in the uploads, every
process of a run keeping its own records, a hostile prefix of records read in bounds. Against moto's
server behind the loopback proxy (tests/store_proxy.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

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
    uploads,
)
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

SHARDS_OF_2 = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
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


# --- 4. the marker: only the uploads a run recorded are aborted --------------------------


def _upload_ids(s3: Any, bucket: str) -> list[tuple[str, str]]:
    listed = s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    return sorted((item["Key"], item["UploadId"]) for item in listed)


@s3_test
def test_a_marker_left_by_a_run_aborts_no_upload_it_did_not_record(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    folder = _model(Factory(tmp_path))
    s3.put_object(Bucket=bucket, Key="out/.ckptfix-writing", Body=b"a killed run's marker\n")
    for key in ["out/sub/theirs.bin", "out/model-00001-of-00002.safetensors"]:
        s3.create_multipart_upload(Bucket=bucket, Key=key)  # another tool's uploads
    theirs = _upload_ids(s3, bucket)
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out", *_SPLIT)
    assert run.code == 2 and "marker" in run.stderr and "--force" in run.stderr, run.stderr
    assert _upload_ids(s3, bucket) == theirs and names(s3, bucket, "out") == [".ckptfix-writing"]
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out", *_SPLIT, "--force", "--json")
    assert run.code == 0, run.stderr
    upload = run.json()["written"]["upload"]
    assert upload["aborted_uploads"] == [] and len(upload["other_uploads"]) == 2
    assert _upload_ids(s3, bucket) == theirs
    assert ".ckptfix-writing" not in names(s3, bucket, "out")


@s3_test
def test_the_marker_records_each_upload_before_its_parts_are_sent(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path
) -> None:
    from ckptfix.write.stores.s3_marker import record_name

    folder = big_model(Factory(tmp_path), shards=2)  # each shard four parts
    seen: list[list[str]] = []

    def hook(number: int) -> None:
        """The uploads under way whose record is there, as each part is sent."""
        records = set(names(s3, bucket, "out"))
        seen.append(
            sorted(
                key[len("out/") :]
                for key, upload_id in _upload_ids(s3, bucket)
                if record_name(key[len("out/") :], upload_id) in records
            )
        )

    proxy.faults.on_part = hook
    assert cli("reshard", folder, "-o", f"s3://{bucket}/out", "--max-shard", "40MB").code == 0
    first, second = SHARDS_OF_2
    assert seen == [[first]] * 4 + [[second]] * 4  # every part after its upload's record
    assert [name for name in names(s3, bucket, "out") if ".ckptfix" in name] == []


def _store(url: str, *, force: bool = False) -> Any:
    from ckptfix.write.stores.base import StoreOptions
    from ckptfix.write.stores.s3 import S3Store

    return S3Store(url, StoreOptions(force=force))


def _start(store: Any, *names: str) -> list[str]:
    """Multipart uploads started (and recorded) by `store`, no part sent: a run killed
    there. Their upload ids."""
    ids = []
    for name in names:
        upload = store.begin(name, 2**30)  # over one part: a multipart upload
        upload.pump.close()
        ids.append(upload.upload_id)
    return ids


def _small(factory: Factory) -> Path:
    """Two small shards, rewritten as one model.safetensors."""
    folder = factory.sharded("m", [[Spec("a")], [Spec("b"), Spec("c")]])
    factory.config("m")
    return folder


SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


# --- the marker traffic grows linearly ------------------------------------------------


def _marker_traffic(bucket: str, uploads: int) -> list[int]:
    """The body sizes of the requests for the marker and records, while `uploads` multipart
    uploads are started (counted on the client, by a botocore event hook)."""
    store = _store(f"s3://{bucket}/out-{uploads}")
    sizes: list[int] = []

    def count(request: Any, **_: Any) -> None:
        if ".ckptfix-writing" in request.url:
            sizes.append(int(request.headers.get("Content-Length", 0)))

    events = store.client.meta.events  # the client is shared: the hook is taken off after
    events.register("before-send.s3", count)
    try:
        _start(store, *(f"model-{i:05d}-of-{uploads:05d}.safetensors" for i in range(uploads)))
    finally:
        events.unregister("before-send.s3", count)
    return sizes


@s3_test
def test_the_marker_traffic_grows_linearly_with_the_uploads(bucket: str) -> None:
    few, many = _marker_traffic(bucket, 5), _marker_traffic(bucket, 80)
    assert len(few) == 1 + 5 and len(many) == 1 + 80  # the marker once, a record each
    assert max(many) < 512  # each request its own size, whatever came before
    assert sum(many) < 80 / 5 * sum(few) * 1.2


# --- every process of a run keeps its own records ----------------------------------------------


@s3_test
def test_the_records_of_every_process_of_a_run_are_taken_over(s3: Any, bucket: str) -> None:
    """Two processes writing to one prefix (the tasks of a Ray run): the next run finds both
    processes' uploads, not the last one's only."""
    url = f"s3://{bucket}/out"
    first, second = _start(_store(url), SHARDS[0]), _start(_store(url), SHARDS[1])
    found = _store(url, force=True).dangling()
    assert sorted((u.name, u.upload_id, u.ours) for u in found) == [
        (SHARDS[0], first[0], True),
        (SHARDS[1], second[0], True),
    ]


@s3_test
def test_a_killed_runs_uploads_are_aborted_with_force_and_its_records_are_no_objects(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    folder = _small(Factory(tmp_path))
    url = f"s3://{bucket}/out"
    _start(_store(url), SHARDS[0])
    _start(_store(url), SHARDS[1])
    s3.create_multipart_upload(Bucket=bucket, Key="out/sub/theirs.bin")  # another tool's
    theirs = [item for item in _upload_ids(s3, bucket) if item[0] == "out/sub/theirs.bin"]
    refused = cli("reshard", folder, "-o", url)
    assert refused.code == 2 and "marker" in refused.stderr and "--force" in refused.stderr
    run = cli("reshard", folder, "-o", url, "--force", "--json")  # no --replace-any
    assert run.code == 0, run.stderr
    upload = run.json()["written"]["upload"]
    assert sorted(upload["aborted_uploads"]) == SHARDS
    assert upload["other_uploads"] == ["sub/theirs.bin"]
    assert _upload_ids(s3, bucket) == theirs
    assert names(s3, bucket, "out") == ["config.json", "model.safetensors"]


@s3_test
def test_an_older_ckptfixs_marker_still_vouches_for_its_uploads(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    """Before the records, a marker listed every upload of its run."""
    folder = _small(Factory(tmp_path))
    started = s3.create_multipart_upload(Bucket=bucket, Key=f"out/{SHARDS[0]}")["UploadId"]
    marker = {"note": "", "run": "0" * 32, "uploads": [[SHARDS[0], started]]}
    s3.put_object(Bucket=bucket, Key="out/.ckptfix-writing", Body=json.dumps(marker).encode())
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out", "--force", "--json")
    assert run.code == 0, run.stderr
    assert run.json()["written"]["upload"]["aborted_uploads"] == [SHARDS[0]]
    assert _upload_ids(s3, bucket) == []


# --- a hostile prefix: records are listed within bounds, never read --------------------


def _put_records(s3: Any, bucket: str, count: int, size: int = 10) -> None:
    s3.put_object(Bucket=bucket, Key="out/.ckptfix-writing", Body=b"{}")
    for number in range(count):
        key = f"out/.ckptfix-writing.d/{number:064x}"
        s3.put_object(Bucket=bucket, Key=key, Body=b"x" * size)


@s3_test
def test_records_are_matched_by_name_and_never_read(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path
) -> None:
    folder = _small(Factory(tmp_path))
    _put_records(s3, bucket, 3, size=8 * 2**20)  # huge ones
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out", "--force")
    assert run.code == 0, run.stderr
    read = [path for method, path in proxy.faults.log if method == "GET" and "writing.d/" in path]
    assert read == []
    assert [name for name in names(s3, bucket, "out") if ".ckptfix" in name] == []


@s3_test
def test_a_prefix_holding_more_records_than_any_run_writes_is_one_line(
    s3: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.write.stores import s3 as s3_store

    monkeypatch.setattr(s3_store, "RECORDS_MAX", 3)  # 100,000 in earnest
    folder = _small(Factory(tmp_path))
    _put_records(s3, bucket, 4)
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out", "--force")
    assert run.code == 1 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith(f"error: s3://{bucket}/out/.ckptfix-writing.d/: holds more ")
    assert "more than 3 upload records" in run.stderr and "Traceback" not in run.stderr
    assert [name for name in names(s3, bucket, "out") if ".ckptfix" not in name] == []


# --- 5. the Hub: the repository's own files are not the output's ------------------------


def hub_test(test: T) -> T:
    """A test against the Hub test server (huggingface_hub's LFS uploads pass a file as
    `data=` to httpx, which warns)."""
    marked: T = needs("huggingface_hub")(
        pytest.mark.slow(pytest.mark.filterwarnings("ignore:Use 'content=<...>'")(test))
    )
    return marked


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The Hub test server (LFS; Xet off through huggingface_hub's setting: it cannot be
    served on loopback) holding a fresh repository: .gitattributes and a model card."""
    from huggingface_hub import constants

    from tests.store_servers import hub_write_server

    for name, value in {"HF_TOKEN": "hf_testtesttesttesttest", "HF_HUB_DISABLE_XET": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    (repo / "README.md").write_text("---\nlicense: apache-2.0\n---\n# The card\n")
    with hub_write_server(repo) as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield server


@hub_test
def test_the_hub_repositorys_card_and_gitattributes_are_never_the_outputs(
    hub: Any, tmp_path: Path
) -> None:
    from tests.remote_servers import REPO
    from tests.store_servers import stored

    factory = Factory(tmp_path)
    own = {name: stored(hub.root)[name] for name in (".gitattributes", "README.md")}
    first = cli("reshard", _model(factory, "a"), "-o", f"hf://{REPO}", *_SPLIT)  # no --force
    assert first.code == 0, first.stderr
    again = cli("reshard", _model(factory, "b", seed="b"), "-o", f"hf://{REPO}", "--force")
    assert again.code == 0, again.stderr
    after = stored(hub.root)
    assert {name: after[name] for name in own} == own
    assert sorted(after) == [".gitattributes", "README.md", "config.json", "model.safetensors"]


@hub_test
def test_a_carried_model_card_replaces_the_repositorys_only_with_force(
    hub: Any, tmp_path: Path
) -> None:
    from tests.remote_servers import REPO
    from tests.store_servers import stored

    folder = _model(Factory(tmp_path))
    (folder / "README.md").write_text("# the input's card\n")
    card = stored(hub.root)["README.md"]
    run = cli("reshard", folder, "-o", f"hf://{REPO}")
    assert run.code == 2 and "README.md" in run.stderr and "--force" in run.stderr, run.stderr
    assert stored(hub.root)["README.md"] == card
    assert cli("reshard", folder, "-o", f"hf://{REPO}", "--force").code == 0
    assert stored(hub.root)["README.md"] == b"# the input's card\n"


# --- 6. a bucket root: only the top level is the output's -------------------------------


@s3_test
def test_force_at_a_bucket_root_deletes_nothing_under_other_prefixes(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    factory = Factory(tmp_path)
    upload_tree(s3, bucket, _model(factory, "other", seed="o"), "other")  # with its index
    s3.put_object(Bucket=bucket, Key="notes/summary.md", Body=b"mine")
    upload_tree(s3, bucket, _model(factory, "old", seed="old"), "")  # same shard names
    s3.put_object(Bucket=bucket, Key="model-00001-of-00003.safetensors", Body=b"stale")
    others = {key: objects(s3, bucket, key) for key in ("other", "notes")}
    run = cli("reshard", _model(factory, "new"), "-o", f"s3://{bucket}", *_SPLIT, "--force")
    assert run.code == 0, run.stderr
    assert {key: objects(s3, bucket, key) for key in ("other", "notes")} == others
    listed = s3.list_objects_v2(Bucket=bucket)["Contents"]
    top = sorted(item["Key"] for item in listed if "/" not in item["Key"])
    assert top == sorted([*SHARDS_OF_2, "config.json", "model.safetensors.index.json"])


# --- 7. publication order over an older checkpoint ------------------------------------


def _entry_points(listed: dict[str, bytes]) -> list[str]:
    """What a loader opens first: an index, or a single weight file."""
    return [n for n in listed if n.endswith(".index.json") or n == "model.safetensors"]


def _not_mixed(before: dict[str, bytes], after: dict[str, bytes]) -> None:
    """The prefix is the older checkpoint untouched, or nothing a loader takes for one."""
    assert after == before or _entry_points(after) == [], sorted(after)


@s3_test
def test_a_failure_while_publishing_never_leaves_the_old_index_with_new_files(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path
) -> None:
    factory = Factory(tmp_path)
    old = factory.sharded("old", [[Spec("x")], [Spec("y")], [Spec("z")]])  # other names
    factory.config("old", version="old")
    factory.bytes("old/tokenizer.json", b'{"old": 1}')
    upload_tree(s3, bucket, old, "out")
    before = objects(s3, bucket, "out")
    new = _model(factory)
    factory.bytes("m/tokenizer.json", b'{"new": 1}')  # put after config.json
    proxy.faults.refuse = lambda method, path: 403 if "tokenizer.json" in path else None
    run = cli("reshard", new, "-o", f"s3://{bucket}/out", *_SPLIT, "--force")
    assert run.code == 1 and len(run.error_lines) == 1, run.stderr
    _not_mixed(before, objects(s3, bucket, "out"))


@s3_test
def test_a_failure_while_publishing_a_single_file_never_leaves_new_weights_with_old_files(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path
) -> None:
    factory = Factory(tmp_path)
    assert cli("reshard", _model(factory, "old", seed="o"), "-o", f"s3://{bucket}/out").code == 0
    before = objects(s3, bucket, "out")
    assert _entry_points(before) == ["model.safetensors"]
    proxy.faults.refuse = lambda method, path: 403 if "config.json" in path else None
    run = cli("convert", _model(factory), "-o", f"s3://{bucket}/out", "--dtype", "bf16", "--force")
    assert run.code == 1 and len(run.error_lines) == 1, run.stderr
    _not_mixed(before, objects(s3, bucket, "out"))


@s3_test
def test_an_old_index_listing_a_missing_shard_goes_before_that_shard_is_written(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path
) -> None:
    factory = Factory(tmp_path)
    upload_tree(s3, bucket, _model(factory, "old", seed="o"), "out")
    s3.delete_object(Bucket=bucket, Key=f"out/{SHARDS_OF_2[0]}")  # listed, absent
    index_there: list[bool] = []

    def hook(method: str, path: str) -> None:
        if method in ("PUT", "POST") and SHARDS_OF_2[0] in path and not index_there:
            listed = s3.list_objects_v2(Bucket=bucket, Prefix="out/").get("Contents", [])
            index_there.append(any(i["Key"].endswith(".index.json") for i in listed))

    proxy.faults.on_request = hook
    run = cli("reshard", _model(factory), "-o", f"s3://{bucket}/out", *_SPLIT, "--force")
    assert run.code == 0, run.stderr
    assert index_there == [False]


# --- 8. --resume --verify-readback reads back what it keeps ----------------------------


@s3_test
def test_resume_with_readback_keeps_only_objects_whose_bytes_read_back(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    folder = _model(Factory(tmp_path))
    assert cli("reshard", folder, "-o", f"s3://{bucket}/out", *_SPLIT).code == 0
    whole = objects(s3, bucket, "out")
    key = f"out/{SHARDS_OF_2[0]}"
    claimed = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")["ChecksumCRC32"]
    bad = bytearray(whole[SHARDS_OF_2[0]])
    bad[-1] ^= 0xFF  # same size; the store reports the planned checksum (moto takes it)
    s3.put_object(
        Bucket=bucket, Key=key, Body=bytes(bad), ChecksumCRC32=claimed, ChecksumAlgorithm="CRC32"
    )
    args = ["reshard", folder, "-o", f"s3://{bucket}/out", *_SPLIT, "--resume"]
    run = cli(*args, "--force", "--verify-readback", "--json")
    assert run.code == 0, run.stderr
    assert run.json()["written"]["upload"]["kept"] == [SHARDS_OF_2[1]]
    assert objects(s3, bucket, "out") == whole


# --- 9. the rest --------------------------------------------------------------------------


@needs("botocore")
@pytest.mark.parametrize(
    "endpoint", ["notaurl", pytest.param("http://127.0.0.1:1/?sig=secret", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("write", [True, False])
def test_an_endpoint_botocore_cannot_use_is_a_settings_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, endpoint: str, write: bool
) -> None:
    for name, value in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    args = ["reshard", _model(Factory(tmp_path)), "-o"] if write else ["inspect"]
    run = cli(*args, "s3://bucket/x")
    assert run.code == 1 and len(run.error_lines) == 1, run.stderr
    assert "rule remote-settings" in run.stderr and "AWS_ENDPOINT_URL" in run.stderr
    assert "secret" not in run.stderr


@pytest.mark.parametrize("flag", ["--resume", "--verify-readback", "--hf-pr"])
@pytest.mark.parametrize("command", ["reshard", "fix"])
def test_store_flags_for_a_local_output_are_usage_errors(
    tmp_path: Path, flag: str, command: str
) -> None:
    run = cli(command, _model(Factory(tmp_path)), "-o", tmp_path / "out", flag)
    assert run.code == 2 and len(run.error_lines) == 1 and flag in run.stderr, run.stderr
    assert not (tmp_path / "out").exists()


def test_hf_pr_for_another_store_is_a_usage_error(tmp_path: Path) -> None:
    run = cli("reshard", _model(Factory(tmp_path)), "-o", "s3://bucket/out", "--hf-pr")
    assert run.code == 2 and "--hf-pr" in run.stderr and "hf://" in run.stderr, run.stderr


@hub_test
def test_a_hub_folder_with_dot_segments_or_empty_ones(hub: Any, tmp_path: Path) -> None:
    from tests.remote_servers import REPO
    from tests.store_servers import stored

    folder = _model(Factory(tmp_path))
    before = stored(hub.root)
    for bad in [f"hf://{REPO}/../x", f"hf://{REPO}/a/%2e%2e/x"]:
        run = cli("reshard", folder, "-o", bad)
        assert run.code == 2 and len(run.error_lines) == 1, run.stderr
    assert stored(hub.root) == before
    run = cli("reshard", folder, "-o", f"hf://{REPO}/a//b/", "--json")
    assert run.code == 0, run.stderr
    assert sorted(n for n in stored(hub.root) if n.startswith("a/")) == [
        "a/b/config.json",
        "a/b/model.safetensors",
    ]


@s3_test
def test_the_librarys_save_to_a_non_empty_prefix_names_no_cli_flag(s3: Any, bucket: str) -> None:
    import torch

    import ckptfix

    s3.put_object(Bucket=bucket, Key="out/config.json", Body=b"{}")
    with pytest.raises(ckptfix.UsageError, match="not empty") as caught:
        ckptfix.save({"a": torch.ones(3)}, f"s3://{bucket}/out")
    assert "--" not in str(caught.value)


@s3_test
@pytest.mark.parametrize("name", ["evil\x1b[31mRED\x1b[0m.json", "new\nline.txt", "tab\tx.md"])
def test_a_carried_file_whose_name_no_object_may_have_stops_the_run_before_anything_is_sent(
    s3: Any, bucket: str, tmp_path: Path, name: str
) -> None:
    folder = _model(Factory(tmp_path))
    (folder / name).write_text("{}")
    run = cli("reshard", folder, "-o", f"s3://{bucket}/out")
    assert run.code == 1 and len(run.error_lines) == 1, run.stderr
    assert "\x1b" not in run.stderr and "nothing was sent" in run.stderr
    assert names(s3, bucket, "out") == [] and uploads(s3, bucket) == []


@needs("gcsfs")
@pytest.mark.slow
def test_a_killed_gs_runs_parts_are_ckptfixs_and_taken_over_only_with_force(
    tmp_path: Path,
) -> None:
    import json
    import subprocess

    from tests.store_helpers import FAST, ckptfix_process
    from tests.store_servers import gcs_write_server, stored

    root = tmp_path / "root"
    (root / "bkt").mkdir(parents=True)
    part = root / "bkt/out/.ckptfix-upload/0123456789ab/model.safetensors/part-00001"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"p" * 1000)  # what a killed run leaves
    folder = _model(Factory(tmp_path))
    with gcs_write_server(root) as server:
        env = {
            "STORAGE_EMULATOR_HOST": server.url,
            "NO_GCE_CHECK": "true",
            "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "none.json"),
            **FAST,
        }

        def run(*flags: str) -> subprocess.CompletedProcess[bytes]:
            args = ["reshard", str(folder), "-o", "gs://bkt/out", "--json", *flags]
            process = ckptfix_process(args, env)
            out, err = process.communicate(timeout=300)
            return subprocess.CompletedProcess(args, process.returncode, out, err)

        refused = run()
        assert refused.returncode == 2 and b"--force" in refused.stderr, refused.stderr
        assert part.exists()
        taken = run("--force")
        assert taken.returncode == 0, taken.stderr
        upload = json.loads(taken.stdout)["written"]["upload"]
        assert upload["aborted_uploads"] == ["model.safetensors"]
        assert not [name for name in stored(root / "bkt") if ".ckptfix-upload" in name]


@pytest.mark.parametrize("url", ["s3://", "gs:///", "hf://"])
def test_a_store_url_naming_no_bucket_says_so(tmp_path: Path, url: str) -> None:
    run = cli("reshard", _model(Factory(tmp_path)), "-o", url)
    assert run.code == 2 and len(run.error_lines) == 1, run.stderr
    assert "names no bucket or repository" in run.stderr
    assert "not a URL scheme" not in run.stderr


@s3_test
@pytest.mark.parametrize("at", [SHARDS_OF_2[1], "config.json", "index.json"])
def test_a_run_killed_while_replacing_an_older_checkpoint_leaves_no_mixed_one(
    s3: Any, bucket: str, proxy: Proxy, tmp_path: Path, at: str
) -> None:
    import os
    import signal

    from tests.store_helpers import ckptfix_process

    factory = Factory(tmp_path)
    upload_tree(s3, bucket, _model(factory, "old", seed="o"), "out")  # the same names
    before = objects(s3, bucket, "out")
    started: list[int] = []

    def hook(method: str, path: str) -> None:  # SIGKILL as the request reaches the store
        if method == "PUT" and at in path.split("?")[0] and started:
            os.kill(started.pop(), signal.SIGKILL)

    env = fresh_env(proxy, lambda name, value: None)  # (resets the faults: hook after)
    proxy.faults.on_request = hook
    args = ["reshard", str(_model(factory)), "-o", f"s3://{bucket}/out", *_SPLIT, "--force"]
    process = ckptfix_process(args, env)
    started.append(process.pid)
    process.communicate(timeout=300)
    proxy.faults.on_request = None
    assert process.returncode == -signal.SIGKILL
    after = objects(s3, bucket, "out")
    after.pop(".ckptfix-writing", None)  # the killed run's
    assert cli("reshard", tmp_path / "m", "-o", tmp_path / "local", *_SPLIT).code == 0
    if after != folder_files(tmp_path / "local"):  # killed as the index went: published
        _not_mixed(before, after)
