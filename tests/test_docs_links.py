"""README.md and docs/ against the code and against themselves: docs/cli.md is what
`make docs` renders from the Typer app now; README stays a landing page (at most 300 lines,
opening with `make demo` and `make test`) and docs/index.md links every page; every relative
link leads to a file and heading that exist; and every `ckptfix ...` command line the pages
show parses with the real command line (its options, their values, its arguments), without
running it, as every option an inline `ckptfix CMD --option` names exists.

As in tests/test_docs.py, each check is a function from text to a list of problems, so the
tests below also feed it broken text and see that it notices.
"""

from __future__ import annotations

import re
import shlex
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main

from tests.docs_pages import DOCS, ROOT, anchors, blocks, links, page, pages, prose

# --- (a) the generated command-line reference ----------------------------------------------


def test_cli_reference_is_what_make_docs_renders_now() -> None:
    from ckptfix.cli.reference import render

    assert page("cli.md") == render(), "docs/cli.md is stale: run `make docs`"


def test_cli_reference_names_every_option_of_every_command() -> None:
    from ckptfix.cli.app import app

    group: Any = typer.main.get_command(app)
    text = page("cli.md")
    sections = dict(re.findall(r"^## `ckptfix (\w+)`\n(.*?)(?=^## |\Z)", text, re.M | re.S))
    root = typer.Context(group, info_name="ckptfix")
    assert sorted(sections) == sorted(group.list_commands(root))
    for name, body in sections.items():
        command = group.get_command(root, name)
        for param in command.params:
            names = [*param.opts, *param.secondary_opts]
            if param.param_type_name == "option":
                assert any(f"`{option}`" in body for option in names), (name, names)
            else:
                assert f"`{param.metavar}`" in body, (name, param.metavar)


def _toy_app(option: str, default: str) -> typer.Typer:
    """An app of one command with one option (the option as a default value: annotations are
    strings here, which typer could not resolve to this function's locals)."""
    toy = typer.Typer()

    @toy.callback()
    def _root() -> None:
        """A toy."""

    @toy.command()
    def run(level: str = typer.Option(default, option, help="How loud.")) -> None:
        """Run it."""

    return toy


def test_the_reference_follows_a_changed_option() -> None:
    """An option renamed or given another default is another reference: the staleness test
    above then fails until `make docs` is run."""
    from ckptfix.cli.reference import render

    before = render(_toy_app("--level", "low"))
    after = render(_toy_app("--loudness", "high"))
    assert "| `--level` | `<str>` | `low` | How loud. |" in before
    assert "| `--loudness` | `<str>` | `high` | How loud. |" in after
    assert before != after


# --- (b) the landing page and the index ----------------------------------------------------

README_MAX_LINES = 300


def landing_problems(text: str) -> list[str]:
    """How README fails to be the landing page: over 300 lines, or not opening with the two
    commands that work on a fresh machine."""
    problems = []
    if len(text.splitlines()) > README_MAX_LINES:
        problems.append(f"{len(text.splitlines())} lines, over {README_MAX_LINES}")
    first = blocks(text)[0].lines if blocks(text) else ()
    opening = [line.split("#")[0].strip() for line in first]
    if opening != ["make demo", "make test"] or not text.startswith("# ckptfix\n\n```"):
        problems.append(f"does not open with make demo and make test: {opening}")
    return problems


def test_readme_is_the_landing_page() -> None:
    assert landing_problems(page("README.md")) == []


def test_the_landing_check_sees_a_long_or_reordered_readme() -> None:
    text = page("README.md")
    assert landing_problems(text + "more\n" * README_MAX_LINES)[0].endswith("over 300")
    swapped = text.replace("make demo ", "make @ ", 1).replace("make test ", "make demo ", 1)
    assert landing_problems(swapped.replace("make @ ", "make test ", 1)) == [
        "does not open with make demo and make test: ['make test', 'make demo']"
    ]


def test_every_page_is_linked_from_the_index() -> None:
    linked = {target.partition("#")[0] for target in links(page("index.md"))}
    assert {path.name for path in DOCS.glob("*.md")} - {"index.md"} <= linked
    assert "docs/index.md" in links(page("README.md"))


# --- (c) links ---------------------------------------------------------------------------------


