"""llama.cpp's n-gram cache file (``lookup-create`` / ``lookup``, ``--lookup-cache-static`` /
``--lookup-cache-dynamic``), read and written for :mod:`.ngram_cache`.

Native = little-endian int32, records repeated to EOF: 4 key slots (unused slots -1), ``ntokens > 0``, then
``ntokens`` pairs ``(token, count > 0)``.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .._io import write_atomic
from ..errors import UsageError

#: slots of every key (LLAMA_NGRAM_MAX): an n-gram of size ``s < 4`` fills the first ``s``, the rest are -1
KEY_SLOTS = 4

Cache = dict  # dict[Key, dict[int, int]]: {(t0, t1, t2, t3): {token: count}}


def cache_to_bytes(cache: Cache) -> bytes:
    """The file image of a cache: per key ``4 x int32 key, int32 ntokens, ntokens x (int32 token, int32
    count)``, little-endian. Keys with no tokens are skipped (``ntokens`` must be > 0).

    >>> cache_to_bytes({(5, -1, -1, -1): {7: 3}}).hex()
    '05000000ffffffffffffffffffffffff010000000700000003000000'
    """
    flat: list[int] = []
    for key, part in cache.items():
        if not part:
            continue
        if len(key) != KEY_SLOTS:
            raise ValueError(f"cache key {key!r} must have {KEY_SLOTS} slots")
        flat.extend(key)
        flat.append(len(part))
        for tok, c in part.items():
            flat.append(tok)
            flat.append(c)
    if not flat:
        return b""
    a = np.asarray(flat, dtype=np.int64)
    if a.min() < -(2**31) or a.max() >= 2**31:
        raise ValueError("cache tokens and counts must fit in int32")
    return a.astype("<i4").tobytes()


def save_cache(cache: Cache, path: str | os.PathLike) -> None:
    """Write ``cache`` to ``path`` in llama.cpp's format (atomically: a temporary file is renamed)."""
    write_atomic(path, cache_to_bytes(cache))


def cache_from_bytes(data: bytes, what: str = "cache") -> Cache:
    """Parse a file image (see :func:`cache_to_bytes`). A key that appears twice has its counts added (so
    concatenated files merge). Raises :class:`UsageError` on a truncated or corrupt image."""
    if len(data) % 4:
        raise UsageError(f"{what}: size {len(data)} bytes is not a multiple of 4; not an n-gram cache file")
    a = np.frombuffer(data, dtype="<i4")
    vals = a.tolist()
    n = len(vals)
    cache: Cache = {}
    pos = 0
    while pos < n:
        if pos + 5 > n:
            raise UsageError(f"{what}: truncated record at byte {4 * pos}; not a complete n-gram cache file")
        key = tuple(vals[pos: pos + 4])
        nt = vals[pos + 4]
        if nt <= 0:
            raise UsageError(f"{what}: record at byte {4 * pos} has ntokens = {nt} (must be > 0); corrupt cache file")
        end = pos + 5 + 2 * nt
        if end > n:
            raise UsageError(f"{what}: record at byte {4 * pos} needs {nt} token entries but the file ends; truncated cache file")
        part = cache.get(key)
        if part is None:
            part = cache[key] = {}
        pairs = vals[pos + 5: end]
        for k in range(0, 2 * nt, 2):
            tok, c = pairs[k], pairs[k + 1]
            if c <= 0:
                raise UsageError(f"{what}: record at byte {4 * pos} has count {c} for token {tok} (must be > 0); corrupt cache file")
            part[tok] = part.get(tok, 0) + c
        pos = end
    return cache


def load_cache(path: str | os.PathLike) -> Cache:
    """Read a cache file written by llama.cpp (``lookup-create`` / ``lookup``) or by :func:`save_cache`.

    A missing, unreadable or corrupt file raises :class:`UsageError` with the path in the message.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"n-gram cache file not found: {p}") from None
    except IsADirectoryError:
        raise UsageError(f"n-gram cache path is a directory, not a file: {p}") from None
    except OSError as e:
        raise UsageError(f"cannot read n-gram cache file {p}: {e.strerror or e}") from None
    return cache_from_bytes(data, what=f"n-gram cache file {p}")

