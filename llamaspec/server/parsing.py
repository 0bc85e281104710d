"""Request bodies -> what :meth:`Engine.submit` takes, with llama-server's field names and rules.

* A field sent as ``null`` counts as absent; unknown fields are ignored (as llama-server does).
* A field of the wrong type or out of range is a 400 ``invalid_request_error`` that names the field.
* Length: ``n_predict`` (aliases ``max_completion_tokens``, ``max_tokens``), -1 = until end of generation
  or a full context.
* Per-request speculative settings: flat keys as llama.cpp spells them (``"speculative.n_max": 2``) or a
  nested object (``"speculative": {"n_max": 2}``); ``n_max``, ``n_min``, ``p_min``, ``verify``.

>>> b = Body({"max_tokens": 8, "temperature": None, "speculative.n_max": 0, "speculative": {"p_min": 0.5}})
>>> b.int("n_predict", -1, aliases=("max_completion_tokens", "max_tokens"), lo=-1)
8
>>> b.float("temperature", 0.8)
0.8
>>> parse_speculative(b)
RequestSpec(n_max=0, n_min=None, p_min=0.5, verify=None)
>>> Body({"top_k": "5"}).int("top_k", 40)
Traceback (most recent call last):
...
llamaspec.server.errors.ApiError: Field 'top_k': expected an integer, got "5"
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .. import _llama as llama
from ..errors import UsageError
from ..options import RequestOptions, Shift, TextLimits
from ..params import RequestSpec
from . import cancel
from .chat_format import ChatFormat, chat_format, constrained_grammar
from .constraints import JSON_GRAMMAR, parse_grammar, parse_logit_bias
from .errors import invalid, show
from .limits import Limits, check_chars, check_generations, over, parse_json
from .probs import parse_probs
from .tenant import current_tenant
from .tools import ToolSpec, message_extras, parse_tools

__all__ = ["Body", "Defaults", "GenParams", "parse_json", "parse_gen_params", "parse_prompts", "parse_messages",
           "parse_speculative", "JSON_GRAMMAR"]


MAX_N_CMPL = 16
#: an integer field is a C ``int32_t`` unless it says otherwise (ctypes would wrap a larger value silently)
I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1
#: llama-server's other sampling fields: request field -> (SamplingParams field, type, llama.cpp's range)
SAMPLER_FIELDS = {"typical_p": ("typ_p", float, None, None), "mirostat": ("mirostat", int, 0, 2),
                  "mirostat_tau": ("mirostat_tau", float, None, None),
                  "mirostat_eta": ("mirostat_eta", float, None, None),
                  "xtc_probability": ("xtc_probability", float, 0.0, 1.0),
                  "xtc_threshold": ("xtc_threshold", float, 0.0, 1.0),
                  "dry_multiplier": ("dry_multiplier", float, None, None), "dry_base": ("dry_base", float, None, None),
                  "dry_allowed_length": ("dry_allowed_length", int, 0, I32_MAX),
                  "dry_penalty_last_n": ("dry_penalty_last_n", int, 0, I32_MAX),
                  "dynatemp_range": ("dynatemp_range", float, None, None),
                  "dynatemp_exponent": ("dynatemp_exponent", float, None, None),
                  "top_n_sigma": ("top_n_sigma", float, None, None), "min_keep": ("min_keep", int, 0, I32_MAX),
                  "adaptive_target": ("adaptive_target", float, None, 1.0),
                  "adaptive_decay": ("adaptive_decay", float, 0.0, 0.99)}


class Body:
    """Typed access to a request's JSON object (``null`` = absent)."""

    def __init__(self, data: dict, size: int | None = None):
        self.data = data
        self.size = size  # bytes of the JSON it was read from (None: unknown)

    def get(self, name: str, *, aliases: Sequence[str] = ()) -> tuple[str, Any]:
        """``(field name used, value)`` of the first of ``name, *aliases`` that is present, else ``(name, None)``."""
        for key in (name, *aliases):
            v = self.data.get(key)
            if v is not None:
                return key, v
        return name, None

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def int(self, name: str, default: int | None, *, aliases: Sequence[str] = (), lo: int | None = None,
            hi: int | None = None) -> int | None:
        key, v = self.get(name, aliases=aliases)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
            raise invalid(f"Field '{key}': expected an integer, got {show(v)}")
        v = int(v)
        _check_range(key, v, I32_MIN if lo is None else lo, I32_MAX if hi is None else hi)
        return v

    def float(self, name: str, default: float | None, *, aliases: Sequence[str] = (), lo: float | None = None,
              hi: float | None = None) -> float | None:
        key, v = self.get(name, aliases=aliases)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise invalid(f"Field '{key}': expected a number, got {show(v)}")
        v = float(v)
        _check_range(key, v, lo, hi)
        return v

    def bool(self, name: str, default: bool) -> bool:
        key, v = self.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise invalid(f"Field '{key}': expected true or false, got {show(v)}")
        return v

    def str(self, name: str, default: str | None = None) -> str | None:
        key, v = self.get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise invalid(f"Field '{key}': expected a string, got {show(v)}")
        return v

    def obj(self, name: str) -> dict | None:
        key, v = self.get(name)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise invalid(f"Field '{key}': expected an object, got {show(v)}")
        return v


