"""Verification cores (spec §8.1, beyond-vendored §1-2): sample-and-match, replay, rejection sampling,
llama.cpp's sampler pipeline as probabilities. No model needed."""
from __future__ import annotations

import doctest
import math

import numpy as np
import pytest

import llamaspec.verify.rules
import llamaspec.verify.verifiers
import reference_probs
from llamaspec.synth import Mt19937Uniform
from llamaspec.verify import (
    VerifyResult,
    rejection_verify,
    replay,
    sample_and_match,
    sample_from_probs,
)
from reference_probs import draft_probs, probs_from_logits


def test_doctests():
    attempted = 0
    for mod in (llamaspec.verify.rules, reference_probs, llamaspec.verify.verifiers):
        res = doctest.testmod(mod)
        assert res.failed == 0, mod.__name__
        attempted += res.attempted
    assert attempted > 15


# ---------------------------------------------------------------------------------------------- sample-and-match


@pytest.mark.parametrize(
    "draft, picks, eog, out",
    [
        ([5, 6, 7], [5, 6, 7, 8], (), [5, 6, 7, 8]),   # all accepted + bonus
        ([5, 6, 7], [5, 9, 7, 8], (), [5, 9]),         # first mismatch at position 1
        ([5, 6, 7], [1, 6, 7, 8], (), [1]),            # mismatch at position 0
        ([5, 6, 7], [5, 6, 3, 8], (), [5, 6, 3]),      # mismatch at the last position: no bonus
        ([5, 2, 7], [5, 2, 7, 8], (2,), [5, 2]),       # matched EOG before the last position stops
        ([5, 6, 2], [5, 6, 2, 8], (2,), [5, 6, 2, 8]),  # EOG at the last position: bonus still sampled
        ([2], [2, 8], (2,), [2, 8]),
        ([], [4], (), [4]),                            # empty draft: one plain sample
        ([5], [6], (6,), [6]),                         # mismatching EOG: stops as a mismatch
    ],
)
def test_sample_and_match_table(draft, picks, eog, out):
    rows = []

    def sample_row(i):
        rows.append(i)
        return picks[i]

    got = sample_and_match(sample_row, lambda t: t in eog, draft)
    assert got == out
    assert rows == list(range(len(out)))  # rows sampled in order, once each, only as far as needed
    assert 1 <= len(got) <= len(draft) + 1


# ---------------------------------------------------------------------------------------------- replay


@pytest.mark.parametrize("known", [[11], [11, 12], [11, 12, 13, 14]])
def test_replay_keeps_known_and_samples_last_row(known):
    calls = []
    got = replay(lambda i, t: calls.append(("advance", i, t)), lambda i: calls.append(("sample", i)) or 99, known)
    assert got == known + [99]
    assert calls == [("advance", i, t) for i, t in enumerate(known)] + [("sample", len(known))]


def test_replay_ignores_what_advance_returns():
    # the row's own pick may differ (batch-shape logit noise): the known token still wins
    assert replay(lambda i, t: t + 1, lambda i: 7, [3, 4]) == [3, 4, 7]


def test_replay_empty_known():
    assert replay(lambda i, t: None, lambda i: 5, []) == [5]


def test_replay_after_match_reproduces_first_pass():
    """A partial acceptance then a replay with a restored sampler gives the first pass's tokens + 1 more."""
    picks_by_row = [5, 9, 1, 3]  # the target's picks for rows 0..3 (deterministic)
    first = sample_and_match(lambda i: picks_by_row[i], lambda t: False, [5, 6, 7])
    assert first == [5, 9]
    again = replay(lambda i, t: None, lambda i: picks_by_row[i], first)
    assert again == [5, 9, 1]


# ---------------------------------------------------------------------------------------------- sample_from_probs


def test_sample_from_probs_never_picks_zero_weight():
    p = np.array([0.0, 0.3, 0.0, 0.0, 0.7, 0.0])
    us = np.linspace(0.0, 1.0, 1001)[:-1]
    picks = {sample_from_probs(p, u) for u in us}
    assert picks == {1, 4}
    assert sample_from_probs(p, math.nextafter(1.0, 0.0)) == 4
    assert sample_from_probs(np.array([2.0, 0.0, 2.0]), 0.5) == 2  # unnormalised weights


def test_sample_from_probs_zero_total():
    with pytest.raises(ValueError, match="sum to zero"):
        sample_from_probs(np.zeros(3), 0.5)


# ---------------------------------------------------------------------------------------------- rejection sampling

