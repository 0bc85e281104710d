"""Context shift (``Engine(context_shift=True)``, ``llamaspec serve --context-shift``): a full context drops the
older half of its tokens and generation goes on, as llama-server does it (:mod:`llamaspec.ctx_shift`)."""
from __future__ import annotations

import json
import logging
import urllib.request

import pytest

from llamaspec.ctx_shift import keep_discard
from llamaspec.engine import Engine
from llamaspec.params import SpecParams
from llamaspec.slot import FinishReason
from llamaspec.options import RequestOptions, Shift

from helpers import EXACT
from support.server import LLAMA_SERVER, ServerProcess, llama_server


N_CTX = 256  # the tiny models' context (llama.cpp gives no smaller one)
PROMPT = [1, 5, 9, 13, 22, 7, 30, 41, 2, 17]


def _run(eng: Engine, n_predict: int):
    req = eng.submit(PROMPT, RequestOptions(n_predict=n_predict))
    res = req.result()
    return req, res


def test_keep_discard_is_llama_servers_rule():
    assert keep_discard(255, 256, add_bos=False) == (0, 127)
    assert keep_discard(255, 256, add_bos=True) == (1, 127)
    assert keep_discard(63, 64, add_bos=False, n_keep=100) == (60, 1)  # n_keep <= n_ctx - 4, >= 1 discarded


def _shifted(tokens: list[int]) -> list[int]:
    """What the memory holds after generating ``tokens`` from PROMPT with llama-server's shifts: before a
    sampled token is decoded into a full context, ``n_discard`` tokens after ``n_keep`` go (the last sampled
    token is never decoded)."""
    mem = list(PROMPT)
    for t in tokens[:-1]:
        if len(mem) + 1 >= N_CTX:
            k, d = keep_discard(len(mem), N_CTX, add_bos=False)
            del mem[k:k + d]
        mem.append(t)
    return mem


def test_generation_goes_past_a_full_context(tiny_model):
    with Engine(tiny_model("llama"), n_ctx=N_CTX, context_shift=True, cache_prompt=True, **EXACT) as eng:
        assert eng.round.shift.enabled and eng.n_ctx_seq == N_CTX
        req, res = _run(eng, 400)
        assert res.finish_reason is FinishReason.LENGTH and len(res.tokens) == 400 and req.truncated
        assert eng.round.shift.n_shifts == 2
        # the memory holds the shifted sequence at positions 0.., and the slot's tokens are those
        cached = eng.slots[0].cached
        assert cached == _shifted(res.tokens)
        assert eng.ctx.memory.pos_min(0) == 0 and eng.ctx.memory.pos_max(0) == len(cached) - 1
        # the next request reuses that cache as any other (a prefix of what the memory holds)
        again = eng.submit(cached[:50] + [3], RequestOptions(n_predict=2))
        again.result()
        assert again.stats.n_cached == 50


def _native(path) -> ServerProcess:
    """llama-server --context-shift on ``path`` (exact settings, one slot, N_CTX) on a free port."""
    return llama_server(["-m", path, "-c", N_CTX, "-np", "1", "-t", "1", "-fa", "off", "-ctk", "f32", "-ctv", "f32",
                         "--no-warmup", "--context-shift"])


@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason="native llama-server not built (scripts/build_llama_cpp.sh)")
def test_same_tokens_as_llama_server(tiny_model):
    """llama-server --context-shift on the same model and prompt: the same 400 greedy tokens."""
    path = tiny_model("llama")
    with _native(path) as srv:
        body = json.dumps({"prompt": PROMPT, "n_predict": 400, "temperature": 0, "return_tokens": True}).encode()
        with urllib.request.urlopen(urllib.request.Request(srv.url + "/completion", body), timeout=300) as r:
            nat = json.load(r)
    with Engine(path, n_ctx=N_CTX, context_shift=True, **EXACT) as eng:
        req, res = _run(eng, 400)
    assert nat["truncated"] and req.truncated
    assert res.tokens == nat["tokens"]


def test_without_context_shift_a_full_context_ends_the_request(tiny_model):
    with Engine(tiny_model("llama"), n_ctx=N_CTX, **EXACT) as eng:
        req, res = _run(eng, 400)
    assert res.finish_reason is FinishReason.LENGTH and len(PROMPT) + len(res.tokens) == N_CTX and req.truncated


