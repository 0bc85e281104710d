"""``ngram-lookup``: llamaspec's own n-gram drafter (beyond llama.cpp; not one of its five n-gram types).

What it does, per slot:

1. **Index.** Every n-gram of the history (prompt + committed output) of length ``1..key_max`` is kept in a
   hash map from a 64-bit key to the end position of its *most recent* occurrence. The prompt is indexed
   in one vectorised pass (numpy rolling hashes, ``begin``); after that each new token costs ``key_max``
   dictionary stores (no rescans of the history per round).
2. **Lookup.** The query is the history plus ``id_last`` (the pending token). Keys of growing length are
   looked up until one is missing: the longest suffix that occurred before, at its most recent place. The
   match is then checked token by token (a hash collision never drafts garbage) and extended backwards up
   to ``MATCH_CAP`` tokens: that *match length* says how sure the copy is.
3. **Copy.** The draft is what followed the match, copied as an overlapping copy (LZ77-style): when the
   match ends right before ``id_last``, the draft continues into what it has just drafted, so a loop of
   period ``p`` yields a draft of any length, not only ``p`` tokens.
4. **Length.** Each slot learns, per match-length bucket, the rate at which the first drafted token is
   accepted (``p1``) and the rate at which a later token is accepted when the ones before it were (``q``),
   with decaying counts (so it follows the text) and a prior learned across requests. With ``v(k)`` the
   cost of verifying ``k + 1`` rows relative to one (the engine's measured cost model when it has one,
   else a CPU-like curve), it drafts the ``k`` that maximises ``E(k) / v(k)``,
   ``E(k) = 1 + p1 (1 + q + ... + q^(k-1))``: long drafts while a copy runs, short ones after a miss,
   none when a draft is not expected to pay (after ``explore_every`` skipped rounds it tries a short one,
   and waits twice as long after each try that fails, up to 8x). After ``MISS_STREAK`` drafts in a row
   whose first token failed in one bucket, that bucket's drafts are at most ``MISS_CAP`` tokens until one
   is accepted: the counts' prior keeps ``p1`` from falling below ~0.25 however often the first token fails,
   and with ``q`` high a low ``p1`` still prices long drafts well (a counting list -- every line the last
   one with its number changed -- failed 15-19-token drafts at their first token line after line). The prior is
   moved per slot by what its drafts earned, and rows are priced at their share of a busy round (ngram_rates).
5. **Pool.** Every slot also looks the suffix up in the shared pool of every request's sequences (earlier and
   running ones, one tenant's own unless shared; :mod:`llamaspec.drafters.ngram_pool`); a pool match longer
   than the own one drafts what followed it there, its length from the slot's counts of pool drafts.

>>> d = NgramLookup(1, NgramLookupParams(n_max=8, adaptive=False))
>>> from llamaspec.drafters.base import DraftParams
>>> hist = [5, 1, 2, 3, 4, 9, 9, 1, 2]
>>> d.begin(0, hist)
>>> dp = DraftParams(drafting=True, n_max=8, prompt=hist, id_last=3)
>>> d.draft([dp]); dp.result                    # "1 2 3" occurred at 1..3: copy what followed it
[4, 9, 9, 1, 2, 3, 4, 9]
>>> d.begin(0, [7, 1, 2, 1, 2])
>>> dp = DraftParams(drafting=True, n_max=6, prompt=[7, 1, 2, 1, 2], id_last=1)
>>> d.draft([dp]); dp.result                    # a loop: the overlapping copy continues it
[2, 1, 2, 1, 2, 1]
"""
from __future__ import annotations

import bisect
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from ..adaptive import CostModel, Explorer, default_verify_cost
from ..params import NgramLookupParams
from ._ngram_util import HASH_MUL, MASK64, MATCH_CAP
from .base import DraftParams, Drafter
from .ngram_pool import PoolDrafting, SharedPool
from .ngram_rates import PRIOR_DECAY, PRIOR_WEIGHT, BucketRates, Calibration, shared_cost_table

__all__ = ["NgramLookup", "NgramLookupParams", "best_length_table", "default_verify_cost"]

