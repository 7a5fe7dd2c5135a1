"""Names that attack whoever reads the output: file, folder, tensor and tag names with
terminal escapes (retitle, clear, clipboard), rich markup, line breaks that forge lines, and
GitHub workflow commands in both the runner's forms. Every command's human output, its
error lines, the lines of `hash` and `diff` that scripts parse, and the pre-commit hook
are checked as their consumers read them (tests/output_checks.py): nothing a terminal acts
on, no workflow command, every name shown (escaped, never dropped)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ckptfix.core.findings import Finding, Severity
from ckptfix.ops.report import FileSummary, Report
from ckptfix.precommit import main as precommit
from tests import training_fixtures as fixtures
from tests.builders import Factory, Spec, seeded_bytes
from tests.helpers import cli
from tests.output_checks import hidden_characters, sha256sum_line, workflow_commands

# A file name that retitles the terminal, forges a line with a current and a legacy
# workflow command, reverses the text after it and holds markup.
HOSTILE = "w\x1b]0;pwn\x07\n::error::forged\r##[error]y\u202e[red]z"
# ... as a person reads it: every control and format character as its escape.
HOSTILE_SHOWN = "w\\x1b]0;pwn\\x07\\n::error::forged\\r##\\x5berror]y\\u202e[red]z"
TENSORS = [
    "t\x1b[2J\n::warning::forged",  # clears the screen, forges a line
    "[red]tag[0]",  # rich markup
    "##[error]x\r",
    "\u202eevil :smile:",  # bidi override, an emoji code
    "clip\x1b]52;c;aGk=\x07",  # writes the clipboard (OSC 52)
    "w",
]
FOLDER = "m\x1b]0;pwn\x07\n::warning::dir"
zero_saved = fixtures.zero_saved  # a DeepSpeed checkpoint saved by DeepSpeed (session-wide)


@pytest.fixture
def hostile(factory: Factory, monkeypatch: pytest.MonkeyPatch) -> Factory:
    """In the current folder: HOSTILE.safetensors (hostile tensor names, two with equal
    bytes, a hostile metadata value, no "format"), an LFS stub HOSTILE.bin, other.safetensors
    to diff against, and a sharded FOLDER with a stray hostile file beside its shards."""
    monkeypatch.chdir(factory.root)
    same = seeded_bytes(24, "same")
    specs = [Spec(name, data=same if index < 2 else None) for index, name in enumerate(TENSORS)]
    factory.safetensors(
        f"{HOSTILE}.safetensors", specs, {"note": "\x1b[31mred\x1b[0m"}, with_format=False
    )
    factory.lfs_pointer(f"{HOSTILE}.bin")
    factory.safetensors(
        "other.safetensors", [Spec(TENSORS[0]), Spec("only\x1b[Kb"), Spec(TENSORS[3], "F16")]
    )
    factory.sharded(FOLDER, [[Spec(TENSORS[0])], [Spec(TENSORS[1])]])
    factory.safetensors(f"{FOLDER}/{HOSTILE}.safetensors", [Spec(TENSORS[2])])
    return factory


FILE, STUB = f"{HOSTILE}.safetensors", f"{HOSTILE}.bin"
# Each command with what its output must show: a hostile name, escaped.
COMMANDS = [
    (["inspect", FILE, "--tensors"], ["[red]tag[0]", "clip\\x1b]52;c;aGk=\\x07", HOSTILE_SHOWN]),
    (["inspect", FILE, STUB], [HOSTILE_SHOWN + ".bin"]),  # a heading per path, an error line
    (["inspect", FOLDER], [HOSTILE_SHOWN]),
    (["inspect", f"missing{HOSTILE}"], [f"missing{HOSTILE_SHOWN}"]),
    (["fix", FILE, "-o", "out", "--dry-run"], [HOSTILE_SHOWN]),
    (["fix", FOLDER, "-o", "out", "--dry-run"], [HOSTILE_SHOWN]),
    (["reshard", FILE, "-o", "out", "--dry-run"], ["t\\x1b[2J\\n::warning::forged"]),
    (["convert", FILE, "-o", "out", "--dry-run", "--exclude", "?red?tag*"], ["[red]tag[0]"]),
    (["dedupe", FILE, "-o", "out", "--by-content", "--dry-run"], ["[red]tag[0]"]),
    (["reshard", STUB, "-o", "out"], [HOSTILE_SHOWN]),  # the error line only
    (["hash", FILE, "--tensors"], ["[red]tag[0]"]),
    (["diff", FILE, "other.safetensors"], ["[red]tag[0]", "only\\\\x1b[Kb"]),
]


IDS = [
    "inspect-tensors",
    "inspect-two-paths",
    "inspect-folder",
    "inspect-missing",
    "fix-file",
    "fix-folder",
    "reshard-plan",
    "convert-plan",
    "dedupe-plan",
    "reshard-error",
    "hash-tensors",
    "diff",
]


@pytest.mark.parametrize(("args", "shown"), COMMANDS, ids=IDS)
def test_human_output_shows_every_name_inert(
    hostile: Factory, args: list[str], shown: list[str]
) -> None:
    run = cli(*args)
    output = run.stdout + run.stderr
    assert hidden_characters(output) == []
    assert workflow_commands(output) == []
    for name in shown:
        assert name in output


def test_a_written_output_names_its_files_inert(hostile: Factory) -> None:
    run = cli("fix", FOLDER, "-o", "out")
    assert run.code == 0, run.stderr
    assert HOSTILE_SHOWN in run.stdout  # the stray file is left out, and named
    assert hidden_characters(run.stdout + run.stderr) == []
    assert workflow_commands(run.stdout + run.stderr) == []


def test_layout_and_metadata_values_are_never_markup(capsys: pytest.CaptureFixture[str]) -> None:
    """A DeepSpeed tag is a folder name; rich would read `[red]` as a style and drop it."""
    from ckptfix.cli import render

    layout = {"framework": "deepspeed", "stage": 2, "tag": "[red]tag[0]\x1b]0;t\x07"}
    finding = Finding("dtype-mix", Severity.INFO, "[bold]x[/bold] :smile:", "f[red]")
    report = Report(
        "p", "deepspeed", (FileSummary("f[red]", "x", 1, 0),), (), (finding,), None, layout
    )
    render.report(report, show_tensors=False, fail_on="error")
    out = capsys.readouterr().out
    assert "tag [red]tag[0]\\x1b]0;t\\x07" in out
    assert "[bold]x[/bold] :smile:" in out and "f[red]" in out
    assert hidden_characters(out) == []


@pytest.mark.parametrize("width", [40, 80])
def test_lines_wrapped_to_a_terminal_width_are_inert(
    factory: Factory, monkeypatch: pytest.MonkeyPatch, width: int
) -> None:
    """With FORCE_COLOR (set in many CI jobs) rich writes as to a terminal and wraps long
    lines: a line may then start in the middle of a name, after any of its spaces."""
    monkeypatch.chdir(factory.root)
    name = "a ::error::pwned b ::warning::x.safetensors"
    factory.safetensors(name, with_format=False)
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", str(width))
    run = cli("inspect", name)
    assert run.code == 0
    assert workflow_commands(run.stdout) == []
    assert "\\x3a:error::pwned" in run.stdout  # where a line started with it


@pytest.mark.slow
def test_a_deepspeed_tag_is_shown_as_it_is(zero_saved: Path, tmp_path: Path) -> None:
    tag = "[red]tag[0]\x1b]0;t\x07"
    folder = tmp_path / "ds"
    shutil.copytree(zero_saved / "zero2_fp32", folder)
    (folder / "global_step2").rename(folder / tag)
    (folder / "latest").write_text(tag)
    run = cli("inspect", folder)
    assert run.code == 0, run.stderr
    assert "tag [red]tag[0]\\x1b]0;t\\x07" in run.stdout
    assert hidden_characters(run.stdout) == []


# -- lines that scripts parse --------------------------------------------------------------


def test_hash_lines_read_back_as_sha256sum_reads_them(factory: Factory) -> None:
    """A name with a line break cannot forge a digest line for another name, nor the path
    line another model's."""
    forged = "x\n" + "0" * 64 + "  F32 [2, 3]  lm_head.weight"
    names = ["lm_head.weight", forged, "back\\slash", "cr\rname", "esc\x1b[2Jname"]
    path = factory.safetensors("m\n" + "1" * 64 + "  trusted-model.safetensors", map(Spec, names))
    run = cli("hash", path, "--tensors")
    assert run.code == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 2 + len(names)
    assert sha256sum_line(lines[0])[1] == str(path)
    document = cli("hash", path, "--json").json()
    shown_names = {name: name for name in names} | {"esc\x1b[2Jname": "esc\\x1b[2Jname"}
    expected = [
        (entry["digest"], f"F32 [2, 3]  {shown_names[name]}")
        for name, entry in document["tensors"].items()
    ]
    assert [sha256sum_line(line) for line in lines[2:]] == expected
    # as sha256sum marks them: only a line whose name needed an escape starts with `\`
    marked = [
        name for name, line in zip(document["tensors"], lines[2:], strict=True) if line[0] == "\\"
    ]
    assert marked == ["back\\slash", "cr\rname", "esc\x1b[2Jname", forged]


