"""Speculative decoding through the engine on tiny models: every rollback level, every verification rule."""
from __future__ import annotations

import math

import numpy as np
import pytest

from llamaspec import _llama as L
from llamaspec.drafters.base import Drafter
from llamaspec.engine import Engine, SlotState
from llamaspec.errors import ModelFormatError, UsageError, VocabMismatchError
from llamaspec.params import SpecParams
from llamaspec.options import RequestOptions

from helpers import EXACT

PROMPTS = [[1, 5, 9, 13, 22, 7], [3, 4, 5], [9, 9, 9, 1], [40, 2, 17, 33, 8]]
N = 48


def spec(n_max: int) -> SpecParams:
    """llama.cpp's fixed draft length: on tiny models (draft as costly as target) the adaptive length
    would rightly stop drafting, and these tests are about what happens to drafts."""
    p = SpecParams()
    p.draft.n_max = n_max
    p.draft_adaptive = False
    return p


@pytest.fixture(scope="module")
def plain(tiny_model):
    """Greedy plain outputs per (kind, prompt index), computed once."""
    cache = {}

    def get(kind: str, i: int = 0, sampling=None) -> list[int]:
        key = (kind, i, None if sampling is None else (sampling.temp, sampling.seed))
        if key not in cache:
            with Engine(tiny_model(kind), n_ctx=256, **EXACT) as e:
                cache[key] = e.generate(PROMPTS[i], n_predict=N, sampling=sampling).tokens
        return cache[key]

    return get


CASES = [
    # (target, draft, n_rs_seq, expected level, what must have happened)
    ("llama", "llama-draft", None, "PART", "trims"),
    ("mamba", "mamba-draft", None, "FULL", "restores"),
    ("lfm2", "lfm2-draft", 2, "RS", "restores"),  # n_rs_seq smaller than the draft: checkpoint path
    ("lfm2", "lfm2-draft", 8, "RS", "trims"),  # n_rs_seq covers the draft: bounded trim path
]


@pytest.mark.parametrize("n_max", [1, 3, 8])
@pytest.mark.parametrize("tgt,dft,n_rs_seq,level,path", CASES)
def test_greedy_equals_plain(tiny_model, plain, tgt, dft, n_rs_seq, level, path, n_max):
    with Engine(tiny_model(tgt), draft=tiny_model(dft), spec=spec(n_max), n_ctx=256, n_rs_seq=n_rs_seq, **EXACT) as e:
        assert e.tgt_level.name == level
        r = e.generate(PROMPTS[0], n_predict=N)
    assert r.tokens == plain(tgt)
    st = r.stats
    assert st.n_drafted > 0 and 0 < st.n_accepted < st.n_drafted  # partial acceptance really happened
    if path == "restores" and n_max > (n_rs_seq or 0):
        assert st.n_restores > 0 and st.n_replays == st.n_restores and st.n_checkpoints > 0
    if path == "trims":
        assert st.n_trims > 0 and st.n_restores == 0
    if level == "RS" and n_rs_seq == 8:
        assert st.n_checkpoints == 0


@pytest.mark.parametrize("tgt,dft,n_rs_seq", [("llama", "llama-draft", None), ("mamba", "mamba-draft", None),
                                              ("lfm2", "lfm2-draft", None), ("lfm2", "lfm2-draft", 2), ("lfm2", "lfm2-draft", 8)])
def test_four_slots_equal_plain(tiny_model, plain, tgt, dft, n_rs_seq):
    with Engine(tiny_model(tgt), draft=tiny_model(dft), spec=spec(4), n_ctx=256, n_parallel=4, n_rs_seq=n_rs_seq,
                **EXACT) as e:
        rs = e.generate_many(PROMPTS, n_predict=N)
        assert all(e.ctx.memory.pos_max(i) == -1 and e.ctx_dft.memory.pos_max(i) == -1 for i in range(4))
    assert [r.tokens for r in rs] == [plain(tgt, i) for i in range(4)]


@pytest.mark.parametrize("tgt,dft", [("llama", "llama-draft"), ("mamba", "mamba-draft")])
def test_sampled_match_equals_plain_sampled(tiny_model, plain, tgt, dft):
    sp = L.SamplingParams(temp=0.8, seed=1234)
    with Engine(tiny_model(tgt), draft=tiny_model(dft), spec=spec(3), n_ctx=256, **EXACT) as e:
        r = e.generate(PROMPTS[0], n_predict=N, sampling=L.SamplingParams(temp=0.8, seed=1234))
    assert r.tokens == plain(tgt, 0, sp)
    assert r.stats.n_accepted > 0


