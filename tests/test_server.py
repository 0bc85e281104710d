"""``llamaspec serve`` as a real process on a free 127.0.0.1 port, driven by the official ``openai`` client
and raw ``httpx`` (SSE framing, error shapes, disconnects), with the tiny F32 models (greedy is exact).

One module-scoped server (``-np 4``, a draft model, ``--metrics``, API keys) serves most tests, with the tiny
``llama`` / ``llama-draft`` pair written with an 8192-token training context (same weights, same outputs as
``tiny_model("llama")``; long enough that a 2000-token generation is still running when a test disconnects).
A second, plain one (``tiny_model("llama")``, no draft, no key, ``--no-slots``, no ``--metrics``) checks the
disabled endpoints and the queue.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from support.server import Server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY, KEY2, FILE_KEY = "sk-test-1", "sk-test-2", "sk-from-file"
N_CTX_SEQ = 2048  # -c 8192 over -np 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from llamaspec.testing.tiny_models import write_model

    d = tmp_path_factory.mktemp("serve")
    (d / "keys.txt").write_text(f"# keys\n{FILE_KEY}\n")
    target = write_model("llama", d / "llama.gguf", n_ctx=8192)
    draft = write_model("llama-draft", d / "llama-draft.gguf", n_ctx=8192)
    # draft-simple named explicitly: these tests are about the draft model's fields (the default is auto)
    # a fixed draft length: the adaptive one would stop drafting on tiny models (draft as costly as target)
    srv = Server(["-m", str(target), "-md", str(draft), "--spec-type", "draft-simple", "--no-spec-draft-adaptive",
                  "-np", "4", "-c", "8192",
                  "-b", "32", "-t", "1", "--alias", "tiny", "--chat-template", "chatml", "--metrics",
                  "--api-key", f"{KEY},{KEY2}", "--api-key-file", str(d / "keys.txt")], d / "server.log")
    yield srv
    srv.stop()
    assert srv.proc.returncode == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def _prompt(seed: int, n: int) -> list[int]:
    """A prompt of ``n`` token ids (the tiny vocabulary has 64)."""
    return [(seed * 7 + i * 13 + (i * i) % 5) % 64 for i in range(n)]


def _sse(lines) -> list:
    """``data:`` payloads of an SSE stream (JSON objects, or the string ``[DONE]``); comments skipped."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def _error(r, code: int, type_: str) -> dict:
    assert r.status_code == code, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert err["code"] == code and err["type"] == type_ and isinstance(err["message"], str) and err["message"], err
    return err


