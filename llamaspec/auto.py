"""``--spec-type auto`` (beyond llama.cpp): the drafters that pay, chosen per slot from what was measured.

The chain of ``auto`` is ``ngram-lookup`` first (:mod:`llamaspec.drafters.ngram_lookup`: it drafts when its
lookups hit and the expected gain pays, and chooses its own length), then the draft model (``draft-simple``)
when there is one. Speculation that loses is switched off for that slot and tried again later:

* **Costs** come from the engine's one cost model (:class:`~llamaspec.adaptive.CostModel`, in units of one
  single-row target decode): ``v(k)``, the verification decode by row count as the round measures it, and
  for the draft model its drafting time per drafted token (``c``, from its statistics) plus its per-round
  ``process`` time.
* **Gain** of a drafter on a slot: over its recent rounds on that slot (decaying sums), tokens per round
  ``1 + accepted`` against the cost ``v(k) + k c + p`` of a round of their mean length ``k``, priced with the
  costs measured *now* (``c`` and ``p`` are medians of the last rounds' drafting and ``process`` times): what
  the text allows is kept apart from what the machine allows, so a slow window moves the price, not what was
  learned about acceptance. Below ``1 - margin`` (it loses against a plain step) the drafter is switched off
  for the slot for ``backoff`` rounds, doubling each time it fails again (up to ``backoff_max``, 32 rounds),
  back to the start value when it pays. Whether speculating pays at all under the machine's current load is
  the referee's question (:mod:`llamaspec.referee`: delivered tokens per second against plain rounds).
* **Catching up.** The draft context mirrors only the batches that verify its own drafts, so a new prompt (or
  rounds it did not draft in) must be decoded into it before it drafts again. With several slots generating,
  that catch-up stalls the whole batch: a slot drafts with the model only when its catch-up costs less than
  what the model's drafts save it over the tokens its request has left (:mod:`llamaspec.catch_up`).
* ``ngram-lookup`` gates itself the same way at each lookup (its expected gain from its per-slot acceptance
  by match length and the same ``v(k)``); it gets the cost model of the auto chain. With a draft model after
  it, its draft must beat the draft model's expected gain on that slot (the slot's own measure, or every
  slot's together until the slot has one: a new request does not start from "anything beats plain"), and a
  slot's first n-gram drafts are at most ``AUTO_NGRAM_K_START`` tokens, doubling with each copy accepted whole
  (a failed long copy costs a round the draft model would have used well).

The statistics (``stats_dicts`` / ``stats_lines``) add, per drafter, why it did not draft: ``no-match`` /
``not-paying`` (ngram-lookup) and ``gated`` rounds, ``n_gate_off`` (times it was switched off),
``catch_up_skipped`` (slot rounds whose catch-up did not pay) and the last measured gain (draft model).

>>> g = SlotGate()
>>> for _ in range(4):
...     g.record(1.0 + 0.0, 3)            # nothing of a 3-token draft accepted
>>> cost = lambda k: 1.0 + 0.2 * k        # a round of k drafted tokens costs 1 + 0.2 k plain steps
>>> g.gain(cost) < 0.7, g.should_stop(min_rounds=3, margin=0.02, round_cost=cost)
(True, True)
"""
from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from . import catch_up
from .adaptive import CostModel, DraftLengthController
from .chain import Chain
from .drafters.base import DraftParams, Drafter
from .drafters.ngram_lookup import NgramLookup


log = logging.getLogger("llamaspec")

#: decay per round of a drafter's all-slots gain (``GatedDrafter.overall``): it follows the last ~20 rounds
OVERALL_DECAY = 0.95
#: ngram-lookup's first-draft limit per slot (NgramLookupParams.k_start) when a draft model follows it
AUTO_NGRAM_K_START = 8


@dataclass
class GateParams:
    #: rounds a slot drafts with a drafter before the gate may judge it
    min_rounds: int = 3
    #: switched off when the measured gain is below 1 - margin
    margin: float = 0.03
    #: rounds off after the first failure; doubles on each further failure (at most ``backoff_max``: a drafter
    #: that a slow window made look poor is back within that many rounds)
    backoff: int = 8
    backoff_max: int = 32
    #: decay of the per-slot sums per recorded round
    decay: float = 0.85


