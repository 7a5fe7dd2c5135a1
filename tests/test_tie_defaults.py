"""ckptfix's table of untied-by-default model types agrees with the installed transformers."""

from __future__ import annotations

import warnings

import pytest

from ckptfix.checks.tie_defaults import UNTIED_BY_DEFAULT


@pytest.mark.slow  # instantiates every config class transformers knows
def test_untied_defaults_match_transformers() -> None:
    from transformers import CONFIG_MAPPING

    disagree = []
    for model_type in sorted(CONFIG_MAPPING.keys()):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                default = getattr(CONFIG_MAPPING[model_type](), "tie_word_embeddings", None)
        except Exception:  # a config class that needs arguments: nothing to compare
            continue
        if default is not None and (default is False) != (model_type in UNTIED_BY_DEFAULT):
            disagree.append(model_type)
    assert not disagree, disagree
