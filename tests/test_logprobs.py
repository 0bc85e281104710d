"""Token probabilities ("logprobs") end to end: the engine (speculative = plain), ``llamaspec serve``'s three
shapes (llama-server's ``completion_probabilities``, OpenAI completions and chat), and ``llamaspec.Llama``
against ``llama_cpp.Llama``.

Exactness runs on the tiny models with flash attention off and an F32 KV cache, where batched and single-row
decoding agree to ~1e-5 (testing-notes.md §1); the comparison with llama-cpp-python (its own batch shapes)
allows 1e-3.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from llamaspec import _llama as L
from llamaspec.drafters.base import Drafter
from llamaspec.engine import Engine
from llamaspec.errors import UsageError
from llamaspec.logprobs import ProbsSpec, TokenProb, post_entry, raw_entry
from llamaspec.params import SpecParams
from llamaspec.options import RequestOptions

from helpers import EXACT

PROMPT = [1, 5, 9, 13, 22, 7]
N = 40
REL = 1e-4


def spec(n_max: int) -> SpecParams:
    p = SpecParams()
    p.draft.n_max = n_max
    p.draft_adaptive = False  # tiny drafts cost as much as the target: keep drafting
    return p


def close_entries(a, b, rel=REL) -> None:
    """Same tokens, same alternatives, log-probabilities equal to ``rel`` (relative)."""
    assert [e.id for e in a] == [e.id for e in b]
    for x, y in zip(a, b):
        assert x.logprob == pytest.approx(y.logprob, rel=rel, abs=1e-6)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        for (_, lx), (_, ly) in zip(x.top, y.top):
            assert lx == pytest.approx(ly, rel=rel, abs=1e-6)


@pytest.fixture(scope="module")
def plain(tiny_model):
    """Greedy plain results with 8 alternatives per token, per kind."""
    cache = {}

    def get(kind: str, probs=ProbsSpec(8), sampling=None):
        key = (kind, probs, None if sampling is None else repr(sampling))
        if key not in cache:
            with Engine(tiny_model(kind), n_ctx=256, **EXACT) as e:
                cache[key] = e.generate(PROMPT, n_predict=N, probs=probs, sampling=sampling)
        return cache[key]

    return get


class Scripted(Drafter):
    """Drafts ``good`` tokens of the known continuation then ``bad`` wrong ones, per call of a plan."""

    type = "scripted"

    def __init__(self, truth: list[int], plan: list[tuple[int, int]]):
        super().__init__(1)
        self.truth, self.plan, self.n_max, self.calls = truth, list(plan), 8, 0

    def draft(self, params):
        dp = params[0]
        if not dp.drafting or self.calls >= len(self.plan):
            return
        good, bad = self.plan[self.calls]
        self.calls += 1
        k = len(dp.prompt) + 1 - len(PROMPT)  # where the token after id_last is in the continuation
        ok = self.truth[k : k + good]
        wrong = [(t + 1) % 64 for t in self.truth[k + len(ok) : k + len(ok) + bad]]
        dp.result.extend(ok + wrong)


# -- engine -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tgt,dft", [("llama", "llama-draft"), ("mamba", "mamba-draft")])
def test_speculative_logprobs_equal_plain(tiny_model, plain, tgt, dft):
    """Draft model: trims (llama, PART) and checkpoint restores + replays (mamba, FULL)."""
    ref = plain(tgt)
    with Engine(tiny_model(tgt), draft=tiny_model(dft), spec=spec(4), n_ctx=256, **EXACT) as e:
        r = e.generate(PROMPT, n_predict=N, probs=ProbsSpec(8))
    st = r.stats
    assert r.tokens == ref.tokens and 0 < st.n_accepted < st.n_drafted
    if tgt == "mamba":
        assert st.n_restores > 0 and st.n_replays > 0
    close_entries(r.token_probs, ref.token_probs)


@pytest.mark.parametrize("kind", ["llama", "mamba"])
def test_scripted_drafts_logprobs_equal_plain(tiny_model, plain, kind):
    ref = plain(kind)
    d = Scripted(ref.tokens, [(3, 0), (1, 2), (0, 2), (2, 1), (4, 0), (0, 1), (5, 3)])
    with Engine(tiny_model(kind), drafters=[d], spec=SpecParams(), n_ctx=256, **EXACT) as e:
        r = e.generate(PROMPT, n_predict=N, probs=ProbsSpec(8))
    assert r.tokens == ref.tokens and r.stats.n_accepted == 15
    close_entries(r.token_probs, ref.token_probs)


def test_greedy_entries_are_the_model_distribution(tiny_model, plain):
    r = plain("llama")
    assert len(r.token_probs) == len(r.tokens) == N
    for e in r.token_probs:
        assert len(e.top) == 8 and not e.post_sampling
        assert e.top[0] == (e.id, e.logprob)  # greedy: the chosen token is the most likely
        lps = [lp for _, lp in e.top]
        assert lps == sorted(lps, reverse=True) and lps[0] <= 0.0
        assert sum(math.exp(lp) for lp in lps) <= 1.0 + 1e-9
    # the numbers are the log-softmax of the target's logits at each position (teacher-forced, one decode)
    with L.Model(tiny_model("llama")) as m, L.Context(m, n_ctx=256, **EXACT) as ctx:
        toks = PROMPT + r.tokens
        ctx.decode_tokens(toks, 0, 0, output_all=True)
        for k, e in enumerate(r.token_probs):
            x = ctx.logits(len(PROMPT) - 1 + k).astype(np.float64)
            want = x - x.max() - math.log(np.exp(x - x.max()).sum())
            assert e.logprob == pytest.approx(want[e.id], rel=REL, abs=1e-5)
            assert [t for t, _ in e.top] == list(np.argsort(-want, kind="stable")[:8])
    zero = plain("llama", ProbsSpec(0))
    assert [e.top for e in zero.token_probs] == [()] * N
    assert [e.logprob for e in zero.token_probs] == pytest.approx([e.logprob for e in r.token_probs], abs=1e-9)


def test_post_sampling_probs(tiny_model, plain):
    sp = L.SamplingParams(temp=0.9, top_k=5, top_p=1.0, min_p=0.0, seed=1234, repeat_penalty=1.3)
    ref = plain("llama", ProbsSpec(10, post_sampling=True), sp)
    for e in ref.token_probs:
        assert e.post_sampling and 0 < len(e.top) <= 5  # top-k respected: the rest have probability 0
        ps = [p for _, p in e.top_probs]
        assert ps == sorted(ps, reverse=True) and sum(ps) == pytest.approx(1.0, abs=1e-5) and sum(ps) <= 1 + 1e-6
        assert 0.0 < e.prob <= 1.0 and e.id in dict(e.top)
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec(3), n_ctx=256, **EXACT) as e:
        r = e.generate(PROMPT, n_predict=N, sampling=sp, probs=ProbsSpec(10, post_sampling=True))
    assert r.tokens == ref.tokens and r.stats.n_accepted > 0
    close_entries(r.token_probs, ref.token_probs)
    greedy = plain("llama", ProbsSpec(4, post_sampling=True))
    assert all(e.top == ((e.id, 0.0),) and e.prob == 1.0 for e in greedy.token_probs)  # a point mass


def test_entries_follow_the_emitted_tokens(tiny_model, plain):
    """Stop strings and n_predict cut a chunk: it keeps the entries of what it emits; without probs, nothing."""
    ref = plain("llama")
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec(6), n_ctx=256, **EXACT) as e:
        stop = e.vocab.token_to_piece(ref.tokens[20]).decode()
        chunks = list(e.stream(PROMPT, n_predict=N, stop=[stop], probs=3))
        r = e.generate(PROMPT, n_predict=N, stop=[stop], probs=3)
        none = e.generate(PROMPT, n_predict=7)
    assert r.finish_reason.value == "stop" and len(r.tokens) < N
    assert [t.id for t in r.token_probs] == r.tokens == ref.tokens[: len(r.tokens)]
    assert any(len(ch.tokens) > 1 for ch in chunks)
    for ch in chunks:
        assert [t.id for t in ch.probs] == ch.tokens and "".join(ch.texts) == ch.text
    assert none.token_probs is None


def test_math_of_one_entry():
    e = raw_entry(np.array([1.0, 3.0, 2.0, 3.0], dtype=np.float32), 2, 3)
    lse = math.log(sum(math.exp(x) for x in (1, 3, 2, 3)))
    assert e.logprob == pytest.approx(2 - lse) and [t for t, _ in e.top] == [1, 3, 2]  # ties: lower id first
    p = post_entry(np.array([3, 9, 4]), np.array([0.2, 0.0, 0.8]), 9, 5)
    assert p.logprob == -math.inf and p.top_probs == ((4, 0.8), (3, 0.2))


@pytest.mark.parametrize("bad", [-1, 65, "5", True, ProbsSpec(-2)])
def test_bad_probs_are_usage_errors(tiny_model, bad):
    with Engine(tiny_model("llama"), n_ctx=64) as e:
        with pytest.raises(UsageError, match="n_probs|probs must"):
            e.submit(PROMPT, RequestOptions(n_predict=2, probs=bad))


# -- server -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http(tiny_model):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from llamaspec.server.app import ServerConfig, ServerState, create_app

    eng = Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec(4), n_ctx=512, n_parallel=2, **EXACT)
    with TestClient(create_app(ServerState(ServerConfig(chat_template="chatml"), engine=eng))) as c:
        yield c


def _sse(r) -> list:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def _check_entry(d: dict, n: int, post: bool = False) -> None:
    val, top = ("prob", "top_probs") if post else ("logprob", "top_logprobs")
    assert {"id", "token", "bytes", val, top} <= set(d)
    assert isinstance(d["token"], str) and bytes(d["bytes"]).decode("utf-8", "ignore") == d["token"]
    assert (0 < d[val] <= 1) if post else d[val] <= 0
    assert len(d[top]) == n if not post else 0 < len(d[top]) <= n


def test_native_completion_probabilities(http, plain):
    ref = plain("llama")
    r = http.post("/completion", json={"prompt": PROMPT, "n_probs": 8, "temperature": 0, "n_predict": N})
    assert r.status_code == 200, r.text
    cp = r.json()["completion_probabilities"]
    assert [d["id"] for d in cp] == ref.tokens
    for d, e in zip(cp, ref.token_probs):
        _check_entry(d, 8)
        assert d["logprob"] == pytest.approx(e.logprob, rel=REL, abs=1e-6)
        assert [t["id"] for t in d["top_logprobs"]] == [t for t, _ in e.top]
    # a stream: one entry per event, even when a speculative round emits several tokens at once
    with http.stream("POST", "/completion", json={"prompt": PROMPT, "n_probs": 3, "temperature": 0,
                                                  "n_predict": N, "stream": True}) as s:
        events = _sse(s)
    body = [ev for ev in events if not ev["stop"]]
    assert all(len(ev["completion_probabilities"]) == 1 for ev in body)
    assert [ev["completion_probabilities"][0]["id"] for ev in body] == ref.tokens
    assert "".join(ev["content"] for ev in events) == "".join(d["token"] for d in cp)
    assert "completion_probabilities" not in events[-1]
    # post-sampling probabilities
    r = http.post("/completion", json={"prompt": PROMPT, "n_probs": 10, "temperature": 1.0, "top_k": 4,
                                       "n_predict": 8, "post_sampling_probs": True, "seed": 7}).json()
    for d in r["completion_probabilities"]:
        _check_entry(d, 4, post=True)
        assert sum(t["prob"] for t in d["top_probs"]) <= 1 + 1e-6
    assert r["generation_settings"]["n_probs"] == 10 and r["generation_settings"]["post_sampling_probs"] is True


def test_openai_completions_logprobs(http, plain):
    ref = plain("llama")
    r = http.post("/v1/completions", json={"prompt": PROMPT, "logprobs": 2, "temperature": 0, "max_tokens": 12})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert [d["id"] for d in lp["content"]] == ref.tokens[:12]
    assert lp["tokens"] == [d["token"] for d in lp["content"]]
    assert lp["token_logprobs"] == [d["logprob"] for d in lp["content"]]
    assert all(len(t) in (2, 3) and tok in t for t, tok in zip(lp["top_logprobs"], lp["tokens"]))
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "logprobs": 0, "temperature": 0,
                                                      "max_tokens": 12, "stream": True}) as s:
        events = _sse(s)
    got = [c for ev in events for ch in ev["choices"] if ch["logprobs"] for c in ch["logprobs"]["content"]]
    assert [c["id"] for c in got] == ref.tokens[:12] and all(c["top_logprobs"] == [] for c in got)
    offsets = [o for ev in events for ch in ev["choices"] if ch["logprobs"] for o in ch["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]
    plain_r = http.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, "max_tokens": 2}).json()
    assert plain_r["choices"][0]["logprobs"] is None


def test_chat_logprobs(http):
    openai = pytest.importorskip("openai")
    msgs = [{"role": "user", "content": "hi"}]
    body = {"messages": msgs, "temperature": 0, "max_tokens": 10, "logprobs": True, "top_logprobs": 3}
    r = http.post("/v1/chat/completions", json=body).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == r["choices"][0]["message"]["content"]
    for c in content:
        _check_entry(c, 3)
    openai.types.chat.ChatCompletion(**r)  # OpenAI's own types take it
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = _sse(s)
    text, toks = "", []
    for ev in events[1:]:
        ch = ev["choices"][0]
        if ch["finish_reason"] is None:
            text += ch["delta"].get("content") or ""
            toks += ch["logprobs"]["content"]
    assert text == r["choices"][0]["message"]["content"] and toks == content
    d = http.post("/v1/chat/completions", json={"messages": msgs, "temperature": 0, "max_tokens": 3,
                                                "logprobs": True}).json()
    assert all(len(c["top_logprobs"]) == 20 for c in d["choices"][0]["logprobs"]["content"])  # llama-server's


EOG = 35  # the tiny llama's 9th greedy token after PROMPT, its 11th in the chat (their first 35s): made EOG


@pytest.fixture(scope="module")
def http_eog(tmp_path_factory):
    """A speculating server on the tiny pair with token EOG made end-of-generation."""
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from llamaspec.server.app import ServerConfig, ServerState, create_app
    from llamaspec.testing.tiny_models import write_model

    d = tmp_path_factory.mktemp("eog")
    target, draft = (write_model(k, d / f"{k}.gguf", eos_token_id=EOG) for k in ("llama", "llama-draft"))
    eng = Engine(target, draft=draft, spec=spec(4), n_ctx=512, **EXACT)
    with TestClient(create_app(ServerState(ServerConfig(chat_template="chatml"), engine=eng))) as c:
        yield c


def test_end_of_generation_token_listed(http_eog, plain):
    """llama-server lists the end-of-generation token a request ended on last in ``tokens`` and in the token
    probabilities (in a stream an event of its own with no content, none in a chat stream), and counts it:
    speculative rounds included (tests/test_schema_text_parity.py compares with llama-server itself, on a
    real model whose end-of-generation token has no text and no bytes)."""
    out = plain("llama").tokens[: plain("llama").tokens.index(EOG)]
    body = {"prompt": PROMPT, "n_probs": 2, "temperature": 0, "n_predict": N, "return_tokens": True}
    r = http_eog.post("/completion", json=body).json()
    assert r["stop_type"] == "eos" and r["tokens"] == out + [EOG] == [d["id"] for d in r["completion_probabilities"]]
    assert r["tokens_predicted"] == len(out) + 1
    with http_eog.stream("POST", "/completion", json={**body, "stream": True}) as s:
        events = _sse(s)
    assert sum((ev["tokens"] for ev in events), []) == r["tokens"]
    assert [d["id"] for ev in events for d in ev.get("completion_probabilities", [])] == r["tokens"]
    eog = events[-2]
    assert (eog["content"], eog["tokens"], eog["tokens_predicted"]) == ("", [EOG], len(out) + 1)
    assert len(eog["completion_probabilities"]) == 1
    with http_eog.stream("POST", "/completion", json={**body, "n_probs": 0, "stream": True}) as s:
        assert sum((ev["tokens"] for ev in _sse(s)), []) == r["tokens"]  # without probabilities too

    oai = {"prompt": PROMPT, "logprobs": 2, "temperature": 0, "max_tokens": N}
    lp = http_eog.post("/v1/completions", json=oai).json()["choices"][0]["logprobs"]
    assert [d["id"] for d in lp["content"]] == r["tokens"] and len(lp["tokens"]) == len(r["tokens"])
    with http_eog.stream("POST", "/v1/completions", json={**oai, "stream": True}) as s:
        events = _sse(s)
    assert [d["id"] for ev in events for c in ev["choices"] if c["logprobs"] for d in c["logprobs"]["content"]] \
        == r["tokens"]
    assert events[-2]["choices"][0]["text"] == "" and len(events[-2]["choices"][0]["logprobs"]["content"]) == 1

    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": N, "logprobs": True}
    c = http_eog.post("/v1/chat/completions", json=chat).json()["choices"][0]
    assert c["finish_reason"] == "stop" and c["logprobs"]["content"][-1]["id"] == EOG
    with http_eog.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
        events = _sse(s)
    got = [d for ev in events for ch in ev["choices"] if ch.get("logprobs") for d in ch["logprobs"]["content"]]
    assert got == c["logprobs"]["content"][:-1]  # llama-server: the token adds no content, so no chunk
    assert all(ch["delta"].get("content") for ev in events[1:-1] for ch in ev["choices"])


def test_stream_events_one_per_token_as_llama_server(http_eog, plain):
    """The completion routes stream one event per sampled token, drafted or not, as the pinned llama-server
    does (observed on SmolLM2-135M Q4_1, ``native/bin/llama-server --jinja -t 1`` beside ``llamaspec serve``,
    temperature 0, every event of both streams diffed, ending by EOS, by n_predict and by a stop word):

    - ``/completion``: every event's ``tokens`` is ``[id]`` of its one token, with or without
      ``return_tokens``; ``tokens_predicted`` counts up by one. The end-of-generation token has its own event
      (``content`` "", ``tokens`` ``[2]``, no ``timings``), the last before the final object (``stop: true``,
      ``tokens: []``, ``content`` "").
    - A stop word: its token's event has ``content`` "" and ``timings`` (llama-server knows the stop before it
      sends the event; at EOS and n_predict the events have none). A token that may begin the stop string
      has ``content`` "", the next event carries the text it held back.
    - ``/v1/completions``: the same events (``text`` "", ``logprobs`` null for the end-of-generation token and
      the stop word, ``timings`` on the stop word's), then the finish chunk with ``usage`` and ``timings``.
    - ``tokens_cached`` (the final object) counts the tokens decoded into the cache: the prompt and the output
      but the last token sampled (the EOG token, the stop word, the one n_predict ended on): 33 + 37 - 1 = 69
      at EOS, 33 + 6 - 1 = 38 at n_predict 6, 33 + 20 - 1 = 52 at the stop word.
    - ``/v1/chat/completions`` with ``stream_options.include_usage``: ``timings`` on the usage chunk only, none
      on the finish chunk (without it: on the finish chunk); no chunk for the end-of-generation token.
    """
    out = plain("llama").tokens[: plain("llama").tokens.index(EOG)]
    base = {"prompt": PROMPT, "temperature": 0, "n_predict": N, "stream": True}
    for extra in ({}, {"return_tokens": True}):
        with http_eog.stream("POST", "/completion", json={**base, **extra}) as s:
            events = _sse(s)
        *parts, final = events
        assert [ev["tokens"] for ev in parts] == [[t] for t in out + [EOG]]
        assert [ev["tokens_predicted"] for ev in parts] == list(range(1, len(out) + 2))
        assert parts[-1]["content"] == "" and not any("timings" in ev for ev in parts)
        assert final["stop"] and final["tokens"] == [] and final["stop_type"] == "eos"
        assert final["tokens_cached"] == len(PROMPT) + len(out)
    with http_eog.stream("POST", "/v1/completions", json={**base, "max_tokens": N}) as s:
        *parts, finish = _sse(s)
    assert len(parts) == len(out) + 1 and parts[-1]["choices"][0]["text"] == ""
    assert parts[-1]["choices"][0]["logprobs"] is None and finish["choices"][0]["finish_reason"] == "stop"

    # a stop word: out's text is "120278" + "1f" ...; "1" may begin the stop string: held by the first event
    stop = {**base, "stop": ["1f"]}
    with http_eog.stream("POST", "/completion", json=stop) as s:
        *parts, final = _sse(s)
    assert [ev["tokens"] for ev in parts] == [[t] for t in out[:5]]
    assert [ev["content"] for ev in parts] == ["", "120", "27", "8", ""]
    assert ["timings" in ev for ev in parts] == [False] * 4 + [True]
    assert (final["stop_type"], final["stopping_word"], final["tokens_cached"]) == ("word", "1f", len(PROMPT) + 4)
    with http_eog.stream("POST", "/v1/completions", json={**stop, "max_tokens": N}) as s:
        *parts, finish = _sse(s)
    assert [ev["choices"][0]["text"] for ev in parts] == ["", "120", "27", "8", ""] and "timings" in parts[-1]
    r = http_eog.post("/completion", json={**base, "stream": False, "n_predict": 3}).json()
    assert (r["stop_type"], r["tokens_cached"]) == ("limit", len(PROMPT) + 2)

    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": N, "stream": True}
    for usage in (False, True):
        with http_eog.stream("POST", "/v1/chat/completions",
                             json={**chat, "stream_options": {"include_usage": usage}}) as s:
            events = _sse(s)
        finish = events[-2] if usage else events[-1]
        assert finish["choices"][0]["finish_reason"] == "stop" and ("timings" in finish) is not usage
        assert "timings" in events[-1] and all("timings" not in ev for ev in events[:-2])


@pytest.mark.parametrize("path,body,field", [
    ("/completion", {"n_probs": -1}, "n_probs"),
    ("/completion", {"n_probs": 101}, "n_probs"),
    ("/completion", {"n_probs": "5"}, "n_probs"),
    ("/completion", {"n_probs": 2, "post_sampling_probs": "yes"}, "post_sampling_probs"),
    ("/v1/completions", {"logprobs": -3}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 100}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
])
def test_bad_values_are_400(http, path, body, field):
    base = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": PROMPT}
    r = http.post(path, json={**base, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and field in err["message"]


# -- llamaspec.Llama against llama_cpp.Llama --------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tiny_model):
    from llamaspec._llama.lcp import load_llama

    ref = load_llama(str(tiny_model("llama")), logits_all=True, n_ctx=256, verbose=False, n_threads=1,
                     chat_format="chatml")
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    out = ref(prompt, max_tokens=16, temperature=0, logprobs=3)
    chat = ref.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
                                      logprobs=True, top_logprobs=2)
    ref.close()
    return prompt, out, chat


@pytest.mark.parametrize("draft", [None, "llama-draft"])
def test_compat_logprobs_equal_llama_cpp(tiny_model, reference, draft):
    from llamaspec.compat import Llama

    prompt, ref, ref_chat = reference
    llm = Llama(str(tiny_model("llama")), draft_model=str(tiny_model(draft)) if draft else None, n_ctx=256,
                verbose=False, n_threads=1, chat_format="chatml")
    try:
        out = llm(prompt, max_tokens=16, temperature=0, logprobs=3)
        stream = list(llm(prompt, max_tokens=16, temperature=0, logprobs=3, stream=True))
        chat = llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2)
    finally:
        llm.close()
    a, b = ref["choices"][0]["logprobs"], out["choices"][0]["logprobs"]
    assert set(b) == {"tokens", "text_offset", "token_logprobs", "top_logprobs"}
    assert b["tokens"] == a["tokens"] and b["text_offset"] == a["text_offset"]
    assert np.allclose(b["token_logprobs"], a["token_logprobs"], atol=1e-3)
    for x, y in zip(a["top_logprobs"], b["top_logprobs"]):
        assert list(x) == list(y) and np.allclose(list(x.values()), list(y.values()), atol=1e-3)
    json.dumps(out)  # plain floats
    streamed = [c["choices"][0]["logprobs"] for c in stream if c["choices"][0]["logprobs"]]
    assert sum((s["tokens"] for s in streamed), []) == b["tokens"]
    assert sum((s["text_offset"] for s in streamed), []) == b["text_offset"]
    ca, cb = ref_chat["choices"][0]["logprobs"]["content"], chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in ca] == [c["token"] for c in cb]
    assert np.allclose([c["logprob"] for c in ca], [c["logprob"] for c in cb], atol=1e-3)


def test_compat_bad_logprobs(tiny_model):
    from llamaspec.compat import CompatError, Llama

    llm = Llama(str(tiny_model("llama")), n_ctx=128, verbose=False, n_threads=1)
    try:
        for bad, what in ((-1, "logprobs"), (10**6, "vocabulary"), ("3", "integer"), (1.5, "integer")):
            with pytest.raises(CompatError, match=what):
                llm([1, 2, 3], max_tokens=2, logprobs=bad)
        echoed = llm([1, 2, 3], max_tokens=2, logprobs=2, echo=True)["choices"][0]["logprobs"]  # the prompt's too
        assert len(echoed["tokens"]) == 3 + 2 and echoed["token_logprobs"][0] is None
        assert llm([1, 2, 3], max_tokens=2, temperature=0)["choices"][0]["logprobs"] is None
    finally:
        llm.close()


def test_legacy_logprobs_one_builder_for_both_faces():
    """compat's ``logprobs`` object and the server's legacy ``/v1/completions`` fields come from one builder:
    equal on whole-character pieces, apart only where each reference's offset unit differs (a character split
    over tokens: llama-cpp-python counts it once whole, the server adds up each token's own text) and at -inf
    (llama-cpp-python keeps it, as its own log-softmax gives it; the server's JSON gets the lowest float)."""
    from llama_cpp import Llama as LcpLlama

    from llamaspec.compat.scoring import CompletionLogprobs
    from llamaspec.logprobs import legacy_logprobs
    from llamaspec.server.probs import LOG_ZERO, ProbsRender

    pieces = {0: b"", 1: b"a", 2: b" bc", 3: b"\xe2\x82", 4: b"\xac", 5: b"d", 6: b"\xc3\xa9"}

    class Vocab:
        bos = 0

        def token_to_piece(self, t, special=False):
            return pieces[t]

    class Llm:
        _vocab = Vocab()

        def detokenize(self, tokens):
            return b"".join(pieces[t] for t in tokens)

    logits = np.array([-np.inf, 2.0, 1.0, 0.5, 0.0, -1.0, -np.inf], dtype=np.float32)
    assert LcpLlama.logits_to_logprobs(logits)[0] == -np.inf  # llama-cpp-python's value of a -inf logit

    def faces(tokens, prompt="xyz"):
        entries = [raw_entry(logits, t, 3) for t in tokens]
        lp, pr = CompletionLogprobs(Llm(), prompt), ProbsRender(Vocab(), False)
        streamed = []  # a stream: one piece at a time, offsets going on
        for t, e in zip(tokens, entries):
            lp.add(t, e)
            streamed.append((lp.take(), pr.completion_logprobs([e])))
        whole = ProbsRender(Vocab(), False).completion_logprobs(entries)
        for face, whole_face in ((0, lp.all), (1, whole)):
            for k in ("tokens", "text_offset", "token_logprobs"):
                assert sum((s[face][k] for s in streamed), []) == whole_face[k]
        return lp.all, whole

    assert CompletionLogprobs.take.__globals__["legacy_logprobs"] is ProbsRender.completion_logprobs.__globals__[
        "legacy_logprobs"] is legacy_logprobs
    compat, server = faces([1, 2, 5, 1])  # whole characters, finite values: the same object
    assert {k: v for k, v in server.items() if k != "content"} == {**compat, "text_offset": [0, 1, 4, 5]}
    assert compat["text_offset"] == [3, 4, 7, 8]  # from the prompt's length (3)
    compat, server = faces([1, 3, 4, 6, 5, 0])  # '€' split over two tokens; BOS is left out by compat only
    assert compat["tokens"] == server["tokens"][:-1] == ["a", "", "", "é", "d"]
    assert compat["text_offset"] == [3 + len(b"".join(pieces[t] for t in [1, 3, 4, 6, 5][:i]).decode("utf-8", "ignore"))
                                     for i in range(5)] == [3, 4, 4, 5, 6]
    assert server["text_offset"] == [0, 1, 1, 1, 2, 3]
    compat, server = faces([6])  # a token of logprob -inf
    assert compat["token_logprobs"] == [-math.inf] and compat["top_logprobs"][0]["é"] == -math.inf
    assert server["token_logprobs"] == [LOG_ZERO] and server["top_logprobs"][0]["é"] == LOG_ZERO
    assert server["content"][0]["logprob"] == LOG_ZERO
    json.dumps(server, allow_nan=False)


def test_stream_events_give_the_end_text_to_the_last_token():
    """A chunk's ``texts`` are what each token made final, its ``text`` ends with what the end released (held
    back for a stop string): the server's stream sends that with the last token, in its own event."""
    from llamaspec.server.probs import ProbsRender
    from llamaspec.slot import Chunk

    tps = [TokenProb(t, -1.0, ()) for t in (1, 2, 3)]
    pr = ProbsRender(None, False)
    ch = Chunk(0, [1, 2, 3], "ab" + "c", True, probs=tps, texts=["ab", "", ""])
    assert pr.events(0, ch) == [("ab", tps[:1], [1]), ("c", tps[1:], [2, 3])]
    ch = Chunk(0, [1, 2], "ab" + "c", True, probs=tps[:2], texts=["a", "b"])
    assert pr.events(1, ch) == [("a", tps[:1], [1]), ("bc", tps[1:2], [2])]


def test_worked_examples():
    import doctest

    import llamaspec.logprobs as mod

    res = doctest.testmod(mod)
    assert res.failed == 0 and res.attempted > 0


@pytest.mark.real
def test_real_model_logprobs_equal_llama_cpp():
    """SmolLM2-135M: plain ``llamaspec.Llama`` = ``llama_cpp.Llama`` (same batch shapes: 1e-3, measured 1e-6);
    the F32 target with its Q4_1 draft gives the same tokens and numbers within the batch-shape difference
    (measured 1.1e-3; a divergence is only allowed after a near-tie)."""
    from helpers import real_model
    from llamaspec._llama.lcp import load_llama
    from llamaspec.compat import Llama

    q4, f32 = str(real_model("smollm2-135m-q4_1")), str(real_model("smollm2-135m-f32"))
    kw = dict(n_ctx=512, verbose=False, n_threads=2)
    prompt = "def fibonacci(n):\n    "
    for target, draft, tol in ((q4, None, 1e-3), (f32, q4, 1e-2)):
        ref = load_llama(target, logits_all=True, **kw)
        a = ref(prompt, max_tokens=32, temperature=0, logprobs=4)["choices"][0]["logprobs"]
        ref.close()
        llm = Llama(target, draft_model=draft, **kw)
        try:
            out = llm(prompt, max_tokens=32, temperature=0, logprobs=4)
        finally:
            llm.close()
        b = out["choices"][0]["logprobs"]
        if draft is not None:
            assert out["llamaspec"]["n_accepted"] > 0
        n = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), len(a["tokens"]))
        if n < len(a["tokens"]):  # only at a near-tie of the two candidates
            assert abs(a["top_logprobs"][n][a["tokens"][n]] - a["top_logprobs"][n].get(b["tokens"][n], -99)) < 0.25
        assert n >= 16 if draft is not None else n == len(a["tokens"]) == 32
        assert np.allclose(a["token_logprobs"][:n], b["token_logprobs"][:n], atol=tol)
