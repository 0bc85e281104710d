"""A request's options: one frozen, typed object, built by every face and held by the request.

:class:`RequestOptions` is what a generation asks for besides its prompt: length, sampling, stop strings,
speculative settings, the slot and the prompt cache, token probabilities, llama-server's context-shift and
line limits, the tenant whose n-gram pool drafts it, and the target sampler's hooks. The server
(``server/parsing.py``), the CLI, the Python API and the llama-cpp-python faces (``compat/``) each build one;
:meth:`Engine.submit <llamaspec.engine.Engine.submit>` validates it once against the engine's
:class:`Caps`, and the request and its slot read it from there (``req.options``, ``slot.options``).

:meth:`RequestOptions.validate` is pure: it returns the options with the engine's conventions applied
(``repeat_last_n`` -1 is the context size, ``probs`` as an int is a :class:`~llamaspec.logprobs.ProbsSpec`)
or raises :class:`~llamaspec.errors.UsageError` naming the field.

>>> caps = Caps(n_vocab=100, n_ctx_seq=512, n_parallel=2, n_max=8)
>>> RequestOptions(n_predict=4, probs=3).validate(caps).probs
ProbsSpec(n_probs=3, post_sampling=False)
>>> RequestOptions(id_slot=2).validate(caps)
Traceback (most recent call last):
...
llamaspec.errors.UsageError: id_slot must be -1 (any) or 0..1, got 2
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from .errors import UsageError
from .logprobs import ProbsSpec, check_probs
from .params import RequestSpec

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from . import _llama as llama

__all__ = ["Caps", "RequestOptions", "SamplerHooks", "Shift", "TextLimits", "resolve_sampling"]


@dataclass(frozen=True)
class Caps:
    """What an engine can do, against which a request's options are checked: the vocabulary size, the
    context per sequence, the slots, and the draft length its contexts were sized for (0: no drafter)."""

    n_vocab: int
    n_ctx_seq: int
    n_parallel: int = 1
    n_max: int = 0


@dataclass(frozen=True)
class TextLimits:
    """llama-server's line limits (:class:`~llamaspec.text.TextStream`): stop at a line indented less than
    ``n_indent`` columns, or at the first new line after ``t_max_predict_ms`` of generation (0: off)."""

    n_indent: int = 0
    t_max_predict_ms: int = 0

    def validate(self) -> None:
        for name in ("n_indent", "t_max_predict_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UsageError(f"{name} must be an integer >= 0 (0 = off), got {v!r}")


@dataclass(frozen=True)
class Shift:
    """llama-server's context shift (:mod:`llamaspec.ctx_shift`): the tokens kept at the start (``n_keep``,
    -1: the whole prompt) and those discarded after them (``n_discard``, 0: half of the rest)."""

    n_keep: int = 0
    n_discard: int = 0

    def validate(self) -> None:
        if isinstance(self.n_keep, bool) or not isinstance(self.n_keep, int) or self.n_keep < -1:
            raise UsageError(f"n_keep must be -1 (the whole prompt) or >= 0, got {self.n_keep!r}")
        if isinstance(self.n_discard, bool) or not isinstance(self.n_discard, int) or self.n_discard < 0:
            raise UsageError(f"n_discard must be >= 0 (0 = half of what is not kept), got {self.n_discard!r}")


@dataclass(frozen=True)
class SamplerHooks:
    """The target sampler's hooks (:class:`~llamaspec.sampler.TargetSampler`): a logits processor
    ``f(input_ids, scores) -> scores`` run before sampling, and whether penalties count the prompt's tokens
    (llama-cpp-python's sampler sees only the generated ones)."""

    logits_processor: "Callable[[np.ndarray, np.ndarray], np.ndarray] | None" = None
    penalize_prompt: bool = True

    def validate(self) -> None:
        if self.logits_processor is not None and not callable(self.logits_processor):
            raise UsageError(f"logits_processor must be callable f(input_ids, scores), got {self.logits_processor!r}")


@dataclass(frozen=True)
class RequestOptions:
    """Everything a request asks for besides its prompt (see the module docstring).

    ``n_predict``: tokens to generate (-1: until end of generation or a full context; 0: the prompt only).
    ``sampling``: the sampler settings (None: greedy). ``stop``: stop strings. ``parse_special``: a text
    prompt's special-token texts are tokens. ``speculative``: lowers the engine's draft settings for this
    request (``n_max=0``: no drafting). ``id_slot``: pin a slot (-1: any). ``cache_prompt``: reuse the slot's
    cached prefix. ``probs``: token probabilities of every emitted token (an int is ``n_probs``).
    ``progress``: prompt-progress chunks while the prompt is decoded. ``owner``: the tenant (the shared
    n-gram pool drafts within it)."""

    n_predict: int = -1
    sampling: "llama.SamplingParams | None" = None
    stop: tuple[str, ...] = ()
    parse_special: bool = False
    speculative: RequestSpec | None = None
    id_slot: int = -1
    cache_prompt: bool = True
    probs: "ProbsSpec | int | None" = None
    shift: Shift = field(default_factory=Shift)
    text: TextLimits = field(default_factory=TextLimits)
    progress: bool = False
    owner: str = ""
    hooks: SamplerHooks = field(default_factory=SamplerHooks)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))

    @classmethod
    def of(cls, options: "RequestOptions | None" = None, **fields: Any) -> "RequestOptions":
        """``options`` (default: the defaults) with ``fields`` replaced; an unknown field is a
        :class:`UsageError` naming it and the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(fields) - known)
        if bad:
            raise UsageError(f"unknown request option {bad[0]!r}; the options are: {', '.join(sorted(known))}")
        base = options if options is not None else cls()
        return dataclasses.replace(base, **fields) if fields else base

    def validate(self, caps: Caps) -> "RequestOptions":
        """These options checked against ``caps`` and resolved (see the module docstring); raises
        :class:`UsageError` naming the field."""
        from ._llama.sampler import SamplingParams  # the dataclass only (no native state)

        _int("n_predict", self.n_predict, -1, "-1 = until end of generation or context")
        _int("id_slot", self.id_slot, -1, "-1 = any")
        if not self.id_slot < caps.n_parallel:
            raise UsageError(f"id_slot must be -1 (any) or 0..{caps.n_parallel - 1}, got {self.id_slot}")
        if not all(isinstance(s, str) for s in self.stop):
            raise UsageError(f"stop must be strings, got {list(self.stop)!r}")
        for name in ("parse_special", "cache_prompt", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.owner, str):
            raise UsageError(f"owner must be a string (the tenant), got {self.owner!r}")
        for name, kind in (("speculative", RequestSpec), ("shift", Shift), ("text", TextLimits),
                           ("hooks", SamplerHooks)):
            v = getattr(self, name)
            if v is not None and not isinstance(v, kind):
                raise UsageError(f"{name} must be a {kind.__name__}, got {v!r}")
        if self.speculative is not None:
            self.speculative.validate(caps.n_max)
        self.shift.validate()
        self.text.validate()
        self.hooks.validate()
        sampling = self.sampling if self.sampling is not None else SamplingParams(temp=0.0)
        if not isinstance(sampling, SamplingParams):
            raise UsageError(f"sampling must be a SamplingParams, got {sampling!r}")
        return dataclasses.replace(self, sampling=resolve_sampling(sampling, caps.n_ctx_seq),
                                   probs=check_probs(self.probs, caps.n_vocab),
                                   stop=tuple(s for s in self.stop if s))


def _int(name: str, v: Any, lo: int, meaning: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise UsageError(f"{name} must be an integer >= {lo} ({meaning}), got {v!r}")


def resolve_sampling(sampling: "llama.SamplingParams", n_ctx_seq: int) -> "llama.SamplingParams":
    """``sampling`` with llama.h's conventions applied for this context: ``repeat_last_n`` -1 is the context
    size (0 = off); a window beyond the context is refused (it would only ask llama.cpp for memory).

    >>> from llamaspec._llama.sampler import SamplingParams
    >>> resolve_sampling(SamplingParams(repeat_last_n=-1), 512).repeat_last_n
    512
    """
    n = sampling.repeat_last_n
    if n == -1:
        return dataclasses.replace(sampling, repeat_last_n=n_ctx_seq)
    if not 0 <= n <= n_ctx_seq:
        raise UsageError(f"repeat_last_n must be -1 (the context size), 0 (off) or up to the context size "
                         f"{n_ctx_seq}, got {n}")
    return sampling
