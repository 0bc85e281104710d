"""How many alternatives a GBNF grammar can make llama.cpp follow at once: what its per-token cost grows with.

llama.cpp keeps one parse *stack* for every way the output so far can go on, and on every sampled token checks
each stack against every candidate token (a pass over the vocabulary: 0.3-0.5 ms of CPU per stack on a 49k
vocabulary and a 2-core CPU, docs/limits.md). A rule reference opens a stack for each of its alternatives (for each of
theirs when they begin with a reference too), and for what follows an element that may be empty (``x?``,
``x*``, ``x{0,n}``, ``""``). :func:`open_alternatives` is the most stacks one such expansion opens anywhere in
the grammar: ``root ::= "a" | "b" | "c"`` opens 3, a JSON-schema ``enum`` of 20,000 strings 20,000, and
``root ::= (a | b) (c | d)`` 2 (the second group opens once the first is done). Alternatives nested in
alternatives multiply: ``a1 ::= a2 "." | a2 ","``, ``a2 ::= a3 "." | a3 ","``, ... doubles at each level, as
llama.cpp's stacks do. A reference that ends its alternative returns nowhere, so llama.cpp opens its stacks
once however many alternatives end with it (``a1 ::= a2 | a2`` opens what ``a2`` opens); counted once per rule
(a rule reached that way through two other rules counts twice: the figure is then above llama.cpp's).

It reads the grammar the way llama.cpp's parser does, without recursion (groups nest up to
``grammar_limits.MAX_GROUP_DEPTH``) and in time linear in the text. A grammar llama.cpp would refuse gets some
figure (llama.cpp then says what is wrong with it). Not counted: alternatives that *share a prefix* stay open
together while it is read, and what each opens next adds up (``root ::= "a" x "1" | "a" x "2"`` opens ``x``
twice after ``a``).

>>> open_alternatives('root ::= "yes" | "no" | "maybe"')
3
>>> open_alternatives('root ::= ("a" | "b") ("c" | "d" | "e") [0-9]*')
3
>>> open_alternatives('root ::= x x\\nx ::= ("a" | "b")? ("c" | "d")?')
8
>>> open_alternatives('root ::= a1\\na1 ::= a2 "." | a2 ","\\na2 ::= a3 "." | a3 ","\\na3 ::= "x" | "y"')
8
>>> open_alternatives('root ::= a1\\na1 ::= a2 | a2\\na2 ::= a3 | a3\\na3 ::= "x" | "y"')
2
"""
from __future__ import annotations

import re

__all__ = ["open_alternatives"]

#: figures saturate here (nested alternatives multiply: a tiny grammar can open 2^1000 stacks)
CAP = 1 << 48

# one token of GBNF (spaces and comments before it skipped): a literal, a character class, any character,
# a token (<...>, !<...>), "::=", a name, a repetition, a parenthesis or "|"; anything else is passed over
_TOKEN = re.compile(r"""(?:[ \t\r\n]+|\#[^\r\n]*)*("(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|\.|!?<[^>\s]*>|::=|"""
                    r"""[A-Za-z0-9_-]+|[*+?]|\{[ \t]*\d*[ \t]*(?:,[ \t]*\d*[ \t]*)?\}|[()|])""", re.S)
_NAME_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_T1, _T0 = ("t", 1, 1, 1), ("t", 0, 1, 1)  # a terminal; an empty literal


def _parse(text: str) -> tuple[dict, list]:
    """``(rules, groups)``: each a list of alternatives, rules by name, groups by index. An alternative is a
    list of elements ``(kind, value, min, max)``: kind "t" a terminal (value 1) or an empty literal (0), "r" a
    rule (value: its name), "g" a group (value: its index); ``max`` -1 = unbounded."""
    rules: dict[str, list] = {}
    groups: list[list] = []
    stack: list[list] = [[[]]]  # the open groups (each: its alternatives), the rule's own first
    alt = stack[-1][-1]
    for tok in _TOKEN.findall(text):
        c = tok[0]
        if c == '"':
            alt.append(_T0 if tok == '""' else _T1)
        elif c == "|":
            alt = []
            stack[-1].append(alt)
        elif c in _NAME_START:
            alt.append(("r", tok, 1, 1))
        elif c in "[.<!":
            alt.append(_T1)
        elif c == "(":
            groups.append([[]])
            alt.append(("g", len(groups) - 1, 1, 1))
            stack.append(groups[-1])
            alt = stack[-1][-1]
        elif c == ")":
            if len(stack) > 1:
                stack.pop()
                alt = stack[-1][-1]
        elif c == ":":  # "name ::=": the name starts a rule
            if alt and alt[-1][0] == "r" and alt[-1][2:] == (1, 1):
                name = alt.pop()[1]
                stack = [rules.setdefault(name, [])]
                alt = []
                stack[0].append(alt)
        elif alt:  # a repetition of the element before it
            alt[-1] = alt[-1][:2] + _bounds(tok)
    return rules, groups


