"""The CLI's store outputs on every store it writes to: S3 (moto behind tests/store_proxy),
Cloud Storage and the Hub (the loopback servers of tests/store_servers), through
tests/store_targets. Each command writes bitwise what it writes to a local folder; --force
replaces an older checkpoint and deletes its stale objects only after publishing; --resume
sends no tensor byte twice; --dry-run sends nothing; a store that does not hold what was sent
fails the run with one line and publishes nothing; SIGTERM half way publishes nothing."""

from __future__ import annotations

import signal
import subprocess
import time
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
    proxied_moto,
    small_model,
    torch_model,
)
from tests.store_proxy import Proxy
from tests.store_targets import STORES, Target, gcs_target, hub_target, loopback_guard, s3_target

pytestmark = [
    needs("botocore", "moto", "gcsfs", "huggingface_hub"),
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]


@pytest.fixture(scope="module")
def moto() -> Iterator[tuple[str, Proxy]]:
    with proxied_moto() as running:
        yield running


@pytest.fixture(params=STORES)
def store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Target]:
    if request.param == "s3":
        yield from s3_target(request.getfixturevalue("moto"), monkeypatch.setenv)
    elif request.param == "gs":
        with gcs_target(tmp_path, monkeypatch.setenv) as target:
            yield target
    else:
        with hub_target(tmp_path, monkeypatch) as target:
            yield target


@pytest.fixture(autouse=True)
def guard(monkeypatch: pytest.MonkeyPatch) -> None:
    loopback_guard(monkeypatch)


def _both(store: Target, tmp_path: Path, source: Path, command: list[str]) -> Any:
    """`command` on `source` to a local folder and to the store: the store's run, after
    checking that the store holds bitwise what the folder holds."""
    local = cli(command[0], source, "-o", tmp_path / "local", *command[1:])
    assert local.code == 0, local.stderr
    run = cli(command[0], source, "-o", store.url(), *command[1:], "--json")
    assert run.code == 0, run.stderr
    expected = folder_files(tmp_path / "local")
    assert store.read() == expected
    assert store.leftovers() == []
    upload = run.json()["written"]["upload"]
    assert upload["bytes_sent"] == sum(map(len, expected.values()))
    return run


@pytest.mark.parametrize(
    "command",
    [
        ["reshard", "--max-shard", "10MB"],
        ["reshard"],  # one file
        ["convert", "--dtype", "bf16", "--max-shard", "5MB"],
        ["dedupe", "--by-content"],
        ["fix"],
    ],
    ids=["reshard", "reshard-one-file", "convert", "dedupe", "fix"],
)
def test_every_command_writes_the_bytes_it_writes_locally(
    store: Target, tmp_path: Path, command: list[str]
) -> None:
    _both(store, tmp_path, small_model(Factory(tmp_path)), command)


def test_a_torch_checkpoint_converts_as_it_does_locally(store: Target, tmp_path: Path) -> None:
    _both(store, tmp_path, torch_model(tmp_path), ["convert", "--max-shard", "5MB"])


def test_hash_writes_its_manifest(store: Target, tmp_path: Path) -> None:
    folder = small_model(Factory(tmp_path))
    local = cli("hash", folder, "--manifest", tmp_path / "m.json")
    assert local.code == 0, local.stderr
    run = cli("hash", folder, "--manifest", store.url("m.json"), "--json")
    assert run.code == 0, run.stderr
    assert store.read() == {"m.json": (tmp_path / "m.json").read_bytes()}
    assert run.json()["manifest"]["replaced"] is False
    again = cli("hash", folder, "--manifest", store.url("m.json"), "--json")
    assert again.code == 0, again.stderr
    assert again.json()["manifest"]["replaced"] is True
    assert store.read() == {"m.json": (tmp_path / "m.json").read_bytes()}


