"""What one slot's ``ngram-lookup`` drafts are worth beyond its match-length buckets (issue 25, the ``n4`` trace).

* **Calibration.** A slot's acceptance per match-length bucket is its own decayed counts shrunk toward the
  drafter-wide prior of that bucket, which every slot's drafts teach (:mod:`llamaspec.drafters.ngram_lookup`).
  That prior is an *average* slot's: four sampled choices of one prompt where three loop (each loop copy
  accepted whole) teach it ``q`` ~ 0.95 in every bucket, and the fourth, whose digits are sampled, then paid
  the loops' optimism in each bucket it reached (its own counts of a bucket start empty, and a draft whose
  first token fails says nothing about ``q``): 31-token drafts at 0-1 accepted, round after round.
  :class:`Calibration` keeps, per slot, the drafted tokens it saw verified and what the drafter-wide prior
  expected of them, and from these the slot's odds ratios against the average slot: of a first drafted
  token, and of a later one (the first tokens' ratio applies to later ones too -- a slot whose copies
  stopped being accepted is one whose later tokens, when the first passes by chance, fail too -- and the
  later tokens' own evidence corrects it once there is some). The prior of *every* bucket is moved by them
  on the odds scale before the slot's own counts of the bucket are added: its drafts shrink everywhere
  within a draft or two and grow back when they are accepted again, for sampled and greedy requests alike
  (the sums decay, so the ratios follow the text). On the odds scale a prior near 1 moves little for a mild
  ratio: a greedy copy whose short matches miss keeps pricing its long matches well.
* **Shared rounds.** A slot's draft rows are decoded together with every other generating slot's rows, and
  the round's time is shared by all their tokens: with ``B`` slots in the round, one slot's plain token costs
  ``v(B - 1) / B`` one-row decodes and its ``k`` draft rows add ``v(B - 1 + k) - v(B - 1)``. In units of
  its plain token, a draft of ``k`` costs :func:`shared_cost_table` ``[k]``; alone (``B = 1``) that is
  ``v(k)``. Priced as if alone, four busy slots on a CPU took a rejected row for a twentieth of a token
  where it costs about half of one.

>>> c = Calibration()
>>> c.prior(0.85, 0.95)                     # nothing seen: the drafter-wide prior
(0.85, 0.95)
>>> for _ in range(2):
...     c.update(k=31, n_acc=0, p1=0.95, q=0.98, decay=0.9)   # the first token fails where 95% pass
>>> [round(x, 2) for x in c.prior(0.85, 0.95)]   # another bucket's prior for this slot
[0.43, 0.72]
>>> for _ in range(3):
...     c.update(k=16, n_acc=16, p1=0.95, q=0.98, decay=0.9)  # copies accepted whole again
>>> [round(x, 2) for x in c.prior(0.85, 0.95)]
[0.68, 0.97]
>>> [round(x, 2) for x in shared_cost_table(lambda k: 1.0 + 0.1 * k, 3, 1)]
[1.0, 1.1, 1.2, 1.3]
>>> [round(x, 2) for x in shared_cost_table(lambda k: 1.0 + 0.1 * k, 3, 4)]   # 4 slots: a row costs 4 / v(3) ~ 3x as much
[1.0, 1.31, 1.62, 1.92]
"""
from __future__ import annotations

from typing import Callable

__all__ = ["BucketRates", "Calibration", "shared_cost_table", "CALIB_PSEUDO", "CALIB_MAX", "PRIOR_WEIGHT",
           "PRIOR_DECAY"]

#: a drafter-wide prior starts as this many drafts at its initial rates, and follows every slot's drafts with
#: this decay per draft (slowly)
PRIOR_WEIGHT = 4.0
PRIOR_DECAY = 0.98
#: pseudo-count of each of the odds ratio's four sums (a new slot's ratio is 1)
CALIB_PSEUDO = 1.0
#: the most a slot's odds ratio raises the prior (a slot that copies better than the average one)
CALIB_MAX = 1.5


