"""The bounds every remote answer is read against (ckptfix/io/remote_answers.py), and the
check of paths under a remote folder in every form a server may decode them to
(ckptfix/io/urls.climbs_out), as pure functions: no server."""

from __future__ import annotations

import time

import pytest

from ckptfix.io.remote_answers import (
    ANSWER_CAP,
    MAX_ENTRIES,
    MAX_PAGES,
    Body,
    Listing,
    body_limit,
    redirect_target,
)
from ckptfix.io.remote_errors import RangeRefused, UnexpectedAnswer, classify
from ckptfix.io.urls import climbs_out

ASKED = "bytes=65536-131071"  # 65,536 bytes from 65,536
RANGE = {"Content-Range": "bytes 65536-131071/999999", "Content-Length": "65536"}


def test_a_ranged_answer_may_hold_exactly_the_range() -> None:
    assert body_limit(ASKED, 206, RANGE) == 65536
    assert body_limit(ASKED, 206, {}) == 65536  # no Content-Range, no length: taken as asked
    assert body_limit(ASKED, 206, {**RANGE, "Content-Encoding": "identity"}) == 65536
    assert body_limit(ASKED, 206, {**RANGE, "Content-Encoding": "aws-chunked"}) == 65536


@pytest.mark.parametrize(
    ("status", "headers", "what"),
    [
        (200, {}, "the server ignores range requests (asked for bytes 65536-131071, it sent"),
        (206, {"Content-Range": "bytes 0-65535/999999"}, "answered 'bytes 0-65535/999999' to"),
        (206, {"Content-Range": "items 65536-131071/9"}, "answered 'items 65536-131071/9' to"),
        (206, {"Content-Length": "65537"}, "sent more than the 65,536 bytes asked for"),
    ],
)
def test_an_answer_that_is_not_the_range_is_refused_before_its_body(
    status: int, headers: dict[str, str], what: str
) -> None:
    with pytest.raises(RangeRefused, match=what.replace("(", r"\(").replace(")", r"\)")):
        body_limit(ASKED, status, headers)


@pytest.mark.parametrize("asked", [ASKED, None])
@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd", "identity, gzip"])
def test_an_encoded_answer_is_refused_before_its_body(asked: str | None, encoding: str) -> None:
    status = 206 if asked else 200
    with pytest.raises(UnexpectedAnswer, match=f"the answer is {encoding}-encoded"):
        body_limit(asked, status, {"Content-Encoding": encoding.upper()})


def test_other_answers_may_hold_the_cap() -> None:
    assert body_limit(None, 200, {}) == ANSWER_CAP
    assert body_limit(ASKED, 404, {"Content-Encoding": "gzip"}) == ANSWER_CAP  # an error page


def test_a_body_stops_one_byte_past_its_bound() -> None:
    ranged = Body(10, (0, 10), float("inf"))
    ranged.add(b"0123456789")
    assert ranged.room() == 1  # one byte more is asked for, to see that there is one
    with pytest.raises(RangeRefused, match="sent more than the 10 bytes asked for"):
        ranged.add(b"!")
    listing = Body(ANSWER_CAP, None, float("inf"))
    assert listing.room(2**20) == 2**20
    with pytest.raises(UnexpectedAnswer, match="an answer longer than 16 MiB"):
        listing.add(bytes(ANSWER_CAP + 1))
    late = Body(ANSWER_CAP, None, time.monotonic() - 1)
    with pytest.raises(UnexpectedAnswer, match="the answer did not end in time"):
        late.add(b"x")


def test_a_ranged_answer_must_arrive_in_time_for_its_size() -> None:
    """10 request timeouts, and a second per MIN_RATE bytes asked: a trickle ends."""
    from ckptfix.io.remote_answers import MIN_RATE, new_body

    before = time.monotonic()
    body = new_body(ASKED, 206, RANGE, 20)
    allowed = 20 + 65536 / MIN_RATE  # 24 s
    assert before + allowed <= body.deadline <= time.monotonic() + allowed
    assert body.late == "the answer to bytes 65536-131071 did not arrive within 24 s"
    late = Body(10, (0, 10), time.monotonic() - 1, body.late)
    with pytest.raises(UnexpectedAnswer, match="did not arrive within 24 s"):
        late.add(b"0")


