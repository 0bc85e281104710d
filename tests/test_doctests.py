"""Run the worked examples in the package's docstrings: every module of ``llamaspec`` whose source has a
``>>>`` example is found by walking the package (so a new example can never go unrun), as ``--doctest-modules``
would, without importing the modules that only load where their optional parts are installed."""
from __future__ import annotations

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import llamaspec

#: modules whose only examples cannot run here, with the reason
SKIP: dict[str, str] = {"llamaspec.engine": "its one example loads model files (marked +SKIP)"}


def _modules_with_examples() -> list[str]:
    root = Path(llamaspec.__file__).parent
    out = []
    for info in pkgutil.walk_packages([str(root)], prefix="llamaspec."):
        rel = info.name.split(".")[1:]
        path = root.joinpath(*rel, "__init__.py") if info.ispkg else root.joinpath(*rel[:-1], rel[-1] + ".py")
        if path.is_file() and ">>> " in path.read_text(encoding="utf-8") and info.name not in SKIP:
            out.append(info.name)
    return sorted(out)


MODULES = _modules_with_examples()


def test_the_walk_finds_the_examples():
    """The walk itself works: the modules known to carry examples are among those found."""
    for name in ("llamaspec.text", "llamaspec.policy", "llamaspec.server.pipeline", "llamaspec._llama.vocab"):
        assert name in MODULES
    assert len(MODULES) > 40


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.failed == 0
    assert res.attempted > 0, f"{name} has a '>>> ' that is no worked example: make it one or reword it"
