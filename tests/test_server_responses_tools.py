"""Function tools on ``/v1/responses`` (llamaspec/server/responses.py): the request's ``tools`` / ``tool_choice``
and its ``function_call`` / ``function_call_output`` input items as the chat request they stand for, then end to
end with the official ``openai`` client on SmolLM2-135M (in process): ``function_call`` output items, the
stream's function-call events, ``responses.stream()``, and a round trip with the tool's output."""
from __future__ import annotations

import json

import pytest

from llamaspec.server.errors import ApiError
from llamaspec.server.responses import to_chat

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}
TIME = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}
TOOLS = [WEATHER, TIME]
ASK = "What is the weather in Paris?"


def test_tools_and_tool_choice_become_the_chat_ones():
    chat = to_chat({"input": ASK, "tools": TOOLS + [{"type": "web_search"}], "parallel_tool_calls": False,
                    "tool_choice": {"type": "function", "name": "get_time"}})
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                             for t in TOOLS]  # the hosted web_search is skipped (llama-server too)
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    assert chat["parallel_tool_calls"] is False
    assert to_chat({"input": ASK, "tools": TOOLS, "tool_choice": "required"})["tool_choice"] == "required"
    assert "tools" not in to_chat({"input": ASK, "tools": [{"type": "file_search"}]})


def test_function_call_items_become_tool_calls_and_tool_messages():
    items = [{"role": "user", "content": ASK},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}', "status": "completed"},
             {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": '{"utc": true}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "12:00"}]}]
    msgs = to_chat({"input": items})["messages"]
    assert msgs[1] == {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"utc": true}'}}]}
    assert msgs[2:] == [{"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12:00"}]}]
    # a call with no assistant text before it is an assistant message of its own
    alone = to_chat({"input": [{"role": "user", "content": "x"}, items[3]]})["messages"]
    assert alone[1] == {"role": "assistant", "content": [], "tool_calls": msgs[1]["tool_calls"][1:]}