def link_problems(path: Path, text: str) -> list[str]:
    """The relative links of a page (at `path`, with `text`) that lead to no file, or to a
    heading its page does not have."""
    problems = []
    for target in links(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        name = f"{path.relative_to(ROOT)}: {target}"
        if not resolved.exists():
            problems.append(f"{name}: no such file")
        elif anchor and resolved.suffix == ".md":
            own = text if resolved == path else resolved.read_text(encoding="utf-8")
            if anchor not in anchors(own):
                problems.append(f"{name}: no such heading")
    return problems


def test_every_relative_link_resolves() -> None:
    linking = [*pages(), ROOT / "SECURITY.md", ROOT / "ARCHITECTURE.md"]  # they link in too
    found = [problem for path in linking for problem in link_problems(path, path.read_text())]
    assert found == []


def test_links_are_checked_at_all() -> None:
    """The pages link to each other and to headings: the check above has work to do."""
    targets = [target for path in pages() for target in links(path.read_text())]
    assert len(targets) > 60
    assert any("#" in target and not target.startswith("#") for target in targets)
    assert "docs/index.md" in links(page("README.md"))


def test_the_link_check_sees_a_broken_link() -> None:
    path = DOCS / "inspect.md"
    text = "# A page\n\n## Exit codes\n\n[ok](#exit-codes) [ok](findings.md#findings)\n"
    assert link_problems(path, text) == []
    broken = text + "[a](nowhere.md) [b](#no-heading) [c](findings.md#no-such) [d](../action.yml)\n"
    assert link_problems(path, broken) == [
        "docs/inspect.md: nowhere.md: no such file",
        "docs/inspect.md: #no-heading: no such heading",
        "docs/inspect.md: findings.md#no-such: no such heading",
    ]
    fenced = text + "```\n[a](nowhere.md)\n```\n"  # inside a code block it is not a link
    assert link_problems(path, fenced) == []


# --- (d) command lines -------------------------------------------------------------------------

_PROMPT = re.compile(r"^\s*(?:\$ |- )?(?:python -m )?(ckptfix (?:.*))$")
# A synopsis names its arguments (`ckptfix inspect PATH... [--json]`, `[OPTIONS]`): the
# synopsis tests check those; an example names real ones.
_SYNOPSIS = re.compile(r"^ckptfix (?:\w+\s+)?(?:[A-Z]+\b|\[)")


def command_lines(text: str) -> list[str]:
    """The `ckptfix ...` command lines of a page's code blocks (after a `$ ` prompt or a
    YAML list's `- `, or as `python -m ckptfix ...`), synopses aside."""
    found = []
    for block in blocks(text):
        for line in block.lines:
            match = _PROMPT.match(line)
            if match and not _SYNOPSIS.match(match[1]):
                found.append(match[1])
    return found


def mentions(text: str) -> list[str]:
    """The inline code spans of a page's prose that start with `ckptfix `: most name a
    command and some of its options (`ckptfix hash --manifest`) rather than whole lines."""
    return [span for line in prose(text) for span in re.findall(r"`(ckptfix [^`]+)`", line)]


def _words(line: str) -> list[str]:
    """A command line's words up to a pipe, redirection or `||`, without its comment."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = []
    for word in lexer:
        if word and word[0] in "|&;<>()":
            break
        words.append(word)
    return words[1:]  # after `ckptfix`


@cache
def _group() -> Any:
    from ckptfix.cli.app import app

    return typer.main.get_command(app)


def _command(words: list[str]) -> tuple[Any, set[str]]:
    """The command the words name (None for the root's own options) and the option names
    it takes."""
    group = _group()
    root = typer.Context(group, info_name="ckptfix")
    command = group.get_command(root, words[0]) if words and words[0][:1] != "-" else None
    params = (command or group).get_params(root)
    return command, {name for param in params for name in [*param.opts, *param.secondary_opts]}


def parse_problem(line: str) -> str | None:
    """Why a command line would not parse (an unknown command or option, a bad choice, a
    missing or extra argument, an invalid size), or None when it parses. Nothing runs: the
    command's context is made, which parses and converts every value."""
    from ckptfix.core.errors import CkptfixError
    from ckptfix.core.sizes import parse_size

    words = _words(line)
    if "--help" in words:  # it would print the help: its options are all there is to check
        return mention_problem(line)
    command, options = _command(words)
    if command is None:
        known = not words or words[0][:1] == "-"
        bad = [word for word in words if word not in options]
        return f"not a command or root option: {bad or words}" if bad or not known else None
    try:
        context = command.make_context(words[0], words[1:], parent=_root_context())
        if context.params.get("max_shard") is not None:
            parse_size(context.params["max_shard"])
    except (typer.TyperException, CkptfixError) as exc:
        return str(exc)
    return None


def _root_context() -> Any:
    return typer.Context(_group(), info_name="ckptfix")


def mention_problem(span: str) -> str | None:
    """Why an inline `ckptfix CMD --option ...` is wrong: no such command, or an option the
    command does not take."""
    words = _words(span)
    command, options = _command(words)
    if command is None and words and words[0][:1] != "-":
        return f"no command {words[0]!r}"
    unknown = [word for word in words if word.startswith("-") and word not in options]
    return f"{words[0] if command else 'ckptfix'} has no option {unknown}" if unknown else None


def test_every_command_line_in_the_docs_parses() -> None:
    lines = {
        f"{path.relative_to(ROOT)}: {line}": line
        for path in pages()
        for line in command_lines(path.read_text())
    }
    assert len(lines) > 40  # the pages' examples were found at all
    commands = {_words(line)[0] for line in lines.values() if _words(line)}
    assert commands >= {"inspect", "fix", "reshard", "convert", "dedupe", "hash", "diff"}
    problems = {where: problem for where, line in lines.items() if (problem := parse_problem(line))}
    assert problems == {}


def test_every_option_the_prose_names_exists() -> None:
    spans = {
        f"{path.relative_to(ROOT)}: {span}": span
        for path in pages()
        for span in mentions(path.read_text())
    }
    assert len(spans) > 50
    problems = {
        where: problem for where, span in spans.items() if (problem := mention_problem(span))
    }
    assert problems == {}


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("ckptfix inspect m --fail-on warnings", "'warnings' is not one of"),
        ("ckptfix inspect m --bogus", "No such option: --bogus"),
        ("ckptfix reshard a b -o c", "Got unexpected extra argument(s) (b)"),
        ("ckptfix diff a", "Missing parameter: b"),
        ("ckptfix frobnicate m", "not a command or root option: ['frobnicate', 'm']"),
        ("ckptfix reshard m -o out --max-shard 5G", "invalid size '5G'"),
        ("ckptfix convert m -o out --dtype", "Option '--dtype' requires an argument"),
        ("ckptfix --versions", "not a command or root option: ['--versions']"),
        ("ckptfix hash --help --bogus", "hash has no option ['--bogus']"),
    ],
)
def test_the_command_line_check_sees_a_bad_line(line: str, problem: str) -> None:
    found = parse_problem(line)
    assert found is not None and problem in found, found


