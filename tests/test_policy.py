"""The round-level speculation budget (llamaspec.policy.allocate_drafts): against brute force, and its behaviour
under load on measured cost curves of two kinds of machine."""
from __future__ import annotations

import itertools
import random

import pytest

from llamaspec.adaptive import CostModel, expected_tokens
from llamaspec.policy import allocate_drafts


def _value(ks, rates, batch_costs, step_costs, overheads=None):
    b = len(ks)
    tokens = sum(expected_tokens(r, k) for r, k in zip(rates, ks))
    n_drafting = sum(1 for k in ks if k)
    cost = batch_costs[b + sum(ks)] + max(ks) * step_costs[n_drafting]
    if overheads is not None:
        cost += sum(o[k] for o, k in zip(overheads, ks))
    return tokens / cost


@pytest.mark.parametrize("seed", range(40))
def test_allocation_is_the_brute_force_optimum(seed):
    """With a draft step whose cost does not depend on how many slots draft, the allocation is optimal."""
    rng = random.Random(seed)
    b = rng.randint(1, 3)
    caps = [rng.randint(0, 4) for _ in range(b)]
    rates = [[rng.uniform(0.05, 0.99) for _ in range(4)] for _ in range(b)]
    slope = rng.uniform(0.0, 0.3)
    batch_costs = [0.0] + [1.0 + slope * (r - 1) + rng.uniform(0, 0.01) * r for r in range(1, b + sum(caps) + 1)]
    step = rng.uniform(0.0, 0.5)
    step_costs = [0.0] + [step] * b
    ks = allocate_drafts(rates, caps, batch_costs, step_costs)
    assert all(0 <= k <= c for k, c in zip(ks, caps))
    best = max(_value(list(kk), rates, batch_costs, step_costs)
               for kk in itertools.product(*[range(c + 1) for c in caps]))
    assert _value(ks, rates, batch_costs, step_costs) >= best * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_allocation_with_slot_dependent_costs_is_near_optimal(seed):
    """Batched draft steps cost more for more sequences, and checkpoints cost per drafting slot: still within
    a few percent of the best allocation (never worse than not drafting)."""
    rng = random.Random(100 + seed)
    b = rng.randint(2, 3)
    caps = [rng.randint(0, 3) for _ in range(b)]
    rates = [[rng.uniform(0.05, 0.99)] * 3 for _ in range(b)]
    batch_costs = [0.0] + [1.0 + 0.1 * (r - 1) for r in range(1, b + sum(caps) + 1)]
    step_costs = [0.0] + [0.1 + 0.05 * n for n in range(1, b + 1)]
    overheads = [[0.0] + [rng.uniform(0, 0.3)] * c for c in caps]
    ks = allocate_drafts(rates, caps, batch_costs, step_costs, overheads)
    got = _value(ks, rates, batch_costs, step_costs, overheads)
    best = max(_value(list(kk), rates, batch_costs, step_costs, overheads)
               for kk in itertools.product(*[range(c + 1) for c in caps]))
    assert got >= best * 0.97
    assert got >= _value([0] * b, rates, batch_costs, step_costs, overheads) * (1 - 1e-9)


def _cost_model(per_row: float, step_ms: float) -> CostModel:
    """A measured cost model: a decode of r rows costs 10 ms + per_row * (r - 1) ms."""
    m = CostModel()
    for r in (1, 2, 4, 8, 16, 32, 64):
        m.add_decode(r, 10.0 + per_row * (r - 1))
    for n in (1, 2, 4, 8, 16):
        m.add_draft(n, step_ms * (1 + 0.05 * (n - 1)), n_seqs=n, n_steps=1)
    return m


def _alloc(m: CostModel, rates, caps):
    b = len(caps)
    return allocate_drafts(rates, caps, m.batch_costs(b + sum(caps)), [0.0] + [m.draft_step_cost(n) for n in range(1, b + 1)])


def test_speculation_shrinks_with_load_on_a_cpu_and_stays_on_a_gpu():
    """A CPU where a row costs 30% of a decode: alone a slot drafts, at 8 busy slots no slot does; with drafts
    that cost nothing to make (n-grams), the one slot that copies still drafts. A GPU where rows are nearly
    free: every slot drafts long at any load."""
    cpu, gpu = _cost_model(per_row=3.0, step_ms=2.0), _cost_model(per_row=0.1, step_ms=2.0)
    good = [0.8] * 12
    assert _alloc(cpu, [good], [12])[0] >= 1
    assert _alloc(cpu, [good] * 8, [12] * 8) == [0] * 8
    free_drafts = _cost_model(per_row=3.0, step_ms=0.0)
    busy = _alloc(free_drafts, [[0.99] * 12] + [[0.5] * 12] * 7, [12] * 8)
    assert busy[0] >= 4 and busy[1:] == [0] * 7
    assert min(_alloc(gpu, [good] * 8, [12] * 8)) >= 3
    assert min(_alloc(gpu, [good] * 16, [12] * 16)) >= 2


def test_lengths_follow_acceptance_between_slots():
    m = _cost_model(per_row=1.0, step_ms=1.0)
    ks = _alloc(m, [[0.95] * 12, [0.6] * 12, [0.2] * 12], [12, 12, 12])
    assert ks[0] > ks[1] >= ks[2]


def test_caps_are_respected_and_empty_rounds_are_fine():
    m = _cost_model(per_row=0.1, step_ms=0.5)
    assert _alloc(m, [[0.99] * 12, [0.99] * 12], [2, 0]) == [2, 0]
    assert allocate_drafts([], [], [0.0], [0.0]) == []
