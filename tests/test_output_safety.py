"""The output side of a write under hostile conditions: other writers racing for OUT,
--force and --in-place next to user files, symlinks and special files in a model folder,
signals after the commit and during start-up, read-only mounts. Every test builds the
situation and checks the promise: one error line and nothing lost, or a complete output."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptfix.core import signals as core_signals
from ckptfix.core.errors import WriteError
from ckptfix.core.tensor import TensorInfo
from ckptfix.ops.rewrite import ReshardOptions, reshard
from ckptfix.plan.select import SelectOptions, select
from ckptfix.platform import linux
from ckptfix.write import staging
from tests.builders import Factory, Spec
from tests.helpers import as_another_user, cli, flat, give_away, tensor_names, tree_snapshot

COMMANDS = ["reshard", "convert", "dedupe"]


@pytest.fixture
def model(factory: Factory) -> Path:
    folder = factory.sharded("m", [[Spec("a")], [Spec("b")]])
    factory.config("m")
    return folder


def names(folder: Path) -> list[str]:
    return sorted(entry.name for entry in folder.iterdir())


def leftovers(*folders: Path) -> list[Path]:
    return [path for folder in folders for path in folder.glob(".ckptfix-*")]


def before_commit(monkeypatch: pytest.MonkeyPatch, action: Callable[[], object]) -> None:
    """Run `action` once, just before the first staging folder is swapped in."""
    real = staging.Staging.commit
    done = False

    def commit(self: staging.Staging) -> None:
        nonlocal done
        if not done:
            done = True
            action()
        real(self)

    monkeypatch.setattr(staging.Staging, "commit", commit)


# Races and replacement --------------------------------------------------------------------


def test_a_file_saved_into_out_during_the_run_is_kept(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    before_commit(monkeypatch, lambda: (out / "notes.txt").write_text("mine"))
    run = cli("reshard", model, "-o", out)
    assert run.code == 1
    assert run.error_lines == [
        f"error: {out}: output folder changed during the run (notes.txt); it was left as it "
        "is now and nothing was written (rule output-conflict; run again)"
    ]
    assert tree_snapshot(out) == {"notes.txt": b"mine"}
    assert not leftovers(tmp_path)


def test_a_file_changed_in_out_during_a_forced_run_is_kept(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    before_commit(monkeypatch, lambda: (out / "config.json").write_text('{"edited": 1}'))
    run = cli("convert", model, "-o", out, "--force")
    assert run.code == 1
    assert run.error_lines == [
        f"error: {out}: output folder changed during the run (config.json); it was left as it "
        "is now and nothing was written (rule output-conflict; run again)"
    ]
    assert tree_snapshot(out) == {"config.json": b'{"edited": 1}'}
    assert not leftovers(tmp_path)


def test_out_created_by_someone_else_during_the_run_is_kept(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"

    def create() -> None:
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")

    before_commit(monkeypatch, create)
    run = cli("dedupe", model, "-o", out)
    assert run.code == 1
    assert run.error_lines == [
        f"error: {out}: output folder was created by another program during the run; it was "
        "left as it is now and nothing was written (rule output-conflict; run again)"
    ]
    assert tree_snapshot(out) == {"theirs.txt": b"theirs"}
    assert not leftovers(tmp_path)


def test_a_file_saved_into_out_during_the_swap_is_kept(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lands after the last look and before the exchange: seen in the old folder afterwards,
    which is exchanged back."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    real = staging._exchange
    calls = 0

    def exchange(first: str, second: str) -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            (out / "late.txt").write_text("late")
        return real(first, second)

    monkeypatch.setattr(staging, "_exchange", exchange)
    run = cli("reshard", model, "-o", out, "--force")
    assert run.code == 1
    assert run.error_lines == [
        f"error: {out}: output folder changed during the run (late.txt); it was left as it "
        "is now and nothing was written (rule output-conflict; run again)"
    ]
    assert tree_snapshot(out) == {"late.txt": b"late", "model.safetensors": b"old"}
    assert not leftovers(tmp_path)


def test_two_writers_to_one_new_out(
    factory: Factory, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both start while OUT does not exist; the second to finish must not discard the first."""
    other = factory.sharded("other", [[Spec("z", "U8", (7,))]])
    out = tmp_path / "out"
    before_commit(monkeypatch, lambda: reshard(other, out))
    with pytest.raises(WriteError) as caught:
        reshard(model, out)
    assert caught.value.line() == (
        f"error: {out}: output folder was created by another program during the run; it was "
        "left as it is now and nothing was written (rule output-conflict; run again)"
    )
    assert tensor_names(out) == ["z"]
    assert not leftovers(tmp_path)