def test_a_listing_stops_at_its_pages_entries_and_time() -> None:
    pages = Listing(60)
    for _ in range(MAX_PAGES - 1):
        pages.page(0, more=True)
    pages.page(0, more=False)  # the 1,000th page may be the last one
    pages = Listing(60)
    for _ in range(MAX_PAGES - 1):
        pages.page(0, more=True)
    with pytest.raises(UnexpectedAnswer, match="the listing did not end after 1,000 pages"):
        pages.page(0, more=True)
    entries = Listing(60)
    entries.page(MAX_ENTRIES, more=False)
    with pytest.raises(UnexpectedAnswer, match="a listing of more than 100,000 entries"):
        Listing(60).page(MAX_ENTRIES + 1, more=False)
    late = Listing(0.01)
    time.sleep(0.02)
    late.page(1, more=False)  # the last page arrived: done, however long it took
    with pytest.raises(UnexpectedAnswer, match=r"the listing did not end within 0\.01 s"):
        late.page(1, more=True)


def test_a_listing_bounds_the_answers_of_its_thread() -> None:
    from ckptfix.io.remote_answers import new_body

    listing = Listing(0.01)
    with listing.pages_of_this_thread():
        inside = new_body(None, 200, {}, 600)
    outside = new_body(None, 200, {}, 600)
    assert (inside.deadline, inside.late) == (listing.deadline, listing.late())
    assert outside.deadline > listing.deadline + 500


@pytest.mark.parametrize(
    ("location", "what"),
    [
        ("file:///etc/passwd", "(file:)"),
        ("FTP://127.0.0.1/x", "(FTP:)"),
        ("data:text/plain,hello", "(data:)"),
        ("javascript:alert(1)", "(javascript:)"),
        ("", "no URL"),
        (None, "no URL"),
    ],
)
def test_a_redirect_to_another_scheme_is_refused(location: str | None, what: str) -> None:
    with pytest.raises(UnexpectedAnswer, match=f"the server redirected to .*{what}"):
        redirect_target(location)


@pytest.mark.parametrize(
    "location", ["https://cdn.example/x", "HTTP://h/x", "/other/path", "//h/x", "x?a=b:c"]
)
def test_a_redirect_to_http_is_followed(location: str) -> None:
    assert redirect_target(location) == location


@pytest.mark.parametrize(
    "name",
    [
        "..",
        "../x",
        "a/../../x",
        "./x",
        "%2e%2e/x",
        "%2E%2e/x",
        ".%2e/x",
        "%252e%252e/x",
        "%25252e%25252e/x",
        "a%2f..%2f..%2fx",
        "..%5cx",
        "..\\x",
        "a\\..\\..\\x",
        "..;/x",
        "..;jsessionid=1/x",
        "a/%2e%2e;x/y",
        "x%00.safetensors",
        "%" + "25" * 9 + "2e",  # still decoding after 8 rounds: refused as such
    ],
)
def test_a_path_that_climbs_out_in_any_decoded_form(name: str) -> None:
    assert climbs_out(name)


@pytest.mark.parametrize(
    "name",
    [
        "model-00001-of-00002.safetensors",
        "sub/model.safetensors",
        "a..b.safetensors",
        "..a/b",
        "100%.safetensors",
        "a%20b.safetensors",
        "a;b.safetensors",
        "%2e%2e%2e/x",
        "",
    ],
)
def test_a_path_that_stays_inside(name: str) -> None:
    assert not climbs_out(name)


@pytest.mark.parametrize(
    ("error", "rule"),
    [
        (RangeRefused("the server sent more than ..."), "remote-no-range"),
        (UnexpectedAnswer("an answer longer than 16 MiB"), "remote-error"),
    ],
)
def test_a_refused_answer_is_its_rule_and_never_retried(error: Exception, rule: str) -> None:
    failure = classify(error, "http")
    assert failure is not None
    assert (failure.rule, failure.transient) == (rule, False)
