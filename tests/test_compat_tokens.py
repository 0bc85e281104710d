"""``llamaspec.Llama`` against ``llama_cpp.Llama`` beyond plain completions: the token-level API (``eval``,
``sample``, ``generate``, ``n_tokens``, ``input_ids``, ``scores``), ``logits_processor`` through speculative
verification, the samplers llama-cpp-python builds (typical, mirostat, penalties), ``echo`` with ``logprobs``,
``suffix``, ``set_cache`` and what is refused. Tiny random models only (fast)."""
from __future__ import annotations

import itertools

import llama_cpp
import numpy as np
import pytest

from llamaspec._llama.lcp import load_llama
from llamaspec.compat import CompatError, Llama
from llamaspec.testing.tiny_models import write_model

KW = dict(n_ctx=256, verbose=False, n_threads=1)
P = [1, 2, 3, 4, 5, 6, 7, 8]


def text(resp) -> str:
    return resp["choices"][0]["text"]


def take(gen, n: int) -> list[int]:
    return list(itertools.islice(gen, n))


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return str(tiny_model("llama")), str(tiny_model("llama-draft"))


@pytest.fixture(scope="module")
def tiny_eos(tmp_path_factory):
    """The tiny llama with a BOS it adds and an EOS (token 63)."""
    return str(write_model("llama", tmp_path_factory.mktemp("eos") / "llama-eos.gguf", eos_token_id=63,
                           bos_token_id=1, add_bos_token=True))


@pytest.fixture(scope="module")
def ref(tiny):
    r = load_llama(tiny[0], **KW)
    yield r
    r.close()


@pytest.mark.parametrize("draft", [None, "model"])
def test_eval_sample_generate_follow_llama_cpp(tiny, ref, draft):
    with Llama(tiny[0], draft_model=tiny[1] if draft else None, **KW) as llm:
        ref.reset()
        expected = take(ref.generate(P, temp=0.0), 12)
        assert take(llm.generate(P, temp=0.0), 12) == expected
        assert llm.n_tokens == ref.n_tokens == len(P) + 11  # the last token yielded is not evaluated yet
        # eval appends to what is evaluated; sample reads any evaluated row
        for m in (llm, ref):
            m.reset()
            m.eval(P[:5])
            m.eval(P[5:])
        assert llm.n_tokens == len(P) and llm.input_ids[: llm.n_tokens].tolist() == P
        assert llm.sample(temp=0.0) == ref.sample(temp=0.0, idx=len(P) - 1) == expected[0]
        assert llm.sample(temp=0.0, idx=3) == take(ref.generate(P[:4], temp=0.0), 1)[0]
        # an exact cache hit; a shorter prompt reuses its prefix
        llm.reset()
        llm.eval(P)
        assert take(llm.generate(P, temp=0.0), 5) == expected[:5]
        llm.reset()
        llm.eval(P + [9, 10, 11])
        assert take(llm.generate(P, temp=0.0), 5) == expected[:5]
        # reset=False: after what is evaluated
        llm.reset()
        llm.eval(P[:4])
        assert take(llm.generate(P[4:], temp=0.0, reset=False), 5) == expected[:5]
        if draft:
            assert llm.engine.totals.n_drafted > 0


def test_generate_yields_eog_goes_on_and_is_cancelled_when_closed(tiny_eos):
    ref = load_llama(tiny_eos, **KW)
    eos = ref.token_eos()

    def force_eos(ids, logits):  # the third generated token is EOS
        if len(ids) == 1 + len(P) + 2:
            logits[:] = -1e9
            logits[eos] = 0.0
        return logits

    expected = take(ref.generate([1] + P, temp=0.0, logits_processor=[force_eos]), 6)
    assert expected[2] == eos
    with Llama(tiny_eos, draft_model=tiny_eos, **KW) as llm:
        assert take(llm.generate([1] + P, temp=0.0, logits_processor=[force_eos]), 6) == expected
        r = llm([1] + P, max_tokens=8, temperature=0, logits_processor=[force_eos])
        assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 2
        g = llm.generate(P, temp=0.0)
        first = next(g)
        assert llm._live is not None and not llm._live.done
        live = llm._live
        g.close()
        assert llm._live is None and live.cancelled
        # a token list sent into the generator is evaluated after the yielded token
        g = llm.generate(P, temp=0.0)
        assert next(g) == first
        g.send([5, 6])
        assert llm.input_ids[: llm.n_tokens].tolist() == P + [first, 5, 6]
        # another call takes the slot: the suspended generator ends
        llm.eval([3])
        assert list(g) == []
    ref.close()


