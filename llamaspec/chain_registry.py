"""The drafter registry and the chain's construction (llama.cpp's ``common_speculative_init``, §3.1).

:data:`FACTORIES` maps each speculative type to the constructor of its drafter; :func:`build_chain` builds
the enabled drafters in priority order and hands them to the relay (:class:`llamaspec.chain.Chain`), or, for
``--spec-type auto``, to :func:`llamaspec.auto.build_auto_chain`. Drafter modules are imported when their
type is built (a chain of n-gram drafters loads no model code).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from .auto import build_auto_chain
from .chain import Chain
from .drafters.base import Drafter
from .errors import UsageError
from .params import SpecParams, SpecType

if TYPE_CHECKING:  # pragma: no cover
    from . import _llama as llama
    from .adaptive import CostModel
    from .drafters.ngram_lookup import NgramLookup

__all__ = ["FACTORIES", "Factory", "build_chain"]

Factory = Callable[[SpecParams, int, "llama.Context", "llama.Context | None"], Drafter]


def _ngram_simple(p: SpecParams, n_seq: int, ctx_tgt, ctx_dft) -> Drafter:
    from .drafters.ngram_simple import NgramSimple

    return NgramSimple(n_seq, p.ngram_simple, fix_quirks=p.ngram_fix_quirks)


def _ngram_map_k(p: SpecParams, n_seq: int, ctx_tgt, ctx_dft) -> Drafter:
    from .drafters.ngram_map import NgramMapK

    return NgramMapK(n_seq, p.ngram_map_k, fix_quirks=p.ngram_fix_quirks)


def _ngram_map_k4v(p: SpecParams, n_seq: int, ctx_tgt, ctx_dft) -> Drafter:
    from .drafters.ngram_map import NgramMapK4V

    return NgramMapK4V(n_seq, p.ngram_map_k4v, fix_quirks=p.ngram_fix_quirks)


def _ngram_mod(p: SpecParams, n_seq: int, ctx_tgt, ctx_dft) -> Drafter:
    from .drafters.ngram_mod import NgramMod

    return NgramMod(n_seq, p.ngram_mod, fix_quirks=p.ngram_fix_quirks)


def _ngram_cache(p: SpecParams, n_seq: int, ctx_tgt, ctx_dft) -> Drafter:
    from .drafters.ngram_cache import NgramCache

    return NgramCache(n_seq, p.ngram_cache, fix_quirks=p.ngram_fix_quirks)


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


def _head_ctx(name: str, ctx_dft):
    if ctx_dft is None:
        raise UsageError(f"{name} needs its head GGUF as the draft model: pass --draft-model (-md) PATH")
    return ctx_dft


def _draft_eagle3(p: SpecParams, n_seq: int, ctx_tgt, ctx_dft) -> Drafter:
    from .drafters.eagle3 import Eagle3

    return Eagle3(n_seq, p.draft, ctx_tgt, _head_ctx("draft-eagle3", ctx_dft))


def _draft_dflash(p: SpecParams, n_seq: int, ctx_tgt, ctx_dft) -> Drafter:
    from .drafters.dflash import DFlash

    return DFlash(n_seq, p.draft, ctx_tgt, _head_ctx("draft-dflash", ctx_dft))


def _draft_dspark(p: SpecParams, n_seq: int, ctx_tgt, ctx_dft) -> Drafter:
    from .drafters.dflash import DFlash

    return DFlash(n_seq, p.draft, ctx_tgt, _head_ctx("draft-dspark", ctx_dft), dspark=True)


def _ngram_lookup(p: SpecParams, n_seq: int, ctx_tgt, ctx_dft) -> "NgramLookup":
    from .adaptive import CostModel
    from .drafters.ngram_lookup import NgramLookup

    return NgramLookup(n_seq, p.ngram_lookup)


FACTORIES: dict[SpecType, Factory] = {
    SpecType.NGRAM_LOOKUP: _ngram_lookup,
    SpecType.NGRAM_SIMPLE: _ngram_simple,
    SpecType.NGRAM_MAP_K: _ngram_map_k,
    SpecType.NGRAM_MAP_K4V: _ngram_map_k4v,
    SpecType.NGRAM_MOD: _ngram_mod,
    SpecType.NGRAM_CACHE: _ngram_cache,
    SpecType.DRAFT_SIMPLE: _draft_simple,
    SpecType.DRAFT_MTP: _draft_mtp,
    SpecType.DRAFT_EAGLE3: _draft_eagle3,
    SpecType.DRAFT_DFLASH: _draft_dflash,
    SpecType.DRAFT_DSPARK: _draft_dspark,
}


def build_chain(params: SpecParams, n_seq: int, ctx_tgt: "llama.Context", ctx_dft: "llama.Context | None",
                cost_model: "CostModel | None" = None) -> Chain | None:
    """Instantiate the enabled drafters in priority order; ``None`` when nothing is enabled. ``cost_model``:
    the engine's (the drafters that price their own drafts read it).

    ``auto`` (beyond llama.cpp, :mod:`llamaspec.auto`): ngram-lookup, then the draft model when there is a
    draft context, handed to :func:`~llamaspec.auto.build_auto_chain`. Any constructor error aborts the
    whole chain (as in llama.cpp), with the drafter's own message; what was built is closed.
    """
    impls: list[Drafter] = []
    try:
        if params.is_auto:
            ngram = _ngram_lookup(params, n_seq, ctx_tgt, ctx_dft)
            impls.append(ngram)
            draft = _draft_simple(params, n_seq, ctx_tgt, ctx_dft) if ctx_dft is not None else None
            if draft is not None:
                impls.append(draft)
            return build_auto_chain(ngram, draft, n_seq, cost=cost_model, adaptive=params.draft_adaptive_on())
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
