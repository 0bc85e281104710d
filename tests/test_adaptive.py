"""Adaptive draft length (llamaspec.adaptive): the pure choice, and the engine with it on."""
from __future__ import annotations

import doctest

import pytest

import llamaspec.adaptive as adaptive
from llamaspec.adaptive import default_verify_cost, CostModel, DraftLengthController, best_draft_length, expected_tokens
from llamaspec.engine import Engine
from llamaspec.params import SpecParams

from helpers import EXACT

PROMPTS = [[1, 5, 9, 13, 22, 7], [3, 4, 5], [9, 9, 9, 1], [40, 2, 17, 33, 8]]


def test_doctests():
    assert doctest.testmod(adaptive).failed == 0


@pytest.mark.parametrize("rate,verify_slope,draft_cost,expect", [
    (0.99, 0.02, 0.05, 16),   # near-perfect cheap drafts: the ceiling
    (0.9, 0.05, 0.3, 4),
    (0.6, 0.1, 0.3, 1),
    (0.3, 0.1, 0.3, 0),       # drafting loses: off
])
def test_best_length_table(rate, verify_slope, draft_cost, expect):
    assert best_draft_length([rate] * 16, 16, lambda k: 1 + verify_slope * k, draft_cost) == expect


def test_the_choice_maximises_tokens_per_cost():
    rates = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]
    v = lambda k: 1 + 0.07 * k  # noqa: E731
    k = best_draft_length(rates, 6, v, 0.2)
    values = [expected_tokens(rates, j) / (v(j) + 0.2 * j) for j in range(7)]
    assert values[k] == max(values)


def test_controller_learns_per_position_and_explores():
    c = DraftLengthController(k_max=6, prior_rate=0.7, explore_every=3)
    for _ in range(30):  # the first two tokens always pass, the third never
        c.update(n_drafted=6, n_accepted=2)
    r = c.rates()
    assert r[0] > 0.9 and r[1] > 0.9 and r[2] < 0.15
    assert c.choose(lambda k: 1 + 0.05 * k, 0.1) == 2
    for _ in range(30):
        c.update(n_drafted=2, n_accepted=0)
    picks = [c.choose(lambda k: 1 + 0.05 * k, 0.5) for _ in range(6)]
    assert picks.count(0) == 4 and picks.count(1) == 2  # off, but it looks again every 3 rounds


def test_cost_model_from_measurements():
    m = CostModel(alpha=1.0)
    assert m.verify_cost(3) == pytest.approx(default_verify_cost(3)) and m.draft_step_cost(1) == 0.3  # priors until measured
    m.add_decode(1, 20.0)
    m.add_decode(3, 24.0)
    m.add_draft(4, 16.0)
    assert m.verify_cost(2) == pytest.approx(1.2) and m.draft_step_cost(1) == pytest.approx(0.2)
    assert m.verify_cost(4) == pytest.approx(1.4)  # 5 rows, beyond the last measurement: the same slope


@pytest.mark.parametrize("kind,draft,n_rs_seq", [("llama", "llama-draft", None), ("mamba", "mamba-draft", None),
                                                 ("lfm2", "lfm2-draft", 2)])
def test_adaptive_engine_greedy_equals_plain(tiny_model, kind, draft, n_rs_seq):
    p = SpecParams()
    p.draft.n_max = 8
    p.draft_adaptive = True
    with Engine(tiny_model(kind), n_ctx=256, **EXACT) as e:
        plain = [e.generate(PROMPTS[i], n_predict=48).tokens for i in range(2)]
    with Engine(tiny_model(kind), draft=tiny_model(draft), spec=p, n_ctx=256, n_parallel=2, n_rs_seq=n_rs_seq,
                **EXACT) as e:
        assert e.cost_model is not None
        res = e.generate_many(PROMPTS[:2], n_predict=48)
        assert e.cost_model.decode_ms  # costs were measured
    assert [r.tokens for r in res] == plain
    assert sum(r.stats.n_drafted for r in res) > 0


def test_parity_turns_adaptive_off(tiny_model):
    p = SpecParams()
    p.draft_adaptive, p.parity = True, True
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=p, n_ctx=256) as e:
        assert not e.budget.adaptive and not e.chain.impls[0].reuse_kv