# tiny vocabulary, fixed target rows (the "target model" ignores the prefix) and a deliberately different draft
V = 6
P_TGT = np.array(
    [
        [0.30, 0.25, 0.15, 0.12, 0.10, 0.08],
        [0.05, 0.40, 0.20, 0.15, 0.10, 0.10],
        [0.10, 0.10, 0.10, 0.20, 0.20, 0.30],
        [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],
    ]
)
P_DFT = [
    np.array([0.05, 0.10, 0.50, 0.05, 0.25, 0.05]),
    np.array([0.40, 0.05, 0.05, 0.30, 0.10, 0.10]),
    np.array([0.30, 0.30, 0.10, 0.10, 0.10, 0.10]),
]
N_RUNS = 20_000
# chi-square critical values at p = 0.001 (scipy.stats.chi2.ppf(0.999, df))
CHI2_CRIT_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic over the cells with positive probability, and its degrees of freedom."""
    keep = probs > 0
    n = counts.sum()
    expected = n * probs[keep] / probs[keep].sum()
    assert counts[~keep].sum() == 0, "a token with probability 0 was emitted"
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum() - 1)


def run_rounds(p_tgt, p_dft, n_runs=N_RUNS):
    """One verification round per seed: the draft tokens are sampled from p_dft with the draft's own stream
    (seed XOR 0x85ebca6b, as the retuned draft sampler), the decisions use the target's stream (seed)."""
    results = []
    u_tgt, u_dft = Mt19937Uniform(0), Mt19937Uniform(0)
    for seed in range(n_runs):
        u_tgt.reseed(seed)
        u_dft.reseed(seed ^ 0x85EBCA6B)
        draft = [sample_from_probs(q, u_dft.next()) for q in p_dft]
        results.append(rejection_verify(p_tgt, draft, p_dft, u_tgt))
    return results


@pytest.fixture(scope="module")
def rounds():
    return run_rounds(P_TGT, P_DFT)


def test_rejection_first_token_follows_target(rounds):
    counts = np.bincount([r.tokens[0] for r in rounds], minlength=V)
    stat, df = chi_square(counts, P_TGT[0])
    assert stat < CHI2_CRIT_999[df], (stat, counts)


def test_rejection_later_tokens_follow_target(rounds):
    """Given that a position is reached, the token emitted there (accepted, recovered or bonus) follows
    that row's target distribution too."""
    for pos in (1, 2, 3):
        toks = [r.tokens[pos] for r in rounds if len(r.tokens) > pos]
        assert len(toks) > 500
        stat, df = chi_square(np.bincount(toks, minlength=V), P_TGT[pos])
        assert stat < CHI2_CRIT_999[df], (pos, stat)


def test_rejection_result_shape(rounds):
    n_acc = np.array([r.n_accepted for r in rounds])
    for r in rounds:
        assert len(r.tokens) == r.n_accepted + 1
        assert r.recovered != r.bonus
        assert r.bonus == (r.n_accepted == 3)
    # P(accept at 0) = sum(min(p, q)) over tokens
    p_acc0 = np.minimum(P_TGT[0], P_DFT[0]).sum()
    assert abs((n_acc > 0).mean() - p_acc0) < 4 * math.sqrt(p_acc0 * (1 - p_acc0) / N_RUNS)


def test_rejection_draft_equals_target_accepts_everything():
    p_dft = [P_TGT[i].copy() for i in range(3)]
    for r in run_rounds(P_TGT, p_dft, n_runs=500):
        assert r.n_accepted == 3 and r.bonus and not r.recovered and len(r.tokens) == 4


def test_rejection_grammar_masked_target():
    """A grammar is part of the target's distribution (TargetSampler.probs: zero outside what it allows,
    renormalised), not of the draft's: the emitted token follows the masked target, and a forbidden token the
    draft proposes is never emitted."""
    mask0 = np.array([True, False, True, True, False, True])  # the grammar forbids tokens 1 and 4 at row 0
    masked = np.where(mask0, P_TGT[0], 0.0)
    p_tgt = np.vstack([masked / masked.sum(), P_TGT[1:]])
    rounds = run_rounds(p_tgt, P_DFT, n_runs=8_000)
    counts = np.bincount([r.tokens[0] for r in rounds], minlength=V)
    stat, df = chi_square(counts, p_tgt[0])
    assert df == 3 and stat < CHI2_CRIT_999[df], (stat, counts)
    # token 4 has p_dft = 0.25 but is forbidden: it is never accepted
    assert counts[4] == 0 and counts[1] == 0


