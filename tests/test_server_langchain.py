"""LangChain's ``ChatOpenAI`` as a client of a real ``llamaspec serve`` process on 127.0.0.1 (SmolLM2-135M, the
Hermes-style tools template of test_server_tools.py): ``with_structured_output`` (json_schema and
function_calling) returns a parsed object, ``bind_tools`` gives ``tool_calls`` (a forced ``tool_choice``: a
grammar, so even a tiny model calls), ``stream`` adds up to the non-stream answer at temperature 0, and a tool
message goes back to the template."""
from __future__ import annotations

import json
import urllib.request

import pytest

pytest.importorskip("langchain_openai")
pytest.importorskip("starlette")

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.slow]


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(description="the city's name")
    country: str = Field(description="its country")


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


@tool
def get_time(utc: bool) -> str:
    """The time now."""
    return "12:00"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``llamaspec serve`` in its own process; its base URL."""
    from helpers import real_model
    from support.server import serve
    from test_server_tools import TEMPLATE

    tmp = tmp_path_factory.mktemp("langchain")
    (tmp / "tools.jinja").write_text(TEMPLATE)
    with serve(["-m", real_model("smollm2-135m-q4_1"), "--host", "127.0.0.1", "--chat-template-file",
                tmp / "tools.jinja", "-c", "2048", "-t", "1"], module="llamaspec.cli.main", log=tmp / "serve.log",
               stop_timeout=20) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def sent():
    """The JSON bodies LangChain sent, in order."""
    return []


@pytest.fixture(scope="module")
def llm(server, sent):
    import httpx

    def keep(request):
        sent.append(json.loads(request.content or b"{}"))

    with httpx.Client(event_hooks={"request": [keep]}) as client:
        yield ChatOpenAI(model="smol", base_url=server + "/v1", api_key="x", temperature=0, max_tokens=48,
                         max_retries=0, http_client=client)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_object(llm, sent, method):
    r = llm.with_structured_output(City, method=method, include_raw=True).invoke("Name a city in France.")
    assert r["parsing_error"] is None, r
    assert isinstance(r["parsed"], City) and r["parsed"].name and r["parsed"].country
    body = sent[-1]
    if method == "json_schema":  # response_format with the schema: a grammar
        assert body["response_format"]["type"] == "json_schema"
    else:  # a forced call of the schema's tool
        assert body["tool_choice"] == {"type": "function", "function": {"name": "City"}}
        assert r["raw"].tool_calls[0]["name"] == "City"


@pytest.mark.parametrize("choice,names", [("get_weather", ["get_weather"]), ("any", ["get_weather", "get_time"])])
def test_bind_tools_gives_tool_calls(llm, choice, names):
    ai = llm.bind_tools([get_weather, get_time], tool_choice=choice).invoke("What is the weather in Paris?")
    assert len(ai.tool_calls) >= 1 and ai.content == ""
    call = ai.tool_calls[0]
    assert call["name"] in names and call["id"] and call["type"] == "tool_call"
    assert isinstance(call["args"].get("city" if call["name"] == "get_weather" else "utc"), (str, bool))
    assert ai.response_metadata["finish_reason"] == "tool_calls"


def test_stream_adds_up_to_the_answer(llm):
    q = "Tell me a short story about a cat."
    chunks = list(llm.stream(q))
    assert len(chunks) > 2
    whole = llm.invoke(q)
    assert "".join(c.content for c in chunks) == whole.content and whole.content


def test_streamed_tool_call_equals_the_non_stream_one(llm):
    m = llm.bind_tools([get_weather, get_time], tool_choice="get_time")
    chunks = list(m.stream("What time is it?"))
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    whole = m.invoke("What time is it?")
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [(c["name"], c["args"]) for c in whole.tool_calls]
    assert total.tool_calls and total.tool_calls[0]["name"] == "get_time"


def test_tool_message_round_trip(llm, sent, server):
    ask = HumanMessage("What is the weather in Paris?")
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([ask])
    call = ai.tool_calls[0]
    assert isinstance(ai, AIMessage) and call["name"] == "get_weather"
    answer = llm.bind_tools([get_weather]).invoke([ask, ai, ToolMessage("sunny, 21 C", tool_call_id=call["id"])])
    assert isinstance(answer, AIMessage) and answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    body = sent[-1]  # what LangChain sent: the assistant's call and the tool's answer, through the template
    assert body["messages"][1]["tool_calls"][0]["id"] == call["id"] and body["messages"][2]["role"] == "tool"
    req = urllib.request.Request(server + "/apply-template", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        prompt = json.load(r)["prompt"]
    assert f"<tool_response>{call['id']}: sunny, 21 C</tool_response>" in prompt
    assert f'"name": "get_weather", "arguments": {json.dumps(call["args"])}' in prompt


def test_the_responses_api_path(server):
    """``ChatOpenAI(use_responses_api=True)``: the same through ``/v1/responses`` (function tools, function_call
    items and the function_call_output of the round trip)."""
    llm = ChatOpenAI(model="smol", base_url=server + "/v1", api_key="x", temperature=0, max_tokens=48, max_retries=0,
                     use_responses_api=True)
    city = llm.with_structured_output(City, method="json_schema").invoke("Name a city in France.")
    assert isinstance(city, City) and city.name
    m = llm.bind_tools([get_weather, get_time], tool_choice="get_weather")
    ai = m.invoke("What is the weather in Paris?")
    assert [c["name"] for c in ai.tool_calls] == ["get_weather"] and isinstance(ai.tool_calls[0]["args"]["city"], str)
    chunks = list(m.stream("What is the weather in Paris?"))
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [(c["name"], c["args"]) for c in ai.tool_calls]
    msgs = [HumanMessage("What is the weather in Paris?"), ai, ToolMessage("sunny", tool_call_id=ai.tool_calls[0]["id"])]
    answer = llm.bind_tools([get_weather]).invoke(msgs)
    assert isinstance(answer, AIMessage) and answer.usage_metadata["output_tokens"] > 0
