"""Whether trimming a draft's vocabulary pays (:func:`trim_pays`), and which tokens a trimmed copy keeps
(:func:`choose_keep`, by frequency in a fixed corpus: :func:`corpus_text`, :func:`tokenize_corpus`). Part of
:mod:`.trim` (use that module)."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import FetchError
from .gguf_io import Layout, open_gguf
from .gguf_trim import (SOURCE_N_KEY, TOK_BYTE, TOK_CONTROL, TOK_NORMAL, TOK_UNKNOWN, TOK_UNUSED, TOK_USER, VOCAB_TENSORS,
                        read_numbers, read_strings)

#: characters per piece of the corpus handed to the tokenizer (pieces end at line breaks)
CORPUS_PIECE = 8192
#: the default number of kept tokens
DEFAULT_KEEP = 32768
#: trim only when the draft's vocabulary is at least this many times K and its vocabulary rows
#: (token_embd + output) are at least this share of its weights
MIN_VOCAB_FACTOR = 2
MIN_VOCAB_SHARE = 0.25

_UNUSED = re.compile(rb"^<unused\d+>$|^\[unused\d+\]$")
#: standard-library modules whose source is the frequency corpus (code and English docstrings)
_CORPUS_MODULES = ("argparse", "textwrap", "json/__init__", "json/decoder", "json/encoder", "csv", "logging/__init__",
                   "http/server", "email/message", "collections/__init__", "functools", "pathlib", "subprocess",
                   "dataclasses", "string", "calendar", "statistics", "difflib", "heapq", "shutil")


def vocab_share(lay: Layout) -> tuple[int, float]:
    """(n_vocab, share of the weight bytes in the vocabulary tensors) of a GGUF layout."""
    kvs = {kv.key: kv for kv in lay.kvs}
    tok = kvs.get("tokenizer.ggml.tokens")
    n_vocab = tok.count if tok is not None else 0
    total = sum(t.nbytes or 0 for t in lay.tensors)
    vocab = sum(t.nbytes or 0 for t in lay.tensors if t.name in VOCAB_TENSORS)
    return n_vocab, (vocab / total if total else 0.0)


#: draft heads (EAGLE-3, DFlash) and MTP drafts read the target's hidden states; they are never trimmed
_NOT_STANDALONE = ("eagle3", "dflash")


def trim_pays(path: str | os.PathLike[str], keep: int = DEFAULT_KEEP, *, asked: bool = False) -> tuple[bool, str]:
    """Whether trimming the draft at ``path`` to ``keep`` tokens pays (``asked``: whether it can), and why."""
    with open_gguf(path) as (lay, _):
        if lay.get(SOURCE_N_KEY) is not None:
            return False, "its vocabulary is already trimmed"
        arch = lay.get("general.architecture")
        if arch in _NOT_STANDALONE or any(kv.key.endswith(".nextn_predict_layers") and kv.value for kv in lay.kvs):
            return False, f"it is a draft head ({arch}), not a standalone draft model"
        n_vocab, share = vocab_share(lay)
        if not any(t.name == "token_embd.weight" and len(t.ne) == 2 and t.ne[1] == n_vocab for t in lay.tensors):
            return False, "it has no token_embd tensor with one row per token"
    if n_vocab <= keep:
        return False, f"its vocabulary has {n_vocab} tokens, not more than {keep}"
    if asked:
        return True, f"keeping {keep} of its {n_vocab} tokens (vocabulary rows are {share:.0%} of its weights)"
    if n_vocab < MIN_VOCAB_FACTOR * keep:
        return False, f"vocabulary of {n_vocab} tokens is less than {MIN_VOCAB_FACTOR}x {keep}"
    if share < MIN_VOCAB_SHARE:
        return False, f"vocabulary rows are {share:.0%} of the weights (< {MIN_VOCAB_SHARE:.0%})"
    return True, f"vocabulary rows are {share:.0%} of the weights; keeping {keep} of {n_vocab} tokens"


def corpus_text() -> str:
    """The frequency corpus: ``pydoc_data.topics`` (the Python reference, English prose) and the source
    of ``_CORPUS_MODULES``, from the running interpreter's standard library (missing files are skipped)."""
    lib = Path(os.__file__).parent
    parts: list[str] = []
    try:
        from pydoc_data.topics import topics

        parts.extend(topics[k] for k in sorted(topics))
    except Exception:  # pragma: no cover - stripped-down Pythons
        pass
    for mod in _CORPUS_MODULES:
        try:
            parts.append((lib / f"{mod}.py").read_text(encoding="utf-8"))
        except OSError:
            continue
    return "\n".join(parts)