def _metric(http, name: str, labels: dict | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    r = http.get("/metrics")
    assert r.status_code == 200
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name == name and (labels is None or s.labels == labels):
                return s.value
    raise KeyError(name)


def _wait_idle(http, timeout: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        slots = http.get("/slots").json()
        if not any(s["is_processing"] for s in slots):
            return slots
        assert time.monotonic() < deadline, f"slots still busy: {slots}"
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------------
# OpenAI client: completions and chat, stream and non-stream
# ---------------------------------------------------------------------------------------------------
def test_completion_non_stream_and_stream(client):
    prompt = _prompt(1, 12)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and ch.text
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == 12 and r.usage.total_tokens == 36
    t = r.model_extra["timings"]
    for k in ("cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
              "predicted_ms", "predicted_per_token_ms", "predicted_per_second"):
        assert k in t, k
    assert t["predicted_n"] == 24 and t["prompt_n"] + t["cache_n"] == 12
    # speculative: llama-server's draft fields and llamaspec's acceptance report
    assert t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert t["draft_n_verif_steps"] > 0
    assert t["draft_mean_accepted_length"] == pytest.approx(1 + t["draft_n_accepted"] / t["draft_n_verif_steps"])
    assert sum(t["draft_n_accepted_per_pos"]) == t["draft_n_accepted"]
    # the drafter type behind the accepted tokens (one draft model here)
    assert sum(t["draft_n_accepted_by_type"].values()) == t["draft_n_accepted"]
    assert set(t["draft_n_accepted_by_type"]) <= {"draft-simple"}

    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ch.text
    last = chunks[-1]
    assert last.choices[0].finish_reason == "length"
    assert last.usage.completion_tokens == 24
    assert last.model_extra["timings"]["predicted_n"] == 24
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_non_stream_and_stream(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    assert r.object == "chat.completion"
    m = r.choices[0].message
    assert m.role == "assistant" and m.content and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens > 4
    assert r.model_extra["timings"]["predicted_n"] == 10

    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == m.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.prompt_tokens == r.usage.prompt_tokens
    assert usage_chunk.model_extra["timings"]["predicted_n"] == 10


def test_several_prompts_and_n(client, http):
    a, b = _prompt(50, 5), _prompt(51, 7)
    r = client.completions.create(model="tiny", prompt=[a, b], max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.prompt_tokens == 12 and r.usage.completion_tokens == 12
    solo = client.completions.create(model="tiny", prompt=b, max_tokens=6, temperature=0)
    assert r.choices[1].text == solo.choices[0].text
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, n=2)
    assert len(c.choices) == 2 and c.choices[0].message.content == c.choices[1].message.content
    with http.stream("POST", "/v1/completions", json={"prompt": [a, b], "max_tokens": 6, "temperature": 0,
                                                      "stream": True}) as resp:
        events = [e for e in _sse(resp.iter_lines()) if e != "[DONE]"]
    for i in (0, 1):
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["index"] == i) \
            == r.choices[i].text


def test_logit_bias_and_ignore_eos(http):
    """OpenAI's ``logit_bias`` (``{"id": bias}``) and llama-server's pair list with ``false`` = never; a token
    biased away never appears; ``ignore_eos``; bad ids and values are 400s naming the field."""
    prompt = _prompt(12, 6)
    base = {"prompt": prompt, "n_predict": 12, "temperature": 0, "return_tokens": True}
    plain = http.post("/completion", json=base).json()["tokens"]
    banned = sorted(set(plain))[:3]
    for lb in ({str(t): -100 for t in banned}, [[t, False] for t in banned]):
        r = http.post("/completion", json={**base, "logit_bias": lb})
        assert r.status_code == 200, r.text
        toks = r.json()["tokens"]
        assert toks and not set(toks) & set(banned) and toks != plain
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                           "logit_bias": {str(plain[0]): 100}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert http.post("/completion", json={**base, "ignore_eos": True}).json()["tokens_predicted"] == 12
    for bad, what in (([[1.5, 1]], "token ids"), ({"5": "a"}, "must be a number"), ({"999999": 1}, "outside the vocabulary"),
                      ([[1]], "expected an object")):
        r = http.post("/completion", json={**base, "logit_bias": bad})
        assert r.status_code == 400 and what in r.json()["error"]["message"], (bad, r.text)


def test_sse_framing_raw(http):
    """llama-server's framing: ``data: {json}`` events, ``[DONE]`` on OpenAI routes only."""
    body = {"prompt": _prompt(2, 6), "max_tokens": 8, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    assert all(block.startswith("data: ") for block in raw.strip().split("\n\n"))
    with http.stream("POST", "/completion", json={**body, "n_predict": 8}) as r:
        events = _sse(r.iter_lines())
    assert "[DONE]" not in events
    assert events[-1]["stop"] is True and events[-1]["stop_type"] == "limit" and "timings" in events[-1]
    assert all(e["stop"] is False and "content" in e for e in events[:-1])


def test_native_completion(http):
    prompt = _prompt(3, 8)
    r = http.post("/completion", json={"prompt": prompt, "n_predict": 12, "temperature": 0, "return_tokens": True})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["stop"] is True and d["stop_type"] == "limit" and d["truncated"] is False
    assert len(d["tokens"]) == 12 and d["tokens_predicted"] == 12 and d["tokens_evaluated"] == 8
    assert d["content"] and d["timings"]["predicted_n"] == 12 and 0 <= d["id_slot"] < 4
    assert d["generation_settings"]["n_predict"] == 12 and d["generation_settings"]["temperature"] == 0.0
    det = http.post("/detokenize", json={"tokens": d["tokens"]}).json()
    assert det["content"] == d["content"]


def test_native_stop_type_word_and_truncated(http):
    """``stop_type`` / ``stopping_word`` / ``truncated`` as the Engine reports them."""
    prompt = _prompt(4, 8)
    full = http.post("/completion", json={"prompt": prompt, "n_predict": 16, "temperature": 0}).json()["content"]
    word = full[5:8]
    d = http.post("/completion", json={"prompt": prompt, "n_predict": 16, "temperature": 0, "stop": [word]}).json()
    assert d["stop_type"] == "word" and d["stopping_word"] == word and d["truncated"] is False
    assert d["content"] == full[:full.index(word)]
    # no n_predict limit and a prompt near the slot's context: a full context ends it (unless an EOS first)
    d = http.post("/completion", json={"prompt": _prompt(5, N_CTX_SEQ - 12), "n_predict": -1, "temperature": 0}).json()
    if d["stop_type"] == "eos":
        assert d["truncated"] is False and d["stopping_word"] == ""
    else:
        assert d["stop_type"] == "limit" and d["truncated"] is True, d


# ---------------------------------------------------------------------------------------------------
# concurrency: 16 requests over 4 slots, a long prompt among them, greedy = each served alone
# ---------------------------------------------------------------------------------------------------
def test_concurrent_requests_match_solo(client, http):
    jobs = [(_prompt(10 + i, 4 + (i * 5) % 23), 6 + (i * 7) % 26) for i in range(15)]
    jobs.insert(5, (_prompt(99, 200), 16))  # a long prompt among them (-b 32: several rounds)

    def run(job):
        prompt, n = job
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0)
        return r.choices[0].text, r.usage.completion_tokens

    solo = [run(j) for j in jobs]
    deferred0 = _metric(http, "llamaspec:requests_deferred_total")
    with cf.ThreadPoolExecutor(16) as ex:
        together = list(ex.map(run, jobs))
    assert together == solo
    assert [n for _, n in together] == [n for _, n in jobs]
    assert _metric(http, "llamaspec:requests_deferred_total") > deferred0  # 16 requests, 4 slots: a queue
    _wait_idle(http)


# ---------------------------------------------------------------------------------------------------
# disconnects free the slot
# ---------------------------------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_slot(server, http):
    _wait_idle(http)
    before = _metric(http, "llamacpp:tokens_predicted_total")
    n = 2000
    body = {"prompt": _prompt(5, 4), "max_tokens": n, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, headers={"X-Api-Key": KEY}, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # the first chunk; leaving the block closes the connection
    _wait_idle(http)
    assert _metric(http, "llamacpp:tokens_predicted_total") - before < n  # cancelled, not finished


def test_disconnect_non_stream_frees_slot(server, http):
    _wait_idle(http)
    before = _metric(http, "llamacpp:tokens_predicted_total")
    n = 2000
    body = {"prompt": _prompt(6, 4), "max_tokens": n, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.3)
    _wait_idle(http)
    assert _metric(http, "llamacpp:tokens_predicted_total") - before < n


# ---------------------------------------------------------------------------------------------------
# per-request speculative settings
# ---------------------------------------------------------------------------------------------------
def test_per_request_speculative(client):
    prompt = _prompt(7, 10)
    base = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    off = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                    extra_body={"speculative.n_max": 0})
    assert off.choices[0].text == base.choices[0].text
    assert off.model_extra["timings"].get("draft_n", 0) == 0
    one = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                    extra_body={"speculative": {"n_max": 1, "verify": "match"}})
    assert one.choices[0].text == base.choices[0].text
    t = one.model_extra["timings"]
    assert 0 < t["draft_n"] <= t["draft_n_verif_steps"] and len(t["draft_n_accepted_per_pos"]) <= 1
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=4, extra_body={"speculative.n_max": 99})
    assert ei.value.status_code == 400 and "n_max" in ei.value.body["message"]


