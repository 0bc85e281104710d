"""Continuous batching, the prompt cache, slot choice, per-request speculative settings, the engine thread."""
from __future__ import annotations

import pytest

from llamaspec import _llama as L
from llamaspec.engine import Engine, FinishReason, RequestState
from llamaspec.errors import LlamaSpecError, UsageError
from llamaspec.params import RequestSpec, SpecParams
from llamaspec.scheduler import common_prefix
from llamaspec.options import RequestOptions

from helpers import EXACT

PROMPTS = [[1, 5, 9, 13, 22, 7], [3, 4, 5], [9, 9, 9, 1], [40, 2, 17, 33, 8]]


def spec(n_max: int = 4) -> SpecParams:
    """A fixed draft length (the adaptive one stops drafting on tiny models, whose draft costs as much as
    the target)."""
    p = SpecParams()
    p.draft.n_max = n_max
    p.draft_adaptive = False
    return p


@pytest.fixture(scope="module")
def alone(tiny_model):
    cache: dict = {}

    def get(kind: str, prompt: tuple, n: int = 16) -> list[int]:
        if (kind, prompt, n) not in cache:
            with Engine(tiny_model(kind), n_ctx=512, **EXACT) as e:
                cache[kind, prompt, n] = e.generate(list(prompt), n_predict=n).tokens
        return cache[kind, prompt, n]

    return get


def test_long_prompt_does_not_stall_generating_slots(tiny_model, alone):
    """A 200-token prompt with n_batch 16 is spread over rounds; the generating slot emits in every one."""
    long_prompt = [(i * 7) % 64 for i in range(200)]
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec(3), n_ctx=1024, n_parallel=2,
                n_batch=16, **EXACT) as e:
        a = e.submit(PROMPTS[0], RequestOptions(n_predict=40))
        e.step()  # a's prompt
        b = e.submit(long_prompt, RequestOptions(n_predict=8))
        rounds_while_b_prompt = 0
        while b.state in (RequestState.QUEUED, RequestState.PROMPT):
            before = len(a.tokens)
            e.step()
            if not a.done:
                assert len(a.tokens) > before  # a emitted in this round too
                rounds_while_b_prompt += 1
        assert rounds_while_b_prompt >= 10  # b's prompt really took many rounds (200 tokens, < 16 per round)
        ra, rb = a.result(), b.result()
    assert ra.tokens == alone("llama", tuple(PROMPTS[0]), 40)
    assert rb.tokens == alone("llama", tuple(long_prompt), 8)


@pytest.mark.parametrize("kind,draft", [("llama", "llama-draft"), ("mamba", "mamba-draft")])
def test_prompt_cache_reuses_the_common_prefix(tiny_model, alone, kind, draft):
    first = PROMPTS[0] + [11, 12]
    with Engine(tiny_model(kind), draft=tiny_model(draft), spec=spec(3), n_ctx=512, cache_prompt=True, **EXACT) as e:
        r1 = e.generate(first, n_predict=8)
        assert e.ctx.memory.pos_max(0) == len(first) + 8 - 2  # kept: prompt + generated (last one not decoded)
        # multi-turn: the next prompt extends everything the slot holds -> works on every memory level
        follow = first + r1.tokens[:-1] + [r1.tokens[-1], 30, 31]
        r2 = e.generate(follow, n_predict=8)
        assert r2.stats.n_cached == len(first) + 7
        # a prompt that only shares a prefix: trimmed on PART, started afresh on FULL
        other = first[:4] + [50, 51, 52]
        r3 = e.generate(other, n_predict=8)
        assert r3.stats.n_cached == (4 if kind == "llama" else 0)
        info = e.slots_info()
        assert info[0]["n_cached"] == len(other) + 7 and not info[0]["is_processing"]
    assert r2.tokens == alone(kind, tuple(follow), 8)
    assert r3.tokens == alone(kind, tuple(other), 8)


