"""Shared pytest fixtures."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import pytest

# the repository's research benchmarks (benchmarks/, not in the wheel) import as `benchmarks`
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from llamaspec._llama.lcp import llama_without_extra_buffers
from llamaspec.testing.tiny_models import make_all


# llama-cpp-python's own Llama (the parity references) loads as llamaspec's loader does on a CPU that
# advertises AMX without supporting it: no extra weight buffers, so a quantized model does not SIGILL the run
llama_without_extra_buffers()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """All tiny random-weight GGUFs (``llamaspec.testing.tiny_models.KINDS``), written once per session:
    ``{kind: path}``."""
    return make_all(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_model(tiny_models: dict[str, Path]) -> Callable[[str], Path]:
    """``tiny_model("llama")`` -> path of that tiny GGUF (KeyError for an unknown kind)."""

    def get(kind: str) -> Path:
        return tiny_models[kind]

    return get


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Which test is being set up (its fixtures run next): helpers.real_model() refuses a test not marked
    ``real``, so ``-m "not real"`` never fetches a model."""
    import helpers

    helpers.CURRENT_TEST[0] = item


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    import helpers

    helpers.CURRENT_TEST[0] = None