#: rounds of drafting time and ``process`` time whose median prices a drafted token (robust to a slow round)
COST_WINDOW = 16


class SlotGate:
    """One drafter on one slot: what the text allows (decaying sums of tokens per round, ``1 + accepted``, and
    of the draft lengths asked) kept apart from what the machine allows (the cost of a round, priced at judging
    time from the current measured costs). A slow window of rounds therefore moves the cost, never what was
    learned about acceptance; and the back-off."""

    __slots__ = ("tokens", "drafted", "weight", "n_rounds", "off_rounds", "backoff")

    def __init__(self, backoff: int = 8):
        #: decaying sum of tokens per round (``1 + accepted``)
        self.tokens = 0.0
        #: decaying sum of the rounds' draft lengths
        self.drafted = 0.0
        #: decaying count of the rounds
        self.weight = 0.0
        #: rounds recorded since the last restart
        self.n_rounds = 0
        #: rounds left switched off
        self.off_rounds = 0
        #: rounds off at the next failure
        self.backoff = backoff

    def record(self, tokens: float, k: int, decay: float = 0.85) -> None:
        self.tokens = self.tokens * decay + tokens
        self.drafted = self.drafted * decay + k
        self.weight = self.weight * decay + 1.0
        self.n_rounds += 1

    def gain(self, round_cost: "Callable[[float], float]") -> float:
        """Tokens per round over ``round_cost(k)``, the cost of a round drafting the mean length ``k`` (in
        one-row target decodes): relative to plain decoding (1 token per unit); 1 with nothing recorded.

        >>> g = SlotGate(); [g.record(4.0, 3) for _ in range(3)] and None
        >>> round(g.gain(lambda k: 1.0 + 0.2 * k), 2)       # 4 tokens for 1.6 units
        2.5
        """
        if self.weight <= 0:
            return 1.0
        return (self.tokens / self.weight) / max(round_cost(self.drafted / self.weight), 1e-9)

    def should_stop(self, min_rounds: int, margin: float, round_cost: "Callable[[float], float]") -> bool:
        return self.n_rounds >= min_rounds and self.gain(round_cost) < 1.0 - margin

    def restart(self) -> None:
        """After a back-off: judged afresh on the next rounds (the acceptance sums are kept, halved)."""
        self.tokens, self.drafted, self.weight = self.tokens / 2, self.drafted / 2, self.weight / 2
        self.n_rounds = 0


def _median_ms(window: "deque[float]") -> float:
    return statistics.median(window) if window else 0.0