def _check_range(key: str, v: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and hi is not None and not lo <= v <= hi:
        raise invalid(f"Field '{key}': value must be between {lo} and {hi}, got {v}")
    if lo is not None and v < lo:
        raise invalid(f"Field '{key}': value must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise invalid(f"Field '{key}': value must be <= {hi}, got {v}")


@dataclass
class Defaults:
    """Server-wide defaults of the request fields (the ``serve`` command's sampling flags)."""

    n_predict: int = -1
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1
    #: the other samplers' settings from the command line (SamplingParams field names: mirostat, dry_*, ...)
    sampling_extra: dict = field(default_factory=dict)


@dataclass
class GenParams:
    """One generation request, parsed (the prompt is parsed separately): what the engine is asked for
    (:class:`~llamaspec.options.RequestOptions`) and how the answer goes back over HTTP."""

    options: RequestOptions
    stream: bool = False
    include_usage: bool = False
    timings_per_token: bool = False
    return_tokens: bool = False
    n_cmpl: int = 1
    #: a chat request's tools and the JSON schema of the Jinja chat path (how its output reads)
    tools: ToolSpec | None = None
    fmt: ChatFormat | None = None

    @property
    def sampling(self) -> llama.SamplingParams:
        return self.options.sampling  # type: ignore[return-value] - parse_gen_params always sets it

    def with_grammar(self, grammar: str) -> None:
        """Constrain the output with ``grammar`` (a forced tool call's, a response format's)."""
        self.options = dataclasses.replace(self.options, sampling=dataclasses.replace(self.sampling, grammar=grammar))


def parse_speculative(b: Body) -> RequestSpec | None:
    """``speculative.n_max`` / ``n_min`` / ``p_min`` / ``verify``, flat or nested; None when none is given."""
    nested = b.obj("speculative")
    nb = Body(nested or {})
    flat_keys = {k: "speculative." + k for k in ("n_max", "n_min", "p_min", "verify")}
    vals: dict[str, Any] = {}
    for k, fk in flat_keys.items():
        fv, nv = b.data.get(fk), nb.data.get(k)
        if fv is not None and nv is not None and (fv != nv or isinstance(fv, bool) != isinstance(nv, bool)):
            raise invalid(f"Field '{fk}' ({show(fv)}) and 'speculative': {{\"{k}\": {show(nv)}}} disagree: give one")
        src = b if fv is not None else nb
        name = fk if fv is not None else k
        if k in ("n_max", "n_min"):
            vals[k] = src.int(name, None, lo=0)
        elif k == "p_min":
            vals[k] = src.float(name, None, lo=0.0, hi=1.0)
        else:
            vals[k] = src.str(name, None)
    if all(v is None for v in vals.values()):
        return None
    return RequestSpec(**vals)


def _stop(b: Body, limits: Limits) -> list[str]:
    key, v = b.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    elif not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        raise invalid(f"Field '{key}': expected a string or a list of strings, got {show(v)}")
    if len(v) > limits.max_stop:
        raise over(f"{len(v)} stop strings", limits.max_stop, "max_stop", field=key)
    for s in v:
        if len(s) > limits.max_stop_chars:
            raise over(f"a stop string of {len(s)} characters", limits.max_stop_chars, "max_stop_chars", field=key)
    return [s for s in v if s]


def _repeat_last_n(b: Body, defaults: Defaults, n_ctx: int | None) -> int:
    """llama.cpp's rule: 0 = off, -1 = the context size. A request's value must be in ``[-1, n_ctx]``; the
    server's default (``--repeat-last-n``) is clamped to the context size."""
    key, v = b.get("repeat_last_n")
    if v is None:
        n = defaults.repeat_last_n
        return n if n_ctx is None else (n_ctx if n < 0 or n > n_ctx else n)
    hi = I32_MAX if n_ctx is None else n_ctx
    n = b.int("repeat_last_n", None, lo=I32_MIN, hi=I32_MAX)
    if not -1 <= n <= hi:
        raise invalid(f"Field '{key}': value must be between -1 (the context size) and {hi} (0 = off), got {n}")
    return hi if n == -1 and n_ctx is not None else n


def _sampler_fields(b: Body, defaults: Defaults) -> dict:
    """llama-server's other samplers (mirostat, DRY, XTC, typical, top-n-sigma, dynamic temperature,
    adaptive-p, ``samplers``, ``dry_sequence_breakers``) as SamplingParams keyword arguments, over the
    command line's defaults."""
    out = dict(defaults.sampling_extra)
    for name, (attr, kind, lo, hi) in SAMPLER_FIELDS.items():
        v = (b.int if kind is int else b.float)(name, None, lo=lo, hi=hi)
        if v is not None:
            out[attr] = v
    if b.has("dry_base") and out["dry_base"] < 1.0:  # llama-server: below 1 means the server's default
        out["dry_base"] = defaults.sampling_extra.get("dry_base", 1.75)
    key, v = b.get("dry_sequence_breakers")
    if v is not None:
        if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
            raise invalid(f"Field '{key}': dry_sequence_breakers must be a non-empty array of strings, "
                          f"got {show(v)}")
        out["dry_sequence_breakers"] = tuple(v)
    key, v = b.get("samplers")
    if v is not None:
        if not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))):
            raise invalid(f"Field '{key}': an array of sampler names or a string of sampler characters, "
                          f"got {show(v)}")
        try:
            out["samplers"] = llama.sampler_order(v)
        except UsageError as e:
            raise invalid(f"Field '{key}': {e}") from None
    return out