def test_draft_equals_target_accepts_everything(tiny_model):
    with Engine(tiny_model("llama"), draft=tiny_model("llama"), spec=spec(4), n_ctx=256, **EXACT) as e:
        r = e.generate(PROMPTS[0], n_predict=N)
    assert r.stats.n_drafted > 0 and r.stats.n_accepted == r.stats.n_drafted
    assert sum(r.drafted_mask) == r.stats.n_accepted  # the emitted tokens that came from drafts


def test_memory_invariant_every_round(tiny_model):
    for tgt, dft, rs in [("llama", "llama-draft", None), ("mamba", "mamba-draft", None), ("lfm2", "lfm2-draft", 2)]:
        with Engine(tiny_model(tgt), draft=tiny_model(dft), spec=spec(3), n_ctx=256, n_rs_seq=rs) as e:
            req = e.submit(PROMPTS[0], RequestOptions(n_predict=40))
            slot = req.slot
            while not req.done:
                e.step()
                if slot.state is SlotState.GENERATING:
                    assert e.ctx.memory.pos_max(0) == slot.n_past - 1
                    # the draft memory is never ahead; a trimmable one may lag (rounds without a draft are
                    # not mirrored: the next draft catches up), a FULL one follows every round
                    if e.rollback_dft.reuse_kv:
                        assert e.ctx_dft.memory.pos_max(0) <= slot.n_past - 1
                    else:
                        assert e.ctx_dft.memory.pos_max(0) == slot.n_past - 1


def test_abandoned_stream_and_exception(tiny_model, monkeypatch):
    with Engine(tiny_model("mamba"), draft=tiny_model("mamba-draft"), spec=spec(3), n_ctx=256) as e:
        it = e.stream(PROMPTS[0], n_predict=40)
        for _ in range(4):
            next(it)
        it.close()
        assert e.ctx.memory.pos_max(0) == -1 and e.ctx_dft.memory.pos_max(0) == -1
        req = e.submit(PROMPTS[1], RequestOptions(n_predict=40))
        slot = req.slot
        e.step(), e.step()
        real = L.Sampler.sample
        calls = {"n": 0}

        def flaky(self, ctx, idx):
            calls["n"] += 1
            if calls["n"] == 2:  # interrupt in the middle of a verification
                raise KeyboardInterrupt
            return real(self, ctx, idx)

        monkeypatch.setattr(L.Sampler, "sample", flaky)
        with pytest.raises(KeyboardInterrupt):
            for _ in range(10):
                e.step()
        monkeypatch.setattr(L.Sampler, "sample", real)
        assert e.ctx.memory.pos_max(0) == slot.n_past - 1
        assert e.ctx_dft.memory.pos_max(0) == slot.n_past - 1
        # and generation can continue from there
        while not req.done:
            e.step()
        assert req.finish_reason is not None and req.error is None


class Scripted(Drafter):
    """Fake drafter: at each call drafts ``n_good`` tokens of the known greedy continuation followed by
    ``n_bad`` wrong ones, following a fixed plan."""

    type = "scripted"

    def __init__(self, truth: list[int], prompt_len: int, plan: list[tuple[int, int]], n_vocab: int):
        super().__init__(1)
        self.truth, self.prompt_len, self.plan, self.n_vocab = truth, prompt_len, list(plan), n_vocab
        self.n_max = 16
        self.calls = 0

    def draft(self, params):
        dp = params[0]
        if not dp.drafting or self.calls >= len(self.plan):
            return
        n_good, n_bad = self.plan[self.calls]
        self.calls += 1
        k = len(dp.prompt) + 1 - self.prompt_len  # index in truth of the token after id_last
        good = self.truth[k : k + n_good]
        bad = [(t + 1) % self.n_vocab for t in self.truth[k + len(good) : k + len(good) + n_bad]]
        dp.result.extend(good + bad)


