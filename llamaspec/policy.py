"""How many tokens each slot drafts this round: the one place that decides it (the drafters propose, this cuts).

:class:`DraftBudget` gives each generating slot of a round its ``n_max`` for this round, under a ``cap``:

* ``cap`` is llama.cpp's ``n_draft_max`` (§7.1: room left in the context), further capped so the slot's
  ``[sampled] + draft`` rows fit one decode (``n_batch`` and the per-sequence output rows), never past
  ``n_predict``, and by the request's own ``n_max`` (per-request settings only lower the engine's);
* ``n_max`` is ``cap``, or, with the adaptive length on (:mod:`llamaspec.adaptive`, beyond llama.cpp), what
  the round-level budget gives the slot (:func:`allocate_drafts`): the lengths of all generating slots are
  chosen together, for the most expected tokens per unit of measured cost of the whole round (the decode of
  all their rows, the batched draft steps, the checkpoints of a FULL / RS target). Under load a row costs
  more, so drafting shrinks to the slots whose drafts are accepted most, or stops; alone a slot drafts long.

The chain then asks each slot's drafters for at most ``n_max`` tokens; a drafter may propose fewer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from .adaptive import CostModel, DraftLengthController

if TYPE_CHECKING:  # pragma: no cover
    from .slot import GenerationStats, Slot

__all__ = ["DraftBudget", "allocate_drafts"]


def allocate_drafts(rates: "Sequence[Sequence[float]]", caps: Sequence[int], batch_costs: Sequence[float],
                    step_costs: Sequence[float], overheads: "Sequence[Sequence[float]] | None" = None) -> list[int]:
    """Draft lengths ``k_i`` for the ``B`` slots of one round, maximising the expected tokens per unit cost
    of the round, ``sum_i E_i(k_i) / (batch_costs[B + sum k] + max(k) * step_costs[n] + sum_i overheads[i][k_i])``
    with ``n`` the number of slots that draft (:mod:`llamaspec.adaptive` for ``E``; ``batch_costs[r]`` is the
    decode of ``r`` rows, ``step_costs[n]`` one batched draft step of ``n`` sequences, both relative to a
    one-row decode; ``overheads[i][k]`` slot ``i``'s checkpoint cost for a ``k``-token draft, 0 at ``k = 0``).

    Draft token ``j`` of slot ``i`` adds ``a_i1 ... a_ij`` expected tokens, which only falls with ``j``; so
    for a given longest draft ``M`` and a given number of draft rows ``R``, the best choice is the ``R``
    largest of these gains with at most ``M`` per slot. Every ``M`` and ``R`` is tried (ties: fewer rows).

    >>> rows = lambda b: [0.0] + [1.0 + 0.08 * (r - 1) for r in range(1, b * 9 + 1)]   # 8% per extra row
    >>> steps = [0.0] + [0.1 * n for n in range(1, 17)]
    >>> allocate_drafts([[0.8] * 8], [8], rows(1), steps)                # alone: a long draft
    [4]
    >>> allocate_drafts([[0.8] * 8] * 8, [8] * 8, rows(8), steps)        # eight busy slots: drafting does not pay
    [0, 0, 0, 0, 0, 0, 0, 0]
    >>> allocate_drafts([[0.95] * 8] + [[0.3] * 8] * 3, [8] * 4, rows(4), steps)  # the copying slot alone drafts
    [6, 0, 0, 0]
    """
    b = len(caps)
    gains: list[list[float]] = []
    for r, cap in zip(rates, caps):
        g, run = [], 1.0
        for j in range(cap):
            run *= r[j] if j < len(r) else (r[-1] if r else 0.0)
            g.append(run)
        gains.append(g)
    best_value, best_m, best_r = b / max(batch_costs[b], 1e-9), 0, 0
    # every gain once, largest first (ties: the earlier slot, the earlier position); a longest draft M keeps
    # those at positions below M
    order = sorted(((g[j], i, j) for i, g in enumerate(gains) for j in range(len(g))), key=lambda t: -t[0])
    for m in range(1, max(caps, default=0) + 1):
        tokens, n_rows, count, ov = float(b), 0, [0] * b, 0.0
        n_drafting = 0
        for gain, i, j in order:
            if j >= m:
                continue
            tokens += gain
            n_rows += 1
            if count[i] == 0:
                n_drafting += 1
            count[i] += 1
            if overheads is not None:
                ov += overheads[i][count[i]] - overheads[i][count[i] - 1]
            cost = batch_costs[b + n_rows] + m * step_costs[n_drafting] + ov
            value = tokens / max(cost, 1e-9)
            if value > best_value * (1 + 1e-9):
                best_value, best_m, best_r = value, m, n_rows
    ks = [0] * b
    for _, i, j in (t for t in order if t[2] < best_m):
        if best_r == 0:
            break
        ks[i] += 1
        best_r -= 1
    return ks


class DraftBudget:
    """Per-round draft lengths (module docstring). ``needs_checkpoint(k)``: whether a draft of ``k`` tokens
    needs a target checkpoint (its cost counts against drafting on FULL / RS targets)."""

    def __init__(self, n_ctx_seq: int, n_rows_max_per_seq: int, n_max: int, cost_model: CostModel | None,
                 needs_checkpoint: Callable[[int], bool]):
        self.n_ctx_seq = n_ctx_seq
        self.n_rows_max_per_seq = n_rows_max_per_seq
        #: the chain's longest draft (the adaptive controllers' ceiling)
        self.n_max = n_max
        self.cost_model = cost_model
        self.needs_checkpoint = needs_checkpoint

    @property
    def adaptive(self) -> bool:
        return self.cost_model is not None

    def controller(self, totals: "GenerationStats") -> DraftLengthController | None:
        """A new request's length controller: it starts from the engine-wide acceptance so far."""
        if self.cost_model is None:
            return None
        return DraftLengthController.after(self.n_max, totals.n_accepted, totals.n_drafted)

    def cap(self, s: "Slot") -> int:
        """The most tokens ``s`` may draft now (module docstring)."""
        n = self.n_ctx_seq - s.n_past - 2
        if s.n_remaining > 0:
            n = min(n, s.n_remaining - 1)
        n = min(n, self.n_rows_max_per_seq - 1)
        req = s.options.speculative
        if req is not None and req.n_max is not None:
            n = min(n, req.n_max)
        return n

    def lengths(self, slots: "Sequence[Slot]") -> list[tuple["Slot", int, bool]]:
        """``(slot, n_max, skipped)`` for each slot that may draft this round, in order; ``skipped``: the
        adaptive length chose not to draft (the expected gain is below the measured cost)."""
        caps = [(s, self.cap(s)) for s in slots]
        if self.cost_model is None:
            return [(s, n, False) for s, n in caps]
        chosen = self._adaptive(caps)
        return [(s, chosen.get(s.id, n), chosen.get(s.id) == 0) for s, n in caps]

    def _adaptive(self, caps: list[tuple["Slot", int]]) -> dict[int, int]:
        cost = self.cost_model
        live = [(s, min(n, s.adaptive.k_max)) for s, n in caps if s.adaptive is not None and n > 0]
        if not live:
            return {}
        rates = [s.adaptive.rates() for s, _ in live]
        ncap = [n for _, n in live]
        b = len(live)
        overheads = None
        if any(self.needs_checkpoint(k) for k in range(1, max(ncap) + 1)):  # a FULL / RS target (cost-gated)
            overheads = [[0.0] + [cost.checkpoint_overhead(r, k) if self.needs_checkpoint(k) else 0.0
                                  for k in range(1, n + 1)] for r, n in zip(rates, ncap)]
        ks = allocate_drafts(rates, ncap, cost.batch_costs(b + sum(ncap)),
                             [0.0] + [cost.draft_step_cost(n) for n in range(1, b + 1)], overheads)
        return {s.id: s.adaptive.explore(k, n) for (s, n), k in zip(live, ks)}
