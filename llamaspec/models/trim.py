"""Draft models with a trimmed vocabulary (beyond llama.cpp; FR-Spec's idea, arXiv 2502.14856).

A small draft model with a large vocabulary spends most of each drafting step on its output layer:
gemma-3-270m's Q8_0 ``token_embd`` (tied output, 262144 x 640) is 72% of the Q4_K_M file, and every
drafted token reads all of it. A draft only has to propose likely tokens, so a copy of the draft whose
vocabulary keeps the ``K`` most frequent tokens drafts the same text for a fraction of the cost; what it
can never propose costs acceptance only where the target would have chosen such a token, and the
target still verifies every token, so greedy output stays the target's.

``trim_vocab_gguf`` writes that copy: the kept rows of ``token_embd`` / ``output``, the kept entries of
the tokenizer arrays, the special ids renumbered, and ``llamaspec.vocab.source_ids`` (the original id of
each kept token, ascending) so the drafter maps ids both ways (``DraftSimple``). Which tokens are kept
(``choose_keep``): the special, byte and user-defined tokens, then the tokens of a fixed English prose +
Python corpus taken from the running interpreter's standard library (``pydoc_data.topics`` and a list of
modules) by frequency, then the rest by the tokenizer's own order (score, else id). The corpus is never a
benchmark prompt.

``trimmed_draft`` is the entry point: it decides whether trimming pays (``trim_pays``), derives the file
once into the model cache and returns its path.

This module is the cache and the public entry; the pieces are :mod:`.trim_policy` (whether to trim, what to
keep) and :mod:`.gguf_trim` (the trimmed file's format and writer), whose names are importable from here.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

from ..errors import FetchError
from .cache import ProgressFn, cache_dir, locked
from .gguf_trim import (SLOT_TEXT, SOURCE_IDS_KEY, SOURCE_N_KEY, SOURCE_PATH_KEY, SOURCE_SIZE_KEY, VOCAB_TENSORS, is_trimmed,
                        read_numbers, read_strings, source_ids, trim_vocab_gguf)
from .trim_policy import (CORPUS_PIECE, DEFAULT_KEEP, MIN_VOCAB_FACTOR, MIN_VOCAB_SHARE, choose_keep, corpus_text,
                          tokenize_corpus, trim_pays, vocab_share)

__all__ = ["CORPUS_PIECE", "DEFAULT_KEEP", "DEFAULT_SLOTS", "MIN_VOCAB_FACTOR", "MIN_VOCAB_SHARE", "SLOT_TEXT",
           "SOURCE_IDS_KEY", "SOURCE_N_KEY", "SOURCE_PATH_KEY", "SOURCE_SIZE_KEY", "TRIM_FORMAT_VERSION", "VOCAB_TENSORS",
           "cached_trimmed", "choose_keep", "corpus_text", "draft_path", "is_trimmed", "read_numbers", "read_strings",
           "source_ids", "tokenize_corpus", "trim_pays", "trim_vocab_gguf", "trimmed_draft", "vocab_share"]

log = logging.getLogger("llamaspec")

#: rows at the end of a trimmed vocabulary kept free for tokens met at run time (source id -1)
DEFAULT_SLOTS = 2048
#: bump when the bytes written or the choice of tokens change
TRIM_FORMAT_VERSION = 3


# --------------------------------------------------------------------------------------------------
# the cached trimmed draft
# --------------------------------------------------------------------------------------------------


def _cache_key(srcp: Path, keep: int) -> str:
    st = srcp.stat()
    key = json.dumps([str(srcp), st.st_size, st.st_mtime_ns, keep, TRIM_FORMAT_VERSION,
                      hashlib.sha256(corpus_text().encode("utf-8")).hexdigest()])
    return f"{srcp.stem}.v{keep}.{hashlib.sha256(key.encode('utf-8')).hexdigest()[:16]}.gguf"


def cached_trimmed(path: str | os.PathLike[str], keep: int, cache: str | os.PathLike[str] | None = None) -> Optional[Path]:
    """The cached trimmed copy of ``path`` for ``keep``, or None when it was not derived yet."""
    dest = cache_dir(cache) / "trimmed" / _cache_key(Path(path).resolve(), keep)
    return dest if dest.exists() else None


def trimmed_draft(path: str | os.PathLike[str], keep: int = DEFAULT_KEEP, *, cache: str | os.PathLike[str] | None = None,
                  progress: Optional[ProgressFn] = None) -> Path:
    """The cached copy of the draft at ``path`` trimmed to ``keep`` rows (``keep // 8``, at most
    ``DEFAULT_SLOTS``, of them free for run-time tokens), derived on first use (seconds). The cache key is
    the source's path, size and mtime, ``keep``, the corpus and the format."""
    srcp = Path(path).resolve()
    d = cache_dir(cache) / "trimmed"
    dest = d / _cache_key(srcp, keep)
    if dest.exists():
        return dest
    d.mkdir(parents=True, exist_ok=True)
    with locked(d / f".{dest.name}.lock"):
        if dest.exists():
            return dest
        n_slots = min(DEFAULT_SLOTS, keep // 8)
        ids = choose_keep(srcp, keep - n_slots, tokenize_corpus(srcp))
        trim_vocab_gguf(srcp, dest, ids, n_slots=n_slots, progress=progress, stage=f"trim {srcp.name} to {keep} tokens")
        log.info("trimmed draft %s to %d of its tokens and %d run-time slots: %s", srcp.name, ids.size, n_slots, dest)
    return dest


def draft_path(path: str | os.PathLike[str], keep: int, asked: bool, progress: Optional[ProgressFn] = None,
               cache: str | os.PathLike[str] | None = None) -> tuple[Path, bool]:
    """(the draft to load for ``path``, whether it is a trimmed file): its trimmed copy when ``keep`` > 0
    and trimming pays (or was ``asked`` for and can be done), else ``path`` itself. Logged."""
    p = Path(path)
    if keep <= 0:
        return p, is_trimmed(p)
    ok, why = trim_pays(p, keep, asked=asked)
    if not ok:
        (log.warning if asked else log.debug)("draft %s keeps its whole vocabulary: %s", p.name, why)
        return p, is_trimmed(p)
    log.info("draft %s: trimmed vocabulary, %s", p.name, why)
    try:
        return trimmed_draft(p, keep, progress=progress, cache=cache), True
    except (OSError, FetchError) as e:  # a cache that cannot be written: trimming is only a speed-up
        msg = f"could not write the trimmed copy of draft {p.name} into the model cache ({e})"
        if asked:
            raise FetchError(msg + "; free space or set LLAMASPEC_CACHE to a writable folder, or pass "
                             "--spec-draft-vocab 0") from None
        log.warning("%s; drafting with its whole vocabulary", msg)
        return p, is_trimmed(p)


if __name__ == "__main__":  # pragma: no cover - python -m llamaspec.models.trim DRAFT [K]
    logging.basicConfig(level=logging.INFO)
    p = trimmed_draft(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_KEEP)
    print(p)