def test_a_full_draft_context_no_drafter_owns_is_never_fed_target_ids(tiny_model, plain):
    """Review 2.6: a FULL draft memory cannot drop rejected rows; it is reloaded and the committed tokens must
    be decoded into it again by the drafter that owns it. Where none does (the caller's drafters beside a
    recurrent draft model), the request fails with one clear line, instead of target ids going into a
    context whose vocabulary or inputs may be another's."""
    class Mirroring(Scripted):  # keeps the draft context in step with the target, in the target's ids
        ctx = None

        def process(self, rows):
            self.ctx.decode([L.Row(r.token, r.pos, r.seq_id, i == len(rows) - 1) for i, r in enumerate(rows)])
            return True

    d = Mirroring(plain("llama"), len(PROMPTS[0]), [(1, 2)], 64)
    calls = []
    with Engine(tiny_model("llama"), draft=tiny_model("mamba-draft"), drafters=[d], n_ctx=256, **EXACT) as e:
        assert e.dft_level.name == "FULL" and e.tgt_level.name == "PART"
        d.ctx = e.ctx_dft
        real = e.ctx_dft.decode_tokens
        e.ctx_dft.decode_tokens = lambda *a, **k: (calls.append(a), real(*a, **k))[1]
        r = e.submit(PROMPTS[0], RequestOptions(n_predict=N)).result()
    assert r.finish_reason == "error" and "no drafter decodes the 2 committed tokens" in r.error, r.error
    assert not calls


@pytest.mark.parametrize("kind,corrected", [("llama", False), ("mamba", False), ("mamba", True)])
def test_statistics_equal_hand_count(tiny_model, plain, kind, corrected):
    truth = plain(kind)
    plan = [(3, 0), (1, 2), (0, 2), (2, 1), (4, 0), (0, 1)]
    d = Scripted(truth, len(PROMPTS[0]), plan, 64)
    p = SpecParams()
    p.replay_accept_corrected = corrected
    with Engine(tiny_model(kind), drafters=[d], spec=p, n_ctx=256, **EXACT) as e:
        r = e.generate(PROMPTS[0], n_predict=N)
        lines = e.stats_lines()
    assert r.tokens == truth
    st, ds = r.stats, d.stats
    n_drafts = len(plan)
    partial = sum(1 for g, b in plan if b > 0)
    assert st.n_drafted == ds.n_gen_tokens == sum(g + b for g, b in plan) == 16
    assert st.n_accepted == sum(g for g, b in plan) == 10  # the slot's count is always corrected
    assert ds.n_gen_drafts == n_drafts and ds.n_call_accept == n_drafts  # a replay is not a new draft
    assert st.n_verif_steps == n_drafts  # replay rounds are not extra verification steps
    if kind == "mamba":  # FULL: every partially accepted draft was restored and replayed
        assert st.n_restores == st.n_replays == partial
    else:
        assert st.n_restores == 0
    assert lines[0].startswith("statistics         scripted: #calls(b,g,a) =    1 ")
    if kind == "mamba" and not corrected:
        # llama.cpp's QUIRK (spec §7.5 step 6): in a replay round the chain also counts the target's token
        chain_counts = [g + 1 if b else g for g, b in plan]
        assert ds.n_acc_tokens == sum(chain_counts) == 14 and ds.n_acc_drafts == 6
        assert ds.n_acc_tokens_per_pos == [6, 4, 3, 1]
        assert "#gen drafts =      6, #acc drafts =     6, #gen tokens =     16, #acc tokens =    14" in lines[0]
        return
    assert ds.n_acc_tokens == 10
    assert ds.n_acc_drafts == sum(1 for g, b in plan if g > 0) == 4
    assert ds.n_acc_tokens_per_pos == [4, 3, 2, 1]
    assert "#gen drafts =      6, #acc drafts =     4, #gen tokens =     16, #acc tokens =    10" in lines[0]
    assert "#mean acc len = 2.67, #acc rate/pos = (0.667, 0.500, 0.333, 0.167)" in lines[0]


