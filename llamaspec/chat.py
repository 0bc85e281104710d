"""Chat templates: render a list of ``{"role", "content"}`` messages into a prompt string.

llama.cpp's built-in template matcher is tried first; templates it does not know are rendered with
Jinja2 through llama-cpp-python's ``Jinja2ChatFormatter`` (what its high-level ``Llama`` does), reached
through :mod:`llamaspec._llama.chat_template`.
"""
from __future__ import annotations

from . import _llama as llama
from ._llama.chat_template import render_jinja_chat_template
from .errors import UsageError


def apply_chat_template(
    model: llama.Model,
    messages: list[dict[str, str]],
    *,
    add_assistant: bool = True,
    template: str | None = None,
) -> str:
    """Render ``messages`` with ``template`` (default: the model's own, ``tokenizer.chat_template``).

    ``add_assistant`` appends the assistant turn's opening, so the model answers next.
    """
    tmpl = template if template is not None else model.chat_template()
    if tmpl is None:
        raise UsageError(
            f"model {model.path.name} has no chat template (tokenizer.chat_template); drop --chat and "
            "format the prompt yourself"
        )
    text = llama.render_builtin_chat_template(tmpl, messages, add_assistant=add_assistant)
    if text is not None:
        return text
    try:
        vocab = model.vocab
        return render_jinja_chat_template(tmpl, messages, eos_token=_special_piece(vocab, vocab.eos),
                                          bos_token=_special_piece(vocab, vocab.bos), add_assistant=add_assistant)
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"could not apply the chat template of {model.path.name}: {e}") from e


def _special_piece(vocab: llama.Vocab, token: int) -> str:
    """The text of a special token (``""`` when the vocabulary has none)."""
    return vocab.token_to_piece(token, special=True).decode("utf-8", "replace") if token >= 0 else ""
