"""Jinja2 chat templates through llama-cpp-python's ``Jinja2ChatFormatter`` (what its high-level ``Llama``
does). ``llama_cpp.llama_chat_format`` is pure Python (no native calls), and ``import llama_cpp`` has loaded it
already; re-implementing its sandboxed Jinja environment would only drift from llama-cpp-python's behaviour.
:func:`llamaspec.chat.apply_chat_template` tries llama.cpp's built-in templates first."""
from __future__ import annotations

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

__all__ = ["render_jinja_chat_template"]


def render_jinja_chat_template(template: str, messages: list[dict[str, str]], *, bos_token: str, eos_token: str,
                               add_assistant: bool = True, tools: list[dict] | None = None) -> str:
    """Render ``messages`` with the Jinja2 ``template``; ``add_assistant`` appends the assistant turn's opening;
    ``tools`` (OpenAI's tool objects) are the template's ``tools``. Raises whatever Jinja2 raises on a template it
    cannot parse or render."""
    fmt = Jinja2ChatFormatter(
        template=template,
        eos_token=eos_token,
        bos_token=bos_token,
        add_generation_prompt=add_assistant,
    )
    return fmt(messages=messages, tools=tools or None).prompt
