"""Issue 21: a grammar with a huge alternation (a JSON-schema ``enum`` of 20,000 values) cost seconds per token
on a 49k vocabulary, while every slot waited. Now the alternatives a grammar has open at once are counted
(``llamaspec._llama.grammar_cost``) and a grammar over ``--max-grammar-alternatives`` is refused at once: a
400 naming the field, the value, the limit and the flag (``grammar``, ``json_schema``, ``response_format``, a
forced tool call), a :class:`UsageError` from the Python API and ``llamaspec generate``. docs/limits.md has the
measured costs.
"""
from __future__ import annotations

import json
import re
import time

import pytest

from llamaspec._llama.grammar_cost import open_alternatives
from llamaspec._llama.grammar_limits import MAX_ALTERNATIVES

ENUM_20K = {"enum": [f"value-{i}" for i in range(20000)]}
GBNF_20K = "root ::= " + " | ".join(f'"w{i}"' for i in range(20000))


def _alts(n: int, fmt: str = "w{}") -> str:
    return " | ".join(f'"{fmt.format(i)}"' for i in range(n))


# ---------------------------------------------------------------------------------------------------
# the figure: what llama.cpp's stacks grow with (docs/limits.md has the measured cost of each shape)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("grammar,n", [
    ('root ::= "hello"', 1),
    ("root ::= " + _alts(300), 300),
    # nested groups open all their alternatives together; a sequence opens one group after the other
    ("root ::= " + " | ".join(f"({_alts(8, str(i) + 'x{}')})" for i in range(8)), 64),
    ("root ::= r0 r1 r2\n" + "\n".join(f"r{i} ::= {_alts(40)}" for i in range(3)), 40),
    # elements that may be empty open what follows them too
    ('root ::= ("a" | "b")? [0-9]* ("c" | "d" | "e")', 6),
    # alternatives that go on after a reference keep their own stacks: doubling at each level...
    ("root ::= a0\n" + "\n".join(f'a{i} ::= a{i + 1} "z" | a{i + 1} "w"' for i in range(10)) + '\na10 ::= "x" | "y"',
     2048),
    # ... but a reference that ends its alternatives returns nowhere: llama.cpp opens its stacks once
    ("root ::= a0\n" + "\n".join(f"a{i} ::= a{i + 1} | a{i + 1}" for i in range(10)) + '\na10 ::= "x" | "y"', 2),
    ('# a comment | "x" | "y"\nroot ::= "a|b" | [|] "|"  # "z" | "w"', 2),
])
def test_open_alternatives(grammar, n):
    assert open_alternatives(grammar) == n


def test_json_schemas_count_their_enums_and_nothing_much_else():
    from llamaspec._llama import json_schema_to_grammar
    from llamaspec.server.constraints import JSON_GRAMMAR

    assert open_alternatives(json_schema_to_grammar(ENUM_20K)) == 20000
    assert open_alternatives(JSON_GRAMMAR) < 16
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}}}
    assert open_alternatives(json_schema_to_grammar(person)) < 12  # llama-server's whitespace: 3 ways at each space


def test_deep_and_long_grammars_are_read_without_recursion():
    chain = "\n".join(f'r{i} ::= r{i + 1} "x"' for i in range(20000)) + '\nr20000 ::= "y"'
    assert open_alternatives(chain) == 1
    assert open_alternatives("root ::= " + "(" * 2500 + _alts(3) + ")" * 2500) == 3


def test_the_defaults_agree():
    from llamaspec.cli.generate import generate
    from llamaspec.cli.limit_options import DEFAULTS
    from llamaspec._llama import SamplingParams
    from llamaspec.server.limits import Limits

    opt = next(p for p in generate.params if p.name == "max_grammar_alternatives")
    assert MAX_ALTERNATIVES == SamplingParams().max_grammar_alternatives == Limits().max_grammar_alternatives \
        == DEFAULTS["max_grammar_alternatives"] == opt.default


# ---------------------------------------------------------------------------------------------------
# the Python API and `llamaspec generate`: a UsageError before llama.cpp builds the grammar
# ---------------------------------------------------------------------------------------------------
def test_the_sampler_refuses_before_llama_cpp_parses(tiny_model):
    from llamaspec import _llama as llama
    from llamaspec.errors import UsageError
    from llamaspec.sampler import TargetSampler

    with llama.Model(tiny_model("llama"), vocab_only=True) as m:
        t0 = time.monotonic()
        with pytest.raises(UsageError) as e:
            TargetSampler(m.vocab, llama.SamplingParams(grammar=GBNF_20K))
        assert time.monotonic() - t0 < 5  # llama.cpp alone takes seconds to set this grammar up
        for words in ("20000 alternatives", str(MAX_ALTERNATIVES), "max_grammar_alternatives",
                      "--max-grammar-alternatives"):
            assert words in str(e.value)
        small = "root ::= " + _alts(MAX_ALTERNATIVES + 1, "{:x}")
        with pytest.raises(UsageError):
            TargetSampler(m.vocab, llama.SamplingParams(grammar=small))
        TargetSampler(m.vocab, llama.SamplingParams(grammar=small, max_grammar_alternatives=0))  # 0: no limit
        TargetSampler(m.vocab, llama.SamplingParams(grammar="root ::= " + _alts(MAX_ALTERNATIVES, "{:x}")))


