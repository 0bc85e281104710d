"""Response shapes: llama-server's ``timings`` (plus llamaspec's acceptance report), OpenAI ``usage``, chunks.

``timings`` carries llama-server's fields (``cache_n``, ``prompt_n``, ``prompt_ms``, ``prompt_per_token_ms``,
``prompt_per_second``, ``predicted_n``, ``predicted_ms``, ``predicted_per_token_ms``,
``predicted_per_second``, and ``draft_n`` / ``draft_n_accepted`` when the server speculates) and, when
anything was drafted, what llama-server lacks: ``draft_n_verif_steps`` (verification steps),
``draft_acceptance_rate``, ``draft_mean_accepted_length`` (``1 + accepted / steps``, llama.cpp's "mean
len") and ``draft_n_accepted_per_pos`` (accepted drafts at each draft position, a histogram).
"""
from __future__ import annotations

import time
import uuid

from ..slot import FinishReason, GenerationStats, PromptProgress

__all__ = ["timings", "usage", "finish_reason", "new_id", "now", "progress_fields"]


def now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _n_cached(s: GenerationStats) -> int:
    return int(getattr(s, "n_cached", 0) or 0)


def n_predicted(s: GenerationStats) -> int:
    """The tokens generated as llama-server counts them: the output, and the end-of-generation token it ended
    on (sampled, not output)."""
    return s.n_predicted + s.n_eog


def timings(s: GenerationStats, speculative: bool = False) -> dict:
    """llama-server's ``timings`` object for one request, plus the acceptance report. ``draft_n`` /
    ``draft_n_accepted`` are there whenever the server speculates (``speculative``), zeros included, as in
    llama-server; the generation rate counts the decode steps after the first token, which comes from the
    prompt's last batch (llama-server: ``predicted_n - 1`` steps)."""
    cache_n = _n_cached(s)
    prompt_n = max(0, s.n_prompt - cache_n)
    prompt_ms = s.t_prompt_s * 1e3
    predicted_n = n_predicted(s)
    predicted_ms = s.t_decode_s * 1e3
    out = {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / (predicted_n - 1) if predicted_n > 1 else 0.0,
        "predicted_per_second": 1e3 * (predicted_n - 1) / predicted_ms if predicted_n > 1 and predicted_ms > 0 else 0.0,
    }
    if speculative or s.n_drafted > 0:
        out.update({"draft_n": s.n_drafted, "draft_n_accepted": s.n_accepted})
    if s.n_drafted > 0:
        out.update({
            # beyond llama-server
            "draft_n_verif_steps": s.n_verif_steps,
            "draft_acceptance_rate": s.acceptance_rate,
            "draft_mean_accepted_length": s.mean_accepted_length,
            "draft_n_accepted_per_pos": list(s.n_accepted_per_pos),
        })
        # the drafter type behind the accepted tokens (beyond llama-server)
        out["draft_n_accepted_by_type"] = dict(s.n_accepted_by_type)
    return out


def merged(stats: list[GenerationStats]) -> GenerationStats:
    if len(stats) == 1:
        return stats[0]
    total = GenerationStats()
    for s in stats:
        total.merge(s)
    return total


def usage(stats: list[GenerationStats]) -> dict:
    """OpenAI ``usage`` over the choices of one response (+ ``prompt_tokens_details.cached_tokens``)."""
    prompt = sum(s.n_prompt for s in stats)
    completion = sum(n_predicted(s) for s in stats)
    return {
        "completion_tokens": completion,
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(_n_cached(s) for s in stats)},
    }


def progress_fields(p: "PromptProgress", *, with_timings: bool, speculative: bool = False) -> dict:
    """What a prompt-progress event adds to a route's stream chunk: llama-server's ``prompt_progress``
    (``total``, ``cache``, ``processed``, ``time_ms``) and, with ``timings_per_token``, the prompt's
    ``timings`` so far (nothing generated yet).

    >>> from llamaspec.slot import PromptProgress
    >>> progress_fields(PromptProgress(40, 8, 8, 0.0), with_timings=False)
    {'prompt_progress': {'total': 40, 'cache': 8, 'processed': 8, 'time_ms': 0}}
    """
    out: dict = {"prompt_progress": {"total": p.total, "cache": p.cache, "processed": p.processed,
                                     "time_ms": int(p.time_ms)}}
    if with_timings:
        st = GenerationStats(n_prompt=p.processed, n_cached=p.cache, t_prompt_s=p.time_ms / 1e3)
        out["timings"] = timings(st, speculative=speculative)
    return out


def finish_reason(reason: FinishReason | None) -> str:
    """OpenAI's ``finish_reason``: ``stop`` or ``length``."""
    return "length" if reason is FinishReason.LENGTH else "stop"
