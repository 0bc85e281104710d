"""Renderers of ``llamaspec serve``: a request's chunks and result in the shape of each route (OpenAI
completions, OpenAI chat, llama.cpp's native ``/completion``), stream and non-stream."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .. import __version__
from .. import _llama as llama
from . import formats
from .respond import Renderer
from .parsing import SAMPLER_FIELDS, Defaults, GenParams
from .probs import ProbsRender
from .tools import ToolStream, parse_output
from .chat_format import FenceStream

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine
    from ..request import Request
    from .chat_format import ChatFormat
    from .tools import ToolSpec

SYSTEM_FINGERPRINT = f"llamaspec-{__version__}"


def _slot_id(req: "Request") -> int:
    return req.slot.id if req.slot is not None else -1


def _events(pr: ProbsRender | None, ch) -> list[tuple[str, list | None, list[int]]]:
    """``(text, entries, tokens)`` per stream event of one chunk, one per sampled token as llama-server sends
    them: the text the token made final ("" while it may begin a stop string, and for the stop word), then the
    end-of-generation token's; what the end released goes with the last. ``entries``: the token's
    probabilities (None: none asked). A chunk without tokens (a failed request) is one event."""
    if ch.texts is None or not (ch.tokens or ch.eog is not None):
        return [(ch.text, None, list(ch.tokens))] if ch.text or ch.tokens else []
    tokens, texts = list(ch.tokens), list(ch.texts)
    if ch.eog is not None:
        tokens.append(ch.eog)
        texts.append("")
    texts[-1] += ch.text[sum(map(len, ch.texts)):]
    probs = ch.probs if pr is not None else None
    return [(t, None if probs is None else probs[k:k + 1], [tok]) for k, (tok, t) in enumerate(zip(tokens, texts))]


def _stop_word_event(req, ch, n: int, k: int) -> bool:
    """Event ``k`` of ``n`` is the stop word's: llama-server has the stop before it sends it (``timings``)."""
    return ch.finished and req.stop_type == "word" and k == n - 1


class Output:
    """One choice's text, fed as it comes, as ``("content", text)`` and ``("call", call)`` events: through the
    request's tool-call parser (server/tools.py), or the JSON of its schema on the Jinja path with the fence parsed
    away (server/chat_format.py; then its output is not parsed into calls, as llama-server's); :meth:`whole` for a
    whole output."""

    def __init__(self, tools: "ToolSpec | None", fmt: "ChatFormat | None"):
        self.tools, self.fmt = tools, fmt
        self._calls = ToolStream(tools) if tools is not None else None
        self._fence = FenceStream() if fmt is not None else None

    def feed(self, text: str) -> list:
        if self._fence is not None:
            text = self._fence.feed(text)
        if self._calls is not None:
            return self._calls.feed(text)
        return [("content", text)] if text else []

    def finish(self) -> list:
        if self._calls is not None:
            return self._calls.finish()
        rest = self._fence.finish() if self._fence is not None else ""
        return [("content", rest)] if rest else []

    def whole(self, text: str) -> tuple[str | None, list[dict]]:
        """``(content, tool_calls)`` of a whole output."""
        text = text if self.fmt is None else self.fmt.content(text)
        return parse_output(text, self.tools) if self.tools is not None else (text, [])


