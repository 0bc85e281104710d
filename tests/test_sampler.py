"""The target sampler: llama.cpp's common_sampler semantics (grammar apart, generated flag, prompt into the
chain) and its distribution read from llama.cpp's own samplers (tiny models, no real model needed)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from llamaspec import _llama as L
from llamaspec.engine import Engine
from llamaspec.errors import UsageError
from llamaspec.sampler import TargetSampler

from helpers import EXACT
from reference_probs import probs_from_logits

PROMPT = [1, 5, 9, 13, 22, 7]
DIGITS = "root ::= [0-7]+\n"


@pytest.fixture()
def row(tiny_model):
    """A model, a context with PROMPT decoded, the row index of its last token."""
    with L.Model(tiny_model("llama")) as m, L.Context(m, n_ctx=64, **EXACT) as ctx:
        ctx.decode_tokens(PROMPT, 0, 0)
        yield m, ctx, len(PROMPT) - 1


def chi2_ok(counts: np.ndarray, expected_p: np.ndarray) -> bool:
    n = counts.sum()
    exp = expected_p * n
    big = exp >= 5
    chi2 = float((((counts[big] - exp[big]) ** 2) / exp[big]).sum())
    rest_o, rest_e = counts[~big].sum(), exp[~big].sum()
    if rest_e > 0:
        chi2 += (rest_o - rest_e) ** 2 / rest_e
    dof = max(1, int(big.sum()) + (1 if rest_e > 0 else 0) - 1)
    z = ((chi2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return z < 3.09  # p > 0.001


def dense(ids, p, n=64):
    out = np.zeros(n)
    out[ids] = p
    return out


def test_probs_equal_the_numpy_reference(row):
    m, ctx, i = row
    for sp in [dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0), dict(temp=0.7, top_k=10, top_p=0.9, min_p=0.05)]:
        s = TargetSampler(m.vocab, L.SamplingParams(seed=1, **sp))
        ids, p = s.probs(ctx, i)
        ref = probs_from_logits(ctx.logits(i).copy(), sp["temp"], sp["top_k"], sp["top_p"], sp["min_p"])
        assert np.allclose(dense(ids, p), ref, atol=1e-5) and np.all(np.diff(ids) > 0)
        s.close()


@pytest.mark.parametrize("grammar,penalty", [(None, 1.3), (DIGITS, 1.0), (DIGITS, 1.3)])
def test_probs_are_what_sample_draws(row, grammar, penalty):
    """p from probs() (computed on a clone, nothing drawn) equals the frequencies of sample_no_accept on
    the same row, including the grammar's resample path and the penalties of the prompt."""
    m, ctx, i = row
    sp = L.SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7, repeat_penalty=penalty, grammar=grammar)
    s = TargetSampler(m.vocab, sp)
    s.accept_prompt(PROMPT)
    before = s.probs(ctx, i)
    ids, p = s.probs(ctx, i)
    assert np.array_equal(ids, before[0]) and np.allclose(p, before[1])  # probs() draws nothing
    counts = np.zeros(64)
    for _ in range(6000):
        counts[s.sample_no_accept(ctx, i)] += 1
    assert chi2_ok(counts, dense(ids, p))
    if grammar:
        allowed = {t for t in range(64) if set(m.vocab.token_to_piece(t).decode()) <= set("01234567")}
        assert set(np.flatnonzero(counts)) <= allowed
    s.close()


def test_prompt_goes_to_the_chain_not_the_grammar(row):
    m, ctx, i = row
    # a grammar that the prompt's pieces would violate: accepting them into it would leave no valid token
    s = TargetSampler(m.vocab, L.SamplingParams(temp=0.0, grammar='root ::= "3f" [0-9a-f]*\n', repeat_penalty=1.5))
    s.accept_prompt(PROMPT)
    assert m.vocab.token_to_piece(s.sample(ctx, i)) in (b"3", b"3f")  # the grammar starts fresh
    plain = TargetSampler(m.vocab, L.SamplingParams(temp=0.0, repeat_penalty=1.5))
    no_prompt = TargetSampler(m.vocab, L.SamplingParams(temp=0.0, repeat_penalty=1.5))
    plain.accept_prompt(PROMPT)
    ref = np.array(ctx.logits(i), dtype=np.float64)
    for t in set(PROMPT):  # llama.cpp's repeat penalty on the prompt's tokens
        ref[t] = ref[t] / 1.5 if ref[t] > 0 else ref[t] * 1.5
    assert plain.sample(ctx, i) == int(np.argmax(ref))
    assert no_prompt.sample(ctx, i) == int(np.argmax(ctx.logits(i)))
    for x in (s, plain, no_prompt):
        x.close()


