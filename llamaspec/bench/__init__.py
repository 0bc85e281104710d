"""``llamaspec bench``: llamaspec side by side with native llama.cpp and llama-cpp-python, in one run.

``prompts`` (the shipped prompt set), ``modes`` (plain / drafter types / synthetic / prompt lookup),
``runners`` (one per engine), ``native`` (llama-server and llama-speculative-simple), ``stats`` (pure
arithmetic: aggregation, speedup model, divergences), ``report`` (markdown, JSON, PNG, rich table) and
``core`` (the interleaved run). The command line lives in ``cli/bench.py``.
"""
from .core import BenchConfig, run_benchmark
from .modes import Mode, parse_modes
from .prompts import Prompt, load_prompts

__all__ = ["BenchConfig", "Mode", "Prompt", "load_prompts", "parse_modes", "run_benchmark"]