# ---------------------------------------------------------------------------------------------------
# other routes
# ---------------------------------------------------------------------------------------------------
def test_models_health_props_slots(server, http):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # public
    assert httpx.get(server.url + "/v1/models").status_code == 401  # with --api-key, as in llama-server
    m = http.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "tiny" and m["data"][0]["object"] == "model"
    p = http.get("/props").json()
    assert p["total_slots"] == 4 and p["model_alias"] == "tiny"
    assert p["default_generation_settings"]["n_ctx"] == N_CTX_SEQ
    assert p["speculative"]["types"] == ["draft-simple"] and p["speculative"]["n_max"] == 3
    assert "im_start" in p["chat_template"] or p["chat_template"] == "chatml"
    _error(http.post("/props", json={}), 501, "not_supported_error")
    slots = _wait_idle(http)
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    assert all(s["n_ctx"] == N_CTX_SEQ and s["speculative"] is True and "next_token" in s for s in slots)


def test_tokenize_detokenize(http):
    r = http.post("/tokenize", json={"content": "hello world"}).json()
    assert r["tokens"] and all(isinstance(t, int) for t in r["tokens"])
    wp = http.post("/tokenize", json={"content": "hello world", "with_pieces": True}).json()
    assert [t["id"] for t in wp["tokens"]] == r["tokens"] and all("piece" in t for t in wp["tokens"])
    d = http.post("/detokenize", json={"tokens": [10, 11, 12]}).json()
    assert d == {"content": "abc"}  # the tiny vocabulary's pieces are the ids in hex


