"""llama-server features of ``llamaspec serve`` that its conformance suite checks: JSON schemas, assistant
prefill, JSON-object and token prompts, text ``logit_bias`` keys, ``return_progress``, ``/v1/responses`` and
``/cors-proxy``. In process (Starlette's TestClient) over a real engine on the tiny ``llama`` model; the JSON
schema's output is checked on SmolLM2 (a vocabulary that can spell JSON)."""
from __future__ import annotations

import doctest
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from llamaspec.engine import Engine  # noqa: E402
from llamaspec.server.app import ServerConfig, ServerState, create_app  # noqa: E402
from llamaspec.server.errors import ApiError  # noqa: E402
from llamaspec.server.parsing import Body, parse_gen_params, parse_prompts, Defaults  # noqa: E402
from llamaspec.options import RequestOptions

from helpers import real_model  # noqa: E402
from support.server import free_port  # noqa: E402

# a Llama-3-style template: parts of a message are joined by the server before it sees them
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
            "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
PROMPT = [1, 5, 9, 13, 22, 7, 30, 41, 2, 17, 19, 23, 29, 31, 37, 43, 47, 53, 59, 61]  # 20 ids of the 64


def _client(eng, **cfg) -> TestClient:
    state = ServerState(ServerConfig(model_id="tiny", **cfg), engine=eng)
    return TestClient(create_app(state))


def _events(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def _bad(r, what: str) -> str:
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert what in msg, msg
    return msg


@pytest.fixture(scope="module")
def engine(tiny_models):
    with Engine(tiny_models["llama"], n_ctx=256, n_batch=8, cache_prompt=True) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    with _client(engine, chat_template=TEMPLATE, sse_ping_interval=0) as c:
        yield c


# ---------------------------------------------------------------------------------------------------
# JSON schemas -> grammars (response_format, json_schema) and their 400s
# ---------------------------------------------------------------------------------------------------
def _grammar(data: dict) -> str:
    return parse_gen_params(Body(data), Defaults()).sampling.grammar


@pytest.mark.parametrize("data", [
    {"response_format": {"type": "json_object", "schema": {"const": "42"}}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"const": "42"}}}},
    {"json_schema": {"const": "42"}},
])
def test_json_schema_becomes_a_grammar(data):
    assert _grammar(data).splitlines()[0] == 'root ::= "\\"42\\""'


def test_empty_schema_is_any_object_and_json_object_alone_too():
    assert "root ::= object" in _grammar({"json_schema": {}}).splitlines()
    # llama-server: json_object alone is the grammar of the schema {"type": "object"}
    assert _grammar({"response_format": {"type": "json_object"}}) == _grammar({"json_schema": {"type": "object"}})
    assert "root ::= object" in _grammar({"response_format": {"type": "json_object"}}).splitlines()
    assert _grammar({"response_format": {"type": "text"}}) is None


@pytest.mark.parametrize("data,what", [
    ({"response_format": {"type": "json_object", "schema": 123}}, "response_format.schema"),
    ({"response_format": {"type": "json_object", "schema": {"type": 123}}}, "type must be a string"),
    ({"response_format": {"type": "json_object", "schema": {"type": "hiccup"}}}, "hiccup"),
    ({"response_format": {"type": "json_schema", "json_schema": 5}}, "response_format.json_schema"),
    ({"json_schema": {"$ref": "https://example.com/s.json"}}, "only references into the same document"),
    ({"json_schema": {"const": 1}, "grammar": 'root ::= "a"'}, "not both"),
    ({"response_format": {"type": "sound"}}, "unknown type"),
])
def test_bad_schemas_are_400s(data, what):
    with pytest.raises(ApiError) as e:
        parse_gen_params(Body(data), Defaults())
    assert e.value.code == 400 and what in e.value.message


@pytest.mark.real
def test_json_schema_output_on_a_real_model():
    path = real_model("smollm2-135m-q4_1")
    with Engine(path, n_ctx=512) as eng, _client(eng) as c:
        msgs = [{"role": "user", "content": "Write an example"}]
        for body, want in [({"response_format": {"type": "json_schema", "json_schema": {"schema": {"const": "foo"}}}},
                            '"foo"'),
                           ({"json_schema": {"type": "integer"}}, None)]:
            r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "temperature": 0, **body})
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["message"]["content"]
            if want is not None:
                assert text == want
            else:
                assert text.strip().lstrip("-").isdigit(), text
        _bad(c.post("/v1/chat/completions", json={"messages": msgs, "json_schema": {"type": "hiccup"}}), "json_schema")


