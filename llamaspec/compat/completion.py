"""``create_completion`` of the drop-in: llama-cpp-python's arguments turned into one
:meth:`Engine.submit <llamaspec.engine.Engine.submit>`, and the request's tokens turned back into its
OpenAI-shaped dictionaries (``text_completion`` objects; a stream is one chunk per piece of final text, then a
chunk with the ``finish_reason``).

What follows llama-cpp-python exactly: the prompt's tokens (a string is tokenized with special tokens parsed,
BOS / CLS and EOS / SEP added as its ``_create_completion`` does; a token list is taken as it is), the
``max_tokens`` rules (None or <= 0: up to the context), the seed chain (a request without ``seed`` draws the
next seed from the previous one with ``random.Random``), the temperature rules (0: greedy; < 0: the plain
distribution, no truncation), its samplers (``typical_p``, ``mirostat_mode`` 1 / 2 with ``mirostat_tau`` /
``mirostat_eta`` alone after the penalties and grammar; ``tfs_z`` and ``penalize_nl`` are accepted and unused,
as there), stop strings (the engine's: the text ends before the first one; a stream never shows a part of one),
``stopping_criteria`` (called with the token history before each new token, which it can veto, and once at the
end), ``logits_processor`` (on every row the target samples, drafted rows included, in order:
:class:`~llamaspec.sampler.TargetSampler`), ``echo`` (with ``logprobs``: the prompt's own, from
:mod:`.scoring`; the first token's are ``None``) and ``set_cache`` (a ``LlamaRAMCache`` / ``LlamaDiskCache``
is read before and written after each completion with ``load_state`` / ``save_state``).

``suffix``: with a model that has fill-in-the-middle tokens the prompt is llama.cpp's infill layout
(:func:`llamaspec.fim_layout.fim_body`: ``[FIM_PRE] prompt [FIM_SUF] suffix [FIM_MID]``, suffix first with
``spm_infill=True``; untruncated, BOS / EOS around it as for any prompt); without them the prompt is completed
as it is and ``suffix`` appended to the text, which is what llama-cpp-python's code means to do (its own FIM token ids are placeholders in 0.3.36).

Each response also carries llamaspec's report of the request under ``"llamaspec"`` (what was drafted and
accepted, timings), a key OpenAI-shaped consumers ignore.
"""
from __future__ import annotations

import random
import time
import uuid
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .. import _llama as llama
from .._llama import compat as lcp
from ..fim_layout import fim_body
from ..logprobs import ProbsSpec
from ..memory import common_prefix
from ..options import SamplerHooks
from ..slot import FinishReason
from .args import CompatError
from .scoring import CompletionLogprobs

__all__ = ["as_processor", "build_sampling", "sampler_hooks", "completion_chunks", "prompt_tokens", "sampling_params"]

REPORT_KEY = "llamaspec"


def fim_layout(llm: Any) -> "tuple[int, int, int] | None":
    """The model's (prefix, suffix, middle) FIM tokens, or None when it lacks one of them."""
    fim = lcp.fim_tokens(llm._model)
    return fim if min(fim) >= 0 else None


def prompt_tokens(llm: Any, prompt: "str | Sequence[int]", suffix: "str | None" = None) -> list[int]:
    """The tokens llama-cpp-python's ``_create_completion`` decodes for ``prompt`` (and ``suffix``: the
    module docstring)."""
    fim = fim_layout(llm) if suffix is not None else None
    if not isinstance(prompt, str) and fim is None:
        return [int(t) for t in prompt]
    vocab, sp = llm._vocab, llm._special
    if fim is not None:
        pre = (vocab.tokenize(prompt, add_special=False, parse_special=False) if prompt else []) \
            if isinstance(prompt, str) else [int(t) for t in prompt]
        suf = vocab.tokenize(suffix, add_special=False, parse_special=False) if suffix else []
        toks = fim_body(*fim, pre, suf, spm=llm.spm_infill)
    else:
        toks = vocab.tokenize(prompt, add_special=False, parse_special=True) if prompt else []
    if vocab.add_bos and vocab.bos != -1:  # llama.cpp's CLS token is its BOS
        toks = [vocab.bos] + toks
    if vocab.add_eos or sp["sep"] != -1:
        toks = toks + [sp["sep"] if sp["sep"] != -1 else vocab.eos]
    if not toks and vocab.bos != -1:  # an empty prompt: generation starts after BOS (as llama-cpp-python does)
        toks = [vocab.bos]
    return toks


def sampling_params(llm: Any, *, seed: "int | None", **kw: Any) -> llama.SamplingParams:
    """llama-cpp-python's sampler settings as :class:`~llamaspec._llama.SamplingParams`; advances the seed as
    ``_create_completion`` does (``seed`` given: it becomes the instance's seed). ``kw``: :func:`build_sampling`."""
    if seed is not None:
        llm.set_seed(seed)
    else:
        llm.set_seed(random.Random(llm._seed).randint(0, 2**32))
    return build_sampling(llm, **kw)


