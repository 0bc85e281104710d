"""The shared n-gram pool of ``ngram-lookup``: drafts from every sequence the engine has seen.

A slot's own history (:mod:`llamaspec.drafters.ngram_lookup`) only knows the request it serves. Real traffic
repeats itself *across* requests: "regenerate", an agent loop that re-emits earlier tool calls and file
contents, ``n > 1`` choices, many users asking about one document. The pool keeps the token sequences of
earlier requests (prompt + committed output, *finished*) and of the ones running now (*live*, growing as they
commit), and ``ngram-lookup`` looks the current suffix up in it as well: when the pool has an earlier
occurrence that matches longer than anything in the slot's own history, the draft is what followed it there.

* **Index.** One hash map per key length in :data:`POOL_KEYS` (a few, not every length: memory) from the
  rolling hash of the key to ``uid << 32 | end`` (a sequence id and the key's last position), the most recent
  occurrence, plus the one before it from another sequence (so a slot's own live sequence, which it already
  searches itself, never hides another's). Keys are verified token by token on use and the match extended
  backwards up to ``MATCH_CAP`` tokens, as the slot's own lookup does.
* **Isolation.** Every sequence has an owner (the server's tenant: a hash of the API key; ``""`` without
  one); the owner is folded into the hash and checked on use, so a slot drafts only from its own tenant's
  sequences unless the pool is ``shared`` (``--spec-pool-shared``).
* **Memory.** Finished sequences are kept while their tokens fit ``budget``; past it the oldest finished
  ones go first (FIFO, a sequence a draft was accepted from moves to the back: LRU) and their index entries
  with them, so the index never holds more than ``len(POOL_KEYS)`` x 2 entries per token held. Live
  sequences are bounded by the context. Tokens are stored as 32-bit ints.
* **Length.** :class:`PoolDrafting` keeps the slot's acceptance counts of pool drafts apart from its own
  copies (a poor pool does not make own copies shorter) and a drafter-wide prior of its own, moved per slot
  by what its pool drafts earned against it (:class:`~llamaspec.drafters.ngram_rates.Calibration`); the length
  rule is ``ngram-lookup``'s (match-length buckets, expected gain per unit cost).

>>> pool = SharedPool(budget=100)
>>> a = pool.open("", [1, 2, 3, 4, 5, 6, 7, 8, 9])
>>> pool.close(a)
>>> uid, e, m = pool.lookup("", [0, 3, 4, 5], 6, exclude=-1, min_m=0)
>>> pool.copy(uid, e, 3), m
([7, 8, 9], 4)
>>> pool.lookup("other", [0, 3, 4, 5], 6, exclude=-1, min_m=0) is None     # another tenant's text
True
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Sequence

import numpy as np

from ._ngram_util import HASH_MUL, MASK64, MATCH_CAP
from .ngram_rates import PRIOR_DECAY, PRIOR_WEIGHT, BucketRates, Calibration

__all__ = ["SharedPool", "PoolDrafting", "POOL_KEYS", "owner_salt"]

#: the key lengths indexed, longest first (a long key finds the real repeat; a short one finds a copy early)
POOL_KEYS = (12, 4)
_LOW = 0xFFFFFFFF


def owner_salt(owner: str) -> int:
    """The 64-bit salt an owner folds into its keys (0 for ``""``).

    >>> owner_salt(""), owner_salt("a") == owner_salt("a"), owner_salt("a") == owner_salt("b")
    (0, True, False)
    """
    if not owner:
        return 0
    return int.from_bytes(hashlib.blake2b(owner.encode("utf-8"), digest_size=8).digest(), "little")


class _Seq:
    __slots__ = ("uid", "owner", "salt", "toks", "live")

    def __init__(self, uid: int, owner: str, salt: int):
        self.uid, self.owner, self.salt = uid, owner, salt
        self.toks = array("i")
        self.live = True


class SharedPool:
    """Token sequences of every request, indexed by a few key lengths (module docstring).

    ``budget``: tokens of finished sequences kept (live ones come on top, bounded by the context);
    ``shared``: every owner drafts from everyone's sequences.
    """

    def __init__(self, budget: int, shared: bool = False, keys: Sequence[int] = POOL_KEYS):
        if budget < 0:
            raise ValueError(f"the pool budget must be >= 0 tokens, got {budget}")
        self.budget, self.shared = int(budget), bool(shared)
        self.keys = tuple(sorted({int(k) for k in keys}, reverse=True))
        self.seqs: dict[int, _Seq] = {}
        self.finished: OrderedDict[int, int] = OrderedDict()  # uid -> tokens, oldest first
        self.n_finished_tokens = 0
        self.idx: list[dict[int, int]] = [dict() for _ in self.keys]
        self.idx2: list[dict[int, int]] = [dict() for _ in self.keys]
        self._next_uid = 0
        self.n_evicted = 0

    # -- sequences ----------------------------------------------------------------------------------
    def open(self, owner: str, tokens: Sequence[int] = ()) -> int:
        """A new live sequence of ``owner``; returns its uid."""
        self._next_uid += 1
        uid = self._next_uid
        self.seqs[uid] = _Seq(uid, owner, 0 if self.shared else owner_salt(owner))
        if tokens:
            self.extend(uid, tokens)
        return uid

    def extend(self, uid: int, tokens: Sequence[int]) -> None:
        """Append committed tokens to live sequence ``uid`` and index the keys they end."""
        seq = self.seqs.get(uid)
        if seq is None or not tokens:
            return
        start = len(seq.toks)
        seq.toks.extend(int(t) for t in tokens)
        self._index(seq, start)

    def close(self, uid: int) -> None:
        """Live sequence ``uid`` is finished: it stays while the budget allows (oldest go first)."""
        seq = self.seqs.get(uid)
        if seq is None or not seq.live:
            return
        seq.live = False
        if not seq.toks:
            del self.seqs[uid]
            return
        self.finished[uid] = len(seq.toks)
        self.n_finished_tokens += len(seq.toks)
        self._evict()

    def clear(self) -> None:
        """Forget every sequence (live ones too: their slots open new ones at their next draft)."""
        self.__init__(self.budget, self.shared, self.keys)

    def touch(self, uid: int) -> None:
        """A draft from ``uid`` paid: it is evicted last (LRU)."""
        if uid in self.finished:
            self.finished.move_to_end(uid)

    def _evict(self) -> None:
        while self.n_finished_tokens > self.budget and self.finished:
            uid, n = self.finished.popitem(last=False)
            self.n_finished_tokens -= n
            self._unindex(self.seqs.pop(uid))
            self.n_evicted += 1

    # -- index ----------------------------------------------------------------------------------------
    def _hashes(self, seq: _Seq, K: int, lo: int) -> list[int]:
        """Hashes of the keys of length K ending at ``lo..len-1`` (oldest token folded first)."""
        n = len(seq.toks)
        count = n - lo
        if count <= 0:
            return []
        if count <= 16:  # a round's few committed tokens: plain Python beats numpy's per-call cost
            toks, out = seq.toks, []
            for e in range(lo, n):
                h = seq.salt
                for t in toks[e - K + 1: e + 1]:
                    h = (h * HASH_MUL + t + 1) & MASK64
                out.append(h)
            return out
        arr = np.frombuffer(seq.toks, dtype=np.int32)[lo - K + 1: n].astype(np.uint64) + np.uint64(1)
        h = np.full(count, seq.salt, dtype=np.uint64)
        mul = np.uint64(HASH_MUL)
        with np.errstate(over="ignore"):
            for j in range(K):
                h = h * mul + arr[j: j + count]
        return h.tolist()

    def _index(self, seq: _Seq, start: int) -> None:
        uid = seq.uid
        for ki, K in enumerate(self.keys):
            lo = max(start, K - 1)
            idx, idx2 = self.idx[ki], self.idx2[ki]
            base = uid << 32
            for e, h in enumerate(self._hashes(seq, K, lo), lo):
                old = idx.get(h)
                if old is not None and old >> 32 != uid:
                    idx2[h] = old
                idx[h] = base | e

    def _unindex(self, seq: _Seq) -> None:
        base = seq.uid << 32
        for ki, K in enumerate(self.keys):
            idx, idx2 = self.idx[ki], self.idx2[ki]
            for e, h in enumerate(self._hashes(seq, K, K - 1), K - 1):
                v = base | e
                if idx.get(h) == v:
                    prev = idx2.pop(h, None)
                    if prev is None:
                        del idx[h]
                    else:
                        idx[h] = prev
                elif idx2.get(h) == v:
                    del idx2[h]

    # -- lookup ---------------------------------------------------------------------------------------
    def lookup(self, owner: str, toks: Sequence[int], id_last: int, exclude: int, min_m: int):
        """``(uid, end, length)`` of an occurrence of the suffix ``toks + [id_last]`` in a sequence of
        ``owner`` (any owner when shared) other than ``exclude``, verified and extended backwards, longer
        than ``min_m`` and followed by at least one token; None when there is none."""
        n = len(toks)
        salt = 0 if self.shared else owner_salt(owner)
        for ki, K in enumerate(self.keys):
            if n + 1 < K or K <= min_m:
                continue
            h = salt
            for t in toks[n - K + 1:]:
                h = (h * HASH_MUL + t + 1) & MASK64
            h = (h * HASH_MUL + id_last + 1) & MASK64
            for d in (self.idx[ki], self.idx2[ki]):
                v = d.get(h)
                if v is None or v >> 32 == exclude:
                    continue
                seq = self.seqs.get(v >> 32)
                if seq is None or (not self.shared and seq.owner != owner):
                    continue
                st, e = seq.toks, v & _LOW
                if e + 1 >= len(st) or st[e] != id_last:
                    continue
                m, lim = 1, min(MATCH_CAP, e + 1, n + 1)
                while m < lim and st[e - m] == toks[n - m]:
                    m += 1
                if m >= min(K, lim) and m > min_m:
                    return seq.uid, e, m
        return None

    def copy(self, uid: int, e: int, k: int) -> list[int]:
        """Up to ``k`` tokens of what followed position ``e`` of sequence ``uid``."""
        seq = self.seqs.get(uid)
        return [] if seq is None else seq.toks[e + 1: e + 1 + k].tolist()

    # -- accounting -----------------------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        """Tokens held (finished + live)."""
        return sum(len(s.toks) for s in self.seqs.values())

    @property
    def n_entries(self) -> int:
        """Index entries held (at most ``2 * len(keys)`` per token held)."""
        return sum(len(d) for d in self.idx) + sum(len(d) for d in self.idx2)

    def info(self) -> dict:
        return {"budget": self.budget, "shared": self.shared, "n_seqs": len(self.seqs),
                "n_finished_tokens": self.n_finished_tokens, "n_tokens": self.n_tokens,
                "n_entries": self.n_entries, "n_evicted": self.n_evicted}


class _Cursor:
    """One slot's place in the pool: its live sequence, what of its history is in it, its counts."""

    __slots__ = ("uid", "ref", "n", "owner", "counts", "last_uid", "cal")

    def __init__(self, nb: int, owner: str = ""):
        self.uid, self.ref, self.n, self.owner = -1, None, 0, owner
        self.counts = BucketRates(nb)  # the acceptance of its pool drafts per bucket
        self.last_uid = -1
        self.cal = Calibration()