def test_diff_lists_one_name_per_line(factory: Factory) -> None:
    forged = "a\n  lm_head.weight"
    a = factory.safetensors("a.safetensors", [Spec(forged), Spec("b\\c"), Spec("same")])
    b = factory.safetensors("b.safetensors", [Spec("same")])
    run = cli("diff", a, b)
    assert run.code == 1
    lines = run.stdout.splitlines()
    start = lines.index("only in A (" + str(a) + "): 2")
    assert lines[start + 1 : start + 3] == ["  a\\n  lm_head.weight", "  b\\\\c"]
    assert "  lm_head.weight" not in lines


# -- the pre-commit hook -------------------------------------------------------------------


def test_hook_lines_inside_github_actions(
    hostile: Factory, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_WORKSPACE", str(hostile.root))
    assert precommit([FILE, STUB, f"gone{HOSTILE}.bin", "--fail-on", "warning"]) == 1
    captured = capsys.readouterr()
    commands = workflow_commands(captured.out)
    # one annotation per finding and per failed file, and nothing else
    assert [(c.name, c.properties["title"]) for c in commands] == [
        ("warning", "missing-format-metadata"),
        ("error", "lfs-pointer"),
        ("error", "input-not-found"),
    ]
    assert [c.properties["file"] for c in commands] == [
        HOSTILE_SHOWN + ".safetensors",
        HOSTILE_SHOWN + ".bin",
        f"gone{HOSTILE_SHOWN}.bin",
    ]
    assert len(captured.out.splitlines()) == 3
    assert workflow_commands(captured.err) == []
    assert hidden_characters(captured.out + captured.err) == []
    assert len(captured.err.splitlines()) == 3 and HOSTILE_SHOWN in captured.err


def test_hook_and_formats_with_a_name_that_is_not_utf8(
    factory: Factory, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every byte but NUL, `/`, letters and digits in one name (255 bytes at most): each
    output names it the same way, its bytes that are not UTF-8 as `\\xNN`."""
    monkeypatch.chdir(factory.root)
    monkeypatch.setenv("GITHUB_WORKSPACE", str(factory.root))
    raw = bytes(b for b in range(1, 256) if not chr(b).isalnum() and b != ord("/"))
    raw += b".safetensors"
    name = os.fsdecode(raw)
    factory.safetensors(name, with_format=False)
    expected = raw.decode("utf-8", "backslashreplace")  # Python's own \xNN for such bytes
    assert cli("inspect", name, "--json").json()["path"] == expected
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    assert precommit([name, "--fail-on", "warning"]) == 1
    captured = capsys.readouterr()
    [command] = workflow_commands(captured.out)
    assert command.name == "warning" and hidden_characters(command.properties["file"]) == []
    assert hidden_characters(captured.out + captured.err) == []