def parse_gen_params(b: Body, defaults: Defaults, *, n_ctx: int | None = None,
                     limits: Limits | None = None, tokenize: Callable[[str], list] | None = None,
                     chat: bool = False, jinja: bool = False) -> GenParams:
    """Sampling, length, stop, streaming and slot fields of a completion or chat request (``n_ctx``: the
    slot's context, the bound of ``repeat_last_n``; ``tokenize``: text -> token ids without BOS, for the
    text keys of ``logit_bias``; ``chat``: a chat request, whose ``tools`` (server/tools.py) and, when the server
    renders with Jinja (``jinja``), JSON schema (server/chat_format.py) are read first and constrain the output)."""
    limits = limits or Limits()
    tools = fmt = None
    if chat:
        tools, fmt = parse_tools(b.data), chat_format(b, jinja)
    elif b.data.get("tools") not in (None, []):
        raise invalid("Field 'tools': tool calls are only supported on /v1/chat/completions")
    n_predict = b.int("n_predict", defaults.n_predict, aliases=("max_completion_tokens", "max_tokens"), lo=-1)
    temp = b.float("temperature", defaults.temp)
    top_k = b.int("top_k", defaults.top_k)
    seed = b.int("seed", defaults.seed, lo=-1, hi=0xFFFFFFFF)
    sampling = llama.SamplingParams(
        temp=max(0.0, temp),  # llama-server: temperature <= 0 is greedy
        top_k=max(0, top_k),  # <= 0 = off
        top_p=b.float("top_p", defaults.top_p, lo=0.0, hi=1.0),
        min_p=b.float("min_p", defaults.min_p, lo=0.0, hi=1.0),
        repeat_penalty=b.float("repeat_penalty", defaults.repeat_penalty, lo=0.0),
        repeat_last_n=_repeat_last_n(b, defaults, n_ctx),
        presence_penalty=b.float("presence_penalty", defaults.presence_penalty),
        frequency_penalty=b.float("frequency_penalty", defaults.frequency_penalty),
        seed=llama.DEFAULT_SEED if seed == -1 else seed,
        grammar=parse_grammar(b, limits.max_grammar_alternatives),
        max_grammar_alternatives=0,  # checked above, naming the field (the engine would count them again)
        logit_bias=parse_logit_bias(b, tokenize),
        ignore_eos=b.bool("ignore_eos", False),
        **_sampler_fields(b, defaults),
    )
    if sampling.repeat_penalty == 0.0:
        sampling.repeat_penalty = 1.0  # llama.cpp: 0 and 1 both mean off
    so = b.obj("stream_options") or {}
    include_usage = so.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise invalid(f"Field 'stream_options.include_usage': expected true or false, got {show(include_usage)}")
    stream = b.bool("stream", False)
    return_progress = b.bool("return_progress", False)
    text = {k: v for k in ("n_indent", "t_max_predict_ms")
            if (v := b.int(k, 0, lo=-1 if k == "t_max_predict_ms" else 0)) and v > 0}
    options = RequestOptions(
        n_predict=n_predict, sampling=sampling, stop=tuple(_stop(b, limits)), speculative=parse_speculative(b),
        id_slot=b.int("id_slot", -1, lo=-1), cache_prompt=b.bool("cache_prompt", True), probs=parse_probs(b),
        shift=Shift(b.int("n_keep", 0, lo=-1, hi=I32_MAX), b.int("n_discard", 0, lo=0, hi=I32_MAX)),
        text=TextLimits(**text), progress=return_progress and stream, owner=current_tenant())
    gen = GenParams(options=options, stream=stream, include_usage=bool(include_usage),
                    timings_per_token=b.bool("timings_per_token", False), return_tokens=b.bool("return_tokens", False),
                    n_cmpl=b.int("n", 1, aliases=("n_cmpl",), lo=1, hi=MAX_N_CMPL), tools=tools, fmt=fmt)
    grammar = constrained_grammar(sampling.grammar, tools, fmt, limits.max_grammar_alternatives)
    if grammar is not None:  # a forced tool call's, or the Jinja chat grammar of a JSON schema
        gen.with_grammar(grammar)
    return gen


