"""Small numpy helpers shared by the n-gram drafters (no llama.cpp state here).

Token histories reach the drafters as Python lists or numpy arrays; :func:`as_tokens` turns either into a
contiguous ``int32`` array without copying when it already is one.

>>> a = as_tokens([5, 1, 2, 3, 1, 2, 3, 9])
>>> find_matches(a, np.array([1, 2, 3], dtype=np.int32), 0, 5).tolist()
[1, 4]
>>> last_match(a, np.array([1, 2, 3], dtype=np.int32), 0, 3)
1
>>> last_match(a, np.array([7, 7], dtype=np.int32), 0, 6)
-1
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF
#: ngram-lookup and its pool: the odd 64-bit multiplier of their rolling hash (any large odd constant works: keys
#: are verified on use), and how far a match is verified / extended backwards (longer ones count as this long)
HASH_MUL = 0x9E3779B97F4A7C15
MATCH_CAP = 32


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """``tokens`` as a 1-D int32 array (a view when it already is one)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int32 and tokens.ndim == 1:
        return tokens
    return np.asarray(tokens, dtype=np.int32).reshape(-1)


def tail_list(tokens: Sequence[int] | np.ndarray, start: int, stop: int | None = None) -> list[int]:
    """``tokens[start:stop]`` as a new list, cheap for both lists (a slice) and arrays (Python ints)."""
    part = tokens[start:stop]
    if isinstance(part, np.ndarray):
        return part.tolist()
    return part if isinstance(part, list) else list(part)


def tail_key(arr: np.ndarray, id_last: int, n: int) -> np.ndarray:
    """The n-gram that ends at the pending token: the last ``n - 1`` tokens of ``arr``, then ``id_last`` (int32).

    >>> tail_key(as_tokens([4, 5, 6]), 9, 3).tolist()
    [5, 6, 9]
    """
    key = np.empty(n, dtype=np.int32)
    key[: n - 1] = arr[len(arr) - n + 1:]
    key[n - 1] = id_last
    return key


def find_matches(arr: np.ndarray, pattern: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """All ``j`` in ``[lo, hi]`` (inclusive, ascending) with ``arr[j:j+n] == pattern`` (``n = len(pattern)``).

    The caller guarantees ``hi + n <= len(arr)``. Candidates are filtered one pattern position at a time,
    so the cost is about one pass over ``arr[lo:hi+1]`` plus a little per surviving candidate.
    """
    n = len(pattern)
    if hi < lo or n == 0:
        return np.empty(0, dtype=np.int64)
    seg = arr[lo: hi + n]
    cand = np.flatnonzero(seg[: hi - lo + 1] == pattern[0])
    for k in range(1, n):
        if cand.size == 0:
            break
        cand = cand[seg[cand + k] == pattern[k]]
    return cand + lo


def last_match(arr: np.ndarray, pattern: np.ndarray, lo: int, hi: int) -> int:
    """The largest ``j`` in ``[lo, hi]`` with ``arr[j:j+n] == pattern``, or -1 (a scan from ``hi`` down)."""
    # search backwards in growing chunks: in copy-heavy text the latest match is usually recent
    if hi < lo:
        return -1
    if len(pattern) == 0:
        return hi
    chunk = 512
    top = hi
    while top >= lo:
        bottom = max(lo, top - chunk + 1)
        m = find_matches(arr, pattern, bottom, top)
        if m.size:
            return int(m[-1])
        top = bottom - 1
        chunk *= 4
    return -1

