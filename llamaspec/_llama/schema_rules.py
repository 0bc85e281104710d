"""The grammar rules :mod:`llamaspec._llama.schema_grammar` writes with (llama.cpp's
``common/json-schema-to-grammar.cpp`` of the pinned tree, rewritten in Python): the primitive and string-format
rules, literals, repetitions, integer ranges as digit ranges, and the pieces of a regex pattern's reader.
"""
from __future__ import annotations

import json
import re
from typing import Any

from .schema_read import I64_MAX, I64_MIN, INT_MAX, SchemaError  # noqa: F401

# -- rules -----------------------------------------------------------------------------------------------
SPACE_RULE = r'| " " | "\n"{1,2} [ \t]{0,20}'

#: name -> (rule, the rules it uses)
PRIMITIVE_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "boolean": (r'("true" | "false")', ()),
    "decimal-part": (r"[0-9]{1,16}", ()),
    "integral-part": (r"[0] | [1-9] [0-9]{0,15}", ()),
    "number": (r'("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)?',
               ("integral-part", "decimal-part")),
    "integer": (r'("-"? integral-part)', ("integral-part",)),
    "value": ("object | array | string | number | boolean | null",
              ("object", "array", "string", "number", "boolean", "null")),
    "object": (r'"{" space ( string ":" space value ("," space string ":" space value)* )? space "}"',
               ("string", "value")),
    "array": (r'"[" space ( value ("," space value)* )? space "]"', ("value",)),
    "uuid": (r'"\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" '
             r'[0-9a-fA-F]{12} "\""', ()),
    "char": (r'[^"\\\x7F\x00-\x1F] | [\\] (["\\bfnrt] | "u" [0-9a-fA-F]{4})', ()),
    "string": (r'"\"" char* "\""', ("char",)),
    "null": (r'"null"', ()),
}
STRING_FORMAT_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "date": (r'[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [1-2] [0-9] | "3" [0-1] )', ()),
    "time": (r'([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{3} )? ( "Z" | ( "+" | "-" ) '
             r'( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )', ()),
    "date-time": (r'date "T" time', ("date", "time")),
    "date-string": (r'"\"" date "\""', ("date",)),
    "time-string": (r'"\"" time "\""', ("time",)),
    "date-time-string": (r'"\"" date-time "\""', ("date-time",)),
}
_RESERVED = {"root", *PRIMITIVE_RULES, *STRING_FORMAT_RULES}
_INVALID_NAME = re.compile(r"[^a-zA-Z0-9-]+")
_LITERAL_ESCAPE = re.compile(r'[\r\n"\\]')
_LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}
_NON_LITERAL = set("|.()[]{}*+?^$")
_REGEX_ONLY_ESCAPES = set("^$.[]()|{}*+?")


def _literal(text: str) -> str:
    return '"' + _LITERAL_ESCAPE.sub(lambda m: _LITERAL_ESCAPES[m.group()], text) + '"'


