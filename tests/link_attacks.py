"""Hostile links in a model folder, from the reviews of `fix` and the rewrites (issue 21):
each builds a folder `m` beside a folder `outside` that holds a secret and a file of the
user's, with links from the model folder into it. tests/test_link_attacks.py runs every
write command on each and checks that nothing outside what the command may change was
changed, and that the secret never lands in a regular file of the output."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.builders import Factory, Spec

SECRET = b"sk-SECRET-0123456789"
ONE = "model-00001-of-00002.safetensors"
TWO = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class LinkAttack:
    id: str
    build: Callable[[Factory], Path]  # returns the model folder


def _outside(factory: Factory) -> Path:
    outside = factory.root / "outside"
    factory.bytes("outside/secret.json", b'{"api_key": "%s", "torch_dtype": "float32"}' % SECRET)
    factory.bytes("outside/mine.txt", b"the user's own file")
    return outside


def _sharded(factory: Factory, *, second_format: bool = True) -> Path:
    factory.safetensors(f"m/{ONE}", [Spec("a")])
    factory.safetensors(f"m/{TWO}", [Spec("b")], with_format=second_format)
    factory.index(f"m/{INDEX}", {"a": ONE, "b": TWO}, 48)
    factory.config("m")
    return factory.root / "m"


def _shards_behind_a_link(rewrite: bool) -> Callable[[Factory], Path]:
    """m/sub -> outside/real, where the index finds both shards."""

    def build(factory: Factory) -> Path:
        _outside(factory)
        factory.safetensors(f"outside/real/{ONE}", [Spec("a")])
        factory.safetensors(f"outside/real/{TWO}", [Spec("b")], with_format=not rewrite)
        factory.index(f"m/{INDEX}", {"a": f"sub/{ONE}", "b": f"sub/{TWO}"}, 48 if rewrite else 9)
        factory.config("m")
        os.symlink("../outside/real", factory.root / "m" / "sub")
        return factory.root / "m"

    return build


def _aside_link(relative: bool) -> Callable[[Factory], Path]:
    """m/ckptfix-aside -> outside, and a stale single-file export that fix takes out."""

    def build(factory: Factory) -> Path:
        outside = _outside(factory)
        model = _sharded(factory)
        factory.safetensors("m/model.safetensors", [Spec("a"), Spec("b", data=bytes(24))])
        os.symlink("../outside" if relative else outside, model / "ckptfix-aside")
        return model

    return build


def _linked_side_file(name: str) -> Callable[[Factory], Path]:
    """m/NAME -> outside/secret.json; the second shard lacks "format" (fix rewrites it)."""

    def build(factory: Factory) -> Path:
        outside = _outside(factory)
        model = _sharded(factory, second_format=False)
        if name == "config.json":
            (model / name).unlink()
        os.symlink(outside / "secret.json", model / name)
        return model

    return build


def _linked_folder(factory: Factory) -> Path:
    """m/docs -> outside and m/nested/up -> ../../outside (relative, one level down)."""
    _outside(factory)
    model = _sharded(factory, second_format=False)
    os.symlink("../outside", model / "docs")
    (model / "nested").mkdir()
    os.symlink("../../outside", model / "nested" / "up")
    return model


LINK_ATTACKS = [
    LinkAttack("shards-behind-a-linked-sub-folder", _shards_behind_a_link(rewrite=True)),
    LinkAttack("kept-shards-behind-a-linked-sub-folder", _shards_behind_a_link(rewrite=False)),
    LinkAttack("aside-folder-absolute-link", _aside_link(relative=False)),
    LinkAttack("aside-folder-relative-link", _aside_link(relative=True)),
    LinkAttack("config-linked-to-a-secret", _linked_side_file("config.json")),
    LinkAttack("tokenizer-linked-to-a-secret", _linked_side_file("tokenizer.json")),
    LinkAttack("folders-linked-outside", _linked_folder),
]