def test_slot_choice_by_prefix_and_id_slot(tiny_model):
    with Engine(tiny_model("llama"), n_ctx=512, n_parallel=2, cache_prompt=True, **EXACT) as e:
        a = e.submit(PROMPTS[0], RequestOptions(n_predict=4))
        b = e.submit(PROMPTS[3], RequestOptions(n_predict=4))
        a.result(), b.result()
        assert (a.seq_id, b.seq_id) == (0, 1)
        c = e.submit(PROMPTS[3] + [5, 6], RequestOptions(n_predict=4))  # shares its prefix with slot 1's cache
        c.result()
        assert c.slot.id == 1 and c.stats.n_cached == len(PROMPTS[3])
        d = e.submit(PROMPTS[3], RequestOptions(n_predict=4, id_slot=0, cache_prompt=False))
        d.result()
        assert d.slot.id == 0 and d.stats.n_cached == 0
        with pytest.raises(UsageError, match="id_slot"):
            e.submit(PROMPTS[0], RequestOptions(id_slot=2))


def test_prompts_sharing_only_their_first_token_keep_their_own_slots(tiny_model):
    """llama-server's slot choice: a cache is chosen when it covers more than ``-sps`` (0.1) of the prompt, else
    the least recently used slot. Before, any common prefix chose a slot, and a model's BOS is common to every
    prompt: one slot took every request in turn, evicting the cache each time, while the others stayed empty."""
    prompts = [[1] + [10 + 7 * i + k for k in range(12)] for i in range(3)]  # one shared first token (a BOS)
    with Engine(tiny_model("llama"), n_ctx=512, n_parallel=3, cache_prompt=True, **EXACT) as e:
        def one_by_one():
            out = []
            for p in prompts:
                r = e.submit(p, RequestOptions(n_predict=2))
                r.result()
                out.append(r)
            return out

        assert [r.slot.id for r in one_by_one()] == [0, 1, 2]  # the empty slots first
        again = one_by_one()  # each finds its own cache
        assert [r.slot.id for r in again] == [0, 1, 2]
        assert [r.stats.n_cached for r in again] == [len(p) - 1 for p in prompts]
    with Engine(tiny_model("llama"), n_ctx=512, n_parallel=2, cache_prompt=True, slot_prompt_similarity=0.0,
                **EXACT) as e:  # -sps 0: least recently used only, whatever is cached
        ids = []
        for p in (prompts[0], prompts[0], prompts[0]):
            r = e.submit(p, RequestOptions(n_predict=2))
            r.result()
            ids.append(r.slot.id)
        assert ids == [0, 1, 0]
    with pytest.raises(UsageError, match="similarity"):
        Engine(tiny_model("llama"), n_ctx=512, slot_prompt_similarity=1.5)


def test_per_request_speculative_settings(tiny_model, alone):
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec(6), n_ctx=512, **EXACT) as e:
        off = e.generate(PROMPTS[0], n_predict=16, speculative=RequestSpec(n_max=0))
        two = e.generate(PROMPTS[0], n_predict=16, speculative=RequestSpec(n_max=2))
        full = e.generate(PROMPTS[0], n_predict=16)
        rej = e.generate(PROMPTS[0], n_predict=16, sampling=L.SamplingParams(temp=0.8, seed=1),
                         speculative=RequestSpec(verify="rejection"))
        with pytest.raises(UsageError, match="above the server's maximum 6"):
            e.submit(PROMPTS[0], RequestOptions(speculative=RequestSpec(n_max=7)))
    truth = alone("llama", tuple(PROMPTS[0]), 16)
    assert off.tokens == two.tokens == full.tokens == truth
    assert off.stats.n_drafted == 0 and two.stats.n_drafted > 0
    assert two.stats.n_drafted <= 2 * two.stats.n_verif_steps  # no draft longer than 2
    assert full.stats.n_drafted > 2 * full.stats.n_verif_steps  # the engine's own drafts are longer
    assert rej.stats.n_drafted > 0 and rej.finish_reason is FinishReason.LENGTH


