"""Requests own their output, threads, errors confined to a slot, limits that hold (tiny models)."""
from __future__ import annotations

import random
import threading

import pytest

from llamaspec import _llama as L
from llamaspec.drafters.base import Drafter
from llamaspec.engine import Engine, FinishReason, RequestState
from llamaspec.errors import DecodeError, EngineClosedError, RequestError
from llamaspec.params import SpecParams
from llamaspec.options import RequestOptions

from helpers import EXACT

PROMPTS = [[1, 5, 9, 13, 22, 7], [3, 4, 5], [9, 9, 9, 1], [40, 2, 17, 33, 8]]
N = 20


@pytest.fixture(scope="module")
def lone(tiny_model):
    """Greedy output of each prompt alone on a one-slot engine, per model kind."""
    cache: dict = {}

    def get(kind: str, i: int, n: int = N) -> list[int]:
        if (kind, i, n) not in cache:
            with Engine(tiny_model(kind), n_ctx=256, **EXACT) as e:
                cache[kind, i, n] = e.generate(PROMPTS[i], n_predict=n).tokens
        return cache[kind, i, n]

    return get


def spec(n_max: int = 4) -> SpecParams:
    p = SpecParams()
    p.draft.n_max = n_max
    p.draft_adaptive = False  # tiny models: the adaptive length would stop drafting
    return p


# --------------------------------------------------------------------------------------------- own outputs
@pytest.mark.parametrize("n", [2, 4])
def test_interleaved_streams_each_equal_alone(tiny_model, lone, n):
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec(), n_ctx=256, n_parallel=n,
                **EXACT) as e:
        its = [e.stream(PROMPTS[i], n_predict=N) for i in range(n)]
        got: list[list[int]] = [[] for _ in range(n)]
        live = set(range(n))
        while live:  # one chunk from each in turn
            for i in sorted(live):
                ch = next(its[i], None)
                if ch is None:
                    live.discard(i)
                else:
                    got[i] += ch.tokens
    assert got == [lone("llama", i) for i in range(n)]


def test_streams_from_two_threads(tiny_model, lone):
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec(), n_ctx=256, n_parallel=2,
                **EXACT) as e:
        got: dict[int, list[int]] = {}

        def run(i: int) -> None:
            got[i] = [t for ch in e.stream(PROMPTS[i], n_predict=N) for t in ch.tokens]

        ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
    assert got == {0: lone("llama", 0), 1: lone("llama", 1)}


def test_engine_thread_serves_submitters(tiny_model, lone):
    """A server's shape: one thread steps, others submit and read their own requests."""
    with Engine(tiny_model("llama"), n_ctx=256, n_parallel=2, **EXACT) as e:
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                if not e.step():
                    stop.wait(0.001)

        t = threading.Thread(target=loop)
        t.start()
        try:
            reqs = [e.submit(PROMPTS[i % 4], RequestOptions(n_predict=N)) for i in range(5)]  # more than the slots: queued
            results = [r.result(timeout=60) for r in reqs]
        finally:
            stop.set()
            t.join(10)
    assert [r.tokens for r in results] == [lone("llama", i % 4) for i in range(5)]
    assert e.n_deferred >= 3


def test_a_reused_slot_never_sees_old_chunks(tiny_model, lone):
    with Engine(tiny_model("llama"), n_ctx=256, **EXACT) as e:
        a = e.submit(PROMPTS[0], RequestOptions(n_predict=N))
        b = e.submit(PROMPTS[1], RequestOptions(n_predict=N))  # waits for a's slot
        assert b.state is RequestState.QUEUED
        rb = b.result()
        ra = a.result()
    assert ra.tokens == lone("llama", 0) and rb.tokens == lone("llama", 1)


