"""The drafter registry and the chain's construction (llama.cpp's ``common_speculative_init``, §3.1).

:data:`FACTORIES` maps each speculative type to the constructor of its drafter; :func:`build_chain` builds
the enabled drafters in priority order and hands them to the relay (:class:`llamaspec.chain.Chain`), or, for
``--spec-type auto``, to :class:`llamaspec.auto.AutoChain`. The model drafters' modules are imported
when their type is built (a chain of n-gram drafters loads none of them).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from .auto import AutoChain
from .chain import Chain
from .drafters.base import Drafter
from .drafters.ngram_cache import NgramCache
from .drafters.ngram_lookup import NgramLookup
from .drafters.ngram_map import NgramMapK, NgramMapK4V
from .drafters.ngram_mod import NgramMod
from .drafters.ngram_simple import NgramSimple
from .errors import UsageError
from .params import SpecParams, SpecType

if TYPE_CHECKING:  # pragma: no cover
    from . import _llama as llama
    from .adaptive import CostModel

__all__ = ["FACTORIES", "Factory", "build_chain"]

Factory = Callable[[SpecParams, int, "llama.Context", "llama.Context | None"], Drafter]


def _ngram(kind: type, field: str) -> Factory:
    """The factory of one of llama.cpp's n-gram drafters: ``kind`` with its ``SpecParams`` part ``field`` and the
    QUIRK fixes."""
    return lambda p, n_seq, ctx_tgt, ctx_dft: kind(n_seq, getattr(p, field), fix_quirks=p.ngram_fix_quirks)


def _head(name: str, **kw) -> Factory:
    """The factory of a drafter on a head GGUF given as the draft model (EAGLE-3, DFlash, DSpark)."""
    def make(p: SpecParams, n_seq: int, ctx_tgt, ctx_dft) -> Drafter:
        if ctx_dft is None:
            raise UsageError(f"{name} needs its head GGUF as the draft model: pass --draft-model (-md) PATH")
        if name == "draft-eagle3":
            from .drafters.eagle3 import Eagle3 as kind
        else:
            from .drafters.dflash import DFlash as kind
        return kind(n_seq, p.draft, ctx_tgt, ctx_dft, **kw)

    return make


def _draft_simple(p: SpecParams, n_seq: int, ctx_tgt, ctx_dft) -> Drafter:
    from .drafters.draft_model import DraftSimple

    if ctx_dft is None:
        raise UsageError("draft-simple needs a draft model: pass --draft-model (-md) NAME|PATH")
    return DraftSimple(n_seq, dataclasses.replace(p.draft, reuse_kv=p.draft_reuse_kv()), ctx_tgt, ctx_dft)


def _draft_mtp(p: SpecParams, n_seq: int, ctx_tgt, ctx_dft) -> Drafter:
    from . import _llama as llama
    from .drafters.mtp import DraftMTP

    if ctx_dft is None or ctx_dft.params.ctx_type != llama.CONTEXT_TYPE_MTP:
        raise UsageError("draft-mtp needs an MTP context on the target (a model with nextn layers, loaded with "
                         "load_mtp) or on an MTP GGUF given with --draft-model (-md)")
    return DraftMTP(n_seq, p.draft, ctx_tgt, ctx_dft)


FACTORIES: dict[SpecType, Factory] = {
    SpecType.NGRAM_LOOKUP: lambda p, n_seq, ctx_tgt, ctx_dft: NgramLookup(n_seq, p.ngram_lookup),
    SpecType.NGRAM_SIMPLE: _ngram(NgramSimple, "ngram_simple"),
    SpecType.NGRAM_MAP_K: _ngram(NgramMapK, "ngram_map_k"),
    SpecType.NGRAM_MAP_K4V: _ngram(NgramMapK4V, "ngram_map_k4v"),
    SpecType.NGRAM_MOD: _ngram(NgramMod, "ngram_mod"),
    SpecType.NGRAM_CACHE: _ngram(NgramCache, "ngram_cache"),
    SpecType.DRAFT_SIMPLE: _draft_simple,
    SpecType.DRAFT_MTP: _draft_mtp,
    SpecType.DRAFT_EAGLE3: _head("draft-eagle3"),
    SpecType.DRAFT_DFLASH: _head("draft-dflash"),
    SpecType.DRAFT_DSPARK: _head("draft-dspark", dspark=True),
}


def build_chain(params: SpecParams, n_seq: int, ctx_tgt: "llama.Context", ctx_dft: "llama.Context | None",
                cost_model: "CostModel | None" = None) -> Chain | None:
    """Instantiate the enabled drafters in priority order; ``None`` when nothing is enabled. ``cost_model``:
    the engine's (the drafters that price their own drafts read it).

    ``auto`` (beyond llama.cpp, :mod:`llamaspec.auto`): ngram-lookup, then the draft model when there is a
    draft context, handed to :class:`~llamaspec.auto.AutoChain`. Any constructor error aborts the
    whole chain (as in llama.cpp), with the drafter's own message; what was built is closed.
    """
    impls: list[Drafter] = []
    try:
        if params.is_auto:
            ngram = NgramLookup(n_seq, params.ngram_lookup)
            impls.append(ngram)
            draft = _draft_simple(params, n_seq, ctx_tgt, ctx_dft) if ctx_dft is not None else None
            if draft is not None:
                impls.append(draft)
            return AutoChain(ngram, draft, n_seq, cost=cost_model, adaptive=params.draft_adaptive_on())
        for t in params.enabled():
            f = FACTORIES.get(t)
            if f is None:
                raise UsageError(f"speculative type {t.type_name!r} is not implemented in this version of llamaspec")
            impls.append(f(params, n_seq, ctx_tgt, ctx_dft))
    except BaseException:
        for d in impls:
            d.close()
        raise
    return Chain(impls, n_seq) if impls else None