def test_engine_thread_metrics_and_slots(tiny_model, alone):
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec(3), n_ctx=512, n_parallel=2,
                **EXACT) as e:
        e.start()
        reqs = [e.submit(PROMPTS[i % 4], RequestOptions(n_predict=12)) for i in range(6)]
        res = [r.result(timeout=60) for r in reqs]
        m = e.metrics()
        e.stop()
        assert len(e.slots_info()) == 2
    assert [r.tokens for r in res] == [alone("llama", tuple(PROMPTS[i % 4]), 12) for i in range(6)]
    assert m["requests_total"] == 6 and m["tokens_predicted_total"] == 72
    assert m["spec_decode_num_draft_tokens_total"] == sum(r.stats.n_drafted for r in res) > 0
    assert m["requests_processing"] == 0 and m["requests_deferred"] == 0 and m["requests_deferred_total"] >= 4


def test_common_prefix():
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2, 3]) == 2


def test_why_a_request_stopped_and_which_drafter_was_accepted(tiny_model, alone):
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec(3), n_ctx=256, **EXACT) as e:
        r = e.submit(PROMPTS[0], RequestOptions(n_predict=8))
        r.result()
        assert (r.stop_type, r.truncated) == ("limit", False)
        assert r.stats.n_accepted_by_type == {"draft-simple": r.stats.n_accepted} and r.stats.n_accepted > 0
        text = e.generate(PROMPTS[0], n_predict=8).text
        word = text[3:5]
        w = e.submit(PROMPTS[0], RequestOptions(n_predict=8, stop=[word]))
        w.result()
        assert (w.stop_type, w.stopping_word) == ("word", word)
        full = e.submit(PROMPTS[0], RequestOptions(n_predict=-1))
        full.result()
        assert (full.stop_type, full.truncated) == ("limit", True)


@pytest.mark.parametrize("kind,draft", [("mamba", "mamba-draft"), ("lfm2", "lfm2-draft")])
def test_prompt_checkpoint_restores_a_prefix_that_cannot_be_trimmed(tiny_model, alone, kind, draft):
    """FULL / RS memories keep a checkpoint before the last prompt token (spec §7.6): the same prompt again
    (a regenerate) and a prompt that shares only the previous prompt reuse all but one of its tokens."""
    first = PROMPTS[0] + [11, 12, 14]
    with Engine(tiny_model(kind), draft=tiny_model(draft), spec=spec(3), n_ctx=512, cache_prompt=True, **EXACT) as e:
        r1 = e.generate(first, n_predict=8)
        assert e.slots[0].prompt_ckpt is not None and len(e.slots[0].prompt_ckpt.tokens) == len(first) - 1
        r2 = e.generate(first, n_predict=8)
        assert r2.stats.n_cached == len(first) - 1
        edited = first + [30, 31]  # the previous prompt, then something else than what was generated
        assert edited[len(first)] != r2.tokens[0] or edited[len(first) + 1] != r2.tokens[1]
        r3 = e.generate(edited, n_predict=8)
        assert r3.stats.n_cached == len(first) - 1
        r4 = e.generate(PROMPTS[1], n_predict=4, cache_prompt=False)  # no cache: the checkpoint goes too
        assert r4.stats.n_cached == 0 and e.slots[0].prompt_ckpt is None
    assert r1.tokens == r2.tokens == alone(kind, tuple(first), 8)
    assert r3.tokens == alone(kind, tuple(edited), 8)


