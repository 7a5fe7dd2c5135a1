"""The bad-input corpus against every command: the documented exit code, one error line
naming the file and the rule, no traceback, nothing written, nothing executed; and the
hostile answers of a remote server (tests/hostile_answers.py) against every command and
every backend, to the same standard."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.attacks import ATTACK_CASES
from tests.builders import Factory
from tests.cases import (
    GGUF_CASES,
    INDEX_CASES,
    PICKLE_CASES,
    SAFETENSORS_CASES,
    SHARDING_CASES,
    Case,
)
from tests.helpers import cli, tree_snapshot
from tests.hf_shard_builders import HF_SHARD_CASES
from tests.hostile_answers import KINDS, applies, expected_rule
from tests.megatron_cases import MEGATRON_CASES
from tests.optional import need
from tests.remote_servers import BACKENDS, served_model, serving
from tests.zero_builders import ZERO_CASES

FAMILIES = [
    SAFETENSORS_CASES,
    SHARDING_CASES,
    INDEX_CASES,
    PICKLE_CASES,
    ATTACK_CASES,
    ZERO_CASES,
    GGUF_CASES,
    HF_SHARD_CASES,
]
CORPUS = [case for family in FAMILIES for case in family]
COMMANDS = ["inspect", "reshard", "convert", "dedupe", "hash", "diff"]


def corpus_pairs(cases: list[Case], commands: list[list[str]]) -> list[pytest.ParameterSet]:
    """Every case against every command. `make test-fast` runs each case against the first
    command (`inspect`, whose reader every command shares) and every command against the
    first case of each family (`cases`' firsts); `make test` runs every pair."""
    firsts = {family[0].id for family in FAMILIES} | {MEGATRON_CASES[0].id}
    return [
        pytest.param(
            case,
            command,
            marks=[] if command == commands[0] or case.id in firsts else [pytest.mark.slow],
            id=f"{case.id}-{' '.join(command)}",
        )
        for case in cases
        for command in commands
    ]


def test_corpus_size() -> None:
    assert len({case.id for case in CORPUS}) == len(CORPUS) >= 80


def marker(case: Case) -> str:
    if case.code == "unsafe-pickle":
        return "outside the allowlist"
    if case.code == "lfs-pointer":
        return "Git LFS pointer"
    if case.code == "unsupported-format":
        return {"torchscript": "TorchScript", "tar": "tar archive"}.get(
            case.rule, f"(rule {case.rule};"
        )
    return f"(rule {case.rule};"


@pytest.mark.parametrize(("case", "command"), corpus_pairs(CORPUS, [[name] for name in COMMANDS]))
def test_every_command_refuses(
    factory: Factory, case: Case, command: list[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    [command] = command
    path = case.build(factory)
    before = tree_snapshot(factory.root)
    out = factory.root / "out"
    args = [command, path] if command in ("inspect", "hash") else [command, path, "-o", out]
    if command == "diff":  # a good checkpoint against the bad one
        good = Factory(tmp_path_factory.mktemp("good")).safetensors("good.safetensors")
        args = [command, good, path]
    run = cli(*args)
    assert run.code == 1
    assert "Traceback" not in run.stdout + run.stderr
    assert len(run.error_lines) == 1, run.stderr
    line = run.error_lines[0]
    assert line.startswith(f"error: {factory.root}"), line  # names the file
    assert marker(case) in line, line
    assert not out.exists()
    assert not list(factory.root.glob(".ckptfix-*"))
    assert tree_snapshot(factory.root) == before
    assert not (factory.root / "CANARY").exists()


MEGATRON_COMMANDS = [
    ["inspect"],
    ["convert"],
    ["convert", "--to-hf", "llama"],
    ["dedupe"],
    ["hash"],
    ["diff"],
    ["diff", "--to-hf", "llama"],
]


@pytest.mark.parametrize(("case", "command"), corpus_pairs(MEGATRON_CASES, MEGATRON_COMMANDS))
def test_every_command_refuses_a_bad_megatron_folder(
    factory: Factory, case: Case, command: list[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = case.build(factory)
    before = tree_snapshot(factory.root)
    out = factory.root / "out"
    name, options = command[0], command[1:]
    args = (
        [name, path, *options] if name in ("inspect", "hash") else [name, path, "-o", out, *options]
    )
    if name == "diff":  # a good checkpoint against the bad one
        good = Factory(tmp_path_factory.mktemp("good")).safetensors("good.safetensors")
        args = [name, good, path, *options]
    run = cli(*args)
    assert run.code == 1, run.stderr
    assert "Traceback" not in run.stdout + run.stderr
    assert len(run.error_lines) == 1, run.stderr
    line = run.error_lines[0]
    assert line.startswith(f"error: {factory.root}"), line
    assert marker(case) in line, line
    assert not out.exists()
    assert not list(factory.root.glob(".ckptfix-*"))
    assert tree_snapshot(factory.root) == before
    assert not (factory.root / "CANARY").exists()


# --- the same refusals from a server that answers as an attacker would ----------------------


# `make test-fast` runs `inspect` against each answer that takes a request or two, from one
# backend in turn; `make test` every command against every answer from every backend
# (listings of 100,000 entries take seconds).
QUICK_KINDS = [kind for kind in KINDS if not kind.endswith(("-listing", "-pages", "-entries"))]
QUICK_BACKEND = {
    kind: serving_it[turn % len(serving_it)]
    for turn, kind in enumerate(QUICK_KINDS)
    for serving_it in [[backend for backend in BACKENDS if applies(backend, kind)]]
}


@pytest.mark.parametrize(
    ("backend", "kind", "command"),
    [
        pytest.param(
            backend,
            kind,
            command,
            marks=[]
            if QUICK_BACKEND.get(kind) == backend and command == "inspect"
            else [pytest.mark.slow],
            id=f"{backend}-{kind}-{command}",
        )
        for backend in BACKENDS
        for kind in KINDS
        for command in COMMANDS
        if applies(backend, kind)
    ],
)
def test_every_command_refuses_a_hostile_server(
    backend: str,
    kind: str,
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every answer of tests/hostile_answers.py (ranged answers that are gzip-encoded,
    endless or longer than asked; listings that never end or hold too much; redirects to
    other schemes, loops, chains) from each backend's server: one error line naming the
    URL and the rule, nothing written. (Memory and time: tests/test_remote_hostile.py.)"""
    need("aiohttp")
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "15")  # the server shares this process
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    model = served_model(tmp_path / "served")
    with serving(backend, tmp_path / "served", model, monkeypatch) as served:
        served.server.behaviour.hostile = kind
        out = tmp_path / "out"
        args = [command, served.url] + ([] if command in ("inspect", "hash") else ["-o", out])
        if command == "diff":  # a good checkpoint against the served one
            args = [command, Factory(tmp_path / "good").safetensors("good.safetensors"), served.url]
        run = cli(*args)
    assert run.code == 1, (run.code, run.stderr)
    assert "Traceback" not in run.stdout + run.stderr
    [line] = run.error_lines
    assert line.startswith(f"error: {served.url}"), line
    assert f"(rule {expected_rule(backend, kind)};" in line, line
    assert not out.exists()
    assert not list(tmp_path.glob(".ckptfix-*"))