#: upper bounds of the match-length buckets (a match of length m is in the first bucket with m <= bound)
BUCKETS = (1, 2, 3, 5, 8, 15, MATCH_CAP)
#: the cost table v(0..n_max) is recomputed every this many draft calls
VT_REFRESH = 16
#: consecutive first-token misses in a bucket after which its drafts are capped, and the cap (module docstring)
MISS_STREAK, MISS_CAP = 3, 4
#: prior rate of the first drafted token per bucket, and of a later token given the ones before it (tuned by
#: replaying recorded greedy outputs of Gemma-3-270M on the benchmark prompts with the measured CPU cost
#: curve; each slot then learns its own, and the drafter-wide prior follows what every slot measured)
PRIOR_P1 = (0.35, 0.5, 0.6, 0.7, 0.8, 0.85, 0.95)
PRIOR_Q = (0.7, 0.8, 0.85, 0.9, 0.92, 0.95, 0.98)


def _bucket(m: int) -> int:
    return min(bisect.bisect_left(BUCKETS, m), len(BUCKETS) - 1)


def best_length_table(p1: float, q: float, vt: Sequence[float], k_max: int, floor: float = 1.0) -> int:
    """The draft length in ``0..k_max`` with the most expected tokens ``E(k) = 1 + p1 (1 + q + ... + q^(k-1))`` per
    unit of cost
    ``vt[k]`` (the cost of verifying ``k + 1`` rows; 0: do not draft); a draft must beat ``floor`` tokens per
    unit (1 = a plain step; more when another drafter does better).

    >>> vt = [default_verify_cost(k) for k in range(33)]
    >>> best_length_table(0.2, 0.5, vt, 16)         # a fresh 1-token match rarely pays
    0
    >>> best_length_table(0.95, 0.97, vt, 32) >= 16   # a copy that runs: long drafts
    True
    >>> 1 <= best_length_table(0.6, 0.6, vt, 32) <= 4
    True
    """
    best_k, best = 0, max(floor, 1.0 / max(vt[0], 1e-9)) * (1 + 1e-6)
    total, run = 1.0, p1
    for k in range(1, min(k_max, len(vt) - 1) + 1):
        total += run
        run *= q
        val = total / vt[k]
        if val > best:
            best_k, best = k, val * (1 + 1e-6)
    return best_k


