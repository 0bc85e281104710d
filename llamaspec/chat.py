"""Chat templates: a list of ``{"role", "content"}`` messages -> the prompt text, one rendering for every face
(``generate --chat``, ``serve``'s chat routes and ``/apply-template``, ``llamaspec.Llama``'s GGUF template).

As llama.cpp's ``common_chat_templates_apply`` (common/chat.cpp) does it:

* A Jinja template is rendered with Jinja first (llama-server's default ``--jinja``), through llama-cpp-python's
  ``Jinja2ChatFormatter`` (:mod:`llamaspec._llama.chat_template`), compiled once per template; when Jinja cannot
  render it (and no tools are asked for), llama.cpp's built-in matcher may still know it. With ``jinja=False``
  (``--no-jinja``) or a template name (``chatml``), the built-in matcher comes first.
* **The BOS/EOS rule.** The template sees the BOS and EOS texts as ``bos_token`` / ``eos_token``. When the
  vocabulary adds BOS itself and Jinja's output starts with the BOS text, that text is cut; likewise an EOS text
  at the end when the vocabulary adds EOS. The text is then tokenised with ``add_special=True,
  parse_special=True`` (:data:`TOKENIZE`), so a ``{{ bos_token }}`` template (Llama 3, Mistral, Gemma 3) gives one
  BOS, as in llama-server, not two.
"""
from __future__ import annotations

from typing import Any

from . import _llama as llama
from ._llama.chat_template import JinjaTemplate, compiled
from .errors import UsageError

__all__ = ["ChatTemplate", "apply_chat_template", "TOKENIZE"]

#: how a rendered chat prompt is tokenised (llama-server's ``tokenize_input_prompts(..., true, true)``)
TOKENIZE = {"add_special": True, "parse_special": True}


def is_jinja(template: str) -> bool:
    """Whether ``template`` is Jinja (else a built-in template's name such as ``chatml``)."""
    return "{%" in template or "{{" in template


def special_piece(vocab: Any, token: int | None) -> str:
    """The text of a special token as llama.cpp's templates see it (``""`` when the vocabulary has none)."""
    if vocab is None or token is None or token < 0:
        return ""
    return vocab.token_to_piece(token, special=True).decode("utf-8", "replace")


class ChatTemplate:
    """One model's chat template with that model's special tokens: what :meth:`render` needs, held once.

    ``vocab``: the model's vocabulary (its BOS/EOS texts and whether it adds them; None: no special tokens);
    ``jinja``: Jinja first (``--jinja``, the default) or the built-in matcher first (``--no-jinja``)."""

    def __init__(self, template: str, vocab: Any = None, *, jinja: bool = True, name: str = "the model"):
        self.template = template
        self.name = name
        self.bos_text = special_piece(vocab, getattr(vocab, "bos", None))
        self.eos_text = special_piece(vocab, getattr(vocab, "eos", None))
        self.add_bos = bool(getattr(vocab, "add_bos", False))
        self.add_eos = bool(getattr(vocab, "add_eos", False))
        #: renders with Jinja first
        self.jinja = jinja and is_jinja(template)

    @classmethod
    def of_model(cls, model: llama.Model, template: str | None = None, *, jinja: bool = True) -> "ChatTemplate":
        """``model``'s template (``template`` instead when given); :class:`UsageError` when it has none."""
        tmpl = template if template is not None else model.chat_template()
        if tmpl is None:
            raise UsageError(
                f"model {model.path.name} has no chat template (tokenizer.chat_template); drop --chat and "
                "format the prompt yourself"
            )
        return cls(tmpl, model.vocab, jinja=jinja, name=f"model {model.path.name}")

    def compiled(self) -> JinjaTemplate:
        """The Jinja template, compiled on first use and then shared (Jinja's syntax errors raise here)."""
        return compiled(self.template, self.bos_text, self.eos_text)

    def render_jinja(self, messages: list[dict[str, Any]], *, add_assistant: bool = True,
                     tools: list[dict] | None = None, **extra: Any) -> str:
        """Jinja's output with llama.cpp's BOS/EOS rule applied (the module docstring); Jinja's errors raise."""
        text = self.compiled().render(messages, add_assistant=add_assistant, tools=tools, **extra)
        if self.add_bos and self.bos_text and text.startswith(self.bos_text):
            text = text[len(self.bos_text):]
        if self.add_eos and self.eos_text and text.endswith(self.eos_text):
            text = text[:-len(self.eos_text)]
        return text

    def render(self, messages: list[dict[str, Any]], *, add_assistant: bool = True,
               tools: list[dict] | None = None) -> str:
        """The prompt text of ``messages``, to tokenise with :data:`TOKENIZE`; ``add_assistant`` appends the
        assistant turn's opening; ``tools`` go to a Jinja template. :class:`UsageError` when the template cannot
        render them."""
        tools = tools or None
        try:
            if self.jinja:
                try:
                    return self.render_jinja(messages, add_assistant=add_assistant, tools=tools)
                except Exception:  # noqa: BLE001 - Jinja cannot render it: the built-in matcher may know it
                    text = None if tools else llama.render_builtin_chat_template(self.template, messages,
                                                                                 add_assistant=add_assistant)
                    if text is None:
                        raise
                    return text
            text = llama.render_builtin_chat_template(self.template, messages, add_assistant=add_assistant)
            if text is not None:
                return text
            return self.render_jinja(messages, add_assistant=add_assistant, tools=tools)
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 - Jinja's own errors (raise_exception in a template, ...)
            raise UsageError(f"could not apply the chat template of {self.name}: {e}") from e


def apply_chat_template(
    model: llama.Model,
    messages: list[dict[str, str]],
    *,
    add_assistant: bool = True,
    template: str | None = None,
    jinja: bool = True,
) -> str:
    """Render ``messages`` with ``template`` (default: the model's own, ``tokenizer.chat_template``):
    :meth:`ChatTemplate.render`, the text to tokenise with :data:`TOKENIZE`.

    ``add_assistant`` appends the assistant turn's opening, so the model answers next.
    """
    return ChatTemplate.of_model(model, template, jinja=jinja).render(messages, add_assistant=add_assistant)
