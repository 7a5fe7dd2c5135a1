"""core.text, the one place that decides how names and other text from the files are
written out: shown (every line a person or a CI log reads), checksum_name (hash and diff
lines, as GNU sha256sum escapes), json_bytes (every JSON document) and redact (URLs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptfix.core.text import checksum_name, inert_lines, json_bytes, redact, shown
from tests.builders import Factory, Spec
from tests.output_checks import hidden_characters, sha256sum_line, workflow_commands

# Every code point, lone surrogates included (Python's form of a byte that is not UTF-8).
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)


@pytest.mark.slow
def test_every_control_and_format_character_is_escaped() -> None:
    """The class in core.text against the running Python's Unicode database."""
    unseen = [
        hex(code)
        for code in range(sys.maxunicode + 1)
        if unicodedata.category(chr(code)) in ("Cc", "Cf", "Cs", "Zl", "Zp")
        and hidden_characters(shown(chr(code)))
    ]
    assert unseen == []


def test_the_escapes() -> None:
    assert shown("a\nb\rc\td\x1be\x07f\x7fg\x9bh") == "a\\nb\\rc\\td\\x1be\\x07f\\x7fg\\x9bh"
    assert shown("\u202eevil\u200b\U000e0041") == "\\u202eevil\\u200b\\U000e0041"
    assert shown(os.fsdecode(b"bad\xff\x80name")) == "bad\\xff\\x80name"
    assert shown("\ud800") == "\\ud800"  # not a surrogate escape: its code point
    # printable text is as it is: backslashes, markup, emoji codes, other scripts
    plain = "a\\b [red]x[/red] :smile: é 模型 🙂"
    assert shown(plain) == plain


def test_workflow_command_forms_are_inert() -> None:
    assert shown("x ##[error]y") == "x ##\\x5berror]y"
    assert shown("###[error]y") == "###\\x5berror]y"
    assert shown("::error::x") == "\\x3a:error::x"
    assert shown("  \u3000::stop-commands::t") == "  \u3000\\x3a:stop-commands::t"
    assert shown("a ::error::x") == "a ::error::x"  # not at the start of a line: nothing to do
    assert shown("\n::error::x") == "\\n::error::x"  # the line break itself is escaped
    wrapped = "a ::x\n::error::y\n \t::warning::z ::w\n"
    assert inert_lines(wrapped) == "a ::x\n\\x3a:error::y\n \t\\x3a:warning::z ::w\n"


@pytest.mark.slow
@given(ANY_TEXT)
def test_shown_is_one_inert_printable_line(text: str) -> None:
    line = shown(text)
    assert hidden_characters(line) == []
    assert workflow_commands(line) == []
    assert workflow_commands("prefix " + line) == []
    assert shown(line) == line  # shown twice is shown once


@given(ANY_TEXT)
def test_checksum_name_reads_back_as_shown(text: str) -> None:
    escaped, name = checksum_name(text)
    line = ("\\" if escaped else "") + "0" * 64 + "  " + name
    assert hidden_characters(line) == [] and workflow_commands(line) == []
    _, back = sha256sum_line(line)
    assert shown(back) == shown(text)
    if not hidden_characters(text.replace("\n", "").replace("\r", "")) and "##[" not in text:
        assert back == text  # sha256sum's own escapes only: exactly the name


SHA256SUM = shutil.which("sha256sum")


