"""``ngram-cache`` (§4.11): lookup decoding with three n-gram caches, and the cache file format.

A *cache* maps an n-gram key to token counts: ``{(t0, t1, t2, t3): {token: count}}``. Keys always have 4
slots; an n-gram of size ``s < 4`` fills the first ``s`` slots and the rest are ``-1``. Three caches are used:

* **context**: per sequence, built from the tokens seen while drafting (LAX thresholds);
* **dynamic**: loaded once from ``--lookup-cache-dynamic`` (STRICT thresholds), never updated or saved;
* **static**: loaded once from ``--lookup-cache-static``; only its 2-gram keys are used, as weights and as the
  last resort.

Drafts are up to 8 tokens (``NGRAM_CACHE_N_DRAFT``); each token is the first of: the context cache with LAX
thresholds, the dynamic cache with STRICT thresholds, the static cache alone. For the context / dynamic tries,
the candidate keys are the last 4, 3, 2, 1 tokens; a token's score is ``count * w`` with ``w = 100 *
static_count`` when the static 2-gram part knows it, else 1; the best score wins (strictly greater, so ties
go to the token met first in the part's dict order — llama.cpp's order there is unspecified). A key
qualifies when ``sum >= min_sample[s-1]`` and ``100 * best_count >= min_percent[s-1] * sum``.

Worked example (no files; the context alone, LAX for 2-grams needs 2 samples and 50 %):

>>> from llamaspec.params import NgramCacheParams
>>> from llamaspec.drafters.base import DraftParams
>>> d = NgramCache(1, NgramCacheParams())
>>> hist = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]
>>> dp = DraftParams(drafting=True, prompt=hist, id_last=2); d.draft([dp]); dp.result
[3, 1, 2, 3, 1, 2, 3, 1]

File format (native = little-endian int32, records repeated to EOF): 4 key slots, ``ntokens > 0``, then
``ntokens`` pairs ``(token, count > 0)`` — see :mod:`.ngram_cache_io` (:func:`save_cache` / :func:`load_cache`,
importable from here).

Opt-in fixes (constructor keywords, default False = llama.cpp; ``fix_quirks=True`` turns both on):

* ``fix_boundary``: when new tokens are added to the context cache, n-grams that start in the old part and
  end in the new part are added too (llama.cpp only adds n-grams lying entirely inside the new tokens, so
  after the first draft the 2..4-grams across every draft boundary are lost — QUIRK).
* ``fix_reset``: ``begin`` clears the sequence's context cache and its ``cache_size``, so a new (possibly
  shorter) prompt is indexed in full (llama.cpp never resets ``cache_size``: after a shorter prompt nothing
  is added until the history outgrows the old length — QUIRK).
"""
from __future__ import annotations

from dataclasses import replace
from itertools import repeat
from typing import Iterable, Sequence

from ..errors import UsageError
from ..params import NGRAM_CACHE_N_DRAFT, NgramCacheParams
from ._ngram_util import tail_list
from .base import Drafter
from .ngram_cache_io import KEY_SLOTS, Cache, cache_from_bytes, cache_to_bytes, load_cache, save_cache

__all__ = ["LAX_MIN_PERCENT", "LAX_MIN_SAMPLE", "NGRAM_MAX", "NGRAM_MIN", "NGRAM_STATIC", "N_DRAFT", "STRICT_MIN_PERCENT",
           "STRICT_MIN_SAMPLE", "Cache", "Key", "NgramCache", "build_cache", "cache_draft", "cache_from_bytes",
           "cache_stats", "cache_to_bytes", "cache_update", "load_cache", "merge_cache", "save_cache"]

NGRAM_MIN = 1
NGRAM_MAX = KEY_SLOTS  # 4
NGRAM_STATIC = 2
N_DRAFT = NGRAM_CACHE_N_DRAFT  # 8