class _OpenAIBase(Renderer):
    """What OpenAI's completions and chat share: the ids, ``__verbose``, the usage chunk, the whole answer."""

    prefix = whole_object = chunk_object = ""

    def __init__(self, served):
        super().__init__(served)
        self.id = formats.new_id(self.prefix)
        self.created = formats.now()

    def with_verbose(self, d: dict, req) -> dict:
        """The request's ``verbose`` (default: the server's ``--verbose``): llama-server's ``__verbose`` object,
        the native ``/completion`` answer (its ``prompt`` is the text the model saw)."""
        if self.served.verbose:
            d["__verbose"] = NativeRenderer(self.served).final(0, req, stream=False)
        return d

    def head(self, obj: str) -> dict:
        return {"created": self.created, "id": self.id, "model": self.model, "system_fingerprint": SYSTEM_FINGERPRINT,
                "object": obj}

    def stream_tail(self, reqs):
        if self.gen.include_usage:
            stats = [r.stats for r in reqs]
            yield {"choices": [], **self.head(self.chunk_object), "usage": formats.usage(stats),
                   "timings": self.timings(formats.merged(stats))}

    def _choice(self, i: int, r) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def whole(self, reqs):
        stats = [r.stats for r in reqs]
        return self.with_verbose({
            "choices": [self._choice(i, r) for i, r in enumerate(reqs)],
            **self.head(self.whole_object), "usage": formats.usage(stats),
            "timings": self.timings(formats.merged(stats))}, reqs[0])


class CompletionRenderer(_OpenAIBase):
    """``/v1/completions``: ``text_completion`` objects."""

    prefix, whole_object = "cmpl", "text_completion"
    chunk_object = whole_object

    def stream_chunk(self, i, req, ch):
        if getattr(ch, "progress", None) is not None:
            yield {"choices": [{"text": "", "index": i, "logprobs": None, "finish_reason": None}],
                   **self.head("text_completion"), **self.progress(ch)}
            return
        events = _events(self.probs, ch)
        for k, (text, entries, _) in enumerate(events):
            lp = self.probs.completion_logprobs(entries, i) if entries is not None else None
            d = {"choices": [{"text": text, "index": i, "logprobs": lp, "finish_reason": None}],
                 **self.head("text_completion")}
            if self.gen.timings_per_token or _stop_word_event(req, ch, len(events), k):
                d["timings"] = self.timings(req.stats)
            yield d

    def stream_finish(self, i, req):
        yield self.with_verbose({"choices": [{"text": "", "index": i, "logprobs": None,
                                              "finish_reason": formats.finish_reason(req.finish_reason)}],
                                 **self.head("text_completion"), "usage": formats.usage([req.stats]),
                                 "timings": self.timings(req.stats)}, req)

    def _choice(self, i, r):
        return {"text": r.text, "index": i, "finish_reason": formats.finish_reason(r.finish_reason),
                "logprobs": self.probs.completion_logprobs(r.token_probs, i) if self.probs else None}


class ChatRenderer(_OpenAIBase):
    """``/v1/chat/completions``: ``chat.completion`` objects and ``chat.completion.chunk`` deltas."""

    prefix, whole_object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, served):
        super().__init__(served)
        self._started: set[int] = set()
        self._outputs: dict[int, Output] = {}  # per choice
        self._n_calls: dict[int, int] = {}

    def _deltas(self, i: int, events: list) -> list[dict]:
        """Choice ``i``'s output events as deltas: content as it is final, each call once it is complete."""
        out = []
        for kind, v in events:
            if kind == "content":
                out.append({"content": v})
            else:
                k = self._n_calls[i] = self._n_calls.get(i, 0) + 1
                out.append({"tool_calls": [{"index": k - 1, **v}]})
        return out

    def _output(self, i: int) -> Output:
        out = self._outputs.get(i)
        if out is None:
            out = self._outputs[i] = Output(self.tools, self.fmt)
        return out

    def _delta(self, i: int, delta: dict) -> dict:
        return {"choices": [{"finish_reason": None, "index": i, "delta": delta}], **self.head("chat.completion.chunk")}

    def _role(self, i):
        if i not in self._started:
            self._started.add(i)
            yield self._delta(i, {"role": "assistant", "content": None})

    def stream_chunk(self, i, req, ch):
        if getattr(ch, "progress", None) is not None:  # llama-server: a role delta with the progress
            yield {**self._delta(i, {"role": "assistant", "content": None}), **self.progress(ch)}
            return
        yield from self._role(i)
        for text, entries, tokens in self.probs.events(i, ch) if self.probs is not None else _events(None, ch):
            if not text and (not entries or tokens == [ch.eog]):
                continue  # llama-server: no chat chunk for the end-of-generation token (it adds no content)
            # the plain text goes as it is (logprobs of a token without text too); through the tool-call parser or
            # the JSON fence, llama-server sends no chunk for a token that adds no content
            plain = self.tools is None and self.fmt is None
            deltas = [{"content": text}] if plain else self._deltas(i, self._output(i).feed(text))
            for j, delta in enumerate(deltas):
                d = self._delta(i, delta)
                if entries is not None and j == 0 and "content" in delta:  # logprobs go with their content
                    d["choices"][0]["logprobs"] = {"content": self.probs.content(entries)}
                if self.gen.timings_per_token and self.tools is None:
                    d["timings"] = self.timings(req.stats)
                yield d

    def stream_finish(self, i, req):
        yield from self._role(i)
        for delta in self._deltas(i, self._output(i).finish()):
            yield self._delta(i, delta)
        reason = "tool_calls" if self._n_calls.get(i) else formats.finish_reason(req.finish_reason)
        d = {"choices": [{"finish_reason": reason, "index": i, "delta": {}}], **self.head("chat.completion.chunk")}
        if not self.gen.include_usage:  # llama-server: the timings go on the last chunk, the usage one if any
            d["timings"] = self.timings(req.stats)
        yield self.with_verbose(d, req)

    def _choice(self, i: int, r) -> dict:
        content, calls = Output(self.tools, self.fmt).whole(r.text)
        c = {"finish_reason": "tool_calls" if calls else formats.finish_reason(r.finish_reason), "index": i,
             "message": {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}}
        if self.probs is not None:
            c["logprobs"] = {"content": self.probs.content(r.token_probs)}
        return c


