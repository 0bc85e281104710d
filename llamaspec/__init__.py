"""llamaspec: speculative decoding for llama.cpp, orchestrated in Python."""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import LlamaSpecError  # noqa: F401