#: thresholds per n-gram size 1..4
LAX_MIN_SAMPLE = (2, 2, 1, 1)
LAX_MIN_PERCENT = (66, 50, 50, 50)
STRICT_MIN_SAMPLE = (4, 3, 2, 2)
STRICT_MIN_PERCENT = (75, 66, 66, 66)

Key = tuple  # (int, int, int, int), unused slots -1

_PADS = {s: (-1,) * (NGRAM_MAX - s) for s in range(NGRAM_MAX + 1)}


def cache_update(
    cache: Cache, tokens: Sequence[int], nnew: int, ngram_min: int = NGRAM_MIN, ngram_max: int = NGRAM_MAX
) -> None:
    """Count the n-grams of ``tokens`` that end in its last ``nnew`` tokens.

    For each size ``s`` in ``[ngram_min, ngram_max]`` and each ``i`` from ``max(len - nnew, s)`` to
    ``len - 1``: ``cache[key(tokens[i-s:i])][tokens[i]] += 1``.

    >>> c = {}; cache_update(c, [1, 2, 1, 2, 1], 5, 2, 2); c
    {(1, 2, -1, -1): {1: 2}, (2, 1, -1, -1): {2: 1}}
    """
    toks = tail_list(tokens, 0)
    L = len(toks)
    for size in range(ngram_min, ngram_max + 1):
        start = max(L - nnew, size)
        if start >= L:
            continue
        cols = [toks[start - size + k: L - size + k] for k in range(size)]
        pad = [repeat(-1)] * (NGRAM_MAX - size)
        get = cache.get
        for key, tok in zip(zip(*cols, *pad), toks[start:L]):
            part = get(key)
            if part is None:
                cache[key] = {tok: 1}
            else:
                part[tok] = part.get(tok, 0) + 1


def build_cache(corpus_token_lists: Iterable[Sequence[int]], ngram_min: int = NGRAM_STATIC,
                ngram_max: int = NGRAM_STATIC) -> Cache:
    """Build a cache from tokenised corpora, the way llama.cpp's ``lookup-create`` does.

    ``lookup-create`` tokenises one text and counts its n-grams of size ``LLAMA_NGRAM_STATIC`` (= 2) only,
    because the static cache is only ever consulted with 2-gram keys; that is the default here. Pass
    ``ngram_min=1, ngram_max=4`` to build a cache meant for ``--lookup-cache-dynamic`` (all sizes are
    consulted there). Each list is counted on its own (no n-gram spans two lists).

    >>> build_cache([[1, 2, 3], [1, 2, 4]])
    {(1, 2, -1, -1): {3: 1, 4: 1}}
    """
    if not (NGRAM_MIN <= ngram_min <= ngram_max <= NGRAM_MAX):
        raise UsageError(f"n-gram sizes must satisfy {NGRAM_MIN} <= min <= max <= {NGRAM_MAX}, got {ngram_min}..{ngram_max}")
    cache: Cache = {}
    for toks in corpus_token_lists:
        cache_update(cache, toks, len(toks), ngram_min, ngram_max)
    return cache


def merge_cache(target: Cache, other: Cache) -> None:
    """Add every count of ``other`` into ``target``."""
    for key, part in other.items():
        dst = target.get(key)
        if dst is None:
            target[key] = dict(part)
        else:
            for tok, c in part.items():
                dst[tok] = dst.get(tok, 0) + c