def _dump(value: Any) -> str:
    """A JSON value as llama.cpp writes it: compact, UTF-8 as it is."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _repetition(item: str, lo: int, hi: int, sep: str = "") -> str:
    has_max = hi != INT_MAX
    if hi == 0:
        return ""
    if lo == 0 and hi == 1:
        return item + "?"
    if not sep:
        if lo == 1 and not has_max:
            return item + "+"
        if lo == 0 and not has_max:
            return item + "*"
        return item + "{" + str(lo) + "," + (str(hi) if has_max else "") + "}"
    out = item + " " + _repetition("(" + sep + " " + item + ")", 0 if lo == 0 else lo - 1,
                                   hi - 1 if has_max else hi)
    return "(" + out + ")?" if lo == 0 else out


def _int_range(lo: int, hi: int, out: list, decimals_left: int = 16, top: bool = True) -> None:
    """The rule of the integers from ``lo`` to ``hi`` (I64_MIN / I64_MAX: unbounded) appended to ``out``."""
    has_min, has_max = lo != I64_MIN, hi != I64_MAX

    def digit_range(a: str, b: str) -> None:
        out.append("[" + (a if a == b else a + "-" + b) + "]")

    def more_digits(mn: int, mx: int) -> None:
        out.append("[0-9]")
        if mn == mx == 1:
            return
        out.append("{" + str(mn) + ("," + (str(mx) if mx != INT_MAX else "") if mx != mn else "") + "}")

    def uniform(frm: str, to: str) -> None:
        i = 0
        while i < len(frm) and i < len(to) and frm[i] == to[i]:
            i += 1
        if i > 0:
            out.append('"' + frm[:i] + '"')
        if i < len(frm) and i < len(to):
            if i > 0:
                out.append(" ")
            sub_len = len(frm) - i - 1
            if sub_len > 0:
                frm_sub, to_sub = frm[i + 1:], to[i + 1:]
                zeros, nines = "0" * sub_len, "9" * sub_len
                reached = False
                out.append("(")
                if frm_sub == zeros:
                    digit_range(frm[i], chr(ord(to[i]) - 1))
                    out.append(" ")
                    more_digits(sub_len, sub_len)
                else:
                    out.append("[" + frm[i] + "] (")
                    uniform(frm_sub, nines)
                    out.append(")")
                    if ord(frm[i]) < ord(to[i]) - 1:
                        out.append(" | ")
                        if to_sub == nines:
                            digit_range(chr(ord(frm[i]) + 1), to[i])
                            reached = True
                        else:
                            digit_range(chr(ord(frm[i]) + 1), chr(ord(to[i]) - 1))
                        out.append(" ")
                        more_digits(sub_len, sub_len)
                if not reached:
                    out.append(" | ")
                    digit_range(to[i], to[i])
                    out.append(" ")
                    uniform(zeros, to_sub)
                out.append(")")
            else:
                out.append("[" + frm[i] + "-" + to[i] + "]")

    if has_min and has_max:
        if lo < 0 and hi < 0:
            out.append('"-" (')
            _int_range(-hi, -lo, out, decimals_left, True)
            out.append(")")
            return
        if lo < 0:
            out.append('"-" (')
            _int_range(0, -lo, out, decimals_left, True)
            out.append(") | ")
            lo = 0
        lo_s, hi_s = str(lo), str(hi)
        for digits in range(len(lo_s), len(hi_s)):
            uniform(lo_s, "9" * digits)
            lo_s = "1" + "0" * digits
            out.append(" | ")
        uniform(lo_s, hi_s)
        return
    less = max(decimals_left - 1, 1)
    if has_min:
        if lo < 0:
            out.append('"-" (')
            _int_range(I64_MIN, -lo, out, decimals_left, False)
            out.append(") | [0] | [1-9] ")
            more_digits(0, decimals_left - 1)
        elif lo == 0:
            if top:
                out.append("[0] | [1-9] ")
                more_digits(0, less)
            else:
                more_digits(1, decimals_left)
        elif lo <= 9:
            c = str(lo)
            start = "1" if top else "0"
            if c > start:
                digit_range(start, chr(ord(c) - 1))
                out.append(" ")
                more_digits(1, less)
                out.append(" | ")
            digit_range(c, "9")
            out.append(" ")
            more_digits(0, less)
        else:
            s = str(lo)
            c = s[0]
            if c > "1":
                digit_range("1" if top else "0", chr(ord(c) - 1))
                out.append(" ")
                more_digits(len(s), less)
                out.append(" | ")
            digit_range(c, c)
            out.append(" (")
            _int_range(int(s[1:]), I64_MAX, out, less, False)
            out.append(")")
            if c < "9":
                out.append(" | ")
                digit_range(chr(ord(c) + 1), "9")
                out.append(" ")
                more_digits(len(s) - 1, less)
        return
    if has_max:
        if hi >= 0:
            if top:
                out.append('"-" [1-9] ')
                more_digits(0, less)
                out.append(" | ")
            _int_range(0, hi, out, decimals_left, True)
        else:
            out.append('"-" (')
            _int_range(-hi, I64_MAX, out, decimals_left, False)
            out.append(")")
        return
    raise SchemaError("At least one of min_value or max_value must be set")


def _escape_len(p: str, pos: int) -> int:
    """The length of the GBNF escape at ``p[pos]`` (``\\x..``, ``\\u....``, ``\\U........``, ``\\t`` ...), else 0."""
    if pos + 1 >= len(p) or p[pos] != "\\":
        return 0
    c = p[pos + 1]
    if c in 'trn\\"[]-':
        return 2
    n_hex = {"x": 2, "u": 4, "U": 8}.get(c, 0)
    if not n_hex or pos + 2 + n_hex > len(p):
        return 0
    if not all(h in "0123456789abcdefABCDEF" for h in p[pos + 2:pos + 2 + n_hex]):
        return 0
    return 2 + n_hex


class _Unsupported(Exception):
    """A valid regex the grammar has no equivalent for: the string is any string."""


class _Invalid(Exception):
    """Not a regex."""


def _stoi(s: str) -> int:
    m = re.match(r"\s*([-+]?\d+)", s)
    if not m:
        raise ValueError(s)
    v = int(m.group(1))
    if not -(1 << 31) <= v <= INT_MAX:
        raise ValueError(s)
    return v


def _trie(words: list[str]) -> dict:
    """The trie of ``words``: ``{char: subtrie}``, and the key ``""`` where a word ends."""
    root: dict = {}
    for w in words:
        node = root
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}
    return root