def test_metrics(http, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model="tiny", prompt=_prompt(8, 5), max_tokens=8, temperature=0)
    text = http.get("/metrics").text
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    for n in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", "llamacpp:prompt_seconds_total",
              "llamacpp:tokens_predicted_seconds_total", "llamacpp:n_decode_total",
              "llamacpp:spec_decode_num_draft_tokens_total", "llamacpp:spec_decode_num_accepted_tokens_total",
              "llamacpp:spec_decode_num_drafts_total", "llamacpp:spec_decode_num_accepted_tokens_per_pos_total",
              "llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:prompt_tokens_seconds",
              "llamacpp:predicted_tokens_seconds", "llamacpp:n_busy_slots_per_decode"):
        assert n in names, n
    assert _metric(http, "llamacpp:n_decode_total") > 0
    assert 1.0 <= _metric(http, "llamacpp:n_busy_slots_per_decode") <= 4.0
    assert _metric(http, "llamacpp:tokens_predicted_total") >= 8
    assert _metric(http, "llamacpp:spec_decode_num_draft_tokens_total") > 0
    assert 'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text


# ---------------------------------------------------------------------------------------------------
# errors: llama-server's shape and codes
# ---------------------------------------------------------------------------------------------------
def test_api_keys(server):
    url = server.url + "/v1/completions"
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    err = _error(httpx.post(url, json=body), 401, "authentication_error")
    assert err["message"] == "Invalid API Key"
    _error(httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}), 401, "authentication_error")
    for headers in ({"Authorization": f"Bearer {KEY2}"}, {"X-Api-Key": KEY}, {"Authorization": f"Bearer {FILE_KEY}"}):
        assert httpx.post(url, json=body, headers=headers, timeout=30).status_code == 200, headers
    _error(httpx.get(server.url + "/slots"), 401, "authentication_error")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).completions.create(
            model="tiny", prompt=[1, 2], max_tokens=1)