def test_rejection_uniform_budget_and_determinism():
    draws = []

    def uniform():
        draws.append(0.999)  # rejects every draft token whose ratio is below 1
        return 0.999

    res = rejection_verify(P_TGT, [2, 0, 0], P_DFT, uniform)
    # token 2 at row 0: p_tgt 0.15 < p_dft 0.5 -> rejected; one test draw + one residual draw
    assert res.n_accepted == 0 and res.recovered and len(draws) == 2
    again = rejection_verify(P_TGT, [2, 0, 0], P_DFT, lambda: 0.999)
    assert again == res

    draws.clear()
    # token 0 at row 0 (ratio 6) and token 1 at row 1 (ratio 8) and 0 at row 2 (ratio 1/3): two accepted
    res = rejection_verify(P_TGT, [0, 1, 0], P_DFT, uniform)
    assert res.tokens[:2] == [0, 1] and res.n_accepted == 2 and res.recovered and len(draws) == 4


def test_rejection_accept_callback_runs_before_next_row():
    log = []

    def row(i):
        log.append(("row", i))
        return P_TGT[i]

    res = rejection_verify(row, [0, 1], P_DFT[:2], lambda: 0.0, accept=lambda t: log.append(("accept", t)))
    assert res == VerifyResult(tokens=[0, 1, 0], n_accepted=2, recovered=False, bonus=True)
    assert log == [("row", 0), ("accept", 0), ("row", 1), ("accept", 1), ("row", 2), ("accept", 0)]


def test_rejection_stops_at_accepted_eog_before_last():
    res = rejection_verify(P_TGT, [0, 1, 0], P_DFT, lambda: 0.0, is_eog=lambda t: t == 1)
    assert res == VerifyResult(tokens=[0, 1], n_accepted=2, recovered=False, bonus=False)
    # at the last position an accepted EOG still gets its bonus (as sample-and-match does)
    res = rejection_verify(P_TGT, [0, 1], P_DFT[:2], lambda: 0.0, is_eog=lambda t: t == 1)
    assert res.bonus and res.tokens[:2] == [0, 1]


def test_rejection_empty_draft_is_a_plain_sample():
    assert rejection_verify(P_TGT[:1], [], [], lambda: 0.5) == VerifyResult([1], 0, False, True)


def test_rejection_temperature_zero_equals_match():
    """Point masses: min(1, p/q) is 0 or 1, so the outcome is sample-and-match's."""
    rows = np.eye(V)[[2, 3, 5, 1]]
    for draft in ([2, 3, 5], [2, 4, 5], [0, 3, 5], [2, 3, 0]):
        dft = [np.eye(V)[t] for t in draft]
        res = rejection_verify(rows, draft, dft, Mt19937Uniform(3))
        assert res.tokens == sample_and_match(lambda i: [2, 3, 5, 1][i], lambda t: False, draft)


