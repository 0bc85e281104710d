"""The referee (llamaspec.referee): speculation judged on the tokens per second it delivered against plain
rounds measured beside it; falls back when it loses, looks again, and comes back within a bounded number of
rounds when the load goes away."""
from __future__ import annotations

import random

import pytest

from llamaspec.referee import Referee, RefereeParams, WindowRate


def drive(ref: Referee, rounds: int, spec_tokens: float, spec_s: float, plain_s: float, n_gen: int = 1,
          noise: float = 0.0, rng: random.Random | None = None, outliers: float = 0.0) -> list[bool]:
    """Run ``rounds`` rounds: a speculative round emits ``spec_tokens`` per slot in ``spec_s`` seconds, a
    plain one 1 token per slot in ``plain_s``; times get multiplicative noise and, with probability
    ``outliers``, a 20x stall. Returns what the referee chose each round."""
    rng = rng or random.Random(0)
    chose = []
    for _ in range(rounds):
        spec = ref.speculate(n_gen)
        chose.append(spec)
        t = spec_s if spec else plain_s
        t *= 1.0 + noise * rng.random()
        if outliers and rng.random() < outliers:
            t *= 20
        ref.record(spec, n_gen, round(spec_tokens * n_gen) if spec else n_gen, t, 1 if spec else 0)
    return chose


def test_keeps_speculating_when_it_pays_and_probes_rarely():
    ref = Referee()
    chose = drive(ref, 400, spec_tokens=4, spec_s=0.02, plain_s=0.01, noise=0.3)
    assert ref.state == Referee.SPEC and ref.n_fallbacks == 0
    assert chose.count(False) / len(chose) < 0.06          # the probes cost a few percent of the rounds
    assert ref.ratio(1) == pytest.approx(2.0, rel=0.25)


def test_falls_back_when_speculation_loses():
    ref = Referee()
    chose = drive(ref, 300, spec_tokens=1.2, spec_s=0.02, plain_s=0.01, noise=0.3)  # 60 tok/s vs 100
    assert ref.n_fallbacks >= 1
    assert chose[100:].count(False) / 200 > 0.7            # mostly plain, with short looks again
    assert ref.ratio(1) < 0.9


def test_robust_to_stalls():
    """1 round in 10 stalls 20x (another process took the core): a speculation that pays 2x stays on."""
    ref = Referee()
    drive(ref, 400, spec_tokens=4, spec_s=0.02, plain_s=0.01, noise=0.2, outliers=0.1)
    assert ref.n_fallbacks == 0 and ref.state == Referee.SPEC


def test_recovers_within_32_rounds_after_the_load_stops():
    ref = Referee()
    # under load: drafting costs as much as it brings, and a bit more
    drive(ref, 300, spec_tokens=2, spec_s=0.05, plain_s=0.02, noise=0.2)
    assert ref.state in (Referee.PLAIN, Referee.PROBE_SPEC) and ref.n_fallbacks >= 1
    # the load stops: speculation pays 2x again
    chose = drive(ref, 64, spec_tokens=4, spec_s=0.02, plain_s=0.01, noise=0.2)
    back = next(i for i in range(len(chose)) if all(chose[i:i + 8]))
    assert back <= 32


def test_batch_sizes_are_judged_apart():
    """Alone a slot's speculation pays; with 8 busy slots it does not: each batch size has its own rates."""
    ref = Referee()
    drive(ref, 200, spec_tokens=4, spec_s=0.02, plain_s=0.01, n_gen=1)
    drive(ref, 200, spec_tokens=1.3, spec_s=0.05, plain_s=0.02, n_gen=8)
    assert ref.ratio(1) > 1.5 and ref.ratio(8) < 1.0
    assert ref.info()["by_slots"]["8"]["n_plain"] >= 2


def test_a_round_without_a_draft_counts_as_plain():
    ref = Referee(RefereeParams(probe_every=1000))
    for _ in range(5):
        assert ref.speculate(1)
        ref.record(True, 1, 1, 0.01, n_drafted=0)
    assert ref.rates(1)[1] == pytest.approx(100.0)


def test_restored_round_time_is_carried():
    """A round that emitted nothing (restored FULL memory) adds its time to the next one."""
    ref = Referee(RefereeParams(probe_every=1000))
    ref.record(True, 1, 0, 0.01)
    ref.record(True, 1, 2, 0.01)
    assert ref.rates(1)[0] == pytest.approx(100.0)


def test_window_rate_and_spread():
    w = WindowRate(4)
    assert w.rate() is None and w.spread() is None
    for t in (0.01, 0.011, 0.009, 0.01):
        w.add(1, t)
    assert w.spread() < 0.1
    w.add(1, 0.03)
    w.add(1, 0.003)
    assert w.spread() > 0.3


def test_unknown_setting():
    with pytest.raises(TypeError, match="unknown referee setting"):
        Referee(probe_evry=3)
