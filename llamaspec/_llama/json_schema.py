"""JSON schema -> GBNF grammar: llama-server's (:mod:`.schema_grammar`, the rules of the pinned llama.cpp's
``json-schema-to-grammar``; the Python drop-in keeps llama-cpp-python's own, :mod:`.compat`). Remote ``$ref``
fetching stays off: a schema can only refer to itself.

>>> print(json_schema_to_grammar({"const": "42"}).splitlines()[0])
root ::= "\\"42\\""
>>> json_schema_to_grammar({"type": "hiccup"})
Traceback (most recent call last):
...
ValueError: JSON schema error at #: unrecognized type hiccup
"""
from __future__ import annotations

from typing import Any

from .grammar_limits import check_schema
from .schema_grammar import _Converter, json_schema_grammar, read_schema

__all__ = ["json_schema_to_grammar", "chat_schema_grammar"]

#: the root of llama-server's Jinja chat grammar for a ``response_format`` / ``json_schema`` (the differential
#: autoparser of common/chat-auto-parser-generator.cpp, a template without reasoning): the JSON, or the JSON
#: in a Markdown ``json`` fence, whitespace around either
CHAT_ROOT = 'space space ("```json" space response-format space "```" | space response-format space)'


def chat_schema_grammar(schema: Any) -> str:
    """The grammar llama-server's Jinja chat path builds for JSON schema ``schema``: its rules named under
    ``response-format-schema``, then ``response-format`` and the :data:`CHAT_ROOT` that allows a fence.
    llama-server's root starts with the generation prompt (``"<|im_start|>assistant\n" space ...``), which
    its sampler feeds the grammar before the first token; this one starts where generation does. (Its other
    difference: none of llama-server's unreachable ``json-*`` rules.) ValueError as :func:`json_schema_to_grammar`.

    >>> print(chat_schema_grammar({"const": 1}), end="")
    response-format ::= response-format-schema
    response-format-schema ::= "1"
    root ::= space space ("```json" space response-format space "```" | space response-format space)
    space ::= | " " | "\\n"{1,2} [ \\t]{0,20}
    """
    def build(s: Any) -> str:
        conv = _Converter()
        conv.add_rule("response-format", conv.visit(read_schema(s), "response-format-schema"))
        conv.add_rule("root", CHAT_ROOT)
        return conv.grammar()

    return _checked(schema, build)


def _checked(schema: Any, build) -> str:
    """``build(schema)`` (llama-server's converter) after the checks, its errors as ValueError."""
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
    check_schema(schema)  # the converter writes every repetition out: a huge count would cost the process
    try:
        return build(schema)
    except ValueError as e:  # llama-server's message
        raise ValueError(str(e)) from None
    except RecursionError:
        raise ValueError("the schema nests (or refers to itself) too deeply") from None


def json_schema_to_grammar(schema: Any) -> str:
    """The GBNF grammar llama-server builds for ``schema`` (a JSON object); :class:`ValueError` saying what is
    wrong with it."""
    return _checked(schema, json_schema_grammar)