# ---------------------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------------------
Tokenize = Callable[[str, bool], list]  # (text, add_special) -> token ids


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


PROMPT_KINDS = ("a prompt is a string, a list of token ids, a list of both, or an object "
                "{\"prompt_string\": ...}")


def _one_prompt(p: Any, where: str) -> tuple[list, int]:
    """Check one prompt: a string, a list of token ids, a mixed list of strings and ids, or llama-server's
    JSON object ``{"prompt_string": one of those}`` (``multimodal_data`` is refused: llamaspec is text-only);
    ``(its parts, its characters)``."""
    if isinstance(p, dict):
        if p.get("multimodal_data") is not None:
            raise invalid(f"Field '{where}.multimodal_data': multimodal data was given, but this server is "
                          "text-only (no multimodal projector): send the prompt text alone")
        if "prompt_string" not in p:
            raise invalid(f"Field '{where}': a JSON prompt object needs \"prompt_string\" ({PROMPT_KINDS})")
        inner = p["prompt_string"]
        if isinstance(inner, dict):
            raise invalid(f"Field '{where}.prompt_string': expected a string or a list of strings and token ids")
        return _one_prompt(inner, f"{where}.prompt_string")
    if isinstance(p, str):
        return [p], len(p)
    if isinstance(p, list):
        for x in p:
            if not (_is_token(x) or isinstance(x, str)):
                raise invalid(f"Field '{where}': {PROMPT_KINDS}; got {show(x)} in it")
        return p, sum(len(x) for x in p if isinstance(x, str))
    raise invalid(f"Field '{where}': {PROMPT_KINDS}; got {show(p)}")