def build_sampling(llm: Any, *, temperature: float, top_p: float, top_k: int, min_p: float, repeat_penalty: float,
                   frequency_penalty: float, presence_penalty: float, grammar: Any = None,
                   logit_bias: "dict | None" = None, typical_p: float = 1.0, mirostat_mode: int = 0,
                   mirostat_tau: float = 5.0, mirostat_eta: float = 0.1) -> llama.SamplingParams:
    """The sampler ``Llama._init_sampler`` builds, seeded with the instance's current seed: penalties, grammar,
    then greedy (``temperature == 0``), the bare distribution (``< 0``), mirostat alone, or top-k, typical,
    top-p, min-p, temperature."""
    if mirostat_mode not in (0, 1, 2):
        raise CompatError(f"mirostat_mode must be 0, 1 or 2, got {mirostat_mode!r}")
    sp = llama.SamplingParams(temp=float(temperature), top_k=max(0, int(top_k)), top_p=min(1.0, max(0.0, top_p)),
                              min_p=min(1.0, max(0.0, min_p)), repeat_penalty=float(repeat_penalty),
                              repeat_last_n=llm.last_n_tokens_size, frequency_penalty=float(frequency_penalty),
                              presence_penalty=float(presence_penalty), seed=llm._seed & 0xFFFFFFFF)
    sp.min_keep = 1  # llama-cpp-python's min_keep for typical, top-p and min-p
    if temperature < 0:  # llama-cpp-python: penalties, grammar, then the distribution itself
        sp.temp, sp.top_k, sp.top_p, sp.min_p = 1.0, 0, 1.0, 0.0
    elif temperature > 0 and mirostat_mode:  # mirostat alone (llama.cpp's temperature(1) before it is neutral)
        sp.temp, sp.top_k, sp.top_p, sp.min_p = 1.0, 0, 1.0, 0.0
        sp.mirostat, sp.mirostat_tau, sp.mirostat_eta = int(mirostat_mode), float(mirostat_tau), float(mirostat_eta)
    elif temperature > 0:
        sp.typ_p = min(1.0, float(typical_p))
    if grammar is not None:
        sp.grammar, sp.grammar_root = lcp.grammar_text(grammar)
    if logit_bias:
        sp.logit_bias = tuple((int(k), float(v)) for k, v in logit_bias.items())
    return sp