class _Slot:
    """One sequence's history, its n-gram index and its acceptance counts."""

    __slots__ = ("toks", "idx", "counts", "last_bucket", "last_k", "explorer", "k_lim", "miss", "cal", "shadow")

    def __init__(self, key_max: int, k_lim: int = 0, explore_every: int = 8):
        self.toks: list[int] = []
        self.idx: list[dict[int, int]] = [dict() for _ in range(key_max)]
        nb = len(BUCKETS)
        self.counts = BucketRates(nb)  # its own copies' acceptance per bucket
        self.last_bucket = -1
        self.last_k = 0
        #: after ``explore_every`` rounds not paying, a short draft; one that finds nothing looks less often
        #: (up to 8x the interval)
        self.explorer = Explorer(explore_every, backoff=8)
        self.k_lim = k_lim  # the longest draft this slot may risk now (0 = no limit)
        self.miss = [0] * nb  # per bucket: drafts in a row whose first token failed
        self.cal = Calibration()  # this slot's copies against the drafter-wide prior (every bucket's)
        #: a copy not drafted because another drafter's draft was expected to do better: (bucket, where its first
        #: token would sit in ``toks``, the copy); scored against what was committed instead (:meth:`score_shadow`)
        self.shadow: "tuple[int, int, list[int]] | None" = None

    # -- index ----------------------------------------------------------------------------------
    def build(self, tokens: Sequence[int]) -> None:
        """Index ``tokens`` from scratch in one vectorised pass (later occurrences overwrite earlier)."""
        key_max = len(self.idx)
        self.toks = [int(t) for t in tokens]
        self.idx = [dict() for _ in range(key_max)]
        n = len(self.toks)
        if n == 0:
            return
        arr = np.asarray(self.toks, dtype=np.uint64) + np.uint64(1)
        h = np.zeros(n, dtype=np.uint64)
        mul = np.uint64(HASH_MUL)
        pos = np.arange(n)
        with np.errstate(over="ignore"):
            for j in range(min(key_max, n)):
                # key of length j+1 ending at e: tokens e, e-1, ..., e-j folded in that order
                h[j:] = h[j:] * mul + arr[: n - j]
                self.idx[j] = dict(zip(h[j:].tolist(), pos[j:].tolist()))

    def append(self, tokens: Sequence[int]) -> None:
        """Add tokens at the end: ``key_max`` dictionary stores per token."""
        toks, idx = self.toks, self.idx
        key_max = len(idx)
        for t in tokens:
            toks.append(int(t))
            e = len(toks) - 1
            h = 0
            for j in range(min(key_max, e + 1)):
                h = (h * HASH_MUL + toks[e - j] + 1) & MASK64
                idx[j][h] = e

    def sync(self, prompt: Sequence[int]) -> None:
        """Bring the index up to ``prompt`` (the slot's committed tokens): append what is new, rebuild when
        the history changed under it (a new request, a reset)."""
        n, toks = len(prompt), self.toks
        m = len(toks)
        if m == n and (m == 0 or toks[-1] == prompt[-1]):
            return
        if m < n and (m == 0 or toks[-1] == prompt[m - 1]):
            self.append(prompt[m:])
            return
        self.build(prompt)

    # -- lookup ---------------------------------------------------------------------------------
    def match(self, id_last: int) -> tuple[int, int]:
        """``(end, length)`` of the longest earlier occurrence of the suffix ``toks + [id_last]`` (most
        recent place; ``length`` verified and extended up to MATCH_CAP), or ``(-1, 0)``."""
        toks, idx = self.toks, self.idx
        n = len(toks)
        h, e_best = 0, -1
        for j in range(min(len(idx), n)):
            t = id_last if j == 0 else toks[n - j]
            h = (h * HASH_MUL + t + 1) & MASK64
            e = idx[j].get(h)
            if e is None:
                break
            e_best = e
        if e_best < 0:
            return -1, 0
        # verify (hash keys) and extend backwards: position n is id_last, the query's end
        if toks[e_best] != id_last:
            return -1, 0
        m = 1
        lim = min(MATCH_CAP, e_best + 1)
        while m < lim and toks[e_best - m] == toks[n - m]:
            m += 1
        return e_best, m  # (m < k_best only after a hash collision on a longer key: m is what was verified)

    def copy(self, e: int, id_last: int, k: int) -> list[int]:
        """``k`` tokens of what followed position ``e`` (overlapping copy over ``toks + [id_last] + draft``)."""
        toks = self.toks
        n = len(toks)
        src = e + 1
        if src + k <= n:
            return toks[src: src + k]
        out = toks[src:n] + [id_last]
        period = n + 1 - src  # the copy reads what it wrote: a loop of this period
        while len(out) < k:
            out.append(out[len(out) - period])
        return out[:k]

    def score_shadow(self, prompt: Sequence[int], id_last: int, decay: float) -> None:
        """Count the copy that was not drafted as if it had been: the tokens committed since agree with it for
        as many tokens as it would have had accepted (or more, where the target's correction token matches
        too: counted at that, the low side). Without it a copy that loses once to a draft model's expected
        gain on the drafter-wide prior is never drafted again in the request, however well it would copy."""
        b, at, draft = self.shadow
        self.shadow = None
        new = list(prompt[at:at + len(draft)])
        if len(new) < len(draft):
            new.append(id_last)
        n_acc = 0
        while n_acc < min(len(new), len(draft)) and new[n_acc] == draft[n_acc]:
            n_acc += 1
        self.counts.observe(b, len(draft), n_acc, decay)

    # -- acceptance counts ------------------------------------------------------------------------
    def rates(self, b: int, prior: tuple[float, float], w: float) -> tuple[float, float]:
        """Bucket ``b``'s ``(p1, q)``: its counts shrunk toward the bucket's drafter-wide ``prior`` as the slot's
        calibration moves it."""
        return self.counts.shrunk(b, self.cal.prior(*prior), w)


