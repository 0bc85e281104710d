"""Adaptive draft length (beyond llama.cpp): each round's ``n_max`` chosen per slot from what was measured.

With ``a_i`` the probability that draft token ``i`` is accepted given that the ones before it were, a draft of
``k`` tokens yields on average ``E(k) = 1 + a_1 + a_1 a_2 + ... + a_1...a_k`` tokens per round (the target's
own token included) and costs ``C(k) = v(k) + k c``: the target decode of ``k + 1`` rows, ``v(k)``, and ``k``
draft steps of relative cost ``c`` (both in units of one single-row target decode). The controller picks the
``k`` in ``0..k_max`` that maximises ``E(k) / C(k)``, the expected tokens per unit of time.

``a_i`` is estimated per slot from the slot's own rounds (accepted / drafted at position ``i``, with a prior
worth a few rounds so that a new request starts from the engine-wide rate); ``v`` and ``c`` are measured
online by the engine (decode time per row count, draft time per batched step). Everything here is pure.

>>> ctl = DraftLengthController(k_max=8, prior_rate=0.9)
>>> ctl.choose(verify_cost=lambda k: 1.0 + 0.05 * k, draft_cost=0.3)   # good drafts: a long-ish draft
4
>>> for _ in range(20):
...     ctl.update(n_drafted=4, n_accepted=0)                           # drafts keep failing: stop drafting
>>> ctl.choose(verify_cost=lambda k: 1.0 + 0.05 * k, draft_cost=0.3)
0
"""
from __future__ import annotations

import bisect
from typing import Callable

__all__ = ["DraftLengthController", "Explorer", "expected_tokens", "best_draft_length", "CostModel",
           "default_verify_cost", "DRAFT_COST_PRIOR"]

#: a draft step's cost relative to a one-row target decode before any was measured
DRAFT_COST_PRIOR = 0.3


def default_verify_cost(k: int) -> float:
    """``v(k)``, the cost of verifying ``k + 1`` rows relative to one, before anything was measured: a
    CPU-like curve (Gemma-3-270M on two cores: 1.28 at 2 rows, 1.4 at 4, 1.8 at 8, 2.2 at 16, 2.9 at 32).

    >>> default_verify_cost(0), default_verify_cost(3), round(default_verify_cost(15), 2)
    (1.0, 1.4, 2.2)
    """
    rows = k + 1
    pts = ((1, 1.0), (2, 1.28), (4, 1.4), (8, 1.8), (16, 2.2), (32, 2.9), (64, 5.0))
    for (r0, c0), (r1, c1) in zip(pts, pts[1:]):
        if rows <= r1:
            return c0 + (c1 - c0) * (rows - r0) / (r1 - r0)
    r0, c0 = pts[-1]
    return c0 + (rows - r0) * 0.07


def expected_tokens(rates: list[float], k: int) -> float:
    """``E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j``.

    >>> expected_tokens([0.5, 0.5], 2)
    1.75
    >>> expected_tokens([0.9], 0)
    1.0
    """
    total, run = 1.0, 1.0
    for i in range(k):
        run *= _rate(rates, i)
        total += run
    return total


def _rate(rates: list[float], i: int) -> float:
    """``a_i``; positions past the estimates take the last one (none: 0)."""
    return rates[i] if i < len(rates) else (rates[-1] if rates else 0.0)


def _cost_at(curve: "tuple[float, dict[int, float], list[int], float]", rows: int) -> float:
    """A decode of ``rows`` rows relative to one on a measured curve (:meth:`CostModel._curve`): the
    measured time, else interpolated between the measured row counts around it, else past the last one
    extended by its slope; never below one row (noise can measure two rows faster than one)."""
    base, ms, known, slope = curve
    if rows in ms:
        return max(1.0, ms[rows] / base)
    last = known[-1]
    if rows > last:
        return max(1.0, (ms[last] + slope * (rows - last)) / base)
    i = bisect.bisect_left(known, rows)
    lo, hi = known[i - 1], known[i]
    return max(1.0, (ms[lo] + (rows - lo) / (hi - lo) * (ms[hi] - ms[lo])) / base)


