"""Plain generation through the engine: parity with llama-cpp-python's Llama, slots, invariants."""
from __future__ import annotations

import pytest

from llamaspec import _llama as L
from llamaspec.chat import apply_chat_template
from llamaspec.engine import Engine, FinishReason, RequestState, SlotState
from llamaspec.errors import ContextOverflowError, UsageError
from llamaspec.options import RequestOptions

from helpers import EXACT, real_model

PROMPTS = [[1, 5, 9, 13, 22, 7], [3, 4, 5], [9, 9, 9, 1], [40, 2, 17, 33, 8]]


def llama_cpp_python_greedy(path, prompt, n, n_ctx=256):
    """Greedy tokens from llama-cpp-python's high-level Llama (the reference)."""
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=n_ctx, verbose=False)
    try:
        out = []
        for t in llm.generate(prompt, temp=0.0, top_k=1):
            if llm.token_eos() == t or len(out) == n:
                break
            out.append(t)
        return out
    finally:
        llm.close()


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mamba", "lfm2"])
def test_greedy_equals_llama_cpp_python(tiny_model, kind):
    path = tiny_model(kind)
    with Engine(path, n_ctx=256) as eng:
        res = eng.generate(PROMPTS[0], n_predict=40)
    assert res.finish_reason is FinishReason.LENGTH
    assert len(res.tokens) == 40
    assert len(set(res.tokens)) > 3, "degenerate tiny model: the test would prove nothing"
    assert res.tokens == llama_cpp_python_greedy(path, PROMPTS[0], 40)


def test_memory_invariant_every_round(tiny_model):
    with Engine(tiny_model("llama"), n_ctx=256) as eng:
        req = eng.submit(PROMPTS[0], RequestOptions(n_predict=10))
        slot = req.slot
        while not req.done:
            eng.step()
            if slot.state is SlotState.GENERATING:
                assert eng.ctx.memory.pos_max(slot.seq_id) == slot.n_past - 1
        assert eng.ctx.memory.pos_max(slot.seq_id) == -1  # released


def test_abandoned_stream_frees_memory(tiny_model):
    with Engine(tiny_model("mamba"), n_ctx=256) as eng:
        it = eng.stream(PROMPTS[1], n_predict=50)
        next(it), next(it)
        assert eng.ctx.memory.pos_max(0) >= 0
        it.close()
        assert eng.ctx.memory.pos_max(0) == -1
        assert eng.slots[0].finish_reason is FinishReason.ABORT
        # the slot is reusable and gives the same result as a fresh engine
        again = eng.generate(PROMPTS[1], n_predict=8).tokens
    with Engine(tiny_model("mamba"), n_ctx=256) as eng:
        assert eng.generate(PROMPTS[1], n_predict=8).tokens == again


def test_exception_mid_round_fails_the_request_only(tiny_model, monkeypatch):
    with Engine(tiny_model("llama"), n_ctx=256) as eng:
        req = eng.submit(PROMPTS[0], RequestOptions(n_predict=20))
        eng.step()
        eng.step()
        real_sample = L.Sampler.sample

        def boom(self, ctx, idx):
            raise RuntimeError("sampler exploded")

        monkeypatch.setattr(L.Sampler, "sample", boom)
        eng.step()  # the error stays in its request
        monkeypatch.setattr(L.Sampler, "sample", real_sample)
        res = req.result()
        assert res.finish_reason is FinishReason.ERROR and "sampler exploded" in res.error
        assert eng.ctx.memory.pos_max(0) == -1  # its memory was released
        full = eng.generate(PROMPTS[0], n_predict=20).tokens  # the engine keeps serving
        assert len(res.tokens) >= 2 and res.tokens == full[: len(res.tokens)]  # what was emitted is kept


def test_interrupt_mid_round_restores_invariant(tiny_model, monkeypatch):
    with Engine(tiny_model("llama"), n_ctx=256) as eng:
        req = eng.submit(PROMPTS[0], RequestOptions(n_predict=20))
        eng.step()
        eng.step()
        real_sample = L.Sampler.sample

        def interrupt(self, ctx, idx):
            raise KeyboardInterrupt

        monkeypatch.setattr(L.Sampler, "sample", interrupt)
        with pytest.raises(KeyboardInterrupt):
            eng.step()
        monkeypatch.setattr(L.Sampler, "sample", real_sample)
        assert eng.ctx.memory.pos_max(0) == req.slot.n_past - 1
        while not req.done:
            eng.step()
        assert len(req.tokens) == 20