def test_force_deletes_the_older_checkpoints_objects_after_publishing(
    store: Target, tmp_path: Path
) -> None:
    folder = small_model(Factory(tmp_path))
    assert cli("reshard", folder, "-o", store.url(), "--max-shard", "5MB").code == 0
    old = store.names()
    refused = cli("reshard", folder, "-o", store.url(), "--max-shard", "17MB")
    assert refused.code == 2 and "not empty" in refused.stderr
    store.clear_log()
    run = cli("reshard", folder, "-o", store.url(), "--force", "--max-shard", "17MB", "--json")
    assert run.code == 0, run.stderr
    local = cli("reshard", folder, "-o", tmp_path / "local", "--max-shard", "17MB")
    assert local.code == 0
    assert store.read() == folder_files(tmp_path / "local")
    stale = sorted(set(old) - set(store.names()))
    assert stale and all(name.endswith("-of-00003.safetensors") for name in stale)
    # the older entry point (its index) goes before anything that replaces a file of it is
    # written; the older shards that are not the new one's, after the new index is published
    first = [store.url("model.safetensors.index.json")]
    assert run.json()["written"]["upload"]["removed_first"] == first
    replaced = sorted(run.json()["written"]["replaced"])
    assert replaced == sorted([*first, *(store.url(name) for name in stale)])
    writes = store.writes()
    published = _index_written_at(store, writes)
    deleted = [i for i, (m, p) in enumerate(writes) if _deletes(store, m, p)]
    if store.scheme == "hf":  # every deletion is part of the one commit
        assert deleted == [published]
    else:
        assert min(deleted) < published < max(deleted)


def test_force_over_shards_of_the_same_names(store: Target, tmp_path: Path) -> None:
    """The earlier index names the shards being replaced: it goes first (in the one commit,
    on the Hub, where the new index replaces it)."""
    factory = Factory(tmp_path)
    first = big_model(factory, "one", shards=2, seed="x")
    second = big_model(factory, "two", shards=2, seed="y")
    assert cli("reshard", first, "-o", store.url(), "--max-shard", "40MB").code == 0
    run = cli("reshard", second, "-o", store.url(), "--max-shard", "40MB", "--force")
    assert run.code == 0, run.stderr
    local = cli("reshard", second, "-o", tmp_path / "local", "--max-shard", "40MB")
    assert local.code == 0
    assert store.read() == folder_files(tmp_path / "local")


def _index_written_at(store: Target, writes: list[tuple[str, str]]) -> int:
    """The request that made the index visible (the Hub: the one commit)."""
    if store.scheme == "hf":
        return next(i for i, (m, p) in enumerate(writes) if "/commit/" in p)
    if store.scheme == "gs":  # an upload names its object in its body: the index is the last
        return max(i for i, (m, p) in enumerate(writes) if m == "POST" and "/upload/" in p)
    return next(
        i for i, (m, p) in enumerate(writes) if m == "PUT" and "index.json" in p.split("?")[0]
    )


def _deletes(store: Target, method: str, path: str) -> bool:
    if store.scheme == "hf":
        return "/commit/" in path  # deletions are part of the commit
    if store.scheme == "gs":
        return method == "DELETE" and ".ckptfix-upload" not in path
    return method == "POST" and "delete" in path


def test_resume_sends_no_tensor_byte_again(store: Target, tmp_path: Path) -> None:
    folder = small_model(Factory(tmp_path))
    args = ["reshard", folder, "-o", store.url(), "--max-shard", "10MB", "--json"]
    first = cli(*args)
    assert first.code == 0, first.stderr
    held = store.read()
    again = cli(*args, "--resume")
    assert again.code == 0, again.stderr
    upload = again.json()["written"]["upload"]
    shards = {name: data for name, data in held.items() if name.endswith(".safetensors")}
    assert sorted(upload["kept"]) == sorted(shards)
    assert upload["bytes_kept"] == sum(map(len, shards.values()))
    assert upload["bytes_sent"] == sum(len(d) for n, d in held.items() if n not in shards)
    assert store.read() == held


def test_dry_run_sends_nothing(store: Target, tmp_path: Path) -> None:
    folder = small_model(Factory(tmp_path))
    store.clear_log()
    run = cli("reshard", folder, "-o", store.url(), "--dry-run", "--json")
    assert run.code == 0, run.stderr
    assert run.json()["written"] is None and run.json()["destination"] == store.url()
    assert store.writes() == []
    assert store.read() == {}


