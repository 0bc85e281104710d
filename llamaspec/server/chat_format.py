"""A JSON schema on the Jinja chat path (``--jinja``: ``/v1/chat/completions``, ``/v1/responses``), as
llama-server serves it: its differential autoparser (common/chat-auto-parser-generator.cpp, a template without
reasoning) lets the model write the JSON alone or in a Markdown ``json`` fence, whitespace around either
(:func:`llamaspec._llama.chat_schema_grammar`), and the message's content is the JSON, the fence and the
whitespace parsed away (:func:`content`; streamed, :class:`FenceStream`). Without ``--jinja`` (llama.cpp's
built-in templates) the grammar is the schema's and the content the text, as there.

>>> content('```json\\n{"a": 1}\\n```'), content(' [1, 2]\\n'), content('```json\\n{"a": '), content('``')
('{"a": 1}', '[1, 2]', '{"a": ', '``')
>>> s = FenceStream()
>>> [s.feed(t) for t in ("``", "`json", "\\n{", '"a"', ": 1}", "\\n```")] + [s.finish()]
['', '', '{', '"a"', ': 1}', '', '']
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from .. import _llama as llama
from .constraints import check_alternatives, request_schema, schema_grammar
from .errors import invalid

if TYPE_CHECKING:  # pragma: no cover
    from .tools import ToolSpec

__all__ = ["ChatFormat", "FenceStream", "chat_format", "constrained_grammar", "content"]

FENCE = "```json"
_WS = " \t\n\v\f\r"  # C's isspace: the autoparser's space()
_DECODER = json.JSONDecoder()


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _parsed(text: str) -> str:
    """The JSON the autoparser reads from ``text`` as far as it goes ("" while there is none yet): after
    whitespace and an optional fence, one JSON value (all of what follows while it is incomplete)."""
    i = _skip(text, 0)
    rest = text[i:]
    if rest.startswith(FENCE):
        i = _skip(text, i + len(FENCE))
    elif FENCE.startswith(rest):  # nothing, or the fence is still being written
        return ""
    try:
        _, end = _DECODER.raw_decode(text, i)
    except ValueError:  # cut short (max_tokens, a stop word): the JSON so far
        return text[i:]
    return text[i:end]


def content(text: str) -> str:
    """The message content of a whole output: the JSON, or the text as it is where no JSON began (llama-server
    answers the raw text when its parse found nothing)."""
    return _parsed(text) or text


class FenceStream:
    """The content deltas of an output fed as it comes (llama-server streams the diffs of its parse): the fence
    and the whitespace around the JSON never appear, :meth:`finish` gives the rest (the raw text when no JSON
    began, as :func:`content`)."""

    def __init__(self) -> None:
        self.buf, self.sent = "", ""

    def _delta(self, now: str) -> str:
        if not now.startswith(self.sent):
            return ""
        out, self.sent = now[len(self.sent):], now
        return out

    def feed(self, text: str) -> str:
        self.buf += text
        return self._delta(_parsed(self.buf))

    def finish(self) -> str:
        return self._delta(content(self.buf)) if self.buf else ""


class ChatFormat:
    """A chat request's JSON schema under a Jinja template: the grammar (:meth:`grammar`, built in the worker
    that parses the request) and how its output reads (:func:`content`, :class:`FenceStream`)."""

    def __init__(self, key: str, schema: Any):
        self.key, self.schema = key, schema

    def grammar(self, max_alternatives: int = 0) -> str:
        return schema_grammar(self.key, self.schema, max_alternatives, llama.chat_schema_grammar)

    content = staticmethod(content)


def chat_format(b: Any, jinja: bool) -> ChatFormat | None:
    """The :class:`ChatFormat` of chat request ``b`` (a :class:`~llamaspec.server.parsing.Body`): None without a
    JSON schema or without a Jinja template (``jinja``; the schema's own grammar then, as llama-server's legacy
    path)."""
    if not jinja:
        return None
    key, schema, _ = request_schema(b)
    return ChatFormat(key, schema) if schema is not None else None


def constrained_grammar(grammar: str | None, tools: "ToolSpec | None", fmt: ChatFormat | None,
                        max_alternatives: int = 0) -> str | None:
    """The grammar of a chat request once its fields are parsed (``grammar``: the one they gave): a forced
    tool call's (``tool_choice`` required or a named function; 400 when a grammar or schema is given too), else
    the Jinja chat grammar of its JSON schema (``fmt``); None to keep the one given."""
    if tools is not None and tools.forced:
        if grammar:
            raise invalid("Field 'tool_choice': a required or named tool call constrains the output itself: "
                          "give no 'grammar', 'json_schema' or 'response_format' with it")
        out = tools.grammar(llama.json_schema_to_grammar)
        check_alternatives("tools", out, max_alternatives)
        return out
    if fmt is not None:
        return fmt.grammar(max_alternatives)
    return None
