"""Pythonic tool calls (llamaspec/server/pythonic.py, through llamaspec/server/tools.py): Gemma 3's
```tool_code block and the list ``[f(x=1), g(y="a")]`` of Llama 3.2 / Gemma prompts, parsed with ``ast``
(literals only, never evaluated) into ``message.tool_calls``, whole and streamed; then end to end on
SmolLM2-135M with a grammar that makes the model write them, stream and not."""
from __future__ import annotations

import json

import pytest

from llamaspec.server.pythonic import parse_calls
from llamaspec.server.tools import ToolStream, parse_output, parse_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
SPEC = parse_tools({"tools": [WEATHER, TIME]})


def _ids():
    return iter(f"c{i}" for i in range(100))


def _calls(*pairs):
    return [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(pairs)]


@pytest.mark.parametrize("text,calls", [
    ('f(a=1, b="x")', [("f", '{"a": 1, "b": "x"}')]),
    ("[f(x=1), g(y='a')]", [("f", '{"x": 1}'), ("g", '{"y": "a"}')]),
    ("(f(),)", [("f", "{}")]),
    ("f(x=1)\ng(y=2)", [("f", '{"x": 1}'), ("g", '{"y": 2}')]),  # one per line
    ("f(a=[1, 2.5, -3], b={'k': (True, None)}, c=false, d=null, e=-0.5, g=+2)",
     [("f", '{"a": [1, 2.5, -3], "b": {"k": [true, null]}, "c": false, "d": null, "e": -0.5, "g": 2}')]),
    ('print(f(q="été"))', [("f", '{"q": "été"}')]),  # Gemma's print(...); non-ASCII kept
    ('default_api.f(x="y")', [("f", '{"x": "y"}')]),
    ('f(s="a\\nb")', [("f", '{"s": "a\\nb"}')]),
])
def test_parse_calls_reads_literals(text, calls):
    assert parse_calls(text) == [{"name": n, "arguments": a} for n, a in calls]


@pytest.mark.parametrize("text", [
    'f(x=open("/etc/passwd").read())',  # a call inside: never evaluated, not a literal
    "f(x=__import__('os').system('true'))",
    "f(x=y)",  # a free name
    "f(x=1 + 2)",  # arithmetic
    "f(1, 2)",  # positional: the parameters' names are unknown
    "f(**kw)", "f(x={**d})", "f(x={1: 2})", "f(x=b'raw')", "f(x=1j)", "f(x=...)", "f(x=1e999)", "f(x={1, 2})",
    "f(x=[i for i in range(3)])", "f(x=lambda: 0)",
    "x = f(a=1)",  # a statement, not a call
    "import os", "[]", "[1, 2]", "f", "'just a string'", "f(a=1", "",
    "(lambda: 0)()", "f()()",
    "[" * 5000 + "]" * 5000,  # too deep: no crash
])
def test_parse_calls_refuses_the_rest(text):
    assert parse_calls(text) is None


def test_parse_calls_known_names():
    assert parse_calls("[get_time()]", known=["get_time"]) == [{"name": "get_time", "arguments": "{}"}]
    assert parse_calls("[get_time(), rm(path='/')]", known=["get_time"]) is None


