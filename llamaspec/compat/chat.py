"""Chat for the drop-in, through llama-cpp-python's own chat handlers (``llama_cpp.llama_chat_format``).

A handler renders the messages (``chat_format`` such as ``chatml`` / ``gemma`` / ``chatml-function-calling``,
or the GGUF's Jinja template), turns ``response_format`` / ``tools`` into a grammar, and calls back
``llama.create_completion`` (here: the speculative engine) and ``llama.tokenize``; it reads ``llama.verbose``.
Handlers that drive llama.cpp themselves (the multimodal ``Llava15ChatHandler`` family) need a
``llama_cpp.Llama``.

The format is chosen as ``llama_cpp.Llama`` chooses it: ``chat_handler``, else ``chat_format``, else the registered
format whose template is the GGUF's own, else the GGUF's template (``chat_template.default``), else
``llama-2``. Beyond llama-cpp-python: OpenAI's ``{"type": "json_schema", "json_schema": {"schema": ...}}``
response format is honoured too (its schema becomes the grammar).
"""
from __future__ import annotations

import json
from typing import Any, Iterator

from .._llama import compat as lcp
from .._llama.grammar_limits import check_schema
from ..chat import ChatTemplate
from .completion import REPORT_KEY

__all__ = ["ChatHandlers"]

DEFAULT_TEMPLATE = "chat_template.default"


class ChatHandlers:
    def __init__(self, llm: Any):
        self.llm = llm
        meta = llm.metadata
        templates = {k[len("tokenizer."):]: v for k, v in meta.items() if k.startswith("tokenizer.chat_template.")}
        if "tokenizer.chat_template" in meta:
            templates[DEFAULT_TEMPLATE] = meta["tokenizer.chat_template"]
        self.templates = templates
        self._handlers: dict[str, Any] = {}

    def _template_handler(self, name: str):
        """The handler of a GGUF template: the server's and the CLI's rendering (:class:`llamaspec.chat.ChatTemplate`,
        compiled once, llama.cpp's BOS rule), in llama-cpp-python's handler (its tool/grammar handling)."""
        h = self._handlers.get(name)
        if h is None and name in self.templates:
            chat = ChatTemplate(self.templates[name], self.llm._vocab, name=f"chat_format {name!r}")

            def render(messages, *, tools=None, **kwargs):
                return chat.render_jinja(messages, add_assistant=True, tools=tools, **kwargs)

            vocab = self.llm._vocab  # the stop text as llama_cpp.Llama takes it: the EOS token's text
            stop = vocab.get_text(vocab.eos).decode("utf-8", "replace") if vocab.eos != -1 else ""
            h = lcp.formatter_chat_handler(render, eos_token=stop, eos_token_id=vocab.eos)
            self._handlers[name] = h
        return h

    def default_format(self, chat_format: "str | None", chat_handler: Any) -> "str | None":
        """The ``chat_format`` a ``llama_cpp.Llama`` with these arguments would use."""
        if chat_format is not None or chat_handler is not None:
            return chat_format
        if DEFAULT_TEMPLATE in self.templates:
            return lcp.guess_chat_format(self.llm.metadata) or DEFAULT_TEMPLATE
        return "llama-2"

    def handler(self):
        llm = self.llm
        if llm.chat_handler is not None:
            return llm.chat_handler
        return self._template_handler(llm.chat_format) or lcp.chat_handler_for(llm.chat_format)

    def complete(self, messages: list, functions=None, function_call=None, tools=None, tool_choice=None,
                 temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                 typical_p: float = 1.0, stream: bool = False, stop: "str | list[str] | None" = [],  # noqa: B006
                 seed: "int | None" = None, response_format: "dict | None" = None, max_tokens: "int | None" = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repeat_penalty: float = 1.0,
                 tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 model: "str | None" = None, logits_processor=None, grammar=None, logit_bias=None,
                 logprobs: "bool | None" = None, top_logprobs: "int | None" = None) -> "dict | Iterator[dict]":
        """``llama_cpp.Llama.create_chat_completion``'s arguments and defaults, handed to the chat handler."""
        if response_format is not None and response_format.get("type") == "json_schema":
            schema = (response_format.get("json_schema") or {}).get("schema", {})
            check_schema(schema)  # the server's limits: a 1e9 minItems is a ValueError, not the process's memory
            grammar = lcp.LlamaGrammar.from_string(lcp.json_schema_grammar(json.dumps(schema)), verbose=False)
            response_format = None
        _check_schemas(response_format, tools, tool_choice)
        self.llm._last_report = None
        out = self.handler()(
            llama=self.llm, messages=messages, functions=functions, function_call=function_call, tools=tools,
            tool_choice=tool_choice, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            typical_p=typical_p, logprobs=logprobs, top_logprobs=top_logprobs, stream=stream, stop=stop, seed=seed,
            response_format=response_format, max_tokens=max_tokens, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, repeat_penalty=repeat_penalty, tfs_z=tfs_z,
            mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, model=model,
            logits_processor=logits_processor, grammar=grammar, logit_bias=logit_bias)
        if not stream:
            if isinstance(out, dict) and self.llm._last_report is not None:
                out[REPORT_KEY] = self.llm._last_report
            return out
        return self._with_report(out)

    def _with_report(self, chunks: Iterator[dict]) -> Iterator[dict]:
        for ch in chunks:
            choices = ch.get("choices") or [{}]
            if choices[0].get("finish_reason") is not None and self.llm._last_report is not None:
                ch = dict(ch)
                ch[REPORT_KEY] = self.llm._last_report
            yield ch


def _check_schemas(response_format: "dict | None", tools: "list | None", tool_choice: Any) -> None:
    """The server's JSON-schema limits (:func:`llamaspec._llama.grammar_limits.check_schema`) on the schemas
    llama-cpp-python's handler turns into grammars itself: ``response_format``'s ``schema`` and a forced tool's
    ``parameters``. :class:`ValueError` when one is over them."""
    if isinstance(response_format, dict) and response_format.get("schema") is not None:
        check_schema(response_format["schema"])
    if isinstance(tool_choice, dict) and tools:
        for t in tools:
            fn = t.get("function") if isinstance(t, dict) else None
            if isinstance(fn, dict) and fn.get("parameters") is not None:
                check_schema(fn["parameters"])