def test_synthetic_tokens_do_not_advance_the_grammar(row):
    m, ctx, i = row
    s = TargetSampler(m.vocab, L.SamplingParams(temp=0.0, grammar='root ::= "1" "2"\n'))
    s.accept(63, generated=False)  # "3f": the grammar would reject it; as not generated it never sees it
    assert s.grammar.allowed(np.array([1, 2])).tolist() == [True, False]
    s.accept(1, generated=True)
    assert s.grammar.allowed(np.array([1, 2])).tolist() == [False, True]
    s.close()


def test_clone_and_copy_keep_grammar_and_random_state(row):
    m, ctx, i = row
    s = TargetSampler(m.vocab, L.SamplingParams(temp=1.0, seed=11, grammar=DIGITS))
    c = s.clone()
    a = [s.sample(ctx, i) for _ in range(20)]
    s.copy_from(c)
    assert [s.sample(ctx, i) for _ in range(20)] == a
    for x in (s, c):
        x.close()


def test_rejection_with_penalties_and_grammar_matches_target_distribution(tiny_model):
    """Two tokens through the engine in rejection mode (the second verified against a different draft):
    their joint distribution equals the target sampler's, penalties and grammar included."""
    sp = dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.3, grammar=DIGITS)
    prompt = PROMPT[:4]
    expected = np.zeros((64, 64))
    with L.Model(tiny_model("llama")) as m, L.Context(m, n_ctx=64, **EXACT) as ctx:
        ctx.decode_tokens(prompt, 0, 0)
        s = TargetSampler(m.vocab, L.SamplingParams(seed=1, **sp))
        s.accept_prompt(prompt)
        ids1, p1 = s.probs(ctx, len(prompt) - 1)
        for t, pt in zip(ids1, p1):
            c = s.clone()
            c.accept(int(t))
            ctx.memory.seq_rm(0, len(prompt), -1)
            ctx.decode([L.Row(int(t), len(prompt), 0, True)])
            ids2, p2 = c.probs(ctx, 0)
            expected[t, ids2] = pt * p2
            c.close()
        s.close()
    n = 2500
    counts = np.zeros((64, 64))
    spec = __import__("llamaspec.params", fromlist=["SpecParams"]).SpecParams()
    spec.draft.n_max = 2
    spec.draft_adaptive = False  # every round drafts: the test counts drafted tokens
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec, verify="rejection", n_ctx=64,
                **EXACT) as e:
        drafted = 0
        for seed in range(n):
            r = e.generate(prompt, n_predict=3, sampling=L.SamplingParams(seed=seed, **sp))
            counts[r.tokens[0], r.tokens[1]] += 1
            drafted += r.stats.n_drafted
    assert drafted > n // 2
    assert chi2_ok(counts.ravel(), expected.ravel())


