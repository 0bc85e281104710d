"""OpenAI's Responses API (``POST /v1/responses``) over the chat path, as llama-server serves it.

A request becomes a chat completion request (:func:`to_chat`): ``instructions`` is a system message,
``input`` a string (one user message) or a list of input items (messages with ``input_text`` /
``output_text`` parts; consecutive assistant items are one message), ``max_output_tokens`` is ``max_tokens``,
``text.format`` a ``response_format``. Function tools (``{"type": "function", "name", "parameters"}``) are the
chat request's ``tools``, ``tool_choice`` (``{"type": "function", "name"}`` for a named one) its
``tool_choice``; ``function_call`` input items are the assistant's ``tool_calls``, ``function_call_output``
items ``tool`` messages. Other tool types (OpenAI's hosted ``web_search``, ``file_search``, ...) are skipped, as
llama-server skips them. What llamaspec cannot do (images, files, custom tools, a previous response) is a 400
naming the item. The answer is a ``response`` object (its ``output``: a ``message`` item, then one
``function_call`` item per call); a stream is llama-server's sequence of events, each sent as ``event: TYPE`` +
``data: {json}``: ``response.created``, ``response.in_progress`` (also one per prompt-progress report with
``return_progress``), ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``..., a call as ``response.output_item.added``,
``response.function_call_arguments.delta`` / ``.done`` and ``response.output_item.done`` once it is complete,
then ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done`` and
``response.completed`` (with ``usage``, and ``timings`` next to it), no ``[DONE]``. Each event also has
OpenAI's ``sequence_number`` and ``output_index`` (the official client's ``responses.stream()`` needs them).

>>> to_chat({"input": "Hi", "instructions": "Be brief", "max_output_tokens": 4})["messages"]
[{'role': 'system', 'content': 'Be brief'}, {'role': 'user', 'content': [{'type': 'text', 'text': 'Hi'}]}]
"""
from __future__ import annotations

import json
import uuid
import logging
from typing import TYPE_CHECKING, Any

from .. import _llama as llama
from . import cancel, formats
from .errors import invalid
from .render import Output
from .respond import Renderer, Served, dumps

if TYPE_CHECKING:  # pragma: no cover
    from ..request import Request

__all__ = ["to_chat", "ResponsesRenderer"]

_INPUT_ROLES = ("user", "system", "developer")
log = logging.getLogger("llamaspec.server")


def _text_parts(where: str, content: Any, kinds: tuple[str, ...]) -> list[dict]:
    """The text parts of one input item's ``content`` (a string or a list of parts of ``kinds``)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(f"Field '{where}.content': expected a string or a list of content parts")
    out = []
    for j, part in enumerate(content):
        t = part.get("type") if isinstance(part, dict) else None
        if t in kinds:
            if not isinstance(part.get("text"), str):
                raise invalid(f"Field '{where}.content[{j}]': a '{t}' part needs a string 'text'")
            out.append({"type": "text", "text": part["text"]})
        elif t in ("input_image", "input_file", "input_audio"):
            raise invalid(f"Field '{where}.content[{j}]': '{t}' is not supported: this server is text-only")
        else:
            raise invalid(f"Field '{where}.content[{j}]': 'type' must be one of {', '.join(repr(k) for k in kinds)}, "
                          f"got {json.dumps(t)}")
    return out


def _string(where: str, item: dict, key: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or (key != "arguments" and not v):
        raise invalid(f"Field '{where}.{key}': a '{item.get('type')}' item needs a string '{key}'")
    return v


def _function_call(where: str, item: dict, msgs: list[dict]) -> None:
    """A ``function_call`` item: a call in the previous assistant message's ``tool_calls`` (a new assistant
    message when the previous one is not the assistant's)."""
    call = {"id": _string(where, item, "call_id"), "type": "function",
            "function": {"name": _string(where, item, "name"), "arguments": _string(where, item, "arguments")}}
    if msgs and msgs[-1]["role"] == "assistant":
        msgs[-1].setdefault("tool_calls", []).append(call)
    else:
        msgs.append({"role": "assistant", "content": [], "tool_calls": [call]})