def test_error_shapes(http, client):
    def post(path, raw=None, **body):
        if raw is not None:
            return http.post(path, content=raw, headers={"Content-Type": "application/json"})
        return http.post(path, json=body)

    _error(post("/v1/completions", raw=b"{not json"), 400, "invalid_request_error")
    _error(post("/v1/completions", raw=b"[1, 2]"), 400, "invalid_request_error")
    _error(post("/v1/completions", raw=b'{"prompt": [1], "temperature": NaN}'), 400, "invalid_request_error")
    _error(post("/v1/chat/completions", raw=b""), 400, "invalid_request_error")
    e = _error(post("/v1/completions", prompt=[1, 2], temperature="hot"), 400, "invalid_request_error")
    assert "temperature" in e["message"]
    assert "prompt" in _error(post("/v1/completions", max_tokens=3), 400, "invalid_request_error")["message"]
    assert "messages" in _error(post("/v1/chat/completions", max_tokens=3), 400, "invalid_request_error")["message"]
    _error(post("/v1/chat/completions", messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
           "invalid_request_error")
    _error(post("/v1/completions", prompt=[1, 2], max_tokens=-5), 400, "invalid_request_error")
    _error(post("/v1/completions", prompt=[1, 2], top_p=3), 400, "invalid_request_error")
    _error(post("/v1/completions", prompt=[1, 2], grammar="root ::= nonsense ["), 400, "invalid_request_error")
    _error(post("/v1/completions", prompt=[1, 2], id_slot=99), 400, "invalid_request_error")
    _error(post("/v1/completions", prompt=[1, 1000]), 400, "invalid_request_error")  # outside the vocabulary
    _error(post("/v1/completions", prompt=[1, 2], logprobs=-1), 400, "invalid_request_error")
    _error(post("/v1/completions", prompt=[1, 2], **{"speculative.verify": "guess"}), 400, "invalid_request_error")
    _error(post("/detokenize", tokens=[1, 999]), 400, "invalid_request_error")
    # prompt >= the slot's context: llama-server's exceed_context_size_error with the numbers
    e = _error(post("/v1/completions", prompt=_prompt(9, 2100)), 400, "exceed_context_size_error")
    assert e["n_prompt_tokens"] == 2100 and e["n_ctx"] == N_CTX_SEQ
    with http.stream("POST", "/v1/completions", json={"prompt": _prompt(9, 2100), "stream": True}) as r:
        r.read()
        _error(r, 400, "exceed_context_size_error")  # before the first token: an HTTP error, not an event
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 12000}])
    assert ei.value.body["type"] == "exceed_context_size_error"
    # unknown fields are ignored, as llama-server does
    r = post("/v1/completions", prompt=[1, 2, 3], max_tokens=2, temperature=0, frobnicate={"x": 1}, samplers="kt")
    assert r.status_code == 200, r.text
    _error(http.get("/no/such/route"), 404, "not_found_error")
    assert http.get("/v1/completions").status_code == 405
    assert set(http.get("/v1/completions").json()) == {"error"}


# ---------------------------------------------------------------------------------------------------
# a plain server: disabled endpoints, no key, the queue with id_slot
# ---------------------------------------------------------------------------------------------------
def test_plain_server_disabled_endpoints(tiny_model, tmp_path):
    srv = Server(["-m", str(tiny_model("llama")), "-np", "1", "-t", "1", "--no-slots", "--chat-template", "chatml",
                  "--spec-type", "none"],
                 tmp_path / "plain.log")
    try:
        _error(httpx.get(srv.url + "/metrics"), 501, "not_supported_error")
        _error(httpx.get(srv.url + "/slots"), 501, "not_supported_error")
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        jobs = [_prompt(20 + i, 6) for i in range(3)]
        with cf.ThreadPoolExecutor(3) as ex:  # one slot: two of them wait in the queue
            rs = list(ex.map(lambda p: c.completions.create(model="x", prompt=p, max_tokens=6, temperature=0), jobs))
        assert all(r.usage.completion_tokens == 6 for r in rs)
        assert "draft_n" not in rs[0].model_extra["timings"]  # plain decoding
        r = httpx.post(srv.url + "/completion", json={"prompt": jobs[0], "n_predict": 6, "temperature": 0, "id_slot": 0})
        assert r.json()["id_slot"] == 0 and r.json()["content"] == rs[0].choices[0].text
    finally:
        srv.stop()
    assert srv.proc.returncode == 0, srv.log.read_text()


def test_health_503_while_loading():
    """In-process: a state without an engine answers 503 ``unavailable_error`` on every route."""
    from starlette.testclient import TestClient

    from llamaspec.server.app import ServerConfig, ServerState, create_app

    app = create_app(ServerState(ServerConfig()))
    with TestClient(app) as c:
        for path in ("/health", "/v1/models", "/props"):
            err = _error(c.get(path), 503, "unavailable_error")
            assert err["message"] == "Loading model"
        _error(c.post("/v1/completions", json={"prompt": "x"}), 503, "unavailable_error")


def test_health_503_after_an_rpc_server_failed(monkeypatch):
    """Once an RPC server failed, the models on it cannot serve: /health says so (503), so that a load
    balancer routes elsewhere. (The live server runs in another process: this checks the route in-process.)"""
    from starlette.testclient import TestClient

    from llamaspec import _llama
    from llamaspec.server.app import ServerConfig, ServerState, create_app

    state = ServerState(ServerConfig())
    monkeypatch.setattr(ServerState, "ready", property(lambda self: True))
    monkeypatch.setattr(_llama.rpc, "failure", lambda: "Remote RPC server crashed")
    with TestClient(create_app(state)) as c:
        err = _error(c.get("/health"), 503, "unavailable_error")
    assert "RPC server failed" in err["message"] and "crashed" in err["message"]


