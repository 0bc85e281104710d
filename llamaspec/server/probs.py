"""Token probabilities in ``llamaspec serve``: the request fields and the response shapes.

Fields (llama-server's rules, with clear 400s where llama-server has none):

- ``n_probs`` (``/completion``; any route): that many alternatives per token, 0 = off (llama-server's
  default); at most :data:`N_PROBS_MAX`. ``post_sampling_probs: true``: probabilities after the sampler
  chain (``prob`` / ``top_probs``) instead of the model's log-probabilities (``logprob`` / ``top_logprobs``).
- ``logprobs`` as a number (OpenAI ``/v1/completions``; llama-server's alias of ``n_probs``, which wins when
  both are given): that many alternatives, 0 = the chosen token's log-probability only.
- ``logprobs: true`` with ``top_logprobs`` (OpenAI chat): ``top_logprobs`` alternatives (0..20; llama-server's
  default 20 when it is absent); ``top_logprobs`` without ``logprobs: true`` is refused, as llama-server does.

Shapes: each token is llama-server's ``{"id", "token", "bytes", "logprob", "top_logprobs": [{"id", "token",
"bytes", "logprob"}]}`` (``prob`` / ``top_probs`` with ``post_sampling_probs``): ``/completion``'s
``completion_probabilities``, the chat ``logprobs.content`` (OpenAI's own fields plus ``id``) and the
``/v1/completions`` ``logprobs.content`` (llama-server's); ``/v1/completions`` also gets OpenAI's legacy
fields ``tokens``, ``token_logprobs``, ``top_logprobs`` (``{token: logprob}``) and ``text_offset`` (character
offsets in the generated text). Streams carry, in each event, the entries of the tokens whose text it
carries: a chunk of several tokens (speculative decoding) is sent as one event per token that made text
final.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ..logprobs import ProbsSpec, TokenProb, legacy_logprobs
from .errors import invalid

if TYPE_CHECKING:  # pragma: no cover
    from .. import _llama as llama
    from ..slot import Chunk

__all__ = ["N_PROBS_MAX", "TOP_LOGPROBS_MAX", "parse_probs", "ProbsRender"]

#: the most alternatives per token ``n_probs`` / ``logprobs`` may ask for (llama-server has no bound)
N_PROBS_MAX = 100
#: OpenAI's bound of ``top_logprobs``
TOP_LOGPROBS_MAX = 20
#: llama-server's ``top_logprobs`` when a chat request sends ``logprobs: true`` alone
TOP_LOGPROBS_DEFAULT = 20
#: what JSON gets for log(0) (llama-server: the lowest float, since JSON has no -inf)
LOG_ZERO = -3.4028234663852886e38


def parse_probs(b: Any) -> ProbsSpec | None:
    """The token probabilities a request body (a ``parsing.Body``) asks for; None = none."""
    post = b.bool("post_sampling_probs", False)
    has_top = b.has("top_logprobs")
    if b.has("n_probs"):
        n = b.int("n_probs", 0, lo=0, hi=N_PROBS_MAX)
        return ProbsSpec(n, post) if n > 0 else None
    lp = b.data.get("logprobs")
    if isinstance(lp, bool) or lp is None:
        if not lp:
            if has_top:
                raise invalid("Field 'top_logprobs': top_logprobs requires logprobs to be set to true")
            return None
        return ProbsSpec(b.int("top_logprobs", TOP_LOGPROBS_DEFAULT, lo=0, hi=TOP_LOGPROBS_MAX), post)
    if has_top:
        raise invalid("Field 'top_logprobs': give it with \"logprobs\": true (chat), or use \"logprobs\": N alone")
    return ProbsSpec(b.int("logprobs", 0, lo=0, hi=N_PROBS_MAX), post)


def _json_log(x: float) -> float:
    return x if x > LOG_ZERO else LOG_ZERO


class ProbsRender:
    """Turns :class:`~llamaspec.logprobs.TokenProb` entries into JSON for one response, and splits stream
    chunks into per-token events (keeping, per choice, the entries of tokens that made no text yet)."""

    def __init__(self, vocab: "llama.Vocab", post_sampling: bool):
        self.vocab = vocab
        self.post = post_sampling
        self._pieces: dict[int, bytes] = {}
        self._pending: dict[int, list[TokenProb]] = {}
        self._offset: dict[int, int] = {}

    # -- one token ---------------------------------------------------------------------------------
    def piece(self, token: int) -> bytes:
        p = self._pieces.get(token)
        if p is None:
            p = self._pieces[token] = self.vocab.token_to_piece(token)
        return p

    def text(self, token: int) -> str:
        """The token's text (an incomplete UTF-8 sequence dropped, as llama-server's ``validate_utf8``)."""
        return self.piece(token).decode("utf-8", "ignore")

    def _one(self, token: int, logprob: float) -> dict:
        key, value = ("prob", math.exp(logprob)) if self.post else ("logprob", _json_log(logprob))
        return {"id": token, "token": self.text(token), "bytes": list(self.piece(token)), key: value}

    def entry(self, tp: TokenProb) -> dict:
        """llama-server's entry of one token (``completion_probabilities`` / ``logprobs.content``)."""
        d = self._one(tp.id, tp.logprob)
        d["top_probs" if self.post else "top_logprobs"] = [self._one(t, lp) for t, lp in tp.top]
        return d

    def content(self, entries: list[TokenProb]) -> list[dict]:
        return [self.entry(tp) for tp in entries]

    # -- OpenAI /v1/completions --------------------------------------------------------------------
    def completion_logprobs(self, entries: list[TokenProb], i: int = 0) -> dict:
        """``/v1/completions``' ``logprobs``: llama-server's ``content`` and OpenAI's legacy fields
        (:func:`~llamaspec.logprobs.legacy_logprobs`, each token's text added up); the text offsets of choice
        ``i`` go on from its previous call (a stream)."""
        off = self._offset.get(i, 0)
        legacy = legacy_logprobs([tp.id for tp in entries], entries, self.piece, start=off, floor=LOG_ZERO)
        self._offset[i] = off + sum(map(len, legacy["tokens"]))
        return {"content": self.content(entries), **legacy}

    # -- streams ------------------------------------------------------------------------------------
    def events(self, i: int, ch: "Chunk") -> list[tuple[str, list[TokenProb], list[int]]]:
        """``(text, entries, tokens)`` per event of one chunk of choice ``i``: one for each token that made
        text final, with the entries of the tokens before it that made none; at the end of the request the
        rest goes with the last event, and the end-of-generation token it ended on has one of its own, text-less
        (llama-server's)."""
        if ch.probs is None or ch.texts is None:  # a chunk without probabilities (a failure, n_predict = 0)
            pend = self._pending.pop(i, []) if ch.finished else []
            return [(ch.text, pend, [tp.id for tp in pend])] if ch.text or pend else []
        pend = self._pending.get(i, [])
        out: list[tuple[str, list[TokenProb]]] = []
        texts = list(ch.texts)
        extra = ch.text[sum(len(t) for t in texts):]  # text no token of this chunk made final (a flush)
        if extra and texts:  # it goes with the token that ended the request
            texts[-1], extra = texts[-1] + extra, ""
        for tp, t in zip(ch.probs, texts):
            pend.append(tp)
            if t:
                out.append((t, pend))
                pend = []
        if extra or (ch.finished and pend):
            if out:
                t, e = out[-1]
                out[-1] = (t + extra, e + pend)
            else:
                out.append((extra, pend))
            pend = []
        self._pending[i] = pend
        if ch.eog is not None:
            out.append(("", ch.probs[len(ch.texts):]))
        return [(t, e, [tp.id for tp in e]) for t, e in out]