def best_draft_length(rates: list[float], k_max: int, verify_cost: Callable[[int], float], draft_cost: float,
                      overhead: Callable[[int], float] | None = None) -> int:
    """The ``k`` in ``0..k_max`` with the most expected tokens per unit cost (ties: the shorter draft);
    ``overhead(k)`` adds what a draft of ``k`` costs beyond decoding (checkpoint and restore of a FULL / RS
    target memory, :meth:`CostModel.checkpoint_overhead`).

    >>> best_draft_length([0.5] * 8, 8, lambda k: 1.0 + 0.1 * k, 0.2)
    1
    >>> best_draft_length([0.5] * 8, 8, lambda k: 1.0 + 0.1 * k, 0.5)   # a draft costs more than it brings
    0
    >>> best_draft_length([0.99] * 8, 8, lambda k: 1.0 + 0.02 * k, 0.1)
    8
    >>> best_draft_length([0.6] * 8, 8, lambda k: 1.0 + 0.05 * k, 0.1, overhead=lambda k: 1.5)  # costly checkpoints
    0
    """
    best_k, best = 0, 1.0 / max(verify_cost(0), 1e-9)
    for k in range(1, k_max + 1):
        cost = verify_cost(k) + k * draft_cost + (overhead(k) if overhead is not None else 0.0)
        value = expected_tokens(rates, k) / max(cost, 1e-9)
        if value > best * (1 + 1e-9):
            best_k, best = k, value
    return best_k


class Explorer:
    """Looking again after idling: the one "explore after not drafting" rule of every length policy.

    A policy that chose not to draft calls :meth:`idle`; after ``every`` such rounds in a row it is told to
    try a short draft anyway (conditions change with the text). With ``backoff`` > 1, an exploration that
    found nothing accepted doubles the interval (up to ``backoff`` x ``every``) and one that paid resets it.

    >>> e = Explorer(every=3, backoff=4)
    >>> [e.idle() for _ in range(3)]
    [False, False, True]
    >>> e.result(0); [e.idle() for _ in range(6)].index(True) + 1     # it found nothing: twice the interval
    6
    """

    __slots__ = ("every", "backoff", "n_idle", "gap", "exploring")

    def __init__(self, every: int, backoff: int = 1):
        self.every = every
        self.backoff = backoff
        self.n_idle = 0
        self.gap = 0  # the current interval (0: ``every``)
        self.exploring = False

    def idle(self) -> bool:
        """A round without a draft; True when this one should explore instead."""
        self.n_idle += 1
        if self.n_idle < max(self.gap, self.every):
            return False
        self.n_idle = 0
        self.exploring = True
        return True

    def drafted(self) -> None:
        """A round with a draft (chosen or exploring)."""
        self.n_idle = 0

    def result(self, n_accepted: int) -> None:
        """What the last draft earned (only the backing-off policies report it)."""
        if n_accepted > 0:
            self.gap = 0
        elif self.exploring and self.backoff > 1:
            self.gap = min(2 * max(self.gap, self.every), self.backoff * self.every)
        self.exploring = False