def choose_keep(path: str | os.PathLike[str], keep: int, corpus_ids: Optional[np.ndarray] = None) -> np.ndarray:
    """The ids to keep (ascending, ``min(keep, n_vocab)`` of them): special, byte and user-defined tokens
    (not ``<unusedN>``), single-character tokens where there are few of them (a byte-level alphabet),
    then by frequency in ``corpus_ids``, then by the tokenizer's order (score, else id)."""
    with open_gguf(path) as (lay, buf):
        kvs = {kv.key: kv for kv in lay.kvs}
        tok_kv = kvs.get("tokenizer.ggml.tokens")
        if tok_kv is None:
            raise FetchError(f"cannot trim {path}: it has no tokenizer.ggml.tokens")
        texts = read_strings(buf, tok_kv)
        n = len(texts)
        tt_kv, sc_kv = kvs.get("tokenizer.ggml.token_type"), kvs.get("tokenizer.ggml.scores")
        types = read_numbers(buf, tt_kv, np.int32) if tt_kv is not None else np.full(n, TOK_NORMAL, np.int32)
        scores = read_numbers(buf, sc_kv, np.float32) if sc_kv is not None else None
        specials = [int(kv.value) for k, kv in kvs.items()
                    if k.startswith("tokenizer.ggml.") and k.endswith("_token_id") and isinstance(kv.value, int)]
    forced = np.zeros(n, bool)
    forced[[s for s in specials if 0 <= s < n]] = True
    unused = np.array([_UNUSED.match(t) is not None for t in texts])
    forced |= np.isin(types, (TOK_UNKNOWN, TOK_CONTROL, TOK_USER, TOK_BYTE)) & ~unused
    single = np.array([len(t.decode("utf-8", "replace")) == 1 for t in texts]) & (types == TOK_NORMAL)
    if single.sum() <= 1024:
        forced |= single
    order: list[int] = list(np.flatnonzero(forced))
    if len(order) > keep:
        raise FetchError(f"cannot trim {path} to {keep} tokens: {len(order)} special, byte and user-defined tokens must stay; "
                         "use a larger --spec-draft-vocab")
    taken = forced.copy()
    if corpus_ids is not None and corpus_ids.size:
        ids = corpus_ids[(corpus_ids >= 0) & (corpus_ids < n)]
        counts = np.bincount(ids, minlength=n)
        seen = np.flatnonzero(counts > 0)
        seen = seen[np.lexsort((seen, -counts[seen]))]  # most frequent first, ties by id
        seen = seen[~taken[seen] & ~unused[seen]]
        add = seen[:keep - len(order)]
        taken[add] = True
        order.extend(add.tolist())
    if len(order) < keep:
        rest = np.flatnonzero(~taken & ~unused & (types != TOK_UNUSED))
        if scores is not None:
            rest = rest[np.lexsort((rest, -scores[rest]))]
        order.extend(rest[:keep - len(order)].tolist())
    return np.array(sorted(order), dtype=np.int64)


def tokenize_corpus(path: Path) -> np.ndarray:
    """The tokens of :func:`corpus_text` in the vocabulary of the model at ``path``."""
    from .. import _llama as llama

    m = llama.Model(path, vocab_only=True)
    try:
        # in pieces that end at a line break: a SentencePiece vocabulary has no pre-tokenizer, and one 1.3 MB
        # text costs llama.cpp's tokenizer 8 s against 1.3 s in pieces (the same counts up to the seams)
        out: list[int] = []
        for piece in _line_pieces(corpus_text(), CORPUS_PIECE):
            out.extend(m.vocab.tokenize(piece, add_special=False))
        return np.array(out, dtype=np.int64)
    finally:
        m.close()


def _line_pieces(text: str, size: int):
    r"""``text` in consecutive pieces of about ``size`` characters, each ending after a line break (or at
    the end).

    >>> list(_line_pieces("ab\ncd\nef", 1)), "".join(_line_pieces("x" * 10, 3))
    (['ab\n', 'cd\n', 'ef'], 'xxxxxxxxxx')
    """
    i, n = 0, len(text)
    while i < n:
        j = text.find("\n", min(i + size, n - 1))
        j = n if j < 0 else j + 1
        yield text[i:j]
        i = j

