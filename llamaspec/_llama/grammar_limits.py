"""Bounds on what a grammar or a JSON schema may cost before llama.cpp (or the schema converter) sees it.

* llama.cpp parses a GBNF grammar's groups ``( ... )`` recursively: some 18,000 nested groups overflow an
  8 MB thread stack and kill the process (a 40 kB request body). :func:`check_gbnf` refuses more than
  :data:`MAX_GROUP_DEPTH` nested groups (string literals, character classes and comments do not count).
* llama-cpp-python's JSON-schema converter writes every repetition out: ``minItems: 1000000000`` builds a
  string of a billion items (the process is killed for memory), ``minLength: 100000000`` takes 20 s and half
  a gigabyte, and ``maxLength: n`` nests ``n`` groups. :func:`check_schema` refuses a ``minItems`` /
  ``maxItems`` / ``minLength`` / ``maxLength`` or a regex ``{m,n}`` count over :data:`MAX_REPEAT`, and a
  schema whose counts together (a pattern's nested ones multiplied) pass :data:`MAX_EXPANSION`. llama.cpp's
  own GBNF parser refuses repetitions over 2000 in the same spirit.

>>> check_gbnf('root ::= ("a" ("(" | [(]))*  # (((')
>>> check_gbnf("root ::= " + "(" * 3000 + '"a"' + ")" * 3000)
Traceback (most recent call last):
...
ValueError: the grammar nests 3000 groups deep, over the limit of 2500
>>> check_schema({"type": "array", "items": {"type": "string", "maxLength": 64}, "maxItems": 8})
>>> check_schema({"type": "array", "minItems": 10 ** 9})
Traceback (most recent call last):
...
ValueError: minItems = 1000000000 is over the limit of 2000 repetitions
>>> check_schema({"type": "string", "pattern": "^(a{400}){400}$"})
Traceback (most recent call last):
...
ValueError: the schema's repetitions expand to 160000 items (pattern '^(a{400}){400}$'), over the limit of 100000
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["MAX_GROUP_DEPTH", "MAX_REPEAT", "MAX_EXPANSION", "check_gbnf", "check_schema", "gbnf_depth"]

MAX_GROUP_DEPTH = 2500
MAX_REPEAT = 2000
MAX_EXPANSION = 100_000

_GBNF_SKIP = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\r\n]*', re.S)
_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_COUNT_KEYS = ("minItems", "maxItems", "minLength", "maxLength")


def gbnf_depth(text: str) -> int:
    """How deep ``text``'s groups nest (outside string literals, character classes and comments)."""
    depth = best = 0
    for c in re.findall(r"[()]", _GBNF_SKIP.sub("", text)):
        depth += 1 if c == "(" else -1
        best = max(best, depth)
    return best


def check_gbnf(text: str) -> None:
    """:class:`ValueError` when ``text`` nests groups deeper than :data:`MAX_GROUP_DEPTH`."""
    d = gbnf_depth(text)
    if d > MAX_GROUP_DEPTH:
        raise ValueError(f"the grammar nests {d} groups deep, over the limit of {MAX_GROUP_DEPTH}")


def _pattern_expansion(pattern: str) -> int:
    """The repetitions a regex expands to, nested counts multiplied (an upper bound: siblings multiply too)."""
    total = 1
    for m in _COUNT.finditer(pattern):
        n = max(int(m.group(1)), int(m.group(2) or 0))
        if n > MAX_REPEAT:
            raise ValueError(f"the pattern {pattern[:60]!r} repeats {n} times, over the limit of {MAX_REPEAT} repetitions")
        total *= max(n, 1)
        if total > MAX_EXPANSION:
            break
    return total if total > 1 else 0


def check_schema(schema: Any) -> None:
    """:class:`ValueError` when a count in ``schema`` (anywhere in it) is over :data:`MAX_REPEAT`, or all
    together expand past :data:`MAX_EXPANSION`."""
    total, stack = 0, [schema]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(v)
            continue
        if not isinstance(v, dict):
            continue
        for k, x in v.items():
            if k in _COUNT_KEYS and isinstance(x, (int, float)) and not isinstance(x, bool):
                if x > MAX_REPEAT:
                    raise ValueError(f"{k} = {x} is over the limit of {MAX_REPEAT} repetitions")
                total += max(int(x), 0)
                what = k
            elif k == "pattern" and isinstance(x, str):
                total += _pattern_expansion(x)
                what = f"pattern {x[:40]!r}"
            else:
                stack.append(x)
                continue
            if total > MAX_EXPANSION:
                raise ValueError(f"the schema's repetitions expand to {total} items ({what}), over the limit of "
                                 f"{MAX_EXPANSION}")