@pytest.mark.parametrize("body,field", [
    ({"tools": {"name": "x"}}, "Field 'tools'"),
    ({"tools": ["x"]}, "Field 'tools[0]'"),
    ({"tools": [{"type": "function"}]}, "Field 'tools[0].name'"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "Field 'tools[0].parameters'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "Field 'tool_choice.name'"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "Field 'tool_choice'"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "Field 'input[0].name'"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "Field 'input[0].call_id'"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "Field 'input[0].output'"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "Field 'input[0].output[0]'"),
])
def test_bad_tool_fields_are_400s_naming_the_field(body, field):
    with pytest.raises(ApiError) as e:
        to_chat({"input": ASK, **body})
    assert e.value.code == 400 and field in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------------
# end to end: the official openai client, a real engine on SmolLM2-135M
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from helpers import real_model
    from llamaspec.engine import Engine
    from llamaspec.server.app import ServerConfig, ServerState, create_app
    from test_server_tools import TEMPLATE

    with Engine(real_model("smollm2-135m-q4_1"), n_ctx=2048) as eng:
        with TestClient(create_app(ServerState(ServerConfig(model_id="smol", chat_template=TEMPLATE,
                                                            sse_ping_interval=0), engine=eng))) as c:
            yield c


@pytest.fixture(scope="module")
def oai(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=server, max_retries=0)


def _check_call(item, name=None):
    assert item.type == "function_call" and item.id.startswith("fc_") and item.call_id.startswith("call_")
    assert item.status == "completed" and item.name == (name or item.name) and item.name in ("get_weather", "get_time")
    args = json.loads(item.arguments)
    if item.name == "get_weather":
        assert args["city"] in ("Paris", "Rome")
    else:
        assert isinstance(args["utc"], bool)


@pytest.mark.real
def test_required_gives_a_function_call_item(oai):
    r = oai.responses.create(model="smol", input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=64,
                             temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and r.output_text == "" and r.status == "completed"
    _check_call(calls[0])


@pytest.mark.real
def test_named_function_streamed_as_function_call_events(oai):
    choice = {"type": "function", "name": "get_time"}
    whole = oai.responses.create(model="smol", input=ASK, tools=TOOLS, tool_choice=choice, max_output_tokens=64,
                                 temperature=0)
    _check_call(whole.output[0], "get_time")
    events = list(oai.responses.create(model="smol", input=ASK, tools=TOOLS, tool_choice=choice,
                                       max_output_tokens=64, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert types[2:-1] == ["response.output_item.added", "response.function_call_arguments.delta",
                           "response.function_call_arguments.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, delta, done, item_done = events[2:6]
    assert added.item.type == "function_call" and added.item.status == "in_progress" and added.item.name == "get_time"
    assert added.output_index == delta.output_index == item_done.output_index == 0
    assert delta.item_id == done.item_id == added.item.id == item_done.item.id
    assert delta.delta == done.arguments == item_done.item.arguments == whole.output[0].arguments
    _check_call(item_done.item, "get_time")
    assert [o.type for o in events[-1].response.output] == ["function_call"]


@pytest.mark.real
def test_the_clients_stream_helper_assembles_the_call(oai):
    with oai.responses.stream(model="smol", input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=64,
                              temperature=0) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    _check_call(final.output[0])


@pytest.mark.real
def test_auto_text_then_call_stream_and_not(server):
    """``tool_choice`` auto: the model's own ``<tool_call>`` (a grammar makes SmolLM2 write one) after some text:
    a ``message`` item, then a ``function_call`` item."""
    said = 'Ok. <tool_call>{"name": "get_time", "arguments": {"utc": true}}</tool_call>'
    body = {"input": ASK, "tools": TOOLS, "max_output_tokens": 64, "temperature": 0,
            "grammar": f"root ::= {json.dumps(said)}"}
    r = server.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    assert [o["type"] for o in out] == ["message", "function_call"]
    assert out[0]["content"][0]["text"] == "Ok."
    assert (out[1]["name"], out[1]["arguments"]) == ("get_time", '{"utc": true}')
    r = server.post("/v1/responses", json={**body, "stream": True})
    ev = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    text = "".join(e["delta"] for e in ev if e["type"] == "response.output_text.delta")
    assert text == "Ok. "
    added = [(e["output_index"], e["item"]["type"]) for e in ev if e["type"] == "response.output_item.added"]
    assert added == [(0, "message"), (1, "function_call")]
    final = ev[-1]["response"]["output"]
    assert [o["type"] for o in final] == ["message", "function_call"] and final[1]["arguments"] == '{"utc": true}'


@pytest.mark.real
def test_round_trip_with_the_function_output(oai, server):
    r = oai.responses.create(model="smol", input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=64,
                             temperature=0)
    call = r.output[0]
    items = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    r2 = oai.responses.create(model="smol", input=items, tools=TOOLS, max_output_tokens=8, temperature=0)
    assert r2.status == "completed" and r2.usage.output_tokens > 0
    chat = to_chat({"input": items, "tools": TOOLS})
    prompt = server.post("/apply-template", json=chat).json()["prompt"]
    assert f"<tool_response>{call.call_id}: sunny, 21 C</tool_response>" in prompt
    assert f'"name": "{call.name}", "arguments": {call.arguments}' in prompt
    assert '"name": "get_time"' in prompt  # the tools went to the template


# ---------------------------------------------------------------------------------------------------
# text.format: structured output on /v1/responses (llama-server drops it; llamaspec constrains with it)
# ---------------------------------------------------------------------------------------------------
PLACE = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                          "population": {"type": "integer", "minimum": 0}},
         "required": ["city", "population"], "additionalProperties": False}


@pytest.mark.real
def test_text_format_becomes_the_chat_response_format():
    fmt = {"type": "json_schema", "name": "place", "schema": PLACE, "strict": True}
    assert to_chat({"input": ASK, "text": {"format": fmt}})["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}}
    assert to_chat({"input": ASK, "text": {"format": {"type": "json_object"}}})["response_format"] == {
        "type": "json_object"}
    for text in ({"format": {"type": "text"}}, {"verbosity": "low"}, {}):
        assert "response_format" not in to_chat({"input": ASK, "text": text})


@pytest.mark.parametrize("fmt,field", [
    ("json", "Field 'text.format'"),
    ({"type": "json_scheme", "schema": PLACE}, "Field 'text.format.type'"),
    ({"schema": PLACE}, "Field 'text.format.type'"),
    ({"type": "json_schema", "name": "x"}, "Field 'text.format.schema'"),
    ({"type": "json_schema", "name": "x", "schema": "{}"}, "Field 'text.format.schema'"),
    ({"type": "json_schema", "name": "x", "schema": {"type": "hiccup"}}, "Field 'text.format.schema'"),
    ({"type": "json_schema", "name": 5, "schema": PLACE}, "Field 'text.format.name'"),
])
@pytest.mark.real
def test_bad_text_formats_are_400s_naming_the_field(fmt, field):
    with pytest.raises(ApiError) as e:
        to_chat({"input": ASK, "text": {"format": fmt}})
    assert e.value.code == 400 and field in str(e.value), str(e.value)


def _place_ok(text: str) -> dict:
    jsonschema = pytest.importorskip("jsonschema")
    value = json.loads(text)  # the JSON alone: the fence the Jinja grammar allows is parsed away
    jsonschema.validate(value, PLACE)
    return value


@pytest.mark.real
def test_text_format_json_schema_constrains_the_output(oai):
    fmt = {"type": "json_schema", "name": "place", "schema": PLACE, "strict": True}
    r = oai.responses.create(model="smol", input="Name a big city and its population.", text={"format": fmt},
                             max_output_tokens=64, temperature=0)
    assert r.status == "completed" and [o.type for o in r.output] == ["message"]
    whole = _place_ok(r.output_text)
    events = list(oai.responses.create(model="smol", input="Name a big city and its population.",
                                       text={"format": fmt}, max_output_tokens=64, temperature=0, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text and _place_ok(events[-1].response.output_text) == whole


@pytest.mark.real
def test_responses_parse_with_a_pydantic_model(oai):
    pydantic = pytest.importorskip("pydantic")

    class Place(pydantic.BaseModel):
        city: str
        population: int

    r = oai.responses.parse(model="smol", input="Name a big city and its population.", text_format=Place,
                            max_output_tokens=64, temperature=0)
    assert isinstance(r.output_parsed, Place) and r.output_parsed.city


@pytest.mark.real
def test_text_format_json_object_and_text(oai):
    r = oai.responses.create(model="smol", input="Describe Paris as JSON.", text={"format": {"type": "json_object"}},
                             max_output_tokens=48, temperature=0)
    if r.output[0].content[0].text and r.usage.output_tokens < 48:  # complete: one JSON object
        assert isinstance(json.loads(r.output_text), dict)
    plain = oai.responses.create(model="smol", input="Say hi.", text={"format": {"type": "text"}},
                                 max_output_tokens=8, temperature=0)
    assert plain.output_text == oai.responses.create(model="smol", input="Say hi.", max_output_tokens=8,
                                                     temperature=0).output_text


@pytest.mark.real
def test_a_bad_text_format_is_a_400_to_the_client(oai):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="smol", input=ASK, text={"format": {"type": "json_schema", "name": "x"}})
    assert "text.format.schema" in str(e.value)


@pytest.mark.real
def test_unknown_named_function_is_a_400_naming_it(oai):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="smol", input=ASK, tools=TOOLS, tool_choice={"type": "function", "name": "nope"})
    assert '"nope"' in str(e.value) and "get_weather" in str(e.value)
