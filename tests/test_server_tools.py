"""OpenAI ``tools`` on ``/v1/chat/completions`` (llamaspec/server/tools.py): the output parsers of each template
family on strings (whole and streamed), the request checks, the template's ``tools`` and tool messages, and end
to end with the official ``openai`` client on SmolLM2-135M (in process, Starlette's TestClient), where
``tool_choice`` required / named is a grammar: even a tiny model answers with a call that parses."""
from __future__ import annotations

import json

import pytest

from llamaspec._llama.chat_template import compiled
from llamaspec.server.errors import ApiError
from llamaspec.server.tools import ToolStream, message_extras, parse_output, parse_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                       "required": ["utc"]}}}
TOOLS = [WEATHER, TIME]

# a Hermes-style template (written for these tests): tools in the system turn, calls in <tool_call> tags
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.tool_call_id }}: {{ m.content }}"
    "</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>{\"name\": \""
    "{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}} {{ c.function.arguments }}"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _spec(**kw):
    return parse_tools({"tools": TOOLS, **kw})


def _ids():
    return iter(f"c{i}" for i in range(100))


def _call(name, args, cid):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


# ---------------------------------------------------------------------------------------------------
# parsers, per family
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,content,calls", [
    # Hermes / Qwen
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", '{"city": "Paris"}')]),
    ('Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>', "Let me look.",
     [("get_weather", '{"city": "Rome"}')]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n<tool_call>'
     '{"name": "get_time", "arguments": {"utc": true}}</tool_call>', None,
     [("get_weather", '{"city": "Rome"}'), ("get_time", '{"utc": true}')]),
    ('<tool_call>{"name": "get_time", "arguments": {"utc": false}}', None, [("get_time", '{"utc": false}')]),  # unclosed
    # Llama 3.x
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    ('{"type": "function", "name": "get_time", "parameters": {"utc": true}}', None, [("get_time", '{"utc": true}')]),
    ('<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}',
     None, [("get_time", "{}"), ("get_weather", '{"city": "Rome"}')]),
    # Mistral
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": "{}"}]',
     None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ('Sure [TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', "Sure", [("get_weather", '{"city": "Rome"}')]),
    # plain JSON: one call, a list, the generic {"tool_call": ...}, in a code fence
    ('{"name": "get_weather", "arguments": {"city": "Rome"}}', None, [("get_weather", '{"city": "Rome"}')]),
    ('[{"name": "get_time", "arguments": {"utc": true}}]', None, [("get_time", '{"utc": true}')]),
    ('{"tool_call": {"name": "get_time", "arguments": {"utc": true}}}', None, [("get_time", '{"utc": true}')]),
    ('```json\n{"name": "get_time", "arguments": {"utc": true}}\n```', None, [("get_time", '{"utc": true}')]),
])
def test_families_parse_into_calls(text, content, calls):
    got_content, got = parse_output(text, _spec(), ids=_ids())
    assert got_content == content
    assert got == [_call(n, a, f"c{i}") for i, (n, a) in enumerate(calls)]


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # malformed JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city"',  # cut off
    '<|python_tag|>print("hello")',  # code, not a call
    '{"name": "not_a_tool", "arguments": {}}',  # plain JSON must name one of the tools
    '{"answer": 42}',
    'The weather is fine. {"name": "get_time"}',  # JSON after prose is prose
    "Just text, no tools.",
])
def test_what_does_not_parse_stays_content(text):
    assert parse_output(text, _spec()) == (text, [])


def test_a_malformed_block_stays_content_and_a_good_one_is_a_call():
    text = '<tool_call>{bad}</tool_call> then <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert parse_output(text, _spec(), ids=_ids()) == ("<tool_call>{bad}</tool_call> then", [_call("get_time", "{}", "c0")])


