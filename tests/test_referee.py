"""The referee (llamaspec.referee): speculation judged on the tokens per second it delivered against plain
rounds measured beside it; falls back when it loses, looks again, and comes back within a bounded number of
rounds when the load goes away."""
from __future__ import annotations

import math
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


def drive_arms(ref: Referee, rounds: int, arm_rates: dict, plain_rate: float, rng=None, noise=0.2) -> list:
    """Rounds of 10 ms-ish: each arm delivers ``arm_rates[arm]`` tokens per second, plain ``plain_rate``;
    returns the arm (or None for plain) of each round."""
    rng = rng or random.Random(1)
    used = []
    for _ in range(rounds):
        spec = ref.speculate(1)
        rate = arm_rates[ref.arm] if spec else plain_rate
        t = 0.01 * (1.0 + noise * rng.random())
        ref.record(spec, 1, max(1, round(rate * t)), t, 1 if spec else 0)
        used.append(ref.arm if spec else None)
    return used


def test_the_arm_that_delivers_more_takes_over():
    """auto with a draft model: n-gram copies then the model ("all") deliver 300 tok/s, the model alone 500:
    the referee moves the speculative rounds to the model alone, and keeps looking at the other rarely."""
    ref = Referee(arms=("all", "model"))
    assert ref.arm == "all"
    used = drive_arms(ref, 400, {"all": 300, "model": 500}, plain_rate=100)
    assert ref.best_arm == "model" and ref.n_arm_switches >= 1
    assert used[100:].count("model") / 300 > 0.85
    assert ref.info()["arm"] == "model" and set(ref.info()["by_slots"]["1"]["arms_tps"]) == {"all", "model"}


def test_the_arm_in_charge_stays_when_it_wins_and_is_retried_when_the_text_changes():
    ref = Referee(arms=("all", "model"))
    used = drive_arms(ref, 300, {"all": 500, "model": 300}, plain_rate=100)
    assert ref.best_arm == "all" and used[50:].count("model") / 250 < 0.12   # probes back off
    used = drive_arms(ref, 600, {"all": 250, "model": 500}, plain_rate=100)  # now the copies stop paying
    assert ref.best_arm == "model"


def test_a_new_batch_size_is_judged_against_plain_before_arms_are_compared():
    """The arm-probe interval counts over every batch size: when a new size (8 slots) came while an arm probe
    was due, the probe of arms ran there first and put off its first plain probe; a burst of 8 short requests
    under load then ran speculating, unjudged (37.6 tok/s where the next burst, plain, gave 46.9)."""
    ref = Referee(arms=("all", "model"), probe_first=4)
    drive_arms(ref, 200, {"all": 300, "model": 200}, plain_rate=100)  # one slot: arms compared meanwhile
    ref._arm_left = 0  # an arm probe is due when the new size comes
    states = []
    for _ in range(6):
        spec = ref.speculate(8)
        states.append(ref.state)
        ref.record(spec, 8, 8 if not spec else 10, 0.1)
    assert "probe-arm" not in states[:5] and "probe-plain" in states[:6], states


def test_one_arm_never_probes_another():
    ref = Referee()
    used = drive_arms(ref, 200, {"spec": 300}, plain_rate=100)
    assert set(used) <= {"spec", None} and ref.n_arm_switches == 0 and "arm" not in ref.info()


def test_auto_chain_arms_leave_ngram_out_of_the_model_arm():
    from llamaspec.auto import AutoChain
    from llamaspec.drafters.base import Drafter
    from llamaspec.drafters.ngram_lookup import NgramLookup

    class Model(Drafter):
        type = "draft-simple"

    ngram = NgramLookup(1)
    chain = AutoChain(ngram, Model(1), n_seq=1)
    assert chain.arms == ("all", "model")
    assert chain.drafting_impls() == [ngram, chain.gated]
    chain.use_arm("model")
    assert chain.drafting_impls() == [chain.gated]
    chain.use_arm("all")
    assert chain.drafting_impls()[0] is ngram
    assert AutoChain(NgramLookup(1), None, n_seq=1).arms == ("spec",)


def test_a_new_batch_size_is_measured_plainly_within_its_first_rounds():
    """8 slots of a short request last ~15 rounds: the plain reference of a batch size comes after
    ``probe_first`` speculative rounds, so speculation that loses there is stopped while the request lasts."""
    ref = Referee()
    chose = drive(ref, 15, spec_tokens=1.2, spec_s=0.02, plain_s=0.01, n_gen=8)   # loses: 60 tok/s vs 100
    assert False in chose[:8]                       # measured plainly by round 8 (was round 13)
    assert ref.ratio(8) is not None and ref.ratio(8) < 0.9
    assert not any(chose[7:11]) and ref.n_fallbacks == 1   # and fallen back at once, not after the request


