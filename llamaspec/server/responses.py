"""OpenAI's Responses API (``POST /v1/responses``) over the chat path, as llama-server serves it.

A request becomes a chat completion request (:func:`to_chat`): ``instructions`` is a system message,
``input`` a string (one user message) or a list of input items (messages with ``input_text`` /
``output_text`` parts; consecutive assistant items are one message), ``max_output_tokens`` is ``max_tokens``,
``text.format`` a ``response_format``. What llamaspec cannot do (images, files, tool calls, a previous
response) is a 400 naming the item. The answer is a ``response`` object; a stream is llama-server's
sequence of events, each sent as ``event: TYPE`` + ``data: {json}``: ``response.created``,
``response.in_progress`` (also one per prompt-progress report with ``return_progress``),
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``..., then
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done`` and
``response.completed`` (with ``usage``, and ``timings`` next to it), no ``[DONE]``.

>>> to_chat({"input": "Hi", "instructions": "Be brief", "max_output_tokens": 4})["messages"]
[{'role': 'system', 'content': 'Be brief'}, {'role': 'user', 'content': [{'type': 'text', 'text': 'Hi'}]}]
"""
from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from . import formats
from .errors import invalid
from .jobs import Renderer, dumps

if TYPE_CHECKING:  # pragma: no cover
    from ..request import Request
    from .parsing import GenParams
    from .state import ServerState

__all__ = ["to_chat", "ResponsesRenderer"]

_INPUT_ROLES = ("user", "system", "developer")


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


def _messages(items: list) -> list[dict]:
    msgs: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"Field '{where}': expected an input item (an object with 'role' and 'content')")
        role, kind = item.get("role"), item.get("type")
        if kind in ("function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output"):
            raise invalid(f"Field '{where}': '{kind}' items are not supported: llamaspec serve does no tool calls")
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
    """``text.format`` of the Responses API as a chat ``response_format``."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid("Field 'text.format': expected an object such as {\"type\": \"json_schema\", \"schema\": {...}}")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
    return fmt


def to_chat(body: dict) -> dict:
    """A Responses API request body as the chat completion request it stands for (400 on what is not there
    or not supported)."""
    if "input" not in body or body["input"] is None:
        raise invalid("'input' is required: a string or a list of input items")
    if body.get("previous_response_id"):
        raise invalid("Field 'previous_response_id' is not supported: send the whole conversation in 'input'")
    out = {k: v for k, v in body.items() if k not in ("input", "instructions", "max_output_tokens", "text",
                                                     "reasoning", "previous_response_id", "store")}
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
    n = out.get("n")
    if n is not None and n != 1:
        raise invalid("Field 'n': the Responses API gives one answer per request")
    return out


class ResponsesRenderer(Renderer):
    """``/v1/responses``: a ``response`` object, or llama-server's stream of Responses events."""

    openai = False  # the stream ends with response.completed, no [DONE]

    def __init__(self, state: "ServerState", gen: "GenParams", model: str):
        self.state, self.gen, self.model = state, gen, model
        self.id = "resp_" + uuid.uuid4().hex  # OpenAI's (and llama-server's) prefixes: resp_, msg_
        self.msg_id = "msg_" + uuid.uuid4().hex
        self.created = formats.now()
        self._begun = False
        self._text_begun = False

    def encode(self, obj: dict) -> bytes:
        return b"event: " + obj["type"].encode() + b"\ndata: " + dumps(obj) + b"\n\n"

    def _timings(self, st) -> dict:
        eng = self.state.engine
        return formats.timings(st, speculative=eng is not None and getattr(eng, "chain", None) is not None)

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

    def stream_chunk(self, i, req, ch):
        progress = getattr(ch, "progress", None)
        if progress is not None:
            eng = self.state.engine
            yield from self._begin(formats.progress_fields(
                progress, with_timings=self.gen.timings_per_token,
                speculative=eng is not None and getattr(eng, "chain", None) is not None))
            return
        if not ch.text:
            return
        yield from self._begin()
        if not self._text_begun:
            self._text_begun = True
            yield {"type": "response.output_item.added", "item": {"content": [], "id": self.msg_id,
                                                                  "role": "assistant", "status": "in_progress",
                                                                  "type": "message"}}
            yield {"type": "response.content_part.added", "item_id": self.msg_id,
                   "part": {"type": "output_text", "text": ""}}
        d = {"type": "response.output_text.delta", "item_id": self.msg_id, "delta": ch.text}
        if self.gen.timings_per_token:
            d["timings"] = self._timings(req.stats)
        yield d

    def _output(self, text: str) -> list[dict]:
        if not text:
            return []
        part = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
        return [{"type": "message", "status": "completed", "id": self.msg_id, "content": [part],
                 "role": "assistant"}]

    @staticmethod
    def _usage(req: "Request") -> dict:
        st = req.stats
        return {"input_tokens": st.n_prompt, "output_tokens": st.n_predicted, "total_tokens": st.n_prompt + st.n_predicted,
                "input_tokens_details": {"cached_tokens": int(getattr(st, "n_cached", 0) or 0)}}

    def stream_finish(self, i, req):
        yield from self._begin()
        output = self._output(req.text)
        if output:
            part = output[0]["content"][0]
            yield {"type": "response.output_text.done", "item_id": self.msg_id, "text": req.text}
            yield {"type": "response.content_part.done", "item_id": self.msg_id, "part": part}
            yield {"type": "response.output_item.done", "item": output[0]}
        yield {"type": "response.completed",
               "response": {"id": self.id, "object": "response", "created_at": formats.now(), "status": "completed",
                            "model": self.model, "output": output, "usage": self._usage(req)},
               "timings": self._timings(req.stats)}

    def whole(self, reqs):
        req = reqs[0]
        t = formats.now()
        return {"completed_at": t, "created_at": self.created, "id": self.id, "model": self.model,
                "object": "response", "output": self._output(req.text), "status": "completed",
                "usage": self._usage(req)}