def test_cancel_from_another_thread(tiny_model):
    with Engine(tiny_model("llama"), n_ctx=256, **EXACT) as e:
        r = e.submit(PROMPTS[0], RequestOptions(n_predict=200))
        next(iter(r))
        threading.Thread(target=r.cancel).start()
        res = r.result(timeout=30)
        assert res.finish_reason is FinishReason.ABORT and e.ctx.memory.pos_max(0) == -1
        assert e.generate(PROMPTS[1], n_predict=3).finish_reason is FinishReason.LENGTH


def test_closed_engine_refuses(tiny_model):
    e = Engine(tiny_model("llama"), n_ctx=256)
    r = e.submit(PROMPTS[0], RequestOptions(n_predict=50))
    e.close()
    assert r.done and r.finish_reason is FinishReason.ABORT
    for call in (lambda: e.step(), lambda: e.submit([1, 2]), lambda: e.tokenize("x"), lambda: e.generate([1])):
        with pytest.raises(EngineClosedError, match="closed"):
            call()
    e.close()  # twice is fine


# --------------------------------------------------------------------------------------------- faults
class Faulty(Drafter):
    """Drafts the known greedy continuation (3 right tokens, 1 wrong), and raises in ``where`` for ``bad_seq``
    once it has generated ``at`` tokens (so a retry of the same call raises again)."""

    type = "faulty"

    def __init__(self, n_seq: int, truth: dict[int, list[int]], prompt_len: dict[int, int], where: str, bad_seq: int,
                 at: int):
        super().__init__(n_seq)
        self.n_max = 4
        self.truth, self.prompt_len, self.where, self.bad_seq, self.at = truth, prompt_len, where, bad_seq, at
        self.n_accept = 0

    def draft(self, params):
        for s, dp in enumerate(params):
            if not dp.drafting:
                continue
            k = len(dp.prompt) + 1 - self.prompt_len[s]  # index in truth of the token after id_last
            if self.where == "draft" and s == self.bad_seq and k >= self.at:
                raise RuntimeError("injected draft fault")
            good = self.truth[s][k : k + 3]
            dp.result.extend(good + [(t + 1) % 64 for t in self.truth[s][k + 3 : k + 4]])

    def process(self, rows):
        if self.where == "process" and any(r.seq_id == self.bad_seq and r.pos >= self.prompt_len[r.seq_id] + self.at
                                           for r in rows):
            raise RuntimeError("injected process fault")
        return True

    def accept(self, seq_id, n_accepted, is_other):
        if self.where == "accept" and seq_id == self.bad_seq:
            self.n_accept += 1
            if self.n_accept == 3:
                raise RuntimeError("injected accept fault")


@pytest.mark.parametrize("kind", ["llama", "mamba"])
@pytest.mark.parametrize("where", ["draft", "process", "accept"])
def test_a_faulty_slot_fails_alone(tiny_model, lone, kind, where):
    truth = {i: lone(kind, i, 40) for i in range(3)}
    d = Faulty(3, truth, {i: len(PROMPTS[i]) for i in range(3)}, where, bad_seq=1, at=6)
    with Engine(tiny_model(kind), drafters=[d], n_ctx=256, n_parallel=3, **EXACT) as e:
        res = e.generate_many(PROMPTS[:3], n_predict=N)
        # the engine keeps serving, on the failed slot too
        again = e.generate(PROMPTS[1], n_predict=N)
    assert res[1].finish_reason is FinishReason.ERROR and "injected" in res[1].error
    assert res[1].tokens == lone(kind, 1)[: len(res[1].tokens)]  # what it emitted before the fault stays
    assert [res[0].tokens, res[2].tokens] == [lone(kind, 0), lone(kind, 2)]
    assert again.tokens == lone(kind, 1)


