"""How many tokens each slot drafts this round: the one place that decides it (the drafters propose, this cuts).

:class:`DraftBudget` gives each generating slot of a round its ``n_max`` for this round, under a ``cap``:

* ``cap`` is llama.cpp's ``n_draft_max`` (§7.1: room left in the context), further capped so the slot's
  ``[sampled] + draft`` rows fit one decode (``n_batch`` and the per-sequence output rows), never past
  ``n_predict``, and by the request's own ``n_max`` (per-request settings only lower the engine's);
* ``n_max`` is ``cap``, or, with the adaptive length on (:mod:`llamaspec.adaptive`, beyond llama.cpp), the
  length that pays best now from each slot's measured acceptance and the measured costs: alone a slot gets
  its own best length, several drafting slots share one (a row costs more in a longer batch).

The chain then asks each slot's drafters for at most ``n_max`` tokens; a drafter may propose fewer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from .adaptive import CostModel, DraftLengthController, best_shared_length

if TYPE_CHECKING:  # pragma: no cover
    from .slot import GenerationStats, Slot

__all__ = ["DraftBudget"]


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
        prior = totals.n_accepted / totals.n_drafted if totals.n_drafted >= 32 else 0.7
        return DraftLengthController(self.n_max, prior_rate=min(max(prior, 0.05), 0.98))

    def cap(self, s: "Slot") -> int:
        """The most tokens ``s`` may draft now (module docstring)."""
        n = self.n_ctx_seq - s.n_past - 2
        if s.n_remaining > 0:
            n = min(n, s.n_remaining - 1)
        n = min(n, self.n_rows_max_per_seq - 1)
        req = s.spec_req
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

        def overhead(i: int, k: int) -> float:  # checkpoint + restore of a FULL / RS target (cost-gated)
            return cost.checkpoint_overhead(rates[i], k) if self.needs_checkpoint(k) else 0.0

        # one slot alone is the same choice as DraftLengthController.choose (rows = k + 1, one draft step each)
        k = best_shared_length(rates, [n for _, n in live], lambda rows: cost.verify_cost(rows - 1),
                               cost.draft_step_cost(len(live)), overhead)
        return {s.id: s.adaptive.explore(min(k, n), n) for s, n in live}
