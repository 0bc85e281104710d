"""JSON schema reading, the first step of :mod:`llamaspec._llama.schema_grammar` (llama.cpp's
``common/json-schema.cpp`` of the pinned tree, rewritten in Python): the schema becomes a small tree of typed
nodes (``$ref`` into the same document, ``oneOf`` / ``anyOf``, a list of types, ``const``, ``enum``, ``allOf``,
objects, tuples, arrays, strings with a pattern / format / length, integers with bounds); :class:`SchemaError`
where llama-server refuses the schema.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["read_schema", "SchemaError", "Node", "INT_MAX", "I64_MIN", "I64_MAX"]

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
INT_MAX = (1 << 31) - 1  # "no maximum" of a repetition
MAX_PATTERN_DEPTH = 100


class SchemaError(ValueError):
    """A schema llama-server refuses (the same cases, its message's words)."""


# -- the typed tree ------------------------------------------------------------------------------------
@dataclass
class Node:
    """One node of the tree: its ``kind`` and the fields that kind has (the others keep their defaults)."""

    kind: str  # any ref anyOf allOf const enum null boolean number integer string array tuple object
    ref: str = ""  # ref: the reference, and the node it names (set once the whole schema is read)
    target: "Node | None" = None
    children: list = field(default_factory=list)  # anyOf / allOf
    value: Any = None  # const
    values: list = field(default_factory=list)  # enum
    minimum: int = I64_MIN  # integer
    maximum: int = I64_MAX
    pattern: str = ""  # string: a pattern, a format ("", date, time, date-time, uuid), a length
    format: str = ""
    min_length: int = 0
    max_length: int = -1
    items: Any = None  # array: the items' Node; tuple: a list of Nodes
    min_items: int = 0
    max_items: int = -1
    properties: list = field(default_factory=list)  # object: (name, Node, required); the other keys' Node
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
        self.pending: list[Node] = []

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
        node = Node("ref", ref=value)
        self.pending.append(node)
        return node

    def alts(self, kind: str, alts: Any, path: str) -> Node:
        if not isinstance(alts, list):
            self.fail(path, "must be an array of schemas")
        if not alts:
            self.fail(path, "must not be empty")
        return Node(kind, children=[self.node(a, f"{path}/{i}") for i, a in enumerate(alts)])

    def object(self, schema: dict, path: str) -> Node:
        req = schema.get("required")
        required = {n for n in req if isinstance(n, str)} if isinstance(req, list) else set()
        node = Node("object")
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
        node = Node("array")
        if "items" in schema or "prefixItems" in schema:
            key = "items" if "items" in schema else "prefixItems"
            items = schema[key]
            if isinstance(items, list):
                return Node("tuple", items=[self.node(x, f"{path}/{key}/{i}") for i, x in enumerate(items)])
            node.items = self.node(items, f"{path}/{key}")
        else:
            node.items = Node("any")
        node.min_items = self.count(schema, "minItems", path, 0)
        node.max_items = self.count(schema, "maxItems", path, -1)
        return node

    def string(self, schema: dict, path: str) -> Node:
        node = Node("string")
        if "pattern" in schema:
            if not isinstance(schema["pattern"], str):
                self.fail(path, "pattern must be a string")
            node.pattern = schema["pattern"]
        node.format = self.fmt(schema, path)
        node.min_length = self.count(schema, "minLength", path, 0)
        node.max_length = self.count(schema, "maxLength", path, -1)
        return node

    def integer(self, schema: dict, path: str) -> Node:
        node = Node("integer")
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
            return Node("anyOf", children=[self.node({**schema, "type": x}, f"{path}/type/{i}")
                                           for i, x in enumerate(t)])
        if "const" in schema:
            return Node("const", value=schema["const"])
        if "enum" in schema:
            vals = schema["enum"]
            if not isinstance(vals, list) or not vals:
                self.fail(path, "enum must be a non-empty array")
            return Node("enum", values=list(vals))
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