@pytest.mark.parametrize("sticky", [True, False])
def test_a_failing_decode_fails_one_slot(tiny_model, lone, monkeypatch, sticky):
    """A decode that keeps failing for slot 0 fails slot 0 only; a one-off failure is retried slot by slot
    and changes nothing."""
    with Engine(tiny_model("llama"), n_ctx=256, n_parallel=2, **EXACT) as e:
        real = L.Context.decode
        state = {"n": 0}

        def decode(self, rows, **kw):
            if self is e.ctx and any(r.seq_id == 0 for r in rows):
                state["n"] += 1
                if state["n"] == 6 or (sticky and state["n"] > 6):
                    raise DecodeError("injected decode failure")
            return real(self, rows, **kw)

        def decode_next(self, tokens, pos, seq):  # plain rounds' decode: the same failures
            return decode(self, [L.Row(t, p, q, True) for t, p, q in zip(tokens, pos, seq)])

        real_next = L.Context.decode_next
        monkeypatch.setattr(L.Context, "decode", decode)
        monkeypatch.setattr(L.Context, "decode_next", decode_next)
        res = e.generate_many(PROMPTS[:2], n_predict=N)
        monkeypatch.setattr(L.Context, "decode", real)
        monkeypatch.setattr(L.Context, "decode_next", real_next)
        assert e.ctx.memory.pos_max(0) == -1 and e.ctx.memory.pos_max(1) == -1
    assert res[1].tokens == lone("llama", 1)
    if sticky:
        assert res[0].finish_reason is FinishReason.ERROR and "injected decode failure" in res[0].error
        assert res[0].tokens == lone("llama", 0)[: len(res[0].tokens)]
    else:
        assert res[0].tokens == lone("llama", 0)


@pytest.mark.parametrize("where", ["decode", "draft"])
def test_a_one_off_failure_with_a_lagging_draft_memory_changes_nothing(tiny_model, lone, monkeypatch, where):
    """Draft-KV reuse leaves the draft memory of a slot that does not draft behind its tokens (the next draft
    catches up). After a one-off failed batched decode (or draft) every slot is put back and retried alone:
    a lagging draft memory is a valid state there, not "memory could not be restored" (it failed the slot)."""
    from llamaspec.params import RequestSpec

    sp = spec(4)
    sp.add_types("draft-simple")
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=sp, n_ctx=256, n_parallel=3,
                **EXACT) as e:
        real_decode, state = L.Context.decode, {"n": 0}

        def decode(self, rows, **kw):
            if where == "decode" and self is e.ctx and len({r.seq_id for r in rows}) == 3:
                state["n"] += 1
                if state["n"] == 4:
                    raise DecodeError("injected decode failure")
            return real_decode(self, rows, **kw)

        monkeypatch.setattr(L.Context, "decode", decode)
        if where == "draft":
            chain_draft = type(e.chain).draft

            def draft(self, *a, **kw):
                state["n"] += 1
                if state["n"] == 1:  # the first draft: no slot's prompt is in the draft memory yet
                    raise RuntimeError("injected draft failure")
                return chain_draft(self, *a, **kw)

            monkeypatch.setattr(type(e.chain), "draft", draft)
        reqs = [e.submit(PROMPTS[0], RequestOptions(n_predict=N, speculative=RequestSpec(n_max=0))),  # never drafts
                e.submit(PROMPTS[1], RequestOptions(n_predict=N)), e.submit(PROMPTS[2], RequestOptions(n_predict=N))]
        res = [r.result() for r in reqs]
        monkeypatch.undo()
        assert state["n"] >= 4, "the failure was not injected"  # (a decode of the 3 slots, or a draft)
    assert [r.error for r in res] == [None, None, None]
    assert [r.tokens for r in res] == [lone("llama", 0), lone("llama", 1), lone("llama", 2)]


def test_generate_raises_the_request_error(tiny_model, monkeypatch):
    with Engine(tiny_model("llama"), n_ctx=256) as e:
        monkeypatch.setattr(L.Sampler, "sample", lambda self, ctx, idx: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RequestError, match="boom"):
            e.generate(PROMPTS[0], n_predict=5)
        monkeypatch.undo()
        assert len(e.generate(PROMPTS[0], n_predict=5).tokens) == 5