def test_draft_model_follows_the_shift(tiny_model):
    with Engine(tiny_model("llama"), n_ctx=N_CTX, context_shift=True, **EXACT) as plain:
        _, want = _run(plain, 450)
    spec = SpecParams()
    spec.draft.n_max = 3
    spec.draft_adaptive = False
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec, n_ctx=N_CTX, context_shift=True,
                cache_prompt=True, **EXACT) as eng:
        assert eng.round.shift.enabled
        req, res = _run(eng, 450)
        assert res.stats.n_drafted > 0 and eng.round.shift.n_shifts >= 2
        n = len(eng.slots[0].cached)
        assert eng.ctx.memory.pos_max(0) == n - 1 and eng.ctx_dft.memory.pos_max(0) == n - 1
    assert res.tokens == want.tokens and req.truncated  # greedy + match: the draft never changes the output


def test_a_memory_that_cannot_shift_turns_it_off(tiny_model, caplog):
    with caplog.at_level(logging.WARNING, logger="llamaspec"):
        with Engine(tiny_model("mamba"), n_ctx=N_CTX, context_shift=True) as eng:
            assert not eng.round.shift.enabled
            req, res = _run(eng, 400)
    assert "context shift is not available" in caplog.text
    assert len(PROMPT) + len(res.tokens) == N_CTX and req.truncated


# -- per-request n_keep / n_discard (llama-server's fields) ------------------------------------------------
KEEP_DISCARD = [(5, 0), (0, 40), (-1, 100), (3, 500)]


def test_keep_discard_takes_the_requests_values():
    assert keep_discard(255, 256, add_bos=False, n_keep=5) == (5, 125)
    assert keep_discard(255, 256, add_bos=False, n_discard=40) == (0, 40)
    assert keep_discard(255, 256, add_bos=True, n_keep=-1, n_prompt=10) == (11, 122)  # -1: the prompt (+ BOS)
    assert keep_discard(255, 256, add_bos=False, n_keep=3, n_discard=500) == (3, 251)  # all but one of the rest


@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason="native llama-server not built (scripts/build_llama_cpp.sh)")
def test_request_n_keep_and_n_discard_give_llama_servers_tokens(tiny_model):
    """llama-server --context-shift with a request's ``n_keep`` / ``n_discard``: the same greedy tokens from
    the engine and from ``llamaspec serve``'s /completion (which reports them in ``generation_settings``)."""
    from starlette.testclient import TestClient

    from llamaspec.server.app import ServerConfig, ServerState, create_app

    path = tiny_model("llama")
    nat = []
    with _native(path) as srv:
        for k, d in KEEP_DISCARD:
            body = json.dumps({"prompt": PROMPT, "n_predict": 400, "temperature": 0, "return_tokens": True,
                               "n_keep": k, "n_discard": d}).encode()
            with urllib.request.urlopen(urllib.request.Request(srv.url + "/completion", body), timeout=300) as r:
                nat.append(json.load(r)["tokens"])
    with Engine(path, n_ctx=N_CTX, context_shift=True, **EXACT) as eng:
        ours = [eng.submit(PROMPT, RequestOptions(n_predict=400, shift=Shift(n_keep=k, n_discard=d))).result().tokens for k, d in KEEP_DISCARD]
        with TestClient(create_app(ServerState(ServerConfig(model_id="tiny"), engine=eng))) as c:
            r = c.post("/completion", json={"prompt": PROMPT, "n_predict": 400, "temperature": 0, "return_tokens": True,
                                            "n_keep": 5, "n_discard": 0})
            assert r.json()["tokens"] == ours[0] and r.json()["truncated"]
            assert r.json()["generation_settings"]["n_keep"] == 5
            for bad in ({"n_keep": -2}, {"n_discard": -1}, {"n_keep": "x"}):
                r = c.post("/completion", json={"prompt": PROMPT, "n_predict": 1, **bad})
                assert r.status_code == 400 and next(iter(bad)) in r.json()["error"]["message"]
    assert len({tuple(t) for t in ours}) == len(ours)  # each setting shifts differently
    for (k, d), a, b in zip(KEEP_DISCARD, ours, nat):
        assert a == b, (k, d)