def test_a_second_writer_to_an_existing_out_fails_at_once(
    factory: Factory, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = factory.sharded("other", [[Spec("z", "U8", (7,))]])
    out = tmp_path / "out"
    out.mkdir()
    refused: list[str] = []

    def second() -> None:
        with pytest.raises(WriteError) as caught:
            reshard(other, out, ReshardOptions(force=True))
        refused.append(caught.value.line())
        # the first writer's staging folder only (and its lock file, where it keeps one)
        assert len([path for path in leftovers(tmp_path) if path.is_dir()]) == 1

    before_commit(monkeypatch, second)
    reshard(model, out)
    assert refused == [
        f"error: {out}: another ckptfix run is writing to this folder "
        "(rule output-conflict; wait for it to finish, then run again)"
    ]
    assert tensor_names(out) == ["a", "b"]
    assert not leftovers(tmp_path)


def test_without_renameat2_the_same_promises_hold(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel or file system without renameat2: the old OUT is moved aside, checked, and
    only then replaced by a plain rename."""
    monkeypatch.setattr(linux, "renameat2", lambda *args: False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    run = cli("reshard", model, "-o", out, "--force", "--json")
    assert run.code == 0, run.stderr
    assert run.json()["written"]["replaced"] == [str(out / "model.safetensors")]
    assert tensor_names(out) == ["a", "b"]
    assert cli("reshard", model, "-o", tmp_path / "new").code == 0
    assert tensor_names(tmp_path / "new") == ["a", "b"]
    before = tree_snapshot(out)
    real = staging.record
    calls = 0

    def record_then_intrude(folder: str) -> staging.OutputState:
        nonlocal calls
        calls += 1
        if calls == 3:  # after the first look at the swap: the write lands in the moved folder
            (Path(folder) / "late.txt").write_text("late")
        return real(folder)

    monkeypatch.setattr(staging, "record", record_then_intrude)
    run = cli("reshard", model, "-o", out, "--force")
    assert run.code == 1
    assert run.error_lines == [
        f"error: {out}: output folder changed during the run (late.txt); it was left as it "
        "is now and nothing was written (rule output-conflict; run again)"
    ]
    assert tree_snapshot(out) == {**before, "late.txt": b"late"}
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("command", COMMANDS)
def test_force_names_what_it_replaces(model: Path, tmp_path: Path, command: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    old = ["README.md", "config.json", "model.safetensors", "tokenizer.json", "vocab.txt"]
    for name in old:
        (out / name).write_text("old")
    run = cli(command, model, "-o", out, "--force")
    assert run.code == 0, run.stderr
    assert (
        f"replaced: {out} (old contents: README.md, config.json and 3 more, moved aside and "
        "deleted)" in flat(run.stdout)
    )
    out.rename(tmp_path / "first")
    out.mkdir()
    (out / "model.safetensors").write_text("old")
    run = cli(command, model, "-o", out, "--force", "--json")
    assert run.code == 0, run.stderr
    assert run.json()["written"]["replaced"] == [str(out / "model.safetensors")]
    run = cli(command, model, "-o", tmp_path / "new", "--json")
    assert run.json()["written"]["replaced"] == []


@pytest.mark.parametrize("command", COMMANDS)
def test_force_refuses_to_replace_unrelated_files(
    model: Path, tmp_path: Path, command: str
) -> None:
    out = tmp_path / "out"
    (out / "photos").mkdir(parents=True)
    (out / "photos" / "cat.jpg").write_bytes(b"cat")
    (out / "thesis.pdf").write_bytes(b"thesis")
    (out / "model.safetensors").write_bytes(b"old")
    before = tree_snapshot(out)
    run = cli(command, model, "-o", out, "--force")
    assert run.code == 2
    assert run.error_lines == [
        f"error: {out}: output folder holds files that are not part of a checkpoint: photos, "
        "thesis.pdf (rule usage; pass --replace-any to replace them too, or choose another -o)"
    ]
    assert tree_snapshot(out) == before
    run = cli(command, model, "-o", out, "--force", "--replace-any", "--json")
    assert run.code == 0, run.stderr
    assert run.json()["written"]["replaced"] == [
        str(out / "model.safetensors"),
        str(out / "photos"),
        str(out / "thesis.pdf"),
    ]
    assert tensor_names(out) == ["a", "b"]


def test_unrelated_files_are_named_up_to_three(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "unet").mkdir(parents=True)
    (out / "unet" / "config.json").write_text("{}")
    (out / "unet" / "holiday.jpg").write_bytes(b"jpg")  # one stranger makes the folder one
    for name in ("a.pdf", "b.docx", "c.xlsx", "config.json"):
        (out / name).write_bytes(b"x")
    run = cli("reshard", model, "-o", out, "--force")
    assert run.code == 2
    assert run.error_lines == [
        f"error: {out}: output folder holds files that are not part of a checkpoint: a.pdf, "
        "b.docx, c.xlsx and 1 more (rule usage; pass --replace-any to replace them too, or choose another -o)"
    ]


def test_force_replaces_a_checkpoint_folder_of_any_layout(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    files = [
        "model_index.json",
        "README.md",
        "LICENSE",
        "LICENSE.txt",
        ".gitattributes",
        "tokenizer.model",
        "spiece.model",
        "sentencepiece.bpe.model",
        "cl100k_base.tiktoken",
        "vocab.json",
        "merges.txt",
        "modeling_custom.py",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model.bin.index.json",
        "weights.pt",
        "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors",
        "scheduler/scheduler_config.json",
        "tokenizer/vocab.json",
        "tokenizer/merges.txt",
        "text_encoder/model.safetensors",
    ]
    for name in files:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(b"x")
    run = cli("reshard", model, "-o", out, "--force", "--json")
    assert run.code == 0, run.stderr
    assert len(run.json()["written"]["replaced"]) == 19
    assert names(out) == ["config.json", "model.safetensors"]


def test_replace_any_needs_force(model: Path, tmp_path: Path) -> None:
    run = cli("reshard", model, "-o", tmp_path / "out", "--replace-any")
    assert run.code == 2
    assert run.error_lines == [
        "error: --replace-any: only applies with --force (rule usage; add --force, or drop --replace-any)"
    ]


def _user_entries_named_like_staging(folder: Path) -> None:
    (folder / ".ckptfix-notes").mkdir()
    (folder / ".ckptfix-notes" / "todo.txt").write_text("todo")
    (folder / ".ckptfix-plan.txt").write_text("plan")


def test_in_place_keeps_user_entries_named_like_staging(model: Path) -> None:
    _user_entries_named_like_staging(model)
    (model / ".git").mkdir()
    (model / ".git" / "HEAD").write_text("ref")
    run = cli("reshard", model, "--in-place", "--max-shard", "1GB")
    assert run.code == 0, run.stderr
    assert names(model) == [
        ".ckptfix-notes",
        ".ckptfix-plan.txt",
        ".git",
        "config.json",
        "model.safetensors",
    ]
    assert (model / ".ckptfix-notes" / "todo.txt").read_text() == "todo"
    assert (model / ".git" / "HEAD").read_text() == "ref"


def test_output_copies_user_entries_named_like_staging(model: Path, tmp_path: Path) -> None:
    _user_entries_named_like_staging(model)
    out = tmp_path / "out"
    run = cli("reshard", model, "-o", out, "--json")
    assert run.code == 0, run.stderr
    assert run.json()["plan"]["copied_files"] == [
        ".ckptfix-notes",
        ".ckptfix-plan.txt",
        "config.json",
    ]
    assert (out / ".ckptfix-notes" / "todo.txt").read_text() == "todo"


def test_a_leftover_staging_folder_is_recognised_by_its_marker(model: Path, tmp_path: Path) -> None:
    """What a killed run leaves behind: never copied, not carried over by --in-place."""
    leftover = model / ".ckptfix-k1ll3d"
    leftover.mkdir()
    staging.write_marker(str(leftover))
    (leftover / "model.safetensors").write_bytes(b"half")
    assert staging.is_staging_folder(str(leftover))
    out = tmp_path / "out"
    run = cli("reshard", model, "-o", out, "--json")
    assert run.code == 0, run.stderr
    plan = run.json()["plan"]
    assert plan["left_out"] == [".ckptfix-k1ll3d"]
    assert plan["left_out_reasons"] == {".ckptfix-k1ll3d": "ckptfix staging folder"}
    assert names(out) == ["config.json", "model.safetensors"]
    run = cli("reshard", model, "--in-place", "--json")
    assert run.code == 0, run.stderr
    assert names(model) == ["config.json", "model.safetensors"]
    assert str(model / ".ckptfix-k1ll3d") in run.json()["written"]["replaced"]


# Symlinks and special files ---------------------------------------------------------------


def _no_file_holds(root: Path, data: bytes) -> bool:
    for folder, _, files in os.walk(root):  # never follows links
        for name in files:
            path = Path(folder) / name
            if not path.is_symlink() and path.read_bytes() == data:
                return False
    return True


def test_a_link_to_a_folder_is_recreated_not_followed(model: Path, tmp_path: Path) -> None:
    secret = tmp_path / "home" / ".ssh"
    secret.mkdir(parents=True)
    (secret / "id_rsa").write_bytes(b"PRIVATE KEY")
    os.symlink(secret, model / "ssh")
    (model / "sub").mkdir()
    (model / "sub" / "notes.txt").write_text("notes")
    os.symlink("../../home", model / "sub" / "home")
    out = tmp_path / "out"
    run = cli("reshard", model, "-o", out)
    assert run.code == 0, run.stderr
    assert os.readlink(out / "ssh") == str(secret)
    assert os.readlink(out / "sub" / "home") == "../../home"
    assert (out / "sub" / "notes.txt").read_text() == "notes"
    assert _no_file_holds(out, b"PRIVATE KEY")


def test_a_link_to_the_root_is_not_walked(model: Path, tmp_path: Path) -> None:
    os.symlink("/", model / "everything")
    (model / "sub").mkdir()
    os.symlink("/", model / "sub" / "everything")
    out = tmp_path / "out"
    run = cli("convert", model, "-o", out)
    assert run.code == 0, run.stderr
    assert os.readlink(out / "everything") == "/"
    assert os.readlink(out / "sub" / "everything") == "/"


def test_hub_cache_snapshot_links_are_copied_as_files(factory: Factory, tmp_path: Path) -> None:
    """A Hugging Face cache snapshot: every file a relative link into ../../blobs/."""
    built = factory.sharded("built", [[Spec("a")], [Spec("b")]])
    factory.config("built")
    factory.bytes("built/sub/special_tokens_map.json", b'{"bos": 1}')
    cache = tmp_path / "models--org--m"
    (cache / "blobs").mkdir(parents=True)
    snapshot = cache / "snapshots" / "abc123"
    (snapshot / "sub").mkdir(parents=True)
    for number, file in enumerate(sorted(p for p in built.rglob("*") if p.is_file())):
        relative = file.relative_to(built)
        blob = cache / "blobs" / f"blob{number}"
        file.rename(blob)
        depth = "../" * (len(relative.parts) + 1)
        os.symlink(f"{depth}blobs/{blob.name}", snapshot / relative)
    (snapshot / "real.txt").write_text("inside")
    os.symlink("real.txt", snapshot / "alias.txt")  # resolves inside: copied too
    os.symlink("../../blobs/missing", snapshot / "gone.json")  # dangling: stays a link
    out = tmp_path / "out"
    run = cli("reshard", snapshot, "-o", out, "--max-shard", "1GB")
    assert run.code == 0, run.stderr
    config = out / "config.json"
    assert config.is_file() and not config.is_symlink()
    assert json.loads(config.read_text()) == {"model_type": "llama"}
    nested = out / "sub" / "special_tokens_map.json"
    assert not nested.is_symlink() and nested.read_bytes() == b'{"bos": 1}'
    alias = out / "alias.txt"
    assert not alias.is_symlink() and alias.read_text() == "inside"
    assert os.readlink(out / "gone.json") == "../../blobs/missing"
    assert tensor_names(out) == ["a", "b"]


def _special_files(model: Path, monkeypatch: pytest.MonkeyPatch) -> socket.socket:
    os.mkfifo(model / "pipe")
    (model / "sub").mkdir()
    (model / "sub" / "ok.txt").write_text("ok")
    os.mkfifo(model / "sub" / "pipe2")
    monkeypatch.chdir(model)  # a socket path must be short
    listener = socket.socket(socket.AF_UNIX)
    listener.bind("sock")
    return listener


def test_special_files_are_left_out_and_listed(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listener = _special_files(model, monkeypatch)
    try:
        out = tmp_path / "out"
        run = cli("reshard", model, "-o", out, "--json")
        assert run.code == 0, run.stderr
        plan = run.json()["plan"]
        assert plan["left_out"] == ["pipe", "sock", "sub/pipe2"]
        assert set(plan["left_out_reasons"].values()) == {"not a regular file"}
        assert names(out) == ["config.json", "model.safetensors", "sub"]
        assert names(out / "sub") == ["ok.txt"]
        human = cli("convert", model, "-o", tmp_path / "human")
        assert human.code == 0, human.stderr
        assert "left out (not a regular file): pipe, sock, sub/pipe2" in flat(human.stdout)
    finally:
        listener.close()


def test_in_place_keeps_special_files(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    listener = _special_files(model, monkeypatch)
    try:
        run = cli("reshard", model, "--in-place")
        assert run.code == 0, run.stderr
        assert stat.S_ISFIFO(os.lstat(model / "pipe").st_mode)
        assert stat.S_ISFIFO(os.lstat(model / "sub" / "pipe2").st_mode)
        assert stat.S_ISSOCK(os.lstat(model / "sock").st_mode)
    finally:
        listener.close()


def test_output_through_a_symlink(model: Path, tmp_path: Path) -> None:
    real = tmp_path / "disk" / "real-out"
    real.mkdir(parents=True)
    (real / "model.safetensors").write_bytes(b"old")
    link = tmp_path / "out-link"
    link.symlink_to(real)
    run = cli("reshard", model, "-o", link, "--force")
    assert run.code == 0, run.stderr
    assert f"replaced: {link} (old contents: model.safetensors, moved aside and deleted)" in flat(
        run.stdout
    )
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert names(real) == ["config.json", "model.safetensors"]
    assert tensor_names(real) == ["a", "b"]
    assert not leftovers(tmp_path, tmp_path / "disk")


def test_in_place_through_a_symlink(factory: Factory, tmp_path: Path) -> None:
    folder = factory.sharded("disk/m", [[Spec("a")], [Spec("b")]])
    factory.config("disk/m")
    link = tmp_path / "m-link"
    link.symlink_to(folder)
    run = cli("reshard", link, "--in-place", "--max-shard", "1GB")
    assert run.code == 0, run.stderr
    assert link.is_symlink() and os.readlink(link) == str(folder)
    assert names(folder) == ["config.json", "model.safetensors"]
    assert tensor_names(folder) == ["a", "b"]
    assert not leftovers(tmp_path, tmp_path / "disk")


# Signals -----------------------------------------------------------------------------------

_SIGNAL_WHILE_RENDERING = """
import os, runpy, signal, sys
import ckptfix.cli.render as render
real = render.rewrite
def rewrite(result):
    os.kill(os.getpid(), signal.{name})
    real(result)
render.rewrite = rewrite
sys.argv = ["ckptfix", *sys.argv[1:]]
runpy.run_module("ckptfix", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_after_the_commit_is_not_an_interruption(
    model: Path, tmp_path: Path, name: str
) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _SIGNAL_WHILE_RENDERING.format(name=name),
            "reshard",
            str(model),
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert f"wrote {out}" in flat(done.stdout)
    assert tensor_names(out) == ["a", "b"]


def test_ctrl_c_after_the_commit_in_process(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.cli import render

    real = render.rewrite

    def rewrite(result: object) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        real(result)  # type: ignore[arg-type]

    monkeypatch.setattr(render, "rewrite", rewrite)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run = cli("reshard", model, "-o", tmp_path / "out")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)
    assert (run.code, run.error_lines) == (0, [])
    assert "wrote" in run.stdout


def _before_our_handler(code: int, stderr: str) -> bool:
    """A signal answered by Python itself, before ckptfix's handler was installed (the
    interpreter's start-up, site, runpy, and the imports that reach cli.entry.main, which
    installs it first thing): death by SIGINT with nothing printed, a fatal start-up error,
    or a KeyboardInterrupt (which ckptfix's handlers never raise) whose traceback has no
    ckptfix frame inside a function, only module-level import lines."""
    frames = re.findall(r'File "[^"]*[/\\]ckptfix[/\\][^"]*", line \d+, in (\S+)', stderr)
    if any(where != "<module>" for where in frames):
        return False
    return (
        (code == -signal.SIGINT and not stderr)
        or "Fatal Python error" in stderr
        or "Could not import runpy" in stderr
        or "KeyboardInterrupt" in stderr
    )


@pytest.mark.slow
def test_ctrl_c_during_start_up_is_quiet(factory: Factory) -> None:
    path = factory.safetensors("ok.safetensors")
    command = [sys.executable, "-m", "ckptfix", "inspect", str(path)]
    outcomes = []
    for delay in [0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.1, 0.13, 0.16, 0.2, 0.25, 0.3] * 3:
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
        if _before_our_handler(process.returncode, stderr):
            outcomes.append("python")
            continue
        assert "Traceback" not in stderr, (delay, stderr)
        assert (process.returncode, stderr) in (
            (0, ""),
            (130, "error: interrupted by SIGINT (rule interrupted)\n"),
        ), (delay, process.returncode, stderr)
        outcomes.append(str(process.returncode))
    assert outcomes.count("130") >= 10, outcomes  # most signals did land during start-up


@pytest.mark.slow
def test_signals_are_ignored_once_the_command_is_over(factory: Factory) -> None:
    """Python's shutdown restores the default handlers, so a signal that arrived then killed
    a finished run (death by SIGINT after a complete output, seen under stress)."""
    path = factory.safetensors("ok.safetensors")
    code = (
        "import signal, sys\n"
        "from ckptfix.cli.entry import main\n"
        f"sys.argv = ['ckptfix', 'inspect', {str(path)!r}]\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    ignored = [signal.getsignal(s) is signal.SIG_IGN for s in (signal.SIGINT, signal.SIGTERM)]\n"
        "    print(exc.code, ignored, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.stderr.splitlines() == ["0 [True, True]"]


def test_the_console_script_imports_only_its_own_modules_before_taking_signals() -> None:
    """Until cli.entry.main installs its handler, a Ctrl-C is answered by Python with a
    traceback: on the way there, ckptfix imported `__future__`, `importlib`, `warnings` and
    `gc` too (about 1 ms of the ~2 ms ckptfix's part of that window took, measured with
    strace; the rest of the window, ~16 ms here, is the interpreter's start-up, site and
    the console-script wrapper's own `import re`). Run without site, whose imports differ
    between installs, and with `os` imported as site imports it."""
    code = (
        "import sys, os; before = set(sys.modules); import ckptfix.cli.entry; "
        "print(sorted(set(sys.modules) - before))"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "['ckptfix', 'ckptfix.cli', 'ckptfix.cli.entry']"


@pytest.mark.slow
def test_importing_ckptfix_is_cheap_and_lazy() -> None:
    """`python -m ckptfix` runs the package __init__ before it can take charge of signals."""
    code = (
        "import sys, ckptfix; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('ckptfix', 'typer', 'rich', 'numpy'))); "
        "import ckptfix.ops.inspect, ckptfix.ops.rewrite; "
        "print(callable(ckptfix.inspect), ckptfix.reshard.__module__, ckptfix.core.sizes.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == [
        "['ckptfix']",
        "True ckptfix.ops.rewrite ckptfix.core.sizes",
    ]
    import ckptfix

    assert set(ckptfix.__all__) <= set(dir(ckptfix))
    for name in ckptfix.__all__:
        assert getattr(ckptfix, name) is not None
    with pytest.raises(AttributeError):
        ckptfix.no_such_thing  # noqa: B018


def test_a_signal_in_other_code_waits_for_a_safe_point() -> None:
    """Raised in threading's Condition.__enter__/__exit__, an exception from a signal leaves
    the lock taken (the write's worker thread and the join with it then wait forever); in
    importlib's end-of-import callback it is printed as "ignored" and lost. The handler
    raises only in ckptfix's own frames and keeps the signal otherwise."""
    import threading
    from types import SimpleNamespace

    from ckptfix.core.errors import Interrupted

    signals = core_signals.Signals()
    signals.writing = True
    foreign = [
        SimpleNamespace(f_code=threading.Condition.__enter__.__code__),
        SimpleNamespace(f_code=threading.Condition.__exit__.__code__),
        SimpleNamespace(f_code=SimpleNamespace(co_filename="<frozen importlib._bootstrap>")),
        sys._getframe(),  # a test is not ckptfix's code either
        None,
    ]
    for frame in foreign:
        signals.handle(signal.SIGINT, frame)  # type: ignore[arg-type]
    with pytest.raises(Interrupted):
        signals.raise_deferred()
    signals.raise_deferred()  # raised once
    ours = SimpleNamespace(f_code=staging.Staging.commit.__code__)
    with pytest.raises(Interrupted):
        signals.handle(signal.SIGTERM, ours)  # type: ignore[arg-type]


_SPIN = """
import time


def spin(condition, signals):
    deadline = time.monotonic() + 60  # a lost interrupt fails the test instead of hanging it
    while time.monotonic() < deadline:
        with condition:
            pass
        signals.raise_deferred()
    raise AssertionError("the interrupt never arrived")
"""


@pytest.mark.slow
def test_signals_never_leave_a_condition_taken() -> None:
    """The hang itself: the main thread takes and releases a Condition (as a thread pool's
    Futures do) while another thread interrupts it, 200 times; every time another thread
    must be able to take the Condition afterwards. The loop runs as ckptfix code (compiled
    under a ckptfix file name) with a safe point, like the write loop."""
    import _thread
    import threading

    from ckptfix.core.errors import Interrupted

    namespace: dict[str, Any] = {}
    exec(compile(_SPIN, staging.__file__, "exec"), namespace)
    signals = core_signals.Signals()
    signals.writing = True
    previous = signals.install()
    try:
        for _ in range(200):
            condition = threading.Condition()
            interrupter = threading.Thread(
                target=lambda: (time.sleep(0.001), _thread.interrupt_main(signal.SIGINT))
            )
            interrupter.start()
            with pytest.raises(Interrupted):
                namespace["spin"](condition, signals)
            interrupter.join()
            taken: list[bool] = []
            taker = threading.Thread(
                target=lambda lock=condition, out=taken: out.append(lock.acquire(timeout=1))
            )
            taker.start()
            taker.join()
            assert taken == [True], "a signal left the Condition's lock taken"
    finally:
        core_signals.restore(previous)


def test_a_failed_comparison_keeps_its_own_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception (a signal) during verification propagates as itself: nothing is mapped
    whose closing could raise BufferError in its place."""
    from ckptfix.io.source import LocalFile
    from ckptfix.write import copy

    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)) * 64)

    def interrupted(*args: object) -> bytes:
        raise KeyboardInterrupt

    monkeypatch.setattr(copy, "preadv_exact", interrupted)
    fd = os.open(path, os.O_RDONLY)
    try:
        with LocalFile(str(path)) as source, pytest.raises(KeyboardInterrupt):
            copy.source_equal(source, 0, fd, 0, 8192)
    finally:
        os.close(fd)


@pytest.mark.slow
def test_force_over_a_read_only_sub_folder_leaves_nothing_behind(
    model: Path, tmp_path: Path
) -> None:
    """As their owner: the new OUT was swapped in and "wrote" printed, then the old one,
    read-only folder and all, stayed beside it as a .ckptfix-* folder."""
    out = tmp_path / "out"
    (out / "docs").mkdir(parents=True)
    (out / "docs" / "README.md").write_text("old")
    (out / "docs").chmod(0o555)
    run = as_another_user("reshard", model, "-o", out, "--force")
    assert run.code == 0, run.stderr
    assert names(out) == ["config.json", "model.safetensors"]
    assert leftovers(tmp_path) == []


@pytest.mark.slow
def test_force_refuses_an_out_it_could_not_clear(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "docs").mkdir(parents=True)
    (out / "docs" / "README.md").write_text("theirs")
    give_away(out / "docs")
    before = tree_snapshot(out)
    run = as_another_user("reshard", model, "-o", out, "--force")
    assert run.code == 1, run.stderr
    assert run.error_lines == [
        f"error: {out / 'docs'}: folder is not writable and not ours to make writable, so its "
        "old entries could not be removed once the new folder is in place (rule "
        "write-failed; make it writable, or run as its owner)"
    ]
    assert tree_snapshot(out) == before and leftovers(tmp_path) == []


def test_a_replaced_out_that_cannot_be_removed_is_an_error(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new OUT is in place; the old one could not be removed (a mount point in it, say):
    that is said, never a plain success with the old contents left behind unnamed."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")

    def fail(path: str) -> None:
        raise OSError(16, "Device or resource busy", path)

    monkeypatch.setattr(staging, "remove_tree", fail)
    run = cli("reshard", model, "-o", out, "--force")
    assert run.code == 1
    [left] = leftovers(tmp_path)
    assert run.error_lines == [
        f"error: {left}: the new output is in place, but its old contents could not all be "
        "removed (Device or resource busy); they are left here (rule write-failed; delete "
        "this folder)"
    ]
    assert tensor_names(out) == ["a", "b"]


# Smaller ones -------------------------------------------------------------------------------


@pytest.mark.native  # refused up front by statvfs's ST_RDONLY (elsewhere: by the first write)
@pytest.mark.parametrize("command", COMMANDS)
def test_read_only_output_deeper_down(
    model: Path, mount: Callable[[str], Path], command: str
) -> None:
    read_only = mount("ro,size=1m")
    out = read_only / "deeper" / "out"
    run = cli(command, model, "-o", out)
    assert run.code == 1
    assert run.error_lines == [
        f"error: {out}: cannot write: Read-only file system (rule write-failed; check the folder's permissions)"
    ]
    assert list(read_only.iterdir()) == []


def test_missing_parents_are_created_and_removed_on_failure(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "a" / "b" / "out"
    assert cli("reshard", model, "-o", out).code == 0
    assert tensor_names(out) == ["a", "b"]

    def fail() -> None:
        raise OSError(5, "Input/output error")

    before_commit(monkeypatch, fail)
    run = cli("reshard", model, "-o", tmp_path / "c" / "d" / "out")
    assert run.code == 1
    assert not (tmp_path / "c").exists()


def test_output_below_a_file(model: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = blocker / "deeper" / "out"
    run = cli("reshard", model, "-o", out)
    assert run.code == 2
    assert run.error_lines == [
        f"error: {out}: {blocker} is not a folder (rule usage; choose another -o folder)"
    ]
    assert blocker.read_text() == "x"


def test_no_verify_does_not_claim_verification(model: Path, tmp_path: Path) -> None:
    run = cli("convert", model, "-o", tmp_path / "out", "--no-verify")
    assert run.code == 0, run.stderr
    assert "not verified (--no-verify)" in flat(run.stdout)
    assert "verified against its source" not in run.stdout
    run = cli("convert", model, "-o", tmp_path / "verified")
    assert "every tensor verified against its source" in flat(run.stdout)


def _tensors(count: int) -> list[TensorInfo]:
    return [
        TensorInfo(f"layer.{i}.weight", "F32", (1,), 4, "f", (4 * i, 4 * i + 4))
        for i in range(count)
    ]


def test_exclude_is_linear() -> None:
    tensors = _tensors(20_000)
    exclude = [t.name for t in tensors]
    start = time.perf_counter()
    selection = select(tensors, SelectOptions(exclude=tuple(exclude)))
    elapsed = time.perf_counter() - start
    assert selection.tensors == () and len(selection.excluded) == 20_000
    assert elapsed < 5, elapsed  # about 0.05 s; the quadratic version took minutes


def test_exclude_globs_match_like_fnmatch() -> None:
    import fnmatch

    tensors = _tensors(300)
    globs = ["layer.1*.weight", "layer.?.weight", "layer.2[05].weight", "layer.299.weight", "a[b"]
    expected = [t.name for t in tensors if any(fnmatch.fnmatchcase(t.name, g) for g in globs)]
    assert list(select(tensors, SelectOptions(exclude=tuple(globs))).excluded) == expected