def test_rejection_sampling_matches_target_distribution(tiny_model):
    """Joint distribution of the first two emitted tokens (the second one is verified by rejection sampling
    against a deliberately different draft) equals the target's: chi-square over a fixed seed set."""
    from reference_probs import probs_from_logits

    prompt = [1, 5, 9, 13]
    sp = dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    with L.Model(tiny_model("llama")) as m, L.Context(m, n_ctx=64, **EXACT) as ctx:
        ctx.decode_tokens(prompt, 0, 0)
        p1 = probs_from_logits(ctx.logits(len(prompt) - 1).copy(), 1.0, 0, 1.0, 0.0)
        p2 = np.zeros((64, 64))
        for t in np.nonzero(p1 > 1e-4)[0]:
            ctx.memory.seq_rm(0, len(prompt), -1)
            ctx.decode([L.Row(int(t), len(prompt), 0, True)])
            p2[t] = probs_from_logits(ctx.logits(0).copy(), 1.0, 0, 1.0, 0.0)
    expected = p1[:, None] * p2
    n = 3000
    counts = np.zeros((64, 64))
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec(2), verify="rejection", n_ctx=64,
                **EXACT) as e:
        drafted = 0
        for seed in range(n):
            # n_predict=3: after the first token one more may be drafted (n_draft_max = n_remaining - 1)
            r = e.generate(prompt, n_predict=3, sampling=L.SamplingParams(seed=seed, **sp))
            counts[r.tokens[0], r.tokens[1]] += 1
            drafted += r.stats.n_drafted
    assert drafted > n // 2  # the second token really went through rejection sampling
    exp = expected.ravel() * n
    obs = counts.ravel()
    big = exp >= 5
    chi2 = float((((obs[big] - exp[big]) ** 2) / exp[big]).sum())
    rest_o, rest_e = obs[~big].sum(), exp[~big].sum()
    if rest_e > 0:
        chi2 += (rest_o - rest_e) ** 2 / rest_e
    dof = int(big.sum()) + (1 if rest_e > 0 else 0) - 1
    # p-value > 0.001 for a chi-square with dof degrees of freedom (Wilson-Hilferty approximation)
    z = ((chi2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    assert z < 3.09, f"chi2={chi2:.1f} dof={dof}"


def test_synthetic_acceptance_hits_target_length(tiny_model):
    p = spec(4)
    p.synth_len = 3.0
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=p, n_ctx=256) as e:
        rs = e.generate_many([PROMPTS[0]] * 4, n_predict=120)
    steps = sum(r.stats.n_verif_steps for r in rs)
    acc = sum(r.stats.n_accepted for r in rs)
    assert 2.5 < 1 + acc / steps < 3.5


# -- bad input -------------------------------------------------------------------------------------


def test_incompatible_vocab(tiny_model):
    with pytest.raises(VocabMismatchError, match="text|size"):
        Engine(tiny_model("llama"), draft=tiny_model("llama-incompat"), n_ctx=64)


def test_negative_n_max():
    p = SpecParams()
    p.draft.n_max = -1
    with pytest.raises(UsageError, match="n-max"):
        Engine("unused.gguf", spec=p)


def test_unknown_type():
    with pytest.raises(UsageError, match="unknown speculative type: 'ngram-foo'.*valid types"):
        SpecParams().add_types("ngram-foo")


def test_draft_model_fails_to_load(tiny_model, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(tiny_model("llama").read_bytes()[:2000])
    with pytest.raises(ModelFormatError):
        Engine(tiny_model("llama"), draft=bad, n_ctx=64)


def test_draft_simple_without_draft_model(tiny_model):
    p = SpecParams()
    p.add_types("draft-simple")
    with pytest.raises(UsageError, match="draft model"):
        Engine(tiny_model("llama"), spec=p, n_ctx=64)


def test_no_memory_turns_speculation_off(tiny_model, monkeypatch, caplog):
    import logging

    import llamaspec.contexts as E
    from llamaspec.level import Level

    monkeypatch.setattr(E, "can_seq_rm", lambda ctx: Level.NO)
    with caplog.at_level(logging.WARNING, logger="llamaspec"):
        with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), n_ctx=64) as e:
            assert not e.speculative and e.ctx_dft is None
            r = e.generate(PROMPTS[0], n_predict=8)
    assert len(r.tokens) == 8 and r.stats.n_drafted == 0
    assert sum("speculative decoding is off" in m for m in caplog.messages) == 1


DIGITS = "root ::= [0-7]+\n"  # tiny-model pieces are hex ids: this allows 32 of 64 tokens


def obeys_digits(e, tokens) -> bool:
    return all(set(e.vocab.token_to_piece(t).decode()) <= set("01234567") for t in tokens)


