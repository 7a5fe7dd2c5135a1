"""Servers that misbehave on purpose, against every backend: the test servers of
tests/remote_servers.py (HTTP, Hub, Cloud Storage JSON API, S3 API), told by
tests/hostile_answers.py to send gzip-encoded, endless or longer-than-asked ranged answers,
listings that never end, hold too much or trickle in, and redirects to other schemes, in
loops and in chains; and indexes whose shard names climb out of the folder once their URL
is decoded. Each is one error line naming the URL and the rule, in bounded memory and time
(measured in a fresh process), and nothing outside the folder is ever asked for. The same
answers against every command: tests/test_bad_inputs.py; random mutations of good answers:
tests/test_mutation_property.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.answer_mutations import Mutation, replacing
from tests.helpers import Measured, cli, measured, one_error_line
from tests.hostile_answers import KINDS, SERVER_CAP, applies, expected_rule
from tests.optional import needs
from tests.remote_servers import BACKENDS, Served, served_model, serving

pytestmark = needs("aiohttp", "gcsfs", "botocore")

TIMEOUT = 2.0  # CKPTFIX_REMOTE_TIMEOUT in these tests: a listing may take 10 times that
MIB = 2**20
# Over a well-behaved server's run of the same command, in a fresh process: the most a
# hostile answer may add to the peak RSS, and to the wall time besides a listing's bound.
RSS_ALLOWANCE = 64 * MIB
TIME_ALLOWANCE = 10.0


@pytest.fixture(params=BACKENDS)
def served(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Served]:
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", str(TIMEOUT))
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    with serving(request.param, tmp_path, served_model(tmp_path), monkeypatch) as found:
        yield found


_baselines: dict[str, Measured] = {}


def baseline(served: Served) -> Measured:
    """`inspect` of the well-behaved server, once per backend (a fresh process)."""
    if served.backend not in _baselines:
        run = measured("inspect", served.url)
        assert run.code == 0, run.stderr
        _baselines[served.backend] = run
    return _baselines[served.backend]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_answer_is_one_line_in_bounded_memory_and_time(served: Served, kind: str) -> None:
    if not applies(served.backend, kind):
        pytest.skip(f"{served.backend} listings have one page")
    good = baseline(served)
    served.server.behaviour.reset()
    served.server.behaviour.hostile = kind
    run = measured("inspect", served.url, timeout=120)
    assert run.code == 1, (run.code, run.stderr)
    [line] = run.error_lines
    assert line.startswith(f"error: {served.url}"), line
    assert f"(rule {expected_rule(served.backend, kind)};" in line, line
    assert run.peak_rss <= good.peak_rss + RSS_ALLOWANCE, (run.peak_rss, good.peak_rss)
    assert run.seconds <= good.seconds + 10 * TIMEOUT + TIME_ALLOWANCE, run.seconds
    # nowhere near all of an endless answer was taken in: at most the listing pages' bytes
    assert served.server.behaviour.bytes_sent < SERVER_CAP // 8


@pytest.mark.slow
def test_a_listing_that_trickles_in_ends_within_its_bound(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "0.3")  # so 3 s for the listing
    served.server.behaviour.hostile = "slow-listing"
    start = time.perf_counter()
    line = one_error_line("inspect", served.url)
    assert time.perf_counter() - start < 3 + 3
    assert line.startswith(f"error: {served.url}: unexpected answer from the server: "), line
    assert "did not end" in line, line


@pytest.mark.slow
def test_a_ranged_answer_that_trickles_in_ends_within_its_bound(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bytes asked for, right, one every 50 ms (never the 0.3 s between bytes that is
    a timeout): the answer may take 10 timeouts, and a second per 16 KiB asked."""
    good = baseline(served)
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "0.3")  # so 3 s for a header's bytes
    served.server.behaviour.hostile = "slow-range"
    run = measured("inspect", served.url, timeout=30)  # unbounded, the shards take 15 min
    assert run.code == 1, (run.code, run.stderr)
    assert run.seconds < good.seconds + 3 + TIME_ALLOWANCE, run.seconds
    [line] = run.error_lines
    assert ": unexpected answer from the server: the answer to bytes 0-" in line, line
    assert " did not arrive within 3.01 s (rule remote-error;" in line, line  # 3 + 208/16 Ki


