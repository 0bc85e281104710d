"""Synthetic acceptance (spec §2.2, §2.3, §8.2): flag parsing, rate resolution, mt19937 stream, synth_accept."""
from __future__ import annotations

import doctest
import math

import pytest

import llamaspec.synth as synth
from llamaspec.errors import UsageError
from llamaspec.synth import (
    Mt19937Uniform,
    conditional_probs,
    parse_synth_len,
    parse_synth_rates,
    resolve_synth_rates,
    synth_accept,
)


def mean_acceptance_length(rates) -> float:
    """Expected tokens per round, target token included."""
    return 1.0 + float(sum(rates))


def test_doctests():
    res = doctest.testmod(synth)
    assert res.failed == 0 and res.attempted > 10


# ---------------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "text, value",
    [("2.5", 2.5), ("3", 3.0), ("  1.25", 1.25), ("+2", 2.0), ("1e0", 1.0), (".5", 0.5), ("0x1.8p1", 3.0), ("-0.5", -0.5)],
)
def test_parse_synth_len_ok(text, value):
    assert parse_synth_len(text) == value


def test_parse_synth_len_non_finite_parses_and_resolution_rejects():
    assert math.isinf(parse_synth_len("inf")) and math.isnan(parse_synth_len("nan"))
    for v in (math.inf, math.nan):
        with pytest.raises(UsageError, match="--spec-synth-len.*between 1 and n_max \\+ 1 = 4"):
            resolve_synth_rates(v, [], 3)


@pytest.mark.parametrize("text", ["", "abc", "1.5x", "2 ", "1_0", "1,5", "--1", "0x"])
def test_parse_synth_len_rejects_partial_numbers(text):
    with pytest.raises(UsageError, match="--spec-synth-len: .* is not a number"):
        parse_synth_len(text)


@pytest.mark.parametrize("text", ["-1", "-1.0", "-1e0", "-0x1p0"])
def test_parse_synth_len_rejects_unset_sentinel(text):
    with pytest.raises(UsageError, match="--spec-synth-len: -1 is reserved"):
        parse_synth_len(text)


@pytest.mark.parametrize(
    "text, value",
    [("0.9", [0.9]), ("0.9,0.5", [0.9, 0.5]), (" 0.9 , 0.5\t,0 ", [0.9, 0.5, 0.0]), ("1,1e-1", [1.0, 0.1])],
)
def test_parse_synth_rates_ok(text, value):
    assert parse_synth_rates(text) == value


@pytest.mark.parametrize(
    "text, msg",
    [("", "item 1 is empty"), ("0.9,", "item 2 is empty"), ("0.9,,0.1", "item 2 is empty"),
     ("0.9,x", "item 2 \\('x'\\) is not a number"), ("0.9,0.5y", "item 2 \\('0.5y'\\) is not a number")],
)
def test_parse_synth_rates_errors(text, msg):
    with pytest.raises(UsageError, match="--spec-synth-rates: " + msg):
        parse_synth_rates(text)


# ---------------------------------------------------------------------------------------------- resolution


def _reference_bisection(L: float, n: int) -> float:
    lo, hi = 0.0, 1.0
    for _ in range(32):
        mid = (lo + hi) / 2
        if sum(mid**k for k in range(1, n + 1)) < L - 1:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@pytest.mark.parametrize("synth_len, rates", [(-1.0, []), (None, None), (-1.0, None), (None, [])])
def test_resolve_neither_set(synth_len, rates):
    assert resolve_synth_rates(synth_len, rates, 3) is None
    assert resolve_synth_rates(synth_len, rates, 0) is None  # n_max is only checked when synth is asked for


def test_resolve_both_set():
    with pytest.raises(UsageError, match="--spec-synth-len and --spec-synth-rates are mutually exclusive"):
        resolve_synth_rates(2.0, [0.5, 0.2], 2)


@pytest.mark.parametrize("n_max", [0, -1])
@pytest.mark.parametrize("synth_len, rates, flag", [(2.0, [], "--spec-synth-len"), (-1.0, [0.5], "--spec-synth-rates")])
def test_resolve_needs_positive_n_max(n_max, synth_len, rates, flag):
    with pytest.raises(UsageError, match=f"{flag} needs a drafter .* n_max is {n_max}, it must be at least 1"):
        resolve_synth_rates(synth_len, rates, n_max)