def test_startup_errors_are_one_line(tiny_model):
    r = subprocess.run([sys.executable, "-m", "llamaspec.cli.main", "serve", "-m", "/no/such/model.gguf", "--port", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode in (1, 2) and r.stderr.count("error:") == 1 and "Traceback" not in r.stderr, r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "llamaspec.cli.main", "serve", "-m", str(tiny_model("llama")), "--port", str(port)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot listen" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "llamaspec.cli.main", "serve", "-m", str(tiny_model("llama")), "--port", "0",
                        "--api-key-file", "/no/such/keys"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "api-key-file" in r.stderr, r.stderr


def test_parsing_doctests():
    import doctest

    from llamaspec.server import parsing

    assert doctest.testmod(parsing, optionflags=doctest.ELLIPSIS).failed == 0


def test_prompt_cache(client):
    prompt = _prompt(30, 40)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model="tiny", prompt=prompt + [5, 6], max_tokens=4, temperature=0)
    t = again.model_extra["timings"]
    assert t["cache_n"] >= 40 and t["prompt_n"] == 42 - t["cache_n"]
    assert again.usage.prompt_tokens_details.cached_tokens == t["cache_n"]
    off = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                    extra_body={"cache_prompt": False})
    assert off.model_extra["timings"]["cache_n"] == 0


def test_long_prompt_does_not_stall_streams_and_disconnect_mid_prompt(server, http):
    """Continuous batching: while a long prompt is processed (-b 32: many rounds), two generating streams keep
    emitting; their largest gap between chunks is well under the long prompt's processing time. Then a client
    that leaves while its long prompt is being processed frees its slot before any token is generated."""
    import threading

    _wait_idle(http)
    arrivals: dict[int, list[float]] = {0: [], 1: []}
    started = [threading.Event(), threading.Event()]
    stop_streams = threading.Event()

    def stream(i: int) -> None:
        body = {"prompt": _prompt(40 + i, 6), "max_tokens": 2000, "temperature": 0, "stream": True}
        with httpx.Client(base_url=server.url, headers={"X-Api-Key": KEY}, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        arrivals[i].append(time.monotonic())
                        started[i].set()
                    if stop_streams.is_set():
                        return  # disconnect: cancels the rest

    with cf.ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(stream, i) for i in (0, 1)]
        try:
            for ev in started:
                assert ev.wait(30)
            t0 = time.monotonic()
            r = http.post("/v1/completions", json={"prompt": _prompt(77, 1900), "max_tokens": 1, "temperature": 0})
            t1 = time.monotonic()
            assert r.status_code == 200, r.text
            prompt_ms = r.json()["timings"]["prompt_ms"]
            gaps = [b - a for i in (0, 1) for a, b in zip(arrivals[i], arrivals[i][1:]) if t0 <= a <= t1]
            assert gaps, "the streams emitted nothing while the long prompt was processed"
            max_gap_ms = 1e3 * max(gaps)
            print(f"long prompt: {prompt_ms:.0f} ms; largest gap between stream chunks meanwhile: {max_gap_ms:.1f} ms")
            assert max_gap_ms < prompt_ms / 2

            # disconnect while the prompt is processed (it took prompt_ms above; we leave after 0.25 s)
            predicted0 = _metric(http, "llamacpp:tokens_predicted_total")
            requests0 = _metric(http, "llamaspec:requests_total")
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json={"prompt": _prompt(78, 1900), "max_tokens": 1, "temperature": 0},
                          timeout=min(0.25, prompt_ms / 4e3))
            deadline = time.monotonic() + 10
            while sum(s["is_processing"] for s in http.get("/slots").json()) > 2:
                assert time.monotonic() < deadline, "the long prompt's slot was not freed"
                time.sleep(0.02)
            if not any(f.done() for f in futs):  # (a stream that finished meanwhile would count too)
                assert _metric(http, "llamaspec:requests_total") == requests0 + 1  # it ran, was cancelled ...
                assert _metric(http, "llamacpp:tokens_predicted_total") == predicted0  # ... before its first token
        finally:
            stop_streams.set()
            for f in futs:
                f.result(timeout=60)
    _wait_idle(http)