def test_sliding_window_cache_is_not_trimmed_into_a_pruned_window(tmp_path):
    """gemma3 (n_swa 16, context 1024, so the window cache reuses cells): a prompt longer than the window
    leaves a checkpoint (a regenerate restores it); a shorter prefix whose window cells were reused is
    processed again, never trimmed into a hole; outputs equal fresh runs."""
    from llamaspec.testing.tiny_models import write_model

    path = write_model("gemma3", tmp_path / "gemma3-1k.gguf", n_ctx=1024)
    long_prompt = [(i * 5 + 3) % 61 for i in range(300)]
    short = long_prompt[:30] + [40, 41]
    kw = dict(n_ctx=1024, n_batch=16, **EXACT)
    with Engine(path, **kw) as e:
        fresh = [e.generate(long_prompt, n_predict=8).tokens, e.generate(short, n_predict=8).tokens]
    with Engine(path, cache_prompt=True, **kw) as e:
        r1 = e.generate(long_prompt, n_predict=8)
        assert e.ctx.memory.pos_min(0) > 0  # the window cache did reuse cells
        r2 = e.generate(long_prompt, n_predict=8)
        assert r2.stats.n_cached == len(long_prompt) - 1  # from the checkpoint
        r3 = e.generate(short, n_predict=8)
        assert r3.stats.n_cached == 0
    assert [r1.tokens, r3.tokens] == fresh and r2.tokens == r1.tokens


def _release_fails_once(eng, monkeypatch) -> list:
    """The target's ``release`` raises on its first call (an RPC server gone), then frees as before; returns the
    list of the seq ids it was called with."""
    release = eng.rollback_tgt.release
    calls: list = []

    def failing_once(seq_id):
        calls.append(seq_id)
        if len(calls) == 1:
            raise LlamaSpecError("the RPC server is gone")
        return release(seq_id)

    monkeypatch.setattr(eng.rollback_tgt, "release", failing_once)
    return calls


def test_a_failing_cancel_drops_no_later_cancel(tiny_model, monkeypatch):
    """Cancels queued together are applied one by one: when freeing the first one's memory fails (an RPC
    server gone), the second is still cancelled, and both requests end (their consumers would wait forever)."""
    with Engine(tiny_model("llama"), n_ctx=512, n_parallel=2) as eng:
        reqs = [eng.submit(p, RequestOptions(n_predict=200)) for p in PROMPTS[:2]]
        for _ in range(3):
            eng.step()
        assert all(r.state is RequestState.GENERATING for r in reqs)
        calls = _release_fails_once(eng, monkeypatch)
        for r in reqs:  # queued together, as while a step runs
            eng.scheduler.request_cancel(r)
        eng.step()
        assert [r.done for r in reqs] == [True, True]
        assert [r.finish_reason for r in reqs] == [FinishReason.ABORT, FinishReason.ABORT]
        assert len(calls) == 2
        monkeypatch.undo()
        # both slots serve again
        again = [eng.submit(p, RequestOptions(n_predict=4)) for p in PROMPTS[2:]]
        while not all(r.done for r in again):
            eng.step()
        assert [len(r.result().tokens) for r in again] == [4, 4]


def test_a_failing_retire_settles_the_other_slots(tiny_model, monkeypatch):
    """Two requests finish in the same round and freeing the first one's memory fails: both still end with
    their tokens (the step settles slot by slot), and the engine serves on."""
    with Engine(tiny_model("llama"), n_ctx=512, n_parallel=2, cache_prompt=False) as eng:
        reqs = [eng.submit(p, RequestOptions(n_predict=6)) for p in (PROMPTS[0], PROMPTS[3])]
        for _ in range(3):
            eng.step()  # both prompts in, the slots generating
        calls = _release_fails_once(eng, monkeypatch)
        for _ in range(20):
            if all(r.done for r in reqs):
                break
            eng.step()
        assert len(calls) >= 2
        assert [(r.finish_reason, len(r.result().tokens)) for r in reqs] == [(FinishReason.LENGTH, 6)] * 2
        monkeypatch.undo()
        assert len(eng.generate(PROMPTS[1], n_predict=3).tokens) == 3