# ---------------------------------------------------------------------------------------------------
# prompts: JSON objects, tokens, mixed; logit_bias keys
# ---------------------------------------------------------------------------------------------------
def test_prompt_objects_and_mixed_lists():
    tok = lambda text, bos: [60 + len(text)] if bos else [len(text)]  # noqa: E731
    assert parse_prompts(Body({"prompt": {"prompt_string": "abc"}}), tok) == [[63]]
    assert parse_prompts(Body({"prompt": [[1, 2], {"prompt_string": "ab"}, "xyz"]}), tok) == [[1, 2], [62], [63]]
    assert parse_prompts(Body({"prompt": [4, "ab", 5, "c"]}), tok) == [[4, 2, 5, 1]]  # BOS only for the first
    assert parse_prompts(Body({"prompt": {"prompt_string": [3, "ab"]}}), tok) == [[3, 2]]
    for bad, what in [({"prompt_string": "x", "multimodal_data": ["AAAA"]}, "text-only"), ({"text": "x"}, "prompt_string"),
                      ([{"prompt_string": {"a": 1}}], "prompt[0].prompt_string")]:
        with pytest.raises(ApiError) as e:
            parse_prompts(Body({"prompt": bad}), tok)
        assert e.value.code == 400 and what in e.value.message


def test_completion_with_object_token_and_mixed_prompts(client):
    r = client.post("/completion", json={"prompt": PROMPT[:6], "n_predict": 4, "temperature": 0})
    assert r.status_code == 200
    want = r.json()["content"]
    r = client.post("/completion", json={"prompt": [PROMPT[:6], {"prompt_string": PROMPT[:6]}], "n_predict": 4,
                                         "temperature": 0})
    assert r.status_code == 200 and [o["content"] for o in r.json()] == [want, want]
    _bad(client.post("/completion", json={"prompt": {"prompt_string": "x", "multimodal_data": ["AA"]}}),
         "multimodal")


def test_logit_bias_text_keys_pairs_and_false(client, engine):
    ids = engine.tokenize("hello", add_special=False)
    for lb in ({"hello": -5, "3": False}, [["hello", -5], [3, False]]):
        r = client.post("/completion", json={"prompt": PROMPT[:4], "n_predict": 1, "logit_bias": lb})
        assert r.status_code == 200, r.text
        got = r.json()["generation_settings"]["logit_bias"]
        assert got == [{"token": t, "bias": -5.0} for t in dict.fromkeys(ids)] + [{"token": 3, "bias": None}]
    _bad(client.post("/completion", json={"prompt": "x", "logit_bias": {"a": "much"}}), "must be a number")
    _bad(client.post("/completion", json={"prompt": "x", "logit_bias": [[1.5, 1]]}), "token ids")
    _bad(client.post("/completion", json={"prompt": "x", "logit_bias": 7}), "logit_bias")


# ---------------------------------------------------------------------------------------------------
# chat: assistant prefill
# ---------------------------------------------------------------------------------------------------
def test_assistant_prefill_continues_after_the_assistant_header(client):
    head = "<|start_header_id|>user<|end_header_id|>\n\nWhat<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    for content, want in [("Whill ", "Whill "), ([{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}],
                                                 "Wh\n\nill")]:
        msgs = [{"role": "user", "content": "What"}, {"role": "assistant", "content": content}]
        r = client.post("/apply-template", json={"messages": msgs})
        assert r.status_code == 200 and r.json()["prompt"].endswith(head + want), r.json()
        r2 = client.post("/apply-template", json={"messages": msgs, "add_generation_prompt": False,
                                                  "continue_final_message": True})
        assert r2.json() == r.json()


# ---------------------------------------------------------------------------------------------------
# return_progress
# ---------------------------------------------------------------------------------------------------
def test_engine_progress_chunks(engine):
    req = engine.submit(PROMPT, RequestOptions(n_predict=2, progress=True, cache_prompt=False))
    chunks = list(req.chunks())
    prog = [c.progress for c in chunks if c.progress is not None]
    assert [(p.total, p.cache, p.processed) for p in prog] == [(20, 0, 0), (20, 0, 8), (20, 0, 16), (20, 0, 20)]
    assert prog[0].time_ms == 0.0 and prog[-1].time_ms > 0
    first_token = next(i for i, c in enumerate(chunks) if c.tokens)
    assert all(c.progress is not None for c in chunks[:first_token]) and len(req.tokens) == 2
    plain = engine.submit(PROMPT, RequestOptions(n_predict=2, cache_prompt=False))
    assert all(c.progress is None for c in plain.chunks())


