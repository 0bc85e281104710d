"""``ngram-map-k`` and ``ngram-map-k4v`` (§4.8 / §4.9): per-sequence n-gram maps with key records.

Both types share one algorithm (:class:`NgramMap`); ``key_only`` (map-k) drafts whatever followed the matched
key, map-k4v keeps up to four distinct m-token continuations ("values") per key with occurrence counts and
drafts only when one of them dominates. ``n = size_n``, ``m = size_m``; ``n_max = m``.

Per sequence the map holds

* ``key_map``: 262144 uint32 slots (0 = empty) indexed by :func:`map_hash` ``% 262144`` of an n-token
  window, holding the history index of one occurrence. Slots are only filled while empty, never overwritten,
  and the stored occurrence is not re-verified except against the current key at lookup time.
* ``keys``: records of keys that were matched once (``key_idx``, ``stat_idx``, ``key_num`` and four
  value records ``value_idx, value_num, n_accepted``; ``n_accepted`` starts at m and caps the draft length).
* ``key_map_last_idx`` (history indices ``<=`` it are indexed), ``size_last_begin`` (prompt length at the
  last ``begin``), ``idx_last_check`` (history length at the last ``begin`` / ``draft``).

Worked example (map-k, ``n = 2, m = 2``): the key ``[1, 2]`` (last history token 1 + ``id_last`` 2)
occurred at index 1 and was followed by ``[3, 4]``:

>>> from llamaspec.params import NgramMapParams
>>> from llamaspec.drafters.base import DraftParams
>>> d = NgramMapK(1, NgramMapParams(size_n=2, size_m=2))
>>> hist = [0, 1, 2, 3, 4, 5, 6, 1]
>>> d.begin(0, hist)
>>> dp = DraftParams(drafting=True, prompt=hist, id_last=2); d.draft([dp]); dp.result
[3, 4]

Feedback caps later drafts from the same key (QUIRK: 0 accepted means empty drafts from that key forever):

>>> d.accept(0, 0, False)
>>> dp = DraftParams(drafting=True, prompt=hist, id_last=2); d.draft([dp]); dp.result
[]

Opt-in fixes (constructor keywords, all default False = llama.cpp; ``fix_quirks=True`` turns on the two
k4v fixes, so it changes nothing for map-k):

* ``fix_stat_idx`` (k4v): statistics resume after the last counted occurrence (``stat_idx = match_pos + 1``)
  instead of counting the occurrence at ``match_pos`` again on the next draft.
* ``fix_value_pos`` (k4v): the draft is the dominant value's own continuation
  (``prompt[value_idx : value_idx+cnt]``) instead of whatever followed the matched occurrence.
* ``fix_accept_feedback`` (k and k4v; experimental, **not** part of ``fix_quirks``): a value whose
  ``n_accepted`` fell to 0 drafts a 1-token probe instead of nothing, and a fully accepted draft doubles the
  value's budget (up to m) instead of freezing it. In the model-free simulation of
  ``scripts/bench_ngram.py --simulate`` it never gained a token: a key's match position (its ``key_map``
  slot) never moves, so a continuation that failed once tends to fail again and the probes only cost
  verification rows (and block lower-priority drafters for that round).

Interpretation note: in ``begin``'s history-shrink cleanup, the value-slot compaction and the "delete the key
when slot 0 is unused" rule apply to map-k4v only (map-k never fills value slots, so applying the second rule
to map-k would delete every surviving key).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from ..errors import LlamaSpecError
from ..params import NgramMapParams
from ._ngram_util import MASK32, as_tokens, find_matches, last_match, tail_key
from .base import Drafter

#: multiplier of the map hash
HASH_MUL = 2654435761
#: number of key_map slots
KEY_MAP_SIZE = 262144
#: value slots per key record
MAX_VALUES = 4
#: saturation of key_num / value_num
MAX_COUNT = 16380


def map_hash(tokens: Sequence[int]) -> int:
    """``h = h * 2654435761 + (t mod 2^32)  (mod 2^32)`` over the tokens (the slot is ``h % 262144``).

    >>> map_hash([1])
    1
    >>> map_hash([1, 2]) == (2654435761 + 2) % 2**32
    True
    >>> map_hash([-1]) == 2**32 - 1
    True
    """
    h = 0
    for t in tokens:
        h = (h * HASH_MUL + (int(t) & MASK32)) & MASK32
    return h


def map_hash_range(arr: np.ndarray, lo: int, hi: int, n: int) -> np.ndarray:
    """:func:`map_hash` of the windows ``arr[j:j+n]`` for ``j`` in ``[lo, hi]`` (ascending), as uint32.

    Horner over the n window positions with uint32 wraparound, vectorised over all windows.
    """
    count = hi - lo + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint32)
    u = arr.view(np.uint32)
    mul = np.uint32(HASH_MUL)
    h = np.zeros(count, dtype=np.uint32)
    for k in range(n):
        h *= mul
        h += u[lo + k: lo + k + count]
    return h


class ValueRecord:
    """One continuation of a key: ``value_idx`` (history index, 0 = unused), ``value_num``, ``n_accepted``."""

    __slots__ = ("value_idx", "value_num", "n_accepted")

    def __init__(self, value_idx: int = 0, value_num: int = 0, n_accepted: int = -1):
        self.value_idx, self.value_num, self.n_accepted = value_idx, value_num, n_accepted

    def copy(self) -> "ValueRecord":
        return ValueRecord(self.value_idx, self.value_num, self.n_accepted)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"ValueRecord({self.value_idx}, {self.value_num}, {self.n_accepted})"


class KeyRecord:
    """A key that was matched: ``key_idx`` (history index of an occurrence), ``stat_idx``, ``key_num``,
    four :class:`ValueRecord`."""

    __slots__ = ("key_idx", "stat_idx", "key_num", "values")

    def __init__(self, key_idx: int, m: int):
        self.key_idx = key_idx
        self.stat_idx = 0
        self.key_num = 0
        self.values = [ValueRecord(0, 0, m) for _ in range(MAX_VALUES)]

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"KeyRecord(key_idx={self.key_idx}, stat_idx={self.stat_idx}, key_num={self.key_num}, values={self.values})"


class MapState:
    """The per-sequence map (see the module docstring)."""

    def __init__(self) -> None:
        self.keys: list[KeyRecord] = []
        self.key_map = np.zeros(KEY_MAP_SIZE, dtype=np.uint32)
        self.key_map_last_idx = 0
        self.size_last_begin = 0
        self.idx_last_check = 0
        self.last_draft_created = False
        self.last_draft_key_idx = 0
        self.last_draft_value_idx = 0
        self.last_draft_len = 0  # used by fix_accept_feedback only


class NgramMap(Drafter):
    """Shared implementation of ``ngram-map-k`` (``key_only=True``) and ``ngram-map-k4v``."""

    key_only = True

    def __init__(
        self,
        n_seq: int,
        params: NgramMapParams,
        *,
        fix_quirks: bool = False,
        fix_accept_feedback: bool = False,
        fix_stat_idx: bool | None = None,
        fix_value_pos: bool | None = None,
    ):
        super().__init__(n_seq)
        self.params = replace(params)
        self.size_n = int(params.size_n)
        self.size_m = int(params.size_m)
        self.min_hits = int(params.min_hits)
        self.n_max = self.size_m
        pick = lambda v: bool(fix_quirks) if v is None else bool(v)  # noqa: E731
        self.fix_accept_feedback = bool(fix_accept_feedback)
        self.fix_stat_idx = pick(fix_stat_idx)
        self.fix_value_pos = pick(fix_value_pos)
        self.maps = [MapState() for _ in range(n_seq)]

    # ------------------------------------------------------------------------------------------ begin
    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        mp = self.maps[seq_id]
        n, m = self.size_n, self.size_m
        S = len(prompt)
        cleanup = mp.size_last_begin
        if cleanup > S:
            cleanup = S - n - m if S > n + m else 0
        if S < mp.idx_last_check:
            km = mp.key_map
            km[km >= cleanup] = 0  # zeroing the already-zero slots too changes nothing
            mp.key_map_last_idx = cleanup - 1 if cleanup > 0 else 0
            keys = mp.keys
            for ki in range(len(keys) - 1, -1, -1):
                rec = keys[ki]
                if rec.key_idx >= cleanup:
                    del keys[ki]
                    continue
                if self.key_only:
                    continue
                vals = rec.values
                for v in range(MAX_VALUES - 1, -1, -1):
                    if vals[v].value_idx != 0 and vals[v].value_idx >= cleanup:
                        for w in range(v, MAX_VALUES - 1):
                            vals[w] = vals[w + 1].copy()
                        last = vals[MAX_VALUES - 1]
                        last.value_idx = 0
                        last.value_num = 0  # n_accepted kept (QUIRK)
                if vals[0].value_idx == 0:
                    del keys[ki]
        mp.idx_last_check = S
        mp.size_last_begin = S

    # ------------------------------------------------------------------------------------------ draft
    def draft_one(self, seq_id: int, prompt: Sequence[int], id_last: int) -> list[int]:
        mp = self.maps[seq_id]
        n, m = self.size_n, self.size_m
        mp.last_draft_created = False
        mp.last_draft_key_idx = 0
        mp.last_draft_value_idx = 0
        L = len(prompt)
        if L < 2 * n + m:
            return []
        if L >= 2**32 or mp.idx_last_check > L or mp.size_last_begin > L:
            raise LlamaSpecError(
                f"ngram-map: history of {L} tokens is shorter than the one already indexed "
                f"(last check {mp.idx_last_check}, last begin {mp.size_last_begin}); call begin() first"
            )
        mp.idx_last_check = L
        arr = as_tokens(prompt)
        key = tail_key(arr, id_last, n)
        key_list = key.tolist()

        slb, last_idx = mp.size_last_begin, mp.key_map_last_idx
        top = L - n - m - 1
        # the two not-yet-indexed ranges: A = the prompt of the last begin, B = what came after it
        a_hi, a_lo = (slb - n - m - 1, last_idx + 1) if slb > n + m + 1 else (0, 1)
        b_hi, b_lo = top, max(slb, last_idx) + 1

        match_pos = 0
        k = int(mp.key_map[map_hash(key_list) % KEY_MAP_SIZE])
        if k != 0 and k < top and arr[k: k + n].tolist() == key_list:
            match_pos = k
        else:
            if slb > n + m + 1:
                j = last_match(arr, key, a_lo, a_hi)
                if j > 0:
                    match_pos = j
            if match_pos == 0:
                j = last_match(arr, key, b_lo, b_hi)
                if j > 0:
                    match_pos = j

        self._index(mp, arr, a_lo, a_hi, b_lo, b_hi)
        mp.key_map_last_idx = max(top, mp.key_map_last_idx)
        if match_pos == 0:
            return []

        keys = mp.keys
        rec_i = self._find_key(keys, arr, key)
        if rec_i < 0:
            keys.append(KeyRecord(match_pos, m))
            rec_i = len(keys) - 1
        rec = keys[rec_i]
        rec.key_num = min(rec.key_num + 1, MAX_COUNT)

        if self.key_only:
            slot = 0
            src = match_pos + n
        else:
            if rec.key_num < self.min_hits:
                return []
            self._count_values(rec, arr, key, match_pos)
            vals = rec.values
            slot, max_occ = 0, vals[0].value_num
            for v in range(1, MAX_VALUES):
                if vals[v].value_num > max_occ:
                    slot, max_occ = v, vals[v].value_num
            sum_other = sum(vals[v].value_num for v in range(MAX_VALUES) if v != slot)
            if sum_other > 0 and max_occ < 2 * sum_other:
                return []
            src = vals[slot].value_idx if self.fix_value_pos else match_pos + n
        cnt = min(m, rec.values[slot].n_accepted)
        if self.fix_accept_feedback and cnt <= 0:
            cnt = 1
        result = arr[src: src + max(cnt, 0)].tolist()
        mp.last_draft_created = True
        mp.last_draft_key_idx = rec_i
        mp.last_draft_value_idx = slot
        mp.last_draft_len = len(result)
        return result

    def _index(self, mp: MapState, arr: np.ndarray, a_lo: int, a_hi: int, b_lo: int, b_hi: int) -> None:
        """Insert-if-empty ``key_map[hash(window j)] = j`` for j over A descending, then B descending.

        Within one descending range the first insert into a slot is the one with the largest j, so a range
        is done at once: per slot the largest candidate j (``np.maximum.at``), written where the slot is
        still empty. A goes first, so B only fills what A left empty, as in the one-by-one loop.
        """
        n = self.size_n
        km = mp.key_map
        for lo, hi in ((a_lo, a_hi), (b_lo, b_hi)):
            if hi < lo:
                continue
            slots = (map_hash_range(arr, lo, hi, n) % np.uint32(KEY_MAP_SIZE)).astype(np.intp)
            jj = np.arange(lo, hi + 1, dtype=np.uint32)
            if slots.size <= 8:
                for s_, j_ in zip(slots[::-1].tolist(), jj[::-1].tolist()):
                    if km[s_] == 0:
                        km[s_] = j_
                continue
            best = np.zeros(KEY_MAP_SIZE, dtype=np.uint32)  # j >= 1, so 0 = no candidate
            np.maximum.at(best, slots, jj)
            win = best[slots] == jj
            s_win, j_win = slots[win], jj[win]
            empty = km[s_win] == 0
            km[s_win[empty]] = j_win[empty]

    def _find_key(self, keys: list[KeyRecord], arr: np.ndarray, key: np.ndarray) -> int:
        """Index of the first key record whose ``prompt[key_idx : key_idx+n]`` equals ``key``, or -1."""
        if not keys:
            return -1
        n = self.size_n
        kidx = np.fromiter((r.key_idx for r in keys), dtype=np.intp, count=len(keys))
        win = arr[kidx[:, None] + np.arange(n)]
        hit = np.flatnonzero((win == key).all(axis=1))
        return int(hit[0]) if hit.size else -1

    def _count_values(self, rec: KeyRecord, arr: np.ndarray, key: np.ndarray, match_pos: int) -> None:
        """map-k4v statistics over the occurrences of ``key`` in ``[stat_idx, match_pos]``."""
        n, m = self.size_n, self.size_m
        vals = rec.values
        for i in find_matches(arr, key, rec.stat_idx, match_pos).tolist():
            v_start = i + n
            cont = arr[v_start: v_start + m]
            for val in vals:
                if val.value_idx == 0:
                    val.value_idx, val.value_num, val.n_accepted = v_start, 0, m
                elif not np.array_equal(arr[val.value_idx: val.value_idx + m], cont):
                    continue
                val.value_num = min(val.value_num + 1, MAX_COUNT)
                break
        rec.stat_idx = match_pos + 1 if self.fix_stat_idx else match_pos

    # ----------------------------------------------------------------------------------------- accept
    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        if is_other:
            return
        mp = self.maps[seq_id]
        if not mp.last_draft_created:
            return
        if mp.last_draft_key_idx >= len(mp.keys):  # keys dropped by a begin() in between
            return
        val = mp.keys[mp.last_draft_key_idx].values[mp.last_draft_value_idx]
        if self.fix_accept_feedback and n_accepted > 0 and n_accepted >= mp.last_draft_len:
            val.n_accepted = min(self.size_m, 2 * n_accepted)
        else:
            val.n_accepted = n_accepted


class NgramMapK(NgramMap):
    """llama.cpp's ``ngram-map-k``: draft what followed the matched key (``min_hits`` unused)."""

    type = "ngram-map-k"
    key_only = True


class NgramMapK4V(NgramMap):
    """llama.cpp's ``ngram-map-k4v``: up to four values per key; draft only when one value dominates
    (``max_occ >= 2 * sum_other``) and the key was matched at least ``min_hits`` times."""

    type = "ngram-map-k4v"
    key_only = False