def cache_stats(cache: Cache, top: int = 10) -> dict:
    """Summary of a cache: key counts per n-gram size, (key, token) entries, total count, the most frequent
    keys. Plain data, for ``llamaspec ngram-cache stats`` to print.

    >>> s = cache_stats({(1, 2, -1, -1): {3: 2, 4: 1}, (5, -1, -1, -1): {6: 1}})
    >>> s["n_keys"], s["n_entries"], s["total_count"], s["keys_by_size"]
    (2, 3, 4, {1: 1, 2: 1, 3: 0, 4: 0})
    """
    by_size = {s: 0 for s in range(1, NGRAM_MAX + 1)}
    n_entries = 0
    total = 0
    max_part = 0
    weights = []
    for key, part in cache.items():
        size = sum(1 for t in key if t != -1)
        by_size[size] = by_size.get(size, 0) + 1
        n_entries += len(part)
        s = sum(part.values())
        total += s
        max_part = max(max_part, len(part))
        weights.append((s, key))
    weights.sort(key=lambda x: -x[0])
    return {
        "n_keys": len(cache),
        "n_entries": n_entries,
        "total_count": total,
        "keys_by_size": by_size,
        "max_tokens_per_key": max_part,
        "file_bytes": 20 * len(cache) + 8 * n_entries,
        "top_keys": [
            {"key": [t for t in key if t != -1], "count": s, "tokens": sorted(cache[key].items(), key=lambda x: -x[1])[:5]}
            for s, key in weights[:top]
        ],
    }


# --------------------------------------------------------------------------------------------- drafting
def _try_cache(cache: Cache, tail: list[int], n_seq_tokens: int, part_s: dict, min_sample, min_percent) -> int | None:
    """Context / dynamic try: keys of size 4..1; the first key that passes the thresholds gives the token."""
    for size in range(NGRAM_MAX, 0, -1):
        if size > n_seq_tokens:
            continue
        part = cache.get(tuple(tail[-size:]) + _PADS[size])
        if part is None:
            continue
        best_tok, best_c, best_cw, total = -1, 0, 0, 0
        for tok, c in part.items():
            s = part_s.get(tok)
            cw = c * (100 * s if s is not None else 1)
            if cw > best_cw:
                best_tok, best_c, best_cw = tok, c, cw
            total += c
        if total < min_sample[size - 1]:
            continue
        if 100 * best_c < min_percent[size - 1] * total:
            continue
        return best_tok
    return None


def _try_static(part_s: dict) -> int | None:
    best_tok, best_c, total = -1, 0, 0
    for tok, c in part_s.items():
        if c > best_c:
            best_tok, best_c = tok, c
        total += c
    if total < 2 or 100 * best_c < 50 * total:
        return None
    return best_tok


def cache_draft(inp: Sequence[int], n_draft: int, context: Cache, dynamic: Cache, static: Cache,
                n_inp: int | None = None) -> list[int]:
    """Up to ``n_draft`` tokens continuing ``inp`` (``inp`` = history + ``id_last``), without ``id_last``. Only its
    last 4 tokens and its length are read: ``inp`` may be just those, ``n_inp`` the whole length. Candidate
    sizes larger than the sequence are skipped (llama.cpp reads out of bounds there).

    >>> ctx = {}; cache_update(ctx, [4, 5, 6, 4, 5, 6], 6)
    >>> cache_draft([4, 5], 3, ctx, {}, {})
    [6, 4, 5]
    """
    n_inp = len(inp) if n_inp is None else n_inp
    if n_inp < 2:
        return []
    tail = tail_list(inp, max(0, len(inp) - NGRAM_MAX))
    out: list[int] = []
    empty: dict = {}
    while len(out) < n_draft:
        n_seq_tokens = n_inp + len(out)
        part_s = static.get((tail[-2], tail[-1], -1, -1), empty) if static else empty
        tok = _try_cache(context, tail, n_seq_tokens, part_s, LAX_MIN_SAMPLE, LAX_MIN_PERCENT)
        if tok is None and dynamic:
            tok = _try_cache(dynamic, tail, n_seq_tokens, part_s, STRICT_MIN_SAMPLE, STRICT_MIN_PERCENT)
        if tok is None:
            tok = _try_static(part_s)
        if tok is None:
            break
        out.append(tok)
        tail.append(tok)
        if len(tail) > NGRAM_MAX:
            del tail[0]
    return out


