"""llamaspec: speculative decoding for llama.cpp, orchestrated in Python."""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import LlamaSpecError  # noqa: F401

import logging as _logging

# the library never prints: without a configured handler, its log (llama.cpp's included) goes nowhere
_logging.getLogger("llamaspec").addHandler(_logging.NullHandler())