def test_rejection_input_errors():
    with pytest.raises(ValueError, match="2 p_dft vectors for a draft of 3"):
        rejection_verify(P_TGT, [0, 1, 2], P_DFT[:2], lambda: 0.5)
    with pytest.raises(ValueError, match="p_dft = 0; it must be sampled from p_dft"):
        rejection_verify(P_TGT, [1], [np.array([1.0, 0, 0, 0, 0, 0])], lambda: 0.5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rejection_verify(P_TGT, [9], [np.ones(V)], lambda: 0.5)
    # vocabularies of different sizes (padded): ids are compared, not positions
    assert rejection_verify(P_TGT, [1], [np.ones(3)], lambda: 0.0).n_accepted == 1
    with pytest.raises(ValueError, match="p_tgt of row 0 has no mass"):
        rejection_verify(np.zeros((2, 3)), [0], [np.ones(3)], lambda: 0.5)


def test_rejection_sparse_equals_dense():
    """Sparse (ids, probs) rows give exactly the dense result for the same uniforms."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        p = rng.dirichlet(np.ones(V) * 0.3, size=4) * (rng.random((4, V)) > 0.3)
        p[:, 0] += 1e-3
        q = [rng.dirichlet(np.ones(V)) for _ in range(3)]
        draft = [int(rng.choice(V, p=qi)) for qi in q]
        us = rng.random(8)
        dense = rejection_verify(p, draft, q, iter(us).__next__)
        sp = [(np.flatnonzero(r)[::-1], r[np.flatnonzero(r)[::-1]]) for r in p]
        sq = [(np.arange(V), qi) for qi in q]
        assert rejection_verify(sp, draft, sq, iter(us).__next__) == dense


# ---------------------------------------------------------------------------------------------- probs from logits


def test_probs_from_logits_grammar_first():
    logits = np.log(np.array([0.5, 0.3, 0.1, 0.1]))
    p = probs_from_logits(logits, 1.0, top_k=0, top_p=1.0, min_p=0.0, mask=np.array([False, True, True, False]))
    assert p == pytest.approx([0.0, 0.75, 0.25, 0.0])
    # min-p is then relative to the best *allowed* token
    p = probs_from_logits(logits, 1.0, top_k=0, top_p=1.0, min_p=0.5, mask=np.array([False, True, True, False]))
    assert p == pytest.approx([0.0, 1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="allows no token"):
        probs_from_logits(logits, 1.0, mask=np.zeros(4, bool))


def test_probs_from_logits_filters_at_temperature_one():
    """top-p and min-p look at temperature-1 probabilities; the temperature reshapes only what is left."""
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    p = probs_from_logits(logits, 2.0, top_k=0, top_p=0.85, min_p=0.0)
    assert p[2] == 0.0  # 0.6 + 0.3 >= 0.85 at temperature 1 (at temperature 2 it would need all three)
    assert p[:2] == pytest.approx(np.sqrt([0.6, 0.3]) / np.sqrt([0.6, 0.3]).sum())


def test_probs_from_logits_top_p_float_sum():
    """The cumulative sum is a float32 sum, as in llama.cpp: 0.5 + 0.3 from logits lands just below 0.8."""
    logits = np.log(np.array([0.05, 0.5, 0.3, 0.1, 0.05]))
    p = probs_from_logits(logits, 1.0, top_k=0, top_p=0.8, min_p=0.0)
    assert (p > 0).sum() == 3


def test_probs_from_logits_min_keep_and_greedy():
    logits = np.array([0.0, 5.0, 1.0])
    assert (probs_from_logits(logits, 1.0, top_k=0, top_p=0.01, min_p=0.0) > 0).sum() == 1  # min_keep = 1
    assert (probs_from_logits(logits, 1.0, top_k=0, top_p=1.0, min_p=1.0) > 0).sum() == 1
    assert probs_from_logits(logits, -1.0).tolist() == [0.0, 1.0, 0.0]
    assert probs_from_logits(logits, 1.0, top_k=1).tolist() == [0.0, 1.0, 0.0]


def test_draft_probs():
    logits = np.array([1.0, 3.0, 2.0, 0.0])
    p = draft_probs(logits, 1.0, top_k=2)
    assert p[[0, 3]].tolist() == [0.0, 0.0] and p.sum() == pytest.approx(1.0)
    assert p[1] / p[2] == pytest.approx(math.e)
    assert draft_probs(logits, 0.0, top_k=10).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert (draft_probs(logits, 1.0, top_k=0) > 0).all()


def _llama_cpp_probs(C, logits, temp, top_k, top_p, min_p):
    """Apply llama.cpp's own chain (the engine's order) to a candidate array; return p by token id."""
    import ctypes

    n = len(logits)
    arr = (C.llama_token_data * n)()
    for i, v in enumerate(logits):
        arr[i].id, arr[i].logit, arr[i].p = i, float(v), 0.0
    cur = C.llama_token_data_array(data=ctypes.cast(arr, ctypes.POINTER(C.llama_token_data)), size=n, selected=-1, sorted=False)
    chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
    try:
        if top_k > 0:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_k(top_k))
        if top_p < 1.0:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_p(top_p, 1))
        if min_p > 0.0:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_min_p(min_p, 1))
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_temp(temp))
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_dist(1))
        C.llama_sampler_apply(chain, ctypes.byref(cur))
    finally:
        C.llama_sampler_free(chain)
    out = np.zeros(n)
    for i in range(cur.size):
        out[arr[i].id] = arr[i].p
    return out


def test_probs_from_logits_matches_llama_cpp_chain():
    """Cross-check against the vendored samplers (no model needed); logits without ties."""
    C = pytest.importorskip("llama_cpp")
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.choice([5, 40, 300, 1500]))
        logits = (rng.standard_normal(n) * rng.choice([0.5, 2.0, 5.0])).astype(np.float32)
        temp = float(rng.choice([0.0, 0.3, 0.8, 1.0, 1.7]))
        top_k = int(rng.choice([0, 1, 3, 10, 40, 5000]))
        top_p = float(rng.choice([1.0, 0.95, 0.9, 0.5, 0.1]))
        min_p = float(rng.choice([0.0, 0.05, 0.1, 0.5]))
        want = _llama_cpp_probs(C, logits, temp, top_k, top_p, min_p)
        got = probs_from_logits(logits, temp, top_k, top_p, min_p)
        assert np.array_equal(want > 0, got > 0), (n, temp, top_k, top_p, min_p)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
