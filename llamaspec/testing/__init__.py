"""Test support: deterministic tiny random-weight GGUF models (see :mod:`llamaspec.testing.tiny_models`)."""
from __future__ import annotations

from .tiny_models import KINDS, make_all, write_model

__all__ = ["KINDS", "make_all", "write_model"]
