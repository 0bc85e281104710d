"""The vocabulary of a loaded model: tokenizer and token metadata (:class:`Vocab`, made by
:class:`~llamaspec._llama.model.Model`, which it holds weakly: see the lifetime rules in :mod:`.model`)."""
from __future__ import annotations

import ctypes
import weakref
from typing import NamedTuple, Sequence

from llama_cpp import llama_cpp as native

from ..errors import LlamaSpecError, UsageError


def utf8(text: str) -> bytes:
    """``text`` as UTF-8; a lone surrogate (what an unpaired ``\\ud800`` JSON escape decodes to) is a
    :class:`UsageError` that says where, not a ``UnicodeEncodeError``.

    >>> utf8("a\\ud800b")
    Traceback (most recent call last):
    ...
    llamaspec.errors.UsageError: the text has a lone surrogate '\\ud800' at character 1, which UTF-8 cannot encode (an unpaired \\uD800-\\uDFFF escape in JSON?): send valid Unicode text
    """
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"the text has a lone surrogate {text[e.start]!r} at character {e.start}, which UTF-8 "
                         "cannot encode (an unpaired \\uD800-\\uDFFF escape in JSON?): send valid Unicode text") from None


def grown(make, cap: int, call) -> tuple[int, object]:
    """``call(buf, cap)`` into ``buf = make(cap)``; once more into a buffer of the size llama.cpp asks for, when
    it says the buffer was too small: ``-size`` (tokenize, detokenize, pieces) or a length of at least ``cap``
    (the ``snprintf``-like calls, whose ``n`` leaves out the NUL). ``(n, buf)``."""
    buf = make(cap)
    n = call(buf, cap)
    if n < 0 or n >= cap:
        cap = -n if n < 0 else n + 1
        buf = make(cap)
        n = call(buf, cap)
    return n, buf


def text_of(call, cap: int = 1024) -> str | None:
    """The string an ``snprintf``-like llama.cpp call writes (``call(buf, size)``, :func:`grown`); None when
    it returns a negative length (nothing to write)."""
    n, buf = grown(ctypes.create_string_buffer, cap, call)
    return None if n < 0 else buf.raw[:n].decode("utf-8", errors="replace")


class FimTokens(NamedTuple):
    """A model's fill-in-the-middle tokens (llama.cpp's ``llama_vocab_fim_*``); -1 where it has none."""

    pre: int
    suf: int
    mid: int
    pad: int
    rep: int
    sep: int

    @property
    def missing(self) -> list[str]:
        """Which of prefix, suffix and middle (what an infill prompt needs) the model lacks."""
        return [name for name, t in (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid)) if t < 0]


