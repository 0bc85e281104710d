"""``ngram-mod`` (§4.10): one shared hash table from an n-token window to the token that followed it.

The table has 4,194,304 int32 entries (16 MiB, ``-1`` = empty) and is shared by all sequences of one drafter
instance. The index of a window ``x[0..n-1]`` is the 64-bit LCG

    r = 0;  r = r * 6364136223846793005 + x_k  (mod 2^64, x_k sign-extended int32);  idx = r % 4194304

There is **no key verification**: a window whose index collides with another window's returns that window's
token (by design). ``n = n_match`` (24); the drafter's ``n_max`` is ``ngram_mod.n_max`` (64).

* ``begin``: index every window of the prompt (later windows overwrite earlier ones), ``i_last = len - n``;
  if more than a quarter of the table is used afterwards, the table is reset (``i_last`` kept).
* ``draft``: index the history in chunks (only when more than 32 tokens are new), then follow the table from
  the window ``prompt[L-n+1:] + [id_last]`` for up to ``n_max`` tokens; hitting an empty entry before
  ``n_min`` tokens yields no draft at all.
* ``accept``: acceptance ``n_acc / n_drafted < 0.25`` five rounds in a row resets the shared table.

Worked example (``n_match = 2, n_min = 1, n_max = 4``): after ``begin`` on ``1 2 3 4 1 2``, the window
``(2, 3)`` -> 4, ``(3, 4)`` -> 1, ``(4, 1)`` -> 2 and the draft follows them around the loop:

>>> from llamaspec.params import NgramModParams
>>> from llamaspec.drafters.base import DraftParams
>>> d = NgramMod(1, NgramModParams(n_match=2, n_min=1, n_max=4))
>>> d.begin(0, [1, 2, 3, 4, 1, 2])
>>> dp = DraftParams(drafting=True, prompt=[1, 2, 3, 4, 1, 2], id_last=3); d.draft([dp]); dp.result
[4, 1, 2, 3]
>>> d.used
4

Memory: the table (16 MiB) plus three integers per sequence, whatever ``n_seq`` is.

Token ids are never -1 in practice; if one were stored it would read as an empty entry (as upstream), and
the vectorised ``used`` count would then differ slightly from a one-by-one count.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Sequence

import numpy as np

from ..params import NgramModParams
from ._ngram_util import MASK64, as_tokens, tail_list
from .base import Drafter

log = logging.getLogger("llamaspec")

#: LCG multiplier of the window index
LCG_MUL = 6364136223846793005
#: table entries (4 Mi)
TABLE_SIZE = 4 * 1024 * 1024
#: empty entry
EMPTY = -1
#: new-token threshold of the chunked indexing in draft()
CHUNK = 32
#: occupancy above which begin() resets the table
MAX_OCCUPANCY = 0.25
#: acceptance below which a round counts as "low"
LOW_ACCEPT = 0.25
#: low rounds in a row that reset the table
N_LOW_RESET = 5


def mod_index(tokens: Sequence[int], size: int = TABLE_SIZE) -> int:
    """The table index of one window (pure Python reference of the 64-bit LCG).

    >>> mod_index([1]), mod_index([1, 0]) == LCG_MUL % TABLE_SIZE
    (1, True)
    >>> mod_index([-1]) == (2**64 - 1) % TABLE_SIZE      # sign-extended
    True
    """
    r = 0
    for x in tokens:
        r = (r * LCG_MUL + (int(x) & MASK64)) & MASK64
    return r % size


def mod_index_windows(arr: np.ndarray, lo: int, count: int, n: int, size: int = TABLE_SIZE) -> np.ndarray:
    """Indices of the windows ``arr[i:i+n]`` for ``i`` in ``[lo, lo+count)``, as intp.

    Horner over the n window positions in uint64 wraparound arithmetic, vectorised over all windows
    (int32 tokens are sign-extended to 64 bits first).
    """
    if count <= 0:
        return np.empty(0, dtype=np.intp)
    u = arr[lo: lo + count + n - 1].astype(np.int64).view(np.uint64)
    mul = np.uint64(LCG_MUL)
    r = np.zeros(count, dtype=np.uint64)
    for k in range(n):
        r *= mul
        r += u[k: k + count]
    return (r % np.uint64(size)).astype(np.intp)


class NgramMod(Drafter):
    """llama.cpp's ``ngram-mod``. ``fix_quirks`` is accepted for a uniform constructor and has no effect
    (llama.cpp has no quirk to fix here; collisions returning foreign tokens are its design)."""

    type = "ngram-mod"
    #: table entries; a test may override it on a subclass to provoke collisions and resets cheaply
    table_size = TABLE_SIZE

    def __init__(self, n_seq: int, params: NgramModParams, *, fix_quirks: bool = False):
        super().__init__(n_seq)
        self.params = replace(params)
        self.n_match = int(params.n_match)
        self.n_min = int(params.n_min)
        self.n_max = int(params.n_max)
        self.fix_quirks = bool(fix_quirks)
        if self.n_match < 16:
            log.warning("ngram-mod: n_match = %d is small (< 16); expect many wrong drafts", self.n_match)
        self.table = np.full(self.table_size, EMPTY, dtype=np.int32)
        self.used = 0
        self.i_last = [0] * n_seq
        self.n_draft_last = [0] * n_seq
        self.n_low = [0] * n_seq
        n = self.n_match
        self._lcg_top = pow(LCG_MUL, n - 1, 1 << 64) if n >= 1 else 0  # a^(n-1), for the rolling index

    # -------------------------------------------------------------------------------------- the table
    def reset(self, seq_id: int | None = None) -> None:
        """A sequence is forgotten (``seq_id``): nothing to drop, what ngram-mod keeps per sequence is set anew
        by ``begin``. Without a sequence: :meth:`clear`."""
        if seq_id is None:
            self.clear()

    def clear(self) -> None:
        """Empty the shared table."""
        self.table.fill(EMPTY)
        self.used = 0

    def occupancy(self) -> float:
        return self.used / self.table_size

    def _add_range(self, arr: np.ndarray, lo: int, hi: int) -> None:
        """``add(arr[i:i+n+1])`` for ``i`` in ``[lo, hi)`` in order (overwrite; ``used`` counts empties filled)."""
        count = hi - lo
        if count <= 0:
            return
        n = self.n_match
        idx = mod_index_windows(arr, lo, count, n, self.table_size)
        val = arr[lo + n: hi + n]
        t = self.table
        if count == 1:
            i = idx[0]
            if t[i] == EMPTY:
                self.used += 1
            t[i] = val[0]
            return
        # last write wins: keep the last occurrence of every index
        ridx = idx[::-1]
        uniq, first = np.unique(ridx, return_index=True)
        self.used += int(np.count_nonzero(t[uniq] == EMPTY))
        t[uniq] = val[::-1][first]

    def add(self, window: Sequence[int]) -> None:
        """``add(t)``: ``table[idx(t[0:n])] = t[n]`` (one window of n+1 tokens)."""
        a = as_tokens(window)
        self._add_range(a, 0, 1)

    def get(self, window: Sequence[int]) -> int:
        """``table[idx(window[-n:])]`` (``-1`` = empty), unverified."""
        return int(self.table[mod_index(list(window)[-self.n_match:], self.table_size)])

    # ------------------------------------------------------------------------------------ the protocol
    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        n = self.n_match
        self.i_last[seq_id] = 0
        self.n_draft_last[seq_id] = 0
        L = len(prompt)
        if L < n:
            return
        self._add_range(as_tokens(prompt), 0, L - n)
        self.i_last[seq_id] = L - n
        if self.occupancy() > MAX_OCCUPANCY:
            log.debug("ngram-mod: occupancy %.3f > %.2f, resetting the table", self.occupancy(), MAX_OCCUPANCY)
            self.clear()

    def draft_one(self, seq_id: int, prompt: Sequence[int], id_last: int) -> list[int]:
        n = self.n_match
        self.n_draft_last[seq_id] = 0
        L = len(prompt)
        if L < n:
            return []
        i_last = self.i_last[seq_id]
        if i_last + CHUNK < L:
            if L - n > i_last:
                self._add_range(as_tokens(prompt[i_last:]), 0, L - n - i_last)
            self.i_last[seq_id] = L - n
        window = tail_list(prompt, L - n + 1) + [int(id_last)]
        # rolling LCG: r(w[1:] + [x]) = (r(w) - w[0] * a^(n-1)) * a + x  (mod 2^64)
        r = 0
        for x in window:
            r = (r * LCG_MUL + (x & MASK64)) & MASK64
        size, t, top = self.table_size, self.table, self._lcg_top
        result: list[int] = []
        for i in range(self.n_max):
            tok = int(t[r % size])
            if tok == EMPTY:
                if i < self.n_min:
                    return []
                break
            result.append(tok)
            window.append(tok)
            r = ((r - (window[-n - 1] & MASK64) * top) * LCG_MUL + (tok & MASK64)) & MASK64
        self.n_draft_last[seq_id] = len(result)
        return result

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        if is_other:
            return
        n_last = self.n_draft_last[seq_id]
        if n_last <= 0:
            return
        if n_accepted / n_last < LOW_ACCEPT:
            self.n_low[seq_id] += 1
            if self.n_low[seq_id] >= N_LOW_RESET:
                log.debug("ngram-mod: %d low-acceptance rounds, resetting the table", N_LOW_RESET)
                self.clear()
                self.n_low[seq_id] = 0
                self.i_last[seq_id] = 0
        else:
            self.n_low[seq_id] = 0
