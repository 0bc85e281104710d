"""A numpy reference of llama.cpp's sampler chains, for the tests (numpy only, no llama.cpp).

The distribution the target's sampler chain samples from (:func:`probs_from_logits`) and the draft sampler's
(:func:`draft_probs`), both over the whole vocabulary, by token id. The library reads these distributions from
llama.cpp's own samplers (:meth:`llamaspec.sampler.TargetSampler.probs`); the tests check those, and the
verification rules, against this independent implementation.
"""
from __future__ import annotations

import numpy as np

__all__ = ["probs_from_logits", "draft_probs"]


def _softmax32(logits: np.ndarray) -> np.ndarray:
    """llama.cpp's float softmax: ``expf(l - max)``, sequential float sum, divide."""
    e = np.exp(logits - logits.max(), dtype=np.float32)
    s = np.cumsum(e, dtype=np.float32)[-1]
    return e / s


def probs_from_logits(
    logits: np.ndarray,
    temp: float,
    top_k: int = 40,
    top_p: float = 0.95,
    min_p: float = 0.05,
    *,
    mask: np.ndarray | None = None,
) -> np.ndarray:
    """The full-vocabulary distribution the target's sampler chain samples from:
    ``[grammar] -> top-k -> top-p -> min-p -> temperature -> dist`` (the engine's chain, in llama.cpp's
    common order). Returns a float64 vector over token ids, 0 for every token the chain removed.

    Semantics, as llama.cpp's samplers implement them (float32 arithmetic like the C code):

    - ``mask`` (grammar first): tokens outside it get logit -inf before anything else. This is the
      distribution of llama.cpp's grammar resample path.
    - top-k: ``k <= 0`` keeps everything; otherwise the ``min(k, n)`` largest logits.
    - top-p: ``p >= 1`` does nothing; otherwise softmax over the remaining candidates **at temperature 1**
      (temperature comes later in the chain), sorted descending, and the shortest prefix whose float
      cumulative sum reaches ``p`` (``cum >= p``) is kept, with ``min_keep = 1``; if rounding keeps the
      sum below ``p``, everything stays.
    - min-p: ``p <= 0`` does nothing; otherwise keeps tokens with ``logit >= max_logit + log(p)``, i.e.
      probability at least ``p`` times the most likely remaining token's, again at temperature 1. The top
      token always stays.
    - temperature: logits divided by ``temp``; ``temp <= 0`` keeps only the largest logit (point mass).
    - dist: softmax of what is left.

    Differences from llama.cpp, all at tie / rounding level: logit ties at a top-k or top-p cut are
    broken by lower token id (llama.cpp's partial sort leaves that order unspecified); the float sums run
    in sorted order, where llama.cpp sums an unsorted candidate array in id order, so a cumulative sum
    landing within one float ulp of ``top_p`` may cut one token differently. Penalties (repeat,
    frequency, presence) are not applied here: pass logits that already carry them.

    >>> logits = np.log(np.array([0.05, 0.5, 0.3, 0.1, 0.05]))
    >>> np.round(probs_from_logits(logits, 1.0, top_k=0, top_p=1.0, min_p=0.0), 3)
    array([0.05, 0.5 , 0.3 , 0.1 , 0.05])
    >>> np.round(probs_from_logits(logits, 1.0, top_k=2, top_p=1.0, min_p=0.0), 3)   # top-k 2
    array([0.   , 0.625, 0.375, 0.   , 0.   ])
    >>> np.round(probs_from_logits(logits, 1.0, top_k=0, top_p=0.75, min_p=0.0), 3)  # 0.5 + 0.3 >= 0.75
    array([0.   , 0.625, 0.375, 0.   , 0.   ])
    >>> np.round(probs_from_logits(logits, 1.0, top_k=0, top_p=1.0, min_p=0.2), 3)   # keep p >= 0.2 * 0.5
    array([0.   , 0.556, 0.333, 0.111, 0.   ])
    >>> probs_from_logits(logits, 0.0).tolist()                                       # greedy
    [0.0, 1.0, 0.0, 0.0, 0.0]
    """
    x = np.array(logits, dtype=np.float32).reshape(-1)
    n = x.size
    if n == 0:
        raise ValueError("probs_from_logits: empty logits")
    if mask is not None:
        m = np.asarray(mask, dtype=bool).reshape(-1)
        if m.shape != x.shape:
            raise ValueError(f"probs_from_logits: mask has {m.size} entries, logits have {n}")
        if not m.any():
            raise ValueError("probs_from_logits: the mask allows no token")
        x[~m] = -np.inf
    # candidates sorted by logit, descending; ties by lower id (stable sort of the negated logits)
    cand = np.argsort(-x, kind="stable")
    if mask is not None:
        cand = cand[x[cand] > -np.inf]  # the grammar's -inf rows would get probability 0 anyway
    if top_k > 0:
        cand = cand[: min(int(top_k), cand.size)]
    if top_p < 1.0:
        cum = np.cumsum(_softmax32(x[cand]), dtype=np.float32)
        hit = np.flatnonzero(cum >= np.float32(top_p))
        if hit.size:
            cand = cand[: int(hit[0]) + 1]
    if min_p > 0.0:
        min_logit = np.float32(x[cand[0]] + np.float32(np.log(np.float32(min_p))))
        keep = x[cand] >= min_logit
        keep[0] = True
        cand = cand[keep]
    out = np.zeros(n, dtype=np.float64)
    if temp <= 0.0:
        out[cand[0]] = 1.0
        return out
    scaled = x[cand] / np.float32(temp)
    e = np.exp(scaled - scaled.max(), dtype=np.float32).astype(np.float64)
    out[cand] = e / e.sum()
    return out


def draft_probs(logits: np.ndarray, temp: float, top_k: int) -> np.ndarray:
    """The draft sampler's distribution when it samples for rejection verification: top-k followed by
    temperature, then a draw (beyond-vendored §1; ``DraftSimple`` samples its drafts this way).
    ``temp <= 0`` gives the argmax as a point mass; ``top_k <= 0`` keeps every token.

    >>> logits = np.log(np.array([0.1, 0.6, 0.3]))
    >>> np.round(draft_probs(logits, 1.0, top_k=2), 3)
    array([0.   , 0.667, 0.333])
    >>> np.round(draft_probs(logits, 0.5, top_k=0), 3)   # temperature 0.5 squares and renormalises
    array([0.022, 0.783, 0.196])
    """
    return probs_from_logits(logits, temp, top_k=top_k, top_p=1.0, min_p=0.0)