class GatedDrafter(Drafter):
    """A drafter (the draft model) behind the auto gate: for a slot that is switched off it is not asked to
    draft (the chain then sees no draft from it); everything else goes straight to it. ``type``, ``stats``,
    ``n_max`` and ``reuse_kv`` are the inner drafter's, so the statistics keep llama.cpp's names.

    ``cost`` is the auto chain's cost model (it prices the rounds), ``gate`` its gate settings; ``adaptive``:
    each slot's draft length is chosen by a :class:`~llamaspec.adaptive.DraftLengthController`."""

    def __init__(self, inner: Drafter, cost: CostModel, gate: GateParams, *, adaptive: bool = False):
        self.inner = inner
        self.cost = cost
        self.gate = gate
        self.n_seq = inner.n_seq
        self.stats = inner.stats
        self.gates = [SlotGate(gate.backoff) for _ in range(inner.n_seq)]
        #: every slot's rounds together (a slower decay): the drafter's gain before a slot has measured its own
        self.overall = SlotGate(gate.backoff)
        self._k = [0] * inner.n_seq  # length of this round's draft per slot (0 = none)
        #: the last COST_WINDOW times of process() per call and of one drafting step (their medians price a round)
        self._process_ms: deque[float] = deque(maxlen=COST_WINDOW)
        self._step_ms: deque[float] = deque(maxlen=COST_WINDOW)
        self.n_gate_off = 0
        self.n_gated = 0  # rounds a slot was not asked because it was switched off
        self.last_gain: float | None = None
        #: per slot, the draft length that pays best now (llamaspec.adaptive; None = the fixed n_max)
        self.lengths: list[DraftLengthController | None] = [None] * inner.n_seq
        self.adaptive = adaptive
        #: generating slots in this round (the chain's, set before each draft)
        self.n_gen = 1
        #: the last COST_WINDOW catch-ups' time per row (ms), and the slots whose catch-up did not pay last round
        self.row_ms: deque[float] = deque(maxlen=COST_WINDOW)
        self._no_catch_up = [False] * inner.n_seq
        self.n_catch_up_skipped = 0

    @property
    def type(self) -> str:
        """The inner drafter's type name."""
        return self.inner.type

    @property
    def n_max(self) -> int:
        """The inner drafter's maximum draft length."""
        return self.inner.n_max

    @n_max.setter
    def n_max(self, value: int) -> None:
        self.inner.n_max = value

    @property
    def catch_up_ms(self) -> float:
        """The inner drafter's catch-up time in its last ``draft()`` (the engine's cost model leaves it out)."""
        return self.inner.catch_up_ms

    @catch_up_ms.setter
    def catch_up_ms(self, value: float) -> None:
        self.inner.catch_up_ms = value

    @property
    def reuse_kv(self) -> bool:
        """The inner drafter's ``reuse_kv`` (the engine turns it off where the draft memory cannot trim)."""
        return self.inner.reuse_kv

    @reuse_kv.setter
    def reuse_kv(self, value: bool) -> None:
        self.inner.reuse_kv = value

    def begin(self, seq_id, prompt):
        """A new request in the slot: a new text, so the drafter gets a fresh chance there."""
        self.inner.begin(seq_id, prompt)
        self._k[seq_id] = 0
        self.gates[seq_id] = SlotGate(self.gate.backoff)
        self._no_catch_up[seq_id] = False
        if self.adaptive:  # a new request starts from the drafter's acceptance so far
            st = self.inner.stats
            self.lengths[seq_id] = DraftLengthController.after(max(1, self.inner.n_max), st.n_acc_tokens, st.n_gen_tokens)

    def _length(self, seq_id: int, dp: DraftParams) -> int:
        """This round's draft length for ``seq_id`` (``dp.n_max`` unless adaptive)."""
        ctl = self.lengths[seq_id]
        cm = self.cost
        if ctl is None or not cm.base_ms():
            return dp.n_max
        cap = dp.n_max if dp.n_max > 0 else self.inner.n_max
        return ctl.choose(cm.verify_cost, self.draft_cost(), k_cap=cap)

    def process(self, rows):
        t0 = time.perf_counter()
        ok = self.inner.process(rows)
        self._process_ms.append((time.perf_counter() - t0) * 1e3)
        return ok

    @property
    def t_process_ms(self) -> float:
        """The median time of ``process`` per call over the last ``COST_WINDOW`` calls."""
        return _median_ms(self._process_ms)

    def draft_cost(self) -> float:
        """One drafting step of the inner drafter in one-row target decodes: the median of its last
        ``COST_WINDOW`` drafting steps (the statistics' whole-run mean until it drafted here)."""
        base = self.cost.base_ms()
        if not base or not self._step_ms:
            return self.cost.draft_cost_of(self.inner.stats)
        return _median_ms(self._step_ms) / base

    def round_cost(self, k: float) -> float:
        """A round drafting ``k`` tokens on one slot, in one-row target decodes, at the current costs: the
        verification of ``k + 1`` rows, ``k`` drafting steps and the ``process`` call."""
        cm = self.cost
        base = cm.base_ms()
        lo = int(k)
        v = cm.verify_cost(lo) + (k - lo) * (cm.verify_cost(lo + 1) - cm.verify_cost(lo)) if k > lo else cm.verify_cost(lo)
        return v + k * self.draft_cost() + ((self.t_process_ms / base) if base else 0.0)

    def draft(self, params: Sequence[DraftParams]) -> None:
        off = []
        n_max_was: dict[int, int] = {}
        for seq_id, dp in enumerate(params):
            self._k[seq_id] = 0
            if not dp.drafting:
                continue
            g = self.gates[seq_id]
            if g.off_rounds > 0:
                g.off_rounds -= 1
                self.n_gated += 1
                dp.drafting = False
                off.append(dp)
                if g.off_rounds == 0:
                    g.restart()  # try again from the next round
                continue
            k = self._length(seq_id, dp)
            if k <= 0:  # no draft length pays this round
                dp.drafting = False
                off.append(dp)
            elif k != dp.n_max:
                n_max_was[seq_id], dp.n_max = dp.n_max, k
        skip = set(catch_up.not_paying(self, params))
        for seq_id, dp in enumerate(params):
            if dp.drafting:
                self._no_catch_up[seq_id] = seq_id in skip
                if seq_id in skip:
                    dp.drafting = False
                    off.append(dp)
                    self.n_catch_up_skipped += 1
        try:
            if any(dp.drafting for dp in params):
                t0 = time.perf_counter()
                self.inner.draft(params)
                n_steps = max((len(dp.result) for dp in params if dp.drafting), default=0)
                step = self.inner.last_step_ms  # (without catching the draft context up: that is no step)
                if step is None and n_steps > 0 and not self.inner.catch_up_ms:
                    # a drafter that does not time its steps; one that caught up and timed none records none
                    # (the catching up, priced as a step, made the draft cost 8 target decodes: never drafted again)
                    step = (time.perf_counter() - t0) * 1e3 / n_steps
                if step is not None and n_steps > 0:
                    self._step_ms.append(step)
                if self.inner.catch_up_rows >= 16 and self.inner.catch_up_ms > 0:
                    self.row_ms.append(self.inner.catch_up_ms / self.inner.catch_up_rows)
        finally:
            for dp in off:
                dp.drafting = True  # the chain sees an empty result: "no draft from this drafter"
            for seq_id, n in n_max_was.items():
                params[seq_id].n_max = n
        for seq_id, dp in enumerate(params):
            if dp.drafting and dp.result:
                self._k[seq_id] = len(dp.result)

    def accept(self, seq_id, n_accepted, is_other):
        self.inner.accept(seq_id, n_accepted, is_other)
        k = self._k[seq_id]
        self._k[seq_id] = 0
        if is_other or k <= 0:
            return
        ctl = self.lengths[seq_id]
        if ctl is not None:
            ctl.update(k, n_accepted)
        g = self.gates[seq_id]
        g.record(1.0 + n_accepted, k, self.gate.decay)
        self.overall.record(1.0 + n_accepted, k, OVERALL_DECAY)
        self.last_gain = g.gain(self.round_cost)
        if g.should_stop(self.gate.min_rounds, self.gate.margin, self.round_cost):
            g.off_rounds = g.backoff
            g.backoff = min(g.backoff * 2, self.gate.backoff_max)
            self.n_gate_off += 1
            log.debug("auto: %s off for slot %d for %d rounds (measured gain %.2fx)", self.type, seq_id, g.off_rounds,
                      self.last_gain)
        elif g.n_rounds >= self.gate.min_rounds:
            g.backoff = self.gate.backoff

    def expected_gain(self, seq_id: int) -> float:
        """The gain this drafter is expected to give ``seq_id`` now (tokens per unit cost; 1 = a plain
        step): the slot's own measure once it has ``min_rounds``, else every slot's together, 1 while
        nothing was measured or the slot is switched off."""
        g = self.gates[seq_id]
        if g.off_rounds > 0 or self._no_catch_up[seq_id]:
            return 1.0
        if g.n_rounds >= self.gate.min_rounds:
            return max(1.0, g.gain(self.round_cost))
        if self.overall.n_rounds >= self.gate.min_rounds:
            return max(1.0, self.overall.gain(self.round_cost))
        return 1.0

    def configure_sampling(self, seq_id, temp, seed):
        self.inner.configure_sampling(seq_id, temp, seed)

    def set_owner(self, seq_id, owner):
        self.inner.set_owner(seq_id, owner)

    def reset(self, seq_id):
        self.inner.reset(seq_id)
        self._k[seq_id] = 0

    def redecode(self, seq_id, tokens, pos0):
        return self.inner.redecode(seq_id, tokens, pos0)

    def get_state(self, seq_id):
        return self.inner.get_state(seq_id)

    def set_state(self, seq_id, data):
        self.inner.set_state(seq_id, data)

    def close(self):
        self.inner.close()


