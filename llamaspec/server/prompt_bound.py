"""A prompt's tokens bounded from below before llama.cpp tokenises it (:func:`tokenize`; issue 36).

llama.cpp splits a text at every occurrence of a special token's text before it tokenises the pieces, and that
split costs time quadratic in the occurrences (SmolLM2-135M, ``<|im_start|>`` repeated: 20,000 take 0.6 s,
100,000 some 20 s; a chat of 100k messages renders 200k of them), all of it in one native call nothing can
interrupt. Each occurrence becomes one token, so counting them first is a lower bound on the prompt's tokens:
a prompt with as many as the slot's context is refused (400 ``exceed_context_size_error``) in milliseconds,
and one that may fit has fewer than ``n_ctx`` occurrences (a bounded split). The count is one scan of the text
with a regular expression built once per vocabulary, a trie of the texts llama.cpp splits at (control and
unknown tokens when special tokens are parsed, user-defined ones always), so its cost does not grow with the
number of special tokens (Gemma 3 has thousands). Special texts are delimited (``<|...|>``, ``<...>``), so no
two occurrences overlap: the count is the tokens llama.cpp makes of them.
"""
from __future__ import annotations

import re
import threading
import weakref
from typing import TYPE_CHECKING

from . import cancel
from .errors import exceed_context

if TYPE_CHECKING:  # pragma: no cover
    from .._llama.vocab import Vocab
    from ..engine import Engine

_CACHE: "weakref.WeakKeyDictionary[Vocab, tuple[re.Pattern | None]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def trie_pattern(texts) -> re.Pattern | None:
    """One regular expression matching any of ``texts`` (longest first at a position), as a trie: each step
    reads one character, whatever the number of texts; ``None`` when there are none.

    >>> p = trie_pattern(["<|im_start|>", "<|im_end|>", "<s>", "<s>x"])
    >>> [m.group() for m in p.finditer("a<s>xb<|im_end|><|im_start|><s")]
    ['<s>x', '<|im_end|>', '<|im_start|>']
    """
    trie: dict = {}
    for t in texts:
        if t:
            node = trie
            for ch in t:
                node = node.setdefault(ch, {})
            node[None] = True

    def emit(node: dict) -> str:
        end = None in node
        alts = [re.escape(ch) + emit(sub) for ch, sub in sorted((k, v) for k, v in node.items() if k is not None)]
        if not alts:
            return ""
        if len(alts) == 1 and not end:
            return alts[0]
        return "(?:" + "|".join(alts) + ")" + ("?" if end else "")

    return re.compile(emit(trie)) if trie else None


def _pattern(vocab: "Vocab") -> re.Pattern | None:
    """The texts split at with parse_special: built once per vocabulary."""
    with _LOCK:
        got = _CACHE.get(vocab)
        if got is None:
            got = _CACHE[vocab] = (trie_pattern(vocab.special_texts()),)
        return got[0]


def count_special(vocab: "Vocab", text: str) -> int:
    """How many special-token texts llama.cpp will split ``text`` at with special tokens parsed (each one token);
    checks the work's cancellation flag as it counts."""
    pattern = _pattern(vocab)
    if pattern is None:
        return 0
    n = 0
    for n, _ in enumerate(pattern.finditer(text), 1):
        if n % cancel.EVERY == 0:
            cancel.check()
    return n


def tokenize(eng: "Engine", text: str, add_special: bool = True) -> list[int]:
    """A prompt's tokens (special tokens parsed); before llama.cpp sees it, a 400 ``exceed_context_size_error``
    when it holds as many special-token texts as the slot's context (the message counts them: at least that many
    tokens), and :class:`~llamaspec.server.cancel.Abandoned` when its client left."""
    n_ctx = eng.n_ctx_seq
    if len(text) >= n_ctx:  # every special text is a character at least: fewer cannot hold n_ctx of them
        n = count_special(eng.vocab, text)
        if n >= n_ctx:
            raise exceed_context(n, n_ctx)
    cancel.check()
    return eng.tokenize(text, add_special=add_special, parse_special=True)
