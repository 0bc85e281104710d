"""Chat messages -> the prompt text, as llama-server builds it: ``add_generation_prompt`` (default true),
``continue_final_message`` and the assistant prefill (a last ``assistant`` message is continued, not answered),
with ``--jinja`` (Jinja templates rendered with Jinja first) or ``--no-jinja`` (llama.cpp's built-in ones)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..chat import ChatTemplate
from ..errors import UsageError
from .errors import invalid

if TYPE_CHECKING:  # pragma: no cover
    from .state import ServerState
    from .tools import ToolSpec

__all__ = ["chat_prompt", "render"]


def _chat(state: "ServerState") -> ChatTemplate:
    chat = state.chat
    if chat is None:
        state.need_engine()  # 503 while loading
        raise invalid("the server has no chat template")
    return chat


def render(state: "ServerState", messages: list[dict[str, str]], add_assistant: bool,
           tools: list[dict] | None = None) -> str:
    """``messages`` through the server's template (:meth:`llamaspec.chat.ChatTemplate.render`: Jinja first under
    ``--jinja``, llama.cpp's BOS rule); ``tools``: the template's ``tools`` (Jinja only)."""
    try:
        return _chat(state).render(messages, add_assistant=add_assistant, tools=tools)
    except UsageError as e:
        raise invalid(str(e)) from None


def _flag(data: dict, name: str, default: Any) -> Any:
    v = data.get(name)
    if v is None:
        return default
    if name == "continue_final_message" and isinstance(v, str):
        return v.strip().lower() not in ("", "none", "false")
    if not isinstance(v, bool):
        raise invalid(f"Field '{name}': expected true or false, got {v!r}")
    return v


def chat_prompt(state: "ServerState", data: dict, messages: list[dict[str, str]], spec: "ToolSpec | None" = None) -> str:
    """The prompt text of a chat request (``data`` its JSON body, ``messages`` as parsed, ``spec`` its tools as
    parsed: they go to the template with ``--jinja``, a 400 without, llama-server's answer)."""
    tools = spec.tools if spec is not None and spec.render else None
    if tools and not _jinja_mode(state):
        raise invalid("tools param requires --jinja flag (and a Jinja chat template)")
    add_gen = _flag(data, "add_generation_prompt", True)
    cont = _flag(data, "continue_final_message", False)
    if not cont and messages and messages[-1]["role"] == "assistant":  # llama-server's assistant prefill
        if len(messages) >= 2 and messages[-2]["role"] == "assistant":
            raise invalid("Cannot have 2 or more assistant messages at the end of the list.")
        cont, add_gen = True, False
    if cont and add_gen:
        raise invalid("Cannot set both add_generation_prompt and continue_final_message to true.")
    if not cont:
        return render(state, messages, add_gen, tools)
    last = messages[-1]["content"] if messages else ""
    if messages and messages[-1]["role"] == "assistant" and _jinja_mode(state):
        # llama-server: the turns before it, the assistant's opening, then its text
        return render(state, messages[:-1], True, tools) + _prefill_text(data, last)
    if messages and messages[-1]["role"] == "assistant" and last:
        text = render(state, messages, False)
        at = text.rfind(last)
        if at >= 0:  # the template's end-of-turn after the final message is dropped: the model continues it
            return text[:at + len(last)]
        return render(state, messages[:-1], True) + last
    return render(state, messages, False, tools)


def _jinja_mode(state: "ServerState") -> bool:
    """The server renders its template with Jinja (``--jinja`` and a Jinja template)."""
    return state.chat is not None and state.chat.jinja


def _prefill_text(data: dict, parsed: str) -> str:
    """The text of a final assistant message that the model continues: its text parts joined with a blank
    line (llama-server's ``render_content``), its string content as it is."""
    raw = data.get("messages")
    content = raw[-1].get("content") if isinstance(raw, list) and raw and isinstance(raw[-1], dict) else None
    if not isinstance(content, list):
        return parsed
    return "\n\n".join(p if isinstance(p, str) else p["text"] for p in content)