def as_processor(logits_processor: Any) -> "Callable[[np.ndarray, np.ndarray], np.ndarray] | None":
    """A ``LogitsProcessorList``, a list of ``f(input_ids, scores) -> scores`` or one such function, as one
    function (None when there is none)."""
    if logits_processor is None:
        return None
    if callable(logits_processor) and not isinstance(logits_processor, (list, tuple)):
        return logits_processor
    procs = list(logits_processor)
    if not procs:
        return None
    for p in procs:
        if not callable(p):
            raise CompatError(f"logits_processor items must be callables f(input_ids, scores), got {p!r}")

    def run(input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        for p in procs:
            scores = p(input_ids, scores)
        return scores

    return run


def sampler_hooks(logits_processor: Any) -> SamplerHooks:
    """The target sampler's hooks for a llama-cpp-python request: its ``logits_processor``, and penalties over
    the generated tokens only (llama-cpp-python's sampler never sees the prompt)."""
    return SamplerHooks(logits_processor=as_processor(logits_processor), penalize_prompt=False)


def _stops(stop: "str | list[str] | None") -> list[str]:
    return [s for s in ([stop] if isinstance(stop, str) else list(stop or [])) if s]


def check_logprobs(llm: Any, logprobs: Any) -> "int | None":
    """``logprobs`` (None: off; N >= 0: the N most likely tokens with each token) checked: a clear
    :class:`CompatError` for what the engine cannot give."""
    if logprobs is None:
        return None
    if not isinstance(logprobs, (int, np.integer)):  # a bool counts as 0 / 1, as in llama-cpp-python
        raise CompatError(f"logprobs must be None or an integer >= 0 (the alternatives per token), got {logprobs!r}")
    n_vocab = llm._vocab.n_tokens
    if not 0 <= int(logprobs) <= n_vocab:
        raise CompatError(f"logprobs must be between 0 and the vocabulary size {n_vocab}, got {logprobs}")
    return int(logprobs)


def completion_chunks(llm: Any, prompt: "str | Sequence[int]", *, max_tokens: "int | None",
                      sampling: llama.SamplingParams, stop: "str | list[str] | None", stream: bool, echo: bool,
                      model: "str | None", stopping_criteria=None, logprobs: "int | None" = None,
                      suffix: "str | None" = None, logits_processor=None) -> Iterator[dict]:
    """The response of one completion: with ``stream`` each chunk, else the one ``text_completion``;
    ``logprobs`` (checked by :func:`check_logprobs`): llama-cpp-python's ``logprobs`` object with it."""
    vocab = llm._vocab
    llm._end_live()  # a suspended generate() gives the slot up
    tokens = prompt_tokens(llm, prompt, suffix)
    append = suffix if suffix is not None and fim_layout(llm) is None else None
    n_ctx = llm.n_ctx()
    if len(tokens) >= n_ctx:
        raise CompatError(f"Requested tokens ({len(tokens)}) exceed context window of {n_ctx}")
    if max_tokens is None or max_tokens <= 0:
        max_tokens = n_ctx - len(tokens)
    max_tokens = min(max_tokens, n_ctx - len(tokens))
    stops = _stops(stop)
    cid, created = f"cmpl-{uuid.uuid4()}", int(time.time())
    name = model if model is not None else llm.model_path
    cache = getattr(llm, "cache", None)
    if cache:
        _cache_lookup(llm, cache, tokens)

    lp = CompletionLogprobs(llm, prompt, echo) if logprobs is not None else None
    if lp is not None and echo:
        lp.add_prompt(tokens, logprobs)
    zeros = np.zeros(vocab.n_tokens, dtype=np.single) if stopping_criteria is not None else None

    def chunk(text: str, finish: "str | None", report: "dict | None" = None, probs: "dict | None" = None) -> dict:
        out = {"id": cid, "object": "text_completion", "created": created, "model": name,
               "choices": [{"text": text, "index": 0, "logprobs": probs, "finish_reason": finish}]}
        if report is not None:
            out[REPORT_KEY] = report
        return out

    req = llm._submit(tokens, max_tokens, sampling, logits_processor, stop=tuple(stops),
                      probs=ProbsSpec(logprobs) if logprobs is not None else None)
    completion: list[int] = []
    n_final = 0  # characters of text the listed tokens made final (the engine's stop strings applied)
    vetoed = False
    try:
        if stream and echo and isinstance(prompt, str) and prompt:
            yield chunk(prompt, None, probs=lp.take() if lp is not None else None)
        for ch in req.chunks():
            for k, tok in enumerate(ch.tokens):
                if stopping_criteria is not None and stopping_criteria(
                        np.asarray(tokens + completion, dtype=np.intc), zeros):
                    vetoed = True
                    break
                completion.append(tok)
                if lp is not None and ch.probs is not None:
                    lp.add(tok, ch.probs[k])
                piece = ch.texts[k]
                n_final += len(piece)
                if stream and piece:
                    yield chunk(piece, None, probs=lp.take() if lp is not None else None)
            if vetoed:
                break
    finally:
        if not req.done:
            req.cancel()
    result = req.result()
    if result.finish_reason is FinishReason.ERROR:
        raise RuntimeError(f"llamaspec: the completion failed: {result.error}")
    finish = "stop" if vetoed or result.finish_reason is FinishReason.STOP else "length"
    by_eog = not vetoed and req.stop_type == "eos"
    # llama-cpp-python's evaluated tokens: the last one sampled is decoded only when generation goes on
    llm._remember(tokens + (completion if by_eog or not completion else completion[:-1]))
    if stopping_criteria is not None and finish != "stop" and stopping_criteria(
            np.asarray(llm._input_ids, dtype=np.intc), zeros):
        finish = "stop"
    full = result.text
    if vetoed:  # the listed tokens' text, to a stop string that only the end's U+FFFD can complete
        full = b"".join(map(vocab.token_to_piece, completion)).decode("utf-8", "replace")
        full = full[:min((full.find(s) for s in stops if s in full), default=len(full))]
    tail = full[n_final:]  # what the end released (held back for a stop string that never came)
    report = llm._report(result.stats)
    llm._last_report = report
    llm._last_tokens = (list(tokens), list(completion))
    if stream:
        if tail:
            yield chunk(tail, None, probs=lp.take() if lp is not None else None)
        rest = lp.take() if lp is not None else None  # tokens that made no text of their own
        yield chunk("", finish, report, probs=rest if rest and rest["tokens"] else None)
        if cache:
            cache[tokens + completion] = llm.save_state()
        return
    if cache:
        cache[tokens + completion] = llm.save_state()
    body = full
    if echo:
        body = (prompt if isinstance(prompt, str) else vocab.detokenize(tokens)) + body
    if append is not None:
        body += append
    out = chunk(body, finish, report, probs=lp.all if lp is not None else None)
    out["usage"] = {"prompt_tokens": len(tokens), "completion_tokens": len(completion),
                    "total_tokens": len(tokens) + len(completion)}
    yield out


def _cache_lookup(llm: Any, cache: Any, tokens: list[int]) -> None:
    """llama-cpp-python's cache read: the cached state with the longest common prefix is loaded when it
    shares more with the prompt than what is evaluated now."""
    try:
        item = cache[tokens]
    except KeyError:
        return
    if common_prefix(item.input_ids.tolist(), tokens) > common_prefix(llm._input_ids.tolist(), tokens):
        llm.load_state(item)
        llm._remember(item.input_ids[: item.n_tokens].tolist())