# --------------------------------------------------------------------------------------------- limits
class Greedy(Drafter):
    """Proposes far more than any limit allows, with random wrong tokens and ids outside the vocabulary."""

    type = "greedy-liar"

    def __init__(self, n_seq: int, n_max: int, seed: int):
        super().__init__(n_seq)
        self.n_max = n_max
        self.rng = random.Random(seed)

    def draft(self, params):
        for dp in params:
            if dp.drafting:
                n = self.rng.randint(0, 3 * self.n_max)
                dp.result.extend(self.rng.randrange(0, 70) for _ in range(n))


def test_n_predict_zero_generates_nothing(tiny_model):
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec(), n_ctx=256) as e:
        r = e.generate(PROMPTS[0], n_predict=0)
        assert r.tokens == [] and r.finish_reason is FinishReason.LENGTH and r.stats.n_prompt == len(PROMPTS[0])
        assert e.ctx.memory.pos_max(0) == -1


@pytest.mark.parametrize("n_batch,n_parallel", [(8, 1), (16, 4)])
def test_oversized_drafts_are_capped(tiny_model, lone, n_batch, n_parallel):
    d = Greedy(n_parallel, 40, seed=n_batch)
    with Engine(tiny_model("llama"), drafters=[d], n_ctx=256, n_batch=n_batch, n_parallel=n_parallel, **EXACT) as e:
        res = e.generate_many(PROMPTS[:n_parallel], n_predict=N)
    assert [r.finish_reason for r in res] == [FinishReason.LENGTH] * n_parallel
    assert [r.tokens for r in res] == [lone("llama", i) for i in range(n_parallel)]


def test_engine_does_not_mutate_spec_params(tiny_model):
    p = SpecParams()
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=p, n_ctx=256):
        pass
    assert p.types_are_default
    with Engine(tiny_model("llama"), spec=p, n_ctx=256) as e:  # still a plain engine
        assert not e.speculative


class Fuzzer(Drafter):
    """Random draft lengths 0..n_max: the true greedy continuation with wrong tokens at random positions."""

    type = "fuzz"

    def __init__(self, n_seq: int, n_max: int, truth: dict[int, list[int]], prompt_len: dict[int, int], seed: int):
        super().__init__(n_seq)
        self.n_max = n_max
        self.truth, self.prompt_len = truth, prompt_len
        self.rng = random.Random(seed)

    def draft(self, params):
        for s, dp in enumerate(params):
            if not dp.drafting:
                continue
            k = len(dp.prompt) + 1 - self.prompt_len[s]
            n = self.rng.randint(0, self.n_max)
            out = list(self.truth[s][k : k + n])
            for j in range(len(out)):
                if self.rng.random() < 0.25:
                    out[j] = (out[j] + self.rng.randint(1, 63)) % 64
            dp.result.extend(out)


FUZZ_TARGETS = [("llama", None), ("mamba", None), ("lfm2", 2), ("lfm2", 8)]  # PART, FULL, RS below/above n_max


@pytest.mark.parametrize("n_parallel", [1, 3])
@pytest.mark.parametrize("kind,n_rs_seq", FUZZ_TARGETS)
def test_draft_fuzz_greedy_equals_plain(tiny_model, lone, kind, n_rs_seq, n_parallel):
    truth = {i: lone(kind, i, 40) for i in range(n_parallel)}
    d = Fuzzer(n_parallel, 5, truth, {i: len(PROMPTS[i]) for i in range(n_parallel)}, seed=n_parallel)
    with Engine(tiny_model(kind), drafters=[d], n_ctx=256, n_parallel=n_parallel, n_rs_seq=n_rs_seq, **EXACT) as e:
        reqs = [e.submit(PROMPTS[i], RequestOptions(n_predict=40)) for i in range(n_parallel)]
        while not all(r.done for r in reqs):
            e.step()
            for r in reqs:  # the memory invariant after every round
                if not r.done:
                    assert e.ctx.memory.pos_max(r.seq_id) == r.slot.n_past - 1
        res = [r.result() for r in reqs]
        stats = [r.stats for r in res]
    assert [r.tokens for r in res] == [truth[i] for i in range(n_parallel)]
    assert sum(s.n_drafted for s in stats) > sum(s.n_accepted for s in stats) > 0