def test_mistral_ids_are_kept_and_parallel_false_keeps_the_first_call():
    text = '[TOOL_CALLS][{"name": "get_time", "arguments": {}, "id": "a1b2c3d4e"}, {"name": "get_time", "arguments": {}}]'
    _, calls = parse_output(text, _spec(parallel_tool_calls=False))
    assert [c["id"] for c in calls] == ["a1b2c3d4e"]
    _, calls = parse_output(text, _spec(), ids=_ids())
    assert [c["id"] for c in calls] == ["a1b2c3d4e", "c0"]
    assert all(c["id"].startswith("call_") for c in parse_output('{"name": "get_time", "arguments": {}}', _spec())[1])


@pytest.mark.parametrize("step", [1, 3, 7])
def test_stream_gives_what_the_whole_text_gives(step):
    text = ('I will check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> and '
            '<tool_ca')
    ts = ToolStream(_spec(), ids=_ids())
    events = []
    for i in range(0, len(text), step):
        events += [(i, e) for e in ts.feed(text[i:i + step])]
    events += [(len(text), e) for e in ts.finish()]
    content = "".join(e[1] for _, e in events if e[0] == "content")
    calls = [(i, e[1]) for i, e in events if e[0] == "call"]
    assert content == "I will check.  and <tool_ca"
    assert [c for _, c in calls] == [_call("get_weather", '{"city": "Paris"}', "c0")]
    at = text.index("</tool_call>") + len("</tool_call>")
    assert calls[0][0] < at  # the call came out as soon as its block closed, before the end
    first_content = next(i for i, e in events if e[0] == "content")
    assert first_content < text.index("<tool_call>")  # text before the call is not held back
    assert not any("<tool_c" in e[1] for i, e in events if e[0] == "content" and i < at)  # a marker's start is held


# ---------------------------------------------------------------------------------------------------
# the request: checks, tool_choice, grammar, template
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("data,field", [
    ({"tools": {"name": "x"}}, "Field 'tools'"),
    ({"tools": ["x"]}, "Field 'tools[0]'"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "Field 'tools[0].function.name'"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": "nope"}}]},
     "Field 'tools[1].function.parameters'"),
    ({"tools": [{"type": "retrieval"}]}, "Field 'tools[0].type'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "Field 'tool_choice'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "Field 'tool_choice.function.name'"),
    ({"tool_choice": "required"}, "Field 'tool_choice'"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "Field 'parallel_tool_calls'"),
])
def test_bad_tools_are_400s_naming_the_field(data, field):
    with pytest.raises(ApiError) as e:
        parse_tools(data)
    assert e.value.code == 400 and field in str(e.value), str(e.value)


def test_a_schema_the_converter_cannot_follow_names_its_tool():
    from llamaspec._llama import json_schema_to_grammar

    spec = parse_tools({"tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": {"type": "hiccup"}}}],
                        "tool_choice": "required"})
    with pytest.raises(ApiError) as e:
        spec.grammar(json_schema_to_grammar)
    assert "tools[1].function.parameters" in str(e.value)


def test_tool_choice_modes():
    assert parse_tools({"tools": []}) is None and parse_tools({}) is None
    auto, none, req = _spec(), _spec(tool_choice="none"), _spec(tool_choice="required")
    assert auto.render and auto.parse and not auto.forced
    assert not none.render and not none.parse and not none.forced
    assert req.forced
    named = _spec(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.forced and named.call_schema()["properties"]["name"] == {"const": "get_time"}
    assert [a["properties"]["name"]["const"] for a in req.call_schema()["oneOf"]] == ["get_weather", "get_time"]
    assert _spec(tool_choice="required", parallel_tool_calls=True).call_schema()["type"] == "array"


def test_template_gets_tools_and_tool_messages():
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    parsed = [{"role": m["role"], "content": m["content"] or "", **message_extras(m, i)} for i, m in enumerate(msgs)]
    text = compiled(TEMPLATE, "", "").render(parsed, tools=TOOLS)
    assert '"name": "get_weather", "description": "The weather in a city"' in text  # tools | tojson
    # arguments: an object for | tojson, its JSON text when printed
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}} {"city": "Paris"}</tool_call>' in text
    assert "<tool_response>c1: sunny</tool_response>" in text
    assert "Tools:" not in compiled(TEMPLATE, "", "").render(parsed[:1])