class NativeRenderer(Renderer):
    """llama.cpp's ``/completion``: ``content`` chunks, a final object with ``stop: true``, no ``[DONE]``."""

    def __init__(self, served):
        super().__init__(served)
        self._n_sent: dict[int, int] = {}  # per choice, the tokens its events have listed

    def stream_chunk(self, i, req, ch):
        if getattr(ch, "progress", None) is not None:
            yield {"index": i, "content": "", "tokens": [], "stop": False, "id_slot": _slot_id(req),
                   "tokens_predicted": 0, "tokens_evaluated": len(req.prompt_tokens),
                   **self.progress(ch)}
            return
        events = _events(self.probs, ch)
        for k, (text, entries, tokens) in enumerate(events):
            n = self._n_sent[i] = self._n_sent.get(i, 0) + len(tokens)
            d = {"index": i, "content": text, "tokens": tokens, "stop": False, "id_slot": _slot_id(req),
                 "tokens_predicted": n, "tokens_evaluated": len(req.prompt_tokens)}
            if entries:
                d["completion_probabilities"] = self.probs.content(entries)
            if self.gen.timings_per_token or _stop_word_event(req, ch, len(events), k):
                d["timings"] = self.timings(req.stats)
            yield d

    def final(self, i, req, *, stream: bool) -> dict:
        st, settings = req.stats, self.served.settings()  # (None: the engine is gone, its vocabulary with it)
        d = {
            "index": i, "content": "" if stream else req.text,
            "tokens": _tokens(req) if self.gen.return_tokens and not stream else [],
            "id_slot": _slot_id(req), "stop": True, "model": self.model,
            "tokens_predicted": formats.n_predicted(st), "tokens_evaluated": st.n_prompt,
            "generation_settings": settings if settings is not None else {},
            "prompt": self.served.vocab.detokenize(req.prompt_tokens, unparse_special=True) if settings is not None else "",
            "has_new_line": "\n" in req.text, "truncated": req.truncated,
            "stop_type": req.stop_type or "none", "stopping_word": req.stopping_word,
            # llama-server: the tokens in the cache, all but the last one sampled (never decoded)
            "tokens_cached": len(req.prompt_tokens) + max(0, formats.n_predicted(st) - 1),
            "timings": self.timings(st),
        }
        if self.probs is not None and not stream:
            d["completion_probabilities"] = self.probs.content(req.token_probs)
        return d

    def stream_finish(self, i, req):
        yield self.final(i, req, stream=True)

    def whole(self, reqs):
        objs = [self.final(i, r, stream=False) for i, r in enumerate(reqs)]
        return objs[0] if len(objs) == 1 else objs