def test_each_batch_size_keeps_its_own_decision_when_the_load_moves_between_them():
    """A server's batch size comes and goes (1 client, then 8, then 1 again): what was learned at each size holds
    when it comes back. Alone speculation pays 2x; with 8 slots it loses. Coming back to 8 slots, the referee
    does not speculate for a probe interval learned at 1 slot, and coming back to 1 it does not wait for a retry
    learned at 8."""
    ref = Referee()
    drive(ref, 60, spec_tokens=4, spec_s=0.02, plain_s=0.01, n_gen=1)
    drive(ref, 30, spec_tokens=1.2, spec_s=0.05, plain_s=0.02, n_gen=8)
    for _ in range(3):
        at1 = drive(ref, 20, spec_tokens=4, spec_s=0.02, plain_s=0.01, n_gen=1)
        at8 = drive(ref, 20, spec_tokens=1.2, spec_s=0.05, plain_s=0.02, n_gen=8)
        assert at1.count(False) <= 3, at1   # speculating where it pays (a probe: 3 rounds)
        assert at8.count(True) <= 6, at8    # plain where it loses (a retry: 6 rounds)
    assert ref.ratio(1) > 1.5 and ref.ratio(8) < 0.9


def test_peek_follows_the_batch_size_decision_without_counting():
    """A round with prompt work is not timed; it follows what its batch size decided, and advances nothing."""
    ref = Referee()
    drive(ref, 40, spec_tokens=1.2, spec_s=0.05, plain_s=0.02, n_gen=8)
    assert not ref.peek(8) and ref.peek(1)
    before = ref.info()
    assert [ref.peek(8) for _ in range(50)] == [False] * 50
    assert ref.info() == before


def test_a_clearly_losing_retry_ends_after_its_first_rounds():
    """A retry that delivers half of plain's rate ends after ``abort_after`` rounds, not ``probe_len_spec``."""
    ref = Referee(RefereeParams(budget=1e9))   # (no loss-based wait: the retries come at the doubling interval)
    chose = drive(ref, 200, spec_tokens=1, spec_s=0.02, plain_s=0.01)   # 50 tok/s against 100
    runs, k = [], 0
    for c in chose[8:] + [False]:  # the speculative runs after the first fall-back
        if c:
            k += 1
        elif k:
            runs.append(k)
            k = 0
    assert runs and max(runs) == ref.p.abort_after


def test_a_large_loss_waits_in_proportion():
    """A retry's first round also catches the draft model up on what the plain rounds committed (5 s under load
    for 8 slots where a plain round takes 0.15 s): the next look comes after the loss over ``budget`` plain
    rounds, unclipped. The first fall-back of a batch size clips each round at ``CLIP`` x the median (a new
    request's prompt is caught up once, not every retry)."""
    ref = Referee()

    def spec_rounds(times):
        for t in times:
            assert ref.speculate(8)
            ref.record(True, 8, 12, t, 8)

    def plain_rounds(n):
        chose = []
        for _ in range(n):
            chose.append(ref.speculate(8))
            ref.record(chose[-1], 8, 8, 0.15)
        return chose

    spec_rounds([5.0, 0.3, 0.3, 0.3])
    plain_rounds(3)                                   # the plain probe
    assert ref.n_fallbacks == 1
    rate = 24 / (3 * 0.15)                            # plain: 8 tokens per 0.15 s round
    first = math.ceil((sum(min(t, 0.9) for t in (5.0, 0.3, 0.3, 0.3)) - 48 / rate) / (ref.p.budget * 0.15))  # 5.0 clipped at 3 x 0.3
    assert ref.info()["by_slots"]["8"]["wait"] == first
    assert not any(plain_rounds(first))
    spec_rounds([5.0, 0.3, 0.3])                      # the retry: clearly losing, ended after 3 rounds
    assert ref.info()["by_slots"]["8"]["state"] == Referee.PLAIN
    want = min(ref.p.retry_cap, math.ceil((sum((5.0, 0.3, 0.3)) - 36 / rate) / (ref.p.budget * 0.15)))
    assert ref.info()["by_slots"]["8"]["wait"] == want and want > 2 * first
    assert not any(plain_rounds(want))
    assert ref.speculate(8)                           # and then it looks again