# ---------------------------------------------------------------------------------------------------
# in-process, with a scripted engine: keep-alive pings, an error before / after the first token
# ---------------------------------------------------------------------------------------------------
class _ScriptedRequest:
    """What the server reads from an engine request (the ``ServedRequest`` of server/jobs.py); a thread plays
    ``script`` (texts, or ``"error"``), one item per ``delay`` seconds."""

    def __init__(self, script, delay):
        import threading
        from collections import deque

        from llamaspec.options import RequestOptions
        from llamaspec.slot import GenerationStats

        self.script, self.delay = script, delay
        self.id, self.slot, self.prompt_tokens, self.options = 1, None, [1, 2], RequestOptions()
        self.tokens, self._text, self.finish_reason, self.error = [], [], None, None
        self.stats = GenerationStats(n_prompt=2)
        self.cancelled = False
        self._chunks, self._callbacks, self._lock = deque(), [], threading.Lock()
        self._changed = threading.Condition(self._lock)
        threading.Thread(target=self._play, daemon=True).start()

    def _play(self):
        from llamaspec.slot import Chunk, FinishReason

        reason = FinishReason.STOP
        for item in self.script:
            time.sleep(self.delay)
            if self.cancelled:
                reason = FinishReason.ABORT
                break
            if item == "error":
                reason, self.error = FinishReason.ERROR, "decode failed (scripted)"
                break
            self.tokens.append(3)
            self._text.append(item)
            self.stats.n_predicted += 1
            with self._changed:
                self._chunks.append(Chunk(0, [3], item))
                self._changed.notify_all()
        with self._changed:
            self.finish_reason = reason
            callbacks, self._callbacks = self._callbacks, None
            self._changed.notify_all()
        for fn in callbacks:
            fn(self)

    @property
    def done(self):
        return self.finish_reason is not None

    @property
    def has_output(self):
        return bool(self._chunks) or self.done

    @property
    def text(self):
        return "".join(self._text)

    def add_done_callback(self, fn):
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn(self)

    def chunks(self):
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._chunks or self.done)
                if not self._chunks:
                    return
                ch = self._chunks.popleft()
            yield ch

    def cancel(self):
        self.cancelled = True


class _ScriptedEngine:
    def __init__(self, script, delay=0.0):
        from llamaspec.params import SpecParams

        self.script, self.delay = script, delay
        self.n_ctx_seq, self.n_parallel, self.chain, self.spec, self.verify = 100, 1, None, SpecParams(), "match"
        self.vocab = None  # (the prompts are too short for the server's special-token count to read it)
        self.model = type("M", (), {"chat_template": staticmethod(lambda: None), "vocab": None,
                                    "path": Path("scripted.gguf")})()
        self.reqs = []

    def start(self):
        pass

    def stop(self):
        pass

    def close(self):
        pass

    def tokenize(self, text, add_special=True, parse_special=False):
        return [1, 2]

    def wait_until(self, ready, timeout):
        time.sleep(min(0.01, timeout))
        return ready()

    def submit(self, prompt, options=None, **kw):
        self.reqs.append(_ScriptedRequest(self.script, self.delay))
        return self.reqs[-1]


def _scripted_client(script, delay=0.0, ping=30.0):
    from starlette.testclient import TestClient

    from llamaspec.server.app import ServerConfig, ServerState, create_app

    eng = _ScriptedEngine(script, delay)
    state = ServerState(ServerConfig(chat_template="chatml", sse_ping_interval=ping), engine=eng)
    return TestClient(create_app(state)), eng


def test_stream_pings_and_error_after_first_token():
    c, eng = _scripted_client(["a", "b", "error"], delay=0.15, ping=0.02)
    with c:
        with c.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
            assert r.status_code == 200
            raw = r.read().decode()
    blocks = raw.strip().split("\n\n")
    assert ":" in blocks  # keep-alive comments while nothing happened
    events = _sse(raw.splitlines())
    assert [e["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
    assert events[-1] == {"error": {"code": 500, "message": "decode failed (scripted)", "type": "server_error"}}
    assert "[DONE]" not in events


def test_error_before_first_token_is_http_error():
    c, _ = _scripted_client(["error"])
    with c:
        for stream in (True, False):
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": stream})
            _error(r, 500, "server_error")
            assert r.headers["content-type"].startswith("application/json")