@pytest.mark.parametrize(
    "rates, msg",
    [([0.5], "got 1 rates, need exactly n_max = 2"),
     ([0.5, 0.4, 0.3], "got 3 rates, need exactly n_max = 2"),
     ([1.5, 0.4], "item 1 = 1.5 is outside \\[0, 1\\]"),
     ([0.5, -0.1], "item 2 = -0.1 is outside \\[0, 1\\]"),
     ([math.nan, 0.1], "item 1 = nan is outside"),
     ([math.inf, 0.1], "item 1 = inf is outside"),
     ([0.4, 0.5], "rates must not increase \\(item 2 = 0.5 > item 1 = 0.4\\)")],
)
def test_resolve_rates_errors(rates, msg):
    with pytest.raises(UsageError, match="--spec-synth-rates: " + msg):
        resolve_synth_rates(-1.0, rates, 2)


@pytest.mark.parametrize("rates", [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.9, 0.9, 0.2], [0.8, 0.5, 0.0]])
def test_resolve_rates_ok(rates):
    assert resolve_synth_rates(-1.0, rates, 3) == rates


@pytest.mark.parametrize("L", [0.0, 0.999, 4.0001, 10.0, -3.0])
def test_resolve_len_out_of_range(L):
    with pytest.raises(UsageError, match=f"--spec-synth-len: {L} is out of range.*between 1 and n_max \\+ 1 = 4"):
        resolve_synth_rates(L, [], 3)


def test_resolve_len_ends():
    assert resolve_synth_rates(4.0, [], 3) == [1.0, 1.0, 1.0]
    assert resolve_synth_rates(1.0, [], 3) == [0.0, 0.0, 0.0]
    assert resolve_synth_rates(2.0, [], 1) == [1.0]
    assert resolve_synth_rates(1.0, [], 1) == [0.0]


@pytest.mark.parametrize(
    "L, n_max, p, tol",
    [(2.0, 2, (math.sqrt(5) - 1) / 2, 2.0**-32),  # p + p^2 = 1: the golden ratio's inverse
     (1.5, 1, 0.5, 2.0**-32),                      # S(p) = p
     (2.5, 3, 0.69141398, 1e-8),
     (3.0, 8, 0.67656769, 1e-8)],
)
def test_resolve_len_bisection(L, n_max, p, tol):
    rates = resolve_synth_rates(L, [], n_max)
    assert len(rates) == n_max
    assert rates[0] == _reference_bisection(L, n_max)  # the exact 32-step midpoint
    assert abs(rates[0] - p) <= tol
    assert rates == pytest.approx([rates[0] ** k for k in range(1, n_max + 1)], rel=1e-12)
    assert mean_acceptance_length(rates) == pytest.approx(L, abs=1e-8)


def test_bisection_is_midpoint_of_final_interval():
    # with n_max = 1 S(p) = p, so the final interval brackets L-1 and the midpoint lies within 2^-33 of it
    for L in (1.1, 1.3, 1.77, 1.999):
        p = resolve_synth_rates(L, [], 1)[0]
        assert abs(p - (L - 1)) <= 2.0**-33
        k = round(p * 2.0**33)
        assert p * 2.0**33 == k and k % 2 == 1  # a midpoint: an odd multiple of 2^-33


def test_conditional_probs_and_mean():
    assert conditional_probs([0.8, 0.4, 0.1]) == pytest.approx([0.8, 0.5, 0.25])
    assert conditional_probs([0.0, 0.0]) == [0.0, 0.0]
    assert conditional_probs([1.0, 0.0, 0.0]) == [1.0, 0.0, 0.0]
    assert conditional_probs([]) == []
    assert mean_acceptance_length([0.8, 0.4, 0.1]) == pytest.approx(2.3)
    assert mean_acceptance_length([]) == 1.0
    rates = resolve_synth_rates(2.5, [], 4)
    assert conditional_probs(rates) == pytest.approx([rates[0]] * 4)


# ---------------------------------------------------------------------------------------------- mt19937


def test_mt19937_matches_std_default_seed():
    u = Mt19937Uniform(5489)  # std::mt19937's default seed
    outs = [u.next_u32() for _ in range(10000)]
    assert outs[0] == 3499211612
    assert outs[9999] == 4123659995  # the C++ standard's check value for mt19937 ([rand.predef])


def test_mt19937_uniform_is_two_draws_low_then_high():
    raw = Mt19937Uniform(1234)
    a, b = raw.next_u32(), raw.next_u32()
    assert Mt19937Uniform(1234).next() == (a + b * 2.0**32) / 2.0**64
    assert Mt19937Uniform(5489).next() == (3499211612 + 581869302 * 2.0**32) / 2.0**64


def test_mt19937_uniform_clamps_below_one():
    class AllOnes:
        def random_raw(self):
            return 0xFFFFFFFF

    u = Mt19937Uniform(1)
    u._bg = AllOnes()
    x = u.next()
    assert x < 1.0 and x == math.nextafter(1.0, 0.0)


