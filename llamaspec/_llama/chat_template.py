"""Jinja2 chat templates through llama-cpp-python's ``Jinja2ChatFormatter`` (what its high-level ``Llama``
does). ``llama_cpp.llama_chat_format`` is pure Python (no native calls), and ``import llama_cpp`` has loaded it
already; re-implementing its sandboxed Jinja environment would only drift from llama-cpp-python's behaviour.

A template is compiled once (:class:`JinjaTemplate`; :func:`compiled` keeps the last few by text), not per
request: compiling a 2 KB template costs ~10 ms, rendering it well under one. :mod:`llamaspec.chat` decides
which renderer a face uses and applies llama.cpp's BOS/EOS rule to the text."""
from __future__ import annotations

import copy
import functools
from typing import Any

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

__all__ = ["JinjaTemplate", "compiled"]


class JinjaTemplate:
    """One Jinja2 chat template, compiled at construction (Jinja's syntax errors are raised here).

    ``bos_token`` / ``eos_token``: the texts the template sees as ``bos_token`` / ``eos_token``."""

    def __init__(self, template: str, *, bos_token: str, eos_token: str):
        self.template = template
        self._answer = Jinja2ChatFormatter(template=template, eos_token=eos_token, bos_token=bos_token,
                                           add_generation_prompt=True)
        # the same compiled template without the assistant's opening (the formatter fixes that at construction)
        self._no_answer = copy.copy(self._answer)
        self._no_answer.add_generation_prompt = False

    def render(self, messages: list[dict[str, Any]], *, add_assistant: bool = True,
               tools: list[dict] | None = None, **extra: Any) -> str:
        """``messages`` rendered; ``add_assistant`` appends the assistant turn's opening; ``tools`` (OpenAI's
        tool objects) and ``extra`` (``functions``, ``tool_choice``, ...) are template variables. Raises
        whatever Jinja2 raises while rendering (``raise_exception`` in a template: ``ValueError``)."""
        fmt = self._answer if add_assistant else self._no_answer
        return fmt(messages=messages, tools=tools, **extra).prompt


@functools.lru_cache(maxsize=16)
def compiled(template: str, bos_token: str, eos_token: str) -> JinjaTemplate:
    """The :class:`JinjaTemplate` of ``template`` with these special-token texts, compiled on first use."""
    return JinjaTemplate(template, bos_token=bos_token, eos_token=eos_token)
