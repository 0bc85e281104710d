"""OpenAI ``tools`` on ``/v1/chat/completions``: the request's tools checked (:func:`parse_tools`), the
messages' ``tool_calls`` / ``tool_call_id`` made ready for a Jinja chat template (:func:`message_extras`), the
grammar of ``tool_choice: "required"`` or a named function (:meth:`ToolSpec.grammar`), and the model's text
parsed back into calls (:class:`ToolStream`, :func:`parse_output`) for the common template families:
Hermes / Qwen ``<tool_call>{json}</tool_call>``, Llama 3.x JSON (after ``<|python_tag|>`` or alone), Mistral
``[TOOL_CALLS][{...}]`` (and ``[TOOL_CALLS]name[ARGS]{...}``), a whole output that is a JSON call, and pythonic
calls (:mod:`~llamaspec.server.pythonic`): Gemma 3's `` ```tool_code`` block, a whole output ``[f(x=1), g(y="a")]``
(Llama 3.2, Gemma prompts) of the request's tools.

>>> spec = parse_tools({"tools": [{"type": "function", "function": {"name": "f"}}]})
>>> parse_output('Sure. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', spec, ids=iter(["c1"]))
('Sure.', [{'id': 'c1', 'type': 'function', 'function': {'name': 'f', 'arguments': '{"x": 1}'}}])
>>> parse_output('<tool_call>{"name": oops}</tool_call>', spec)
('<tool_call>{"name": oops}</tool_call>', [])
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .errors import invalid, show
from .pythonic import parse_calls as pythonic_calls

__all__ = ["ToolSpec", "ToolStream", "message_extras", "parse_output", "parse_tools", "new_call_id"]

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
TOOL_CODE, FENCE_CLOSE = "```tool_code", "```"  # Gemma 3
_MARKERS = (HERMES_OPEN, MISTRAL, PYTHON_TAG, TOOL_CODE)
_CLOSE = {HERMES_OPEN: HERMES_CLOSE, TOOL_CODE: FENCE_CLOSE}
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolSpec:
    """The tools of one request, checked: ``tools`` as the template gets them, ``choice`` one of ``auto``,
    ``none``, ``required`` or ``function`` (then ``name``), ``parallel`` (``parallel_tool_calls``; None: not
    given, then a forced call is one call, as llama-server's default, and every call the model writes is kept)."""

    tools: list[dict]
    choice: str = "auto"
    name: str | None = None
    parallel: bool | None = None
    names: list[str] = field(default_factory=list)

    @property
    def render(self) -> bool:
        """The template gets the tools (not with ``tool_choice: "none"``)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def parse(self) -> bool:
        """The output is parsed into calls."""
        return self.render

    @property
    def forced(self) -> bool:
        """The output must be a call: a grammar constrains it."""
        return self.render and self.choice in ("required", "function")

    def call_schema(self) -> dict:
        """The JSON schema of the output under a forced choice: ``{"name", "arguments"}`` of one of the
        (allowed) tools, a non-empty list of them with ``parallel_tool_calls``. A tool whose ``parameters``
        refers into itself (``#/$defs/...``: any pydantic model with a nested one, a recursive schema) moves to
        the top-level ``$defs`` as ``tool<i>``, its references rebased there, so they resolve where it is now.

        >>> spec = parse_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        ...     "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "string"}}}}}],
        ...     "tool_choice": "required"})
        >>> s = spec.call_schema()
        >>> s["properties"]["arguments"], s["$defs"]["tool0"]["properties"]["p"]
        ({'$ref': '#/$defs/tool0'}, {'$ref': '#/$defs/tool0/$defs/P'})
        """
        alts, defs = [], {}
        for i, t in enumerate(self.tools):
            f = t["function"]
            if self.choice == "function" and f["name"] != self.name:
                continue
            params = f.get("parameters") or {"type": "object"}
            if _has_local_ref(params):
                defs[f"tool{i}"] = _rebased(params, f"/$defs/tool{i}")
                params = {"$ref": f"#/$defs/tool{i}"}
            alts.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
                         "required": ["name", "arguments"], "additionalProperties": False})
        one = alts[0] if len(alts) == 1 else {"oneOf": alts}
        out = {"type": "array", "items": one, "minItems": 1} if self.parallel is True else one
        return {**out, "$defs": defs} if defs else out

    def grammar(self, to_grammar: Callable[[Any], str]) -> str:
        """The GBNF of :meth:`call_schema` (``to_grammar``: JSON schema -> GBNF, ValueError when it cannot);
        a 400 naming the tool whose ``parameters`` is not a schema llamaspec can follow."""
        try:
            return to_grammar(self.call_schema())
        except ValueError as e:
            whole = e
        for i, t in enumerate(self.tools):
            try:
                to_grammar(t["function"].get("parameters") or {"type": "object"})
            except ValueError as e:
                raise invalid(f"Field 'tools[{i}].function.parameters': not a JSON schema llamaspec can "
                              f"follow: {e}") from None
        raise invalid(f"Field 'tools': the forced call's schema is not one llamaspec can follow: {whole}")


def _local_refs(node: Any) -> Iterator[dict]:
    """Every object of ``node`` (a JSON value) whose ``$ref`` points into its own document (``#...``)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if isinstance(n.get("$ref"), str) and n["$ref"].startswith("#"):
                yield n
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)