def test_return_progress_streams(client):
    body = {"prompt": PROMPT, "n_predict": 2, "stream": True, "return_progress": True, "timings_per_token": True,
            "cache_prompt": False}
    ev = _events(client.post("/completion", json=body).text)
    prog = [e for e in ev if "prompt_progress" in e]
    assert [e["prompt_progress"]["processed"] for e in prog] == [0, 8, 16, 20]
    assert prog[0]["timings"]["prompt_n"] == 0 and prog[0]["timings"]["prompt_ms"] == 0.0
    assert prog[-1]["timings"]["prompt_n"] == 20 and prog[-1]["timings"]["prompt_ms"] > 0
    assert ev.index(prog[-1]) < next(i for i, e in enumerate(ev) if e.get("content"))
    # chat: a role delta carries each report; a cached prefix shows in the first one
    chat = {"messages": [{"role": "user", "content": "a b c d e f g h i j"}], "max_tokens": 1, "stream": True,
            "return_progress": True}
    client.post("/v1/chat/completions", json={**chat, "stream": False})
    ev = _events(client.post("/v1/chat/completions", json=chat).text)
    prog = [e["prompt_progress"] for e in ev if "prompt_progress" in e]
    assert prog[0]["cache"] == prog[0]["processed"] > 0 and prog[-1]["processed"] == prog[-1]["total"]
    assert len(prog) == 2
    assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": None} for e in ev if "prompt_progress" in e)
    # not asked for, or not a stream: none
    assert not any("prompt_progress" in e for e in _events(client.post("/completion", json={**body, "return_progress": False}).text))
    r = client.post("/completion", json={**body, "stream": False})
    assert r.status_code == 200 and "prompt_progress" not in r.json()


# ---------------------------------------------------------------------------------------------------
# /v1/responses
# ---------------------------------------------------------------------------------------------------
def test_responses_non_stream(client):
    r = client.post("/v1/responses", json={"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 3,
                                           "instructions": "short", "temperature": 0})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["id"].startswith("resp_") and d["object"] == "response" and d["status"] == "completed"
    msg = d["output"][0]
    assert msg["id"].startswith("msg_") and msg["role"] == "assistant" and msg["content"][0]["type"] == "output_text"
    assert d["usage"]["output_tokens"] == 3 and d["usage"]["total_tokens"] == d["usage"]["input_tokens"] + 3


def test_responses_stream_events(client):
    with client.stream("POST", "/responses", json={"input": "hello", "max_output_tokens": 3, "stream": True,
                                                   "timings_per_token": True, "return_progress": True}) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    blocks = [b for b in raw.strip().split("\n\n") if b]
    assert all(b.startswith("event: ") for b in blocks) and "[DONE]" not in raw
    ev = _events(raw)
    assert [b.split("\n", 1)[0][7:] for b in blocks] == [e["type"] for e in ev]
    types = [e["type"] for e in ev]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert any("prompt_progress" in e and e["type"] == "response.in_progress" for e in ev)
    deltas = [e for e in ev if e["type"] == "response.output_text.delta"]
    assert deltas and all("timings" in e for e in deltas)
    done = ev[-1]
    assert "timings" in done and done["response"]["usage"]["output_tokens"] == 3
    assert "".join(e["delta"] for e in deltas) == done["response"]["output"][0]["content"][0]["text"]


