"""ngram-lookup's per-slot calibration and shared-round pricing (issue 25, the ``n4`` trace): a slot whose drafts
stop being accepted drafts less in every match-length bucket, not only in the one that failed, and grows back
when its drafts are accepted again; with several slots drafting in one round a row is priced at its share of
the round; the measured decode curve never makes a longer verify cheaper than a shorter one."""
from __future__ import annotations

import pytest

from llamaspec.adaptive import CostModel, default_verify_cost
from llamaspec.drafters.base import DraftParams
from llamaspec.drafters.ngram_lookup import NgramLookup, NgramLookupParams
from llamaspec.drafters.ngram_rates import Calibration, shared_cost_table

#: a long earlier occurrence (match length 32: the last bucket) and a 7-token one (another bucket)
LONG = list(range(100, 140)) * 2 + list(range(100, 120)), 120
SHORT = list(range(1, 8)) + list(range(200, 260)) + list(range(1, 7)), 7


def _draft(d: NgramLookup, seqs: list[int], query) -> list[list[int]]:
    """One draft call in which the slots ``seqs`` draft for ``query`` (history, id_last)."""
    hist, last = query
    dps = [DraftParams(drafting=j in seqs, n_max=32, prompt=tuple(hist), id_last=last) for j in range(d.n_seq)]
    d.draft(dps)
    return [dps[j].result for j in seqs]


def _drafter(n_seq: int) -> NgramLookup:
    d = NgramLookup(n_seq, NgramLookupParams(pool_tokens=0))
    for j in range(n_seq):
        d.begin(j, [])
    return d


def test_failed_drafts_shrink_every_bucket_and_accepted_ones_grow_them_back():
    d = _drafter(3)
    for _ in range(2):  # slot 0: long copies whose first token fails
        (r,) = _draft(d, [0], LONG)
        assert len(r) > 16
        d.accept(0, 0, False)
    (failing,) = _draft(d, [0], SHORT)   # a bucket slot 0 never drafted from
    (fresh,) = _draft(d, [1], SHORT)     # the same draft for a slot that saw nothing
    d.accept(0, 0, True), d.accept(1, 0, True)
    assert len(fresh) > 12 and 0 < len(failing) <= len(fresh) // 4
    for _ in range(4):  # slot 0's copies are accepted whole again
        (r,) = _draft(d, [0], LONG)
        d.accept(0, len(r), False)
    (back,) = _draft(d, [0], SHORT)
    (fresh,) = _draft(d, [2], SHORT)
    assert len(back) >= len(fresh) > 12


def test_calibration_starts_neutral_and_moves_on_the_odds_scale():
    c = Calibration()
    assert c.ratios() == (1.0, 1.0) and c.prior(0.3, 0.9) == (0.3, 0.9)
    for _ in range(3):  # short matches miss, where the average slot's first tokens pass 35% of the time
        c.update(k=8, n_acc=0, p1=0.35, q=0.9, decay=0.9)
    p1, q = c.prior(0.95, 0.98)  # a long match's prior moves little: a greedy copy keeps its long drafts
    assert 0.85 < p1 < 0.95 and 0.94 < q < 0.98
    p1, q = c.prior(0.5, 0.7)
    assert p1 < 0.3 and q < 0.5


@pytest.mark.parametrize("query", [LONG, SHORT])
def test_busy_rounds_price_rows_at_their_share(query):
    alone = _draft(_drafter(4), [0], query)[0]
    busy = _draft(_drafter(4), [0, 1, 2, 3], query)
    assert len({len(r) for r in busy}) == 1 and 0 < len(busy[0]) < len(alone)


def test_one_slot_prices_with_v_itself():
    v = default_verify_cost
    assert shared_cost_table(v, 32, 1) == [v(k) for k in range(33)]
    t4 = shared_cost_table(v, 32, 4)
    assert t4[0] == 1.0 and all(a < b for a, b in zip(t4, t4[1:]))
    assert t4[8] > v(8)  # a row of one of four slots costs more of that slot's token than a row alone


def test_a_slow_sample_never_prices_a_medium_verify_above_a_long_one():
    m = CostModel()
    m.add_decode(1, 10.0)
    m.add_decode(33, 30.0)
    m.add_decode(12, 4000.0)  # a decode that waited for the CPU, at a row count seen once
    m.add_decode(60, 5.0e4)
    m.add_decode(64, 45.0)
    costs = [m.verify_cost(k) for k in range(80)]
    assert all(a <= b for a, b in zip(costs, costs[1:]))
    assert costs[11] <= costs[32] and costs[59] <= costs[63] < 5.0


def test_slow_decodes_move_the_measured_time_less_than_fast_ones():
    m = CostModel()
    m.add_decode(4, 10.0)
    for _ in range(5):
        m.add_decode(4, 20.0)  # a busy machine
    slow = m.decode_ms[4]
    assert 10.0 < slow < 12.5
    for _ in range(5):
        m.add_decode(4, 10.0)
    assert m.decode_ms[4] < slow - 0.5 * (slow - 10.0)
