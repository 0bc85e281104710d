"""A cheap estimate of plain decoding speed, for "how much faster was speculation?" after a run.

Plain (non-speculative) decoding costs one target decode of one token, and one sampling of its logits, per
generated token. After a speculative run, :func:`measure_plain_step` times a few such steps of the target on
a scratch context that holds the same prompt (its last ``n_prefix_max`` tokens) and continues with the
tokens that were generated, with the run's sampling settings, so the estimate sees the same model, threads,
sampler and KV size order as the run (well under a second on the models of ``models.toml``). The engine's
loop around each step (Python, a few hundred microseconds) is left out: the estimated plain speed is, if
anything, a little too fast, and the speedup a little too small.

The arithmetic is kept pure (:func:`plain_tokens_per_second`, :func:`speedup`) so it can be tested without
a model.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

from . import _llama as llama
from .referee import relative_mad

__all__ = ["PlainStepCost", "measure_plain_step", "plain_tokens_per_second", "speedup"]


@dataclass(frozen=True)
class PlainStepCost:
    """Median milliseconds of one plain decoding step (one token decoded, then sampled), over ``n_steps``."""

    ms_per_token: float
    n_steps: int
    n_prefix: int
    wall_s: float  # what measuring cost, context creation included
    #: median absolute deviation of the step times over their median (0 steady; a busy machine: 0.25 and more)
    spread: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return plain_tokens_per_second(self.ms_per_token)


def plain_tokens_per_second(ms_per_token: float) -> float:
    """Tokens per second of plain decoding at ``ms_per_token`` per step (0 when unknown).

    >>> plain_tokens_per_second(50.0)
    20.0
    >>> plain_tokens_per_second(0.0)
    0.0
    """
    return 1e3 / ms_per_token if ms_per_token > 0 else 0.0


def speedup(tokens_per_second: float, plain: float) -> float | None:
    """``tokens_per_second / plain``, or None when either is unknown (0).

    >>> speedup(30.0, 20.0)
    1.5
    >>> speedup(30.0, 0.0) is None
    True
    """
    if tokens_per_second <= 0 or plain <= 0:
        return None
    return tokens_per_second / plain


def measure_plain_step(
    model: llama.Model,
    prompt: Sequence[int],
    generated: Sequence[int] = (),
    *,
    n_prefix_max: int = 32,
    n_steps_max: int = 8,
    n_steps_min: int = 5,
    budget_s: float = 0.3,
    sampling: llama.SamplingParams | None = None,
    n_threads: int | None = None,
    n_threads_batch: int | None = None,
    flash_attn: bool | None = None,
    kv_f32: bool = False,
) -> PlainStepCost:
    """Time plain decoding steps of ``model``: decode the last ``n_prefix_max`` prompt tokens in one batch,
    one untimed step (warm-up), then single-token steps fed with ``generated`` (cycled; the prompt when
    nothing was generated) until ``n_steps_max`` steps or ``budget_s`` seconds, at least ``n_steps_min``.
    Each step is sampled with ``sampling`` (greedy when None) as plain decoding would; the picks are not
    used. Uses its own small context and sampler, so the caller's are not touched.
    """
    from .sampler import TargetSampler

    t_start = time.perf_counter()
    prefix = list(prompt[-n_prefix_max:]) if n_prefix_max > 0 else []
    if not prefix:
        prefix = list(generated[:1]) or [0]
    cont = list(generated) or list(prompt) or [0]
    n_ctx = len(prefix) + n_steps_max + 8
    if model.n_ctx_train > 0:
        n_ctx = min(n_ctx, model.n_ctx_train)
    n_ctx = max(16, n_ctx)
    n_steps_max = max(1, min(n_steps_max, n_ctx - len(prefix) - 2))
    times: list[float] = []
    sampler = TargetSampler(model.vocab, sampling or llama.SamplingParams(temp=0.0))
    with contextlib.closing(sampler), llama.Context(
        model, n_ctx=n_ctx, n_batch=max(len(prefix), 1), n_threads=n_threads, n_threads_batch=n_threads_batch,
        flash_attn=flash_attn, kv_f32=kv_f32,
    ) as ctx:
        ctx.decode_tokens(prefix, 0, 0)
        pos = len(prefix)
        for i in range(n_steps_max + 1):
            tok = cont[i % len(cont)]
            t0 = time.perf_counter()
            ctx.decode([llama.Row(tok, pos, 0, True)])
            sampler.sample(ctx, 0)
            dt = time.perf_counter() - t0
            pos += 1
            if i == 0:
                continue  # warm-up: the first decode of a context allocates and builds its graph
            times.append(dt * 1e3)
            if len(times) >= n_steps_min and time.perf_counter() - t_start > budget_s:
                break
    return PlainStepCost(statistics.median(times), len(times), len(prefix), time.perf_counter() - t_start,
                         relative_mad(times) or 0.0)
