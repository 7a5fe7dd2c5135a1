"""gs:// outputs through the store protocol (ckptfix/write/stores/gcs.py), against the Cloud
Storage JSON API test server with uploads (tests/store_servers.gcs_write_server), which keeps
the bytes it receives and reports the CRC-32C of what it stored. Parts are made small here
(PART_MIN at 256 KiB) so that objects of a few MiB have many parts and compose rounds."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptfix.core.errors import RemoteError, VerificationError
from ckptfix.io.remote import Settings
from ckptfix.write.stores.gcs_upload import layout
from tests.optional import need, needs
from tests.remote_servers import HttpServer, file_crc32c
from tests.store_servers import gcs_write_server, pattern, stored, upload_whole

pytestmark = needs("gcsfs")

BUCKET = "out"
KIB = 2**10
SMALL = 256 * KIB
SETTINGS = Settings(timeout=10.0, retries=3, concurrency=4, backoff=0.0)


@pytest.fixture
def gcs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HttpServer]:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-credentials.json"))
    monkeypatch.setenv("NO_GCE_CHECK", "true")
    (tmp_path / "root" / BUCKET).mkdir(parents=True)
    from ckptfix.write.stores import gcs_upload

    monkeypatch.setattr(gcs_upload, "PART_MIN", SMALL)
    with gcs_write_server(tmp_path / "root") as server:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
        yield server


def _store(url: str = f"gs://{BUCKET}/run/model", **options: int) -> object:
    from ckptfix.write.stores.base import StoreOptions
    from ckptfix.write.stores.gcs import GcsStore

    settings = {"max_in_flight": 4 * SMALL, "concurrency": 3, **options}
    return GcsStore(url, StoreOptions(**settings), SETTINGS)  # type: ignore[arg-type]


def _bucket(server: HttpServer) -> Path:
    return server.root / BUCKET


def _crc(data: bytes) -> str:
    import google_crc32c

    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


@pytest.mark.parametrize(
    "size",
    [
        0,
        1000,
        SMALL,
        3 * SMALL + 123,
        pytest.param(70 * SMALL + 5, marks=pytest.mark.slow),  # 70 parts: rounds of compose
    ],
    ids=["empty", "under-a-part", "one-part", "parts-not-a-multiple", "compose-rounds"],
)
def test_objects_of_every_size_are_stored_exactly_and_verified(gcs: HttpServer, size: int) -> None:
    store = _store()
    data = pattern(size)
    found = upload_whole(store, "model-00001-of-00002.safetensors", data)
    assert found.checksum == ("crc32c", _crc(data))  # type: ignore[attr-defined]
    objects = stored(_bucket(gcs))
    assert objects == {"run/model/model-00001-of-00002.safetensors": data}  # no part left
    [listed] = store.list()  # type: ignore[attr-defined]
    assert (listed.name, listed.size, listed.checksum) == (
        "model-00001-of-00002.safetensors",
        size,
        ("crc32c", _crc(data)),
    )
    parts = layout("", size, store.options).parts  # type: ignore[attr-defined]
    composes = [p for m, p, _ in gcs.behaviour.log if m == "POST" and "/compose" in p]
    # 36 parts of 512 KiB: two composes into intermediates (32 + 4), then the object
    assert len(composes) == {1: 0, 2: 1, 36: 3}[parts]


@pytest.mark.slow
def test_parts_stream_in_parallel_within_the_budget(gcs: HttpServer) -> None:
    """Parts in flight at once: more than one, and never more bytes than the budget."""
    gcs.behaviour.delay = 0.05
    store = _store(max_in_flight=4 * SMALL, concurrency=8)
    from ckptfix.write.stores.gcs import GcsStore

    assert isinstance(store, GcsStore)
    peak = 0
    upload = store.begin("big.safetensors", 12 * SMALL)
    data = pattern(12 * SMALL)
    for start in range(0, len(data), SMALL // 2):
        upload.send(data[start : start + SMALL // 2])
        peak = max(peak, store.budget.taken)
    upload.complete()
    assert peak <= 4 * SMALL
    assert stored(_bucket(gcs))["run/model/big.safetensors"] == data


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault",
    [
        ("wrong_checksum", "part-00001"),
        ("wrong_checksum", "model/big.safetensors"),  # the composed object, not its parts
        ("drop_chunk", "part-00002"),
        ("corrupt", "part-00000"),
        ("wrong_checksum", "small.json"),
        ("corrupt", "small.json"),
    ],
    ids=[
        "part-crc",
        "composed-crc",
        "dropped-chunk",
        "changed-on-the-way",
        "single-crc",
        "single-changed",
    ],
)
def test_a_store_that_does_not_hold_the_bytes_sent_is_a_verification_error(
    gcs: HttpServer, fault: tuple[str, str]
) -> None:
    setattr(gcs.behaviour, *fault)
    store = _store()
    name = "small.json" if fault[1] == "small.json" else "big.safetensors"
    data = pattern(1000 if name == "small.json" else 6 * SMALL + 9)
    with pytest.raises(VerificationError) as caught:
        upload_whole(store, name, data)
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"error: gs://{BUCKET}/run/model/{name}: ")
    assert "nothing was published" in line
    assert stored(_bucket(gcs)) == {}  # no object, no part
    assert store.dangling() == []  # type: ignore[attr-defined]


def test_abort_leaves_nothing(gcs: HttpServer) -> None:
    store = _store()
    upload = store.begin("big.safetensors", 8 * SMALL)  # type: ignore[attr-defined]
    upload.send(pattern(5 * SMALL))
    upload.abort()
    upload.abort()  # again: nothing more
    assert stored(_bucket(gcs)) == {}


def test_transient_failures_are_retried(gcs: HttpServer) -> None:
    gcs.behaviour.fail_next, gcs.behaviour.fail_status = 3, 500
    store = _store()
    data = pattern(3 * SMALL + 1)
    upload_whole(store, "big.safetensors", data)
    assert stored(_bucket(gcs))["run/model/big.safetensors"] == data
    assert store.stats().requests >= 3 + 4 + 1  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("status", "message", "rule", "words"),
    [
        (403, "forced by the test", "remote-forbidden", "may create, read and delete objects"),
        (403, "The project exceeded its storage quota.", "remote-forbidden", "quota exceeded"),
        (401, "Invalid Credentials", "remote-credentials", "GOOGLE_APPLICATION_CREDENTIALS"),
        (404, "No such object.", "remote-not-found", "check the URL"),
    ],
)
def test_refusals_are_one_line_errors(
    gcs: HttpServer, status: int, message: str, rule: str, words: str
) -> None:
    gcs.behaviour.forced = {"model.safetensors": status}
    gcs.behaviour.forced_message = message
    store = _store()
    with pytest.raises(RemoteError) as caught:
        upload_whole(store, "model.safetensors", pattern(100))
    assert caught.value.rule == rule
    assert words in str(caught.value) and "\n" not in str(caught.value)
    assert str(caught.value).startswith(f"error: gs://{BUCKET}/run/model/model.safetensors: ")


def test_a_missing_bucket_is_one_error_before_anything_is_sent(gcs: HttpServer) -> None:
    with pytest.raises(RemoteError) as caught:
        _store("gs://no-such-bucket/model")
    assert str(caught.value) == (
        "error: gs://no-such-bucket/model: the bucket 'no-such-bucket' does not exist "
        "(HTTP 404) (rule remote-not-found; create the bucket, or check its name in the URL)"
    )
    assert not [m for m, _, _ in gcs.behaviour.log if m == "POST"]


def test_publish_puts_the_index_last_then_deletes(gcs: HttpServer) -> None:
    bucket = _bucket(gcs)
    (bucket / "run/model").mkdir(parents=True)
    (bucket / "run/model/old-00001-of-00001.safetensors").write_bytes(b"old")
    store = _store()
    upload_whole(store, "model-00001-of-00001.safetensors", pattern(2 * SMALL + 3))
    index = b'{"weight_map": {}}'
    published = store.publish(  # type: ignore[attr-defined]
        {"model.safetensors.index.json": index, "config.json": b"{}"},
        ["old-00001-of-00001.safetensors"],
        message="reshard",
    )
    assert [p.name for p in published] == ["config.json", "model.safetensors.index.json"]
    writes = [
        (m, p) for m, p, _ in gcs.behaviour.log if m in ("POST", "DELETE") and "/compose" not in p
    ]
    order = [p.rsplit("/", 1)[-1] if m == "DELETE" else m for m, p in writes[-3:]]
    assert order[-1].endswith("old-00001-of-00001.safetensors")  # the deletion after both
    uploads = [p for m, p in writes if m == "POST"]
    assert len(uploads) >= 2
    objects = stored(bucket)
    assert objects["run/model/model.safetensors.index.json"] == index
    assert "run/model/old-00001-of-00001.safetensors" not in objects


def test_reads_are_ranges_of_what_was_stored(gcs: HttpServer) -> None:
    store = _store()
    data = pattern(3 * SMALL)
    upload_whole(store, "a.safetensors", data)
    assert store.read("a.safetensors", 5, SMALL + 7) == data[5 : SMALL + 7]  # type: ignore[attr-defined]
    assert store.read("a.safetensors", 9, 9) == b""  # type: ignore[attr-defined]


_KILLED = textwrap.dedent(
    """
    import sys
    from ckptfix.io.remote import Settings
    from ckptfix.write.stores import gcs_upload
    from ckptfix.write.stores.base import StoreOptions
    from ckptfix.write.stores.gcs import GcsStore

    gcs_upload.PART_MIN = 256 * 1024
    store = GcsStore(sys.argv[1], StoreOptions(max_in_flight=1 << 20, concurrency=2),
                     Settings(timeout=10, retries=0, concurrency=2, backoff=0))
    upload = store.begin("model.safetensors", 64 * 256 * 1024)
    for _ in range(64):
        upload.send(bytes(256 * 1024))
    upload.complete()
    """
)


@pytest.mark.slow
def test_dangling_parts_of_a_killed_run_are_found_and_cleaned(gcs: HttpServer) -> None:
    gcs.behaviour.delay = 0.05
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED, f"gs://{BUCKET}/run/model"],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    temp = _bucket(gcs) / "run/model/.ckptfix-upload"
    deadline = time.monotonic() + 30
    while len(list(temp.rglob("part-*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    gcs.behaviour.delay = 0.0
    _settled(temp)  # a part the server had whole when the child died is still stored
    assert len(list(temp.rglob("part-*"))) >= 3
    store = _store()
    assert store.list() == []  # type: ignore[attr-defined]  # parts are not the output
    [dangling] = store.dangling()  # type: ignore[attr-defined]
    assert dangling.name == "model.safetensors" and dangling.started
    store.abort_dangling([dangling])  # type: ignore[attr-defined]
    assert stored(_bucket(gcs)) == {}
    assert store.dangling() == []  # type: ignore[attr-defined]


def _settled(folder: Path) -> None:
    """Wait until the files under `folder` stay the same for 0.3 s."""
    seen: list[Path] = []
    while True:
        now = sorted(folder.rglob("*"))
        if now == seen:
            return
        seen = now
        time.sleep(0.3)


_STREAMED = textwrap.dedent(
    """
    import sys, psutil
    from ckptfix.io.remote import Settings
    from ckptfix.write.stores.base import StoreOptions
    from ckptfix.write.stores.gcs import GcsStore

    size = 512 * 2**20
    store = GcsStore(sys.argv[1], StoreOptions(max_in_flight=64 * 2**20, concurrency=4),
                     Settings(timeout=60, retries=2, concurrency=4, backoff=0.1))
    chunk = bytes(range(256)) * 4096  # 1 MiB
    process = psutil.Process()
    before = process.memory_info().rss
    peak = before
    upload = store.begin("big.safetensors", size)
    for _ in range(size // len(chunk)):
        upload.send(chunk)
        peak = max(peak, process.memory_info().rss)
    print(upload.complete().checksum[1], peak - before, flush=True)
    """
)


@pytest.mark.slow
def test_a_512_mb_object_streams_in_bounded_memory(gcs: HttpServer) -> None:
    """Peak RSS growth of the uploading process ≤ the 64 MiB budget + 32 MiB slack (measured: 67-68 MiB)."""
    need("psutil")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    run = subprocess.run(
        [sys.executable, "-c", _STREAMED, f"gs://{BUCKET}/m"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    checksum, growth = run.stdout.split()
    path = _bucket(gcs) / "m/big.safetensors"
    assert path.stat().st_size == 512 * 2**20
    assert checksum == base64.b64encode(file_crc32c(path).to_bytes(4, "big")).decode()
    print(f"peak RSS growth: {int(growth) / 2**20:.1f} MiB")  # shown with -s
    assert int(growth) <= (64 + 32) * 2**20, int(growth) / 2**20


@pytest.mark.parametrize(
    ("size", "budget", "part", "parts"),
    [
        (0, 256 * 2**20, 256 * KIB, 1),
        (1000, 256 * 2**20, 256 * KIB, 1),
        (10 * 2**30, 256 * 2**20, 64 * 2**20, 160),  # 10 GiB in 64 MiB parts
        (100 * 2**30, 256 * 2**20, 100 * 2**20, 1024),  # the component limit sets the size
        (100 * 2**20, 4 * 2**20, 2 * 2**20, 50),  # a small budget: small parts
    ],
)
def test_part_sizes_follow_the_object_the_limit_and_the_budget(
    size: int, budget: int, part: int, parts: int
) -> None:
    from ckptfix.write.stores.base import StoreOptions
    from ckptfix.write.stores.gcs_upload import ALIGN, MAX_COMPONENTS, PART_MIN

    assert (PART_MIN, ALIGN, MAX_COMPONENTS) == (8 * 2**20, 256 * KIB, 1024)
    found = layout("gs://b/m", size, StoreOptions(max_in_flight=budget))
    assert (found.part_size, found.parts) == (part, parts)
    assert found.part_size % ALIGN == 0 and found.part_size * found.parts >= size


def test_an_object_too_large_for_the_budget_is_a_usage_error() -> None:
    from ckptfix.core.errors import UsageError
    from ckptfix.write.stores.base import StoreOptions

    with pytest.raises(UsageError) as caught:
        layout("gs://b/m/x.safetensors", 2**40, StoreOptions(max_in_flight=256 * 2**20))
    assert "needs parts of 1,073,741,824 bytes" in str(caught.value)


def test_without_google_crc32c_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ckptfix.core.errors import UsageError

    monkeypatch.setitem(sys.modules, "google_crc32c", None)  # import fails
    with pytest.raises(UsageError) as caught:
        _store()
    assert str(caught.value) == (
        f"error: gs://{BUCKET}/run/model: writing gs:// URLs needs google-crc32c "
        "(google_crc32c is not installed) (rule usage; pip install 'ckptfix[remote]')"
    )


def test_stat_and_the_hasher_agree_and_delete_removes(gcs: HttpServer) -> None:
    """What --resume compares (i24-core's protocol: stat, hasher, delete, flush)."""
    store = _store()
    data = pattern(5 * SMALL + 77)
    upload = store.begin("a.safetensors", len(data))  # type: ignore[attr-defined]
    upload.send(data)
    upload.flush()  # every part stored and checked, nothing composed yet
    assert stored(_bucket(gcs)).get("run/model/a.safetensors") is None
    upload.complete()
    hasher = store.hasher(len(data))  # type: ignore[attr-defined]
    for start in range(0, len(data), 65_537):
        hasher.update(memoryview(data)[start : start + 65_537])
    found = store.stat("a.safetensors")  # type: ignore[attr-defined]
    assert found is not None and found.size == len(data)
    assert found.checksum == hasher.value() == ("crc32c", _crc(data))
    assert store.stat("missing.safetensors") is None  # type: ignore[attr-defined]
    store.delete(["a.safetensors", "missing.safetensors"])  # type: ignore[attr-defined]
    assert stored(_bucket(gcs)) == {}


@pytest.mark.slow
def test_a_listing_without_end_is_refused_within_its_bound(gcs: HttpServer) -> None:
    store = _store()
    gcs.behaviour.hostile = "endless-pages"  # every page says another follows
    with pytest.raises(RemoteError) as caught:
        store.list()  # type: ignore[attr-defined]
    assert caught.value.rule == "remote-error" and "\n" not in str(caught.value)


def test_an_object_resource_without_a_size_is_one_error(
    gcs: HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store()
    hostile = [{"name": "run/model/x.safetensors", "size": "many"}]
    monkeypatch.setattr(store, "_objects", lambda prefix, limit=None: hostile)
    with pytest.raises(RemoteError) as caught:
        store.list()  # type: ignore[attr-defined]
    assert str(caught.value) == (
        f"error: gs://{BUCKET}/run/model/x.safetensors: unexpected answer from the server: an "
        "object resource without a size (rule remote-error; check the endpoint)"
    )
