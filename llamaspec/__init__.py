"""llamaspec: speculative decoding for llama.cpp, orchestrated in Python."""
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
    # what the command line (llamaspec.cli) checks and writes before and after a run
    "check_device_params": ("llamaspec.contexts", "check_device_params"),
    "parse_rpc_servers": ("llamaspec._llama.rpc", "parse_servers"),
    "write_atomic": ("llamaspec._io", "write_atomic"),
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
           "ProbsSpec", "RequestOptions", "RequestSpec", "SamplingParams", "SpecParams", "__version__", "check_device_params", "parse_rpc_servers", "write_atomic"]
