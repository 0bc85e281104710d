"""Issue 35's fixes, without the libraries (tiny models, fast): the JSON-schema grammars llama-server builds,
LangChain's constructor arguments on ``llamaspec.Llama``, ``tokenizer()`` / ``tokenizer_`` for outlines, and
``tools`` on a model without a chat template under ``--jinja`` (chatml as a Jinja template)."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from llamaspec._llama import compat, json_schema_to_grammar
from llamaspec._llama.lcp import load_llama
from llamaspec.compat import Llama

KW = dict(n_ctx=256, verbose=False, n_threads=1)
CASES = json.loads((Path(__file__).parent / "data" / "llama_server_schema_grammars.json").read_text())["cases"]


# -- grammars: llama-server's ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_schema_grammar_is_llama_servers(case):
    """The grammar text of each schema of llama.cpp's own converter tests (tests/data: the pinned tree's
    expectations) is the one llama-server builds."""
    assert json_schema_to_grammar(case["schema"]) == case["grammar"]


LIBRARY_SCHEMAS = [  # as instructor / pydantic-ai / LangChain send them (pydantic v2's model_json_schema)
    {"properties": {"name": {"title": "Name", "type": "string"}, "age": {"title": "Age", "type": "integer"}},
     "required": ["name", "age"], "title": "User", "type": "object"},
    {"$defs": {"Place": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}},
     "properties": {"place": {"$ref": "#/$defs/Place"}, "tags": {"items": {"type": "string"}, "type": "array"}},
     "required": ["place"], "type": "object"},
    {"properties": {"answer": {"enum": ["yes", "no"], "type": "string"},
                    "score": {"anyOf": [{"type": "number"}, {"type": "null"}], "default": None}},
     "required": ["answer"], "type": "object", "additionalProperties": False},
]


@pytest.mark.parametrize("schema", LIBRARY_SCHEMAS)
def test_library_schemas_allow_llama_servers_whitespace(schema):
    """The first divergence from llama-cpp-python's converter: after ``{`` llama-server allows whitespace."""
    g = json_schema_to_grammar(schema)
    root = next(line for line in g.splitlines() if line.startswith("root ::= "))
    assert root.startswith('root ::= "{" space ') and root.endswith(' space "}"'), root
    assert 'space ::= | " " | "\\n"{1,2} [ \\t]{0,20}' in g.splitlines()
    assert compat.json_schema_grammar(json.dumps(schema)) != g  # llama-cpp-python's converter


def test_json_object_is_the_schema_type_object():
    from llamaspec.server.constraints import parse_grammar
    from llamaspec.server.parsing import Body

    assert parse_grammar(Body({"response_format": {"type": "json_object"}})) == \
        json_schema_to_grammar({"type": "object"})


# -- LangChain's constructor arguments ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model):
    return str(tiny_model("llama"))


def _greedy(llm) -> str:
    return llm("tok_1 tok_2 tok_3", max_tokens=12, temperature=0)["choices"][0]["text"]


def test_n_parts_and_f16_kv_are_accepted_silently(tiny):
    """LangChain's LlamaCpp / ChatLlamaCpp always pass them; llama_cpp.Llama swallows them."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Llama(tiny, n_parts=-1, f16_kv=True, seed=-1, use_mlock=False, lora_base=None, lora_path=None,
              rope_freq_base=0.0, rope_freq_scale=0.0, **KW).close()
        Llama(tiny, n_parts=4, f16_kv=False, **KW).close()


def test_rope_freq_base_is_honoured_as_llama_cpp_does(tiny):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Llama(tiny, **KW) as llm:
            plain = _greedy(llm)
        with Llama(tiny, rope_freq_base=10.0, rope_freq_scale=0.25, **KW) as llm:
            ours = _greedy(llm)
    ref = load_llama(tiny, rope_freq_base=10.0, rope_freq_scale=0.25, **KW)
    try:
        assert ours == _greedy(ref)
    finally:
        ref.close()
    assert ours != plain  # the values reached the context


# -- tokenizer() / tokenizer_ ------------------------------------------------------------------------------
def test_tokenizer_is_llama_cpp_pythons(tiny):
    from llama_cpp.llama_tokenizer import BaseLlamaTokenizer

    ref = load_llama(tiny, vocab_only=True, verbose=False)
    llm = Llama(tiny, vocab_only=True, verbose=False)
    try:
        for tok in (llm.tokenizer(), llm.tokenizer_):
            assert isinstance(tok, BaseLlamaTokenizer)
            for s in ("tok_1 tok_2", "hello world", ""):
                assert tok.encode(s) == ref.tokenizer().encode(s)
                assert tok.tokenize(s.encode()) == ref.tokenizer_.tokenize(s.encode())
                ids = ref.tokenize(s.encode())
                assert tok.decode(ids) == ref.tokenizer().decode(ids)
                assert tok.detokenize(ids, special=True) == ref.tokenizer_.detokenize(ids, special=True)
    finally:
        llm.close()
        ref.close()


# -- tools without a chat template --------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}


def _tool_client(engine, **cfg):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from llamaspec.server.app import ServerConfig, ServerState, create_app

    state = ServerState(ServerConfig(model_id="m", **cfg), engine=engine)
    return state, TestClient(create_app(state))


def _ask(c, choice, max_tokens=48):
    return c.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "What is the weather in Rome?"}], "tools": [WEATHER],
        "tool_choice": choice, "max_tokens": max_tokens, "temperature": 0})


def test_tools_on_a_model_without_a_template_under_jinja(tiny_models):
    """llama-server renders chatml as a Jinja template there: ``tools`` are accepted (a 400 before)."""
    from llamaspec.engine import Engine
    from llamaspec.server.state import CHATML_JINJA

    with Engine(tiny_models["llama"], n_ctx=256) as eng:
        assert eng.model.chat_template() is None
        state, client = _tool_client(eng)
        assert state.chat_template == CHATML_JINJA
        with client as c:
            for choice in ("auto", "required"):
                r = _ask(c, choice, max_tokens=4)
                assert r.status_code == 200, r.text
            # the prompt is chatml's, as the built-in chatml writes it
            p = c.post("/apply-template", json={"messages": [{"role": "user", "content": "hi"}]})
            assert p.json()["prompt"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with Engine(tiny_models["llama"], n_ctx=256) as eng:
        state, client = _tool_client(eng, jinja=False)
        with client as c:  # --no-jinja: llama-server's 400
            assert _ask(c, "required", max_tokens=4).status_code == 400


@pytest.mark.real
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_through_the_chatml_fallback(choice):
    """``--chat-template chatml`` (what a model without a template gets) on SmolLM2: the call is the grammar's."""
    from helpers import real_model
    from llamaspec.engine import Engine

    with Engine(real_model("smollm2-135m-q4_1"), n_ctx=512) as eng:
        _, client = _tool_client(eng, chat_template="chatml")
        with client as c:
            r = _ask(c, choice)
            assert r.status_code == 200, r.text
            calls = r.json()["choices"][0]["message"].get("tool_calls")
            assert calls and calls[0]["function"]["name"] == "get_weather", r.json()
            assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Rome")