class PoolDrafting:
    """``ngram-lookup``'s side of the pool: per slot, the live sequence kept in step with the slot's
    history, the lookup that excludes it, and the acceptance counts of pool drafts (module docstring)."""

    def __init__(self, n_seq: int, pool: SharedPool, prior_p1: Sequence[float], prior_q: Sequence[float]):
        self.pool = pool
        self.nb = len(prior_p1)
        self.cur = [_Cursor(self.nb) for _ in range(n_seq)]
        self._prior0 = (list(prior_p1), list(prior_q))
        self._prior = BucketRates(self.nb, *self._prior0, PRIOR_WEIGHT)
        #: draft rounds from the pool, and the pool-drafted tokens accepted
        self.n_drafts = 0
        self.n_accepted = 0

    def set_owner(self, seq_id: int, owner: str) -> None:
        self.cur[seq_id].owner = owner or ""

    def clear(self) -> None:
        """An empty pool, every slot's pool counts and the pool-wide prior as at the start (benchmarks of
        prompts never seen: ``llamaspec bench`` clears it before each run)."""
        self.pool.clear()
        self.cur = [_Cursor(self.nb, c.owner) for c in self.cur]
        self._prior = BucketRates(self.nb, *self._prior0, PRIOR_WEIGHT)

    def begin(self, seq_id: int, toks: list[int]) -> None:
        """A new request on the slot: the last one's sequence is finished, the new one is live; the counts
        start again from the pool-wide prior."""
        owner = self.cur[seq_id].owner
        self.end(seq_id)
        c = self.cur[seq_id] = _Cursor(self.nb, owner)
        c.uid, c.ref, c.n = self.pool.open(owner, toks), toks, len(toks)

    def end(self, seq_id: int) -> None:
        c = self.cur[seq_id]
        if c.uid >= 0:
            self.pool.close(c.uid)
        c.uid, c.ref, c.n, c.last_uid = -1, None, 0, -1

    def sync(self, seq_id: int, toks: list[int]) -> None:
        """Bring the live sequence up to the slot's history ``toks`` (the drafter's own list: appended to in
        place, replaced when the history changed under it)."""
        c = self.cur[seq_id]
        c.last_uid = -1
        if c.uid >= 0 and c.ref is toks and len(toks) >= c.n:
            if len(toks) > c.n:
                self.pool.extend(c.uid, toks[c.n:])
                c.n = len(toks)
            return
        if c.uid >= 0:
            self.pool.close(c.uid)
        c.uid, c.ref, c.n = self.pool.open(c.owner, toks), toks, len(toks)

    def match(self, seq_id: int, toks: Sequence[int], id_last: int, m_own: int):
        c = self.cur[seq_id]
        return self.pool.lookup(c.owner, toks, id_last, c.uid, m_own)

    def rates(self, seq_id: int, b: int, w: float) -> tuple[float, float]:
        c = self.cur[seq_id]
        return c.counts.shrunk(b, c.cal.prior(*self._prior.mean(b)), w)

    def copy(self, seq_id: int, hit, k: int) -> list[int]:
        """The draft from ``hit`` (``lookup``'s answer); remembers it for :meth:`accept`."""
        out = self.pool.copy(hit[0], hit[1], k)
        if out:
            self.cur[seq_id].last_uid = hit[0]
            self.n_drafts += 1
        return out

    def accept(self, seq_id: int, b: int, k: int, n_acc: int, decay: float) -> bool:
        """Feedback on the slot's last draft: True (counted here) when it came from the pool."""
        c = self.cur[seq_id]
        uid, c.last_uid = c.last_uid, -1
        if uid < 0:
            return False
        self.n_accepted += n_acc
        if n_acc > 0:
            self.pool.touch(uid)
        c.cal.update(k, n_acc, *self._prior.mean(b), decay)
        c.counts.observe(b, k, n_acc, decay)
        self._prior.observe(b, k, n_acc, PRIOR_DECAY)
        return True