@pytest.mark.parametrize("mode", ["rejection", "synth"])
def test_grammar_with_rejection_and_synth(tiny_model, mode):
    """A grammar no longer turns rejection sampling off, and synthetic tokens never reach the grammar
    (llama.cpp accepts them with generated=false): the output obeys the grammar, nothing aborts."""
    p = spec(3)
    if mode == "synth":
        p.synth_len = 3.0
    verify = "rejection" if mode == "rejection" else "match"
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=p, verify=verify, n_ctx=256,
                **EXACT) as e:
        for seed in range(4):
            sp = L.SamplingParams(temp=0.8, seed=seed, repeat_penalty=1.1, grammar=DIGITS)
            r = e.generate(PROMPTS[seed], n_predict=24, sampling=sp)
            assert len(r.tokens) == 24 and r.stats.n_drafted > 0
            if mode == "rejection":
                assert obeys_digits(e, r.tokens)


def test_sampled_match_with_penalties_equals_plain(tiny_model):
    sp = lambda: L.SamplingParams(temp=0.8, seed=3, repeat_penalty=1.3)  # noqa: E731
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec(3), n_ctx=256, **EXACT) as e:
        a = e.generate(PROMPTS[0], n_predict=24, sampling=sp()).tokens
    with Engine(tiny_model("llama"), n_ctx=256, **EXACT) as e:
        b = e.generate(PROMPTS[0], n_predict=24, sampling=sp()).tokens
    assert a == b  # sample-and-match with the same seed equals plain sampling


@pytest.mark.parametrize("n_parallel", [1, 4])
def test_draft_kv_reuse_keeps_output_and_skips_reeval(tiny_model, plain, n_parallel):
    """Beyond llama.cpp: with reuse_kv the draft context keeps what drafting decoded; the target output is
    unchanged and the draft context ends every round holding the committed tokens or fewer (a round without
    a draft is not mirrored; the next draft catches up), exactly them after a round that drafted."""
    p = spec(4)
    p.draft.reuse_kv = True
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=p, n_ctx=256, n_parallel=n_parallel,
                **EXACT) as e:
        assert e.rollback_dft.reuse_kv
        if n_parallel == 1:
            req = e.submit(PROMPTS[0], RequestOptions(n_predict=N))
            slot = req.slot
            out = []
            n_exact = 0
            while not req.done:
                drafted = slot.stats.n_drafted
                for ch in e.step():
                    out += ch.tokens
                if slot.state is SlotState.GENERATING:
                    assert e.ctx_dft.memory.pos_max(0) <= slot.n_past - 1
                    if slot.stats.n_drafted > drafted and slot.spec_draft == []:  # this round drafted
                        assert e.ctx_dft.memory.pos_max(0) == slot.n_past - 1
                        n_exact += 1
            assert n_exact > 0
            assert out == plain("llama")
        else:
            rs = e.generate_many(PROMPTS, n_predict=N)
            assert [r.tokens for r in rs] == [plain("llama", i) for i in range(4)]


def test_rounds_without_a_draft_cost_no_draft_decode(tiny_model, plain):
    """A round in which no slot drafts (the referee's plain rounds, a budget that skips every slot) decodes
    nothing in the draft context: the rows it committed wait for the next draft's catch-up. (The seqs of the last
    draft() were mirrored in every later round until the next one: under load, 13% of the plain rounds' time with
    8 slots.) The output stays plain decoding's."""
    p = spec(4)
    p.draft.reuse_kv = True
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=p, n_ctx=256, **EXACT) as e:
        phase, real_run = e.round.drafting, e.round.drafting.run
        n_round = [0]

        def run(gen, fail, allow=True):
            n_round[0] += 1
            return real_run(gen, fail, allow=allow and n_round[0] % 6 < 2)   # 2 rounds draft, 4 do not

        phase.run = run
        dft_decodes, real_decode = [], e.ctx_dft.decode
        e.ctx_dft.decode = lambda rows, **kw: (dft_decodes.append((n_round[0], len(rows))), real_decode(rows, **kw))[1]
        r = e.generate(PROMPTS[0], n_predict=N)
    assert r.tokens == plain("llama")
    assert r.stats.n_drafted > 0
    undrafted = [(k, n) for k, n in dft_decodes if k % 6 >= 2]
    assert undrafted == []
    assert any(k % 6 < 2 for k, _ in dft_decodes)


def test_draft_kv_reuse_off_for_full_draft_memory(tiny_model, plain):
    p = spec(3)
    p.draft.reuse_kv = True
    with Engine(tiny_model("mamba"), draft=tiny_model("mamba-draft"), spec=p, n_ctx=256, **EXACT) as e:
        assert not e.rollback_dft.reuse_kv and not e.chain.impls[0].reuse_kv
        assert e.generate(PROMPTS[0], n_predict=N).tokens == plain("mamba")