def _has_local_ref(schema: Any) -> bool:
    return next(_local_refs(schema), None) is not None


def _rebased(schema: Any, base: str) -> Any:
    """A copy of ``schema`` whose references into itself point at it under ``base`` (a JSON pointer)."""
    out = json.loads(json.dumps(schema))
    for n in _local_refs(out):
        n["$ref"] = "#" + base + n["$ref"][1:]
    return out


def _check_tool(i: int, t: Any) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict):
        raise invalid(f"Field '{where}': expected an object {{\"type\": \"function\", \"function\": {{...}}}}, "
                      f"got {show(t)}")
    if t.get("type", "function") != "function":
        raise invalid(f"Field '{where}.type': only \"function\" tools are supported, got {show(t.get('type'))}")
    f = t.get("function")
    if not isinstance(f, dict):
        raise invalid(f"Field '{where}.function': expected an object with 'name' (and 'parameters'), got {show(f)}")
    name = f.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"Field '{where}.function.name': expected a non-empty string, got {show(name)}")
    params = f.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise invalid(f"Field '{where}.function.parameters': expected a JSON schema object, got {show(params)}")
    desc = f.get("description")
    if desc is not None and not isinstance(desc, str):
        raise invalid(f"Field '{where}.function.description': expected a string, got {show(desc)}")
    return {**t, "type": "function"}


def parse_tools(data: dict) -> ToolSpec | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request (None: no tools); 400 naming the
    field that is wrong."""
    raw = data.get("tools")
    choice = data.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise invalid(f"Field 'tool_choice': {show(choice)} needs 'tools'")
        return None
    if not isinstance(raw, list):
        raise invalid(f"Field 'tools': expected a list of tools, got {show(raw)}")
    tools = [_check_tool(i, t) for i, t in enumerate(raw)]
    names = [t["function"]["name"] for t in tools]
    spec = ToolSpec(tools, names=names)
    par = data.get("parallel_tool_calls")
    if par is not None and not isinstance(par, bool):
        raise invalid(f"Field 'parallel_tool_calls': expected true or false, got {show(par)}")
    spec.parallel = par
    if choice is None or choice in ("auto", "none", "required"):
        spec.choice = choice or "auto"
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise invalid(f"Field 'tool_choice.function.name': {show(name)} is not one of the tools "
                          f"({', '.join(names)})")
        spec.choice, spec.name = "function", name
    else:
        raise invalid(f"Field 'tool_choice': expected \"none\", \"auto\", \"required\" or "
                      f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {show(choice)}")
    return spec


class _Arguments(dict):
    """A call's arguments for a template: a dict (``| tojson``, ``.items()``), its JSON text when printed."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)


