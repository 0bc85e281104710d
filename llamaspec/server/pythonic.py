"""Pythonic tool calls, as Llama 3.2's and Gemma's function-calling prompts ask for them: a list
``[f(x=1), g(y="a")]``, calls one per line, or the body of Gemma 3's fenced block (`` ```tool_code``
then ``f(a=1)`` then `` ``` ``, also ``print(f(a=1))``). The text is parsed with :mod:`ast` and only literals are
read from it (strings, numbers, booleans, ``None``, lists, tuples, dicts; ``true`` / ``false`` / ``null`` as
JSON spells them): nothing is ever evaluated, and a call with anything else in it is no call.

>>> parse_calls('[get_weather(city="Paris"), get_time(utc=True)]')
[{'name': 'get_weather', 'arguments': '{"city": "Paris"}'}, {'name': 'get_time', 'arguments': '{"utc": true}'}]
>>> parse_calls('get_weather(city=open("/etc/passwd").read())') is None
True
"""
from __future__ import annotations

import ast
import json
import math
from typing import Any

__all__ = ["parse_calls"]

_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}
MAX_CHARS = 200_000  # past this a text is not parsed (a model's output is far shorter)


class _NotLiteral(ValueError):
    pass


def _value(node: ast.AST) -> Any:
    """The JSON value of a literal expression (:class:`_NotLiteral` for anything else)."""
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, float) and not math.isfinite(v):
            raise _NotLiteral("not a finite number")
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise _NotLiteral(f"{type(v).__name__} is not a JSON value")
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            key = _value(k) if k is not None else None  # None: a ``**mapping``
            if not isinstance(key, str):
                raise _NotLiteral("a dict key that is not a string")
            out[key] = _value(v)
        return out
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _NotLiteral("a sign before something that is not a number")
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    raise _NotLiteral(type(node).__name__)


def _name(func: ast.AST) -> str:
    """The called function's name: ``f``, or the last part of ``default_api.f``."""
    if isinstance(func, ast.Attribute):
        base = func.value
        while isinstance(base, ast.Attribute):
            base = base.value
        if not isinstance(base, ast.Name):
            raise _NotLiteral("a call of something that is not a name")
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    raise _NotLiteral("a call of something that is not a name")


def _call(node: ast.AST) -> dict:
    if not isinstance(node, ast.Call):
        raise _NotLiteral("not a call")
    name = _name(node.func)
    if name == "print" and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.Call):
        return _call(node.args[0])  # Gemma's ``print(f(...))``
    if node.args:
        raise _NotLiteral("positional arguments (the parameters' names are not known)")
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise _NotLiteral("a **mapping")
        args[kw.arg] = _value(kw.value)
    return {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}


def parse_calls(text: str, known: list[str] | None = None) -> list[dict] | None:
    """``[{"name", "arguments"}, ...]`` (``arguments`` a JSON object's text) of ``text``: statements that are
    each a call or a list / tuple of calls with literal keyword arguments; None when it is anything else, or
    (``known``) names a function that is not one of them."""
    text = text.strip()
    if not text or len(text) > MAX_CHARS:
        return None
    try:
        tree = ast.parse(text, mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    out: list[dict] = []
    try:
        for stmt in tree.body:
            if not isinstance(stmt, ast.Expr):
                return None
            v = stmt.value
            for node in (v.elts if isinstance(v, (ast.List, ast.Tuple)) else [v]):
                out.append(_call(node))
    except (_NotLiteral, RecursionError):
        return None
    if not out or (known is not None and any(c["name"] not in known for c in out)):
        return None
    return out