@pytest.mark.slow
def test_listing_pages_that_come_slowly_end_within_the_bound(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    if served.backend == "http":
        pytest.skip("an HTTP listing has one page")
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "0.3")  # so 3 s for the listing
    served.server.behaviour.hostile = "endless-pages"
    served.server.behaviour.delay = 0.1  # every answer: 30 pages in the 3 s at most
    start = time.perf_counter()
    line = one_error_line("inspect", served.url)
    assert time.perf_counter() - start < 3 + 3
    assert "the listing did not end within 3 s (rule remote-error;" in line, line


def test_every_request_asks_for_unencoded_answers(served: Served, tmp_path: Path) -> None:
    """Accept-Encoding: identity on every request a command makes, whichever library makes
    it (an encoded answer is refused, so one asked for would be an error)."""
    served.server.behaviour.reset()
    assert cli("convert", served.url, "-o", tmp_path / "out").code == 0
    assert served.server.behaviour.encodings == {"identity"}


def test_an_answer_cut_short_is_tried_again_then_one_error_line(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ranged answer whose body stops before its Content-Length, the connection closed:
    a connection that failed, tried again (botocore's IncompleteReadError was an internal
    error)."""
    monkeypatch.setenv("CKPTFIX_REMOTE_CONCURRENCY", "1")  # the answers in the same order
    behaviour = served.server.behaviour
    behaviour.mutation = lambda answer: answer  # counts the answers, changes none
    assert cli("inspect", served.url).code == 0
    first = next(i for i, (_, _, ranged) in enumerate(behaviour.log) if ranged)
    for retries in (1, 0):
        monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", str(retries))
        behaviour.reset()
        behaviour.mutation = Mutation("truncate", first, 0, 0)  # the body goes, not its length
        behaviour.mutate_at = first
        run = cli("inspect", served.url, "--json")
        if retries:
            assert run.code == 0, run.stderr
            assert run.json()["remote"]["retries"] == 1
        else:
            assert run.code == 1, run.stderr
            [line] = run.error_lines
            assert "the connection failed: " in line and "(rule remote-unreachable;" in line, line


@pytest.mark.parametrize(
    ("old", "new", "what"),
    [
        # botocore's int() of a count or a size: a ValueError (was an internal error)
        (b"<KeyCount>", b"<KeyCount>many", "unexpected answer from the server: not S3's XML"),
        (b"<Size>", b"<Size>x", "unexpected answer from the server: not S3's XML"),
        # not XML: botocore takes it for an answer cut short, a 500 tried again
        (b"<ListBucketResult", b"<html><ListBucketResult", "the server failed (HTTP 500)"),
    ],
)
def test_an_s3_listing_out_of_form_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: bytes, new: bytes, what: str
) -> None:
    """botocore parses S3's XML itself: its parser's errors are the server's fault."""
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    with serving("s3", tmp_path, served_model(tmp_path), monkeypatch) as served:
        served.server.behaviour.mutation = replacing(old, new)
        served.server.behaviour.mutate_at = 1  # the listing, after the one-key probe
        line = one_error_line("inspect", served.url)
    assert line.startswith(f"error: {served.url}: {what}"), line


# --- names that leave the folder once their URL is decoded ---------------------------------

CLIMBING = [
    "%2e%2e/secret.safetensors",  # percent-encoded dots: `..` once the server decodes them
    "%2E%2E/secret.safetensors",
    "%252e%252e/secret.safetensors",  # encoded twice
    "sub/..%2f..%2fsecret.safetensors",  # an encoded slash
    "..%5csecret.safetensors",  # an encoded backslash
    "..;/secret.safetensors",  # `;` parameters, which some servers drop
]


# `make test-fast` tries the first name on every backend; `make test` every name.
@pytest.mark.parametrize(
    "name", [CLIMBING[0], *(pytest.param(name, marks=pytest.mark.slow) for name in CLIMBING[1:])]
)
def test_an_index_entry_that_climbs_out_once_decoded_is_refused_unread(
    served: Served, name: str
) -> None:
    (served.local.parent / "secret.safetensors").write_bytes(b"not for you")
    index = served.local / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    document["weight_map"]["c"] = name
    index.write_text(json.dumps(document))
    served.server.behaviour.reset()
    run = cli("inspect", served.url, "--json", "--fail-on", "never")
    assert run.code == 0, run.stderr
    [finding] = [f for f in run.json()["findings"] if "unsafe-shard-path" in f["message"]]
    assert f"shard name {name!r} points outside the model folder" in finding["message"]
    asked = [path for _, path, _ in served.server.behaviour.log]
    assert not [path for path in asked if "secret" in path], asked


def test_no_path_that_climbs_out_once_decoded_is_ever_requested(served: Served) -> None:
    """Whatever names the path (an index, a DCP `.metadata`, a listing), the folder refuses
    to open it: the check under the index's, for every other source of names."""
    from ckptfix.core.errors import RemoteError
    from ckptfix.io.remote_folder import open_url

    (served.local.parent / "secret.safetensors").write_bytes(b"not for you")
    folder = open_url(served.url).folder
    served.server.behaviour.reset()
    for name in CLIMBING:
        url = f"{served.url}/{name}"
        assert not folder.is_file(url)
        with pytest.raises(RemoteError) as raised:
            folder.open(url).read_at(0, 1)
        assert raised.value.rule == "remote-outside"
    assert served.server.behaviour.log == []


def test_a_listed_name_that_climbs_out_once_decoded_is_not_an_entry(
    served: Served, tmp_path: Path
) -> None:
    """A sub-folder named `%2e%2e` is listed (quoted once more, or as is): read back as a
    URL, it would be the folder's parent, which a convert would download into OUT. The
    folder holds no such entry for ckptfix."""
    (served.local / "%2e%2e").mkdir()
    (served.local / "%2e%2e" / "notes.txt").write_bytes(b"a sub-folder's file")
    (served.local.parent / "secret.txt").write_bytes(b"not for you")
    served.server.behaviour.reset()
    run = cli("convert", served.url, "-o", tmp_path / "out")
    assert run.code == 0, run.stderr
    assert not list((tmp_path / "out").rglob("secret.txt"))
    asked = [path for _, path, _ in served.server.behaviour.log]
    assert not [path for path in asked if "secret" in path or "2e" in path.lower()], asked


# --- redirects that are fine ----------------------------------------------------------------


def test_a_hub_download_redirected_elsewhere_never_carries_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hub sends its downloads to a CDN: the redirect is followed (by ckptfix, not
    httpx), the token goes to the Hub only, and the bytes are the same."""
    from tests.remote_servers import http_server

    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    model = served_model(tmp_path)
    want = cli("hash", model, "--json")
    with (
        serving("hf", tmp_path, model, monkeypatch) as hub,
        http_server(model) as cdn,
    ):
        monkeypatch.setenv("HF_TOKEN", "hf_secret_token")
        hub.server.behaviour.cdn = cdn.url
        got = cli("hash", hub.url, "--json")
    assert got.code == 0, got.stderr
    assert got.json()["digest"] == want.json()["digest"]
    assert cdn.behaviour.gets()  # the bytes came from the CDN
    assert cdn.behaviour.authorized == []
    assert "resolve" in hub.server.behaviour.authorized  # the Hub itself got the token
