"""Token probabilities of emitted tokens ("logprobs"): what a request asks for and how each entry is computed.

A request asks with a :class:`ProbsSpec` (``Engine.submit(..., probs=ProbsSpec(n_probs=5))``): for every
token the engine emits for it, a :class:`TokenProb` with the token's log-probability and the ``n_probs``
most likely tokens of the same distribution. Two distributions (llama-server's two modes):

- default: the **target model's** distribution, the softmax of the raw logits of the verification row that
  produced the token (no bias, no penalty, no temperature). Speculative decoding reports what plain decoding
  would: the row of an accepted draft token predicts the same position as plain decoding's row.
- ``post_sampling``: the distribution the sampler chain draws from at that row (logit bias, penalties,
  grammar, top-k / top-p / min-p, temperature: :meth:`~llamaspec.sampler.TargetSampler.probs`), computed on
  a copy of the request's sampler taken before the round, advanced by each emitted token. Tokens the chain
  removed (probability 0) are not listed, so ``top`` may have fewer than ``n_probs`` entries.

Requests that did not ask cost nothing: the round only looks at :attr:`Slot.probs` (None).

:func:`legacy_logprobs` turns entries into OpenAI's legacy completions ``logprobs`` object, for both faces that
answer with it (``llamaspec.Llama`` and ``llamaspec serve``'s ``/v1/completions``).

>>> import numpy as np
>>> e = raw_entry(np.array([0.0, 2.0, 1.0], dtype=np.float32), 2, 2)
>>> e.id, [t for t, _ in e.top], round(e.logprob, 4), round(sum(p for _, p in e.top_probs), 4)
(2, [1, 2], -1.4076, 0.91)
>>> post_entry(np.array([4, 7]), np.array([0.25, 0.75]), 4, 5).top_probs
((7, 0.75), (4, 0.25))
"""
from __future__ import annotations

import codecs
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from . import _llama as llama
    from .sampler import TargetSampler

__all__ = ["ProbsSpec", "TokenProb", "check_probs", "raw_entry", "post_entry", "RoundProbs", "legacy_logprobs"]


@dataclass(frozen=True)
class ProbsSpec:
    """What a request asks for: ``n_probs`` alternatives per emitted token (0 = the emitted token's own
    probability only), of the model's distribution or, with ``post_sampling``, of the sampler chain's."""

    n_probs: int = 0
    post_sampling: bool = False


@dataclass(frozen=True)
class TokenProb:
    """One emitted token: its id, its log-probability and the ``top`` (id, log-probability) pairs, most
    likely first (ties: lower id first). ``post_sampling`` says which distribution they are of; a token the
    chain removed has ``logprob = -inf`` (probability 0)."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    post_sampling: bool = False

    @property
    def prob(self) -> float:
        return math.exp(self.logprob)

    @property
    def top_probs(self) -> tuple[tuple[int, float], ...]:
        return tuple((t, math.exp(lp)) for t, lp in self.top)


def check_probs(probs: "ProbsSpec | int | None", n_vocab: int) -> "ProbsSpec | None":
    """``probs`` as a :class:`ProbsSpec` (an int is ``n_probs``), checked against the vocabulary; None = off.

    >>> check_probs(3, 100)
    ProbsSpec(n_probs=3, post_sampling=False)
    >>> check_probs(-1, 100)
    Traceback (most recent call last):
    ...
    llamaspec.errors.UsageError: n_probs must be between 0 and the vocabulary size 100, got -1
    """
    if probs is None:
        return None
    if not isinstance(probs, ProbsSpec):
        if isinstance(probs, bool) or not isinstance(probs, int):
            raise UsageError(f"probs must be a ProbsSpec or an int (n_probs), got {probs!r}")
        probs = ProbsSpec(n_probs=probs)
    n = probs.n_probs
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= n_vocab:
        raise UsageError(f"n_probs must be between 0 and the vocabulary size {n_vocab}, got {n!r}")
    return probs


def _top(ids: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Indices of the ``n`` largest ``values``, largest first, ties by lower id."""
    n = min(n, values.shape[0])
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    part = np.argpartition(-values, n - 1)[:n] if n < values.shape[0] else np.arange(values.shape[0])
    order = np.lexsort((ids[part], -values[part]))
    return part[order]


def raw_entry(logits: np.ndarray, token: int, n_probs: int) -> TokenProb:
    """The model's distribution at one row: log-softmax of the raw ``logits`` (float64), ``token``'s value and
    the ``n_probs`` most likely tokens."""
    x = np.asarray(logits, dtype=np.float64)
    m = float(x.max())
    lse = m + math.log(float(np.exp(x - m).sum()))
    idx = _top(np.arange(x.shape[0]), x, n_probs) if n_probs else ()
    top = tuple((int(i), float(x[i]) - lse) for i in idx)
    return TokenProb(int(token), float(x[token]) - lse, top, False)