@pytest.mark.parametrize("fault", ["checksum", "drop"])
def test_a_store_that_does_not_hold_what_was_sent_fails_the_run(
    store: Target, tmp_path: Path, fault: str
) -> None:
    folder = big_model(Factory(tmp_path), shards=2)
    store.break_store(fault)
    run = cli("reshard", folder, "-o", store.url(), "--max-shard", "40MB")
    assert run.code == 1, run.stderr
    assert len(run.error_lines) == 1, run.stderr
    assert run.error_lines[0].startswith(f"error: {store.scheme}://"), run.stderr
    assert "Traceback" not in run.stderr
    assert not [name for name in store.names() if name.endswith(".index.json")]
    if store.scheme == "hf":
        assert store.server is not None and not store.server.behaviour.kept.get("commits")


def test_hf_pr_opens_a_pull_request_and_leaves_the_branch(store: Target, tmp_path: Path) -> None:
    if store.scheme != "hf":
        run = cli("reshard", small_model(Factory(tmp_path)), "-o", store.url(), "--hf-pr")
        assert run.code == 2 and "--hf-pr" in run.stderr and len(run.error_lines) == 1
        assert store.read() == {}
        return
    assert store.server is not None
    folder = small_model(Factory(tmp_path))
    run = cli("reshard", folder, "-o", store.url(), "--max-shard", "10MB", "--hf-pr", "--json")
    assert run.code == 0, run.stderr
    assert store.read() == {}  # main is unchanged
    [(_, _, _, pr)] = store.server.behaviour.kept["commits"]
    assert pr
    [request] = [p for m, p in store.writes() if "/commit/" in p]
    assert "create_pr=1" in request
    local = cli("reshard", folder, "-o", tmp_path / "local", "--max-shard", "10MB")
    assert local.code == 0
    [tree] = store.server.behaviour.kept["trees"].values()
    assert folder_files(tree / "out") == folder_files(tmp_path / "local")


