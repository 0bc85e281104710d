"""Shared pytest fixtures."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from llamaspec._llama.cpu_features import use_extra_buffers
from llamaspec.testing.tiny_models import make_all


def _llama_cpp_without_extra_buffers() -> None:
    """Tests that load models with llama-cpp-python's own ``Llama`` (the parity references) get what
    llamaspec's loader does on a CPU that advertises AMX without supporting it (llamaspec._llama.cpu_features):
    no extra weight buffers, so a quantized model does not kill the test process with SIGILL."""
    if use_extra_buffers():
        return
    import llama_cpp

    native = llama_cpp.llama_cpp
    default = native.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    native.llama_model_default_params = params


_llama_cpp_without_extra_buffers()


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
