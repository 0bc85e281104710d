"""Whether a batch catches the draft model up (``--spec-type auto``, :class:`~llamaspec.auto.GatedDrafter`).

The draft context mirrors only the batches that verify its own drafts, so a new prompt (or rounds it did not
draft in) must be decoded into it before it drafts again. With several slots generating, that catch-up stalls
the whole batch. A slot drafts with the model only when its catch-up costs less than what the model's drafts
save it over the tokens its request has left. (Counted in, 8 new prompts on 8 slots under load caught up
~1,000 tokens in the first rounds: 9 s, where the whole wave of 64 tokens each took 12.5 s plainly.)

* The catch-up is priced at :func:`row_ms`: the draft context's measured time per caught-up row, or before
  any, the target's prompt row scaled by the models' sizes.
* The saving at :func:`batch_gain`: the slot's measured tokens per round over its share of a batched round.
* A lone slot always catches up (its first catch-up is the referee's entry fee; alone, the model's drafts paid
  1.5-2x of plain with it); a catch-up below ``FREE`` of a plain round is not priced; while no draft of the
  model was verified, only the slot with the least to catch up drafts with it, to measure.
"""
from __future__ import annotations

import statistics
from collections import deque
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from .adaptive import CostModel
    from .drafters.base import DraftParams, Drafter

__all__ = ["FREE", "UNBOUNDED_LEFT", "batch_gain", "not_paying", "row_ms"]


class GatedDrafter(Protocol):
    """What is read of :class:`llamaspec.auto.GatedDrafter` (not imported: auto imports this module)."""

    inner: "Drafter"
    cost: "CostModel"
    gates: list
    overall: object
    gate: object
    row_ms: "deque[float]"
    n_gen: int

    def draft_cost(self) -> float: ...


#: the tokens a request without a limit is taken to have left when its catch-up is priced
UNBOUNDED_LEFT = 256
#: a catch-up costing less than this share of a plain round is not priced (the gate decides as usual)
FREE = 0.5


def row_ms(gated: GatedDrafter) -> float | None:
    """What one committed token costs the draft context to catch up on: the median of its last catch-ups per
    row, else the target's prompt row scaled by the draft's size (``Drafter.prompt_cost_ratio``), else None
    (nothing measured)."""
    if gated.row_ms:
        return statistics.median(gated.row_ms)
    row = gated.cost.prompt_row_ms
    return None if row is None else row * gated.inner.prompt_cost_ratio


def batch_gain(gated: GatedDrafter, seq_id: int, n_gen: int, n_drafting: int) -> float | None:
    """The gain (tokens per unit of time against plain decoding) of the model's drafts for ``seq_id`` in a
    round of ``n_gen`` generating slots, ``n_drafting`` of them drafting together: its tokens per round (the
    slot's own mean once judged, else every slot's) over its share of the round, a plain round's
    ``v(n_gen - 1) / n_gen`` plus the rows its draft adds to the batch's verification and its share of the
    batched drafting steps. None while no draft of the model was verified.

    >>> from llamaspec.adaptive import CostModel
    >>> from llamaspec.auto import GatedDrafter, GateParams
    >>> from llamaspec.drafters.base import Drafter
    >>> g = GatedDrafter(type("D", (Drafter,), {"type": "draft-simple"})(2), CostModel(), GateParams())
    >>> g.cost.add_decode(1, 10.0); g.cost.add_decode(16, 30.0)
    >>> batch_gain(g, 0, 1, 1) is None
    True
    >>> for _ in range(4):
    ...     g.overall.record(4.0, 4)          # 3 of 4 drafted tokens accepted
    >>> round(batch_gain(g, 0, 1, 1), 2), round(batch_gain(g, 0, 8, 8), 2)   # alone, and in a batch of 8
    (1.46, 1.05)
    """
    g = gated.gates[seq_id]
    src = g if g.n_rounds >= gated.gate.min_rounds else gated.overall
    if src.weight <= 0:
        return None
    e, k = src.tokens / src.weight, max(1, round(src.drafted / src.weight))
    cm = gated.cost
    share = cm.verify_cost(n_gen - 1) / n_gen
    extra = cm.verify_cost(n_gen - 1 + k) - cm.verify_cost(n_gen - 1) + k * gated.draft_cost() / max(n_drafting, 1)
    return e * share / (share + extra)


def not_paying(gated: GatedDrafter, params: "Sequence[DraftParams]") -> list[int]:
    """The asking slots of a round of ``gated.n_gen`` generating slots whose catch-up (the tokens their draft
    context lacks, times :func:`row_ms`) costs more than the model's drafts save them over ``n_left`` tokens
    (``UNBOUNDED_LEFT`` without a limit) at :func:`batch_gain` (module docstring)."""
    n_gen = gated.n_gen
    base = gated.cost.base_ms()
    per_row = row_ms(gated)
    if n_gen < 2 or not base or per_row is None:
        return []
    asking = [s for s, dp in enumerate(params) if dp.drafting]
    pend = {s: gated.inner.pending(s, params[s].pos0) for s in asking}
    round_ms = gated.cost.verify_cost(n_gen - 1) * base
    skip: list[int] = []
    explored = False
    for s in sorted(asking, key=lambda q: pend[q]):
        cost_ms = pend[s] * per_row
        if cost_ms <= FREE * round_ms:
            explored = True  # (caught up: it measures)
            continue
        gain = batch_gain(gated, s, n_gen, len(asking))
        if gain is None:
            if not explored:
                explored = True
                continue
            skip.append(s)
            continue
        left = params[s].n_left if params[s].n_left >= 0 else UNBOUNDED_LEFT
        if cost_ms > left * round_ms / n_gen * max(0.0, 1.0 - 1.0 / gain):
            skip.append(s)
    return skip