def _bounds(rep: str) -> tuple[int, int]:
    if rep in ("*", "+", "?"):
        return {"*": (0, -1), "+": (1, -1), "?": (0, 1)}[rep]
    lo, comma, hi = rep[1:-1].replace(" ", "").replace("\t", "").partition(",")
    a = int(lo) if lo else 0
    return (a, a) if not comma else (a, int(hi) if hi else -1)


def _repeat(t: int, n: int, lo: int, hi: int) -> tuple[int, int]:
    """The figure of ``x{lo,hi}`` from ``x``'s ``(stacks, may be empty)``: an empty ``x`` opens the next copy too."""
    if n == 0 or hi == 0:
        return (t, int(lo == 0)) if hi != 0 else (0, 1)
    return min(t * min(hi if hi > 0 else 1, 64), CAP), 1


def _values(rules: dict, groups: list) -> dict:
    """``{(kind, rule): (stacks, empty ways)}`` for every rule and group: the stacks its expansion opens, and the
    ways it can match nothing (each opens what follows it too). Without recursion (each rule's figures are a
    generator that yields the rules it needs first and is sent their figures); left recursion counts 0."""
    table = {("r", k): v for k, v in rules.items()}
    table.update((("g", i), v) for i, v in enumerate(groups))
    memo: dict = {}
    active: set = set()

    def value(key):
        total = empty = 0
        tails: set = set()  # the rules it calls last (a tail call opens the same stacks from every alternative)
        for alt in table[key]:
            if alt and alt[0] is _T1:  # the usual alternative: a terminal first, one stack
                total = min(total + 1, CAP)
                continue
            t, mult = 0, 1  # its stacks, whether it may be empty so far
            for i, (kind, v, lo, hi) in enumerate(alt):
                if not mult:
                    break
                if kind == "t":
                    te, ne = v, 1 - v
                else:
                    sub = (kind, v)
                    got = memo.get(sub)
                    if got is None:  # an undefined rule, left recursion (llama.cpp refuses both), or to compute
                        got = (1, 0) if sub not in table else (0, 0) if sub in active else (yield sub)
                    te, ne = got
                    if i == len(alt) - 1 and lo == hi == 1:  # a tail call: once per rule
                        te = 0 if sub in tails else te
                        tails.add(sub)
                if lo != 1 or hi != 1:
                    te, ne = _repeat(te, ne, lo, hi)
                t, mult = min(t + te, CAP), ne
            total, empty = min(total + t, CAP), empty | mult
        return total, empty

    for root in table:
        if root in memo:
            continue
        stack, sent = [(root, value(root))], None
        active.add(root)
        while stack:
            key, gen = stack[-1]
            try:
                need = gen.send(sent)
            except StopIteration as done:
                memo[key] = sent = done.value
                active.discard(key)
                stack.pop()
                continue
            active.add(need)
            stack.append((need, value(need)))
            sent = None
    return memo


def open_alternatives(text: str) -> int:
    """The most parse stacks one expansion opens anywhere in grammar ``text`` (see the module docstring)."""
    rules, groups = _parse(text)
    memo = _values(rules, groups)
    best = max((t for t, _ in memo.values()), default=0)
    for alts in list(rules.values()) + groups:  # at each element: what it opens, and what follows while it is empty
        for alt in alts:
            if len(alt) < 2 and (not alt or alt[0][2:] == (1, 1)):
                continue  # what it opens is its rule's
            t = 0
            for kind, v, lo, hi in reversed(alt):
                if kind == "t" and v and lo > 0:
                    t = 1
                    continue
                te, ne = (v, 1 - v) if kind == "t" else memo.get((kind, v), (1, 0))
                if lo != 1 or hi != 1:
                    te, ne = _repeat(te, ne, lo, hi)
                t = min(te + ne * t, CAP)
                best = max(best, t)
    return int(best)