def test_generate_refuses_before_loading_and_the_flag_lifts_it(tiny_model, tmp_path):
    from click.testing import CliRunner

    from llamaspec.cli.main import main

    g = tmp_path / "many.gbnf"
    words = [f"{i:x}" for i in range(MAX_ALTERNATIVES + 88)]  # the tiny vocabulary's pieces are hex digits
    g.write_text("root ::= " + " | ".join(f'"{w}"' for w in words) + "\n")
    r = CliRunner().invoke(main, ["generate", "x", "-m", "/no/such.gguf", "--grammar-file", str(g)])
    assert r.exit_code == 2, r.output
    assert f"{len(words)} alternatives" in r.stderr and "--max-grammar-alternatives" in r.stderr and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["generate", "x", "-m", str(tiny_model("llama")), "--grammar-file", str(g),
                                  "--max-grammar-alternatives", str(len(words)), "-n", "4", "--temp", "0", "--spec-type", "none",
                                  "-q"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() in words


# ---------------------------------------------------------------------------------------------------
# the server, in process: every field a grammar comes from
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def app(tiny_model):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from llamaspec.engine import Engine
    from llamaspec.server.app import ServerConfig, ServerState, create_app

    eng = Engine(tiny_model("llama"), n_ctx=256, n_parallel=1, n_batch=32, n_threads=1)
    state = ServerState(ServerConfig(chat_template="chatml"), engine=eng)
    with TestClient(create_app(state), raise_server_exceptions=False) as client:
        yield client, state


TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"v": ENUM_20K}, "required": ["v"]}}}
HUGE = [("/completion", {"prompt": [1, 2], "json_schema": ENUM_20K}, "json_schema"),
        ("/completion", {"prompt": [1, 2], "grammar": GBNF_20K}, "grammar"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "v", "schema": ENUM_20K}}},
         "response_format.json_schema.schema"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_object", "schema": ENUM_20K}}, "response_format.schema"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL],
                                  "tool_choice": "required"}, "tools"),
        ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "v", "schema": ENUM_20K}}},
         "response_format.json_schema.schema")]


@pytest.mark.parametrize("route,body,field", HUGE, ids=[f"{r} {f}" for r, _, f in HUGE])
def test_a_20000_value_enum_is_a_400_at_once(app, route, body, field):
    client, state = app
    t0 = time.monotonic()
    r = client.post(route, content=json.dumps({**body, "max_tokens": 2}))
    assert time.monotonic() - t0 < 5  # before: llama.cpp set the grammar up for seconds, then seconds a token
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    msg = err["message"]
    for words in (f"Field '{field}'", f"limit of {MAX_ALTERNATIVES}", "--max-grammar-alternatives"):
        assert words in msg, msg
    n = re.search(r"can follow (\d+) alternatives at once", msg)
    assert n and 20000 <= int(n.group(1)) <= 20002, msg  # the enum's, and an optional space before it
    assert not state.engine.scheduler.has_work()


def test_normal_schemas_and_grammars_still_work(app):
    client, _ = app
    r = client.post("/completion", json={"prompt": [1, 2], "json_schema": {"enum": [1, 2, 3]}, "n_predict": 4})
    assert r.status_code == 200 and r.json()["content"] in ("1", "2", "3"), r.text
    words = [f"{i:x}" for i in range(MAX_ALTERNATIVES)]  # at the limit
    r = client.post("/completion", json={"prompt": [1, 2], "grammar": "root ::= " + " | ".join(f'"{w}"' for w in words),
                                         "n_predict": 4})
    assert r.status_code == 200 and r.json()["content"] in words, r.text


@pytest.mark.parametrize("limit", [0, MAX_ALTERNATIVES + 100])
def test_the_limit_is_the_servers(app, monkeypatch, limit):
    from llamaspec.server.limits import Limits

    client, state = app
    words = [f"{i:x}" for i in range(MAX_ALTERNATIVES + 88)]
    body = {"prompt": [1, 2], "grammar": "root ::= " + " | ".join(f'"{w}"' for w in words), "n_predict": 4}
    assert client.post("/completion", json=body).status_code == 400
    monkeypatch.setattr(state.config, "limits", Limits(max_grammar_alternatives=limit))  # --max-grammar-alternatives
    r = client.post("/completion", json=body)
    assert r.status_code == 200 and r.json()["content"] in words, r.text


def test_the_flag_reaches_the_limits():
    import click
    from click.testing import CliRunner

    from llamaspec.cli.limit_options import limit_options, pop_limit_options

    seen = []

    @click.command()
    @limit_options()
    def cmd(**kw):
        seen.append(pop_limit_options(kw))

    assert CliRunner().invoke(cmd, ["--max-grammar-alternatives", "0"]).exit_code == 0
    assert CliRunner().invoke(cmd, []).exit_code == 0
    assert [x.max_grammar_alternatives for x in seen] == [0, MAX_ALTERNATIVES]
    r = CliRunner().invoke(cmd, ["--max-grammar-alternatives", "-1"])
    assert r.exit_code == 2 and "--max-grammar-alternatives" in r.output


def test_inverted_and_huge_repetitions_are_refused_before_llama_cpp_sees_them():
    """A repetition ``{m,n}`` with ``m > n`` (what a schema bound past 64 bits converted to) or a count over
    MAX_REPEAT makes llama.cpp expand rules without end before the first token: refused up front, in
    milliseconds, with what was wrong."""
    import time

    from llamaspec._llama.grammar_limits import MAX_REPEAT, check_gbnf
    from llamaspec._llama.json_schema import json_schema_to_grammar

    t0 = time.perf_counter()
    for g, msg in (('root ::= [0-9]{19,15}', "minimum is above the maximum"),
                   ('root ::= "a"{0,100000}', f"over the limit of {MAX_REPEAT}"),
                   (json_schema_to_grammar({"type": "integer", "minimum": 10 ** 300}), "minimum is above the maximum")):
        with pytest.raises(ValueError, match=msg):
            check_gbnf(g)
    check_gbnf('root ::= "{1,0}" [{] x{2,3}\nx ::= "a"')  # counts inside literals and classes are text
    assert time.perf_counter() - t0 < 5.0
