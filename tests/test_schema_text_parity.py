"""JSON-constrained text at temperature 0: the reference llama-server (native/bin, scripts/build_llama_cpp.sh) and
a real ``llamaspec serve`` on the same model and the same requests, ``json_schema`` on ``/completion`` and
``response_format`` ``json_schema`` on ``/v1/chat/completions``, for the schemas of llama.cpp's own server and
converter tests and those instructor / pydantic-ai / LangChain send (pydantic v2's ``model_json_schema``).

Near-tie-aware (issue 35): where the two texts differ, the first differing token is found in the tokens both
servers report (``n_probs`` / ``top_logprobs``), and the difference passes only when the two candidates were
within ``TOL`` of each other in *both* servers' log-probabilities at that position (the shared prefix: the
same context). Both servers report the probabilities before sampling (the raw softmax), so the gap of two
tokens the grammar allows is their logit gap. Anything else -- a candidate one server does not list, one
server ending where the other goes on, a gap over ``TOL`` -- is a divergence and fails.

Run (prints the counts per route)::

    nice -n 15 python -m pytest tests/test_schema_text_parity.py -m real -s
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from helpers import real_model
from support.server import LLAMA_SERVER, llama_server, running, serve

TOL = 0.02  # nats; the two builds' log-probabilities of one token at one position differ by ~1e-3 at most
N_PREDICT = 48
N_PROBS = 20

pytestmark = [pytest.mark.real,
              pytest.mark.skipif(not LLAMA_SERVER.exists(),
                                 reason="native llama-server not built (scripts/build_llama_cpp.sh); CI has none")]

# (name, what the prompt asks for, schema)
SCHEMAS = [
    # pydantic v2 models as the libraries send them
    ("user", "a user", {"properties": {"name": {"title": "Name", "type": "string"},
                                       "age": {"title": "Age", "type": "integer"}},
                        "required": ["name", "age"], "title": "User", "type": "object"}),
    ("defs ref + array", "a place and its tags",
     {"$defs": {"Place": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}},
      "properties": {"place": {"$ref": "#/$defs/Place"}, "tags": {"items": {"type": "string"}, "type": "array"}},
      "required": ["place"], "type": "object"}),
    ("enum + nullable number", "an answer and a score",
     {"properties": {"answer": {"enum": ["yes", "no"], "type": "string"},
                     "score": {"anyOf": [{"type": "number"}, {"type": "null"}], "default": None}},
      "required": ["answer"], "type": "object", "additionalProperties": False}),
    ("enum class in defs", "a colour",
     {"$defs": {"Color": {"enum": ["red", "green", "blue"], "title": "Color", "type": "string"}},
      "properties": {"color": {"$ref": "#/$defs/Color"}, "label": {"title": "Label", "type": "string"}},
      "required": ["color", "label"], "title": "Paint", "type": "object"}),
    ("list of models", "a shopping list",
     {"$defs": {"Item": {"properties": {"name": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                         "required": ["name", "qty"], "title": "Item", "type": "object"}},
      "properties": {"items": {"items": {"$ref": "#/$defs/Item"}, "title": "Items", "type": "array"}},
      "required": ["items"], "title": "Cart", "type": "object"}),
    ("optional str", "a person with an optional nickname",
     {"properties": {"name": {"type": "string"},
                     "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}},
      "required": ["name"], "type": "object"}),
    ("literal", "a pet",
     {"properties": {"kind": {"const": "cat", "type": "string"}, "name": {"type": "string"}},
      "required": ["kind", "name"], "type": "object"}),
    ("instructor tags maxItems", "a blog post",
     {"properties": {"title": {"type": "string"},
                     "tags": {"items": {"type": "string"}, "maxItems": 3, "type": "array"}},
      "required": ["title", "tags"], "title": "Post", "type": "object"}),
    ("nested objects", "a person with an address",
     {"type": "object", "properties": {"person": {"type": "object", "properties": {
         "name": {"type": "string"},
         "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
                     "required": ["street", "zip"]}}, "required": ["name", "address"]}},
      "required": ["person"]}),
    ("recursive tree", "a tree of numbers",
     {"$defs": {"Node": {"type": "object", "properties": {
         "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
         "required": ["value", "children"]}}, "$ref": "#/$defs/Node"}),
    # llama.cpp's server and converter tests
    ("const", "the answer", {"const": "42"}),
    ("integer array min/max items", "a few lottery numbers",
     {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}),
    ("bounded integers", "a time of day",
     {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                       "minute": {"type": "integer", "minimum": 0, "maximum": 59}},
      "required": ["hour", "minute"]}),
    ("integer across zero", "a temperature", {"type": "integer", "minimum": -10, "maximum": 10}),
    ("string pattern", "a flight code",
     {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
      "required": ["code"]}),
    ("pattern alternation", "a yes or no", {"type": "string", "pattern": "^(yes|no|maybe)$"}),
    ("formats", "an event",
     {"type": "object", "properties": {"date": {"type": "string", "format": "date"},
                                       "id": {"type": "string", "format": "uuid"},
                                       "at": {"type": "string", "format": "date-time"}},
      "required": ["date", "id", "at"]}),
    ("string length", "a nickname", {"type": "string", "minLength": 3, "maxLength": 8}),
    ("all optional", "some settings",
     {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                       "c": {"type": "boolean"}}}),
    ("required + optional + closed", "a product",
     {"type": "object", "properties": {"sku": {"type": "string"}, "price": {"type": "number"},
                                       "note": {"type": "string"}},
      "required": ["sku", "price"], "additionalProperties": False}),
    ("additional props typed", "word counts",
     {"type": "object", "additionalProperties": {"type": "integer"}}),
    ("boolean", "whether the sky is blue", {"type": "boolean"}),
    ("number", "the value of pi", {"type": "number"}),
    ("tuple", "a name and an age", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]}),
    ("string enum", "a traffic light colour", {"enum": ["red", "amber", "green"]}),
    ("non-string enum", "a value", {"enum": [1, "two", None, True]}),
    ("anyOf", "an identifier", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 6}]}),
    ("allOf", "a labelled point",
     {"allOf": [{"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                 "required": ["x", "y"]},
                {"type": "object", "properties": {"label": {"type": "string"}}, "required": ["label"]}]}),
    ("nested arrays", "a 2x2 matrix",
     {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
      "minItems": 2, "maxItems": 2}),
    ("unconstrained", "anything", {"description": "any JSON value"}),
]


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{path} on :{port}: {e.code} {e.read()[:500]!r}") from None


@pytest.fixture(scope="module")
def servers(request):
    """(native port, llamaspec port): both on SmolLM2-135M Q4_1, one slot, one thread each; ``request.param``
    "jinja" (both servers' default) or "no-jinja" (llama.cpp's built-in templates)."""
    model = str(real_model("smollm2-135m-q4_1"))
    common = ["-m", model, "-np", "1", "-c", "2048", "-t", "1", f"--{request.param}"]
    with running(llama_server(common), serve(common)) as srvs:
        yield tuple(s.port for s in srvs)


def classify(native: list[dict], ours: list[dict], tol: float = TOL) -> tuple[str, str]:
    """``identical``, ``near-tie`` or ``divergent`` for two greedy outputs given as their per-token entries
    (``{"id", "logprob", "top_logprobs": [{"id", "logprob"}, ...]}``), with what was found."""
    # the end-of-generation token that stopped one is an entry too (no bytes, no text): both servers list it
    a, b = [e["id"] for e in native], [e["id"] for e in ours]
    if a == b:
        return "identical", ""
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if k >= len(a) or k >= len(b):
        return "divergent", f"one output ends at token {k} where the other goes on ({len(a)} vs {len(b)} tokens)"
    ta, tb = a[k], b[k]

    def lp(entry: dict, tok: int) -> float | None:
        if entry["id"] == tok:
            return entry["logprob"]
        return next((t["logprob"] for t in entry["top_logprobs"] if t["id"] == tok), None)

    gaps = []
    for who, e in (("llama-server", native[k]), ("llamaspec", ours[k])):
        la, lb = lp(e, ta), lp(e, tb)
        if la is None or lb is None:
            return "divergent", (f"token {k}: {ta} vs {tb}; {who} does not list "
                                 f"{tb if lb is None else ta} in its top {N_PROBS}")
        gaps.append(abs(la - lb))
    what = f"token {k}: {ta} vs {tb}, log-prob gap {gaps[0]:.5f} (llama-server) / {gaps[1]:.5f} (llamaspec)"
    return ("near-tie" if max(gaps) <= tol else "divergent"), what


def test_classify_tells_a_near_tie_from_a_divergence():
    """The classifier itself: a swap of two tokens within TOL is a near-tie, over TOL or unlisted it is not."""
    def e(tok, lp, *top):
        return {"id": tok, "logprob": lp, "bytes": [tok], "top_logprobs": [{"id": t, "logprob": p} for t, p in top]}

    same = [e(1, -0.1, (1, -0.1))]
    assert classify(same, same) == ("identical", "")
    near_a = same + [e(5, -0.70, (5, -0.70), (6, -0.705))]
    near_b = same + [e(6, -0.704, (6, -0.704), (5, -0.701))]
    assert classify(near_a, near_b)[0] == "near-tie"
    far_b = same + [e(6, -0.70, (6, -0.70), (5, -0.9))]
    assert classify(near_a, far_b)[0] == "divergent"
    assert classify(near_a, same + [e(6, -0.70, (6, -0.70))])[0] == "divergent"  # 5 not listed
    assert classify(near_a, same)[0] == "divergent"  # one ends
    eog = {"id": 0, "logprob": -1.0, "bytes": [], "top_logprobs": []}
    assert classify(same + [eog], same + [eog]) == ("identical", "")
    assert classify(same + [eog], same)[0] == "divergent"  # the end-of-generation token is listed: one lacks it


def _report(route: str, results: list[tuple[str, str, str]]) -> None:
    counts = {k: sum(r[1] == k for r in results) for k in ("identical", "near-tie", "divergent")}
    print(f"\n{route}: {counts['identical']} identical, {counts['near-tie']} near-tie, "
          f"{counts['divergent']} divergent of {len(results)} schemas")
    for name, kind, what in results:
        if kind != "identical":
            print(f"  {kind}: {name}: {what}")
    bad = [r for r in results if r[1] == "divergent"]
    assert not bad, f"{route}: divergent from llama-server: {bad}"
    assert counts["identical"] + counts["near-tie"] >= 20


@pytest.mark.parametrize("servers", ["jinja"], indirect=True)
def test_completion_json_schema_text_equals_llama_servers(servers):
    """``json_schema`` on ``/completion``: the same grammar text, and the same text up to near-ties."""
    results = []
    for name, what, schema in SCHEMAS:
        body = {"prompt": f"Here is {what}, written as JSON:\n", "json_schema": schema, "n_predict": N_PREDICT,
                "temperature": 0, "seed": 42, "n_probs": N_PROBS, "cache_prompt": False}
        n, o = (_post(p, "/completion", body) for p in servers)
        assert o["generation_settings"]["grammar"] == n["generation_settings"]["grammar"], name
        kind, detail = classify(n["completion_probabilities"], o["completion_probabilities"])
        if kind == "identical":
            assert o["content"] == n["content"], name
            assert o["stop_type"] == n["stop_type"], name
        results.append((name, kind, detail or repr(n["content"][:60])))
    _report("/completion json_schema", results)


def _chat_grammar(native: str) -> str:
    """llama-server's Jinja chat grammar as llamaspec writes it: its root without the generation prompt it
    opens with (llama-server's sampler feeds it that prompt first), none of its unreachable ``json-*`` rules."""
    lines = [line for line in native.splitlines(keepends=True) if not line.startswith("json-")]
    return "".join(line.replace('root ::= "<|im_start|>assistant\\n" ', "root ::= ", 1) for line in lines)


def _sse(port: int, path: str, body: dict) -> list[dict]:
    """The events of ``body`` streamed from ``path``."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return [json.loads(line[6:]) for line in r.read().decode().splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def _stream_text(port: int, body: dict) -> str:
    return "".join(c["delta"].get("content") or "" for ev in _sse(port, "/v1/chat/completions", body)
                   for c in ev["choices"])


def _ids(entries: list[dict] | None) -> list[int]:
    return [e["id"] for e in entries or []]


@pytest.mark.parametrize("servers", ["jinja"], indirect=True)
def test_end_of_generation_token_listed_as_llama_servers(servers):
    """A greedy generation that ends on the end-of-generation token: llama-server lists that token last in
    ``tokens`` (``return_tokens``) and in the token probabilities (an entry with no text and no bytes; in a
    stream an event of its own, none in a chat stream) and counts it in ``tokens_predicted``; llamaspec the same,
    on /completion, /v1/completions and /v1/chat/completions, whole and streamed."""
    messages = [{"role": "user", "content": "Say hi"}]
    prompt = _post(servers[0], "/apply-template", {"messages": messages})["prompt"]
    body = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, "n_probs": 2, "return_tokens": True}
    n, o = (_post(p, "/completion", body) for p in servers)
    assert n["stop_type"] == o["stop_type"] == "eos" and n["content"] == o["content"]
    eog = n["tokens"][-1]
    assert o["tokens"] == n["tokens"] == _ids(n["completion_probabilities"]) == _ids(o["completion_probabilities"])
    assert {k: o["completion_probabilities"][-1][k] for k in ("token", "bytes")} == {"token": "", "bytes": []}
    assert o["tokens_predicted"] == n["tokens_predicted"] == len(n["tokens"])

    def shape(ev: dict) -> tuple:
        return ev["content"], ev["tokens"], _ids(ev.get("completion_probabilities")), ev["stop"], ev["tokens_predicted"]
    sn, so = ([shape(ev) for ev in _sse(p, "/completion", body)] for p in servers)
    assert so == sn and sn[-2] == ("", [eog], [eog], False, len(n["tokens"]))

    oai = {"prompt": prompt, "max_tokens": N_PREDICT, "temperature": 0, "logprobs": 2}
    n, o = (_post(p, "/v1/completions", oai)["choices"][0] for p in servers)
    assert _ids(o["logprobs"]["content"]) == _ids(n["logprobs"]["content"])
    assert _ids(n["logprobs"]["content"])[-1] == eog
    assert o["text"] == n["text"]
    sn, so = ([(c["text"], _ids((c["logprobs"] or {}).get("content")), c["finish_reason"])
               for ev in _sse(p, "/v1/completions", oai) for c in ev["choices"]] for p in servers)
    assert so == sn and sn[-2] == ("", [eog], None)

    chat = {"messages": messages, "max_tokens": N_PREDICT, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    n, o = (_post(p, "/v1/chat/completions", chat)["choices"][0] for p in servers)
    assert o["message"]["content"] == n["message"]["content"]
    assert _ids(o["logprobs"]["content"]) == _ids(n["logprobs"]["content"])
    assert _ids(n["logprobs"]["content"])[-1] == eog
    sn, so = ([(c["delta"], _ids((c.get("logprobs") or {}).get("content")), c["finish_reason"])
               for ev in _sse(p, "/v1/chat/completions", chat) for c in ev["choices"]] for p in servers)
    assert so == sn and eog not in sum((ids for _, ids, _ in sn), [])


@pytest.mark.parametrize("servers", ["no-jinja", "jinja"], indirect=True)
def test_chat_response_format_text_equals_llama_servers(servers, request):
    """``response_format`` ``json_schema`` on ``/v1/chat/completions``: the same message text up to near-ties.
    With --no-jinja llama-server's grammar is the schema's; with Jinja (the differential autoparser, chat format
    peg-native) it is ``root ::= space space ("```json" space SCHEMA space "```" | space SCHEMA space)`` and the
    fence is parsed out of the content: the same grammar rules here (``__verbose``), the same content, whole and
    streamed (SmolLM2 opens with a fence on every schema)."""
    jinja = request.node.callspec.params["servers"] == "jinja"
    results = []
    for k, (name, what, schema) in enumerate(SCHEMAS):
        body = {"messages": [{"role": "system", "content": "You reply with JSON."},
                             {"role": "user", "content": f"Give me {what}."}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}},
                "max_tokens": N_PREDICT, "temperature": 0, "seed": 42, "logprobs": True,
                "top_logprobs": N_PROBS, "verbose": True}
        answers = [_post(p, "/v1/chat/completions", body) for p in servers]
        grammars = [a["__verbose"]["generation_settings"]["grammar"] for a in answers]
        assert grammars[1] == (_chat_grammar(grammars[0]) if jinja else grammars[0]), name
        n, o = (a["choices"][0] for a in answers)
        kind, detail = classify(n["logprobs"]["content"], o["logprobs"]["content"])
        if kind == "identical":
            assert o["message"]["content"] == n["message"]["content"], name
            assert o["finish_reason"] == n["finish_reason"], name
            if k < 4:  # streamed: the same content deltas, joined
                assert _stream_text(servers[1], body) == _stream_text(servers[0], body) == n["message"]["content"]
        results.append((name, kind, detail or repr(n["message"]["content"][:60])))
    _report("/v1/chat/completions response_format", results)
