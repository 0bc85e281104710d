"""``llamaspec bench``: llamaspec side by side with native llama.cpp and llama-cpp-python, in one run.

``prompts`` (the shipped prompt set), ``modes`` (plain / drafter types / synthetic / prompt lookup),
``config`` (:class:`BenchConfig`), ``runners`` (one per engine), ``native`` (llama-server and
llama-speculative-simple), ``execute`` (the run, step by step: machine, costs, models, runners, the
interleaved schedule), ``stats`` (pure arithmetic: aggregation, speedup model, divergences), ``analysis``
(output checks, summaries), ``report`` (the report dictionary; markdown, JSON, PNG, rich table), ``load``
(``--load``) and ``server_mode`` / ``server_variants`` (``--server``). The command line lives in
``llamaspec/cli/bench.py``.
"""
from .config import BenchConfig
from .execute import run_benchmark
from .modes import Mode, parse_modes
from .prompts import Prompt, load_prompts

__all__ = ["BenchConfig", "Mode", "Prompt", "load_prompts", "parse_modes", "run_benchmark"]