def test_slots_batched_equal_single(tiny_model):
    path = tiny_model("llama")
    with Engine(path, n_ctx=256, **EXACT) as eng:
        single = [eng.generate(p, n_predict=16).tokens for p in PROMPTS]
    with Engine(path, n_ctx=256, n_parallel=4, **EXACT) as eng:
        many = [r.tokens for r in eng.generate_many(PROMPTS, n_predict=16)]
        assert all(eng.ctx.memory.pos_max(s.seq_id) == -1 for s in eng.slots)
    assert many == single


def test_more_prompts_than_slots(tiny_model):
    with Engine(tiny_model("llama"), n_ctx=256, n_parallel=2, **EXACT) as eng:
        res = eng.generate_many(PROMPTS, n_predict=5)
    assert [len(r.tokens) for r in res] == [5] * 4


def test_seeded_sampling_reproducible(tiny_model):
    sp = lambda: L.SamplingParams(temp=1.0, seed=1234)  # noqa: E731
    with Engine(tiny_model("llama"), n_ctx=256) as eng:
        a = eng.generate(PROMPTS[0], n_predict=20, sampling=sp()).tokens
        b = eng.generate(PROMPTS[0], n_predict=20, sampling=sp()).tokens
        c = eng.generate(PROMPTS[0], n_predict=20, sampling=L.SamplingParams(temp=1.0, seed=99)).tokens
    assert a == b and a != c


def test_context_limit_ends_generation(tiny_model):
    with Engine(tiny_model("llama"), n_ctx=256) as eng:
        n_ctx = eng.n_ctx_seq
        res = eng.generate(PROMPTS[0], n_predict=-1)
    assert res.finish_reason is FinishReason.LENGTH
    assert len(PROMPTS[0]) + len(res.tokens) == n_ctx


def test_bad_requests(tiny_model):
    with Engine(tiny_model("llama"), n_ctx=256) as eng:
        with pytest.raises(ContextOverflowError, match="prompt has 300 tokens"):
            eng.submit([5] * 300)
        with pytest.raises(UsageError, match="outside the vocabulary"):
            eng.submit([5, 64])
        with pytest.raises(UsageError, match="empty"):
            eng.submit([])
        with pytest.raises(UsageError, match="n_predict"):
            eng.submit([5], RequestOptions(n_predict=-2))
        eng.submit([5], RequestOptions(n_predict=3))
        queued = eng.submit([6])  # all slots busy: it waits for one
        assert queued.state is RequestState.QUEUED and eng.metrics()["requests_deferred"] == 1 and eng.n_deferred == 1
    with pytest.raises(UsageError):
        Engine(tiny_model("llama"), n_parallel=0)


@pytest.mark.real
@pytest.mark.parametrize("name", ["gemma3-270m-f32", "smollm2-135m-f32"])
def test_real_greedy_equals_llama_cpp_python(name):
    path = real_model(name)
    with Engine(path, n_ctx=512) as eng:
        prompt = eng.tokenize("def fibonacci(n):")
        res = eng.generate(prompt, n_predict=48)
        assert res.text.strip()
    assert res.tokens == llama_cpp_python_greedy(path, prompt, len(res.tokens), n_ctx=512)


@pytest.mark.real
def test_real_stop_string_and_eog():
    with Engine(real_model("smollm2-135m-q4_1"), n_ctx=512) as eng:
        res = eng.generate("1, 2, 3, 4,", n_predict=64, stop=[" 7"])
        assert res.finish_reason is FinishReason.STOP
        assert " 7" not in res.text and res.text.strip().startswith("5")
        chat = apply_chat_template(eng.model, [{"role": "user", "content": "Say hi."}])
        res = eng.generate(eng.tokenize(chat, parse_special=True), n_predict=200)
        assert res.finish_reason is FinishReason.STOP  # EOG reached


def test_stop_with_a_step_under_way_never_leaves_two_engine_threads():
    """Stepper.stop(timeout) during a long step keeps the thread (it ends after its step); start() then waits
    for it instead of starting a second one beside it (review: 'Stepper.stop forgets a live thread')."""
    import threading

    from llamaspec.stepper import Stepper

    gate, steps, inside = threading.Event(), [], threading.Event()

    def step():
        inside.set()
        gate.wait(5)
        steps.append(threading.current_thread().ident)

    st = Stepper(step, has_work=lambda: len(steps) < 3, is_closed=lambda: False)
    st.start()
    assert inside.wait(5)
    st.stop(timeout=0.05)                           # the step is still under way
    assert not st.threaded and st.has_thread
    threading.Timer(0.2, gate.set).start()
    st.start()                                      # waits for the old thread, then one fresh thread
    alive = [t for t in threading.enumerate() if t.name == "llamaspec-engine"]
    assert len(alive) == 1
    st.stop()
    assert not st.has_thread
