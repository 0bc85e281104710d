"""Run the worked examples in the docstrings of the pure modules."""
from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "llamaspec.text",
    "llamaspec.vocab",
    "llamaspec.params",
    "llamaspec.stats",
    "llamaspec.probe",
    "llamaspec._llama",
    "llamaspec._llama.grammar_limits",
    "llamaspec._llama.grammar_cost",
    "llamaspec.drafters.base",
    "llamaspec.drafters.draft_model",
    "llamaspec.drafters.ngram_lookup",
    "llamaspec.drafters.ngram_pool",
    "llamaspec.drafters.ngram_rates",
    "llamaspec.server.tenant",
    "llamaspec.server.pipeline",
    "llamaspec.server.tools",
    "llamaspec.server.pythonic",
    "llamaspec.auto",
    "llamaspec.adaptive",
    "llamaspec.bench.modes",
    "llamaspec.cli.generate",
    "llamaspec.memory",
    "llamaspec.slot_file",
]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.failed == 0
    assert res.attempted > 0, f"{name} has no worked examples left: drop it from the list or add one"