def _function_output(where: str, item: dict) -> dict:
    """A ``function_call_output`` item: a ``tool`` message (``output`` a string or ``input_text`` parts)."""
    out = item.get("output")
    if isinstance(out, list):
        out = _output_parts(where, out)
    elif not isinstance(out, str):
        raise invalid(f"Field '{where}.output': expected a string or a list of 'input_text' parts")
    return {"role": "tool", "tool_call_id": _string(where, item, "call_id"), "content": out}


def _output_parts(where: str, parts: list) -> list[dict]:
    out = []
    for j, part in enumerate(parts):
        t = part.get("type") if isinstance(part, dict) else None
        if t == "input_text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif t in ("input_image", "input_file"):
            raise invalid(f"Field '{where}.output[{j}]': '{t}' is not supported: this server is text-only")
        else:
            raise invalid(f"Field '{where}.output[{j}]': expected an 'input_text' part with a string 'text'")
    return out


def _messages(items: list) -> list[dict]:
    msgs: list[dict] = []
    for i, item in enumerate(items):
        if i % cancel.EVERY == 0:  # 100k items take a second: stop when the client left
            cancel.check()
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"Field '{where}': expected an input item (an object with 'role' and 'content')")
        role, kind = item.get("role"), item.get("type")
        if kind == "function_call":
            _function_call(where, item, msgs)
            continue
        if kind == "function_call_output":
            msgs.append(_function_output(where, item))
            continue
        if kind in ("custom_tool_call", "custom_tool_call_output"):
            raise invalid(f"Field '{where}': '{kind}' items are not supported: llamaspec serve calls function tools")
        if kind == "reasoning":
            raise invalid(f"Field '{where}': 'reasoning' items are not supported by llamaspec serve")
        if kind not in (None, "message"):
            raise invalid(f"Field '{where}': unknown item type {json.dumps(kind)} (llamaspec takes 'message' items)")
        if role in _INPUT_ROLES:
            msgs.append({"role": role, "content": _text_parts(where, item.get("content"), ("input_text",))})
        elif role == "assistant":
            parts = _text_parts(where, item.get("content", ""), ("output_text", "input_text"))
            if msgs and msgs[-1]["role"] == "assistant":  # llama-server merges consecutive assistant items
                msgs[-1]["content"].extend(parts)
            else:
                msgs.append({"role": "assistant", "content": parts})
        else:
            raise invalid(f"Field '{where}.role': expected one of user, system, developer, assistant, "
                          f"got {json.dumps(role)}")
    return msgs


def _response_format(fmt: Any) -> dict | None:
    """``text.format`` of the Responses API as a chat ``response_format`` (llama-server drops it): ``{"type":
    "json_schema", "name", "schema", "strict"}`` constrains the output with the schema's grammar (``strict`` or
    not: a grammar is always strict), ``{"type": "json_object"}`` to any JSON object, ``{"type": "text"}`` not
    at all; anything else a 400 naming the field.

    >>> _response_format({"type": "json_schema", "name": "n", "schema": {"const": 1}, "strict": True})
    {'type': 'json_schema', 'json_schema': {'name': 'n', 'schema': {'const': 1}}}
    """
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid("Field 'text.format': expected an object such as {\"type\": \"json_schema\", \"name\": ..., "
                      f"\"schema\": {{...}}}}, got {json.dumps(fmt)[:60]}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise invalid(f"Field 'text.format.type': expected \"text\", \"json_object\" or \"json_schema\", got "
                      f"{json.dumps(kind)[:60]}")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise invalid("Field 'text.format.schema': a \"json_schema\" format needs its JSON schema (an object), got "
                      f"{json.dumps(schema)[:60]}")
    if fmt.get("name") is not None and not isinstance(fmt["name"], str):
        raise invalid(f"Field 'text.format.name': expected a string, got {json.dumps(fmt['name'])[:60]}")
    try:  # the message names the field the client wrote (the chat path would name response_format's)
        llama.json_schema_to_grammar(schema or {"type": "object"})
    except ValueError as e:
        raise invalid(f"Field 'text.format.schema': not a JSON schema llamaspec can follow: {e}") from None
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": schema}}


