"""``Llama.tokenizer()`` / ``Llama.tokenizer_``: llama-cpp-python's ``LlamaTokenizer`` over a
:class:`~llamaspec.compat.llama.Llama` (outlines' ``from_llamacpp`` reads the vocabulary through it).

The defaults are ``llama_cpp.llama_tokenizer.LlamaTokenizer``'s: ``tokenize`` parses special tokens
(``special=True``), ``detokenize`` does not, ``encode`` / ``decode`` go through UTF-8 (invalid bytes dropped).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

from llama_cpp.llama_tokenizer import BaseLlamaTokenizer

if TYPE_CHECKING:  # pragma: no cover
    from .llama import Llama

__all__ = ["LlamaTokenizer"]


class LlamaTokenizer(BaseLlamaTokenizer):
    """A ``BaseLlamaTokenizer`` (llama-cpp-python's interface) reading the model's vocabulary."""

    def __init__(self, llama: "Llama"):
        self._llama = llama

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> List[int]:
        return self._llama.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: List[int], prev_tokens: Optional[List[int]] = None,
                   special: bool = False) -> bytes:
        return self._llama.detokenize(tokens, special=special)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> List[int]:
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos=add_bos, special=special)

    def decode(self, tokens: List[int]) -> str:
        return self.detokenize(tokens).decode("utf-8", errors="ignore")

    @classmethod
    def from_ggml_file(cls, path: str) -> "LlamaTokenizer":
        from .llama import Llama

        return cls(Llama(model_path=path, vocab_only=True, verbose=False))
