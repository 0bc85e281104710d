"""The chain of drafters (llama.cpp's ``common_speculative``, spec §3).

Drafters run in priority order (spec §3.1). ``draft()`` relays the ``drafting`` flag: the first drafter that
returns a non-empty draft for a sequence wins it for this round; lower-priority drafters are not asked for
that sequence. ``accept()`` credits the drafter that produced the sequence's last draft (``impl_last``) and
tells every other drafter with ``is_other=True``.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Callable, Sequence

from .drafters.base import DraftParams, Drafter
from .errors import UsageError
from .params import SpecParams, SpecType
from .stats import Timer

if TYPE_CHECKING:  # pragma: no cover
    from . import _llama as llama

log = logging.getLogger("llamaspec")


class Chain:
    def __init__(self, impls: Sequence[Drafter], n_seq: int):
        if not impls:
            raise UsageError("a speculative chain needs at least one drafter")
        self.impls = list(impls)
        self.n_seq = n_seq
        self.impl_last: list[Drafter | None] = [None] * n_seq
        self.dparams = [DraftParams() for _ in range(n_seq)]

    @property
    def n_max(self) -> int:
        return max(max(0, d.n_max) for d in self.impls)

    @property
    def types(self) -> list[str]:
        return [d.type for d in self.impls]

    # -- protocol -------------------------------------------------------------------------------
    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        for d in self.impls:
            with Timer(d.stats, "t_begin_us"):
                d.begin(seq_id, prompt)
            d.stats.n_call_begin += 1

    def process(self, rows: "Sequence[llama.Row]") -> bool:
        for d in self.impls:
            if not d.process(rows):
                return False
        return True

    def draft(self, params: Sequence[DraftParams] | None = None) -> None:
        """Relay of the drafting flag (spec §3.2) over ``params`` (default: the chain's own, by seq id)."""
        params = self.dparams if params is None else params
        drafting = [dp for dp in params if dp.drafting]
        for dp in drafting:
            if dp.result:
                raise AssertionError("draft result must be empty when drafting starts")
        if not drafting:
            return
        for d in self.impls:
            with Timer(d.stats, "t_draft_us"):
                d.draft(params)
            d.stats.n_call_draft += 1
            still = False
            for seq_id, dp in enumerate(params):
                if not dp.drafting:
                    continue
                if dp.result:
                    dp.drafting = False
                    if dp.n_max > 0 and len(dp.result) > dp.n_max:
                        del dp.result[dp.n_max :]
                        if dp.probs is not None:
                            del dp.probs[dp.n_max :]
                    self.impl_last[seq_id] = d
                    d.stats.n_gen_drafts += 1
                    d.stats.n_gen_tokens += len(dp.result)
                else:
                    still = True
            if not still:
                break
        for dp in params:
            dp.drafting = False

    def accept(self, seq_id: int, n_accepted: int) -> None:
        impl = self.impl_last[seq_id]
        if impl is None:
            assert n_accepted == 0, "accepted tokens without a drafter"
            return
        st = impl.stats
        with Timer(st, "t_accept_us"):
            per = st.n_acc_tokens_per_pos
            if len(per) < n_accepted:
                per.extend([0] * (n_accepted - len(per)))
            for i in range(n_accepted):
                per[i] += 1
            if n_accepted > 0:
                st.n_acc_drafts += 1
                st.n_acc_tokens += n_accepted
            impl.accept(seq_id, n_accepted, False)
            st.n_call_accept += 1
        for d in self.impls:
            if d is not impl:
                d.accept(seq_id, n_accepted, True)

    def configure_sampling(self, seq_id: int, temp: float, seed: int) -> None:
        for d in self.impls:
            d.configure_sampling(seq_id, temp, seed)

    def reset(self, seq_id: int) -> None:
        """After an error or a cancel: clear the sequence's draft request and every drafter's caches."""
        dp = self.dparams[seq_id]
        dp.drafting, dp.result, dp.probs = False, [], None
        self.impl_last[seq_id] = None
        for d in self.impls:
            d.reset(seq_id)

    def get_state(self, seq_id: int) -> bytes | None:
        for d in self.impls:
            s = d.get_state(seq_id)
            if s is not None:
                return s
        return None

    def set_state(self, seq_id: int, data: bytes) -> None:
        for d in self.impls:
            d.set_state(seq_id, data)

    # -- reporting ------------------------------------------------------------------------------
    def stats_lines(self) -> list[str]:
        return [d.stats.stats_line(d.type) for d in self.impls]

    def stats_dicts(self) -> list[dict]:
        return [{"type": d.type, **d.stats.to_dict()} for d in self.impls]

    def close(self) -> None:
        for d in self.impls:
            d.close()


# ---------------------------------------------------------------------------------------------------
# construction
# ---------------------------------------------------------------------------------------------------

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


def _ngram_lookup(p: SpecParams, n_seq: int, ctx_tgt, ctx_dft) -> Drafter:
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


def build_chain(params: SpecParams, n_seq: int, ctx_tgt: "llama.Context", ctx_dft: "llama.Context | None") -> Chain | None:
    """Instantiate the enabled drafters in priority order; ``None`` when nothing is enabled.

    Any constructor error aborts the whole chain (as in llama.cpp), with the drafter's own message.
    """
    if params.is_auto:  # beyond llama.cpp: the drafters that pay, per slot (llamaspec.auto)
        from .auto import build_auto_chain

        return build_auto_chain(params, n_seq, ctx_tgt, ctx_dft)
    impls: list[Drafter] = []
    try:
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
