"""llamaspec: speculative decoding for llama.cpp, orchestrated in Python.

Section numbers (§N) in the docstrings name parts of llama.cpp's behaviour: docs/architecture.md, "llama.cpp by
section (§N)", says what each is and where it lives.
"""
from __future__ import annotations

import logging as _logging

__version__ = "0.1.0"

from .errors import LlamaSpecError  # noqa: F401,E402

# the library never prints: without a configured handler, its log (llama.cpp's included) goes nowhere
_logging.getLogger("llamaspec").addHandler(_logging.NullHandler())

_LAZY = {
    "Engine": ("llamaspec.engine", "Engine"),
    "GenerationResult": ("llamaspec.slot", "GenerationResult"),
    "SamplingParams": ("llamaspec._llama", "SamplingParams"),
    "SpecParams": ("llamaspec.params", "SpecParams"),
    "Model": ("llamaspec._llama", "Model"),
    "DEFAULT_SEED": ("llamaspec._llama", "DEFAULT_SEED"),
    # a request's options (Engine.submit(prompt, RequestOptions(...)))
    "RequestOptions": ("llamaspec.options", "RequestOptions"),
    "RequestSpec": ("llamaspec.params", "RequestSpec"),
    "ProbsSpec": ("llamaspec.logprobs", "ProbsSpec"),
    # llama-cpp-python compatibility (llamaspec.compat): its Llama over the engine, and a draft model for its hook
    "Llama": ("llamaspec.compat.llama", "Llama"),
    "DraftModel": ("llamaspec.compat.draft", "DraftModel"),
}


def __getattr__(name: str):
    """Heavy names (they load llama.cpp) are imported on first use."""
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'llamaspec' has no attribute {name!r}")


__all__ = ["DEFAULT_SEED", "DraftModel", "Engine", "GenerationResult", "Llama", "LlamaSpecError", "Model",
           "ProbsSpec", "RequestOptions", "RequestSpec", "SamplingParams", "SpecParams", "__version__"]