@pytest.mark.parametrize("draft", [None, "model", "prompt-lookup"])
def test_logits_processor_runs_on_every_verified_row(tiny, ref, draft):
    def ban_argmax(ids, logits):
        logits[int(np.argmax(logits))] = -np.inf
        return logits

    prompts = [P, [10, 20, 30, 40, 10, 20, 30]]
    expected = [text(ref(p, max_tokens=24, temperature=0, logits_processor=llama_cpp.LogitsProcessorList([ban_argmax])))
                for p in prompts]
    dm = {None: None, "model": tiny[1], "prompt-lookup": llama_cpp.llama_speculative.LlamaPromptLookupDecoding(
        num_pred_tokens=4)}[draft]
    seen: list[int] = []

    def recorded(ids, logits):
        seen.append(len(ids))
        return ban_argmax(ids, logits)

    with Llama(tiny[0], draft_model=dm, **KW) as llm:
        got = [text(llm(p, max_tokens=24, temperature=0, logits_processor=[recorded])) for p in prompts]
        assert got == expected
        # one call per sampled token, in order: the history grows by one each time
        first = seen[: 24]
        assert first == list(range(len(P), len(P) + 24))
        if draft == "model":
            assert llm.engine.totals.n_drafted > 0


@pytest.mark.parametrize("kw", [dict(typical_p=0.8), dict(mirostat_mode=1), dict(mirostat_mode=2, mirostat_tau=3.0),
                                dict(repeat_penalty=1.5, frequency_penalty=0.3), dict(temperature=-1.0),
                                dict(temperature=1.4, top_k=0, typical_p=0.9, min_p=0.0)])
def test_samplers_follow_llama_cpp(tiny, kw):
    ref = load_llama(tiny[0], seed=99, **KW)
    # no draft: a sampled token can flip where a draw falls within the batched-vs-single logit difference
    with Llama(tiny[0], seed=99, **KW) as llm:
        for _ in range(2):
            assert text(llm(P, max_tokens=16, **kw)) == text(ref(P, max_tokens=16, **kw))
    ref.close()


def test_echo_with_logprobs_lists_the_prompt(tiny_eos):
    ref = load_llama(tiny_eos, logits_all=True, **KW)
    with Llama(tiny_eos, **KW) as llm:
        for n in (6, 1):
            a = llm("tok_1 tok_2 tok_3 tok_4", max_tokens=n, temperature=0, echo=True, logprobs=3)
            b = ref("tok_1 tok_2 tok_3 tok_4", max_tokens=n, temperature=0, echo=True, logprobs=3)
            assert text(a) == text(b)
            la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
            assert la["tokens"] == lb["tokens"] and la["text_offset"] == lb["text_offset"]
            assert la["token_logprobs"][0] is None and la["top_logprobs"][0] is None
            np.testing.assert_allclose(la["token_logprobs"][1:], lb["token_logprobs"][1:], atol=2e-3)
            for x, y in zip(la["top_logprobs"][1:], lb["top_logprobs"][1:]):
                assert x.keys() == y.keys()
            chunks = list(llm("tok_1 tok_2 tok_3 tok_4", max_tokens=n, temperature=0, echo=True, logprobs=3,
                              stream=True))
            listed = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
            assert listed == la["tokens"]  # a stream lists the same tokens (the prompt's with the echoed prompt)
    ref.close()


@pytest.mark.parametrize("kind", ["llama", "mamba"])  # mamba: the scoring memory cannot trim, it starts over
def test_scores_with_logits_all(tiny_model, kind):
    path = str(tiny_model(kind))
    r = load_llama(path, logits_all=True, **KW)
    with Llama(path, logits_all=True, **KW) as llm:
        for m in (llm, r):
            m.eval(P[:3])
            m.eval(P[3:])
        llm.reset()
        llm.eval(P)  # the scoring context keeps the common prefix, or decodes again
        np.testing.assert_allclose(llm._scores, r._scores, atol=1e-3)
        assert llm._scores.shape == r._scores.shape == (len(P), llm.n_vocab())
        np.testing.assert_allclose(llm._scores, r._scores, atol=1e-3)
    r.close()


