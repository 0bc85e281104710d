"""The samplers of llama.cpp's ``common_sampler`` chain, in its order, from :class:`SamplingParams`.

llama.cpp builds: logit bias, then either (``mirostat == 0``) the configured order of
``penalties; dry; top_n_sigma; top_k; typ_p; top_p; min_p; xtc; temperature`` (plus ``infill`` and
``adaptive_p`` when named) ending in ``dist`` (or ``adaptive_p`` when it is named), or
(``mirostat`` 1 / 2) ``temperature`` and the mirostat sampler alone. Samplers at their neutral value
are no-ops in llama.cpp; they are left out here (same output, less work per token).

Greedy requests (``temp <= 0``) end in ``greedy`` instead of ``dist``: llama.cpp's ``temperature(0)`` keeps
only the largest logit, so what matters is what runs before it. The truncations (top-k, top-p, min-p,
top-n-sigma) always keep the largest logit and are left out; the samplers that can change which token is
largest (bias, penalties, DRY, typical, XTC, infill) run in the configured order.

>>> sampler_order(["top-k", "Temp", "nucleus"])
('top_k', 'temperature', 'top_p')
>>> sampler_order("kpt")
('top_k', 'top_p', 'temperature')
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Sequence

from llama_cpp import llama_cpp as native

from ..errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from .model import Vocab

    SamplingParams = object  # llamaspec._llama.sampler.SamplingParams (which imports this module)

__all__ = ["DEFAULT_ORDER", "SAMPLER_NAMES", "sampler_order", "chain_samplers", "picks_in_chain"]

#: llama.cpp's canonical sampler type names and their one-character codes (``--sampling-seq``)
SAMPLER_NAMES = {"dry": "d", "top_k": "k", "typ_p": "y", "top_p": "p", "top_n_sigma": "s", "min_p": "m",
                 "temperature": "t", "xtc": "x", "infill": "i", "penalties": "e", "adaptive_p": "a"}
DEFAULT_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
_BY_CHAR = {c: n for n, c in SAMPLER_NAMES.items()}


#: every spelling ``sampler_order`` takes (lower case): canonical, kebab-case, no-dash and llama.cpp's aliases
_ALIASES = {**{spelling: n for n in SAMPLER_NAMES for spelling in (n, n.replace("_", "-"), n.replace("_", ""))},
            "nucleus": "top_p", "temp": "temperature", "typ": "typ_p", "typical_p": "typ_p", "typical": "typ_p"}


def sampler_order(value: "str | Sequence[str]") -> tuple[str, ...]:
    """llama-server's ``samplers`` field (and ``--samplers`` / ``--sampling-seq``): a list of sampler names
    (canonical, kebab-case, no-dash or llama.cpp's aliases, any case) or a string of sampler characters.
    A name or character llama.cpp does not know is an error here (llama-server logs and drops it)."""
    if isinstance(value, str):
        bad = [c for c in value if c not in _BY_CHAR]
        if bad:
            raise UsageError(f"samplers: unknown sampler character(s) {''.join(bad)!r}; known: "
                             + ", ".join(f"{c}={n}" for n, c in SAMPLER_NAMES.items()))
        return tuple(_BY_CHAR[c] for c in value)
    out = []
    for name in value:
        if not isinstance(name, str) or name.lower() not in _ALIASES:
            raise UsageError(f"samplers: unknown sampler {name!r}; known: {', '.join(SAMPLER_NAMES)}")
        out.append(_ALIASES[name.lower()])
    return tuple(out)


def picks_in_chain(p: "SamplingParams") -> bool:
    """Whether a sampler other than ``dist`` draws the token or randomness is used before it (mirostat,
    adaptive-p, XTC): the distribution then cannot be read off a clone, so rejection sampling is not exact
    and such requests verify by sample-and-match (which is exact for any chain)."""
    return bool(p.mirostat) or "adaptive_p" in (p.samplers or ()) or _xtc_on(p)


def _xtc_on(p: "SamplingParams") -> bool:
    return p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5


def _one(name: str, vocab: "Vocab", p: "SamplingParams", greedy: bool):
    """The native sampler for ``name``, or None when it would do nothing (or, greedy, not move the argmax)."""
    if name == "penalties":
        if p.repeat_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
            return native.llama_sampler_init_penalties(vocab.n_tokens, p.repeat_last_n, p.repeat_penalty,
                                                       p.frequency_penalty, p.presence_penalty)
    elif name == "dry":
        if p.dry_multiplier != 0.0 and p.dry_base >= 1.0 and p.dry_penalty_last_n != 0:
            breakers = [s.encode("utf-8") for s in p.dry_sequence_breakers]
            return native.llama_sampler_init_dry(vocab.ptr, p.dry_multiplier, p.dry_base, p.dry_allowed_length,
                                                 p.dry_penalty_last_n,
                                                 (ctypes.c_char_p * max(1, len(breakers)))(*breakers), len(breakers))
    elif name == "typ_p":
        if p.typ_p < 1.0:
            return native.llama_sampler_init_typical(p.typ_p, p.min_keep)
    elif name == "xtc":
        if _xtc_on(p):
            return native.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold, p.min_keep, p.seed)
    elif name == "infill":
        return native.llama_sampler_init_infill(vocab.ptr)
    elif greedy:
        return None
    elif name == "top_k":
        if p.top_k > 0:
            return native.llama_sampler_init_top_k(p.top_k)
    elif name == "top_p":
        if p.top_p < 1.0:
            return native.llama_sampler_init_top_p(p.top_p, p.min_keep)
    elif name == "min_p":
        if p.min_p > 0.0:
            return native.llama_sampler_init_min_p(p.min_p, p.min_keep)
    elif name == "top_n_sigma":
        if p.top_n_sigma > 0.0:
            return native.llama_sampler_init_top_n_sigma(p.top_n_sigma)
    elif name == "temperature":
        if p.dynatemp_range > 0.0:
            return native.llama_sampler_init_temp_ext(p.temp, p.dynatemp_range, p.dynatemp_exponent)
        return native.llama_sampler_init_temp(p.temp)
    return None


def chain_samplers(vocab: "Vocab", p: "SamplingParams") -> list:
    """The native samplers after the logit bias, in llama.cpp's order (see the module docstring); the last
    one selects the token (``dist``, ``greedy``, ``mirostat``, ``adaptive_p``). The caller owns them."""
    greedy = p.temp <= 0
    if p.mirostat:
        if greedy:  # temperature(0) leaves one candidate: mirostat picks it
            return [native.llama_sampler_init_greedy()]
        pick = (native.llama_sampler_init_mirostat(vocab.n_tokens, p.seed, p.mirostat_tau, p.mirostat_eta, 100)
                if p.mirostat == 1 else native.llama_sampler_init_mirostat_v2(p.seed, p.mirostat_tau, p.mirostat_eta))
        return [native.llama_sampler_init_temp(p.temp), pick]
    order = p.samplers if p.samplers is not None else DEFAULT_ORDER
    if greedy and "temperature" in order:
        order = order[:order.index("temperature")]
    out = [s for s in (_one(n, vocab, p, greedy) for n in order if n != "adaptive_p") if s is not None]
    if greedy:
        out.append(native.llama_sampler_init_greedy())
    elif "adaptive_p" in order:
        out.append(native.llama_sampler_init_adaptive_p(p.adaptive_target, p.adaptive_decay, p.seed))
    else:
        out.append(native.llama_sampler_init_dist(p.seed))
    return out
