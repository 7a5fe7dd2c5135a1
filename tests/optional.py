"""The optional packages some tests need, and the mark that skips those tests, naming the
package, where it is missing (tests/test_optional_deps.py hides them all to prove it).

`needs` looks a package up without importing it: importing gcsfs or megatron.core costs a
second or more, and a test module marked with it is collected in every worker."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

# import name -> the distribution and the extra of pyproject.toml that installs it. The rest
# of the test extra (torch, safetensors, hypothesis, jsonschema, junitparser, pyyaml) is the
# suite's own ground: oracles every module uses, imported freely.
OPTIONAL = {
    "accelerate": "accelerate (the test extra)",
    "aiohttp": "aiohttp (the remote extra)",
    "botocore": "botocore (the remote extra)",
    "deepspeed": "deepspeed (the test extra)",
    "diffusers": "diffusers (the test extra)",
    "fsspec": "fsspec (the remote extra)",
    "gcsfs": "gcsfs (the remote extra)",
    "gguf": "gguf (the test and gguf extras)",
    "huggingface_hub": "huggingface_hub (the test and remote extras)",
    "lightning": "pytorch-lightning (the test extra)",
    "megatron.core": "megatron-core (the test extra)",
    "moto": "moto[server] (the test extra)",
    "peft": "peft (the test extra)",
    "psutil": "psutil (the test extra)",
    "ray": "ray (the ray extra)",
    "pytorch_lightning": "pytorch-lightning (the test extra)",
    "sentence_transformers": "sentence-transformers (the test extra)",
    "transformers": "transformers (the test extra)",
}


def installed(module: str) -> bool:
    """Whether `module` can be found, without importing it (a dotted name imports only its
    parent packages)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that is missing or not a package
        return False


def missing(*modules: str) -> list[str]:
    """Those of `modules` that are not installed."""
    unknown = set(modules) - set(OPTIONAL)
    assert not unknown, f"not an optional package of tests/optional.py: {sorted(unknown)}"
    return [module for module in modules if not installed(module)]


def reason(modules: list[str]) -> str:
    return "needs " + ", ".join(OPTIONAL[module] for module in modules) + ": not installed"


def needs(*modules: str) -> pytest.MarkDecorator:
    """A mark (on a test, a parametrized case or a module's `pytestmark`) that skips the
    test, naming the packages, when any of `modules` is not installed; evaluated before its
    fixtures are set up, so a fixture may import them."""
    absent = missing(*modules)
    return pytest.mark.skipif(bool(absent), reason=reason(absent))


def need(*modules: str) -> None:
    """Skip the running test (or fixture), naming the packages, unless `modules` are all
    installed: for a fixture shared by tests that do not all need them."""
    absent = missing(*modules)
    if absent:
        pytest.skip(reason(absent))


def need_tool(name: str, package: str) -> str:
    """The path of the command `name`, or skip naming the package that installs it."""
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"needs the {name} command ({package}): not installed")
    return found
