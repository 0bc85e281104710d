"""What :mod:`llamaspec.compat` (the ``llama_cpp.Llama`` drop-in and the ``LlamaDraftModel`` adapter) needs of
llama-cpp-python's high-level layer: its chat handlers, its grammar class, its JSON-schema converter and its
draft-model base class, plus the GGUF metadata as ``Llama.metadata`` reads it. Thin accessors only: the
behaviour is llama-cpp-python's own.
"""
from __future__ import annotations

from typing import Any, Callable

from llama_cpp import llama_cpp as native
from llama_cpp import llama_chat_format as _chat_format
from llama_cpp.llama_grammar import LlamaGrammar, json_schema_to_gbnf
from llama_cpp.llama_tokenizer import BaseLlamaTokenizer  # noqa: F401 - the base of compat's LlamaTokenizer
from llama_cpp.llama_speculative import LlamaDraftModel

from .context import GGML_TYPE_F16, GGML_TYPE_F32
from .model import Model
from .sampler import DEFAULT_SEED
from .vocab import text_of

__all__ = [
    "LlamaDraftModel", "LlamaGrammar", "chat_handler_for",
    "formatter_chat_handler", "grammar_text", "guess_chat_format", "json_schema_grammar", "metadata",
    "special_tokens", "model_kind", "fim_tokens", "GGML_TYPE_F16", "GGML_TYPE_F32", "split_mode_name", "DEFAULT_SEED",
]


def metadata(model: Model) -> dict[str, str]:
    """Every GGUF metadata key of ``model`` with its value as a string (what ``llama_cpp.Llama.metadata``
    holds; arrays are not returned by llama.cpp)."""
    ptr = model.live_ptr()
    out: dict[str, str] = {}
    for i in range(int(native.llama_model_meta_count(ptr))):
        key = text_of(lambda b, k: native.llama_model_meta_key_by_index(ptr, i, b, k))
        if key:
            out[key] = text_of(lambda b, k: native.llama_model_meta_val_str_by_index(ptr, i, b, k)) or ""
    return out


def special_tokens(model: Model) -> dict[str, int]:
    """``sep`` / ``nl`` token ids of ``model``'s vocabulary (-1 when it has none; llama.cpp's ``cls`` is its BOS)."""
    v = model.vocab.ptr
    return {"sep": int(native.llama_vocab_sep(v)),
            "nl": int(native.llama_vocab_nl(v))}


def model_kind(model: Model) -> tuple[bool, bool]:
    """``(recurrent, hybrid)``: llama.cpp's ``llama_model_is_recurrent`` / ``llama_model_is_hybrid``."""
    ptr = model.live_ptr()
    return bool(native.llama_model_is_recurrent(ptr)), bool(native.llama_model_is_hybrid(ptr))


def fim_tokens(model: Model) -> tuple[int, int, int]:
    """``(prefix, suffix, middle)`` fill-in-the-middle token ids of ``model`` (-1 where it has none)."""
    return model.vocab.fim[:3]


def split_mode_name(value: int) -> str:
    """llamaspec's split-mode name for one of llama-cpp-python's ``LLAMA_SPLIT_MODE_*`` integers."""
    names = {int(native.LLAMA_SPLIT_MODE_NONE): "none", int(native.LLAMA_SPLIT_MODE_LAYER): "layer",
             int(native.LLAMA_SPLIT_MODE_ROW): "row"}
    if value not in names:
        raise ValueError(f"unknown split_mode {value!r} (LLAMA_SPLIT_MODE_NONE/LAYER/ROW: {sorted(names)})")
    return names[value]


# -- chat ------------------------------------------------------------------------------------------

def chat_handler_for(name: str) -> Callable[..., Any]:
    """llama-cpp-python's registered chat handler ``name`` (``chatml``, ``gemma``, ``chatml-function-calling``
    ...); ``ValueError`` naming the known ones when there is none."""
    try:
        return _chat_format.get_chat_completion_handler(name)
    except Exception as e:  # LlamaChatCompletionHandlerNotFoundException
        known = ", ".join(sorted(_chat_format.LlamaChatCompletionHandlerRegistry()._chat_handlers))
        raise ValueError(f"unknown chat_format {name!r} (known: {known})") from e


def formatter_chat_handler(render: Callable[..., str], *, eos_token: str, eos_token_id: int) -> Callable[..., Any]:
    """A chat handler like the one ``llama_cpp.Llama`` builds from a GGUF's Jinja template (stop at the
    ``eos_token`` text and at token ``eos_token_id``), whose prompt is ``render(messages, tools=..., functions=..., function_call=...,
    tool_choice=..., **template_kwargs)``: text that is tokenised with the vocabulary's own BOS/EOS
    (``llama.tokenize(add_bos=True, special=True)``), so ``render`` applies llama.cpp's BOS rule."""
    from llama_cpp import llama as _llama_high

    def stop_on_eos(tokens, logits) -> bool:
        return tokens[-1] == eos_token_id

    def formatter(*, messages, **kwargs):
        return _chat_format.ChatFormatterResponse(
            prompt=render(messages, **kwargs), stop=[eos_token],
            stopping_criteria=_llama_high.StoppingCriteriaList([stop_on_eos]), added_special=False)

    return _chat_format.chat_formatter_to_chat_completion_handler(formatter)


def guess_chat_format(meta: dict[str, str]) -> str | None:
    """The registered chat format whose template is exactly the GGUF's (chatml, mistral-instruct, llama-3)."""
    return _chat_format.guess_chat_format_from_gguf_metadata(meta)


# -- grammars --------------------------------------------------------------------------------------

def json_schema_grammar(schema: str) -> str:
    """GBNF for a JSON schema (a JSON string), with llama-cpp-python's converter."""
    return json_schema_to_gbnf(schema)


def grammar_text(grammar: Any) -> tuple[str, str]:
    """``(GBNF text, root rule)`` of a ``llama_cpp.LlamaGrammar`` (or of a GBNF string)."""
    if isinstance(grammar, str):
        return grammar, "root"
    if isinstance(grammar, LlamaGrammar):
        return grammar._grammar, getattr(grammar, "_root", "root") or "root"
    raise TypeError(f"grammar must be a llama_cpp.LlamaGrammar or a GBNF string, got {type(grammar).__name__}")