class NgramLookup(Drafter):
    """llamaspec's n-gram drafter (module docstring).

    Beyond the drafter protocol, for the chain of ``auto`` (:mod:`llamaspec.auto`):

    - :meth:`use_cost_model`: take ``v(k)`` from a measured cost model (default: a CPU-like curve);
    - ``gain_floor(seq_id)``: the tokens per unit cost a draft must beat on that slot (default 1, a plain
      step; ``auto`` sets the draft model's expected gain);
    - :meth:`set_k_start`: limit each slot's first drafts;
    - ``skips`` counts the rounds it did not draft, by reason: ``no-match`` (no earlier occurrence of even
      the last token), ``not-paying`` (a match whose expected gain at the measured acceptance and cost is
      below the floor); ``n_explore`` the short drafts it tried anyway to look again.
    """

    type = "ngram-lookup"

    def __init__(self, n_seq: int, params: NgramLookupParams | None = None):
        super().__init__(n_seq)
        p = replace(params) if params is not None else NgramLookupParams()
        if p.n_max < 0:
            raise ValueError(f"ngram-lookup n_max must be >= 0, got {p.n_max}")
        if p.key_max < 1:
            raise ValueError(f"ngram-lookup key_max must be >= 1, got {p.key_max}")
        self.params = p
        self.n_max = p.n_max
        self._slots = [_Slot(p.key_max, p.k_start, p.explore_every) for _ in range(n_seq)]
        #: drafter-wide acceptance (a prior for new requests): decayed counts per bucket
        self._prior = BucketRates(len(BUCKETS), PRIOR_P1, PRIOR_Q, PRIOR_WEIGHT)
        #: v(k) relative to a one-row decode (:meth:`use_cost_model` hands a measured one over)
        self.verify_cost: Callable[[int], float] = default_verify_cost
        #: per slot, the tokens per unit cost a draft must beat (auto: the draft model's measured gain)
        self.gain_floor: Callable[[int], float] = lambda seq_id: 1.0
        self._vt: dict[int, list[float]] = {}  # cost tables by the number of slots drafting in the round
        self._vt_age = 0
        #: rounds without a draft, by reason (class docstring)
        self.skips: dict[str, int] = {"no-match": 0, "not-paying": 0}
        #: short drafts tried where none was expected to pay (to look again)
        self.n_explore = 0
        #: copies scored without being drafted (another drafter was expected to do better: _Slot.score_shadow)
        self.n_shadow = 0
        #: the shared pool of every request's sequences (:mod:`llamaspec.drafters.ngram_pool`; None: off)
        #: (a short match in everything the server saw is likelier chance than one in the request's own text:
        #: its prior starts at half the own one until the pool's drafts have been measured)
        self.pool = (PoolDrafting(n_seq, SharedPool(p.pool_tokens, p.pool_shared),
                                  [x * (0.5 if m <= 5 else 1.0) for m, x in zip(BUCKETS, PRIOR_P1)], PRIOR_Q)
                     if p.pool_tokens > 0 else None)

    def use_cost_model(self, cost_model: CostModel) -> None:
        """Take ``v(k)`` from an online cost model (``auto``'s :class:`~llamaspec.adaptive.CostModel`)."""
        self.verify_cost = cost_model.verify_cost
        self._vt = {}

    def _cost_table(self, n_slots: int = 1) -> list[float]:
        """A draft's cost by length with ``n_slots`` drafting (ngram_rates.shared_cost_table; ``v(0..n_max)``
        for one), recomputed every ``VT_REFRESH`` draft calls (the costs move slowly)."""
        if self._vt_age >= VT_REFRESH:
            self._vt = {}
            self._vt_age = 0
        self._vt_age += 1
        vt = self._vt.get(n_slots)
        if vt is None:
            vt = self._vt[n_slots] = shared_cost_table(self.verify_cost, self.n_max, n_slots)
        return vt

    # -- protocol ---------------------------------------------------------------------------------
    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        """A new request: index its prompt; the slot's acceptance counts start again from the drafter-wide
        prior (what earlier requests measured)."""
        st = _Slot(self.params.key_max, self.params.k_start, self.params.explore_every)
        st.build(prompt)
        self._slots[seq_id] = st
        if self.pool is not None:
            self.pool.begin(seq_id, st.toks)

    def set_owner(self, seq_id: int, owner: str) -> None:
        if self.pool is not None:
            self.pool.set_owner(seq_id, owner)

    def reset(self, seq_id: int) -> None:
        self._slots[seq_id] = _Slot(self.params.key_max, self.params.k_start, self.params.explore_every)
        if self.pool is not None:
            self.pool.end(seq_id)

    def set_k_start(self, k: int) -> None:
        """Limit each slot's first drafts to ``k`` tokens (``NgramLookupParams.k_start``)."""
        self.params.k_start = k
        for st in self._slots:
            st.k_lim = k

    def draft(self, params: Sequence[DraftParams]) -> None:
        p = self.params
        n_slots = sum(1 for dp in params if dp.drafting)  # the slots whose rows share this round's decode
        for seq_id, dp in enumerate(params):
            if not dp.drafting:
                continue
            st = self._slots[seq_id]
            st.last_bucket, st.last_k = -1, 0
            st.sync(dp.prompt)
            if st.shadow is not None:
                if st.shadow[1] < len(st.toks):  # something was committed since: score it
                    st.score_shadow(st.toks, dp.id_last, p.decay)
                else:
                    st.shadow = None
            if self.pool is not None:
                self.pool.sync(seq_id, st.toks)
            k_cap = self.n_max if dp.n_max < 0 else min(self.n_max, dp.n_max)
            if st.k_lim > 0:
                k_cap = min(k_cap, st.k_lim)
            if k_cap <= 0:
                continue
            e, m = st.match(dp.id_last)
            hit = self.pool.match(seq_id, st.toks, dp.id_last, m) if self.pool is not None else None
            if e < 0 and hit is None:
                self.skips["no-match"] += 1
                continue
            b = _bucket(m)
            if p.adaptive:
                k = 0
                if hit is not None:  # the pool matches longer: its own counts decide
                    bp = _bucket(hit[2])
                    p1, q = self.pool.rates(seq_id, bp, p.prior_weight)
                    k = best_length_table(p1, q, self._cost_table(n_slots), k_cap, floor=self.gain_floor(seq_id))
                    hit, b = (hit, bp) if k > 0 or e < 0 else (None, b)
                if hit is None:
                    p1, q = st.rates(b, self._prior.mean(b), p.prior_weight)
                    vt, floor = self._cost_table(n_slots), self.gain_floor(seq_id)
                    k = best_length_table(p1, q, vt, k_cap, floor=floor)
                    if k == 0 and floor > 1.0:
                        k_plain = best_length_table(p1, q, vt, k_cap)
                        if k_plain > 0:  # it would beat a plain step: learn what it would have done
                            st.shadow = (b, len(st.toks) + 1, st.copy(e, dp.id_last, k_plain))
                            self.n_shadow += 1
                    if st.miss[b] >= MISS_STREAK:
                        k = min(k, MISS_CAP)
                if k == 0:
                    if not st.explorer.idle():
                        self.skips["not-paying"] += 1
                        continue
                    k = min(2, k_cap)  # look again: the text may have changed
                    self.n_explore += 1
                st.explorer.drafted()
            else:
                k, b = k_cap, (_bucket(hit[2]) if hit is not None else b)
            if dp.n_min is not None and k < dp.n_min:
                continue
            dp.result.extend(self.pool.copy(seq_id, hit, k) if hit is not None else st.copy(e, dp.id_last, k))
            st.last_bucket, st.last_k = b, len(dp.result)

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        st, p = self._slots[seq_id], self.params
        b, k = st.last_bucket, st.last_k
        st.last_bucket, st.last_k = -1, 0
        # a pool draft is counted apart from the slot's own copies
        from_pool = not is_other and self.pool is not None and self.pool.accept(seq_id, b, k, n_accepted, p.decay)
        if is_other or b < 0 or k <= 0:
            return
        if not from_pool:
            st.cal.update(k, n_accepted, *self._prior.mean(b), p.decay)
            st.counts.observe(b, k, n_accepted, self.params.decay)
            st.miss[b] = st.miss[b] + 1 if n_accepted == 0 else 0
        if st.k_lim > 0:
            if n_accepted >= k and k >= st.k_lim:
                st.k_lim = min(2 * st.k_lim, max(self.n_max, 1))
            elif 2 * n_accepted < k:
                st.k_lim = max(self.params.k_start, st.k_lim // 2)
        st.explorer.result(n_accepted)
        if from_pool:
            return
        self._prior.observe(b, k, n_accepted, PRIOR_DECAY)  # the drafter-wide prior follows every slot slowly