class DraftLengthController:
    """Per-slot estimates of ``a_i`` and the choice of the next draft length (module docstring)."""

    def __init__(self, k_max: int, prior_rate: float = 0.7, prior_weight: float = 3.0, explore_every: int = 8):
        self.k_max = k_max
        self.prior_rate = prior_rate
        self.prior_weight = prior_weight
        #: after ``explore_every`` rounds without drafting, one draft token is tried
        self.explorer = Explorer(explore_every)
        self.trials = [0.0] * k_max
        self.accepts = [0.0] * k_max

    @classmethod
    def after(cls, k_max: int, n_accepted: int, n_drafted: int) -> "DraftLengthController":
        """A new request's controller: its prior is the acceptance so far (``n_accepted`` of ``n_drafted``, once
        there are 32 drafted tokens; 0.7 before), kept within 0.05..0.98."""
        prior = n_accepted / n_drafted if n_drafted >= 32 else 0.7
        return cls(k_max, prior_rate=min(max(prior, 0.05), 0.98))

    def rates(self) -> list[float]:
        """``a_i`` per position: the position's own counts, shrunk toward the estimate of the position before
        it (the first toward ``prior_rate``). A position never drafted yet takes its predecessor's rate, so
        high acceptance at the short lengths tried so far lets the next choice reach further.

        >>> c = DraftLengthController(k_max=4, prior_rate=0.7)
        >>> for _ in range(10):
        ...     c.update(n_drafted=2, n_accepted=2)       # two positions tried, always accepted
        >>> [round(r, 2) for r in c.rates()]               # positions 3 and 4 inherit the high rate
        [0.93, 0.98, 0.98, 0.98]
        """
        w, prev = self.prior_weight, self.prior_rate
        out = []
        for i in range(self.k_max):
            prev = (self.accepts[i] + w * prev) / (self.trials[i] + w)
            out.append(prev)
        return out

    def update(self, n_drafted: int, n_accepted: int) -> None:
        """One verified draft: positions ``< n_accepted`` were accepted, position ``n_accepted`` rejected."""
        for i in range(min(n_drafted, self.k_max)):
            if i > n_accepted:
                break
            self.trials[i] += 1
            if i < n_accepted:
                self.accepts[i] += 1

    def choose(self, verify_cost: Callable[[int], float], draft_cost: float, k_cap: int | None = None,
               overhead: Callable[[int], float] | None = None) -> int:
        k_max = self.k_max if k_cap is None else min(self.k_max, k_cap)
        return self.explore(best_draft_length(self.rates(), k_max, verify_cost, draft_cost, overhead), k_max)

    def explore(self, k: int, k_max: int) -> int:
        """``k`` as chosen, except that after ``explore_every`` rounds of not drafting one token is tried."""
        if k == 0 and k_max > 0:
            return 1 if self.explorer.idle() else 0
        self.explorer.drafted()
        return k