@pytest.mark.parametrize("text,content,calls", [
    # Gemma 3: a ```tool_code block, with or without prose around it
    ('```tool_code\nget_weather(city="Paris")\n```', None, [("get_weather", '{"city": "Paris"}')]),
    ('Let me check.\n```tool_code\nprint(get_weather(city="Rome"))\n```\nOne moment.', "Let me check.\n\nOne moment.",
     [("get_weather", '{"city": "Rome"}')]),
    ('```tool_code\n[get_time(), get_weather(city="Oslo")]\n```', None,
     [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]),
    ('```tool_code\n{"name": "get_time", "arguments": {}}\n```', None, [("get_time", "{}")]),  # JSON in the fence
    ('```tool_code\nget_time()', None, [("get_time", "{}")]),  # unclosed at the end
    # Llama 3.2 / Gemma prompts: a whole output that is a list of calls of the tools
    ('[get_weather(city="Paris"), get_time()]', None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("  [get_time()]\n", None, [("get_time", "{}")]),
    ('<|python_tag|>[get_weather(city="Paris")]', None, [("get_weather", '{"city": "Paris"}')]),
])
def test_gemma_and_pythonic_outputs_parse_into_calls(text, content, calls):
    assert parse_output(text, SPEC, ids=_ids()) == (content, _calls(*calls))


@pytest.mark.parametrize("text", [
    "[not_a_tool(x=1)]",  # a bare list must call the request's tools
    "[get_time(), not_a_tool()]",
    "[get_weather(city=input())]",
    "```tool_code\nimport os; os.system('x')\n```",
    '```tool_code\nprint("hello")\n```',
    "```python\nget_time()\n```",  # only tool_code fences are calls
    'It is get_weather(city="Paris") I think',  # a call in prose is prose
    "[1, 2, 3]",
    "```",
])
def test_what_is_not_a_pythonic_call_stays_content(text):
    assert parse_output(text, SPEC) == (text, [])


def _stream(text: str, step: int):
    ts = ToolStream(SPEC, ids=_ids())
    events = []
    for i in range(0, len(text), step):
        events += [(i, e) for e in ts.feed(text[i:i + step])]
    events += [(len(text), e) for e in ts.finish()]
    return events


@pytest.mark.parametrize("step", [1, 2, 5, 13])
@pytest.mark.parametrize("text", [
    'I will check.\n```tool_code\nget_weather(city="Paris")\n```\nand then `x` ``` code',
    '```tool_code\nget_weather(city="Paris")\n```',
    '[get_weather(city="Paris")]',
    '` not a fence',
])
def test_stream_gives_what_the_whole_text_gives(text, step):
    events = _stream(text, step)
    content = "".join(e[1] for _, e in events if e[0] == "content")
    calls = [e[1] for _, e in events if e[0] == "call"]
    whole_content, whole_calls = parse_output(text, SPEC, ids=_ids())
    assert calls == whole_calls
    if calls:
        assert content.strip() == (whole_content or "")
    else:
        assert content == text
    if "```tool_code" in text and text.rstrip().endswith("``` code"):
        at = text.index("```\nand") + 3
        assert next(i for i, e in events if e[0] == "call") < at + step  # out as soon as the fence closed
        assert next(i for i, e in events if e[0] == "content") < text.index("```")  # prose is not held


# ---------------------------------------------------------------------------------------------------
# end to end: a grammar makes SmolLM2-135M write Gemma / pythonic calls
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client():
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from helpers import real_model
    from llamaspec.engine import Engine
    from llamaspec.server.app import ServerConfig, ServerState, create_app
    from test_server_tools import TEMPLATE

    with Engine(real_model("smollm2-135m-q4_1"), n_ctx=1024) as eng:
        with TestClient(create_app(ServerState(ServerConfig(model_id="smol", chat_template=TEMPLATE,
                                                            sse_ping_interval=0), engine=eng))) as c:
            yield c


@pytest.mark.parametrize("said,content", [
    ('Sure.\n```tool_code\nget_weather(city="Paris")\n```', "Sure."),
    ('[get_weather(city="Paris")]', None),
])
@pytest.mark.real
def test_http_stream_and_not(client, said, content):
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER, TIME],
            "max_tokens": 48, "temperature": 0, "grammar": f"root ::= {json.dumps(said)}"}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] == content
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in ch["message"]["tool_calls"]] == \
        [("get_weather", {"city": "Paris"})]
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [json.loads(line[6:])["choices"] for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [d[0] for d in deltas if d]
    streamed = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
    assert streamed.strip() == (content or "") and deltas[-1]["finish_reason"] == "tool_calls"
    assert [(t["index"], t["function"]["name"], t["function"]["arguments"]) for t in calls] == \
        [(0, "get_weather", '{"city": "Paris"}')]