def _tokens(req: "Request") -> list[int]:
    """A request's tokens as llama-server lists them: the end-of-generation token that ended it last."""
    eog = req.stats.eog_token
    return req.tokens + [eog] if eog is not None else list(req.tokens)


def _logit_bias_json(eng: "Engine", s) -> list[dict]:
    """llama-server's ``logit_bias`` list: ``{"token", "bias"}``, ``null`` for -inf, EOG tokens with
    ``ignore_eos``; a later bias for the same token wins."""
    bias = dict(s.logit_bias)
    if s.ignore_eos:
        bias.update(dict.fromkeys(eng.vocab.eog_tokens(), float("-inf")))
    return [{"token": t, "bias": None if b == float("-inf") else b} for t, b in bias.items()]


def _other_samplers(s) -> dict:
    """The other samplers' settings under llama-server's names (``samplers``: the order in effect)."""
    d = {name: getattr(s, attr) for name, (attr, _k, _lo, _hi) in SAMPLER_FIELDS.items()}
    d["dry_sequence_breakers"] = list(s.dry_sequence_breakers)
    d["samplers"] = list(s.samplers if s.samplers is not None else llama.SAMPLER_ORDER)
    return d


def generation_settings(eng: "Engine", gen: GenParams | None, defaults: Defaults, model_id: str) -> dict:
    """llama-server's ``generation_settings`` / slot ``params`` (the fields llamaspec has)."""
    spec = eng.spec
    if gen is not None:
        o, s = gen.options, gen.sampling
        d = {"n_predict": o.n_predict, "temperature": s.temp, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
             "repeat_penalty": s.repeat_penalty, "repeat_last_n": s.repeat_last_n,
             "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty, "seed": s.seed,
             "stop": list(o.stop), "grammar": s.grammar or "", "stream": gen.stream,
             "n_probs": o.probs.n_probs if o.probs else 0,
             "post_sampling_probs": bool(o.probs and o.probs.post_sampling),
             "cache_prompt": o.cache_prompt, "id_slot": o.id_slot, "ignore_eos": s.ignore_eos,
             "n_keep": o.shift.n_keep, "n_discard": o.shift.n_discard,
             "logit_bias": _logit_bias_json(eng, s)}
        rs = o.speculative
    else:
        d = {"n_predict": defaults.n_predict, "temperature": defaults.temp, "top_k": defaults.top_k,
             "top_p": defaults.top_p, "min_p": defaults.min_p, "repeat_penalty": defaults.repeat_penalty,
             "repeat_last_n": defaults.repeat_last_n, "presence_penalty": defaults.presence_penalty,
             "frequency_penalty": defaults.frequency_penalty, "seed": defaults.seed, "stop": [], "grammar": "",
             "stream": False, "cache_prompt": True, "id_slot": -1, "ignore_eos": False, "logit_bias": [],
             "n_keep": 0, "n_discard": 0,
             "n_probs": 0, "post_sampling_probs": False}
        rs = None
    d.update(_other_samplers(gen.sampling if gen is not None else
                             llama.SamplingParams(**defaults.sampling_extra)))
    n_max = eng.chain.n_max if eng.chain is not None else 0
    d.update({
        "model": model_id,
        "speculative.types": list(eng.chain.types) if eng.chain is not None else ["none"],
        "speculative.n_max": rs.n_max if rs is not None and rs.n_max is not None else n_max,
        "speculative.n_min": rs.n_min if rs is not None and rs.n_min is not None else spec.draft.n_min,
        "speculative.p_min": rs.p_min if rs is not None and rs.p_min is not None else spec.draft.p_min,
        "speculative.verify": rs.verify if rs is not None and rs.verify else eng.verify,
    })
    return d