class NgramCache(Drafter):
    """llama.cpp's ``ngram-cache`` (lookup decoding): a per-seq context cache plus the shared, read-only
    dynamic and static caches loaded at construction from ``params.lookup_cache_dynamic`` /
    ``params.lookup_cache_static`` (a missing or corrupt file raises :class:`UsageError`).

    Speed note: llama.cpp indexes the prompt into the context cache in the first ``draft`` of a generation
    (``begin`` is a no-op). Here ``begin`` counts the prompt's n-grams ahead of time into a side cache, and
    the first ``draft`` merges them after checking that its history still starts with that prompt (else the
    side cache is dropped and the draft indexes as llama.cpp does). The resulting counts, and the order of
    tokens inside every key (which decides ties), are identical; only the time moves to ``begin``.
    """

    type = "ngram-cache"

    def __init__(self, n_seq: int, params: NgramCacheParams, *, fix_quirks: bool = False,
                 fix_boundary: bool | None = None, fix_reset: bool | None = None):
        super().__init__(n_seq)
        self.params = replace(params)
        self.n_max = N_DRAFT
        self.fix_boundary = bool(fix_quirks) if fix_boundary is None else bool(fix_boundary)
        self.fix_reset = bool(fix_quirks) if fix_reset is None else bool(fix_reset)
        # loaded once and shared by all sequences (never modified)
        self.dynamic: Cache = load_cache(params.lookup_cache_dynamic) if params.lookup_cache_dynamic else {}
        self.static: Cache = load_cache(params.lookup_cache_static) if params.lookup_cache_static else {}
        self.context: list[Cache] = [{} for _ in range(n_seq)]
        self.cache_size = [0] * n_seq
        # per seq: (cache_size at begin, first history index of seg, seg, n-grams of seg) or None
        self._pending: list[tuple[int, int, list[int], Cache] | None] = [None] * n_seq

    def _seg_start(self, cs: int) -> int:
        """First history index an update starting at ``cache_size = cs`` may read."""
        return max(0, cs - NGRAM_MAX) if self.fix_boundary else cs

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        if self.fix_reset:
            self.context[seq_id] = {}
            self.cache_size[seq_id] = 0
        self._pending[seq_id] = None
        cs = self.cache_size[seq_id]
        Lb = len(prompt)
        if Lb - cs >= 2 * NGRAM_MAX:  # precompute what the first draft would add for prompt[cs:Lb]
            a = self._seg_start(cs)
            seg = tail_list(prompt, a, Lb)
            pending: Cache = {}
            cache_update(pending, seg, Lb - cs)
            self._pending[seq_id] = (cs, a, seg, pending)

    def _update_context(self, seq_id: int, prompt: Sequence[int], id_last: int) -> None:
        L = len(prompt)
        cs = self.cache_size[seq_id]
        ctx = self.context[seq_id]
        pend, self._pending[seq_id] = self._pending[seq_id], None
        lo = cs  # n-grams ending at history index >= lo are still to be added
        if pend is not None:
            p_cs, a, seg, pending = pend
            b = a + len(seg)
            if p_cs == cs and b <= L and tail_list(prompt, a, b) == seg:
                if ctx:
                    merge_cache(ctx, pending)
                else:
                    self.context[seq_id] = ctx = pending
                lo = b
        nnew = L + 1 - lo
        # the tokens an n-gram ending at >= lo may read: from max(lo - 4, first allowed index)
        start = max(lo - NGRAM_MAX, self._seg_start(cs))
        cache_update(ctx, tail_list(prompt, start) + [id_last], nnew)
        self.cache_size[seq_id] = L + 1

    def draft_one(self, seq_id: int, prompt: Sequence[int], id_last: int) -> list[int]:
        id_last = int(id_last)
        L = len(prompt)
        if self.cache_size[seq_id] < L + 1:
            self._update_context(seq_id, prompt, id_last)
        # inp = prompt + [id_last]; drafting only looks at its last 4 tokens and its length
        tail = tail_list(prompt, max(0, L - NGRAM_MAX + 1)) + [id_last]
        return cache_draft(tail, N_DRAFT, self.context[seq_id], self.dynamic, self.static, n_inp=L + 1)
