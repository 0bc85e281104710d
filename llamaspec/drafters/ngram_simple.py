"""``ngram-simple`` (§4.7): copy what followed the latest earlier occurrence of the last n tokens.

Stateless. With ``n = size_n`` and ``m = size_m`` (``min_hits`` is unused), for a history ``prompt`` of
length ``L`` and the pending token ``id_last``:

1. ``L <= n + m + 1`` -> no draft;
2. the pattern is the last ``n - 1`` tokens of ``prompt`` plus ``id_last``;
3. scan ``j`` from ``L - n - 1`` down to 1 (index 0 never matches) for ``prompt[j:j+n] == pattern``;
   the first (= latest) match wins, no match -> no draft;
4. ``copy = min(m, L - (j + n))``; if ``copy < n`` -> no draft (QUIRK: the minimum draft length is the key
   size n, and a too-short latest match is not replaced by an earlier one);
5. the draft is ``prompt[j+n : j+n+copy]``.

Worked example with ``n = 2, m = 3`` (history of 8 tokens, ``id_last = 2``):

>>> prompt = [9, 1, 2, 3, 4, 5, 6, 1]
>>> simple_draft(prompt, 2, 2, 3)        # pattern [1, 2] found at j=1, copy = min(3, 8-3) = 3
[3, 4, 5]
>>> simple_draft(prompt, 7, 2, 3)        # pattern [1, 7] never occurs
[]
>>> simple_draft(prompt[:6], 2, 2, 3)    # L = 6 <= n + m + 1
[]

QUIRK in action (``n = 3, m = 8``): the period-2 loop ``1 2 1 2 ...`` matches only 1 token before the
end, so the copy (1) is shorter than n and nothing is drafted; ``fix_short_match=True`` keeps scanning
to an earlier match whose continuation is at least ``min(n, m)`` tokens long:

>>> loop = [7] + [1, 2] * 8
>>> simple_draft(loop, 1, 3, 8)
[]
>>> simple_draft(loop, 1, 3, 8, fix_short_match=True)
[2, 1, 2]
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from ..params import NgramMapParams
from ._ngram_util import as_tokens, last_match, tail_key
from .base import Drafter


def simple_draft(
    prompt: Sequence[int] | np.ndarray, id_last: int, n: int, m: int, *, fix_short_match: bool = False
) -> list[int]:
    """One ``ngram-simple`` draft (see the module docstring); returns a list of Python ints."""
    L = len(prompt)
    if L <= n + m + 1:
        return []
    arr = as_tokens(prompt)
    pattern = tail_key(arr, id_last, n)
    min_copy = min(n, m) if fix_short_match else 1
    # with the QUIRK every j <= L-n-1 is a candidate and a short copy is rejected after the fact;
    # with the fix only candidates whose continuation is long enough are considered at all
    j = last_match(arr, pattern, 1, L - n - min_copy)
    if j < 0:
        return []
    copy = min(m, L - (j + n))
    if copy < n and not fix_short_match:
        return []
    return arr[j + n: j + n + copy].tolist()


class NgramSimple(Drafter):
    """llama.cpp's ``ngram-simple`` (stateless; ``begin`` / ``process`` / ``accept`` are no-ops).

    ``fix_short_match`` (default False = llama.cpp): when the latest match leaves fewer than n tokens to
    copy, keep scanning for an earlier match instead of drafting nothing (helps short-period repetition).
    ``fix_quirks=True`` turns on every fix of this type (here just that one).
    """

    type = "ngram-simple"

    def __init__(self, n_seq: int, params: NgramMapParams, *, fix_quirks: bool = False,
                 fix_short_match: bool | None = None):
        super().__init__(n_seq)
        self.params = replace(params)
        self.size_n = int(params.size_n)
        self.size_m = int(params.size_m)
        self.fix_short_match = bool(fix_quirks) if fix_short_match is None else bool(fix_short_match)
        self.n_max = self.size_m

    def draft_one(self, seq_id: int, prompt: Sequence[int], id_last: int) -> list[int]:
        return simple_draft(prompt, id_last, self.size_n, self.size_m, fix_short_match=self.fix_short_match)