@pytest.mark.parametrize("body,what", [
    ({}, "'input' is required"),
    ({"input": 5}, "'input'"),
    ({"input": [{"type": "custom_tool_call", "name": "f", "input": "x", "call_id": "c"}]}, "function tools"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "text-only"),
    ({"input": [{"role": "robot", "content": "x"}]}, "role"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
])
def test_responses_bad_input_is_400(client, body, what):
    _bad(client.post("/v1/responses", json=body), what)


@pytest.mark.parametrize("key", ["n", "n_cmpl"])
def test_responses_answer_once_whatever_the_n_key(client, engine, key):
    """One answer per request: ``n_cmpl`` (the alias the chat path reads) is refused as ``n`` is, before any
    generation is submitted (it was a 200 with 16 generations and 16 ``response.completed`` events)."""
    submitted = []
    orig = engine.submit
    engine.submit = lambda *a, **kw: submitted.append(1) or orig(*a, **kw)
    try:
        for stream in (False, True):
            _bad(client.post("/v1/responses", json={"input": "hi", key: 16, "stream": stream,
                                                    "max_output_tokens": 1}), f"Field '{key}'")
    finally:
        del engine.submit
    assert submitted == []


# ---------------------------------------------------------------------------------------------------
# /cors-proxy
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def target():
    class Capture(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/redirect?to="):  # a 302 to the URL after "to="
                self.send_response(302)
                self.send_header("Location", self.path[len("/redirect?to="):])
                self.end_headers()
                return
            self.server.captured = dict(self.headers)
            self.send_response(201)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Access-Control-Allow-Origin", "*")
            self.send_header("X-Target", "yes")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Capture)
    srv.captured = {}
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_cors_proxy_is_off_by_default(client, target):
    r = client.get(f"/cors-proxy?url=http://127.0.0.1:{target.server_port}/x")
    assert r.status_code == 403 and r.json()["error"]["type"] == "feature_disabled"
    assert target.captured == {}


def test_cors_proxy_checks_redirect_targets_as_the_first(engine, target):
    """A redirect is followed (llama-server's client follows them) only to a URL the proxy would take from the
    client: http(s), a host, no credentials; else a 502 that names the redirect, and the URL is never fetched."""
    base = f"http://127.0.0.1:{target.server_port}"
    auth = {"Authorization": "Bearer k"}
    c = _client(engine, chat_template="chatml", mcp_proxy=True, api_keys=["k"])  # no lifespan: the engine stays open
    r = c.get(f"/cors-proxy?url={base}/redirect?to={base}/capture", headers=auth)
    assert r.status_code == 201 and r.text == "ok"  # an allowed redirect is followed
    other = f"http://localhost:{target.server_port}/capture"  # another host: the named credentials stay behind
    r = c.get("/cors-proxy", params={"url": f"{base}/redirect?to={other}"},
              headers={**auth, "x-llama-server-proxy-header-authorization": "Bearer explicit",
                       "x-llama-server-proxy-header-accept": "text/x"})
    got = {k.lower(): v for k, v in target.captured.items()}
    assert r.status_code == 201 and got["accept"] == "text/x" and "authorization" not in got
    for bad, what in ((f"http://u:p@127.0.0.1:{target.server_port}/capture", "authentication"),
                      ("ftp://127.0.0.1/x", "scheme"), ("file:///etc/passwd", "scheme")):
        target.captured = {}
        r = c.get("/cors-proxy", params={"url": f"{base}/redirect?to={bad}"}, headers=auth)
        assert r.status_code == 502, r.text
        msg = r.json()["error"]["message"]
        assert "redirect" in msg and what in msg, msg
        assert target.captured == {}


def test_cors_proxy_forwards_only_explicit_headers(engine, target):
    with _client(engine, chat_template="chatml", mcp_proxy=True, api_keys=["k"]) as c:
        url = f"/cors-proxy?url=http://127.0.0.1:{target.server_port}/capture"
        assert c.get(url).status_code == 401  # the API key protects it as every route
        r = c.get(url, headers={"Authorization": "Bearer k", "Cookie": "s=1", "X-Api-Key": "k",
                                "Proxy-Authorization": "Basic x", "x-llama-server-proxy-header-accept": "text/x",
                                "x-llama-server-proxy-header-authorization": "Bearer explicit"})
        assert r.status_code == 201 and r.text == "ok" and r.headers["x-target"] == "yes"
        assert "access-control-allow-origin" not in r.headers  # the target's CORS headers stay there
        got = {k.lower(): v for k, v in target.captured.items()}
        assert got["accept"] == "text/x" and got["authorization"] == "Bearer explicit"
        assert not {"cookie", "x-api-key", "proxy-authorization"} & set(got)
        auth = {"Authorization": "Bearer k"}
        _bad(c.get("/cors-proxy?url=ftp://127.0.0.1/x", headers=auth), "scheme")
        _bad(c.get("/cors-proxy?url=http://u:p@127.0.0.1/x", headers=auth), "authentication")
        _bad(c.get("/cors-proxy", headers=auth), "url")
        r = c.get(f"/cors-proxy?url=http://127.0.0.1:{free_port()}/", headers=auth)  # nobody listens there
        assert r.status_code == 502 and "proxy error" in r.json()["error"]["message"]


def test_worked_examples():
    import llamaspec.ctx_shift
    import llamaspec.server.constraints
    import llamaspec.server.cors_proxy
    import llamaspec.server.formats
    import llamaspec.server.responses
    from llamaspec._llama import json_schema

    for mod in (llamaspec.ctx_shift, llamaspec.server.constraints, llamaspec.server.cors_proxy,
                llamaspec.server.formats, llamaspec.server.responses, json_schema):
        res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
        assert res.failed == 0 and res.attempted > 0, mod.__name__