def test_scores_after_a_trim_on_a_sliding_window_model(tmp_path):
    """The scoring context keeps a prefix only where its sliding window is whole (the engine's rule,
    ``Rollback.keep_prefix``): after 300 tokens the window cache has given the first positions' cells to later
    ones, so a history cut back to 10 tokens is decoded again (it read a half-empty window before)."""
    path = str(write_model("gemma3", tmp_path / "gemma3-1k.gguf", n_ctx=1024))
    rng = np.random.default_rng(0)
    a, b = ([int(t) for t in rng.integers(0, 64, n)] for n in (300, 20))
    kw = dict(KW, n_ctx=1024)
    with Llama(path, logits_all=True, **kw) as llm:
        llm.eval(a)
        llm.n_tokens = 10
        llm.eval(b)
        got = llm._scores[10:].copy()
    r = load_llama(path, logits_all=True, **kw)
    r.eval(a[:10] + b)
    np.testing.assert_allclose(got, r._scores[10:], atol=1e-3)
    r.close()


def test_suffix(tiny, monkeypatch):
    with Llama(tiny[0], **KW) as llm:
        plain = text(llm(P, max_tokens=6, temperature=0))
        assert text(llm(P, max_tokens=6, temperature=0, suffix=" tail")) == plain + " tail"  # no FIM tokens
        from llamaspec.compat import completion

        monkeypatch.setattr(completion.lcp, "fim_tokens", lambda model: (11, 12, 13))
        assert completion.prompt_tokens(llm, P, "") == [11] + P + [12, 13]
        assert completion.prompt_tokens(llm, P, None) == P
        llm.spm_infill = True
        assert completion.prompt_tokens(llm, P, "") == [12, 11] + P + [13]
        r = llm(P, max_tokens=4, temperature=0, suffix="x")
        assert r["usage"]["prompt_tokens"] == len(P) + 3 + len(llm.tokenize(b"x", add_bos=False))


def test_set_cache_loads_the_cached_state(tiny):
    cache = llama_cpp.LlamaRAMCache()
    with Llama(tiny[0], **KW) as writer:
        writer.set_cache(cache)
        expected = writer(P, max_tokens=4, temperature=0)
    assert len(cache.cache_state) == 1
    with Llama(tiny[0], **KW) as llm:
        llm.set_cache(cache)
        calls = []
        orig = llm.load_state
        llm.load_state = lambda state: (calls.append(state), orig(state))[1]
        got = llm(P, max_tokens=4, temperature=0)
        assert len(calls) == 1 and text(got) == text(expected)
        assert got["llamaspec"]["n_cached"] >= len(P) - 1  # the restored prompt was not decoded again


def test_handles_and_refusals(tiny):
    with Llama(tiny[0], vocab_only=True, verbose=False) as v:
        assert v._ctx.ctx is not None and v.model is not None
        assert (v._is_recurrent, v._is_hybrid) == (False, False)
    with Llama(tiny[0], **KW) as llm:
        assert llm.ctx is not None and llm._ctx.n_ctx() == llm.n_ctx() == llm.context_params.n_ctx == 256
        with pytest.raises(CompatError, match="embedding=True"):
            llm.create_embedding("hello")
        with pytest.raises(CompatError, match="embedding=True"):
            llm.embed("hello")
        with pytest.raises(CompatError, match="eval first"):
            llm.sample()


def test_native_log_callback_is_reentrant():
    """A finalizer (an unclosed Llama freed by the garbage collector) can log from inside the log callback, on
    the same thread: llama-cpp-python's tests create many Llamas without closing them, and this deadlocked."""
    import threading

    from llamaspec._llama import log

    done = threading.Event()

    def inner():
        with log._router._lock:  # the callback holds its lock when the collector runs a finalizer that logs
            log._router.feed(2, "a line logged from a finalizer\n")
        done.set()

    t = threading.Thread(target=inner, daemon=True)
    t.start()
    t.join(10)
    assert done.is_set()