class BucketRates:
    """Decayed acceptance counts per match-length bucket: of first drafted tokens (``p1_a`` accepted of
    ``p1_n`` tried) and of later ones (``q_a`` of ``q_n``). A slot's own copies, its pool drafts and the
    drafter-wide priors (those start at ``weight`` drafts of the rates ``p1`` and ``q``) each keep one.

    >>> r = BucketRates(2, p1=[0.5, 0.8], q=[0.9, 0.9], weight=4.0)
    >>> r.observe(1, k=4, n_acc=2, decay=0.98); [round(x, 3) for x in r.mean(1)]
    [0.841, 0.765]
    >>> [round(x, 3) for x in BucketRates(2).shrunk(0, (0.5, 0.9), w=2.0)]   # no counts: the prior
    [0.5, 0.9]
    """

    __slots__ = ("p1_n", "p1_a", "q_n", "q_a")

    def __init__(self, nb: int, p1: "list[float] | None" = None, q: "list[float] | None" = None, weight: float = 0.0):
        self.p1_n, self.q_n = [weight] * nb, [weight] * nb
        self.p1_a = [x * weight for x in p1] if p1 is not None else [0.0] * nb
        self.q_a = [x * weight for x in q] if q is not None else [0.0] * nb

    def observe(self, b: int, k: int, n_acc: int, decay: float) -> None:
        """A verified draft of ``k`` tokens in bucket ``b``, ``n_acc`` accepted."""
        self.p1_n[b] = self.p1_n[b] * decay + 1.0
        self.p1_a[b] = self.p1_a[b] * decay + (1.0 if n_acc > 0 else 0.0)
        if n_acc > 0 and k > 1:
            self.q_n[b] = self.q_n[b] * decay + (min(k, n_acc + 1) - 1)
            self.q_a[b] = self.q_a[b] * decay + (n_acc - 1)

    def mean(self, b: int) -> tuple[float, float]:
        """Bucket ``b``'s ``(p1, q)`` from the counts alone (a prior's: they never reach zero)."""
        return self.p1_a[b] / self.p1_n[b], self.q_a[b] / self.q_n[b]

    def shrunk(self, b: int, prior: tuple[float, float], w: float) -> tuple[float, float]:
        """Bucket ``b``'s ``(p1, q)``: the counts shrunk toward ``prior`` with weight ``w``."""
        return (self.p1_a[b] + w * prior[0]) / (self.p1_n[b] + w), (self.q_a[b] + w * prior[1]) / (self.q_n[b] + w)


def _shift(p: float, ratio: float) -> float:
    """``p`` with its odds multiplied by ``ratio``."""
    if p >= 1.0 or p <= 0.0 or ratio == 1.0:
        return p
    o = p / (1.0 - p) * ratio
    return o / (1.0 + o)


def _odds_ratio(n: float, o: float, e: float) -> float:
    """The odds of ``o`` accepted of ``n`` tried against those of the ``e`` expected, each sum with a
    pseudo-count (1 while nothing was seen)."""
    c = CALIB_PSEUDO
    return (o + c) / (n - o + c) * (max(n - e, 0.0) + c) / (e + c)


class Calibration:
    """One slot's (own copies' or pool drafts') verified draft tokens against the drafter-wide prior: decayed
    sums of first drafted tokens tried, accepted and expected accepted (``n1, o1, e1``), and the same of
    later tokens (``nq, oq, eq``; their expectation already moved by the first tokens' ratio, so their own
    ratio is what later tokens add to it). Module docstring."""

    __slots__ = ("n1", "o1", "e1", "nq", "oq", "eq")

    def __init__(self) -> None:
        self.n1 = self.o1 = self.e1 = self.nq = self.oq = self.eq = 0.0

    def update(self, k: int, n_acc: int, p1: float, q: float, decay: float) -> None:
        """A verified draft of ``k`` tokens, ``n_acc`` accepted (the tokens tried: up to the first rejected
        one); ``p1`` and ``q`` the drafter-wide prior of its bucket (what the average slot expected)."""
        if k <= 0:
            return
        later = min(k, n_acc + 1) - 1  # tokens tried after the first
        q = _shift(q, min(_odds_ratio(self.n1, self.o1, self.e1), CALIB_MAX))
        self.n1, self.o1, self.e1 = self.n1 * decay + 1.0, self.o1 * decay + (n_acc > 0), self.e1 * decay + p1
        self.nq = self.nq * decay + later
        self.oq = self.oq * decay + max(n_acc - 1, 0)
        self.eq = self.eq * decay + later * q

    def ratios(self) -> tuple[float, float]:
        """The slot's odds against the average slot's: of a first drafted token, of a later one."""
        r1 = _odds_ratio(self.n1, self.o1, self.e1)
        return min(r1, CALIB_MAX), min(r1 * _odds_ratio(self.nq, self.oq, self.eq), CALIB_MAX)

    def prior(self, p1: float, q: float) -> tuple[float, float]:
        """The drafter-wide prior ``(p1, q)`` of a bucket, moved by this slot's odds ratios."""
        r1, rq = self.ratios()
        return _shift(p1, r1), _shift(q, rq)


def shared_cost_table(verify_cost: Callable[[int], float], n_max: int, n_slots: int) -> list[float]:
    """``vt[k]``, ``k = 0..n_max``: a draft of ``k`` rows of one of ``n_slots`` slots decoded together, in units
    of that slot's plain token (``v(B - 1) / B`` one-row decodes): ``1 + B (v(B - 1 + k) - v(B - 1)) / v(B - 1)``;
    ``v(k)`` itself for one slot (module docstring)."""
    if n_slots <= 1:
        return [max(verify_cost(k), 1e-9) for k in range(n_max + 1)]
    b = n_slots
    v0 = max(verify_cost(b - 1), 1e-9)
    return [1.0 + b * (max(verify_cost(b - 1 + k), v0) - v0) / v0 for k in range(n_max + 1)]
