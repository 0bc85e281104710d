"""Property-based fuzzing of the HTTP boundary of ``llamaspec serve`` (Hypothesis), in process: the Starlette
app on a real engine (tiny llama target + draft, 2 slots, draft-simple), driven by Starlette's TestClient.

Bodies for every route that takes one: llama-server's and OpenAI's fields with values that fit and values
that do not (every JSON type for every field, huge and negative numbers, NaN / Infinity, nested garbage,
empty messages, lone surrogates as JSON escapes, unknown fields, deep nesting), and raw bodies that are no
JSON object at all (invalid UTF-8, truncated, a top-level array, 10,000 brackets). Properties:

* the answer is a 200 or a 4xx, never a 500, within a time limit (no hang);
* a 4xx is ``{"error": {"code", "message", "type"}}`` with the HTTP status as its code and a message that
  names what was wrong (one of the body's fields, or the body itself), never a traceback;
* a 200 is JSON (or, for a stream, SSE events of JSON with no 500 error event);
* afterwards nothing is left running (no generation, no reserved admission) and ``/health`` answers 200.

``LLAMASPEC_FUZZ_EXAMPLES=N`` (or ``scripts/fuzz.py server``) runs N random examples per property instead of
the suite's fixed few dozen.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from helpers import tiny_draft_engine  # noqa: E402

FUZZ_EXAMPLES = int(os.environ.get("LLAMASPEC_FUZZ_EXAMPLES", "60"))
FIXED = "LLAMASPEC_FUZZ_EXAMPLES" not in os.environ
TIMEOUT = 60.0  # seconds one request may take (the longest valid one generates 4 x 255 tokens: ~2 s)
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=FIXED, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def app(tiny_model):
    from starlette.testclient import TestClient

    from llamaspec.server.app import ServerConfig, ServerState, create_app
    from llamaspec.server.limits import Limits

    eng = tiny_draft_engine(tiny_model, n_max=4)
    limits = Limits(max_request_generations=4, max_prompt_chars=4000, max_stop=4, max_stop_chars=16,
                    max_json_depth=16, max_body_size=1 << 16)
    state = ServerState(ServerConfig(chat_template="chatml", limits=limits), engine=eng)
    pool = cf.ThreadPoolExecutor(1)
    with TestClient(create_app(state), raise_server_exceptions=False) as client:
        yield client, state, pool
    pool.shutdown(wait=False)


# ------------------------------------------------------------------------------------------- strategies
BIG = [2 ** 31, 2 ** 32 + 1, 2 ** 63, 10 ** 30, -(2 ** 31) - 1, -(10 ** 30)]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 70), st.sampled_from(BIG),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
garbage = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                      st.dictionaries(st.text(max_size=6), kids, max_size=4)),
                       max_leaves=12)
small_text = st.text(max_size=24)
tokens = st.lists(st.integers(0, 63), min_size=1, max_size=12)
msg = st.fixed_dictionaries({"role": st.sampled_from(["user", "user", "system", "assistant", "tool"]),
                             "content": st.one_of(small_text, st.lists(st.one_of(
                                 small_text, st.fixed_dictionaries({"type": st.just("text"), "text": small_text})),
                                 max_size=3))})
speculative = st.fixed_dictionaries({}, optional={"n_max": st.integers(0, 4), "n_min": st.integers(0, 4),
                                                  "p_min": st.floats(0, 1), "verify": st.sampled_from(["match", "rejection"])})
bias_key = st.one_of(st.integers(0, 63).map(str), small_text)

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                      "properties": {"a": {"type": "integer"}}}}}
TOOL_CHOICE = {"type": "function", "function": {"name": "f"}}
#: values that fit each field (a body of them is answered 200, but for a few combinations llama-server refuses
#: too); any field may instead get ``garbage`` (the wrong type, out of range, huge, nested)
SAMPLING = {
    "n_predict": st.integers(-1, 8), "max_tokens": st.integers(0, 8), "max_completion_tokens": st.integers(0, 8),
    "temperature": st.floats(-1, 2), "top_k": st.integers(-1, 80), "top_p": st.floats(0, 1), "min_p": st.floats(0, 1),
    "repeat_penalty": st.floats(0, 3), "repeat_last_n": st.integers(-1, 256), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "seed": st.integers(-1, 2 ** 32 - 1),
    "stop": st.one_of(st.text(max_size=16), st.lists(st.text(max_size=16), max_size=4)), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "n": st.integers(1, 2),
    "id_slot": st.integers(-1, 1), "cache_prompt": st.booleans(), "speculative": speculative,
    "speculative.n_max": st.integers(0, 4),
    "logit_bias": st.one_of(st.dictionaries(bias_key, st.one_of(st.floats(-5, 5), st.just(False)), max_size=3),
                            st.lists(st.tuples(st.integers(0, 63), st.floats(-5, 5)).map(list), max_size=3)),
    "grammar": st.sampled_from(['root ::= "a" | "b"', 'root ::= [0-9a-f]+']),
    "json_schema": st.sampled_from([{}, {"type": "integer"}, {"const": 4}]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                        {"type": "json_schema", "json_schema": {"schema": {"type": "string"}}}]),
    "n_probs": st.integers(0, 10), "post_sampling_probs": st.booleans(), "ignore_eos": st.booleans(),
    "tools": st.sampled_from([[], [TOOL]]), "tool_choice": st.sampled_from(["auto", "none", "required", TOOL_CHOICE]),
    "typical_p": st.floats(0, 1), "mirostat": st.integers(0, 2), "return_tokens": st.booleans(),
    "timings_per_token": st.booleans(), "return_progress": st.booleans(), "model": small_text, "verbose": st.booleans(),
}
#: fields that only take garbage here (their good values depend on each other or on the route)
EXTRA = ["logprobs", "top_logprobs", "chat_template_kwargs", "text", "previous_response_id", "multimodal_data",
         "speculative.n_min", "speculative.p_min", "speculative.verify", "dry_multiplier", "xtc_probability", "n_cmpl",
         "parallel_tool_calls"]
PROMPT = {"prompt": st.one_of(small_text.filter(bool), tokens, st.lists(st.one_of(small_text.filter(bool), tokens),
                                                                         min_size=1, max_size=2),
                              st.fixed_dictionaries({"prompt_string": small_text.filter(bool)}))}
CHAT = {"messages": st.lists(msg, min_size=1, max_size=3), "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans()}
RESPONSES = {"input": st.one_of(small_text, st.lists(msg.filter(lambda m: m["role"] != "tool"), min_size=1,
                                                      max_size=3)),
             "instructions": small_text, "max_output_tokens": st.integers(0, 8)}
ROUTES = {
    "/completion": {**PROMPT, **SAMPLING}, "/v1/completions": {**PROMPT, **SAMPLING},
    "/v1/chat/completions": {**CHAT, **SAMPLING}, "/v1/responses": {**RESPONSES, **SAMPLING},
    "/apply-template": CHAT, "/v1/chat/completions/input_tokens": CHAT,
    "/tokenize": {"content": small_text, "add_special": st.booleans(), "parse_special": st.booleans(),
                  "with_pieces": st.booleans()},
    "/detokenize": {"tokens": st.lists(st.integers(0, 63), max_size=8)},
}
REQUIRED = {"/completion": "prompt", "/v1/completions": "prompt", "/v1/chat/completions": "messages",
            "/v1/responses": "input", "/apply-template": "messages", "/v1/chat/completions/input_tokens": "messages",
            "/tokenize": "content", "/detokenize": "tokens"}


@st.composite
def bodies(draw, route: str) -> dict:
    """Mostly good values, then none, one or two fields (known or not) set to garbage, and unknown fields."""
    fields = ROUTES[route]
    optional = sorted(set(fields) - {REQUIRED[route]})
    names = draw(st.lists(st.sampled_from(optional), unique=True, max_size=6)) if optional else []
    if draw(st.integers(0, 9)):  # the required field, almost always
        names.insert(0, REQUIRED[route])
    body = {n: draw(fields[n]) for n in names}
    for n in draw(st.lists(st.sampled_from(sorted(fields) + EXTRA), unique=True,
                           max_size=draw(st.sampled_from([0, 0, 1, 1, 2])))):
        body[n] = draw(garbage)
    for k, v in draw(st.dictionaries(st.text(max_size=8), garbage, max_size=2)).items():  # unknown fields
        body.setdefault(k, v)
    return body


# raw bodies that are no JSON object: (bytes, words one of which the message must hold)
RAW = [b"", b"   ", b"\xff\xfe{}", b'{"prompt": "a\xc3"}', b'{"prompt": ', b"[1, 2]", b'"text"', b"null", b"42",
       b'{"prompt": NaN}', b'{"temperature": Infinity}', b'{"n_predict": -Infinity}', b'{"prompt": "x"} trailing',
       b"[" * 10000 + b"]" * 10000, b'{"a": ' + b"[" * 5000, b'{"prompt": "\\ud800"}', b'{"\\udc00": 1}',
       b'{"messages": [{"role": "user", "content": "\\udfff"}]}', b'{"content": "a\\ud83d"}', b"{'single': 1}",
       b'{"prompt": "a", "prompt": [1]}', b"\x00", b'{"stop": ["\\u0000"], "prompt": "x", "n_predict": 2}',
       b'{"messages": []}', b'{"messages": [{}]}', b'{"messages": [{"role": "user"}], "max_tokens": 2}',
       b'{"messages": [{"role": "user", "content": ""}], "max_tokens": 2}', b'{"messages": [[]]}',
       b'{"prompt": "", "n_predict": 2}', b'{"prompt": [], "n_predict": 2}', b'{"prompt": [[]]}',
       b'{"tokens": [1e400]}', b'{"prompt": "x", "n_predict": 1e400}', b'{"prompt": "x", "seed": -1e400}',
       b'{"content": "x", "with_pieces": true}', b'{"input": [], "max_output_tokens": 2}', b'{"input": ""}']
raw_bodies = st.one_of(st.binary(max_size=40),
                       st.recursive(scalars, lambda k: st.lists(k, max_size=3), max_leaves=8).map(
                           lambda v: json.dumps(v).encode()))  # JSON that is no object


# ------------------------------------------------------------------------------------------- the oracle
def post(app, route: str, content: bytes, headers: dict | None = None):
    client, _, pool = app
    fut = pool.submit(client.post, route, content=content, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        return fut.result(timeout=TIMEOUT)
    except cf.TimeoutError:
        pytest.fail(f"no answer to POST {route} within {TIMEOUT} s: {content[:300]!r}")


def _keys(v, out: set, depth: int = 0) -> set:
    if isinstance(v, dict) and depth < 4:
        for k, x in v.items():
            out.add(k)
            _keys(x, out, depth + 1)
    elif isinstance(v, list) and depth < 4:
        for x in v:
            _keys(x, out, depth + 1)
    return out


#: words that say what was wrong without naming a field of the body (a missing field, the body as a whole)
GENERAL = ("body", "JSON", "must be provided", "required", "prompt", "messages", "content", "input", "context",
           "template", "tokens", "generations", "UTF-8", "surrogate", "assistant", "add_generation_prompt")


def check_answer(r, route: str, body: object) -> None:
    text = r.text
    assert r.status_code != 500 and (r.status_code == 200 or 400 <= r.status_code < 500), \
        f"POST {route} -> {r.status_code}: {text[:500]}\nbody: {json.dumps(body)[:500] if body is not None else ''}"
    assert "Traceback" not in text and 'File "' not in text, text[:1000]
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) >= {"code", "message", "type"} and err["code"] == r.status_code, err
        assert isinstance(err["message"], str) and isinstance(err["type"], str) and err["type"], err
        names = [k for k in _keys(body, set()) if k] if isinstance(body, dict) else []
        assert any(w in err["message"] for w in [*names, *GENERAL]), \
            f"the message names nothing of the request: {err['message']!r}\nbody: {json.dumps(body)[:300]}"
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                assert not (isinstance(ev, dict) and "error" in ev and ev["error"].get("code", 0) >= 500), ev
    else:
        json.loads(text)


def check_idle(app) -> None:
    """Nothing left running: every generation ended, every reservation released; /health answers."""
    client, state, pool = app
    deadline = time.monotonic() + TIMEOUT
    while state.n_groups or state.admission.n or state.engine.scheduler.has_work():
        assert time.monotonic() < deadline, (state.n_groups, state.admission.n, state.engine.slots_info())
        time.sleep(0.005)
    h = pool.submit(client.get, "/health").result(timeout=TIMEOUT)
    assert h.status_code == 200 and h.json() == {"status": "ok"}, h.text


# ------------------------------------------------------------------------------------------- the properties
BASE = {"/completion": {"prompt": [1, 2, 3], "n_predict": 1}, "/v1/completions": {"prompt": "hi", "max_tokens": 1},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        "/v1/responses": {"input": "hi", "max_output_tokens": 1},
        "/apply-template": {"messages": [{"role": "user", "content": "hi"}]},
        "/v1/chat/completions/input_tokens": {"messages": [{"role": "user", "content": "hi"}]},
        "/tokenize": {"content": "hi"}, "/detokenize": {"tokens": [1, 2]}}
WRONG = [[], {}, "x", True, 2 ** 63, -(2 ** 63), 1.5, -1, [[{}]], {"a": [1, "b"]}]


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_wrong_types_for_every_field(app, route):
    """Systematically: each known field of the route, alone on a good body, set to each value of WRONG."""
    answered = {}
    for name in sorted(set(ROUTES[route]) | set(EXTRA if route in REQUIRED and ROUTES[route] is not CHAT else ())):
        for v in WRONG:
            body = {**BASE[route], name: v}
            r = post(app, route, json.dumps(body).encode())
            check_answer(r, route, body)
            answered[name, json.dumps(v)] = r.status_code
    check_idle(app)
    assert 400 in answered.values(), answered


@FUZZ
@given(data=st.data(), route=st.sampled_from(sorted(ROUTES)))
def test_fuzzed_bodies(app, data, route):
    body = data.draw(bodies(route), label="body")
    r = post(app, route, json.dumps(body).encode())
    event(f"{route} -> {r.status_code}")
    check_answer(r, route, body)
    check_idle(app)


def _check_raw(app, route: str, raw: bytes):
    r = post(app, route, raw)
    try:
        body = json.loads(raw)  # (for the field names the message may name)
    except (ValueError, RecursionError):
        body = None
    check_answer(r, route, body)
    assert r.status_code != 200 or _json_object(raw), (route, raw[:200], r.text[:300])
    check_idle(app)
    return r


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_hostile_bodies(app, route):
    """Every body of RAW on every route."""
    codes = {raw[:40]: _check_raw(app, route, raw).status_code for raw in RAW}
    assert codes[b""] == codes[b"[1, 2]"] == codes[b"[" * 40] == codes[b'{"prompt": NaN}'] == 400, codes


@FUZZ
@given(route=st.sampled_from(sorted(ROUTES)), raw=raw_bodies)
def test_raw_bodies(app, route, raw):
    _check_raw(app, route, raw)


def _json_object(raw: bytes) -> bool:
    def no_constants(name):
        raise ValueError(name)

    try:
        return isinstance(json.loads(raw, parse_constant=no_constants), dict)
    except (ValueError, RecursionError):
        return False


@FUZZ
@given(route=st.sampled_from(["/completion", "/v1/chat/completions", "/tokenize"]),
       value=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),  # one: a high + low pair is a character
       where=st.sampled_from(["value", "key", "nested"]))
def test_lone_surrogates(app, route, value, where):
    """``"\\ud800"`` is valid JSON but no text: a 400 that names the field, wherever the string is."""
    key = {"/completion": "prompt", "/v1/chat/completions": "messages", "/tokenize": "content"}[route]
    s = "ab" + value + "c"
    val = [{"role": "user", "content": s}] if key == "messages" else s
    body = {key: val} if where == "value" else {key: "x" if key != "messages" else [{"role": "user", "content": "x"}],
                                                 ("stop" if where == "nested" else s): [s] if where == "nested" else 1}
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as a \\uXXXX escape
    r = post(app, route, raw)
    check_answer(r, route, body)
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    check_idle(app)


#: grammars and JSON schemas that cost the process before they were bounded (llamaspec._llama.grammar_limits)
COSTLY = [({"grammar": "root ::= " + "(" * 20000 + '"a"' + ")" * 20000}, "20000 groups"),  # was: a segfault
          ({"json_schema": {"type": "array", "minItems": 10 ** 9, "items": {"type": "integer"}}}, "minItems"),  # OOM
          ({"json_schema": {"type": "string", "minLength": 10 ** 8}}, "minLength"),  # 20 s and 500 MB
          ({"json_schema": {"type": "string", "pattern": "^a{1000000}$"}}, "repeats"),
          ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
              f"p{i}": {"type": "string", "minLength": 1500} for i in range(80)}}}}}, "expand")]


@pytest.mark.parametrize("extra,words", COSTLY, ids=[w for _, w in COSTLY])
def test_grammars_that_would_cost_the_process_are_refused(app, extra, words):
    route = "/v1/chat/completions" if "response_format" in extra else "/completion"
    body = {**BASE[route], **extra}
    t0 = time.monotonic()
    r = post(app, route, json.dumps(body).encode())
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text[:300]
    assert time.monotonic() - t0 < 5
    check_idle(app)


def test_infill_without_fim_tokens(app):
    """``/infill`` on a model without fill-in-the-middle tokens: llama-server's 501 in the error shape, not a
    500."""
    r = post(app, "/infill", b'{"input_prefix": "a", "input_suffix": "b"}')
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


def test_an_error_before_the_response_owns_the_generations_releases_them(app, monkeypatch):
    """Whatever fails between submitting a request's generations and the response taking them over (here the
    renderer) cancels them and releases their admission: nothing keeps running for nobody."""
    from llamaspec.server.render import NativeRenderer

    def broken(*a, **kw):
        raise ValueError("renderer failed")

    monkeypatch.setattr(NativeRenderer, "__init__", broken)
    r = post(app, "/completion", b'{"prompt": [1, 2, 3], "n_predict": 200}')
    assert r.status_code == 500 and "renderer failed" in r.json()["error"]["message"]
    check_idle(app)


# ------------------------------------------------------------------------------------------- disconnects
GEN_ROUTES = ["/completion", "/v1/completions", "/v1/chat/completions", "/v1/responses"]


async def _asgi(app, route: str, body: bytes, when: tuple[str, float]) -> list[dict]:
    """POST ``body`` to the ASGI ``app`` and go away ``when``: ("body", _) before the body arrived, ("time", s)
    ``s`` seconds after sending it, ("sent", k) once the app sent ``k`` body messages, ("never", _) not at
    all. The messages the app sent."""
    import asyncio

    sent: list[dict] = []
    gone = asyncio.Event()
    first = True

    async def receive() -> dict:
        nonlocal first
        if first and when[0] != "body":
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        if when[0] == "time":
            try:
                await asyncio.wait_for(gone.wait(), when[1])
            except asyncio.TimeoutError:
                pass
        elif when[0] != "body":
            await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        sent.append(msg)
        if when[0] == "sent" and sum(m["type"] == "http.response.body" for m in sent) >= when[1]:
            gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": route, "raw_path": route.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"testserver"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 50000), "server": ("testserver", 80)}
    await asyncio.wait_for(app(scope, receive, send), TIMEOUT)
    return sent


#: valid fields a disconnecting request may carry (each changes what is running when the client goes away)
DISCONNECT_FIELDS = ["temperature", "top_k", "stop", "seed", "n_probs", "grammar", "speculative", "id_slot",
                     "cache_prompt", "ignore_eos", "return_progress", "timings_per_token"]
disconnect_points = st.one_of(st.tuples(st.just("body"), st.just(0.0)), st.tuples(st.just("time"), st.floats(0, 0.3)),
                              st.tuples(st.just("sent"), st.integers(1, 6)), st.tuples(st.just("never"), st.just(0.0)))


@FUZZ
@given(data=st.data(), route=st.sampled_from(GEN_ROUTES), when=disconnect_points, stream=st.booleans(),
       n_predict=st.sampled_from([1, 8, 64, 250]), n=st.sampled_from([1, 1, 2]))
def test_client_disconnects(app, data, route, when, stream, n_predict, n):
    """A client that goes away at any point (before its body arrived, while its prompt waits or is
    processed, after some of its stream): the app returns, never starts a 500, and nothing is left running
    (its generations cancelled, their admission released)."""
    import asyncio

    fields = data.draw(st.lists(st.sampled_from(DISCONNECT_FIELDS), unique=True, max_size=3), label="fields")
    body = {**BASE[route], **{k: data.draw(SAMPLING[k], label=k) for k in fields}, "stream": stream, "n": n}
    if route in ("/completion", "/v1/completions") and data.draw(st.booleans(), label="long prompt"):
        body["prompt"] = data.draw(st.lists(st.integers(0, 63), min_size=60, max_size=120), label="prompt")
    body["max_output_tokens" if route == "/v1/responses" else "max_tokens" if route != "/completion" else "n_predict"] = n_predict
    client, _, pool = app
    fut = pool.submit(asyncio.run, _asgi(client.app, route, json.dumps(body).encode(), when))
    try:
        sent = fut.result(timeout=TIMEOUT + 5)
    except (cf.TimeoutError, asyncio.TimeoutError):
        pytest.fail(f"the app did not return within {TIMEOUT} s after a disconnect ({when}): {json.dumps(body)[:300]}")
    starts = [m for m in sent if m["type"] == "http.response.start"]
    event(f"{route} {when[0]} -> {starts[0]['status'] if starts else 'no answer'}")
    assert not starts or starts[0]["status"] < 500, (starts[0]["status"], sent[-1:], body)
    check_idle(app)