@pytest.mark.skipif(SHA256SUM is None, reason="no sha256sum")
@pytest.mark.parametrize(
    "name", ["plain", "new\nline", "back\\slash", "cr\rname", "all\\\n\r\\\\n", "é模型", "a  b"]
)
def test_checksum_lines_match_the_real_sha256sum(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(b"x")
    done = subprocess.run([SHA256SUM, name], cwd=tmp_path, capture_output=True, check=True)
    line = done.stdout.decode().removesuffix("\n")
    escaped, shown_name = checksum_name(name)
    digest = line.removeprefix("\\")[:64]
    assert line == ("\\" if escaped else "") + f"{digest}  {shown_name}"


def test_json_bytes_is_the_same_document_with_nothing_raw() -> None:
    document = {
        "plain": ["a", 1, None, 2.5, {"b": True}],
        "hostile\x1b": ["##[error]x", "\x7f\x9b\u202e\U000e0041\u2028", "é", "\\##["],
    }
    data = json_bytes(document)
    assert json.loads(data) == document
    text = data.decode()
    assert hidden_characters(text) == [] and workflow_commands(text) == []
    clean = {"a": ["b", 1, {"c": None}], "é": "模型"}
    assert json_bytes(clean) == orjson.dumps(clean, option=orjson.OPT_INDENT_2)


@pytest.mark.parametrize("indent", [True, False])
def test_json_bytes_writes_integers_past_64_bits_exactly(indent: bool) -> None:
    """A shape a hostile file claims ([2**70, 0]) reaches the JSON report: orjson cannot
    write it (an internal error), so it is written as the exact number JSON allows."""
    document = {"shape": [2**70, 0], "name": "##[x\x1b", "bad": os.fsdecode(b"\xff")}
    data = json_bytes(document, indent=indent)
    assert json.loads(data) == {"shape": [2**70, 0], "name": "##[x\x1b", "bad": "\\xff"}
    assert workflow_commands(data.decode()) == [] and hidden_characters(data.decode()) == []
    assert (b"\n  " in data) is indent


def test_json_bytes_writes_bytes_that_are_not_utf8_as_everywhere() -> None:
    name = os.fsdecode(b"m/bad\xff.safetensors")
    document = json.loads(json_bytes({"path": name, "files": [{name: [name]}]}))
    assert document == {
        "path": "m/bad\\xff.safetensors",
        "files": [{"m/bad\\xff.safetensors": ["m/bad\\xff.safetensors"]}],
    }
    assert shown(name) == document["path"]


@pytest.mark.parametrize(
    ("given", "printed"),
    [
        ("https://user:secret@host/m/", "https://***@host/m/"),
        ("https://token@host:8080/m", "https://***@host:8080/m"),
        ("http://u:p@ss@host/m", "http://***@host/m"),
        ("s3://bucket/key", "s3://bucket/key"),
        ("https://host/m?a=1", "https://host/m?a=***"),
        (
            "https://b.s3.amazonaws.com/m.safetensors?X-Amz-Credential=AKIA%2F1&X-Amz-Date=2"
            "&X-Amz-Security-Token=tok&X-Amz-Signature=deadbeef",
            "https://b.s3.amazonaws.com/m.safetensors?X-Amz-Credential=***&X-Amz-Date=***"
            "&X-Amz-Security-Token=***&X-Amz-Signature=***",
        ),
        ("https://h/f?sv=1&sig=abc&se=2", "https://h/f?sv=***&sig=***&se=***"),
        ("https://h/f?token=abc#frag", "https://h/f?token=***#***"),
        # secrets under names no list foresees (they were printed as given)
        ("https://h/m?jwt=eyJ&t=1&code=2", "https://h/m?jwt=***&t=***&code=***"),
        ("https://h/m?pass=hunter2;session=s", "https://h/m?pass=***;session=***"),
        ("https://h/m?SECRETTOKEN", "https://h/m?***"),
        ("https://h/m#access_token=abc&x", "https://h/m#access_token=***&***"),
        ("https://h/m?", "https://h/m?"),
        ("https://h/f?access_token=a&key=b", "https://h/f?access_token=***&key=***"),
        (
            "error: 'https://u:p@h/x' and 'gs://b/o?X-Goog-Signature=s' failed",
            "error: 'https://***@h/x' and 'gs://b/o?X-Goog-Signature=***' failed",
        ),
        ("no url: a@b, key=c", "no url: a@b, key=c"),
    ],
)
def test_redact(given: str, printed: str) -> None:
    assert redact(given) == printed
    assert redact(printed) == printed


def test_a_report_streams_the_document_json_bytes_writes(factory: Factory) -> None:
    """inspect --json streams its document a batch of tensors at a time: the same bytes."""
    from ckptfix.ops.inspect import inspect

    name = os.fsdecode(b"bad\xff ##[x\x1b\xe2\x80\xae.safetensors")
    specs = [Spec(f"t{index}\x9b##[error]\u202e\U000e0041") for index in range(7)]
    report = inspect(factory.safetensors(name, specs, with_format=False))
    whole = json_bytes(report.to_dict())
    for batch in (1, 3, 10_000):
        assert b"".join(report.json_chunks(batch)) == whole
    assert json.loads(whole)["tensors"][6]["name"] == specs[6].name
    assert hidden_characters(whole.decode()) == [] and workflow_commands(whole.decode()) == []