class CostModel:
    """Online costs in units of one single-row target decode: ``v(k)`` from decode times by row count
    (exponential moving averages; unmeasured row counts interpolate linearly), ``c`` from the time of a
    batched draft step by the number of sequences drafting together."""

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.decode_ms: dict[int, float] = {}
        #: time of one batched draft step by the number of sequences drafting together
        self.draft_step_ms: dict[int, float] = {}
        #: FULL / RS targets: time of a speculative checkpoint (state save) and of a restore (reload + trim)
        self.checkpoint_ms: float | None = None
        self.restore_ms: float | None = None
        #: time of one row of a target prompt batch (a catch-up of the draft context is priced from it until the
        #: draft model measured its own)
        self.prompt_row_ms: float | None = None

    def _ema(self, old: float | None, new: float) -> float:
        """The moving average; one sample moves it at most by a factor of 3 (a decode that waited for a busy
        machine's scheduler, or a page fault, must not price speculation for the next hundred rounds).

        >>> m = CostModel(); round(m._ema(10.0, 5000.0), 1)           # an outlier counts as 30 ms, not 5 s
        14.0
        """
        if old is None:
            return new
        new = min(max(new, old / 3.0), old * 3.0)
        return old + self.alpha * (new - old)

    def add_prompt(self, n_rows: int, ms: float) -> None:
        """A target decode of ``n_rows`` rows that were mostly a prompt's took ``ms``.

        >>> m = CostModel(); m.add_prompt(100, 500.0); m.prompt_row_ms
        5.0
        """
        if n_rows > 0:
            self.prompt_row_ms = self._ema(self.prompt_row_ms, ms / n_rows)

    def add_checkpoint(self, ms: float) -> None:
        self.checkpoint_ms = self._ema(self.checkpoint_ms, ms)

    def add_restore(self, ms: float) -> None:
        self.restore_ms = self._ema(self.restore_ms, ms)

    def checkpoint_overhead(self, rates: list[float], k: int) -> float:
        """What a draft of ``k`` tokens costs a FULL / RS target beyond decoding, in one-row decodes: the
        checkpoint, and when not every token is accepted (probability ``1 - a_1...a_k``) the restore plus the
        replay decode (about one row). Zero until a checkpoint was measured.

        >>> m = CostModel(); m.add_decode(1, 10.0); m.add_checkpoint(5.0); m.add_restore(5.0)
        >>> round(m.checkpoint_overhead([0.5, 0.5], 2), 3)   # 0.5 + (1 - 0.25) * (0.5 + 1.0)
        1.625
        """
        base = self.base_ms()  # several busy slots never decode one row: estimated from the smallest batch
        if not base or self.checkpoint_ms is None:
            return 0.0
        all_accepted = 1.0
        for i in range(k):
            all_accepted *= _rate(rates, i)
        restore = (self.restore_ms if self.restore_ms is not None else self.checkpoint_ms) / base + self.verify_cost(0)
        return self.checkpoint_ms / base + (1.0 - all_accepted) * restore

    def add_decode(self, n_rows: int, ms: float) -> None:
        """A decode of ``n_rows`` rows took ``ms``. A busy machine only ever makes a decode wait longer (another
        process had the cores), so a time above the average moves it a quarter as far as one below, and a row
        count's first time counts at most 3x what the curve measured so far predicts: the times follow the
        machine's undisturbed speed, and row counts measured at different moments compare as work (issue 25).

        >>> m = CostModel(); m.add_decode(4, 10.0); m.add_decode(4, 30.0); m.decode_ms[4]   # 20 ms slower: +1 ms
        11.0
        >>> m.add_decode(4, 6.0); m.decode_ms[4]                                            # 5 ms faster: -1 ms
        10.0
        """
        old = self.decode_ms.get(n_rows)
        if old is None and len(self.decode_ms) >= 2:
            ms = min(ms, 3.0 * self.verify_cost(n_rows - 1) * (self.base_ms() or ms))
        elif old is not None and ms > old:
            ms = old + (min(ms, 3.0 * old) - old) / 4.0
        self.decode_ms[n_rows] = self._ema(old, ms)

    def add_draft(self, n_tokens: int, ms: float, n_seqs: int = 1, n_steps: int | None = None) -> None:
        """``ms`` of drafting ``n_tokens`` for ``n_seqs`` sequences together in ``n_steps`` batched steps
        (default: ``ceil(n_tokens / n_seqs)``)."""
        if n_tokens > 0:
            steps = n_steps or -(-n_tokens // max(n_seqs, 1))
            self.draft_step_ms[n_seqs] = self._ema(self.draft_step_ms.get(n_seqs), ms / max(steps, 1))

    def base_ms(self) -> float | None:
        """The time of a one-row target decode: measured, or, where only batches were decoded (several slots
        always generating together never decode one row), the smallest measured batch scaled down by a
        CPU-like cost curve (:func:`default_verify_cost`). None until any
        decode was measured.

        >>> m = CostModel(); m.add_decode(4, 14.0); m.base_ms()     # 4 rows cost 1.4 one-row decodes on that curve
        10.0
        """
        base = self.decode_ms.get(1)
        if base or not self.decode_ms:
            return base or None
        r = min(self.decode_ms)
        return self.decode_ms[r] / default_verify_cost(r - 1)

    def verify_cost(self, k: int) -> float:
        """``v(k)``: the decode of ``k + 1`` rows relative to one row, measured; until two row counts were
        measured, the CPU-like prior :func:`default_verify_cost` (a first long draft on an unmeasured CPU
        would otherwise be priced far too cheap). The one definition every user of ``v(k)`` shares.

        >>> CostModel().verify_cost(15) == default_verify_cost(15)
        True
        >>> m = CostModel(); m.add_decode(1, 10.0); m.add_decode(5, 14.0)
        >>> m.verify_cost(0), m.verify_cost(4), round(m.verify_cost(2), 2)
        (1.0, 1.4, 1.2)
        >>> m = CostModel(); m.add_decode(4, 14.0); m.add_decode(16, 22.0)   # no one-row decode (4 slots)
        >>> m.verify_cost(0), m.verify_cost(3), m.verify_cost(15), round(m.verify_cost(9), 2)
        (1.0, 1.4, 2.2, 1.8)
        """
        curve = self._curve()
        return default_verify_cost(k) if curve is None else _cost_at(curve, k + 1)

    def batch_costs(self, n_rows: int) -> list[float]:
        """``[v(r - 1) for r in 0..n_rows]``, the cost of a decode of ``r`` rows relative to one (index 0 is 0),
        in one pass: what :meth:`verify_cost` gives row count by row count (a round's budget prices every
        batch size it considers).

        >>> m = CostModel(); m.add_decode(1, 10.0); m.add_decode(5, 14.0)
        >>> m.batch_costs(7) == [0.0] + [m.verify_cost(r - 1) for r in range(1, 8)]
        True
        >>> CostModel().batch_costs(3) == [0.0] + [default_verify_cost(r - 1) for r in range(1, 4)]
        True
        """
        curve = self._curve()
        if curve is None:
            return [0.0] + [default_verify_cost(r - 1) for r in range(1, n_rows + 1)]
        return [0.0] + [_cost_at(curve, r) for r in range(1, n_rows + 1)]

    def _curve(self) -> "tuple[float, dict[int, float], list[int], float] | None":
        """``(base, ms by row count, the row counts sorted, the slope past the last)`` of the measured decode
        times, never falling with the row count, or None while the prior applies (fewer than two measured).

        >>> m = CostModel(); m.add_decode(1, 10.0); m.add_decode(9, 400.0); m.add_decode(17, 20.0)
        >>> m.add_decode(33, 30.0); [m.verify_cost(k) for k in (0, 8, 32)]   # 9 rows never above 17
        [1.0, 2.0, 3.0]
        """
        base = self.base_ms()
        if not base or len(self.decode_ms) < 2:
            return None
        ms = {1: base, **self.decode_ms}
        known = sorted(ms)
        # the lower envelope from the right: a busy machine only adds time, and one slow sample at a row count
        # seen once (the first decodes, a decode that waited for the CPU) priced medium drafts above long ones
        # for the rest of the run (issue 25: 11 rows 4.3 s and 57 rows 5.2 s next to 12 rows 0.13 s)
        low = ms[known[-1]]
        for r in reversed(known):
            low = ms[r] = min(ms[r], low)
        last = known[-1]
        # a noisy measurement can make the slope negative: a longer verify never costs less than one row
        slope = max((ms[last] - base) / max(last - 1, 1) if last > 1 else 0.05 * base, 0.0)
        return base, ms, known, slope


    def draft_step_cost(self, n_seqs: int = 1) -> float:
        """One batched draft step for ``n_seqs`` sequences, relative to a one-row target decode: measured
        for that batch size, else the nearest measured one scaled by the target's cost curve, else
        ``DRAFT_COST_PRIOR`` one-row decodes scaled the same way (a batched step
        costs about what a batched decode does, not ``n_seqs`` single steps).

        >>> m = CostModel(); m.add_decode(1, 10.0); m.add_decode(4, 14.0)
        >>> m.draft_step_cost(1), m.draft_step_cost(4)              # prior: 0.3 x v(rows - 1)
        (0.3, 0.42)
        >>> m.add_draft(8, 8.0, n_seqs=4, n_steps=2); m.draft_step_cost(4), round(m.draft_step_cost(1), 3)
        (0.4, 0.286)
        """
        base = self.base_ms()
        scale = self.verify_cost(max(n_seqs, 1) - 1)
        if not base or not self.draft_step_ms:
            return DRAFT_COST_PRIOR * scale
        if n_seqs in self.draft_step_ms:
            return self.draft_step_ms[n_seqs] / base
        b0 = min(self.draft_step_ms, key=lambda b: (abs(b - n_seqs), b))
        return self.draft_step_ms[b0] / base * scale / self.verify_cost(b0 - 1)

    def draft_cost_of(self, stats) -> float:
        """One drafted token of a drafter, relative to a one-row target decode, from its statistics
        (``t_draft_us`` / ``n_gen_tokens``; ``DRAFT_COST_PRIOR`` until it drafted and a decode was measured).

        >>> from llamaspec.stats import DrafterStats
        >>> m = CostModel(); m.add_decode(1, 10.0); st = DrafterStats(); m.draft_cost_of(st)
        0.3
        >>> st.n_gen_tokens, st.t_draft_us = 10, 20_000.0; m.draft_cost_of(st)
        0.2
        """
        base = self.base_ms()
        if not base or stats.n_gen_tokens <= 0:
            return DRAFT_COST_PRIOR
        return (stats.t_draft_us / 1e3 / stats.n_gen_tokens) / base