def _tokens(parts: list, tokenize: Tokenize) -> list[int]:
    """llama-server's ``tokenize_mixed``: only the first string gets the model's BOS."""
    out: list[int] = []
    for i, x in enumerate(parts):
        if isinstance(x, str):
            out.extend(tokenize(x, i == 0))
        else:
            out.append(x)
    return out


def parse_prompts(b: Body, tokenize: Tokenize, *, key: str = "prompt", limits: Limits | None = None,
                  n_cmpl: int = 1) -> list[list[int]]:
    """The prompt(s) of a completion request as token lists. One prompt: a string, a list of ids, a mixed
    list, or an object ``{"prompt_string": ...}``; several prompts: a list of those (each becomes a choice).
    The limits (prompts x ``n_cmpl``, characters) are checked before anything is tokenised; the context, once
    the prompts are tokens (:func:`llamaspec.server.pipeline.submit`)."""
    limits = limits or Limits()
    k, v = b.get(key)
    if v is None:
        raise invalid(f"\"{key}\" must be provided")
    if isinstance(v, (str, dict)) or (isinstance(v, list) and any(_is_token(x) for x in v)):
        checked = [_one_prompt(v, k)]  # one prompt: a string, an object; ids, or ids and strings
    elif isinstance(v, list):
        if not v:
            raise invalid(f"Field '{k}': the prompt list is empty")
        checked = [_one_prompt(p, f"{k}[{i}]") for i, p in enumerate(v)]
    else:
        raise invalid(f"Field '{k}': expected a string, a list or an object {{\"prompt_string\": ...}}, got {show(v)}")
    check_generations(len(checked), n_cmpl, limits)
    check_chars(k, sum(n for _, n in checked), limits)
    return [_tokens(parts, tokenize) for parts, _ in checked]


def parse_messages(b: Body, limits: Limits | None = None) -> list[dict[str, str]]:
    """OpenAI chat messages as ``{"role", "content"}`` strings (text parts are joined; other parts refused),
    with their ``tool_calls`` / ``tool_call_id`` / ``name`` (:func:`~llamaspec.server.tools.message_extras`);
    their text together within ``--max-prompt-chars``."""
    k, v = b.get("messages")
    if v is None:
        raise invalid("\"messages\" must be provided")
    if not isinstance(v, list) or not v:
        raise invalid(f"Field '{k}': expected a non-empty list of messages")
    out = []
    for i, m in enumerate(v):
        if i % cancel.EVERY == 0:  # stop when the client left
            cancel.check()
        if not isinstance(m, dict):
            raise invalid(f"Field 'messages[{i}]': expected an object with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise invalid(f"Field 'messages[{i}].role': expected a string")
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, str):
                    parts.append(part)
                elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    t = part.get("type") if isinstance(part, dict) else None
                    raise invalid(f"Field 'messages[{i}].content[{j}]': only text parts are supported"
                                  + (f" (got type {show(t)})" if t else ""))
            text = "\n".join(parts)
        else:
            raise invalid(f"Field 'messages[{i}].content': expected a string or a list of parts")
        out.append({"role": role, "content": text, **message_extras(m, i)})
    check_chars(k, sum(len(m["role"]) + len(m["content"]) for m in out), limits or Limits())
    return out
