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
* llama.cpp checks every alternative a grammar has open against the whole vocabulary on every token: a
  ``{"enum": [...20,000 strings...]}`` costs seconds a token, for every slot. :func:`alternatives_over` counts
  them (:func:`~llamaspec._llama.grammar_cost.open_alternatives`); the callers refuse a grammar over
  :data:`MAX_ALTERNATIVES` (``SamplingParams.max_grammar_alternatives``, ``--max-grammar-alternatives``).

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
>>> alternatives_over('root ::= "a" | "b"', 1), alternatives_over('root ::= "a" | "b"', 2), alternatives_over('root ::= "a" | "b"', 0)
(2, 0, 0)
>>> alternatives_message(20000)
'the grammar can follow 20000 alternatives at once (llama.cpp checks each one against the whole vocabulary on every token)'
"""
from __future__ import annotations

import re
from typing import Any

from .grammar_cost import open_alternatives

__all__ = ["MAX_GROUP_DEPTH", "MAX_REPEAT", "MAX_EXPANSION", "MAX_ALTERNATIVES", "check_gbnf", "check_schema",
           "alternatives_over", "alternatives_message"]

MAX_GROUP_DEPTH = 2500
MAX_REPEAT = 2000
MAX_EXPANSION = 100_000
#: the default bound on the alternatives a grammar has open at once (0: none). Each costs a pass over the
#: vocabulary per token: 0.3-0.5 ms of CPU on a 49k vocabulary and a 2-core CPU, on top of 5-8 ms for any
#: grammar (docs/limits.md): 512 keep a token's worst near 0.2 s while an enum of every country (~250 values)
#: or a schema of a few hundred optional properties still passes, as llama-server would take them (20,000: 5-7 s)
MAX_ALTERNATIVES = 512

_GBNF_SKIP = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\r\n]*', re.S)
_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_COUNT_KEYS = ("minItems", "maxItems", "minLength", "maxLength")


def check_gbnf(text: str) -> None:
    """:class:`ValueError` when ``text`` nests groups deeper than :data:`MAX_GROUP_DEPTH`, or has a repetition
    ``{m,n}`` with ``m > n`` or a count over :data:`MAX_REPEAT` (outside literals and character classes):
    llama.cpp expands a count into that many rules before the first token, and an inverted one without end
    (a schema bound past 64 bits wrote ``[0-9]{19,15}``: minutes of CPU and gigabytes before any answer).

    >>> check_gbnf('root ::= [0-9]{2,5} "x"{3}')
    >>> check_gbnf('root ::= [0-9]{19,15}')
    Traceback (most recent call last):
    ValueError: the grammar repeats {19,15}: the minimum is above the maximum
    """
    plain = _GBNF_SKIP.sub("", text)  # (literals, character classes and comments do not count)
    depth = d = 0
    for c in re.findall(r"[()]", plain):
        depth += 1 if c == "(" else -1
        d = max(d, depth)
    if d > MAX_GROUP_DEPTH:
        raise ValueError(f"the grammar nests {d} groups deep, over the limit of {MAX_GROUP_DEPTH}")
    for m in _COUNT.finditer(plain):
        lo, hi = int(m.group(1)), m.group(2)
        if hi:
            if int(hi) < lo:
                raise ValueError(f"the grammar repeats {{{lo},{hi}}}: the minimum is above the maximum")
            lo = max(lo, int(hi))
        if lo > MAX_REPEAT:
            raise ValueError(f"the grammar repeats {lo} times, over the limit of {MAX_REPEAT} repetitions")


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


def alternatives_over(text: str, limit: int) -> int:
    """How many alternatives grammar ``text`` has open at once, when that is over ``limit`` (> 0); else 0."""
    if limit <= 0 or not text:
        return 0
    n = open_alternatives(text)
    return n if n > limit else 0


def alternatives_message(n: int) -> str:
    """What is wrong with a grammar that has ``n`` alternatives open at once (the callers add limit and flag)."""
    return (f"the grammar can follow {n} alternatives at once (llama.cpp checks each one against the whole "
            "vocabulary on every token)")