def test_a_larger_batch_size_starts_plainly_where_a_smaller_one_fell_back():
    """Speculation that loses with 4 slots does not pay with 8: a first round with 8 slots starts plainly,
    with the wait learned at 4; a smaller size (1 slot) still starts speculating."""
    ref = Referee()
    drive(ref, 30, spec_tokens=1.2, spec_s=0.05, plain_s=0.02, n_gen=4)
    assert ref.info()["by_slots"]["4"]["state"] in (Referee.PLAIN, Referee.PROBE_SPEC)
    assert not ref.speculate(8)
    assert ref.speculate(1)


def test_a_new_batch_size_waits_as_the_nearest_smaller_one_that_fell_back():
    """Where several smaller sizes fell back, a new size starts plainly with the wait of the nearest one (its
    costs are the closest), not of whichever was seen first."""
    ref = Referee()
    drive(ref, 30, spec_tokens=1.0, spec_s=0.2, plain_s=0.02, n_gen=4)   # a large loss at 4: a long wait
    drive(ref, 30, spec_tokens=1.0, spec_s=0.025, plain_s=0.02, n_gen=1)  # a small loss at 1
    by = ref.info()["by_slots"]
    assert by["4"]["state"] in (Referee.PLAIN, Referee.PROBE_SPEC) and by["1"]["state"] in (Referee.PLAIN, Referee.PROBE_SPEC)
    assert by["4"]["wait"] != by["1"]["wait"]
    assert not ref.speculate(8)
    assert ref.info()["by_slots"]["8"]["wait"] == ref.info()["by_slots"]["4"]["wait"]


def test_a_new_text_on_one_slot_looks_again_soon():
    """A large loss on one prompt sets a long wait; the next request on a lone slot is a new text, so the wait is
    cut to ``retry`` rounds (larger batch sizes keep theirs: their texts do not turn over at once)."""
    ref = Referee()
    drive(ref, 30, spec_tokens=1.0, spec_s=0.2, plain_s=0.02, n_gen=1)
    drive(ref, 30, spec_tokens=1.0, spec_s=0.2, plain_s=0.02, n_gen=4)
    assert ref.info()["by_slots"]["1"]["wait"] > 100 and ref.info()["by_slots"]["4"]["wait"] > 100
    ref.new_text(1)
    chose = drive(ref, ref.p.retry + 1, spec_tokens=4.0, spec_s=0.02, plain_s=0.02, n_gen=1)
    assert chose[-1] and not any(chose[:-1])
    assert not any(drive(ref, ref.p.retry + 1, spec_tokens=4.0, spec_s=0.02, plain_s=0.02, n_gen=4))


def test_a_lone_slots_first_catch_up_is_left_out_of_its_speculative_time():
    """One slot: the draft context's first catch-up in a request (its prompt) is paid once whatever the referee
    decides next, so it is left out of the round's time (``Round._entry_fee``); a later catch-up (after plain
    rounds) stays in, and with several slots every catch-up stays in (new requests' prompts recur there)."""
    from llamaspec.round import Round
    from llamaspec.slot import Slot

    class Chain:
        ms = 300.0

        def catch_up_ms(self):
            return self.ms

    rnd = Round.__new__(Round)
    rnd.chain = Chain()
    one, a, b = Slot(0), Slot(1), Slot(2)
    assert rnd._entry_fee([a, b]) == 0.0                 # several slots: counted in
    assert rnd._entry_fee([one]) == pytest.approx(0.3)   # the request's first catch-up: left out
    assert rnd._entry_fee([one]) == 0.0                  # the next ones: counted in
    one.reset()                                          # a new request in the slot
    rnd.chain.ms = 0.0
    assert rnd._entry_fee([one]) == 0.0 and not one.draft_entered  # n-gram rounds catch nothing up
    rnd.chain.ms = 120.0
    assert rnd._entry_fee([one]) == pytest.approx(0.12)


def test_a_new_text_starts_from_the_first_arm():
    """Which arm wins (n-gram copies then the model, or the model alone) depends on how the text copies itself:
    a lone slot's next request starts from the first arm again (it still gives the model every round the
    copies do not beat it)."""
    r = Referee(arms=("all", "model"))
    r.best_arm = r.arm = "model"
    r.new_text(1)
    assert r.best_arm == r.arm == "all"
    r._arm_probe, r.arm = True, "model"      # an arm probe under way is left alone
    r.new_text(1)
    assert r.arm == "model" and r._arm_probe
