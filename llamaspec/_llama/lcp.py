"""llama-cpp-python's own high-level API (``Llama`` and its prompt-lookup decoder), which ``llamaspec bench``
runs as a baseline. Everything else in llamaspec uses the low-level wrappers of this package.

The high-level modules are imported on first use, as the bench did before: nothing here loads them at
``import llamaspec``.
"""
from __future__ import annotations

from typing import Callable


def split_mode(name: str) -> int:
    """llama-cpp-python's ``LLAMA_SPLIT_MODE_*`` value for ``name`` (``none``, ``layer``, ``row``)."""
    import llama_cpp

    return getattr(llama_cpp, f"LLAMA_SPLIT_MODE_{name.upper()}")


def prompt_lookup_decoding(num_pred_tokens: int):
    """A ``llama_cpp.llama_speculative.LlamaPromptLookupDecoding`` drafting ``num_pred_tokens`` tokens."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    return LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens)


def load_llama(path: str, **kwargs):
    """``llama_cpp.Llama(path, **kwargs)``, without llama.cpp's extra weight buffers where llamaspec's own
    models load without them (:mod:`llamaspec._llama.cpu_features`), through
    :func:`llama_without_extra_buffers`."""
    from llama_cpp import Llama

    llama_without_extra_buffers()
    return Llama(path, **kwargs)


def llama_without_extra_buffers() -> None:
    """For this whole process: every ``llama_cpp.Llama`` loads without the extra weight buffers where
    llamaspec's own models do (``Llama`` has no argument for it, so its default model parameters are wrapped;
    also what tests whose reference is llama-cpp-python's own ``Llama`` need). Idempotent; nothing to do where
    the buffers are safe."""
    import llama_cpp

    from .cpu_features import use_extra_buffers

    native = llama_cpp.llama_cpp
    default = native.llama_model_default_params
    if use_extra_buffers() or hasattr(default, "wraps_default"):
        return

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    params.wraps_default = default
    native.llama_model_default_params = params


def eog_test(llm) -> Callable[[int], bool]:
    """A test of whether a token ends generation, in the vocabulary of the ``Llama`` ``llm`` (looked up once)."""
    import llama_cpp

    vocab, is_eog = llm._model.vocab, llama_cpp.llama_vocab_is_eog
    return lambda token: is_eog(vocab, token)