def _log(p: float) -> float:
    return math.log(p) if p > 0.0 else -math.inf


def post_entry(ids: np.ndarray, p: np.ndarray, token: int, n_probs: int) -> TokenProb:
    """The sampler chain's distribution at one row as sparse ``(ids, p)``: ``token``'s value and the
    ``n_probs`` most likely tokens with ``p > 0``."""
    ids = np.asarray(ids, dtype=np.int64)
    p = np.asarray(p, dtype=np.float64)
    keep = p > 0.0
    ids, p = ids[keep], p[keep]
    hit = np.nonzero(ids == token)[0]
    chosen = float(p[hit[0]]) if hit.size else 0.0
    idx = _top(ids, p, n_probs) if n_probs else ()
    top = tuple((int(ids[i]), _log(float(p[i]))) for i in idx)
    return TokenProb(int(token), _log(chosen), top, True)


def legacy_logprobs(tokens: Sequence[int], entries: "Sequence[TokenProb | None]", piece: Callable[[int], bytes], *,
                    start: int = 0, before: "bytes | None" = None, floor: "float | None" = None) -> dict:
    """OpenAI's legacy ``logprobs`` object of ``tokens`` (``entries[i]`` is ``tokens[i]``'s; None: listed
    without log-probabilities): ``tokens`` (each one's ``piece`` decoded, an incomplete UTF-8 sequence dropped),
    ``text_offset``, ``token_logprobs`` and ``top_logprobs`` (``{text: logprob}`` of the alternatives, then of
    the token itself).

    ``text_offset`` counts characters from ``start``, in one of two units: with ``before`` (the bytes of the
    tokens listed earlier) llama-cpp-python's, all the tokens' bytes decoded together (a character split over
    tokens counts once it is whole); without it ``llamaspec serve``'s, each token's own text added up.
    ``floor``: lower log-probabilities become it (the server's, as JSON has no -inf); None keeps -inf, as
    llama-cpp-python does.

    >>> pieces = {1: b"\\xe2\\x82", 2: b"\\xac", 3: b"!"}
    >>> e = [TokenProb(1, -0.5, ((1, -0.5), (3, -1.0))), TokenProb(2, -math.inf, ()), None]
    >>> lp = legacy_logprobs([1, 2, 3], e, pieces.get, before=b"")
    >>> lp["tokens"], lp["text_offset"], lp["token_logprobs"], lp["top_logprobs"]
    (['', '', '!'], [0, 0, 1], [-0.5, -inf, None], [{'': -0.5, '!': -1.0}, {'': -inf}, None])
    >>> lp = legacy_logprobs([1, 2, 3], e, pieces.get, floor=-1e30)
    >>> lp["text_offset"], lp["token_logprobs"]
    ([0, 0, 0], [-0.5, -1e+30, None])
    """
    texts = [piece(t).decode("utf-8", "ignore") for t in tokens]
    # llama-cpp-python's unit: what an incremental decoder gave so far is as long as the prefix decoded alone
    dec = codecs.getincrementaldecoder("utf-8")("ignore") if before is not None else None
    n, offsets = start + (len(dec.decode(before)) if dec else 0), []
    for t, s in zip(tokens, texts):
        offsets.append(n)
        n += len(dec.decode(piece(t))) if dec else len(s)

    def lp(x: float) -> float:
        return x if floor is None or x > floor else floor

    top = [None if e is None else {**{piece(t).decode("utf-8", "ignore"): lp(v) for t, v in e.top}, s: lp(e.logprob)}
           for s, e in zip(texts, entries)]
    return {"tokens": texts, "text_offset": offsets,
            "token_logprobs": [None if e is None else lp(e.logprob) for e in entries], "top_logprobs": top}


class RoundProbs:
    """The entries of one slot's emitted tokens in one round. Built before the round's sampling (with
    ``post_sampling`` it keeps a copy of the sampler as it is then); :meth:`entries` after it, while the
    rows' logits are still those of this decode."""

    def __init__(self, spec: ProbsSpec, sampler: "TargetSampler"):
        self.spec = spec
        self._sampler = sampler.clone() if spec.post_sampling else None

    def entries(self, ctx: "llama.Context", rows: Sequence[int], tokens: Sequence[int]) -> list[TokenProb]:
        """One entry per emitted token; ``tokens[i]`` was picked from batch row ``rows[i]``. Once only: the
        copy of the sampler is freed."""
        n = self.spec.n_probs
        if not self.spec.post_sampling:
            return [raw_entry(ctx.logits(rows[i]), t, n) for i, t in enumerate(tokens)]
        s, out = self._sampler, []
        try:
            for i, t in enumerate(tokens):
                ids, p = s.probs(ctx, rows[i])
                out.append(post_entry(ids, p, t, n))
                s.accept(t, True)
        finally:
            self.close()
        return out

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
