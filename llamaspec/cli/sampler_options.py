"""llama.cpp's other sampler flags (``--mirostat``, ``--dry-*``, ``--xtc-*``, ``--typical``, ``--top-nsigma``,
``--dynatemp-*``, ``--adaptive-*``, ``--samplers`` / ``--sampling-seq``, ``--min-keep``) for ``generate`` and
``serve``, with llama.cpp's spellings and meanings.

The options do not become parameters of the command: each given one is stored, under its
:class:`~llamaspec.SamplingParams` field name, in ``ctx.meta``; :func:`sampler_extra` returns them.
"""
from __future__ import annotations

from typing import Any, Callable

import click

from ._common import option_group

__all__ = ["sampler_options", "sampler_extra"]

_KEY = "llamaspec.sampler_extra"


def _store(field: str, convert: Callable[[Any], Any] = lambda v: v):
    def cb(ctx: click.Context, _param: click.Parameter, value: Any) -> None:
        if value is None or value == ():
            return
        from llamaspec.errors import UsageError

        try:
            ctx.meta.setdefault(_KEY, {})[field] = convert(value)
        except UsageError as e:
            raise click.BadParameter(str(e)) from None
    return cb


def _samplers(value: str) -> tuple[str, ...]:
    from llamaspec import _llama as llama

    return llama.sampler_order([s for s in value.split(";") if s])


def _sequence(value: str) -> tuple[str, ...]:
    from llamaspec import _llama as llama

    return llama.sampler_order(value)


def _breakers(values: tuple[str, ...]) -> tuple[str, ...]:
    """llama.cpp: the first ``--dry-sequence-breaker`` clears the defaults; ``none`` clears them all."""
    out: list[str] = []
    for v in values:
        out = [] if v == "none" else out + [v]
    return tuple(out)


def _opt(decls: str, field: str, kind: Any, help: str, convert: Callable[[Any], Any] = lambda v: v, **kw):
    name = decls.split()[0].lstrip("-").replace("-", "_") + "_sampler_opt"
    return click.option(*decls.split(), name, type=kind, default=None, expose_value=False,
                        callback=_store(field, convert), help=help, **kw)


_OPTIONS = (
    _opt("--samplers", "samplers", str, "Samplers in order, separated by ';' (llama.cpp's names; default: "
         "penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature).", _samplers),
    _opt("--sampling-seq --sampler-seq", "samplers", str, "The sampler order as characters (e.g. 'edskypmxt').",
         _sequence),
    _opt("--typical --typical-p", "typ_p", float, "Locally typical sampling, parameter p (1.0 = off)."),
    _opt("--top-nsigma --top-n-sigma", "top_n_sigma", float, "Top-n-sigma sampling (-1 = off)."),
    _opt("--xtc-probability", "xtc_probability", click.FloatRange(0.0, 1.0), "XTC probability (0 = off)."),
    _opt("--xtc-threshold", "xtc_threshold", float, "XTC threshold (> 0.5 = off)."),
    _opt("--dynatemp-range", "dynatemp_range", float, "Dynamic temperature range (0 = off)."),
    _opt("--dynatemp-exp", "dynatemp_exponent", float, "Dynamic temperature exponent."),
    _opt("--dry-multiplier", "dry_multiplier", float, "DRY repetition penalty multiplier (0 = off)."),
    _opt("--dry-base", "dry_base", float, "DRY base value."),
    _opt("--dry-allowed-length", "dry_allowed_length", click.IntRange(min=0), "DRY allowed length."),
    _opt("--dry-penalty-last-n", "dry_penalty_last_n", click.IntRange(min=0), "DRY: tokens scanned (0 = off)."),
    _opt("--dry-sequence-breaker", "dry_sequence_breakers", str, "A DRY sequence breaker (repeatable; the first "
         "clears the defaults; 'none' = no breakers).", _breakers, multiple=True),
    _opt("--mirostat", "mirostat", click.IntRange(0, 2), "Mirostat sampling: 0 = off, 1 = Mirostat, 2 = Mirostat 2.0."),
    _opt("--mirostat-lr", "mirostat_eta", float, "Mirostat learning rate, parameter eta."),
    _opt("--mirostat-ent", "mirostat_tau", float, "Mirostat target entropy, parameter tau."),
    _opt("--adaptive-target", "adaptive_target", float, "adaptive-p: select tokens near this probability "
         "(negative = off; used when --samplers names adaptive_p)."),
    _opt("--adaptive-decay", "adaptive_decay", click.FloatRange(0.0, 0.99), "adaptive-p: EMA decay."),
    _opt("--min-keep", "min_keep", click.IntRange(min=0), "Samplers keep at least this many tokens (0 = off)."),
)


#: adds the options (see the module docstring) to a click command
sampler_options = option_group(list(_OPTIONS))


def sampler_extra(ctx: click.Context | None = None) -> dict:
    """The given options as :class:`~llamaspec.SamplingParams` keyword arguments."""
    ctx = ctx or click.get_current_context()
    return dict(ctx.find_root().meta.get(_KEY, {})) | dict(ctx.meta.get(_KEY, {}))