class AutoChain(Chain):
    """The chain of ``--spec-type auto`` (module docstring): ``ngram`` first, then ``draft`` (the draft model,
    or None) behind the gate (:attr:`gated`). ``cost`` is the engine's one cost model (the round measures the
    decodes into it); the chain hands it to both drafters and reports the gating.

    With a draft model, the n-gram draft must beat the draft model's expected gain on the slot
    (``NgramLookup.gain_floor``), and a slot's first n-gram drafts are at most ``AUTO_NGRAM_K_START`` tokens
    unless ``ngram`` has its own ``k_start``."""

    def __init__(self, ngram: NgramLookup, draft: Drafter | None, n_seq: int, *, cost: CostModel | None = None,
                 adaptive: bool = False, gate: GateParams | None = None):
        self.gate = gate or GateParams()
        #: the engine's cost model (a private one when the chain is built alone, as in tests)
        self.cost = cost if cost is not None else CostModel()
        self.ngram = ngram
        #: the draft model behind the gate (None without a draft model)
        self.gated = GatedDrafter(draft, self.cost, self.gate, adaptive=adaptive) if draft is not None else None
        super().__init__([ngram] if self.gated is None else [ngram, self.gated], n_seq)
        #: with a draft model, two arms for the referee: n-gram copies then the draft model, or the model alone
        self.arms = ("all", "model") if self.gated is not None else ("spec",)
        self._ngram_on = True
        ngram.use_cost_model(self.cost)
        if self.gated is not None:
            ngram.gain_floor = self.gated.expected_gain  # the n-gram draft must beat the draft model where it pays
            if ngram.params.k_start == 0:
                ngram.set_k_start(AUTO_NGRAM_K_START)

    def use_arm(self, arm: str) -> None:
        self._ngram_on = arm != "model"

    def draft(self, params: Sequence[DraftParams] | None = None) -> None:
        if self.gated is not None:
            self.gated.n_gen = self.n_gen
        super().draft(params)

    def drafting_impls(self) -> list[Drafter]:
        """The ``model`` arm leaves ngram-lookup out (it still follows the text: its next lookup syncs)."""
        return self.impls if self._ngram_on or self.gated is None else [self.gated]

    # -- reporting --------------------------------------------------------------------------------
    def auto_info(self) -> dict:
        """Per drafter type: why it did not draft, and the gate's figures."""
        out: dict = {}
        for d in self.impls:
            info: dict = {}
            if isinstance(d, NgramLookup):
                info.update(d.skips)
                info["n_explore"] = d.n_explore
                if d.pool is not None:  # drafts from the shared pool (of them: accepted tokens), tokens held
                    info.update(pool_drafts=d.pool.n_drafts, pool_accepted=d.pool.n_accepted,
                                pool_tokens=d.pool.pool.n_tokens)
            if isinstance(d, GatedDrafter):
                info.update(gated=d.n_gated, n_gate_off=d.n_gate_off, catch_up_skipped=d.n_catch_up_skipped,
                            last_gain=None if d.last_gain is None else round(d.last_gain, 3))
            out[d.type] = info
        base = self.cost.base_ms()
        out["verify_cost"] = {str(k): round(self.cost.verify_cost(k), 3) for k in (1, 3, 7, 15)} if base else {}
        return out

    def stats_dicts(self) -> list[dict]:
        info = self.auto_info()
        return [{**d, "auto": info.get(d["type"], {})} for d in super().stats_dicts()]

    def stats_lines(self) -> list[str]:
        info = self.auto_info()
        parts = []
        for d in self.impls:
            i = info.get(d.type, {})
            why = ", ".join(f"{k} {v}" for k, v in i.items() if v not in (None, 0))
            parts.append(f"{d.type}: {d.stats.n_gen_drafts} drafts, {d.stats.n_acc_tokens} accepted"
                         + (f" ({why})" if why else ""))
        return super().stats_lines() + ["auto: " + "; ".join(parts)]
