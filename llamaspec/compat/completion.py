"""``create_completion`` of the drop-in: llama-cpp-python's arguments turned into one
:meth:`Engine.submit <llamaspec.engine.Engine.submit>`, and the request's tokens turned back into its
OpenAI-shaped dictionaries (``text_completion`` objects; a stream is one chunk per piece of final text, then a
chunk with the ``finish_reason``).

What follows llama-cpp-python exactly: the prompt's tokens (a string is tokenized with special tokens parsed,
BOS / CLS and EOS / SEP added as its ``_create_completion`` does; a token list is taken as it is), the
``max_tokens`` rules (None or <= 0: up to the context), the seed chain (a request without ``seed`` draws the
next seed from the previous one with ``random.Random``), the temperature rules (0: greedy; < 0: the plain
distribution, no truncation), stop strings (the text ends before the first one; a stream never shows a part
of one), ``stopping_criteria`` (called with the token history before each new token, which it can veto) and
``echo``. Each response also carries llamaspec's report of the request under ``"llamaspec"`` (what was drafted
and accepted, timings), a key OpenAI-shaped consumers ignore.
"""
from __future__ import annotations

import random
import time
import uuid
from typing import Any, Iterator, Sequence

import numpy as np

from .. import _llama as llama
from .._llama import compat as lcp
from ..logprobs import ProbsSpec
from ..slot import FinishReason
from ..text import TextStream
from .args import CompatError

__all__ = ["completion_chunks", "prompt_tokens", "sampling_params"]

REPORT_KEY = "llamaspec"