class Vocab:
    """Tokenizer and token metadata of a :class:`Model` (usable while the model is open).

    Thread-safe for reading: every call uses its own output buffer.
    """

    def __init__(self, model):  # a Model (not imported here: model imports this module)
        self._model_ref = weakref.ref(model)  # weak: Model.vocab -> Vocab is the strong edge
        self._model_name = model.path.name
        self._ptr = native.llama_model_get_vocab(model.live_ptr())
        ptr = self._ptr
        self.n_tokens: int = int(native.llama_vocab_n_tokens(ptr))
        self.type: int = int(native.llama_vocab_type(ptr))
        self.bos: int = int(native.llama_vocab_bos(ptr))
        self.eos: int = int(native.llama_vocab_eos(ptr))
        self.eot: int = int(native.llama_vocab_eot(ptr))
        self.add_bos: bool = bool(native.llama_vocab_get_add_bos(ptr))
        self.add_eos: bool = bool(native.llama_vocab_get_add_eos(ptr))
        self._eog_cache: dict[int, bool] = {}
        #: token -> piece, without / with special tokens rendered (``token_to_piece``)
        self._pieces: tuple[dict[int, bytes], dict[int, bytes]] = ({}, {})
        self._eog_all: tuple[int, ...] | None = None

    @property
    def model(self):
        """The owning model; :class:`LlamaSpecError` when it was closed or dropped."""
        model = self._model_ref()
        if model is None or not model.ptr:
            raise LlamaSpecError(f"model {self._model_name} is closed: its vocabulary can no longer be used")
        return model

    @property
    def ptr(self):
        """The native ``llama_vocab *``; :class:`LlamaSpecError` when the model was closed or dropped."""
        self.model  # noqa: B018 - raises when the model is closed
        return self._ptr

    @property
    def fim(self) -> FimTokens:
        """The fill-in-the-middle tokens (from the GGUF's metadata, or found by llama.cpp by their text)."""
        ptr = self.ptr
        return FimTokens(*(int(getattr(native, f"llama_vocab_fim_{k}")(ptr)) for k in FimTokens._fields))

    @property
    def suppress_tokens(self) -> list[int]:
        """Model-specific tokens a sampler must never pick (``tokenizer.ggml.suppress_tokens``)."""
        n = ctypes.c_int32(0)
        p = native.llama_vocab_get_suppress_tokens(self.ptr, ctypes.byref(n))
        return [int(p[i]) for i in range(n.value)] if p and n.value > 0 else []

    def is_eog(self, token: int) -> bool:
        r = self._eog_cache.get(token)
        if r is None:
            r = bool(native.llama_vocab_is_eog(self.ptr, token))
            self._eog_cache[token] = r
        return r

    def eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation token id (computed once per vocabulary)."""
        if self._eog_all is None:
            ptr = self.ptr
            self._eog_all = tuple(t for t in range(self.n_tokens) if native.llama_vocab_is_eog(ptr, t))
        return self._eog_all

    def special_texts(self) -> list[str]:
        """The texts of the tokens llama.cpp splits a text at before tokenising it with ``parse_special``
        (control, unknown and user-defined tokens)."""
        ptr = self.ptr
        split = native.LLAMA_TOKEN_ATTR_CONTROL | native.LLAMA_TOKEN_ATTR_UNKNOWN | native.LLAMA_TOKEN_ATTR_USER_DEFINED
        return [self.get_text(t).decode("utf-8", "replace") for t in range(self.n_tokens)
                if native.llama_vocab_get_attr(ptr, t) & split]

    def get_text(self, token: int) -> bytes:
        """Raw vocabulary text of a token (what §11 compares byte for byte)."""
        t = native.llama_vocab_get_text(self.ptr, token)
        return t if t is not None else b""

    def tokenize(self, text: str | bytes, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        ptr = self.ptr
        data = utf8(text) if isinstance(text, str) else bytes(text)
        n, buf = grown(lambda k: (native.llama_token * k)(), len(data) + 8,
                       lambda b, k: native.llama_tokenize(ptr, data, len(data), b, k, add_special, parse_special))
        if n < 0:
            raise LlamaSpecError(f"tokenization failed (llama_tokenize returned {n})")
        return list(buf[:n])

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        """The token's bytes (llama.cpp's ``llama_token_to_piece``), asked of llama.cpp once per token and
        then read from a cache (a piece never changes; the emitter reads one per generated token). A piece not
        cached yet needs the model open."""
        cache = self._pieces[1 if special else 0]
        piece = cache.get(token)
        if piece is None:
            ptr = self.ptr  # raises once the model is closed
            # (a buffer per call: two threads may detokenize at once)
            n, buf = grown(ctypes.create_string_buffer, 64,
                           lambda b, k: native.llama_token_to_piece(ptr, token, b, k, 0, special))
            piece = buf.raw[:n]
            if 0 <= token < self.n_tokens:  # an id outside the vocabulary is not kept
                cache[token] = piece
        return piece

    def detokenize(self, tokens: Sequence[int], *, remove_special: bool = False, unparse_special: bool = False) -> str:
        if not tokens:
            return ""
        ptr = self.ptr
        arr = (native.llama_token * len(tokens))(*tokens)
        n, out = grown(ctypes.create_string_buffer, max(64, 8 * len(tokens)),
                       lambda b, k: native.llama_detokenize(ptr, arr, len(tokens), b, k, remove_special, unparse_special))
        return out.raw[:n].decode("utf-8", errors="replace")