def test_mt19937_seeds():
    assert Mt19937Uniform(7).next() == Mt19937Uniform(7).next()
    assert Mt19937Uniform(7).next() != Mt19937Uniform(8).next()
    r = Mt19937Uniform(0xFFFFFFFF)  # random sentinel: some real seed is chosen
    assert 0 <= r.seed <= 0xFFFFFFFF and 0.0 <= r.next() < 1.0
    for bad in (-1, 2**32):
        with pytest.raises(UsageError, match="seed must be in"):
            Mt19937Uniform(bad)


def test_mt19937_reseed_restarts_the_stream():
    u = Mt19937Uniform(11)
    first = [u.next() for _ in range(3)]
    u.reseed(12)
    assert u.seed == 12 and u.next() == Mt19937Uniform(12).next()
    u.reseed(11)
    assert [u.next() for _ in range(3)] == first
    with pytest.raises(UsageError, match="seed must be in"):
        u.reseed(-5)


def test_mt19937_call_is_next():
    u, c = Mt19937Uniform(99), Mt19937Uniform(99)
    assert [u() for _ in range(5)] == [c.next() for _ in range(5)]


# ---------------------------------------------------------------------------------------------- synth_accept


class CountingRng:
    """Stands in for Mt19937Uniform: returns scripted uniforms and counts draws."""

    def __init__(self, values):
        self.values = list(values)
        self.draws = 0

    def next(self):
        self.draws += 1
        return self.values.pop(0)


def run_synth(draft, cond, rng, is_replay, picks=None, eog=()):
    picks = picks or [100 + i for i in range(len(draft) + 1)]
    sampled, accepted = [], []

    def sample_row(i):
        sampled.append(i)
        return picks[i]

    out = synth_accept(sample_row, lambda t: t in eog, lambda t, g: accepted.append((t, g)), draft, cond, rng, is_replay)
    return out, sampled, accepted


@pytest.mark.parametrize(
    "draft, cond, uniforms, out, sampled, accepted, draws",
    [
        # all accepted (u < cond) -> bonus from row d
        ([1, 2, 3], [0.5, 0.5, 0.5], [0.1, 0.2, 0.3], [1, 2, 3, 103], [0, 1, 2, 3],
         [(1, False), (2, False), (3, False), (103, True)], 3),
        # rejected at position 1 (u >= cond): the target's pick of row 1 is emitted
        ([1, 2, 3], [0.5, 0.5, 0.5], [0.1, 0.5], [1, 101], [0, 1], [(1, False), (101, True)], 2),
        # rejected at position 0
        ([1, 2], [0.0, 1.0], [0.0], [100], [0], [(100, True)], 1),
        # empty draft: one sampled token, no draw
        ([], [], [], [100], [0], [(100, True)], 0),
        # cond may be longer than the draft
        ([1], [1.0, 1.0, 1.0], [0.99], [1, 101], [0, 1], [(1, False), (101, True)], 1),
    ],
)
def test_synth_accept_table(draft, cond, uniforms, out, sampled, accepted, draws):
    rng = CountingRng(uniforms)
    got, got_sampled, got_accepted = run_synth(draft, cond, rng, False)
    assert (got, got_sampled, got_accepted, rng.draws) == (out, sampled, accepted, draws)


def test_synth_accept_eog_draft_token_not_accepted():
    rng = CountingRng([0.0, 0.0])
    got, sampled, accepted = run_synth([1, 2, 3], [1.0, 1.0, 1.0], rng, False, eog={2})
    assert got == [1, 101] and accepted == [(1, False), (101, True)]
    assert rng.draws == 2  # the draw happens before the EOG test


def test_synth_accept_replay_takes_no_draws():
    rng = CountingRng([])
    got, sampled, accepted = run_synth([1, 2, 3], [0.0, 0.0, 0.0], rng, True, eog={2})
    assert got == [1, 2, 3, 103]
    assert sampled == [0, 1, 2, 3]  # every row still sampled (advances the target sampler)
    assert accepted == [(1, False), (2, False), (3, True), (103, True)]  # last replayed token is the target's
    assert rng.draws == 0


def test_synth_accept_with_real_stream_is_reproducible():
    cond = conditional_probs(resolve_synth_rates(2.5, [], 4))
    runs = [run_synth([1, 2, 3, 4], cond, Mt19937Uniform(42), False)[0] for _ in range(2)]
    assert runs[0] == runs[1]
    u = Mt19937Uniform(42)
    expect_n = 0
    while expect_n < 4 and u.next() < cond[expect_n]:
        expect_n += 1
    assert len(runs[0]) == expect_n + 1


def test_synth_accept_short_cond():
    with pytest.raises(ValueError, match="2 conditional probabilities for a draft of 3"):
        run_synth([1, 2, 3], [1.0, 1.0], CountingRng([]), False)