def test_cost_model_without_a_one_row_decode():
    """Several slots generating together never decode one row: the one-row cost is estimated from the
    smallest batch (before this, every cost fell back to its prior and a 4-slot engine stopped drafting), and
    a batched draft step is priced by what was measured for that batch, not as n single steps."""
    m = CostModel(alpha=1.0)
    m.add_decode(4, 28.0)
    m.add_decode(16, 44.0)
    assert m.base_ms() == pytest.approx(20.0)            # 4 rows = 1.4 one-row decodes on the prior curve
    assert m.verify_cost(3) == pytest.approx(1.4) and m.verify_cost(15) == pytest.approx(2.2)
    assert m.draft_step_cost(4) == pytest.approx(0.3 * 1.4)
    m.add_draft(12, 30.0, n_seqs=4, n_steps=3)
    assert m.draft_step_cost(4) == pytest.approx(0.5) and m.draft_step_cost(1) == pytest.approx(0.5 / 1.4)
    # 4 slots at acceptance 0.9: drafts of 3 pay (before: step cost 4 x 0.3 and no drafting)
    from llamaspec.policy import allocate_drafts
    steps = [0.0] + [m.draft_step_cost(n) for n in range(1, 5)]
    assert allocate_drafts([[0.9] * 3] * 4, [3] * 4, m.batch_costs(16), steps) == [3, 3, 3, 3]


def _frozen_costs(cm: CostModel, checkpoint_decodes: float) -> None:
    """Costs as if measured: cheap drafts, flat verification, a checkpoint worth ``checkpoint_decodes``
    one-row decodes; ``alpha = 0`` keeps them through the run."""
    cm.alpha = 0.0
    cm.decode_ms = {1: 10.0, 2: 10.2, 3: 10.4, 5: 10.8, 9: 11.6}
    cm.draft_step_ms = {1: 0.1}
    cm.checkpoint_ms = cm.restore_ms = 10.0 * checkpoint_decodes


@pytest.mark.parametrize("kind,draft,gated", [("llama", "llama-draft", False), ("mamba", "mamba-draft", True)])
def test_checkpoint_costs_gate_drafting(tiny_model, kind, draft, gated):
    """Cost-gated checkpoints (issue 12 item 6): on a FULL target a draft also pays its checkpoint and,
    when partly rejected, the restore and replay; when those cost 30 decodes drafting stops (counted in
    ``n_draft_skipped``), while a PART target with the same costs drafts on. Output equals plain either way."""
    p = SpecParams()
    p.draft.n_max = 4
    p.referee = False  # the budget's own gating is under test: no plain probes in between
    with Engine(tiny_model(kind), n_ctx=256, **EXACT) as e:
        plain = e.generate(PROMPTS[3], n_predict=32).tokens
    with Engine(tiny_model(kind), draft=tiny_model(draft), spec=p, n_ctx=256, **EXACT) as e:
        e.generate(PROMPTS[0], n_predict=16)
        if gated:
            assert e.cost_model.checkpoint_ms is not None  # a FULL target's checkpoints were timed
        _frozen_costs(e.cost_model, 30.0)
        r = e.generate(PROMPTS[3], n_predict=32)
    assert r.tokens == plain
    if gated:
        assert r.stats.n_draft_skipped >= 20 and r.stats.n_drafted <= 4  # only the exploring single tokens
    else:
        assert r.stats.n_draft_skipped == 0 and r.stats.n_drafted > 20


def test_checkpoints_are_priced_when_no_one_row_decode_was_measured():
    """Issue 21 (review §4.6): with several busy slots the target never decodes one row; checkpoints of a
    FULL / RS target must still cost something (they were priced at 0, so the cost gate was off)."""
    m = CostModel()
    m.add_decode(4, 14.0)
    m.add_decode(8, 18.0)
    m.add_checkpoint(5.0)
    m.add_restore(5.0)
    assert m.checkpoint_overhead([0.5, 0.5], 2) > 0.4


def test_a_negative_measured_slope_never_makes_a_long_verify_cheaper_than_one_row():
    m = CostModel()
    m.add_decode(1, 10.0)
    m.add_decode(2, 9.0)  # noise: two rows measured faster than one
    assert all(m.verify_cost(k) >= 1.0 for k in range(0, 64))
    assert m.verify_cost(40) >= m.verify_cost(1)
