"""What constrains sampling in a request: ``grammar`` (GBNF) or a JSON schema (``json_schema``,
``response_format``), and ``logit_bias`` (token ids or text). Parsed from a request
:class:`~llamaspec.server.parsing.Body` (taken as it is: parsing imports this module); a value llamaspec
cannot follow is a 400 that names the field, and so is a grammar with more alternatives open at once than
``--max-grammar-alternatives`` (:func:`check_alternatives`).

>>> from llamaspec.server.parsing import Body
>>> print(parse_grammar(Body({"response_format": {"type": "json_object", "schema": {"const": 4}}})).splitlines()[0])
root ::= "4"
>>> parse_logit_bias(Body({"logit_bias": {"5": -1, "hi": False}}), lambda text: [7, 8])
((5, -1.0), (7, -inf), (8, -inf))
"""
from __future__ import annotations

from typing import Any, Callable

from .. import _llama as llama
from .._llama.grammar_limits import alternatives_message, alternatives_over
from .errors import invalid, show
from .limits import over

__all__ = ["JSON_GRAMMAR", "parse_grammar", "request_schema", "schema_grammar", "parse_logit_bias", "check_alternatives"]

I32_MAX = (1 << 31) - 1

#: llama.cpp's ``grammars/json.gbnf`` (MIT): any JSON object (``response_format: {"type": "json_object"}`` is
#: the grammar of the schema ``{"type": "object"}`` instead, as llama-server builds it)
JSON_GRAMMAR = r'''root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
'''


def _schema_grammar(key: str, schema: Any, to_grammar: Callable[[Any], str]) -> str:
    """The GBNF grammar of a JSON schema (llama-server: an empty schema means any object); 400 when it is not one."""
    if isinstance(schema, dict) and not schema:
        schema = {"type": "object"}
    try:
        return to_grammar(schema)
    except ValueError as e:
        raise invalid(f"Field '{key}': not a JSON schema llamaspec can follow: {e}. Give a JSON schema object "
                      "(https://json-schema.org), response_format {\"type\": \"json_object\"} or a GBNF 'grammar'") from None


def check_alternatives(key: str, grammar: str | None, limit: int) -> None:
    """400 naming field ``key`` when ``grammar`` has more alternatives open at once than ``limit``
    (``--max-grammar-alternatives``; 0: no limit): llama.cpp would check each against the whole vocabulary on
    every token, while every slot waits."""
    n = alternatives_over(grammar or "", limit)
    if n:
        raise over(alternatives_message(n), limit, "max_grammar_alternatives", field=key)


def request_schema(b: Any) -> tuple[str, Any, str | None]:
    """``(field, schema, grammar)`` of a request: its JSON schema (None: none) and the field it came from (the
    top-level ``json_schema``, ``response_format`` ``{"type": "json_schema", "json_schema": {"schema": ...}}`` or
    ``{"type": "json_object", "schema": ...}``; ``{"type": "json_object"}`` alone: any JSON object, the schema
    ``{"type": "object"}`` as llama-server has it, unless a schema or a grammar is given), and its GBNF
    ``grammar``; 400 for an unknown ``response_format``.

    >>> from llamaspec.server.parsing import Body
    >>> request_schema(Body({"response_format": {"type": "json_object"}}))
    ('response_format', {'type': 'object'}, None)
    """
    grammar = b.str("grammar")
    schema_key, schema = b.get("json_schema")
    rf = b.obj("response_format")
    if rf is not None:
        t = rf.get("type")
        if t in (None, "text"):
            pass
        elif t == "json_object" and rf.get("schema") is None:
            if schema is None and not grammar:  # llama-server: the grammar of the schema {"type": "object"}
                schema_key, schema = "response_format", {"type": "object"}
        elif t == "json_object":
            schema_key, schema = "response_format.schema", rf["schema"]
        elif t == "json_schema":
            wrapper = rf.get("json_schema")
            if wrapper is not None and not isinstance(wrapper, dict):
                raise invalid(f"Field 'response_format.json_schema': expected an object {{\"schema\": ...}}, "
                              f"got {show(wrapper)}")
            inner = (wrapper or {}).get("schema")
            schema_key, schema = "response_format.json_schema.schema", {} if inner is None else inner
        else:
            raise invalid(f"Field 'response_format': unknown type {show(t)} (valid: text, json_object, json_schema)")
    if schema is not None and grammar:
        raise invalid(f"Fields '{schema_key}' and 'grammar': give a JSON schema or a GBNF grammar, not both")
    return schema_key, schema, grammar


def schema_grammar(key: str, schema: Any, max_alternatives: int = 0,
                   to_grammar: Callable[[Any], str] | None = None) -> str:
    """The grammar of JSON schema ``schema`` of field ``key`` (``to_grammar``: the converter, llama-server's
    by default; an empty schema means any object), checked against ``max_alternatives``; 400 naming ``key``."""
    grammar = _schema_grammar(key, schema, to_grammar or llama.json_schema_to_grammar)
    check_alternatives(key, grammar, max_alternatives)
    return grammar


def parse_grammar(b: Any, max_alternatives: int = 0) -> str | None:
    """``grammar`` (GBNF), or the grammar of the request's JSON schema (:func:`request_schema`); either checked
    against ``max_alternatives`` (:func:`check_alternatives`)."""
    schema_key, schema, grammar = request_schema(b)
    if schema is not None:
        return schema_grammar(schema_key, schema, max_alternatives)
    check_alternatives("grammar", grammar, max_alternatives)
    return grammar


def parse_logit_bias(b: Any, tokenize: Callable[[str], list] | None = None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as OpenAI sends it (``{"token id": bias}``) or as llama-server also takes it
    (``[[token id, bias], ...]``); a key may also be text (``"hello"`` or ``[" hello", -5]``): the bias applies
    to each of its tokens (``tokenize``, without BOS, as llama-server). A bias of ``false`` means never this
    token (``-inf``). Token ids must be in the vocabulary (checked when the sampler is built)."""
    key, v = b.get("logit_bias")
    if v is None:
        return ()
    if isinstance(v, dict):
        items = list(v.items())
    elif isinstance(v, list) and all(isinstance(x, list) and len(x) == 2 for x in v):
        items = [(x[0], x[1]) for x in v]
    else:
        raise invalid(f"Field '{key}': expected an object {{\"token id or text\": bias}} or a list of "
                      f"[token id or text, bias] pairs, got {show(v)}")
    out = []
    for tok, bias in items:
        t = tok
        if isinstance(t, str) and t.strip().lstrip("-").isdigit():
            t = int(t)
        if isinstance(t, str):
            if tokenize is None:  # pragma: no cover - every route passes its tokenizer
                raise invalid(f"Field '{key}': give token ids (use /tokenize for text), got {show(tok)}")
            ids = list(tokenize(t))
        elif isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= I32_MAX:
            raise invalid(f"Field '{key}': keys must be token ids (integers >= 0) or text, got {show(tok)}")
        else:
            ids = [t]
        if bias is False:
            bias = float("-inf")
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or bias != bias or bias == float("inf"):
            raise invalid(f"Field '{key}': the bias of {show(tok)} must be a number (or false: never), got {show(bias)}")
        out.extend((i, float(bias)) for i in ids)
    return tuple(out)
