"""JSON schema -> GBNF, by the rules of the pinned llama-server (llama.cpp's ``common/json-schema.cpp`` and
``common/json-schema-to-grammar.cpp`` in llama-cpp-python 0.3.36's vendored tree), rewritten in Python: the
grammar text is the one llama-server builds for ``json_schema`` / ``response_format``, so constrained text at
temperature 0 is the text llama-server writes.

Two steps, as there: the schema is read into a small tree of typed nodes (:func:`read_schema`: ``$ref`` into
the same document, ``oneOf`` / ``anyOf``, a list of types, ``const``, ``enum``, ``allOf``, objects, tuples,
arrays, strings with a pattern / format / length, integers with bounds), then each node writes its rules
(:class:`_Converter`); the rules come out sorted by name. Differences from llama-cpp-python's older converter
(what ``llama_cpp.Llama`` uses): whitespace (``space``) may follow ``{`` / ``[`` / ``,`` and come before ``}`` /
``]``, ``"\\n"`` runs with indentation are whitespace too, integer bounds become digit ranges, repetitions stay
``{m,n}``, and a pattern the grammar cannot follow (``\\d``, lookarounds) means any string.

>>> print(json_schema_grammar({"type": "integer", "minimum": 1, "maximum": 12}), end="")
root ::= ([1-9] | "1" [0-2])
space ::= | " " | "\\n"{1,2} [ \\t]{0,20}
>>> print(json_schema_grammar({"properties": {"a": {"const": 1}}, "required": ["a"]}), end="")
a ::= "1"
a-kv ::= "\\"a\\"" space ":" space a
root ::= "{" space a-kv space "}"
space ::= | " " | "\\n"{1,2} [ \\t]{0,20}
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["json_schema_grammar", "read_schema", "SchemaError", "SPACE_RULE", "PRIMITIVE_RULES"]

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
INT_MAX = (1 << 31) - 1  # "no maximum" of a repetition
MAX_PATTERN_DEPTH = 100


class SchemaError(ValueError):
    """A schema llama-server refuses (the same cases, its message's words)."""


# -- the typed tree ------------------------------------------------------------------------------------
@dataclass
class Node:
    kind: str  # any ref anyOf allOf const enum null boolean number integer string array tuple object


@dataclass
class Ref(Node):
    ref: str = ""
    target: "Node | None" = None


@dataclass
class Alts(Node):  # anyOf / allOf
    children: list = field(default_factory=list)


@dataclass
class Const(Node):
    value: Any = None


@dataclass
class Enum(Node):
    values: list = field(default_factory=list)


@dataclass
class Integer(Node):
    minimum: int = I64_MIN
    maximum: int = I64_MAX


@dataclass
class String(Node):
    pattern: str = ""
    format: str = ""  # "", date, time, date-time, uuid
    min_length: int = 0
    max_length: int = -1


@dataclass
class Array(Node):
    items: "Node | None" = None
    min_items: int = 0
    max_items: int = -1


@dataclass
class Tuple(Node):
    items: list = field(default_factory=list)


@dataclass
class Object(Node):
    properties: list = field(default_factory=list)  # (name, Node, required)
    additional: "Node | None" = None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _stoull(s: str) -> int | None:
    m = re.match(r"\s*\+?(\d+)", s)
    return int(m.group(1)) if m else None


class _Reader:
    """A JSON schema -> :class:`Node` tree (``$ref`` targets shared, cycles allowed)."""

    def __init__(self, root: Any):
        self.root = root
        self.refs: dict[str, Node | None] = {}
        self.pending: list[Ref] = []

    @staticmethod
    def fail(path: str, msg: str):
        raise SchemaError(f"JSON schema error at {path}: {msg}")

    def count(self, schema: dict, key: str, path: str, default: int) -> int:
        if key not in schema:
            return default
        v = schema[key]
        if not _is_int(v) or v < 0:
            self.fail(path, f"{key} must be a non-negative integer")
        return v

    def bound(self, schema: dict, key: str, path: str, round_up: bool) -> int:
        v = schema[key]
        if _is_int(v):
            return v
        if not _is_num(v):
            self.fail(path, f"{key} must be a number")
        if not math.isfinite(v):
            self.fail(path, f"{key} must be a finite number")
        return int(math.ceil(v) if round_up else math.floor(v))

    def fmt(self, schema: dict, path: str) -> str:
        if "format" not in schema:
            return ""
        f = schema["format"]
        if not isinstance(f, str):
            self.fail(path, "format must be a string")
        if f in ("date", "time", "date-time"):
            return f
        if f == "uuid" or (len(f) == 5 and f.startswith("uuid") and "1" <= f[4] <= "5"):
            return "uuid"
        return ""

    def resolve(self, ref: str, path: str) -> Any:
        target = self.root
        for sel in ref[1:].split("/")[1:]:
            if isinstance(target, dict) and sel in target:
                target = target[sel]
            elif isinstance(target, list):
                idx = _stoull(sel)
                if idx is None or idx >= len(target):
                    self.fail(path, f"cannot resolve $ref {ref}, {sel} is out of range")
                target = target[idx]
            else:
                self.fail(path, f"cannot resolve $ref {ref}, {sel} not found")
        return target

    def ref(self, value: Any, path: str) -> Node:
        if not isinstance(value, str):
            self.fail(path, "$ref must be a string")
        if not value.startswith("#/"):
            self.fail(path, f"unsupported $ref {value}, only references into the same document are supported")
        if value not in self.refs:
            self.refs[value] = None  # a cycle back to this $ref stops here
            self.refs[value] = self.node(self.resolve(value, path), value)
        node = Ref("ref", ref=value)
        self.pending.append(node)
        return node

    def alts(self, kind: str, alts: Any, path: str) -> Node:
        if not isinstance(alts, list):
            self.fail(path, "must be an array of schemas")
        if not alts:
            self.fail(path, "must not be empty")
        return Alts(kind, children=[self.node(a, f"{path}/{i}") for i, a in enumerate(alts)])

    def object(self, schema: dict, path: str) -> Node:
        req = schema.get("required")
        required = {n for n in req if isinstance(n, str)} if isinstance(req, list) else set()
        node = Object("object")
        if "properties" in schema:
            props = schema["properties"]
            if not isinstance(props, dict):
                self.fail(path, "properties must be an object")
            node.properties = [(n, self.node(p, f"{path}/properties/{n}"), n in required) for n, p in props.items()]
        if "additionalProperties" in schema:
            add = schema["additionalProperties"]
            if isinstance(add, bool):
                node.additional = Node("any") if add else None
            elif isinstance(add, dict):
                node.additional = self.node(add, f"{path}/additionalProperties")
            else:
                self.fail(path, "additionalProperties must be a boolean or a schema")
        elif "properties" not in schema:
            node.additional = Node("any")  # {"type": "object"} alone: any object
        return node

    def array(self, schema: dict, path: str) -> Node:
        node = Array("array")
        if "items" in schema or "prefixItems" in schema:
            key = "items" if "items" in schema else "prefixItems"
            items = schema[key]
            if isinstance(items, list):
                return Tuple("tuple", items=[self.node(x, f"{path}/{key}/{i}") for i, x in enumerate(items)])
            node.items = self.node(items, f"{path}/{key}")
        else:
            node.items = Node("any")
        node.min_items = self.count(schema, "minItems", path, 0)
        node.max_items = self.count(schema, "maxItems", path, -1)
        return node

    def string(self, schema: dict, path: str) -> Node:
        node = String("string")
        if "pattern" in schema:
            if not isinstance(schema["pattern"], str):
                self.fail(path, "pattern must be a string")
            node.pattern = schema["pattern"]
        node.format = self.fmt(schema, path)
        node.min_length = self.count(schema, "minLength", path, 0)
        node.max_length = self.count(schema, "maxLength", path, -1)
        return node

    def integer(self, schema: dict, path: str) -> Node:
        node = Integer("integer")
        if "minimum" in schema:
            node.minimum = self.bound(schema, "minimum", path, True)
        elif "exclusiveMinimum" in schema:
            node.minimum = self.bound(schema, "exclusiveMinimum", path, False) + 1
        if "maximum" in schema:
            node.maximum = self.bound(schema, "maximum", path, False)
        elif "exclusiveMaximum" in schema:
            node.maximum = self.bound(schema, "exclusiveMaximum", path, True) - 1
        node.minimum = max(I64_MIN, min(I64_MAX, node.minimum))
        node.maximum = max(I64_MIN, min(I64_MAX, node.maximum))
        return node

    def node(self, schema: Any, path: str) -> Node:
        if not isinstance(schema, dict):
            self.fail(path, "schema must be an object")
        if "$ref" in schema:
            return self.ref(schema["$ref"], path)
        if "oneOf" in schema or "anyOf" in schema:
            key = "oneOf" if "oneOf" in schema else "anyOf"
            return self.alts("anyOf", schema[key], f"{path}/{key}")
        t = schema.get("type")
        if isinstance(t, list):  # {"type": [a, b], ...} = {"anyOf": [{"type": a, ...}, {"type": b, ...}]}
            if not t:
                self.fail(path, "type must not be empty")
            return Alts("anyOf", children=[self.node({**schema, "type": x}, f"{path}/type/{i}")
                                           for i, x in enumerate(t)])
        if "const" in schema:
            return Const("const", value=schema["const"])
        if "enum" in schema:
            vals = schema["enum"]
            if not isinstance(vals, list) or not vals:
                self.fail(path, "enum must be a non-empty array")
            return Enum("enum", values=list(vals))
        if t is not None and not isinstance(t, str):
            self.fail(path, "type must be a string or an array of strings")
        t = t or ""
        has_props = "properties" in schema or ("additionalProperties" in schema
                                               and schema["additionalProperties"] is not True)
        if not t:  # the structural keywords decide
            if has_props:
                return self.object(schema, path)
            if "allOf" in schema:
                return self.alts("allOf", schema["allOf"], f"{path}/allOf")
            if "items" in schema or "prefixItems" in schema:
                return self.array(schema, path)
            if any(k in schema for k in ("pattern", "minLength", "maxLength")) or self.fmt(schema, path):
                return self.string(schema, path)
            return Node("any")
        if t == "object":
            if not has_props and "allOf" in schema:
                return self.alts("allOf", schema["allOf"], f"{path}/allOf")
            return self.object(schema, path)
        if t == "string":
            if "allOf" in schema:
                return self.alts("allOf", schema["allOf"], f"{path}/allOf")
            return self.string(schema, path)
        if t == "array":
            return self.array(schema, path)
        if t == "integer":
            return self.integer(schema, path)
        if t in ("number", "boolean", "null"):
            return Node(t)
        self.fail(path, f"unrecognized type {t}")

    def read(self) -> Node:
        node = self.node(self.root, "#")
        for r in self.pending:
            r.target = self.refs[r.ref]
        return node


def read_schema(schema: Any) -> Node:
    """The typed tree of ``schema``; :class:`SchemaError` where llama-server refuses it."""
    return _Reader(schema).read()


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


def _trie(words: list[str]) -> list[dict]:
    """Nodes ``{"children": {char: index}, "end": bool}`` of the trie of ``words`` (node 0 the root)."""
    nodes = [{"children": {}, "end": False}]
    for w in words:
        at = 0
        for ch in w:
            nxt = nodes[at]["children"].get(ch)
            if nxt is None:
                nxt = len(nodes)
                nodes.append({"children": {}, "end": False})
                nodes[at]["children"][ch] = nxt
            at = nxt
        nodes[at]["end"] = True
    return nodes


class _Converter:
    def __init__(self, dotall: bool = False):
        self.dotall = dotall
        self.rules: dict[str, str] = {"space": SPACE_RULE}
        self.resolving: set[str] = set()
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def add_rule(self, name: str, rule: str) -> str:
        esc = _INVALID_NAME.sub("-", name)
        if esc not in self.rules or self.rules[esc] == rule:
            self.rules[esc] = rule
            return esc
        i = 0
        while f"{esc}{i}" in self.rules and self.rules[f"{esc}{i}"] != rule:
            i += 1
        key = f"{esc}{i}"
        self.rules[key] = rule
        return key

    def add_primitive(self, name: str, rule: tuple[str, tuple[str, ...]]) -> str:
        n = self.add_rule(name, rule[0])
        for dep in rule[1]:
            dep_rule = PRIMITIVE_RULES.get(dep) or STRING_FORMAT_RULES.get(dep)
            if dep_rule is None:
                self.errors.append(f"Rule {dep} not known")
                continue
            if dep not in self.rules:
                self.add_primitive(dep, dep_rule)
        return n

    def primitive(self, rule_name: str, t: str) -> str:
        return self.add_primitive("root" if rule_name == "root" else t, PRIMITIVE_RULES[t])

    # -- patterns -----------------------------------------------------------------------------------------
    def visit_pattern(self, pattern: str, name: str) -> str:
        snapshot = dict(self.rules)
        try:
            return self.pattern_rule(pattern, name)
        except _Unsupported as e:
            self.rules = snapshot
            self.warnings.append(f"pattern {pattern} is not supported ({e}), accepting any string")
            return self.add_rule(name, self.add_primitive("string", PRIMITIVE_RULES["string"]))
        except _Invalid as e:
            self.rules = snapshot
            self.errors.append(f"Invalid pattern {pattern}: {e}")
            return ""

    def pattern_rule(self, pattern: str, name: str) -> str:
        if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$":
            raise _Unsupported("not anchored with '^' and '$'")
        sub = pattern[1:-1]
        n = len(sub)
        sub_ids: dict[str, str] = {}
        st = {"i": 0, "depth": 0}

        def to_rule(item: tuple[str, bool]) -> str:
            return '"' + item[0] + '"' if item[1] else item[0]

        def dot() -> str:
            return self.add_rule("dot", r"[\U00000000-\U0010FFFF]" if self.dotall else r"[^\x0A\x0D]")

        def transform() -> tuple[str, bool]:
            seq: list[tuple[str, bool]] = []

            def join() -> tuple[str, bool]:
                merged: list[tuple[str, bool]] = []
                lit = ""
                for text, is_lit in seq:
                    if is_lit:
                        lit += text
                    else:
                        if lit:
                            merged.append((lit, True))
                            lit = ""
                        merged.append((text, False))
                if lit:
                    merged.append((lit, True))
                return " ".join(to_rule(x) for x in merged), False

            while st["i"] < n:
                i = st["i"]
                c = sub[i]
                if c == ".":
                    seq.append((dot(), False))
                    st["i"] += 1
                elif c == "(":
                    st["i"] += 1
                    if st["i"] < n and sub[st["i"]] == "?":
                        if st["i"] + 1 < n and sub[st["i"] + 1] == ":":
                            st["i"] += 2
                        else:
                            raise _Unsupported("unsupported group syntax")
                    st["depth"] += 1
                    if st["depth"] > MAX_PATTERN_DEPTH:
                        raise _Unsupported("pattern nesting too deep")
                    seq.append(("(" + to_rule(transform()) + ")", False))
                elif c == ")":
                    st["i"] += 1
                    if st["depth"] == 0:
                        raise _Invalid("unbalanced parentheses")
                    st["depth"] -= 1
                    return join()
                elif c in "^$":
                    raise _Unsupported("anchor inside the pattern")
                elif c == "[":
                    cls = "["
                    i += 1
                    while i < n and sub[i] != "]":
                        if sub[i] == "\\":
                            k = _escape_len(sub, i)
                            if k == 0:
                                raise _Unsupported("unsupported escape in character class: " + sub[i:i + 2])
                            cls += sub[i:i + k]
                            i += k
                        else:
                            cls += sub[i]
                            i += 1
                    if i >= n:
                        raise _Invalid("unterminated character class")
                    st["i"] = i + 1
                    seq.append((cls + "]", False))
                elif c == "|":
                    seq.append(("|", False))
                    st["i"] += 1
                elif c in "*+?":
                    if not seq:
                        raise _Invalid("nothing to repeat")
                    seq[-1] = (to_rule(seq[-1]) + c, False)
                    st["i"] += 1
                elif c == "{":
                    j = i + 1
                    while j < n and sub[j] != "}":
                        j += 1
                    if j >= n:
                        raise _Unsupported("unterminated curly brackets")
                    nums = sub[i + 1:j].split(",")
                    st["i"] = j + 1
                    lo, hi = 0, INT_MAX
                    if len(nums) not in (1, 2):
                        raise _Unsupported("wrong number of values in curly brackets")
                    try:
                        if len(nums) == 1:
                            lo = hi = _stoi(nums[0])
                        else:
                            if nums[0]:
                                lo = _stoi(nums[0])
                            if nums[1]:
                                hi = _stoi(nums[1])
                    except ValueError:
                        raise _Unsupported("invalid number in curly brackets") from None
                    if not seq:
                        raise _Invalid("nothing to repeat")
                    text, is_lit = seq[-1]
                    if not is_lit:
                        sid = sub_ids.get(text)
                        if sid is None:
                            sub_ids[text] = ""
                            sid = sub_ids[text] = self.add_rule(f"{name}-{len(sub_ids)}", text)
                        text = sid
                    seq[-1] = (_repetition('"' + text + '"' if is_lit else text, lo, hi, ""), False)
                else:
                    lit = ""
                    while i < n:
                        ch = sub[i]
                        if ch == "\\":
                            if i == n - 1:
                                raise _Invalid("trailing backslash")
                            nxt = sub[i + 1]
                            if nxt in _REGEX_ONLY_ESCAPES:
                                lit += nxt
                                i += 2
                            else:
                                k = _escape_len(sub, i)
                                if k == 0:
                                    raise _Unsupported("unsupported escape: " + sub[i:i + 2])
                                lit += sub[i:i + k]
                                i += k
                        elif ch == '"':
                            lit += '\\"'
                            i += 1
                        elif ch not in _NON_LITERAL and (i == n - 1 or not lit or sub[i + 1] == "."
                                                         or sub[i + 1] not in _NON_LITERAL):
                            lit += ch
                            i += 1
                        else:
                            break
                    if not lit:
                        raise _Unsupported("unsupported character: " + c)
                    st["i"] = i
                    seq.append((lit, True))
            return join()

        rule = to_rule(transform())
        if st["depth"] != 0:
            raise _Invalid("unbalanced parentheses")
        return self.add_rule(name, r'"\"" (' + rule + r') "\""')

    def not_strings(self, strings: list[str]) -> str:
        """A JSON string that is none of ``strings`` (llama.cpp's trie rule, its quirks kept)."""
        nodes = _trie(strings)
        char = self.add_primitive("char", PRIMITIVE_RULES["char"])
        out = ['["] ( ']

        def visit(idx: int) -> None:
            kids = sorted(nodes[idx]["children"].items())
            rejects = ""
            for k, (ch, child) in enumerate(kids):
                rejects += ch
                if k:
                    out.append(" | ")
                out.append("[" + ch + "]")
                if nodes[child]["children"]:
                    out.append(" (")
                    visit(child)
                    out.append(")")
                else:
                    out.append(" " + char + "+")
            if kids:
                out.append(' | [^"' + rejects + "] " + char + "*")

        visit(0)
        out.append(" )")
        if not nodes[0]["end"]:
            out.append("?")
        out.append(' ["]')
        return "".join(out)

    # -- nodes ---------------------------------------------------------------------------------------------
    def resolve_ref(self, node: Ref) -> str:
        frag = node.ref[node.ref.index("#") + 1:] if "#" in node.ref else node.ref
        ref_name = "ref" + _INVALID_NAME.sub("-", frag)
        if ref_name not in self.rules and node.ref not in self.resolving:
            if node.target is None:
                self.errors.append(f"Unresolved $ref {node.ref}")
                return ""
            self.resolving.add(node.ref)
            ref_name = self.visit(node.target, ref_name)
            self.resolving.discard(node.ref)
        return ref_name

    def object_rule(self, props: list, required: set, name: str, additional: "Node | None") -> str:
        req_props: list[str] = []
        opt_props: list[str] = []
        kv: dict[str, str] = {}
        names: list[str] = []
        pre = name + ("-" if name else "")
        for pname, pschema in props:
            prule = self.visit(pschema, pre + pname)
            kv[pname] = self.add_rule(pre + pname + "-kv", _literal(_dump(pname)) + ' space ":" space ' + prule)
            (req_props if pname in required else opt_props).append(pname)
            names.append(pname)
        if additional is not None:
            sub = pre + "additional"
            value = (self.visit(additional, sub + "-value") if additional.kind != "any"
                     else self.add_primitive("value", PRIMITIVE_RULES["value"]))
            key = (self.add_primitive("string", PRIMITIVE_RULES["string"]) if not names
                   else self.add_rule(sub + "-k", self.not_strings(names)))
            kv["*"] = self.add_rule(sub + "-kv", key + ' ":" space ' + value)
            opt_props.append("*")
        if not req_props and not opt_props:
            return '"{" space "}"'
        rule = '"{" space ' + ' "," space '.join(kv[p] for p in req_props)
        if opt_props:
            rule += " ("
            if req_props:
                rule += ' "," space ( '

            def rest(ks: list[str], first_optional: bool) -> str:
                if not ks:
                    return ""
                k = ks[0]
                comma = '( "," space ' + kv[k] + " )"
                if first_optional:
                    res = comma + ("*" if k == "*" else "?")
                else:
                    res = kv[k] + (" " + comma + "*" if k == "*" else "")
                if len(ks) > 1:
                    res += " " + self.add_rule(pre + k + "-rest", rest(ks[1:], True))
                return res

            rule += " | ".join(rest(opt_props[i:], False) for i in range(len(opt_props)))
            if req_props:
                rule += " )"
            rule += " )?"
        return rule + ' space "}"'

    def visit_all_of(self, node: Alts, name: str, rule_name: str) -> str:
        required: set[str] = set()
        props: list = []
        enums: dict[str, int] = {}

        def add(comp: Node, is_required: bool) -> None:
            if isinstance(comp, Ref):
                if comp.target is not None:
                    add(comp.target, is_required)
            elif isinstance(comp, Object):
                for pname, pschema, _ in comp.properties:
                    props.append((pname, pschema))
                    if is_required:
                        required.add(pname)
            elif isinstance(comp, Enum):
                for v in comp.values:
                    r = _literal(_dump(v))
                    enums[r] = enums.get(r, 0) + 1

        for child in node.children:
            if child.kind == "anyOf":
                for alt in child.children:
                    add(alt, False)
            else:
                add(child, True)
        if enums:
            both = [r for r, k in sorted(enums.items()) if k == len(node.children)]
            if both:
                return self.add_rule(rule_name, "(" + " | ".join(both) + ")")
        return self.add_rule(rule_name, self.object_rule(props, required, name, None))

    def visit(self, node: Node, name: str) -> str:
        rule_name = name + "-" if name in _RESERVED else (name or "root")
        sub = name + ("-" if name else "")
        k = node.kind
        if k == "ref":
            return self.add_rule(rule_name, self.resolve_ref(node))
        if k == "anyOf":
            alts = [self.visit(c, name + ("-" if name else "alternative-") + str(i))
                    for i, c in enumerate(node.children)]
            return self.add_rule(rule_name, " | ".join(alts))
        if k == "allOf":
            return self.visit_all_of(node, name, rule_name)
        if k == "const":
            return self.add_rule(rule_name, _literal(_dump(node.value)))
        if k == "enum":
            return self.add_rule(rule_name, "(" + " | ".join(_literal(_dump(v)) for v in node.values) + ")")
        if k == "object":
            if not node.properties and node.additional is not None and node.additional.kind == "any":
                return self.add_rule(rule_name, self.add_primitive("object", PRIMITIVE_RULES["object"]))
            required = {p for p, _, req in node.properties if req}
            return self.add_rule(rule_name, self.object_rule([(p, s) for p, s, _ in node.properties], required,
                                                             name, node.additional))
        if k == "tuple":
            items = ' "," space '.join(self.visit(x, f"{sub}tuple-{i}") for i, x in enumerate(node.items))
            return self.add_rule(rule_name, '"[" space ' + items + ' space "]"')
        if k == "array":
            if node.items.kind == "any" and node.min_items == 0 and node.max_items < 0:
                return self.primitive(rule_name, "array")
            item = self.visit(node.items, sub + "item")
            hi = INT_MAX if node.max_items < 0 else node.max_items
            return self.add_rule(rule_name, '"[" space ' + _repetition(item, node.min_items, hi, '"," space')
                                 + ' space "]"')
        if k == "string":
            if node.pattern:
                return self.visit_pattern(node.pattern, rule_name)
            if node.format == "uuid":
                return self.primitive(rule_name, "uuid")
            if node.format:
                prim = node.format + "-string"
                return self.add_rule(rule_name, self.add_primitive(prim, STRING_FORMAT_RULES[prim]))
            if node.min_length > 0 or node.max_length >= 0:
                char = self.add_primitive("char", PRIMITIVE_RULES["char"])
                hi = INT_MAX if node.max_length < 0 else node.max_length
                return self.add_rule(rule_name, r'"\"" ' + _repetition(char, node.min_length, hi) + r' "\""')
            return self.primitive(rule_name, "string")
        if k == "integer":
            if node.minimum == I64_MIN and node.maximum == I64_MAX:
                return self.primitive(rule_name, "integer")
            out = ["("]
            _int_range(node.minimum, node.maximum, out)
            out.append(")")
            return self.add_rule(rule_name, "".join(out))
        if k in ("number", "boolean", "null"):
            return self.primitive(rule_name, k)
        return self.add_rule(rule_name, self.add_primitive("value", PRIMITIVE_RULES["value"]))

    def grammar(self) -> str:
        if self.errors:
            raise SchemaError("JSON schema conversion failed:\n" + "\n".join(self.errors))
        return "".join(f"{k} ::= {v}\n" for k, v in sorted(self.rules.items(), key=lambda kv: kv[0].encode()))


def json_schema_grammar(schema: Any) -> str:
    """The GBNF grammar llama-server builds for JSON schema ``schema``; :class:`SchemaError` (a ValueError)
    with its message where it refuses the schema."""
    tree = read_schema(schema)
    conv = _Converter()
    conv.visit(tree, "")
    return conv.grammar()
