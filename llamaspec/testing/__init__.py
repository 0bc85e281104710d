"""Deterministic tiny random-weight GGUF models (see :mod:`llamaspec.testing.tiny_models`): what
``llamaspec bench --quick`` runs on, and what the tests load. The rest of the test tooling (fault injection,
load runners, fuzzers, the tiny EAGLE-3 / DFlash / MTP fixtures) is in tests/support and does not ship."""
from __future__ import annotations

from typing import Any

__all__ = ["KINDS", "make_all", "write_model"]


def __getattr__(name: str) -> Any:
    # Lazy, so that ``python -m llamaspec.testing.tiny_models`` does not import the module twice.
    if name in __all__:
        from . import tiny_models

        return getattr(tiny_models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