def _tools(raw: Any) -> list[dict]:
    """The Responses API's function tools as chat tools (``{"type": "function", "function": {...}}``); the
    other tool types skipped with a warning, as llama-server does."""
    if not isinstance(raw, list):
        raise invalid("Field 'tools': expected a list of tools such as {\"type\": \"function\", \"name\": ...}")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise invalid(f"Field 'tools[{i}]': expected an object {{\"type\": \"function\", \"name\", \"parameters\"}}")
        kind = t.get("type")
        if kind != "function":
            log.warning("a Responses tool of type %r is skipped: only function tools are offered to the model", kind)
            continue
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise invalid(f"Field 'tools[{i}].name': expected a non-empty string")
        if t.get("parameters") is not None and not isinstance(t["parameters"], dict):
            raise invalid(f"Field 'tools[{i}].parameters': expected a JSON schema object")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type" and v is not None}})
    return out


def _tool_choice(choice: Any, tools: list[dict]) -> Any:
    """``tool_choice`` of the Responses API as the chat one."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        names = [t["function"]["name"] for t in tools]
        if choice.get("name") not in names:
            raise invalid(f"Field 'tool_choice.name': {json.dumps(choice.get('name'))} is not one of the function "
                          f"tools ({', '.join(names) or 'none given'})")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("Field 'tool_choice': expected \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                  f"\"name\": ...}}, got {json.dumps(choice)[:60]}")


def to_chat(body: dict) -> dict:
    """A Responses API request body as the chat completion request it stands for (400 on what is not there
    or not supported)."""
    if "input" not in body or body["input"] is None:
        raise invalid("'input' is required: a string or a list of input items")
    if body.get("previous_response_id"):
        raise invalid("Field 'previous_response_id' is not supported: send the whole conversation in 'input'")
    out = {k: v for k, v in body.items() if k not in ("input", "instructions", "max_output_tokens", "text",
                                                     "reasoning", "previous_response_id", "store", "tools",
                                                     "tool_choice")}
    tools = _tools(body["tools"]) if body.get("tools") is not None else []
    if tools:
        out["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"), tools)
    if choice is not None:
        out["tool_choice"] = choice
    msgs: list[dict] = []
    instr = body.get("instructions")
    if instr is not None:
        if not isinstance(instr, str):
            raise invalid("Field 'instructions': expected a string")
        msgs.append({"role": "system", "content": instr})
    inp = body["input"]
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": [{"type": "text", "text": inp}]})
    elif isinstance(inp, list):
        msgs.extend(_messages(inp))
    else:
        raise invalid("Field 'input': expected a string or a list of input items")
    if not msgs:
        raise invalid("Field 'input': the list of input items is empty")
    out["messages"] = msgs
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise invalid("Field 'text': expected an object such as {\"format\": {\"type\": \"text\"}}")
        rf = _response_format(text.get("format"))
        if rf is not None and out.get("response_format") is None:
            out["response_format"] = rf
    return out


def _call_item(call: dict, status: str = "completed") -> dict:
    """A chat ``tool_calls`` entry as a Responses ``function_call`` output item (llama-server's ids: ``fc_``,
    ``call_``)."""
    f = call["function"]
    return {"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call", "status": status,
            "arguments": f["arguments"] if status == "completed" else "", "call_id": call["id"], "name": f["name"]}


class ResponsesRenderer(Renderer):
    """``/v1/responses``: a ``response`` object, or llama-server's stream of Responses events (``tools``: the
    request's, when the output is parsed into function calls)."""

    def __init__(self, served: Served):
        super().__init__(served)
        self.id = "resp_" + uuid.uuid4().hex  # OpenAI's (and llama-server's) prefixes: resp_, msg_
        self.msg_id = "msg_" + uuid.uuid4().hex
        self.created = formats.now()
        self._output = Output(self.tools, self.fmt)
        self._begun = False
        self._msg_index: int | None = None  # the message item's output_index once its text began
        self._text = ""  # the message's text so far (a stream)
        self._items: list[tuple[int, dict]] = []  # (output_index, item) of the calls streamed
        self._seq = 0

    def encode(self, obj: dict) -> bytes:
        obj = {**obj, "sequence_number": self._seq}
        self._seq += 1
        return b"event: " + obj["type"].encode() + b"\ndata: " + dumps(obj) + b"\n\n"

    def _stub(self) -> dict:
        return {"id": self.id, "object": "response", "status": "in_progress"}

    def _begin(self, extra: dict | None = None):
        """``response.created`` + ``response.in_progress`` once; later, an ``in_progress`` per progress report
        (``extra``: its ``prompt_progress`` and ``timings``)."""
        if not self._begun:
            self._begun = True
            yield {"type": "response.created", "response": self._stub()}
            yield {"type": "response.in_progress", "response": self._stub(), **(extra or {})}
        elif extra is not None:
            yield {"type": "response.in_progress", "response": self._stub(), **extra}

    def _next_index(self) -> int:
        return len(self._items) + (self._msg_index is not None)

    def _text_events(self, text: str):
        if self._msg_index is None:
            self._msg_index = self._next_index()
            yield {"type": "response.output_item.added", "output_index": self._msg_index,
                   "item": {"content": [], "id": self.msg_id, "role": "assistant", "status": "in_progress",
                            "type": "message"}}
            yield {"type": "response.content_part.added", "item_id": self.msg_id, "output_index": self._msg_index,
                   "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}
        self._text += text
        yield {"type": "response.output_text.delta", "item_id": self.msg_id, "output_index": self._msg_index,
               "content_index": 0, "delta": text}

    def _call_events(self, call: dict):
        """A complete call: its item added, its arguments in one delta, done."""
        k = self._next_index()
        item = _call_item(call)
        self._items.append((k, item))
        yield {"type": "response.output_item.added", "output_index": k, "item": _call_item(call, "in_progress")}
        yield {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": k,
               "delta": item["arguments"]}
        yield {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": k,
               "name": item["name"], "arguments": item["arguments"]}
        yield {"type": "response.output_item.done", "output_index": k, "item": item}

    def _events(self, events):
        for kind, v in events:
            yield from (self._text_events(v) if kind == "content" else self._call_events(v))

    def stream_chunk(self, i, req, ch):
        if getattr(ch, "progress", None) is not None:
            yield from self._begin(self.progress(ch))
            return
        if not ch.text:
            return
        yield from self._begin()
        evs = list(self._events(self._output.feed(ch.text)))
        if evs and self.gen.timings_per_token:
            evs[-1]["timings"] = self.timings(req.stats)
        yield from evs

    def _message(self, text: str) -> dict:
        part = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
        return {"type": "message", "status": "completed", "id": self.msg_id, "content": [part], "role": "assistant"}

    @staticmethod
    def _usage(req: "Request") -> dict:
        st, n = req.stats, formats.n_predicted(req.stats)
        return {"input_tokens": st.n_prompt, "output_tokens": n, "total_tokens": st.n_prompt + n,
                "input_tokens_details": {"cached_tokens": int(getattr(st, "n_cached", 0) or 0)}}

    def stream_finish(self, i, req):
        yield from self._begin()
        yield from self._events(self._output.finish())
        output = sorted(self._items, key=lambda x: x[0])
        if self._msg_index is not None:
            msg = self._message(self._text)
            part = msg["content"][0]
            k = self._msg_index
            yield {"type": "response.output_text.done", "item_id": self.msg_id, "output_index": k, "content_index": 0,
                   "text": self._text}
            yield {"type": "response.content_part.done", "item_id": self.msg_id, "output_index": k,
                   "content_index": 0, "part": part}
            yield {"type": "response.output_item.done", "output_index": k, "item": msg}
            output = sorted(output + [(k, msg)], key=lambda x: x[0])
        yield {"type": "response.completed",
               "response": {"id": self.id, "object": "response", "created_at": formats.now(), "status": "completed",
                            "model": self.model, "output": [item for _, item in output], "usage": self._usage(req)},
               "timings": self.timings(req.stats)}

    def whole(self, reqs):
        req = reqs[0]
        text, calls = self._output.whole(req.text)
        output = ([self._message(text)] if text else []) + [_call_item(c) for c in calls]
        return {"completed_at": formats.now(), "created_at": self.created, "id": self.id, "model": self.model,
                "object": "response", "output": output, "status": "completed", "usage": self._usage(req)}