def _template_call(where: str, c: Any) -> dict:
    if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
        raise invalid(f"Field '{where}': expected {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                      f"\"arguments\"}}}}, got {show(c)}")
    f = c["function"]
    if not isinstance(f.get("name"), str) or not f["name"]:
        raise invalid(f"Field '{where}.function.name': expected a non-empty string, got {show(f.get('name'))}")
    args = f.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except ValueError:
            parsed = None
        args = _Arguments(parsed) if isinstance(parsed, dict) else args
    elif isinstance(args, dict) or args is None:
        args = _Arguments(args or {})
    else:
        raise invalid(f"Field '{where}.function.arguments': expected a JSON string, got {show(args)}")
    return {**c, "type": "function", "function": {**f, "arguments": args}}


def message_extras(m: dict, i: int) -> dict:
    """The fields of chat message ``m`` (``messages[i]``) a template reads besides ``role`` and ``content``:
    an assistant's ``tool_calls`` (their ``arguments`` as objects that print as JSON), a tool result's
    ``tool_call_id`` and ``name``."""
    out: dict = {}
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise invalid(f"Field 'messages[{i}].tool_calls': expected a list of calls, got {show(calls)}")
        if calls:
            out["tool_calls"] = [_template_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(calls)]
    for k in ("tool_call_id", "name"):
        v = m.get(k)
        if v is not None:
            if not isinstance(v, str):
                raise invalid(f"Field 'messages[{i}].{k}': expected a string, got {show(v)}")
            out[k] = v
    return out