@pytest.mark.parametrize("m,field", [
    ({"role": "assistant", "tool_calls": "x"}, "messages[0].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "messages[0].tool_calls[0].function.name"),
    ({"role": "tool", "tool_call_id": 5}, "messages[0].tool_call_id"),
])
def test_bad_tool_messages_are_400s(m, field):
    with pytest.raises(ApiError) as e:
        message_extras(m, 0)
    assert field in str(e.value)


# ---------------------------------------------------------------------------------------------------
# end to end: the openai client, a real engine on SmolLM2-135M
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from helpers import real_model
    from llamaspec.engine import Engine
    from llamaspec.server.app import ServerConfig, ServerState, create_app

    with Engine(real_model("smollm2-135m-q4_1"), n_ctx=2048) as eng:
        with TestClient(create_app(ServerState(ServerConfig(model_id="smol", chat_template=TEMPLATE,
                                                            sse_ping_interval=0), engine=eng))) as c:
            yield c, eng


@pytest.fixture(scope="module")
def oai(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=server[0], max_retries=0)


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call, name=None):
    assert call.type == "function" and call.id
    assert call.function.name in ("get_weather", "get_time") if name is None else call.function.name == name
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert args["city"] in ("Paris", "Rome")
    else:
        assert isinstance(args["utc"], bool)


@pytest.mark.real
def test_required_gives_a_call(oai):
    r = oai.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice="required",
                                    max_tokens=64, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert len(ch.message.tool_calls) == 1 and not ch.message.content
    _check_call(ch.message.tool_calls[0])


@pytest.mark.real
def test_named_function_gives_that_call_streamed_too(oai):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = oai.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=64,
                                    temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_call(r.choices[0].message.tool_calls[0], "get_time")
    calls, reasons, content = [], [], ""
    for chunk in oai.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice=choice,
                                             max_tokens=64, temperature=0, stream=True):
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            content += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert len(calls) == 1 and reasons[-1] == "tool_calls" and not content.strip()
    _check_call(calls[0], "get_time")
    assert calls[0].function.arguments == r.choices[0].message.tool_calls[0].function.arguments


@pytest.mark.real
def test_parallel_required_may_give_several_calls(oai):
    r = oai.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=True, max_tokens=96, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    for call in r.choices[0].message.tool_calls:
        _check_call(call)


@pytest.mark.real
def test_round_trip_with_a_tool_message(oai, server):
    r = oai.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice="required",
                                    max_tokens=64, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    msgs = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r2 = oai.chat.completions.create(model="smol", messages=msgs, tools=TOOLS, max_tokens=8, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = server[0].post("/apply-template", json={"messages": msgs, "tools": TOOLS}).json()["prompt"]
    assert f"<tool_response>{call.id}: sunny, 21 C</tool_response>" in prompt
    assert f'"name": "{call.function.name}", "arguments": {call.function.arguments}' in prompt
    assert '"name": "get_time"' in prompt  # the tools went to the template


@pytest.mark.real
def test_tool_choice_none_renders_no_tools_and_parses_no_calls(server):
    c, _ = server
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4, "temperature": 0}
    assert "Tools:" not in c.post("/apply-template", json=body).json()["prompt"]
    r = c.post("/v1/chat/completions", json=body).json()
    assert "tool_calls" not in r["choices"][0]["message"] and r["choices"][0]["finish_reason"] != "tool_calls"


@pytest.mark.real
def test_http_400s(server):
    c, eng = server
    r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": [{"function": {}}]})
    assert r.status_code == 400 and "tools[0].function.name" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                             "json_schema": {"type": "object"}})
    assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"]
    r = c.post("/v1/completions", json={"prompt": "hi", "tools": TOOLS})
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"]


NESTED = [{"type": "function", "function": {"name": "get_weather", "parameters": {  # as pydantic writes a nested model
    "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"],
    "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                        "required": ["city"]}}}}}]
CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
TREE = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer", "minimum": 0, "maximum": 9},
    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["v"]}}}


