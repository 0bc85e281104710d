"""A JSON schema on the Jinja chat path (llamaspec/server/chat_format.py, issue 35): the grammar llama-server's
differential autoparser builds (the JSON, or the JSON in a ```json fence) for the schemas of
tests/test_schema_text_parity.py as the pinned llama-server wrote them (tests/data), the fence parsed out of
the content as llama-server parses it, whole and streamed, then end to end on SmolLM2-135M (in process) with
the official ``openai`` client: ``chat.completions.parse`` with a pydantic model, the stream, ``--no-jinja``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from llamaspec._llama import chat_schema_grammar, json_schema_to_grammar
from llamaspec.server.chat_format import FenceStream, chat_format, content
from llamaspec.server.parsing import Body

CASES = json.loads((Path(__file__).parent / "data" / "llama_server_chat_schema_grammars.json").read_text())["cases"]


def _as_llamaspec_writes_it(native: str) -> str:
    """llama-server's root opens with the generation prompt (its sampler feeds the grammar that prompt first);
    its ``json-*`` rules (of the PEG parser's generic JSON) are unreachable."""
    lines = [line for line in native.splitlines(keepends=True) if not line.startswith("json-")]
    return "".join(line.replace('root ::= "<|im_start|>assistant\\n" ', "root ::= ", 1) for line in lines)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_chat_grammar_is_llama_servers(case):
    assert chat_schema_grammar(case["schema"]) == _as_llamaspec_writes_it(case["grammar"])


def test_chat_grammar_allows_a_fence_around_the_schemas_rules():
    g = chat_schema_grammar({"type": "integer", "minimum": 0, "maximum": 5})
    assert g.splitlines()[:3] == ["response-format ::= response-format-schema", "response-format-schema ::= ([0-5])",
                                  'root ::= space space ("```json" space response-format space "```" | space '
                                  'response-format space)']
    with pytest.raises(ValueError, match="hiccup"):
        chat_schema_grammar({"type": "hiccup"})
    assert json_schema_to_grammar({"const": 1}) != chat_schema_grammar({"const": 1})


@pytest.mark.parametrize("text,want", [
    ('```json\n{"a": 1}\n```', '{"a": 1}'),            # fenced
    ('```json\n\n{\n  "a": [1, 2]\n}\n\n```', '{\n  "a": [1, 2]\n}'),
    ('\n  {"a": 1}\n', '{"a": 1}'),                      # bare, whitespace around
    ("1\n\n", "1"),
    ('"x"', '"x"'),
    ('```json\n{"a": "b', '{"a": "b'),                    # cut short: the JSON so far
    ('```json\n{"a": 1}\n``', '{"a": 1}'),                 # cut in the closing fence
    ("```", "```"), ("```json", "```json"), ("``", "``"),  # no JSON began: the text as it is
    ("", ""),
])
def test_content_is_the_json_llama_server_parses(text, want):
    assert content(text) == want
    # streamed a character at a time: the same content, never a fence
    s = FenceStream()
    deltas = [s.feed(ch) for ch in text] + [s.finish()]
    assert "".join(deltas) == want
    if want != text:
        assert not any("`" in d for d in deltas)


def test_a_chat_format_only_under_jinja_with_a_schema():
    rf = {"response_format": {"type": "json_schema", "json_schema": {"schema": {"const": 1}}}}
    fmt = chat_format(Body(rf), True)
    assert fmt is not None and fmt.key == "response_format.json_schema.schema"
    assert fmt.grammar() == chat_schema_grammar({"const": 1})
    assert chat_format(Body(rf), False) is None
    assert chat_format(Body({"messages": []}), True) is None
    assert chat_format(Body({"grammar": "root ::= [a]"}), True) is None
    assert chat_format(Body({"response_format": {"type": "json_object"}}), True).schema == {"type": "object"}
    assert chat_format(Body({"json_schema": {"type": "integer"}}), True).key == "json_schema"


# ---------------------------------------------------------------------------------------------------
# end to end: SmolLM2-135M, which opens a fence on every schema
# ---------------------------------------------------------------------------------------------------
USER = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give me a user with a name and an age."}]


@pytest.fixture(scope="module")
def engine():
    from helpers import real_model
    from llamaspec.engine import Engine

    with Engine(real_model("smollm2-135m-q4_1"), n_ctx=2048) as eng:
        yield eng


def _client(engine, **cfg):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from llamaspec.server.app import ServerConfig, ServerState, create_app

    return TestClient(create_app(ServerState(ServerConfig(model_id="smol", sse_ping_interval=0, **cfg),
                                             engine=engine)))


def _body(**kw):
    return {"messages": ASK, "max_tokens": 64, "temperature": 0, "verbose": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "user", "schema": USER}}, **kw}


@pytest.mark.real
def test_fenced_output_gives_the_json_whole_and_streamed(engine):
    c = _client(engine)
    r = c.post("/v1/chat/completions", json=_body()).json()
    raw, msg = r["__verbose"]["content"], r["choices"][0]["message"]["content"]
    assert raw.startswith("```json") and raw.rstrip().endswith("```"), raw  # what the model wrote
    assert json.loads(msg) == json.loads(raw.strip()[7:-3]) and msg == msg.strip(), msg
    assert r["__verbose"]["generation_settings"]["grammar"] == chat_schema_grammar(USER)
    s = c.post("/v1/chat/completions", json=_body(stream=True))
    chunks = [json.loads(line[6:]) for line in s.text.splitlines() if line.startswith("data: ") and "[DONE]" not in line]
    deltas = [ch["choices"][0]["delta"].get("content") for ch in chunks if ch["choices"]]
    assert "".join(d or "" for d in deltas) == msg and not any("`" in (d or "") for d in deltas)
    # the openai client's parse: the content validates against the pydantic model
    openai = pytest.importorskip("openai")
    pydantic = pytest.importorskip("pydantic")

    class User(pydantic.BaseModel):
        name: str
        age: int

    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=c, max_retries=0)
    parsed = oai.chat.completions.parse(model="smol", messages=ASK, response_format=User, max_tokens=64,
                                        temperature=0).choices[0].message.parsed
    assert isinstance(parsed, User) and parsed.name


@pytest.mark.real
def test_no_jinja_keeps_the_schemas_grammar_and_the_text(engine):
    c = _client(engine, chat_template="chatml", jinja=False)
    r = c.post("/v1/chat/completions", json=_body()).json()
    assert r["__verbose"]["generation_settings"]["grammar"] == json_schema_to_grammar(USER)
    assert r["choices"][0]["message"]["content"] == r["__verbose"]["content"]