def test_the_mention_check_sees_a_wrong_option() -> None:
    assert mention_problem("ckptfix hash --manifest") is None
    assert mention_problem("ckptfix convert --dequantize") is None
    assert mention_problem("ckptfix --help") is None
    assert mention_problem("ckptfix hash --dequantize") == "hash has no option ['--dequantize']"
    assert mention_problem("ckptfix unpack x") == "no command 'unpack'"


def test_what_counts_as_a_command_line() -> None:
    text = "\n".join(
        [
            "Run `ckptfix hash m --json` or `ckptfix`-style tools.",
            "```sh",
            "ckptfix inspect ./m --json | jq .   # a comment",
            "$ ckptfix fix m -o out",
            "  - ckptfix inspect a b --format junit > out.xml || true",
            "python -m ckptfix --version",
            "ckptfix inspect PATH... [--json]",
            "ckptfix convert [OPTIONS] SRC",
            "ckptfix [OPTIONS] COMMAND [ARGS]...",
            "fix: ckptfix fix m -o OUT (or --in-place): what it does",
            "```",
        ]
    )
    assert command_lines(text) == [
        "ckptfix inspect ./m --json | jq .   # a comment",
        "ckptfix fix m -o out",
        "ckptfix inspect a b --format junit > out.xml || true",
        "ckptfix --version",
    ]
    assert mentions(text) == ["ckptfix hash m --json"]
    assert _words("ckptfix inspect ./m --json | jq .   # a comment") == ["inspect", "./m", "--json"]
    assert _words("ckptfix inspect a --format junit > out.xml || true") == [
        "inspect",
        *("a", "--format", "junit"),
    ]
    assert [parse_problem(line) for line in command_lines(text)] == [None] * 4