def prompt_tokens(llm: Any, prompt: "str | Sequence[int]") -> list[int]:
    """The tokens llama-cpp-python's ``_create_completion`` decodes for ``prompt`` (no suffix)."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    vocab, sp = llm._vocab, llm._special
    toks = vocab.tokenize(prompt, add_special=False, parse_special=True) if prompt else []
    if vocab.add_bos and vocab.bos != -1:  # llama.cpp's CLS token is its BOS
        toks = [vocab.bos] + toks
    if vocab.add_eos or sp["sep"] != -1:
        toks = toks + [sp["sep"] if sp["sep"] != -1 else vocab.eos]
    if not toks and vocab.bos != -1:  # an empty prompt: generation starts after BOS (as llama-cpp-python does)
        toks = [vocab.bos]
    return toks


def sampling_params(llm: Any, *, temperature: float, top_p: float, top_k: int, min_p: float,
                    repeat_penalty: float, frequency_penalty: float, presence_penalty: float, grammar: Any,
                    logit_bias: "dict | None", seed: "int | None") -> llama.SamplingParams:
    """llama-cpp-python's sampler settings as :class:`~llamaspec._llama.SamplingParams`; advances the seed as
    ``_create_completion`` does (``seed`` given: it becomes the instance's seed)."""
    if seed is not None:
        llm.set_seed(seed)
    else:
        llm.set_seed(random.Random(llm._seed).randint(0, 2**32))
    sp = llama.SamplingParams(temp=float(temperature), top_k=max(0, int(top_k)), top_p=min(1.0, max(0.0, top_p)),
                              min_p=min(1.0, max(0.0, min_p)), repeat_penalty=float(repeat_penalty),
                              repeat_last_n=llm.last_n_tokens_size, frequency_penalty=float(frequency_penalty),
                              presence_penalty=float(presence_penalty), seed=llm._seed & 0xFFFFFFFF)
    if temperature < 0:  # llama-cpp-python: penalties, grammar, then the distribution itself
        sp.temp, sp.top_k, sp.top_p, sp.min_p = 1.0, 0, 1.0, 0.0
    if grammar is not None:
        sp.grammar, sp.grammar_root = lcp.grammar_text(grammar)
    if logit_bias:
        sp.logit_bias = tuple((int(k), float(v)) for k, v in logit_bias.items())
    return sp


def _stops(stop: "str | list[str] | None") -> list[str]:
    return [s for s in ([stop] if isinstance(stop, str) else list(stop or [])) if s]


def check_logprobs(llm: Any, logprobs: Any, echo: bool) -> "int | None":
    """``logprobs`` (None: off; N >= 0: the N most likely tokens with each token) checked: a clear
    :class:`CompatError` for what the engine cannot give."""
    if logprobs is None:
        return None
    if not isinstance(logprobs, (int, np.integer)):  # a bool counts as 0 / 1, as in llama-cpp-python
        raise CompatError(f"logprobs must be None or an integer >= 0 (the alternatives per token), got {logprobs!r}")
    n_vocab = llm._vocab.n_tokens
    if not 0 <= int(logprobs) <= n_vocab:
        raise CompatError(f"logprobs must be between 0 and the vocabulary size {n_vocab}, got {logprobs}")
    if echo:
        raise CompatError("llamaspec.Llama does not return logprobs of the prompt: call with echo=False (or use "
                          "llama_cpp.Llama with logits_all=True)")
    return int(logprobs)


class _Logprobs:
    """llama-cpp-python's ``logprobs`` object of a completion (``tokens``, ``text_offset``, ``token_logprobs``,
    ``top_logprobs``), filled token by token; :meth:`take` hands out what was added since its last call."""

    def __init__(self, llm: Any, prompt: "str | Sequence[int]"):
        self.llm = llm
        self.base = len(prompt)  # llama-cpp-python: offsets count from the prompt's length
        self._done = b""  # the completion's bytes so far
        self.all = self._empty()
        self._new = self._empty()

    @staticmethod
    def _empty() -> dict:
        return {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}

    def _text(self, token: int) -> str:
        return self.llm.detokenize([token]).decode("utf-8", errors="ignore")

    def add(self, token: int, tp) -> None:
        if token == self.llm._vocab.bos:  # llama-cpp-python leaves BOS out
            return
        s = self._text(token)
        top = {self._text(t): lp for t, lp in tp.top}
        top[s] = tp.logprob
        offset = self.base + len(self._done.decode("utf-8", errors="ignore"))
        self._done += self.llm.detokenize([token])
        for d in (self.all, self._new):
            d["tokens"].append(s)
            d["text_offset"].append(offset)
            d["token_logprobs"].append(tp.logprob)
            d["top_logprobs"].append(dict(top))

    def take(self) -> dict:
        out, self._new = self._new, self._empty()
        return out


def completion_chunks(llm: Any, prompt: "str | Sequence[int]", *, max_tokens: "int | None",
                      sampling: llama.SamplingParams, stop: "str | list[str] | None", stream: bool, echo: bool,
                      model: "str | None", stopping_criteria=None, logprobs: "int | None" = None) -> Iterator[dict]:
    """The response of one completion: with ``stream`` each chunk, else the one ``text_completion``;
    ``logprobs`` (checked by :func:`check_logprobs`): llama-cpp-python's ``logprobs`` object with it."""
    engine, vocab = llm._require_engine(), llm._vocab
    tokens = prompt_tokens(llm, prompt)
    n_ctx = llm.n_ctx()
    if len(tokens) >= n_ctx:
        raise CompatError(f"Requested tokens ({len(tokens)}) exceed context window of {n_ctx}")
    if max_tokens is None or max_tokens <= 0:
        max_tokens = n_ctx - len(tokens)
    max_tokens = min(max_tokens, n_ctx - len(tokens))
    stops = _stops(stop)
    cid, created = f"cmpl-{uuid.uuid4()}", int(time.time())
    name = model if model is not None else llm.model_path

    lp = _Logprobs(llm, prompt) if logprobs is not None else None

    def chunk(text: str, finish: "str | None", report: "dict | None" = None, probs: "dict | None" = None) -> dict:
        out = {"id": cid, "object": "text_completion", "created": created, "model": name,
               "choices": [{"text": text, "index": 0, "logprobs": probs, "finish_reason": finish}]}
        if report is not None:
            out[REPORT_KEY] = report
        return out

    req = engine.submit(tokens, n_predict=max_tokens, sampling=sampling, stop=stops,
                        cache_prompt=llm._take_cache_permission(),
                        probs=ProbsSpec(logprobs) if logprobs is not None else None)
    text = TextStream(stops)
    completion: list[int] = []
    finish = "length"
    try:
        if stream and echo and isinstance(prompt, str) and prompt:
            yield chunk(prompt, None)
        done = False
        for ch in req.chunks():
            for k, tok in enumerate(ch.tokens):
                if stopping_criteria is not None and stopping_criteria(
                        np.asarray(tokens + completion, dtype=np.intc), np.zeros(0, dtype=np.single)):
                    finish, done = "stop", True
                    break
                completion.append(tok)
                if lp is not None and ch.probs is not None:
                    lp.add(tok, ch.probs[k])
                piece = text.feed(vocab.token_to_piece(tok))
                if stream and piece:
                    yield chunk(piece, None, probs=lp.take() if lp is not None else None)
                if text.stopped:
                    finish, done = "stop", True
                    break
            if done:
                break
    finally:
        if not req.done:
            req.cancel()
    result = req.result()
    if result.finish_reason is FinishReason.ERROR:
        raise RuntimeError(f"llamaspec: the completion failed: {result.error}")
    if not done and result.finish_reason is FinishReason.STOP:
        finish = "stop"
    tail = text.flush()
    report = llm._report(result.stats)
    llm._last_report = report
    llm._last_tokens = (list(tokens), list(completion))
    if stream:
        if tail:
            yield chunk(tail, None, probs=lp.take() if lp is not None else None)
        rest = lp.take() if lp is not None else None  # tokens that made no text of their own
        yield chunk("", finish, report, probs=rest if rest and rest["tokens"] else None)
        return
    body = text.text
    if echo:
        body = (prompt if isinstance(prompt, str) else vocab.detokenize(tokens)) + body
    out = chunk(body, finish, report, probs=lp.all if lp is not None else None)
    out["usage"] = {"prompt_tokens": len(tokens), "completion_tokens": len(completion),
                    "total_tokens": len(tokens) + len(completion)}
    yield out