@pytest.mark.real
def test_forced_call_of_a_tool_with_defs(server):
    """``#/$defs/...`` in a tool's parameters resolves once the parameters sit under ``arguments`` (issue 36)."""
    c, eng = server
    r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": NESTED, "tool_choice": "required",
                                             "max_tokens": 48, "temperature": 0})
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    args = json.loads(calls[0]["function"]["arguments"])
    assert isinstance(args["place"]["city"], str)


@pytest.mark.real
def test_ref_cycles_are_400_and_recursive_schemas_generate(server):
    c, eng = server
    cyc_tool = [{"type": "function", "function": {"name": "f", "parameters": CYCLE}}]
    r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": cyc_tool, "tool_choice": "required",
                                             "max_tokens": 8})
    assert r.status_code == 400, r.text
    r = c.post("/completion", json={"prompt": "hi", "json_schema": CYCLE, "n_predict": 4})
    assert r.status_code == 400, r.text
    r = c.post("/completion", json={"prompt": "A tree as JSON:", "json_schema": TREE, "n_predict": 24,
                                    "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["content"].lstrip().startswith("{")
    tree_tool = [{"type": "function", "function": {"name": "f", "parameters": TREE}}]
    r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": tree_tool, "tool_choice": "required",
                                             "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200, r.text


@pytest.mark.real
def test_auto_parses_a_hermes_call_with_text_before_it_stream_and_not(server):
    """``tool_choice`` auto: the model's own ``<tool_call>`` (a grammar makes SmolLM2 write one) is parsed."""
    c, _ = server
    said = 'Ok. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 64, "temperature": 0, "grammar": f"root ::= {json.dumps(said)}"}
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    assert ch["message"]["content"] == "Ok."
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in ch["message"]["tool_calls"]] == \
        [("get_time", "{}")]
    r = c.post("/v1/chat/completions", json={**body, "stream": True, "logprobs": True})
    deltas = [json.loads(line[6:])["choices"] for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [d[0] for d in deltas if d]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
    assert content == "Ok. " and deltas[-1]["finish_reason"] == "tool_calls"
    assert [(t["index"], t["function"]["name"]) for t in calls] == [(0, "get_time")]
    first_call = next(i for i, d in enumerate(deltas) if d["delta"].get("tool_calls"))
    assert all(not d["delta"].get("content") for d in deltas[first_call:])  # the text came before the call
    assert any(d.get("logprobs") for d in deltas[:first_call])


@pytest.mark.real
def test_named_function_grammar_is_that_tools_call_only(server):
    """``tool_choice`` ``{"type": "function", "function": {"name"}}``: the grammar of that tool's call alone (its
    name a constant, its parameters' schema), not of any other tool (llama-server reads the object as "auto")."""
    c, _ = server
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 48, "temperature": 0, "verbose": True}
    named = c.post("/v1/chat/completions", json={**body, "tool_choice": {"type": "function",
                                                                         "function": {"name": "get_weather"}}}).json()
    grammar = named["__verbose"]["generation_settings"]["grammar"]
    assert '"\\"get_weather\\""' in grammar and "get_time" not in grammar and "utc" not in grammar, grammar
    calls = named["choices"][0]["message"]["tool_calls"]
    assert [t["function"]["name"] for t in calls] == ["get_weather"]
    required = c.post("/v1/chat/completions", json={**body, "tool_choice": "required"}).json()
    assert "get_time" in required["__verbose"]["generation_settings"]["grammar"]


@pytest.mark.real
def test_unknown_named_function_is_a_400_naming_it(oai):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, max_tokens=4,
                                    tool_choice={"type": "function", "function": {"name": "get_wether"}})
    msg = str(e.value)
    assert "tool_choice.function.name" in msg and '"get_wether"' in msg and "get_weather, get_time" in msg, msg


@pytest.mark.real
def test_tools_need_jinja(server):  # last: its app's shutdown closes the shared engine
    from starlette.testclient import TestClient

    from llamaspec.server.app import ServerConfig, ServerState, create_app

    _, eng = server
    with TestClient(create_app(ServerState(ServerConfig(model_id="smol", chat_template=TEMPLATE, jinja=False),
                                           engine=eng))) as c:
        r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 400 and "--jinja" in r.json()["error"]["message"]