@pytest.mark.parametrize("verify", ["match", "rejection"])
def test_logit_bias_and_ignore_eos_with_a_draft(tmp_path, verify):
    """The bias is part of the target's chain, so speculative output follows it (the draft knows nothing of
    it): +100 on the end token ends the generation at once; ``ignore_eos`` overrides that and runs to
    ``n_predict`` without it; -inf on the plain output's tokens keeps them out. Out-of-vocabulary ids are
    a one-line UsageError at submit."""
    from llamaspec.params import SpecParams
    from llamaspec.testing.tiny_models import write_model

    target = write_model("llama", tmp_path / "t.gguf", eos_token_id=7)
    draft = write_model("llama-draft", tmp_path / "d.gguf", eos_token_id=7)
    spec = SpecParams()
    spec.draft.n_max = 3
    spec.draft_adaptive = False  # draft every round (tiny models)
    with Engine(target, draft=draft, spec=spec, n_ctx=256, verify=verify, **EXACT) as e:
        eos = sorted(e.vocab.eog_tokens())
        assert 7 in eos
        greedy = L.SamplingParams(temp=0.0) if verify == "match" else L.SamplingParams(temp=0.7, seed=3)
        plain = e.generate([1, 5, 9, 13], n_predict=12, sampling=greedy)
        ends = e.generate([1, 5, 9, 13], n_predict=12,
                          sampling=L.SamplingParams(**{**greedy.__dict__, "logit_bias": ((eos[0], 100.0),)}))
        assert ends.tokens in ([], [eos[0]]) and str(ends.finish_reason) == "stop"
        on = e.generate([1, 5, 9, 13], n_predict=12, sampling=L.SamplingParams(
            **{**greedy.__dict__, "logit_bias": ((eos[0], 100.0),), "ignore_eos": True}))
        assert len(on.tokens) == 12 and not set(on.tokens) & set(eos)
        banned = tuple((t, float("-inf")) for t in set(plain.tokens))
        other = e.generate([1, 5, 9, 13], n_predict=12, sampling=L.SamplingParams(**{**greedy.__dict__, "logit_bias": banned}))
        assert other.tokens and not set(other.tokens) & set(plain.tokens)
        with pytest.raises(UsageError, match="outside the vocabulary"):
            e.generate([1, 5], n_predict=2, sampling=L.SamplingParams(logit_bias=((10**6, 1.0),)))


GRAMMAR_END_CHILD = r'''
import json, sys
from llamaspec import _llama as L
from llamaspec.engine import Engine
from llamaspec.params import SpecParams
target, draft, eos_path = sys.argv[1:4]
spec = SpecParams()
spec.add_types("draft-simple")
spec.draft.n_max, spec.draft_adaptive = 4, False
out = []
for verify in ("match", "rejection"):
    with Engine(target, draft=draft, spec=spec, n_ctx=256, n_parallel=2, verify=verify) as e:
        for grammar, bias in (('root ::= "a"', ()), ('root ::= [0-9a-f]{3,9}', ()),
                              ('root ::= "a" | "b"', ((10, float("-inf")), (11, float("-inf"))))):
            for temp in (0.0, 0.9):
                sp = L.SamplingParams(temp=temp, seed=3, grammar=grammar, logit_bias=bias)
                r = e.generate([1, 2, 3], n_predict=8, sampling=sp, probs=2)
                out.append([verify, grammar, temp, r.text, str(r.finish_reason)])
        assert e.generate([1, 2, 3], n_predict=4).tokens  # the engine goes on
with Engine(eos_path, n_ctx=64) as e:  # a model with an end token, ignored: the grammar's end ends it
    r = e.generate([1, 2], n_predict=8, sampling=L.SamplingParams(temp=0.0, grammar='root ::= "a"', ignore_eos=True))
    out.append(["ignore_eos", r.text, str(r.finish_reason)])
print(json.dumps(out))
'''


def test_grammar_that_allows_nothing_more_ends_the_request(tiny_model, tmp_path):
    """Found by tests/test_fuzz_server.py: a grammar that is complete where no end-of-generation token may
    follow (a vocabulary without one, ``ignore_eos``) or whose every token the logit bias forbids aborted the
    whole process in llama.cpp ("Unexpected empty grammar stack after accepting piece"; one request killed the
    server). Now the request stops there, as at an end token, on PART (llama) and FULL (mamba: restore +
    replay) memory, with both verifications, greedy and sampled, with token probabilities."""
    import json
    import subprocess
    import sys

    from llamaspec.testing.tiny_models import write_model

    eos = write_model("llama", tmp_path / "eos.gguf", eos_token_id=7)
    for kind in ("llama", "mamba"):
        p = subprocess.run([sys.executable, "-c", GRAMMAR_END_CHILD, str(tiny_model(kind)),
                            str(tiny_model(f"{kind}-draft")), str(eos)], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        rows = json.loads(p.stdout.strip().splitlines()[-1])
        for row in rows[:-1]:
            verify, grammar, temp, text, reason = row
            assert reason == "stop", row
            if grammar == 'root ::= "a"':
                assert text == "a", row
            elif grammar.startswith("root ::= [0-9a-f]"):
                assert 3 <= len(text) <= 9 and set(text) <= set("0123456789abcdef"), row
            else:
                assert text == "", row  # both of its tokens are forbidden: nothing can be generated
        assert rows[-1] == ["ignore_eos", "a", "stop"]