# ---------------------------------------------------------------------------------------------------
# the model's text -> calls
# ---------------------------------------------------------------------------------------------------
def _call(obj: Any, known: list[str] | None) -> dict | None:
    """``{"name", "arguments"}`` of one JSON call (``arguments``, ``parameters``; a nested ``function``), or
    None; ``known``: the name must be one of them."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = {**obj["function"], "id": obj.get("id")}
    name = obj.get("name")
    if not isinstance(name, str) or not name or (known is not None and name not in known):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
    else:
        args = json.dumps(args, ensure_ascii=False)
    out = {"name": name, "arguments": args}
    if isinstance(obj.get("id"), str) and obj["id"]:
        out["id"] = obj["id"]
    return out


def _calls(obj: Any, known: list[str] | None) -> list[dict] | None:
    """The calls of a JSON value: one call, a list of them, ``{"tool_call": ...}`` or ``{"tool_calls": [...]}``."""
    if isinstance(obj, dict) and set(obj) in ({"tool_call"}, {"tool_calls"}):
        obj = obj.get("tool_call", obj.get("tool_calls"))
    items = obj if isinstance(obj, list) else [obj]
    out = [_call(x, known) for x in items]
    return out if out and all(c is not None for c in out) else None


def _json_values(text: str) -> list | None:
    """JSON values one after the other (whitespace or ``;`` between), or None."""
    dec, vals, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        try:
            v, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        vals.append(v)
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
    return vals or None


def _tail_calls(text: str, known: list[str]) -> list[dict] | None:
    """Calls of the text held to the end: after ``[TOOL_CALLS]``, ``<|python_tag|>``, or a whole output that
    looks like JSON or a pythonic list of calls (then the names must be the tools')."""
    if text.startswith(MISTRAL):
        out: list[dict] = []
        for seg in text.split(MISTRAL)[1:]:
            if "[ARGS]" in seg:
                name, args = seg.split("[ARGS]", 1)
                vals = _json_values(args)
                c = _call({"name": name.strip(), "arguments": vals[0]}, None) if vals and len(vals) == 1 else None
                cs = [c] if c else None
            else:
                vals = _json_values(seg)
                cs = _calls(vals[0], None) if vals and len(vals) == 1 else None
            if not cs:
                return None
            out.extend(cs)
        return out
    tagged = text.startswith(PYTHON_TAG)
    body = text[len(PYTHON_TAG):] if tagged else text.strip()
    m = _FENCE.match(body.strip())
    vals = _json_values(m.group(1) if m else body)
    if not vals:
        return pythonic_calls(body, None if tagged else known)
    out = []
    for v in vals:
        cs = _calls(v, None if tagged else known)
        if not cs:
            return None
        out.extend(cs)
    return out


def _held_prefix(buf: str) -> int:
    """How many characters at the end of ``buf`` could start a marker (held back from the content)."""
    for n in range(min(len(buf), max(map(len, _MARKERS)) - 1), 0, -1):
        if any(mk.startswith(buf[-n:]) for mk in _MARKERS):
            return n
    return 0


class ToolStream:
    """The model's text, fed as it comes, as events: ``("content", text)`` and ``("call", {"id", "type",
    "function": {"name", "arguments"}})``. A ``<tool_call>`` or `` ```tool_code`` block is a call as soon as it
    closes; what follows ``[TOOL_CALLS]`` or ``<|python_tag|>``, and an output that opens with JSON (or ``[``), is
    held to the end. What does not parse stays content, as it was written."""

    def __init__(self, spec: ToolSpec, ids: Iterator[str] | None = None):
        self.spec, self.ids = spec, ids
        self.buf, self.mode, self.started, self.n_calls = "", "text", False, 0
        self.open = ""  # the marker of the block in "tag" mode

    def _call_event(self, c: dict) -> list:
        if self.n_calls and self.spec.parallel is False:
            return []  # parallel_tool_calls false: the first call only
        self.n_calls += 1
        cid = c.get("id") or (next(self.ids) if self.ids is not None else new_call_id())
        return [("call", {"id": cid, "type": "function",
                          "function": {"name": c["name"], "arguments": c["arguments"]}})]

    def _calls(self, cs: list[dict]) -> list:
        return [e for c in cs for e in self._call_event(c)]

    def feed(self, text: str) -> list:
        self.buf += text
        out: list = []
        while True:
            if self.mode == "text":
                if not self.started:
                    s = self.buf.lstrip()
                    if not s or (len(s) < len(TOOL_CODE) and TOOL_CODE.startswith(s)):
                        return out  # "`", "```", "```tool": a fence, but which one
                    self.started = True
                    if s[0] in "{[" or (s.startswith("```") and not s.startswith(TOOL_CODE)):
                        self.mode = "json"
                        return out
                hits = [(self.buf.find(mk), mk) for mk in _MARKERS if mk in self.buf]
                if not hits:
                    n = _held_prefix(self.buf)
                    emit, self.buf = self.buf[:len(self.buf) - n], self.buf[len(self.buf) - n:]
                    if emit:
                        out.append(("content", emit))
                    return out
                at, mk = min(hits)
                if at:
                    out.append(("content", self.buf[:at]))
                self.buf = self.buf[at:]
                self.mode, self.open = ("tag", mk) if mk in _CLOSE else ("tail", "")
            elif self.mode == "tag":
                close = _CLOSE[self.open]
                end = self.buf.find(close, len(self.open))
                if end < 0:
                    return out
                block, self.buf = self.buf[:end + len(close)], self.buf[end + len(close):]
                out.extend(self._block(block))
                self.mode = "text"
            else:
                return out  # tail / json: held to the end

    def _block(self, block: str) -> list:
        body = block[len(self.open):].removesuffix(_CLOSE[self.open])
        vals = _json_values(body)
        cs = _calls(vals[0], None) if vals and len(vals) == 1 else None
        if cs is None and self.open == TOOL_CODE:
            cs = pythonic_calls(body)
        return self._calls(cs) if cs else [("content", block)]

    def finish(self) -> list:
        buf, self.buf = self.buf, ""
        if not buf:
            return []
        if self.mode == "tag":  # a block the model did not close
            return self._block(buf)
        if self.mode in ("tail", "json"):
            cs = _tail_calls(buf, self.spec.names)
            if cs:
                return self._calls(cs)
        return [("content", buf)]


def parse_output(text: str, spec: ToolSpec, ids: Iterator[str] | None = None) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a whole output: the content stripped (None when there is none but calls),
    the calls as OpenAI's ``message.tool_calls``."""
    ts = ToolStream(spec, ids)
    events = ts.feed(text) + ts.finish()
    calls = [e[1] for e in events if e[0] == "call"]
    content = "".join(e[1] for e in events if e[0] == "content")
    if not calls:
        return text, []
    return (content.strip() or None), calls