NGRAM_TYPES = ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"]


@pytest.mark.parametrize("spec_type", NGRAM_TYPES)
def test_small_batch_with_every_ngram_type(tiny_model, spec_type):
    """-b 32 with n-gram drafters whose n_max exceeds the batch: drafts are capped, greedy equals plain."""
    prompt = [3, 4, 5, 6, 7, 8] * 12  # repetitive: the n-gram drafters propose long drafts
    p = SpecParams()
    p.add_types(spec_type)
    for q in (p.ngram_simple, p.ngram_map_k, p.ngram_map_k4v):
        q.size_n = 1  # short keys: drafts on every round (ngram-simple drafts 48 > n_batch - 1)
    p.ngram_mod.n_match, p.ngram_mod.n_min = 1, 1
    with Engine(tiny_model("llama"), n_ctx=256, n_batch=32, **EXACT) as e:
        plain = e.generate(prompt, n_predict=40).tokens
    with Engine(tiny_model("llama"), spec=p, n_ctx=256, n_batch=32, **EXACT) as e:
        r = e.generate(prompt, n_predict=40)
    assert r.tokens == plain and r.finish_reason is FinishReason.LENGTH and r.stats.n_drafted > 0


def test_four_slots_batch_16(tiny_model, lone):
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec(8), n_ctx=256, n_parallel=4,
                n_batch=16, **EXACT) as e:
        res = e.generate_many(PROMPTS, n_predict=N)
    assert [r.tokens for r in res] == [lone("llama", i) for i in range(4)]
    assert all(r.stats.n_drafted > 0 for r in res)


def test_done_callbacks_run_once_from_the_finishing_thread_or_at_once(tiny_model):
    """Request.add_done_callback (a whole server response hears of its end this way): a callback added before
    the end runs once, in the thread that finishes the request; one added after runs at once; a failing one
    neither stops the step nor the other callbacks."""
    with Engine(tiny_model("llama"), n_ctx=256, **EXACT) as e:
        e.start()
        seen: list[tuple[str, int, bool]] = []
        threads: list[str] = []
        done = threading.Event()
        r = e.submit([3, 4, 5], RequestOptions(n_predict=40))

        def failing(req):
            raise RuntimeError("a callback that fails")

        r.add_done_callback(failing)
        r.add_done_callback(lambda req: (seen.append(("early", req.id, req.done)), done.set(),
                                         threads.append(threading.current_thread().name)))
        assert done.wait(30)
        r.add_done_callback(lambda req: seen.append(("late", req.id, req.done)))
        again = e.submit([3, 4, 5], RequestOptions(n_predict=3)).result()  # the engine thread went on after the failing callback
    assert [s[0] for s in seen] == ["early", "late"] and all(s[1] == r.id and s[2] for s in seen)
    assert threads == ["llamaspec-engine"]
    assert r.result().finish_reason is FinishReason.LENGTH and len(again.tokens) == 3


def test_a_plain_round_refuses_bad_rows_like_decode(tiny_model):
    """Context.decode_next (the plain round's decode) checks what Context.decode checks: a token outside the
    vocabulary or a sequence outside the context is a DecodeError, never a native abort."""
    with Engine(tiny_model("llama"), n_ctx=256, n_parallel=2, **EXACT) as e:
        n_vocab = e.vocab.n_tokens
        with pytest.raises(DecodeError, match="invalid token"):
            e.ctx.decode_next([3, n_vocab], [0, 0], [0, 1])
        with pytest.raises(DecodeError, match="invalid sequence"):
            e.ctx.decode_next([3, 4], [0, 0], [0, 2])
        e.ctx.decode_next([3, 4], [0, 0], [0, 1])  # and a good batch decodes
        assert e.ctx.memory.pos_max(0) == 0 and e.ctx.memory.pos_max(1) == 0