@pytest.mark.parametrize("scheme", ["gs", "hf"])
def test_sigterm_half_way_publishes_nothing(
    scheme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = big_model(Factory(tmp_path), shards=4)
    with (gcs_target if scheme == "gs" else hub_target)(  # type: ignore[operator]
        tmp_path, monkeypatch.setenv if scheme == "gs" else monkeypatch
    ) as store:
        assert store.server is not None
        store.server.behaviour.delay = 0.3
        args = ["reshard", str(folder), "-o", store.url(), "--max-shard", "40MB"]
        process = ckptfix_process(args, store.env)
        _wait_for_uploads(store, process)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
        store.server.behaviour.delay = 0.0
        assert process.returncode == 143, err
        lines = [line for line in err.decode().splitlines() if line]
        assert len(lines) == 1 and "interrupted" in lines[0], err
        # shards completed before the signal may stay under their names (no index: no
        # checkpoint, as on S3); no part, no index, no commit
        assert not [name for name in store.names() if not name.endswith(".safetensors")]
        assert store.leftovers() == []
        assert not store.server.behaviour.kept.get("commits")
        if scheme == "hf":
            assert store.read() == {}


def _wait_for_uploads(store: Target, process: subprocess.Popen[bytes]) -> None:
    """Until the process has sent two of its writes (of 4 shards' and more)."""
    deadline = time.monotonic() + 60
    while len(store.writes()) < 2 and time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        time.sleep(0.02)
    assert len(store.writes()) >= 2


@pytest.mark.parametrize("url", ["s3://b/out", "gs://b/out", "hf://org/model"])
def test_the_guard_fails_a_store_opened_off_this_machine(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    from ckptfix.write import stores
    from ckptfix.write.stores.base import StoreOptions

    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://s3.example.com")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "https://storage.example.com")
    monkeypatch.setattr(constants, "ENDPOINT", "https://huggingface.co")
    with pytest.raises(pytest.fail.Exception, match="without a loopback endpoint"):
        stores.open_store(url, StoreOptions())


def test_the_parts_a_killed_gs_run_left_are_deleted_by_a_run_told_to_take_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cloud Storage's temporary parts are under ckptfix's own prefix (.ckptfix-upload/RUN/
    NAME/part-N): whoever left them, it was a ckptfix run (a killed one, see
    test_store_gcs::test_dangling_parts_of_a_killed_run_are_found_and_cleaned)."""
    folder = small_model(Factory(tmp_path))
    with gcs_target(tmp_path, monkeypatch.setenv) as store:
        part = ".ckptfix-upload/killed-run/model-00001-of-00003.safetensors/part-00000"
        store.put(part, b"x" * 1000)
        args = ["reshard", folder, "-o", store.url(), "--max-shard", "10MB", "--json"]
        waits = cli(*args)  # its run may still be writing: taken over only when told to
        assert waits.code == 2 and "another ckptfix run is writing here" in waits.stderr
        assert len(store.leftovers()) == 1
        run = cli(*args, "--force")
        assert run.code == 0, run.stderr
        upload = run.json()["written"]["upload"]
        assert upload["aborted_uploads"] == ["model-00001-of-00003.safetensors"]
        assert upload["other_uploads"] == []
        assert store.leftovers() == []


def _write(out: str | Path, max_shard: str, *, fail: bool = False) -> None:
    """Five tensors through ckptfix.Writer (the last one alone larger than max_shard)."""
    import numpy as np

    import ckptfix

    with ckptfix.Writer(out, max_shard=max_shard, config={"model_type": "t"}) as writer:
        for i in range(4):
            writer.add(f"layer.{i}", np.arange(2**20, dtype=np.float32) * (i + 1))
        if fail:
            raise RuntimeError("the caller fails half way")
        writer.add("head", np.ones((1024, 2048), dtype=np.float16))


@pytest.mark.parametrize("max_shard", ["9MB", "100MB"], ids=["sharded", "one-file"])
def test_the_writer_writes_what_it_writes_locally(
    store: Target, tmp_path: Path, max_shard: str
) -> None:
    _write(tmp_path / "local", max_shard)
    _write(store.url(), max_shard)
    expected = folder_files(tmp_path / "local")
    assert store.read() == expected
    assert store.leftovers() == []
    assert not [name for name in expected if ".ckptfix" in name]
    if store.scheme == "hf":  # one commit, with the shards at their final paths
        assert store.server is not None
        [(_, _, operations, _)] = store.server.behaviour.kept["commits"]
        assert {op["value"]["path"] for op in operations} == {f"out/{n}" for n in expected}


def test_a_writer_that_fails_leaves_nothing(store: Target, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="half way"):
        _write(store.url(), "5MB", fail=True)
    # S3's marker stays, as after any failed run: the uploads it vouches for are gone, and
    # the next run's listing leaves it out
    assert [name for name in store.names() if name != ".ckptfix-writing"] == []
    assert store.leftovers() == []
    if store.scheme == "hf":
        assert store.server is not None and not store.server.behaviour.kept.get("commits")


def test_a_writer_whose_store_lies_publishes_nothing(store: Target, tmp_path: Path) -> None:
    import ckptfix

    store.break_store("checksum")
    with pytest.raises(ckptfix.CkptfixError) as caught:
        _write(store.url(), "9MB")
    assert "\n" not in str(caught.value) and str(caught.value).startswith("error: ")
    assert not [name for name in store.names() if name.endswith(".index.json")]
    assert store.leftovers() == []
    if store.scheme == "hf":
        assert store.server is not None and not store.server.behaviour.kept.get("commits")


def _copied_in_parts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """S3 copies at most 5 GiB in one CopyObject (MAX_COPY): made 12 MiB here, so that a
    Writer's 16 MiB shard takes its name by UploadPartCopy requests (counted, by part)."""
    from ckptfix.write.stores import s3, s3_copy

    monkeypatch.setattr(s3, "MAX_COPY", 12 * 2**20)
    copied: list[int] = []
    real = s3_copy._copy_part

    def counted(store: Any, names: Any, number: int, start: int, end: int) -> Any:
        copied.append(number)
        return real(store, names, number, start, end)

    monkeypatch.setattr(s3_copy, "_copy_part", counted)
    return copied


def test_a_writer_shard_larger_than_one_s3_copy_is_copied_in_parts(
    moto: tuple[str, Proxy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copied = _copied_in_parts(monkeypatch)
    _write(tmp_path / "local", "20MB")
    for store in s3_target(moto, monkeypatch.setenv):
        _write(store.url(), "20MB")
        assert store.read() == folder_files(tmp_path / "local")
        assert store.leftovers() == []
    assert sorted(copied) == [1, 2, 3]  # the 16 MiB shard: two 8 MiB parts and its header


def test_a_writer_copy_in_parts_that_differs_is_not_published(
    moto: tuple[str, Proxy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 reports another checksum for the copy only (from its first copied part on)."""
    import ckptfix

    copied = _copied_in_parts(monkeypatch)
    faults = moto[1].faults
    for store in s3_target(moto, monkeypatch.setenv):

        def lie_from_the_copy(method: str, path: str) -> None:
            if method == "PUT" and "/out/model-" in path and "partNumber=" in path:
                faults.lie_checksum = True

        faults.on_request = lie_from_the_copy
        with pytest.raises(ckptfix.VerificationError) as caught:
            _write(store.url(), "20MB")
        assert "\n" not in str(caught.value) and "model-00001-of-00002" in str(caught.value)
        assert copied and not [name for name in store.names() if name.endswith(".index.json")]
        assert store.leftovers() == []


def test_a_writer_copy_in_parts_that_fails_is_aborted(
    moto: tuple[str, Proxy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptfix

    copied = _copied_in_parts(monkeypatch)
    for store in s3_target(moto, monkeypatch.setenv):

        def refuse_the_third_part(method: str, path: str) -> int | None:
            third = method == "PUT" and "/out/model-" in path and "partNumber=3" in path
            return 403 if third else None

        moto[1].faults.refuse = refuse_the_third_part
        with pytest.raises(ckptfix.CkptfixError) as caught:
            _write(store.url(), "20MB")
        assert "\n" not in str(caught.value) and "model-00001-of-00002" in str(caught.value)
        assert 3 in copied and store.leftovers() == []  # the copy's upload aborted
        # what stays is the marker, as after any failed run (no upload's record)
        assert store.names() == [".ckptfix-writing"]


def test_a_writer_copy_that_differs_is_not_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cloud Storage reports another CRC-32C for the shards under their final names only:
    the copies are checked, not only the uploads."""
    import ckptfix

    with gcs_target(tmp_path, monkeypatch.setenv) as store:
        assert store.server is not None
        store.server.behaviour.wrong_checksum = "/model-0000"
        with pytest.raises(ckptfix.VerificationError) as caught:
            _write(store.url(), "9MB")
        assert "the copy of .ckptfix-shard-00001.safetensors" in str(caught.value)
        assert store.read() == {} and store.leftovers() == []


@pytest.mark.parametrize("max_shard", ["5MB", "100MB"], ids=["sharded", "one-file"])
def test_convert_to_torch_writes_the_bytes_it_writes_locally(
    store: Target, tmp_path: Path, max_shard: str
) -> None:
    """The .bin shards streamed in file order (write.torch_stream) are the torch writer's
    bytes, and torch loads them with the tie kept."""
    import io

    import torch

    source = torch_model(tmp_path)
    _both(store, tmp_path, source, ["convert", "--to", "torch", "--max-shard", max_shard])
    held = store.read()
    loaded = {}
    for name, data in held.items():
        if name.endswith(".bin"):
            loaded.update(torch.load(io.BytesIO(data), weights_only=True))
    assert torch.equal(loaded["embed.weight"], torch.load(source)["embed.weight"])


@pytest.mark.parametrize("split", [0, 3], ids=["one-file", "split-set"])
def test_gguf_reshard_writes_the_bytes_it_writes_locally(
    store: Target, tmp_path: Path, split: int
) -> None:
    """GGUF parts streamed in file order (write.gguf.gguf_stream): a split set (or one file)
    of the same bytes as a local reshard."""
    from tests.gguf_files import write_gguf

    source = write_gguf(tmp_path / "src" / "model.gguf", split_max_tensors=split)
    if split:
        source = sorted(source.parent.glob("*.gguf"))[0]
    max_shard = "2500" if not split else "10GB"  # one file split; a split set merged
    _both(store, tmp_path, source, ["reshard", "--max-shard", max_shard])
    parts = [name for name in store.names() if name.endswith(".gguf")]
    assert (len(parts) == 1) == bool(split), parts
